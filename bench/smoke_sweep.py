"""Run several `rlk-mm smoke` configurations at once and summarize their reward curves.

How the smoke test's defaults were chosen: CUDA runs go one after another (parallel
runs on one GPU thrash), CPU runs go side by side with a few threads each. Every run's
log is parsed as it stands, so a run cut off by `--deadline` still reports its curve.

    python bench/smoke_sweep.py CONFIGS.json --out DIR [--cpu-workers 6] [--threads 2] [--deadline 540]

CONFIGS.json: a list of {"name": str, "device": "cuda" | "cpu", "args": [smoke options],
"set": {constant of a module of rlk_mm.smoke: value}}. Writes DIR/sweep.json and DIR/NAME.log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROW = re.compile(r"^\s*(\d+)/(\d+)\s+\S+\s+([0-9.]+)±")
# each constant is set in every module of the package that holds it (where it is defined and where it is imported)
RUNNER = "import sys, json, rlk_mm.smoke as S\n" \
         "parts = [m for name, m in sys.modules.items() if name.startswith('rlk_mm.smoke.')]\n" \
         "for k, v in json.loads(sys.argv[1]).items(): [setattr(m, k, v) for m in parts if hasattr(m, k)]\n" \
         "sys.exit(S.run_smoke(S.parse_args(sys.argv[2:])))"


def summarize(name: str, log: str, seconds: float, code) -> dict:
    rewards = [float(m.group(3)) for m in map(ROW.match, log.splitlines()) if m]
    window = [sum(rewards[i - 9 : i + 1]) / 10 for i in range(9, len(rewards))]
    reached = next((i + 10 for i, w in enumerate(window) if w >= 0.8), None)
    return dict(
        name=name, exit_code=code, seconds=round(seconds, 1), steps=len(rewards),
        start=rewards[0] if rewards else None, final_10=round(window[-1], 3) if window else None,
        best_10=round(max(window), 3) if window else None, first_step_10_at_0_8=reached,
        by_50=[round(sum(rewards[i : i + 50]) / len(rewards[i : i + 50]), 3) for i in range(0, len(rewards), 50)],
        gates_failed="a gate failed" in log,
    )


def run_one(cfg: dict, out: Path, threads: int, deadline: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}  # run_smoke tunes malloc itself
    argv = ["--device", cfg.get("device", "cpu"), "--out", str(out / cfg["name"]), *cfg.get("args", [])]
    log_path = out / f"{cfg['name']}.log"
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps(cfg.get("set", {})), *argv],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "killed at the deadline"
    result = summarize(cfg["name"], log_path.read_text(), time.time() - start, code)
    result.update(device=cfg.get("device", "cpu"), args=cfg.get("args", []), set=cfg.get("set", {}))
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
