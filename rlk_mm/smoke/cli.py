"""The `smoke` sub-command of `rlk-mm`, and `python -m rlk_mm.smoke`."""

from __future__ import annotations

import argparse

from .options import add_arguments, parse_args
from .train import run_smoke


def add_smoke_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `smoke` sub-command to an argparse sub-parser set."""
    p = subparsers.add_parser(
        "smoke",
        help="image-text GRPO smoke test: gates (layout, log-probs, masking, ratio) then training",
        description="Prove layout and log-prob parity and loss masking, then train a tiny Qwen2.5-VL with GRPO and check it learns.",
    )
    add_arguments(p)
    p.set_defaults(func=run_smoke)
    return p


def main(argv=None) -> int:
    """`python -m rlk_mm.smoke [options]`: run the smoke test; the exit code."""
    return run_smoke(parse_args(argv))
