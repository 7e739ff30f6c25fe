"""The smoke test's options: their argparse definitions, `parse_args`, and `to_argv`
(options back to command-line words, for the report)."""

from __future__ import annotations

import argparse


BREAKS = ("loss-shift", "adv-sign", "image-swap")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="a Geo3K folder (problems.jsonl + images), e.g. ../shared/geo3k; default: the colour task")
    p.add_argument("--model-path", help="a local Qwen2.5-VL checkpoint directory; default: a tiny random Qwen2.5-VL")
    p.add_argument("--steps", type=int, default=250, help="GRPO steps (default 250)")
    p.add_argument("--seed", type=int, default=0, help="seed of data, weights and sampling (default 0)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (Triton kernels on cuda; default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="model dtype (default float32)")
    p.add_argument("--out", default="smoke_out", help="output directory (default smoke_out/)")
    p.add_argument("--break", dest="break_mode", choices=BREAKS, help="inject a known bug to see the gates or the learning check catch it")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (default 16)")
    p.add_argument("--samples", type=int, default=4, help="answers per prompt, the GRPO group size (default 4)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts, also used to score them (default 1.0)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak Adam learning rate of the GRPO steps (default 3e-3; see --lr-warmup-steps and LR_FLOOR)")
    p.add_argument("--lr-warmup-steps", type=int, default=40, help="GRPO steps over which the learning rate ramps up linearly (default 40)")
    p.add_argument("--kl-coef", type=float, default=0.01, help="weight of the k3 KL to the warm-up policy (default 0.01)")
    p.add_argument("--warmup-steps", type=int, default=40, help="supervised warm-up steps with shuffled labels (default 40)")
    p.add_argument("--warmup-lr", type=float, default=2e-3, help="Adam learning rate of the warm-up (default 2e-3)")
    p.add_argument("--quiet", action="store_true", help="print nothing (the report is still written)")


def to_argv(args) -> list[str]:
    """The smoke options of `args` as command-line words (for the report and re-execution)."""
    words = []
    defaults = vars(parse_args([]))
    for key, value in vars(args).items():
        if key == "func" or key not in defaults or value == defaults[key]:
            continue
        flag = "--break" if key == "break_mode" else "--" + key.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    return words


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlk-mm smoke")
    add_arguments(p)
    return p.parse_args(argv)
