"""Run several `rlk-mm smoke` configurations at once and summarize their reward curves.

How the smoke test's defaults were chosen: CUDA runs go one after another (parallel
runs on one GPU thrash), CPU runs go side by side with a few threads each. Each run is a
subprocess that calls `rlk_mm.smoke.run_smoke(args, tuning=SmokeTuning(...), on_step=...)`:
its options are command-line words, its other settings a `SmokeTuning` (no module global
is changed), and every finished GRPO step is appended to DIR/NAME.steps.jsonl as it ends,
so a run cut off by `--deadline` still reports its curve.

    python -m bench.smoke_sweep CONFIGS.json --out DIR [--cpu-workers 6] [--threads 2] [--deadline 540]

CONFIGS.json: a list of {"name": str, "device": "cuda" | "cpu", "args": [smoke options],
"tuning": {SmokeTuning field: value}}; earlier configs' "set" ({"LR_FLOOR": 0.3}: the module
constants a field replaces) is read as "tuning". Writes DIR/sweep.json, DIR/NAME.log (the
run's output), DIR/NAME.steps.jsonl and DIR/NAME/ (the run's report and pictures).
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


def tuning_of(cfg: dict) -> dict:
    """The run's ``SmokeTuning`` settings (``"tuning"``, or an earlier config's ``"set"``), checked."""
    values = {**cfg.get("set", {}), **cfg.get("tuning", {})}
    SmokeTuning.from_mapping(values)  # refuse an unknown or bad setting before any run starts
    return values


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
    )


def read_steps(path: Path) -> list[dict]:
    """The steps a run wrote (a line cut by a kill at the deadline is dropped)."""
    steps = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            steps.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return steps


def run_one(cfg: dict, out: Path, threads: int, deadline: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}  # run_smoke tunes malloc itself
    run_dir, steps_path = out / cfg["name"], out / f"{cfg['name']}.steps.jsonl"
    argv = ["--device", cfg.get("device", "cpu"), "--out", str(run_dir), *cfg.get("args", [])]
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
    result.update(device=cfg.get("device", "cpu"), args=cfg.get("args", []), tuning=tuning_of(cfg))
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("configs")
    p.add_argument("--out", required=True)
    p.add_argument("--cpu-workers", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--deadline", type=float, default=540, help="seconds from now after which runs are killed")
    a = p.parse_args()
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
    gpu_thread = threading.Thread(target=lambda: [record(run_one(c, out, 4, deadline)) for c in cuda])
    gpu_thread.start()
    with ThreadPoolExecutor(a.cpu_workers) as pool:
        for r in pool.map(lambda c: run_one(c, out, a.threads, deadline), cpu):
            record(r)
    gpu_thread.join()


if __name__ == "__main__":
    main()
