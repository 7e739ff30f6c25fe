"""Bad and unusual command lines of ``rlk-mm`` (parity, inspect, invariance, smoke): each exits with the
documented code and a message naming the cause; an internal error prints a traceback only with --debug."""

from __future__ import annotations

import pytest

from rlk_mm.cli import main as cli_main
from support.context_cases import (
    DRIFT,
    TRAINING,
    Case,
    Exits,
    assert_well,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _cli(*argv):
    return lambda c: cli_main([str(a).replace("{tmp}", str(c.tmp)) for a in argv])


def _smoke(*argv):
    """``rlk-mm smoke`` with one GRPO step and no warm-up (short even where a bad value is not refused)."""
    return _cli("smoke", "--steps", "1", "--warmup-steps", "0", "--quiet", "--out", "{tmp}/smoke", *argv)


def _internal_error(debug: bool):
    """A bug inside a sub-command (planted: the parity check itself raises)."""

    def run(c):
        from rlk_mm import parity

        real = parity.check_layout_parity
        parity.check_layout_parity = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("planted bug"))
        try:
            return cli_main(["parity", TRAINING, TRAINING] + (["--debug"] if debug else []))
        finally:
            parity.check_layout_parity = real

    return run


BAD = [
    # ------------------------------------------- the CLI (exit codes: 0 ok, 1 negative, 2 bad input, 3 internal)
    Case("cli.parity.missing_file", _cli("parity", "{tmp}/nope.safetensors", TRAINING),
         Exits(2, r"nope\.safetensors: no such file")),
    Case("cli.parity.model_path", _cli("parity", DRIFT, TRAINING, "--model-path", "{tmp}/no_model"),
         Exits(2, r"--model-path.*no_model")),
    Case("cli.parity.arguments", _cli("parity", TRAINING), Exits(2, r"the following arguments are required: training")),
    Case("cli.command", _cli("train"), Exits(2, r"invalid choice: 'train'")),
    Case("cli.internal_error", _internal_error(False), Exits(3, r"internal error: RuntimeError: planted bug.*--debug")),
    Case("cli.internal_error.debug", _internal_error(True), Exits(3, r"RuntimeError: planted bug", traceback=True)),
    Case("cli.inspect.png_dir", _cli("inspect", TRAINING, "--png", "{tmp}/no_such_dir/l.png"),
         Exits(2, r"--png.*no_such_dir")),
    Case("cli.inspect.max_rows", _cli("inspect", TRAINING, "--max-rows", "-1"),
         Exits(2, r"--max-rows: -1 is not an int >= 0")),
    Case("cli.invariance.samples", _cli("invariance", "--samples", "1"), Exits(2, r"--samples: 1 is not an int >= 2")),
    Case("cli.invariance.response_length",
         _cli("invariance", "--samples", "2", "--cases", "packed", "--no-control", "--backend", "torch",
              "--response-length", "0"), Exits(2, r"--response-length: 0 is not an int >= 1")),
    Case("cli.invariance.device", _cli("invariance", "--device", "tpu"), Exits(2, r"--device: 'tpu'")),
    Case("cli.invariance.json_dir",
         _cli("invariance", "--samples", "2", "--cases", "packed", "--no-control", "--backend", "torch",
              "--response-length", "2", "--json", "{tmp}/no_such_dir/r.json"), Exits(2, r"--json.*no_such_dir")),
    Case("cli.invariance.model_path", _cli("invariance", "--model-path", "{tmp}/no_model"),
         Exits(2, r"--model-path.*no_model")),
    Case("cli.smoke.steps", _smoke("--steps", "-1"), Exits(2, r"--steps: -1 is not an int >= 1")),
    Case("cli.smoke.prompts", _smoke("--prompts", "0"), Exits(2, r"--prompts: 0 is not an int >= 1")),
    Case("cli.smoke.temperature", _smoke("--temperature", "0"),
         Exits(2, r"--temperature: 0(\.0)? is not a number >= 1e-05")),
    Case("cli.smoke.lr", _smoke("--lr", "nan"), Exits(2, r"--lr: nan is not a number > 0")),
    Case("cli.smoke.lr_floor_high", _smoke("--lr-floor", "1.5"), Exits(2, r"--lr-floor: 1.5 is not a number <= 1")),
    Case("cli.smoke.lr_floor_low", _smoke("--lr-floor", "-0.1"), Exits(2, r"--lr-floor: -0.1 is not a number >= 0")),
    Case("cli.smoke.lr_floor_inf", _smoke("--lr-floor", "inf"), Exits(2, r"--lr-floor: inf is not a number >= 0")),
    Case("cli.smoke.data", _smoke("--data", "{tmp}/no_geo3k"), Exits(2, r"--data: .*no_geo3k")),
    Case("cli.smoke.device", _smoke("--device", "tpu"), Exits(2, r"--device: 'tpu'")),
    Case("cli.smoke.out_file", _smoke("--out", TRAINING), Exits(2, r"--out: .* is a file: give a folder")),
    Case("cli.smoke.out_under_file", _smoke("--out", f"{TRAINING}/run"), Exits(2, r"--out: .* is a file, so the folder cannot be made")),
    Case("cli.smoke.out_empty", _smoke("--out", ""), Exits(2, r"--out: an empty path")),
    Case("cli.smoke.image_swap", _smoke("--break", "image-swap", "--prompts", "2"),
         Exits(2, r"--break image-swap needs --prompts >= 5")),
]


GOOD = [
    Case("cli.parity.offline_decode", _cli("parity", DRIFT, TRAINING),
         Exits(1, r"'<\|vision_start\|>' '<\|image_pad\|>' \['<\|image_pad\|>'\]")),
    Case("cli.parity.debug_flag", _cli("parity", TRAINING, TRAINING, "--debug"), Exits(0, r"layout parity OK")),
]


@pytest.mark.parametrize("case", BAD + GOOD, ids=lambda case: case.id)
def test_input(case, input_context):
    assert_well(case, input_context)

