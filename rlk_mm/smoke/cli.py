"""The `smoke` sub-command of `rlk-mm`, and `python -m rlk_mm.smoke`. Exit codes: 0 passed,
1 a gate or the learning check failed, 2 bad arguments, 3 an internal error (`rlk_mm.command`)."""

from __future__ import annotations

import argparse

from .. import command
from .options import add_arguments, check_args, parser, resolve_task_settings

__all__ = ["add_smoke_parser", "main"]


def add_smoke_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `smoke` sub-command to an argparse sub-parser set."""
    p = subparsers.add_parser(
        "smoke",
        help="GRPO smoke test (--task colour, geo3k or video-direction): gates (layout, log-probs, masking, ratio) then training",
        description="Prove layout and log-prob parity and loss masking, then train a tiny Qwen2.5-VL with GRPO and check it learns.",
    )
    add_arguments(p)
    p.set_defaults(func=_run)
    return p


def _run(args) -> int:
    from .train import run_smoke  # torch and the model: imported only to run (the parser answers --help without)

    check_args(resolve_task_settings(args))
    return run_smoke(args)


def main(argv=None) -> int:
    """`python -m rlk_mm.smoke [options]`: run the smoke test; the exit code."""
    p = parser()
    p.set_defaults(func=_run)
    return command.main(p, argv)
