"""The ``rlk-mm`` command: smoke | parity | inspect | invariance."""

from __future__ import annotations

import argparse
import sys


def _load(path: str):
    from .schema import RLBatch

    return RLBatch.load(path)


def cmd_inspect(args) -> int:
    from .schema import SchemaError

    try:
        batch = _load(args.file)
    except SchemaError as e:
        print(f"rlk-mm inspect: {e}", file=sys.stderr)
        return 2
    print(batch.summary(max_rows=args.max_rows))
    if args.png:
        from .viz import draw_layout

        print(f"layout picture: {draw_layout(batch, args.png)}")
    return 0


def cmd_parity(args) -> int:
    from .parity import check_layout_parity
    from .schema import SchemaError

    try:
        rollout, training = _load(args.rollout), _load(args.training)
    except SchemaError as e:
        print(f"rlk-mm parity: {e}", file=sys.stderr)
        return 2
    tokenizer = None
    if args.model_path:
        from .fixtures import qwen_vl_processor

        tokenizer = qwen_vl_processor(args.model_path).tokenizer
    report = check_layout_parity(rollout, training, tokenizer=tokenizer)
    print(report.to_json(indent=2) if args.json else str(report))
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlk-mm", description="Multimodal RL operators: layout parity, smoke test, inspection.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="print a saved batch's per-sample layout table (and draw it)")
    p.add_argument("file", help="a batch saved with RLBatch.save (.safetensors)")
    p.add_argument("--png", help="also draw each sample's spans to this PNG")
    p.add_argument("--max-rows", type=int, default=32, help="samples shown in the table (default 32)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("parity", help="check that two saved batches share a token layout (exit 0 match, 1 mismatch, 2 unreadable)")
    p.add_argument("rollout")
    p.add_argument("training")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--model-path", help="a local Qwen-VL model dir, to decode context tokens")
    p.set_defaults(func=cmd_parity)

    try:
        from .smoke import add_smoke_parser
    except ImportError:
        add_smoke_parser = None
    if add_smoke_parser is not None:
        add_smoke_parser(sub)
    try:
        from .parity.invariance import add_invariance_parser
    except ImportError:
        add_invariance_parser = None
    if add_invariance_parser is not None:
        add_invariance_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
