"""The model families on one GPU: the family GPU tests (Qwen3-VL at the 2B and 8B widths: decode,
cache, layouts and rollout bitwise the training forward; head dim 256 in the invariant attention),
then ``rlk-mm smoke --model qwen3-vl --device cuda`` with every gate and, at every GRPO step, the
rollout's log-probs against the training forward's (max |Δ| and differing tokens).

    python -m bench.gpu_check_families --out $OUT [--steps 170] [--tests-timeout 420]

Writes ``families_gpu.json`` (bench/common.py's schema: the card, versions, command), with each
test's outcome, and the smoke run's gates, per-step deltas, reward and learning verdict.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.common import write_result

TESTS = ("tests/models/test_model_families_gpu.py", "tests/ops/test_attention_head_dim.py", "tests/models/test_on_policy.py",
         "tests/models/test_decode_invariance.py", "tests/ops/test_batch_invariant.py")


def run_tests(out: Path, timeout: int) -> dict:
    """The GPU tests of ``TESTS`` (pytest -m gpu): the summary line and each test's outcome."""
    junit = out / "families_gpu_tests.xml"
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={junit}",
                               *TESTS], capture_output=True, text=True, timeout=timeout)
        log, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log, code = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout} s", 124
    (out / "families_gpu_tests.log").write_text(log if isinstance(log, str) else log.decode())
    outcomes = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            failed = case.find("failure") is not None or case.find("error") is not None
            outcomes[name] = "failed" if failed else "skipped" if case.find("skipped") is not None else "passed"
    lines = [line for line in str(log).splitlines() if line.strip()]
    return {"exit_code": code, "seconds": round(time.perf_counter() - start, 1), "summary": lines[-1] if lines else "",
            "outcomes": outcomes}


def run_smoke(out: Path, steps: int, timeout: int) -> dict:
    """``rlk-mm smoke --model qwen3-vl --device cuda``: gates, per-step rollout-vs-training deltas, learning."""
    folder = out / "smoke_qwen3_vl"
    command = [sys.executable, "-m", "rlk_mm.smoke", "--model", "qwen3-vl", "--device", "cuda", "--steps", str(steps),
               "--quiet", "--out", str(folder)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        code, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, log = 124, f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout} s"
    (out / "smoke_qwen3_vl.log").write_text(str(log))
    report_path = folder / "smoke_report.json"
    result = {"command": " ".join(["rlk-mm smoke", *command[3:]]), "exit_code": code,
              "seconds": round(time.perf_counter() - start, 1)}
    if not report_path.exists():
        return result
    report = json.loads(report_path.read_text())
    records = report.get("steps", [])
    rewards = [r["reward_mean"] for r in records]
    result.update(
        gates={g["name"]: {"ok": g["ok"], "detail": g["detail"]} for g in report.get("gates", [])},
        steps=len(records),
        max_abs_delta_any_step=max((r["max_abs_delta"] for r in records), default=None),
        tokens_differing_any_step=sum(r["tokens_differing"] for r in records),
        per_step_max_abs_delta=[r["max_abs_delta"] for r in records],
        per_step_tokens_differing=[r["tokens_differing"] for r in records],
        reward_first_10=sum(rewards[:10]) / max(len(rewards[:10]), 1),
        reward_last_10=sum(rewards[-10:]) / max(len(rewards[-10:]), 1),
        learning=report.get("learning"),
        timings=report.get("timings"),
    )
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=170, help="GRPO steps of the smoke run (default 170, the smoke's own)")
    parser.add_argument("--tests-timeout", type=int, default=420)
    parser.add_argument("--smoke-timeout", type=int, default=420)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--label", default="default", help="the result's name in its file name")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"tests": None if args.skip_tests else run_tests(args.out, args.tests_timeout)}
    print("tests:", data["tests"] and data["tests"]["summary"], flush=True)
    data["smoke_qwen3_vl"] = run_smoke(args.out, args.steps, args.smoke_timeout)
    smoke = data["smoke_qwen3_vl"]
    print(f"smoke: exit {smoke['exit_code']}, max |Δ| {smoke.get('max_abs_delta_any_step')}, "
          f"differing tokens {smoke.get('tokens_differing_any_step')}, reward {smoke.get('reward_first_10')} -> "
          f"{smoke.get('reward_last_10')}", flush=True)
    write_result(args.out, "families", data, shapes={"model": "qwen3-vl", "smoke_steps": args.steps}, label=args.label)


if __name__ == "__main__":
    main()
