"""Every script in examples/ runs as a user runs it, on the CPU, and exits 0.

verl imports ray at import time; where ray is not installed (a source checkout's test run) the
scripts run with the tests' ray stand-in installed first (``tests/support/ray_stand_in.py``), so the
examples themselves need nothing of tests/. The smoke example runs its gates and two small steps,
and its output opens the table with an estimate and gives each row an ETA."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
#: the arguments that keep an example short on 2 CPU cores (the smoke test: gates and two small steps)
ARGS = {"grpo_smoke.py": ["--steps", "2", "--warmup-steps", "0", "--prompts", "2", "--samples", "2"],
        "trl_on_policy.py": ["--steps", "1", "--prompts", "1", "--max-completion-length", "4"]}
#: lines an example's output must hold: the smoke test opens its table with an estimate from the
#: first step, and every row ends with the ETA of the steps left
EXPECT = {"grpo_smoke.py": [r"^2 steps, about \d+ (s|min) here \(\d+\.\d s for step 1", r"^ +step progress .* ETA$",
                            r"^ +1/2 .* \d+:\d\d$", r"^ +2/2 .* 0:00$"],
          "trl_on_policy.py": [r"^step 1: .* max \|Δ log-prob\| 0, 0 tokens differ$"]}
#: run a script with the ray stand-in installed where ray is missing, as a user's verl install has ray
LAUNCH = ("import runpy, sys; sys.path.insert(0, {tests!r}); import ray_stand_in; ray_stand_in.install(); "
          "sys.argv = [{script!r}, *sys.argv[1:]]; runpy.run_path({script!r}, run_name='__main__')")


def test_every_example_is_listed():
    assert {p.name for p in EXAMPLES} >= {"grpo_smoke.py", "verl_policy_loss.py", "verl_fused_kernels.py",
                                           "easyr1_swap.py", "trl_grpo.py", "trl_on_policy.py"}


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_the_example_runs(script, tmp_path):
    args = [*ARGS.get(script.name, [])] + (["--out", str(tmp_path / "out")] if script.name == "grpo_smoke.py" else [])
    code = LAUNCH.format(tests=str(ROOT / "tests" / "support"), script=str(script))
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for pattern in EXPECT.get(script.name, []):
        assert re.search(pattern, proc.stdout, re.MULTILINE), f"{script.name} printed no line like {pattern!r}:\n{proc.stdout}"
