"""Does the point task learn? `rlk-mm smoke --task point` over seeds, against the shuffled-target control.

Each seed runs the task (reward: the point lies in the shape the prompt names) and the control
`point-shuffled` (the same prompts; the rewarded shape drawn at random, independent of the one
named), each a subprocess (`smoke_sweep.run_one`: its progress table is parsed as it stands, so a
run cut off by `--deadline` still reports its curve), all side by side. Learning shows as the
task's reward rising above the control's, which can only learn a position prior (about 1/3 for
a well-formed answer in one of three strips). Reported as measured, with no threshold.

Defaults from a CPU probe (seed 0, 16 prompts x 4): after 60 warm-up steps at temperature 1.0,
6 of 32 answers were well-formed (reward 0.06); after 100 at 0.7, 29 of 32 (reward 0.125).

    python -m bench.bench_point_task --out $OUT              # the GPU run (3 seeds x 2 tasks, < 4 min on an H100)
    python -m bench.bench_point_task --dry-run --out /tmp/pt # CPU, 1 seed, 1 step: every code path
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .common import add_output_args, write_result
from .smoke_sweep import run_one

TASKS = ("point", "point-shuffled")


def configs(seeds: list[int], device: str, smoke_args: list[str]) -> list[dict]:
    return [dict(name=f"{task}-seed{seed}", device=device, args=["--task", task, "--seed", str(seed), *smoke_args])
            for seed in seeds for task in TASKS]


def aggregate(results: list[dict]) -> dict:
    """Per task: the last-10-step reward of each seed, their mean, and the task minus the control."""
    out = {}
    for task in TASKS:
        runs = [r for r in results if r["name"].startswith(f"{task}-seed")]
        finals = [r["final_10"] for r in runs if r["final_10"] is not None]
        out[task] = dict(final_10=finals, mean_final_10=round(statistics.mean(finals), 3) if finals else None,
                         start=[r["start"] for r in runs], gates_failed=[r["gates_failed"] for r in runs])
    task, control = out["point"]["mean_final_10"], out["point-shuffled"]["mean_final_10"]
    out["task_minus_control"] = None if task is None or control is None else round(task - control, 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(p)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup-steps", type=int, default=100,
                   help="format warm-up (the answer is ~15 tokens, not one word)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature: at 1.0 the tail of the 151k vocabulary breaks most 15-token answers")
    p.add_argument("--parallel", type=int, default=6,
                   help="runs side by side (the tiny model leaves the GPU mostly idle)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads per run")
    p.add_argument("--deadline", type=float, default=225,
                   help="seconds after which unfinished runs are killed (and reported)")
    p.add_argument("--dry-run", action="store_true", help="CPU, seed 0, 1 warm-up step and 1 step: checks the script")
    p.add_argument("--device", choices=("cuda", "cpu"), help="where the runs train (default: cuda where there is one)")
    a = p.parse_args()
    device = a.device or ("cuda" if torch.cuda.is_available() and not a.dry_run else "cpu")
    seeds = [0] if a.dry_run else [int(s) for s in a.seeds.split(",")]
    smoke_args = (["--steps", "1", "--warmup-steps", "1", "--prompts", "2", "--samples", "2"] if a.dry_run
                  else ["--steps", str(a.steps), "--warmup-steps", str(a.warmup_steps), "--temperature",
                        str(a.temperature)])
    out = Path(a.out)
    logs = out / "point_task_runs"
    logs.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + (1e9 if a.dry_run else a.deadline)
    start = time.time()
    with ThreadPoolExecutor(a.parallel) as pool:
        results = list(pool.map(lambda c: run_one(c, logs, a.threads, deadline), configs(seeds, device, smoke_args)))
    summary = aggregate(results)
    write_result(out, "point_task", dict(
        device=device, seeds=seeds, smoke_args=smoke_args, parallel=a.parallel, seconds=round(time.time() - start, 1),
        summary=summary, runs=results,
    ), shapes={"seeds": seeds, "smoke_args": smoke_args}, label=a.label, dry_run=a.dry_run,
        card="cpu" if device == "cpu" else None)


if __name__ == "__main__":
    main()
