"""Run several `rlk-mm smoke` configurations at once and summarize their reward curves.

How the smoke test's defaults were chosen: CUDA runs go one after another on one GPU
(parallel runs on one GPU thrash), or, with `--gpus N --per-gpu K`, K at a time on each of
N GPUs (small runs leave a GPU mostly idle); CPU runs go side by side with a few threads each. Each run is a
subprocess that calls `rlk_mm.smoke.run_smoke(args, tuning=SmokeTuning(...), on_step=...)`:
its options are command-line words, its other settings a `SmokeTuning` (no module global
is changed), and every finished GRPO step is appended to DIR/NAME.steps.jsonl as it ends,
so a run cut off by `--deadline` still reports its curve.

    python -m bench.smoke_sweep CONFIGS.json --out DIR [--cpu-workers 6] [--threads 2] [--deadline 540] \
        [--gpus 4 --per-gpu 6]

CONFIGS.json: a list of {"name": str, "device": "cuda" | "cpu", "args": [smoke options],
"tuning": {SmokeTuning field: value}}; earlier configs' "set" ({"TINY_MODEL": ...}: the module
constants a field replaces) is read as "tuning", and their learning-rate floor ("LR_FLOOR" or
"lr_floor" there) as the option --lr-floor. Writes DIR/sweep.json (as runs finish), DIR/NAME.log
(the run's output), DIR/NAME.steps.jsonl and DIR/NAME/ (the run's report and pictures), and at
the end a ``smoke_sweep`` result (``bench.common.write_result``, labelled ``--label`` or the
configs file's name) under DIR with every run's summary and the margins.

A config may also name its "variant" (the settings it tries), its "role" ("task" or "control")
and the task's "chance" reward, and give a "bar" (colour: the last-10-step reward every seed must
reach); then DIR/margins.json says per variant whether it learns (`margins`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlk_mm.smoke import SmokeTuning
from rlk_mm.smoke.tuning import MOVED_TO_OPTIONS

__all__ = ["args_of", "MARGIN", "RUNNER", "main", "margins", "read_steps", "run_one", "summarize", "tuning_of"]

#: the subprocess: ``python -c RUNNER TUNING_JSON STEPS_JSONL smoke-options...``
RUNNER = """
import json, sys
from rlk_mm.smoke import SmokeTuning, parse_args, run_smoke

tuning, steps_file, argv = SmokeTuning.from_mapping(json.loads(sys.argv[1])), sys.argv[2], sys.argv[3:]
with open(steps_file, "a") as steps:
    def on_step(metrics):
        steps.write(json.dumps(metrics) + "\\n")
        steps.flush()
    sys.exit(run_smoke(parse_args(argv), tuning=tuning, on_step=on_step))
"""


def _settings(cfg: dict) -> dict:
    """A config's settings: ``"tuning"``, over an earlier config's ``"set"``."""
    return {**cfg.get("set", {}), **cfg.get("tuning", {})}


def tuning_of(cfg: dict) -> dict:
    """The run's ``SmokeTuning`` settings, checked; the settings that are options now are left
    to ``args_of``."""
    values = {k: v for k, v in _settings(cfg).items() if k not in MOVED_TO_OPTIONS}
    SmokeTuning.from_mapping(values)  # refuse an unknown or bad setting before any run starts
    return values


def args_of(cfg: dict) -> list[str]:
    """The run's smoke options: ``"args"``, and the options an earlier config set as tunings
    (``SmokeTuning``'s ``MOVED_TO_OPTIONS``: the learning-rate floor)."""
    moved = {MOVED_TO_OPTIONS[k]: v for k, v in _settings(cfg).items() if k in MOVED_TO_OPTIONS}
    return [*cfg.get("args", []), *(x for option, v in moved.items() for x in (option, str(v)))]


def summarize(name: str, steps: list[dict], report: dict | None, seconds: float, code) -> dict:
    rewards = [s["reward_mean"] for s in steps]
    window = [sum(rewards[i - 9 : i + 1]) / 10 for i in range(9, len(rewards))]
    reached = next((i + 10 for i, w in enumerate(window) if w >= 0.8), None)
    return dict(
        name=name, exit_code=code, seconds=round(seconds, 1), steps=len(rewards),
        start=rewards[0] if rewards else None, final_10=round(window[-1], 3) if window else None,
        best_10=round(max(window), 3) if window else None, first_step_10_at_0_8=reached,
        by_50=[round(sum(rewards[i : i + 50]) / len(rewards[i : i + 50]), 3) for i in range(0, len(rewards), 50)],
        gates_failed=report is not None and not all(g["ok"] for g in report.get("gates", [])),
        curve=[round(r, 4) for r in rewards],
        # rollout vs training log-probs at every step (0 and 0 under the invariant kernels; None if not recorded)
        max_abs_delta=max((s["max_abs_delta"] for s in steps if "max_abs_delta" in s), default=None),
        tokens_differing=max((s["tokens_differing"] for s in steps if "tokens_differing" in s), default=None),
        steps_with_any_difference=sum(s.get("max_abs_delta", 0) > 0 or s.get("tokens_differing", 0) > 0 for s in steps),
    )


MARGIN = 0.3
"""Learning: over the seeds, the task's mean last-10-step reward beats its control's and chance by this much."""


def margins(results: list[dict], configs: list[dict]) -> dict:
    """Per variant: the seeds' last-10-step rewards of the task (and of its control), their means,
    the margins over the control and over chance, whether every gate passed, and whether the
    variant learns: both margins >= `MARGIN` (or, with a "bar", every seed's reward >= the bar)."""
    by_name = {r["name"]: r for r in results}
    out: dict = {}
    for cfg in configs:
        if "variant" not in cfg:
            continue
        v = out.setdefault(cfg["variant"], dict(chance=cfg.get("chance"), bar=cfg.get("bar"), task=[], control=[],
                                                gates_ok=True, finished=True, seconds=0.0))
        r = by_name.get(cfg["name"])
        if r is None or r["final_10"] is None:
            v["finished"] = False
            continue
        v[cfg.get("role", "task")].append(r["final_10"])
        v["gates_ok"] &= not r["gates_failed"] and bool(r["steps"])
        v["finished"] &= r["exit_code"] != "killed at the deadline"
        v["seconds"] = max(v["seconds"], r["seconds"])
    for v in out.values():
        mean = {k: round(sum(v[k]) / len(v[k]), 3) if v[k] else None for k in ("task", "control")}
        v.update(mean_task=mean["task"], mean_control=mean["control"])
        if v["bar"] is not None:
            v["learns"] = bool(v["task"]) and min(v["task"]) >= v["bar"] and v["gates_ok"]
            continue
        v["over_control"] = None if None in mean.values() else round(mean["task"] - mean["control"], 3)
        v["over_chance"] = None if mean["task"] is None or v["chance"] is None else round(mean["task"] - v["chance"], 3)
        v["learns"] = (v["over_control"] is not None and v["over_chance"] is not None and v["gates_ok"]
                       and v["over_control"] >= MARGIN and v["over_chance"] >= MARGIN)
    return out


def read_steps(path: Path) -> list[dict]:
    """The steps a run wrote (a line cut by a kill at the deadline is dropped)."""
    steps = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            steps.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return steps


def run_one(cfg: dict, out: Path, threads: int, deadline: float, gpu: int | None = None) -> dict:
    """Run one config as a subprocess (on GPU ``gpu`` when given) until it ends or ``deadline``; its summary."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}  # run_smoke tunes malloc itself
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    run_dir, steps_path = out / cfg["name"], out / f"{cfg['name']}.steps.jsonl"
    argv = ["--device", cfg.get("device", "cpu"), "--out", str(run_dir), *args_of(cfg)]
    steps_path.unlink(missing_ok=True)
    start = time.time()
    with open(out / f"{cfg['name']}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps(tuning_of(cfg)), str(steps_path), *argv],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "killed at the deadline"
    report_path = run_dir / "smoke_report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else None
    result = summarize(cfg["name"], read_steps(steps_path), report, time.time() - start, code)
    result.update(device=cfg.get("device", "cpu"), args=args_of(cfg), tuning=tuning_of(cfg))
    print(json.dumps(result), flush=True)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("configs")
    p.add_argument("--out", required=True)
    p.add_argument("--cpu-workers", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--deadline", type=float, default=540, help="seconds from now after which runs are killed")
    p.add_argument("--gpus", type=int, default=0,
                   help="spread the CUDA runs over this many GPUs (default: one, in turn)")
    p.add_argument("--per-gpu", type=int, default=1, help="CUDA runs at once on each GPU (with --gpus)")
    p.add_argument("--label", help="the result's name in its file name (default: the configs file's name)")
    a = p.parse_args(argv)
    if a.gpus < 0 or a.per_gpu < 1 or a.cpu_workers < 1 or a.threads < 1:
        raise SystemExit("--gpus must be >= 0, --per-gpu, --cpu-workers and --threads >= 1")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = json.loads(Path(a.configs).read_text())
    for cfg in configs:
        tuning_of(cfg)
    deadline = time.time() + a.deadline
    results: list[dict] = []
    lock = threading.Lock()

    def record(r):
        with lock:
            results.append(r)
            (out / "sweep.json").write_text(json.dumps(results, indent=1))

    cuda = [c for c in configs if c.get("device") == "cuda"]
    cpu = [c for c in configs if c.get("device", "cpu") == "cpu"]

    def run_cuda():
        if not a.gpus:
            for c in cuda:
                record(run_one(c, out, 4, deadline))
            return
        with ThreadPoolExecutor(a.gpus * a.per_gpu) as gpu_pool:  # run i on GPU i % gpus, one CPU thread each
            list(gpu_pool.map(lambda ic: record(run_one(ic[1], out, 1, deadline, gpu=ic[0] % a.gpus)),
                              enumerate(cuda)))

    gpu_thread = threading.Thread(target=run_cuda)
    gpu_thread.start()
    with ThreadPoolExecutor(a.cpu_workers) as pool:
        for r in pool.map(lambda c: run_one(c, out, a.threads, deadline), cpu):
            record(r)
    gpu_thread.join()
    summary = margins(results, configs) if any("variant" in c for c in configs) else None
    if summary is not None:
        (out / "margins.json").write_text(json.dumps(summary, indent=1))
    from bench.common import write_result  # here: tests load this file by its path, outside the package

    label = a.label or Path(a.configs).stem.lower().replace("_", "-")
    write_result(out, "smoke_sweep", {"configs": configs, "runs": results, "margins": summary},
                 shapes={"configs": a.configs, "runs": len(configs)}, label=label, card=None if cuda else "cpu")


if __name__ == "__main__":
    main()
