"""The parity diagnosis names the real cause or none, on the checked-in traces
and on single changes of one batch."""

from pathlib import Path

import pytest

from rlk_mm import RLBatch
from rlk_mm.fixtures import processor_inputs, synthetic_image_text
from rlk_mm.parity import check_layout_parity

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "parity"


def diagnosis(case):
    report = check_layout_parity(RLBatch.load(FIXTURES / f"{case}.rollout.safetensors"),
                                 RLBatch.load(FIXTURES / "training.safetensors"))
    return report.first.diagnosis if report.first else None


@pytest.mark.parametrize("case, says, never", [
    ("chat_template_whitespace",
     r"a text token differs and the processor fingerprints differ: .* chat templates or tokenizers",
     "pixel values"),
    ("reprocessed_image", r"fingerprints are equal: the input image differs", "other processor settings"),
    ("different_max_pixels", r"the rollout's processor has other settings \(the processor fingerprints differ\)",
     "input image"),
    ("missing_mm_token_type_ids", r"rollout's positions are 1-D .* without mm_token_type_ids", "pixel"),
])
def test_traces_get_their_real_cause(case, says, never):
    text = diagnosis(case)
    assert text is not None and pytest.importorskip("re").search(says, text), text
    assert never not in text


@pytest.mark.parametrize("case", ["different_eos_token", "left_vs_right_padding"])
def test_no_cause_is_guessed(case):
    assert diagnosis(case) is None


@pytest.fixture(scope="module")
def batch(processor):
    out = processor_inputs(processor, synthetic_image_text(1, seed=4, max_images=1, sizes=[(56, 56)]))
    return RLBatch.from_qwen_vl(out, processor=processor, responses=[[5, 151645]])


def _with(batch, **fields):
    return RLBatch(**{**{n: getattr(batch, n) for n in type(batch).model_fields}, **fields})


def test_other_pixels_same_grid(batch):
    other = _with(batch, pixel_values=batch.pixel_values + 1, media_cache_keys=["other"], media_ids=["other"])
    text = check_layout_parity(other, batch).first.diagnosis
    assert "same grid, other pixel values" in text


def test_same_pixels_other_keys(batch):
    other = _with(batch, media_cache_keys=["given-by-caller"], media_ids=["given-by-caller"])
    text = check_layout_parity(other, batch).first.diagnosis
    assert "identical pixel rows under other cache keys" in text


def test_no_pixels_kept_says_it_cannot_tell(batch):
    a = _with(batch, pixel_values=None, media_cache_keys=["a"], media_ids=["a"])
    b = _with(batch, pixel_values=None)
    text = check_layout_parity(a, b).first.diagnosis
    assert "no pixel rows to tell whether the pixels differ" in text and "other pixel values" not in text


def test_positions_that_are_not_one_d_get_no_position_cause(batch):
    pos = batch.position_ids.clone()
    pos[:, -1] += 1  # the last response token one step further: not the 1-D pattern
    report = check_layout_parity(_with(batch, position_ids=pos), batch)
    assert report.first.field.startswith("position_ids") and report.first.diagnosis is None
