"""The core imports without the [vl] extra: no transformers, Pillow or qwen-vl-utils.

``pip install rlk-mm`` (no extra) must sit beside EasyR1, which pins transformers < 5, so
``rlk_mm`` itself, the batch schema, the ops, the parity checks and the EasyR1 adapter never
import them at import time (the builders take a processor object; the models, fixtures and
smoke test import transformers when used). The check runs in a fresh interpreter whose
import system refuses those packages (and matplotlib, which needs Pillow) and records every
attempt, so a guarded ``try: import transformers`` counts too. ``rlk_mm.integrations.verl``
is left out, with its modules (the fused path ``verl.fused`` among them): importing it
registers the plugin, which imports verl, which imports transformers. The helpers the
adapters share (``integrations.args``, ``integrations.micro_batch``) are in. ``rlk_mm.fixtures``,
which needs the [vl] extra, is the control: the probe must see it try.

``import rlk_mm`` itself imports no torch (the ``rlk-mm`` command's help answers at once), and
``batch_invariant()`` still applies every model family's patches when nothing but the ops was
imported.
"""

import json
import subprocess
import sys

BLOCKED = ("transformers", "PIL", "qwen_vl_utils", "matplotlib")
CORE = (
    "rlk_mm", "rlk_mm.schema", "rlk_mm.ops", "rlk_mm.parity", "rlk_mm.integrations", "rlk_mm.integrations.easyr1",
    "rlk_mm.integrations.args", "rlk_mm.integrations.micro_batch", "rlk_mm.integrations.trl",
)
CONTROL = "rlk_mm.fixtures"

PROBE = """
import importlib, importlib.abc, json, sys
blocked, attempts = {blocked!r}, []

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            attempts.append(name)
            raise ModuleNotFoundError(f"blocked: {{name}}", name=name)

sys.meta_path.insert(0, Refuse())
report = {{}}
for module in {modules!r}:
    try:
        importlib.import_module(module)
        error = None
    except ImportError as e:
        error = str(e)
    report[module] = {{"attempts": list(attempts), "error": error}}
    attempts.clear()
print(json.dumps(report))
"""


def test_the_core_imports_without_transformers_pillow_or_qwen_vl_utils():
    modules = (*CORE, CONTROL)
    result = subprocess.run(
        [sys.executable, "-c",
         PROBE.format(blocked=BLOCKED, modules=modules)], capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    tried = {m: r for m, r in report.items() if m != CONTROL and (r["attempts"] or r["error"])}
    assert not tried, f"with {BLOCKED} blocked, these core modules tried to import them or failed: {tried}"
    assert report[CONTROL]["attempts"] and report[CONTROL]["error"], (
        f"the probe saw no attempt by {CONTROL}: {report[CONTROL]}")


LAZY_PROBE = """
import json, sys
import rlk_mm
report = {"torch_after_import": "torch" in sys.modules}
from rlk_mm.ops import batch_invariant
report["models_before_the_mode"] = "rlk_mm.models" in sys.modules
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen
from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3
own = (qwen.Qwen2_5_VLRMSNorm.forward, qwen3.Qwen3VLTextRMSNorm.forward)
with batch_invariant(backend="torch"):
    report["patched"] = [qwen.Qwen2_5_VLRMSNorm.forward is not own[0], qwen3.Qwen3VLTextRMSNorm.forward is not own[1]]
report["restored"] = (qwen.Qwen2_5_VLRMSNorm.forward, qwen3.Qwen3VLTextRMSNorm.forward) == own
print(json.dumps(report))
"""


def test_import_rlk_mm_is_light_and_the_mode_still_patches_every_family():
    """``import rlk_mm`` imports no torch; ``batch_invariant()`` entered with nothing but the ops
    imported still applies the model families' patches (it imports ``rlk_mm.models`` on entry)."""
    result = subprocess.run([sys.executable, "-c", LAZY_PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"torch_after_import": False, "models_before_the_mode": False, "patched": [True, True],
                      "restored": True}
