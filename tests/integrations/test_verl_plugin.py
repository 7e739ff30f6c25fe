"""The verl plugin where verl cannot be imported: its warning says what to install (ray, which
verl imports and ``make setup``'s environment lacks; or verl itself), in a fresh interpreter
whose import system refuses that module."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import importlib.abc, json, sys, warnings

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {missing!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Refuse())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import rlk_mm.integrations.verl
print(json.dumps([str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]))
"""


@pytest.mark.parametrize("missing, install", [
    ("ray", ["verl imports ray, which is not installed here", "pip install ray", "pip install -e '.[verl]'"]),
    ("verl", ["verl is not installed here", "pip install -e '.[verl]'"]),
])
def test_the_plugin_says_what_to_install(missing, install):
    p = subprocess.run([sys.executable, "-c", PROBE.format(missing=missing)], capture_output=True, text=True,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    messages = [m for m in json.loads(p.stdout.strip().splitlines()[-1]) if "verl plugin did not register" in m]
    assert len(messages) == 1, p.stdout
    for words in install:
        assert words in messages[0], messages[0]
    assert "Traceback" not in messages[0] and "ModuleNotFoundError" not in messages[0]
