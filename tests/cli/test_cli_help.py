"""``rlk-mm --help`` and each command's ``--help``: fast (no torch, no heavy part of rlk_mm is
imported to build a parser), and every option and positional says what it does."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest

from rlk_mm import cli
from rlk_mm.cli import COMMANDS
from rlk_mm.counts import plural

#: modules that make a command slow to start; none may be imported to answer --help
HEAVY = ("torch", "numpy", "pydantic", "safetensors", "triton", "transformers", "PIL", "matplotlib")

#: answers the help of argv in this interpreter, then says which heavy modules and which modules of rlk_mm it imported
PROBE = r"""
import json, sys
from rlk_mm.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "modules": sorted(m for m in sys.modules if m.split(".")[0] in (*HEAVY, "rlk_mm"))}),
      file=sys.stderr)
""".replace("HEAVY", repr(HEAVY))

#: seconds a --help may take, interpreter start included: generous for a loaded 2-core machine
#: (about 0.05 s on a quiet one; torch alone takes more than 1 s to import)
HELP_LIMIT = 2.0


@pytest.mark.parametrize("argv", [("--help",), *((name, "--help") for name in COMMANDS)],
                         ids=["rlk-mm", *COMMANDS])
def test_help_is_fast_and_imports_no_torch(argv):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=120,
                       check=False)
    seconds = time.monotonic() - start
    result = json.loads(p.stderr.strip().splitlines()[-1])
    assert result["code"] == 0 and "usage: rlk-mm" in p.stdout, p.stdout + p.stderr
    heavy = [m for m in result["modules"] if m.split(".")[0] in HEAVY]
    assert not heavy, f"rlk-mm {' '.join(argv)} imported {heavy[:8]}"
    light = {"rlk_mm", "rlk_mm.cli", "rlk_mm.command", "rlk_mm.progress", "rlk_mm.deprecations", "rlk_mm.lazy", "rlk_mm.smoke",
             "rlk_mm.smoke.cli", "rlk_mm.smoke.options", "rlk_mm.smoke.task_settings"}
    assert set(result["modules"]) <= light, f"rlk-mm {' '.join(argv)} imported {sorted(set(result['modules']) - light)}"
    assert seconds < HELP_LIMIT, f"rlk-mm {' '.join(argv)} took {seconds:.2f} s"


def _actions(parser: argparse.ArgumentParser, where: str):
    """(where, action) for every action of ``parser`` and of the sub-parsers it holds, their choice lines too."""
    for action in parser._actions:
        yield where, action
        if isinstance(action, argparse._SubParsersAction):
            yield from ((f"{where} {line.dest}", line) for line in action._choices_actions)
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{where} {name}")


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_and_positional_has_help(name):
    from rlk_mm.smoke.options import parser as smoke_parser

    found = list(_actions(cli._build_parser([name]), "rlk-mm"))
    if name == "smoke":
        found += list(_actions(smoke_parser(), "python -m rlk_mm.smoke"))
    missing = [f"{where}: {'/'.join(a.option_strings) or a.dest}" for where, a in found
               if not (a.help and a.help.strip()) or a.help == argparse.SUPPRESS]
    assert not missing, f"without help text: {missing}"
    assert any(where.endswith(name) for where, _ in found), f"the {name} parser was not built"


def test_the_invariance_parser_offers_every_case_of_the_sweep():
    from rlk_mm.parity.invariance import CASES

    assert cli.INVARIANCE_CASES == tuple(CASES)


@pytest.mark.parametrize("n, noun, want", [(1, "sample", "1 sample"), (0, "sample", "0 samples"),
                                           (4, "step", "4 steps"), (2, "mismatch", "2 mismatches"),
                                           (1, "media item", "1 media item"), (3, "media item", "3 media items")])
def test_counts_are_worded_in_the_singular_for_one(n, noun, want):
    assert plural(n, noun) == want


def test_one_sample_reads_in_the_singular_in_the_parity_report(processor):
    from rlk_mm import RLBatch
    from rlk_mm.fixtures import IM_END_TOKEN_ID, processor_inputs, synthetic_image_text
    from rlk_mm.parity import check_layout_parity

    samples = synthetic_image_text(1, seed=0)
    batch = RLBatch.from_qwen_vl(processor_inputs(processor, samples), processor=processor,
                                 responses=[processor.tokenizer.encode("5") + [IM_END_TOKEN_ID]])
    text = str(check_layout_parity(batch, batch))
    assert text.startswith("layout parity OK: 1 sample, ") and "samples" not in text
