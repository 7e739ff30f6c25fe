"""The ``rlk-mm`` command's first run: the command line is parsed before anything heavy is
imported, so ``--help`` and usage errors come back without transformers, the smoke test or the
fixtures; long commands draw a progress bar with an ETA on stderr, off with ``--quiet`` and when
stderr is not a terminal."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from rlk_mm.cli import COMMANDS, HELP
from rlk_mm.progress import Progress, progress_wanted

#: what a parse must not import: the modules that make a command slow to start
HEAVY = ("transformers", "PIL", "matplotlib", "rlk_mm.smoke", "rlk_mm.fixtures", "rlk_mm.parity.invariance")

PROBE = r"""
import json, sys, time
start = time.monotonic()
from rlk_mm.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "seconds": time.monotonic() - start,
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "PIL", "matplotlib")
                                   or m.startswith(("rlk_mm.smoke", "rlk_mm.fixtures", "rlk_mm.parity.invariance")))}),
      file=sys.stderr)
"""


def _probe(*argv: str) -> tuple[dict, str]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=300,
                       check=False)
    return json.loads(p.stderr.strip().splitlines()[-1]), p.stdout + p.stderr


@pytest.mark.parametrize("argv, code", [(("--help",), 0), (("parity",), 2), (("inspect", "--max-rows", "x"), 2),
                                        (("smok",), 2)], ids=["help", "parity-missing-args", "inspect-bad-int", "typo"])
def test_help_and_usage_errors_import_nothing_heavy(argv, code):
    result, output = _probe(*argv)
    assert result["code"] == code, output
    assert result["loaded"] == [], f"rlk-mm {' '.join(argv)} imported {result['loaded']} before answering"


def test_top_level_help_lists_every_command_and_the_gates_only_run():
    result, output = _probe("--help")
    flat = "".join(output.split())  # argparse wraps the lines anywhere, hyphens included
    for name in COMMANDS:
        assert "".join(HELP[name].split()) in flat
    assert "--steps1--warmup-steps0" in flat


def test_only_the_chosen_command_is_built(monkeypatch, tmp_path, capsys):
    from rlk_mm import cli

    def refuse(sub):
        raise AssertionError("a sub-command that was not chosen was built")

    for name in COMMANDS:
        if name != "inspect":
            monkeypatch.setitem(cli.BUILDERS, name, refuse)
    assert cli.main(["--debug", "inspect", str(tmp_path / "missing.safetensors")]) == 2
    assert "missing.safetensors" in capsys.readouterr().err


def test_progress_bar_eta_and_quiet():
    ticks = iter([0.0, 10.0, 20.0, 20.0])
    out = io.StringIO()
    bar = Progress(4, "sweep", stream=out, clock=lambda: next(ticks))
    bar.update(note="case a")        # one step in 10 s: three left, 30 s
    bar.update(2)                    # two in 20 s: two left, 20 s
    lines = out.getvalue().splitlines()
    assert lines[0] == "sweep [######------------------] 1/4 0:10 elapsed, ETA 0:30  case a"
    assert lines[1].endswith("2/4 0:20 elapsed, ETA 0:20")
    quiet = io.StringIO()
    Progress(2, "x", enabled=False, stream=quiet).update()
    assert quiet.getvalue() == ""
    with pytest.raises(ValueError, match="total"):
        Progress(0, "x")


def test_progress_is_off_when_stderr_is_not_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert not progress_wanted(stream=io.StringIO())
    assert progress_wanted(stream=Tty())
    assert progress_wanted(progress=True, stream=io.StringIO())
    assert not progress_wanted(quiet=True, progress=True, stream=Tty())


def test_invariance_draws_its_bar_on_request(capsys):
    from rlk_mm.cli import main

    argv = ["invariance", "--samples", "2", "--cases", "packed", "--no-control", "--response-length", "2",
            "--backend", "torch"]
    assert main([*argv, "--progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("rlk-mm invariance [") and "1/2" in err[0] and err[0].endswith("model loaded")
    assert "2/2" in err[-1] and "ETA 0:00" in err[-1] and "packed" in err[-1]


@pytest.mark.parametrize("n", [1, 6])
def test_layout_picture_legend_clears_the_axis_label(n, tmp_path, monkeypatch, processor):
    """``rlk-mm inspect --png``: the legend sits below the axis label, never over it."""
    from matplotlib.figure import Figure

    from rlk_mm import RLBatch
    from rlk_mm.fixtures import IM_END_TOKEN_ID, processor_inputs, synthetic_image_text
    from rlk_mm.viz import draw_layout

    boxes = []
    save = Figure.savefig

    def savefig(fig, *args, **kwargs):
        save(fig, *args, **kwargs)  # lays the figure out, then the extents are the saved picture's
        renderer = fig.canvas.get_renderer()
        boxes.append((fig.legends[0].get_window_extent(renderer), fig.axes[0].xaxis.label.get_window_extent(renderer)))

    monkeypatch.setattr(Figure, "savefig", savefig)
    samples = synthetic_image_text(n, seed=0)
    batch = RLBatch.from_qwen_vl(processor_inputs(processor, samples), processor=processor,
                                 responses=[processor.tokenizer.encode("5") + [IM_END_TOKEN_ID]] * n)
    draw_layout(batch, tmp_path / "layout.png")
    legend, label = boxes[0]
    assert not legend.overlaps(label) and legend.y1 <= label.y0
