"""The ``rlk-mm`` command: smoke | parity | inspect | invariance.

Exit codes (``rlk_mm.command``): 0 ok; 1 the documented negative result (layout mismatch,
not invariant, a smoke gate or the learning check failed); 2 bad input or usage; 3 an
internal error (one line; ``--debug`` prints the traceback).

The command line is parsed before anything heavy is imported: only the chosen sub-command's
parser is built in full (``smoke``'s imports the smoke test), and each command imports what it
runs. Long commands draw a progress bar with an ETA on stderr (``rlk_mm.progress``).
"""

from __future__ import annotations

import argparse
import sys

from . import command
from .command import UsageError
from .progress import Progress, add_progress_flags, progress_wanted

__all__ = ["main"]

#: the sub-commands, in the order the help lists them
COMMANDS = ("inspect", "parity", "invariance", "smoke")


def _load(path: str):
    from .schema import RLBatch

    return RLBatch.load(path)


def _inspect(args) -> int:
    batch = _load(args.file)
    print(batch.summary(max_rows=args.max_rows))
    if args.png:
        from .viz import draw_layout

        print(f"layout picture: {draw_layout(batch, args.png)}")
    return command.OK


def _processor(model_path):
    """The Qwen-VL processor of ``model_path``, or the bundled offline one (None)."""
    from .fixtures import qwen_vl_processor

    if model_path is None:
        return qwen_vl_processor()
    try:
        return qwen_vl_processor(model_path)
    except Exception as e:  # noqa: BLE001 (transformers raises many kinds for a folder it cannot read)
        raise UsageError(f"--model-path {model_path}: cannot load a Qwen-VL processor there "
                         f"({type(e).__name__}: {e})") from e


def _decoder(model_path, batches):
    """(tokenizer, note): the tokenizer that decodes context tokens, and what the output says
    of it. The bundled offline Qwen tokenizer unless ``--model-path`` names another, and only
    for batches whose image/video token ids it shares (else ids are shown as numbers)."""
    tokenizer = _processor(model_path).tokenizer
    if model_path is not None:
        return tokenizer, f"context decoded with the tokenizer of {model_path}"
    ids = {"image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
           "video_token_id": tokenizer.convert_tokens_to_ids("<|video_pad|>")}
    if any(getattr(b, name) not in (None, want) for b in batches for name, want in ids.items()):
        return None, "context shown as token ids: the batches' image/video token ids are not the bundled Qwen " \
                     "tokenizer's; " \
                     "--model-path DIR decodes with your model's"
    return tokenizer, ("context decoded with the bundled offline Qwen tokenizer; "
                       "--model-path DIR decodes with your model's")


def _bar(args, total: int, label: str) -> Progress:
    return Progress(total, label, enabled=progress_wanted(args.quiet, args.progress))


def _parity(args) -> int:
    with _bar(args, 3, "rlk-mm parity") as bar:
        from .parity import check_layout_parity

        rollout, training = _load(args.rollout), _load(args.training)
        bar.update(note="batches loaded")
        tokenizer, note = _decoder(args.model_path, (rollout, training))
        bar.update(note="tokenizer loaded")
        report = check_layout_parity(rollout, training, tokenizer=tokenizer)
        bar.update(note="compared")
    if args.json:
        print(report.to_json(indent=2))
    else:
        print(report if report.ok else f"{report}\n({note})")
    return command.OK if report.ok else command.NEGATIVE


#: the invariance sweep's cases, ``rlk_mm.parity.invariance.CASES``' names (a test keeps them equal), held here
#: so that the parser imports no torch
INVARIANCE_CASES = ("batch_size", "position", "padding_side", "packed", "neighbour_images", "processor_cache",
                    "vision_cache", "prefix_cache", "group_cache", "decode", "video_frames")


def _add_invariance_parser(sub) -> None:
    p = sub.add_parser("invariance", help=HELP["invariance"])
    p.add_argument("--model-path", type=command.folder,
                   help="local Qwen2.5-VL model directory (default: the tiny random-weight model)")
    p.add_argument("--samples", type=command.int_at_least(2), default=4,
                   help="number of synthetic image-text samples (>= 2; default 4)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic samples, their responses and the tiny model's weights (default 0)")
    p.add_argument("--cases", nargs="+", choices=INVARIANCE_CASES, metavar="CASE",
                   help=f"cases to run (default: all): {', '.join(INVARIANCE_CASES)}")
    p.add_argument("--backend", choices=["torch", "triton"],
                   help="kernels inside batch_invariant() (default: Triton on CUDA, torch on CPU)")
    p.add_argument("--score", choices=["logprob", "hidden"], default="logprob",
                   help="what must be bitwise: the selected log-probs through the LM head (logprob, the default) or "
                        "the hidden states that feed it (hidden)")
    p.add_argument("--response-length", type=command.int_at_least(1), default=8,
                   help="tokens in each sample's seeded random response, EOS included (>= 1; default 8)")
    p.add_argument("--group-size", type=command.int_at_least(1), default=4,
                   help="responses in the GRPO group that the vision_cache and group_cache cases score (>= 1; "
                        "default 4)")
    p.add_argument("--device", type=command.device, help="cpu, cuda or cuda:N (default: cuda when there is one)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the model's dtype (default float32)")
    p.add_argument("--no-control", action="store_true", help="skip the run without batch_invariant()")
    p.add_argument("--json", type=command.output_file, help="write the report as JSON here")
    p.add_argument("--png", type=command.image_file, help="draw the 'where drift starts' chart here")
    add_progress_flags(p)
    command.add_debug_flag(p)
    p.set_defaults(func=_invariance)


def _invariance(args) -> int:
    """Exit 0 when every case is bitwise under batch_invariant(), else 1."""
    from .parity.invariance import CASES

    runs = len(args.cases or CASES) * (1 if args.no_control else 2)
    with _bar(args, 1 + runs, "rlk-mm invariance") as bar:
        report = _sweep(args, bar)
    print(report.table())
    if args.json:
        report.save_json(args.json)
    if args.png:
        report.save_png(args.png)
    return command.OK if report.invariant else command.NEGATIVE


def _sweep(args, bar: Progress):
    """The invariance report of ``args``' model and samples; ``bar`` moves once the model is loaded, then per case."""
    import torch

    from . import fixtures
    from .parity.invariance import invariance_sweep

    processor = _processor(args.model_path)
    if args.model_path:
        from transformers import Qwen2_5_VLForConditionalGeneration

        try:
            model = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.model_path, attn_implementation="sdpa")
        except Exception as e:  # noqa: BLE001 (transformers raises many kinds for a folder it cannot read)
            raise UsageError(f"--model-path {args.model_path}: cannot load a Qwen2.5-VL model there "
                             f"({type(e).__name__}: {e})") from e
    else:
        model = fixtures.tiny_qwen2_5_vl(args.seed)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device=device, dtype=getattr(torch, args.dtype)).eval()
    samples = fixtures.synthetic_image_text(args.samples, args.seed)
    bar.update(note="model loaded")

    def progress(done: int, total: int, what: str) -> None:
        bar.update(1 + done, note=what)

    return invariance_sweep(model, processor, samples, cases=args.cases, control=not args.no_control,
                            backend=args.backend, score=args.score, response_length=args.response_length,
                            group_size=args.group_size, seed=args.seed, progress=progress)


#: each sub-command's line in ``rlk-mm --help``
HELP = {
    "inspect": "print a saved batch's per-sample layout table (and draw it)",
    "parity": "check that two saved batches share a token layout (exit 0 match, 1 mismatch, 2 bad input)",
    "invariance": "bitwise invariance sweep of selected log-probs (batching, padding, packing, caches)",
    "smoke": ("GRPO smoke test on a tiny Qwen2.5-VL: gates (layout, log-probs, masking, ratio), then training; "
              "'rlk-mm smoke --help' lists its tasks; '--steps 1 --warmup-steps 0' runs the gates only"),
}


def _add_inspect_parser(sub) -> None:
    p = sub.add_parser("inspect", help=HELP["inspect"])
    p.add_argument("file", help="a batch saved with RLBatch.save (.safetensors)")
    p.add_argument("--png", type=command.image_file, help="also draw each sample's spans to this PNG")
    p.add_argument("--max-rows", type=command.int_at_least(0), default=32,
                   help="samples shown in the table (default 32)")
    command.add_debug_flag(p)
    p.set_defaults(func=_inspect)


def _add_parity_parser(sub) -> None:
    p = sub.add_parser("parity", help=HELP["parity"])
    p.add_argument("rollout", help="the rollout side's batch, saved with RLBatch.save (.safetensors)")
    p.add_argument("training", help="the training side's batch of the same samples, saved with RLBatch.save")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--model-path", type=command.folder,
                   help=("a local Qwen-VL model dir whose tokenizer decodes context tokens "
                         "(default: the bundled offline Qwen tokenizer)"))
    add_progress_flags(p)
    command.add_debug_flag(p)
    p.set_defaults(func=_parity)


def _add_smoke_parser(sub) -> None:
    from .smoke import add_smoke_parser

    add_smoke_parser(sub)


BUILDERS = {"inspect": _add_inspect_parser, "parity": _add_parity_parser, "invariance": _add_invariance_parser,
            "smoke": _add_smoke_parser}


def _chosen(argv) -> str | None:
    """The sub-command ``argv`` names: its first word that is not an option (the top level has flags only)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _build_parser(argv=None) -> argparse.ArgumentParser:
    """The parser; only the sub-command ``argv`` names is built in full (the others are a help line each)."""
    parser = argparse.ArgumentParser(
        prog="rlk-mm", description="Multimodal RL operators: layout parity, smoke test, inspection.",
        epilog="exit codes: 0 ok, 1 mismatch / not invariant / check failed, 2 bad input or usage, 3 internal error",
    )
    command.add_debug_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of these; 'rlk-mm COMMAND --help' lists its options")
    chosen = _chosen(sys.argv[1:] if argv is None else argv)
    for name in COMMANDS:
        if name == chosen:
            BUILDERS[name](sub)
        else:
            sub.add_parser(name, help=HELP[name], add_help=False)
    return parser


def main(argv=None) -> int:
    """Run ``rlk-mm`` with ``argv`` (default: the command line); the exit code."""
    return command.main(_build_parser(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
