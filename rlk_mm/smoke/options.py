"""The smoke test's options: their argparse definitions (bad values refused at parse time:
exit 2), the checks across options, `parse_args`, and `to_argv` (options back to
command-line words, for the report). Standard library and ``task_settings`` only: building the
parser imports no torch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import command
from ..command import UsageError
from .task_settings import DATA_TASKS, TASK_NAMES, TASK_SETTINGS

__all__ = ["parse_args"]

MIN_TEMPERATURE = 1e-5
"""``rlk_mm.schema.checks.MIN_TEMPERATURE`` (a test keeps them equal), held here so that the parser
imports no schema (pydantic, torch): ``rlk-mm smoke --help`` answers at once."""

BREAKS = ("loss-shift", "adv-sign", "image-swap")
LR_FLOOR = 0.1
"""The learning rate decays (cosine) to this fraction of `--lr` at the last GRPO step (`--lr-floor`)."""
OPTION_DEFAULTS = {"steps": 170, "temperature": 0.75, "lr": 3e-3, "lr_warmup_steps": 40, "lr_floor": LR_FLOOR,
                   "warmup_steps": 40}
"""The defaults of the options a task may set otherwise (``task_settings.TASK_SETTINGS``): they parse as
None and ``resolve_task_settings`` fills them in."""
IMAGE_SWAP_MIN_PROMPTS = 5
"""With 5 or more prompts, the 4 first-image sizes force two same-size images in different groups."""


def control_report(text: str) -> str:
    """An argparse type: an existing smoke_report.json with per-step records (``--control``)."""
    try:
        steps = json.loads(Path(text).read_text()).get("steps")
    except (OSError, ValueError, AttributeError) as e:
        raise argparse.ArgumentTypeError(f"{text}: not a readable smoke_report.json ({e})") from None
    if not isinstance(steps, list) or not steps:
        raise argparse.ArgumentTypeError(f"{text}: no per-step records (a smoke_report.json of a run with steps)")
    return text


def _defaults(name: str) -> str:
    """The help text's defaults of an option a task may set: "default 0.75, point tasks 0.7"."""
    by_task = {}
    for task, settings in TASK_SETTINGS.items():
        if name in settings:
            by_task.setdefault(settings[name], []).append(task)
    tasks = "; ".join(f"{', '.join(names)}: {value:g}" for value, names in by_task.items())
    return f"default {OPTION_DEFAULTS[name]:g}" + (f"; {tasks}" if tasks else "")


def add_arguments(p: argparse.ArgumentParser) -> None:
    count, positive = command.int_at_least, command.number(0, open_low=True)
    p.add_argument("--task", choices=sorted(TASK_NAMES), help="the smoke task (default: colour, or geo3k with --data)")
    p.add_argument("--data", type=command.folder,
                   help="a Geo3K folder (problems.jsonl + images); implies --task geo3k "
                        "(which reads the 3-problem sample in rlk_mm/fixtures/geo3k_sample without it)")
    p.add_argument("--model", default="qwen2.5-vl", choices=("qwen2.5-vl", "qwen3-vl"),
                   help="the model family: a tiny random policy of it, or --model-path's checkpoint (default qwen2.5-vl)")
    p.add_argument("--model-path", type=command.folder, help="a local checkpoint directory of the --model family; default: a tiny random model")
    p.add_argument("--steps", type=count(1), help=f"GRPO steps ({_defaults('steps')})")
    p.add_argument("--seed", type=int, default=0, help="seed of data, weights and sampling (default 0)")
    p.add_argument("--device", type=command.device, default="cpu", help="cpu or cuda (Triton kernels on cuda; default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="model dtype (default float32)")
    p.add_argument("--out", type=command.output_folder, default="smoke_out", help="output directory, made if missing (default smoke_out/)")
    p.add_argument("--break", dest="break_mode", choices=BREAKS, help="inject a known bug to see the gates or the learning check catch it")
    p.add_argument("--prompts", type=count(1), default=16, help="prompts per step (default 16)")
    p.add_argument("--samples", type=count(2), default=4, help="answers per prompt, the GRPO group size (default 4; GRPO compares at least 2)")
    p.add_argument("--temperature", type=command.number(MIN_TEMPERATURE, open_low=False),
                   help=f"sampling temperature of the rollouts, also used to score them (>= {MIN_TEMPERATURE}; "
                        f"{_defaults('temperature')})")
    p.add_argument("--lr", type=positive,
                   help=f"peak Adam learning rate of the GRPO steps ({_defaults('lr')}; see --lr-warmup-steps and --lr-floor)")
    p.add_argument("--lr-warmup-steps", type=count(0),
                   help=f"GRPO steps over which the learning rate ramps up linearly ({_defaults('lr_warmup_steps')})")
    p.add_argument("--lr-floor", type=command.number(0, open_low=False, high=1),
                   help=f"the learning rate's fraction of --lr at the last step, after a cosine decay ({_defaults('lr_floor')})")
    p.add_argument("--kl-coef", type=command.number(0, open_low=False), default=0.0,
                   help="weight of the k3 KL to the warm-up policy (default 0: no reference forward)")
    p.add_argument("--warmup-steps", type=count(0),
                   help=f"supervised warm-up steps with shuffled labels ({_defaults('warmup_steps')})")
    p.add_argument("--warmup-lr", type=positive, default=2e-3, help="Adam learning rate of the warm-up (default 2e-3)")
    p.add_argument("--kernels", default="invariant", choices=("invariant", "default"),
                   help="kernels of rollout and training: invariant (batch_invariant(): rollout log-probs equal the "
                        "training log-probs bitwise, gate (b) is torch.equal) or default (the control: a tolerance)")
    p.add_argument("--control", type=control_report,
                   help="a smoke_report.json of a --kernels default run: its rollout-vs-training series is drawn "
                        "next to this run's")
    p.add_argument("--quiet", action="store_true", help="print nothing (the report is still written)")
    command.add_debug_flag(p)


def task_name(args) -> str:
    """The task to run: `--task`, else geo3k with `--data`, else colour."""
    return args.task or ("geo3k" if args.data else "colour")


def resolve_task_settings(args) -> argparse.Namespace:
    """Fill the options left out (None) with the task's settings (``task_settings.TASK_SETTINGS``), else
    ``OPTION_DEFAULTS``; options given on the command line stay. Returns ``args``."""
    settings = TASK_SETTINGS.get(task_name(args), {})
    for name, default in OPTION_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, settings.get(name, default))
    return args


def check_args(args) -> None:
    """The checks across options (each option alone is checked by its argparse type)."""
    task = task_name(args)
    if args.data and task not in DATA_TASKS:
        raise UsageError(f"--data is for --task {'/'.join(DATA_TASKS)}; --task {task} draws its own prompts: drop --data")
    if args.break_mode == "image-swap" and task == "video-direction":
        raise UsageError("--break image-swap swaps two images; --task video-direction has videos only: choose another --break")
    if args.break_mode == "image-swap" and args.prompts < IMAGE_SWAP_MIN_PROMPTS:
        raise UsageError(f"--break image-swap needs --prompts >= {IMAGE_SWAP_MIN_PROMPTS} (two same-size images in different "
                         f"groups to swap), got {args.prompts}")


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


def parser() -> argparse.ArgumentParser:
    """The standalone parser (``python -m rlk_mm.smoke``)."""
    p = argparse.ArgumentParser(prog="rlk-mm smoke")
    add_arguments(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The smoke options of ``argv``, the task's settings filled in."""
    return resolve_task_settings(parser().parse_args(argv))
