"""The ``rlk-mm`` command: smoke | parity | inspect | invariance."""

from __future__ import annotations

import argparse
import sys


def _load(path: str):
    from .schema import RLBatch

    return RLBatch.load(path)


def _inspect(args) -> int:
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


def _parity(args) -> int:
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


def _add_invariance_parser(sub) -> None:
    import torch

    from .parity.invariance import CASES

    p = sub.add_parser("invariance", help="bitwise invariance sweep of selected log-probs (batching, padding, packing, caches)")
    p.add_argument("--model-path", help="local Qwen2.5-VL model directory (default: the tiny random-weight model)")
    p.add_argument("--samples", type=int, default=4, help="number of synthetic image-text samples (>= 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", nargs="+", choices=list(CASES), help="cases to run (default: all)")
    p.add_argument("--backend", choices=["torch", "triton"], help="kernels inside batch_invariant() (default: Triton on CUDA, torch on CPU)")
    p.add_argument("--score", choices=["logprob", "hidden"], default="logprob")
    p.add_argument("--response-length", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--no-control", action="store_true", help="skip the run without batch_invariant()")
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--png", help="draw the 'where drift starts' chart here")
    p.set_defaults(func=_invariance)


def _invariance(args) -> int:
    """Exit 0 when every case is bitwise under batch_invariant(), else 1."""
    import torch

    from . import fixtures
    from .parity.invariance import invariance_sweep

    processor = fixtures.qwen_vl_processor(args.model_path)
    if args.model_path:
        from transformers import Qwen2_5_VLForConditionalGeneration

        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.model_path, attn_implementation="sdpa")
    else:
        model = fixtures.tiny_qwen2_5_vl(args.seed)
    model = model.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    samples = fixtures.synthetic_image_text(args.samples, args.seed)
    report = invariance_sweep(model, processor, samples, cases=args.cases, control=not args.no_control,
                              backend=args.backend, score=args.score, response_length=args.response_length,
                              group_size=args.group_size)
    print(report.table())
    if args.json:
        report.save_json(args.json)
    if args.png:
        report.save_png(args.png)
    return 0 if report.invariant else 1


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlk-mm", description="Multimodal RL operators: layout parity, smoke test, inspection.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="print a saved batch's per-sample layout table (and draw it)")
    p.add_argument("file", help="a batch saved with RLBatch.save (.safetensors)")
    p.add_argument("--png", help="also draw each sample's spans to this PNG")
    p.add_argument("--max-rows", type=int, default=32, help="samples shown in the table (default 32)")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("parity", help="check that two saved batches share a token layout (exit 0 match, 1 mismatch, 2 unreadable)")
    p.add_argument("rollout")
    p.add_argument("training")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--model-path", help="a local Qwen-VL model dir, to decode context tokens")
    p.set_defaults(func=_parity)

    _add_invariance_parser(sub)
    from .smoke import add_smoke_parser

    add_smoke_parser(sub)
    return parser


def main(argv=None) -> int:
    args = _build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
