"""Drift diagnosis: check_layout_parity's first mismatch names the media item, both sides'
placeholder counts, grids and resize settings, and the cause (other resize settings,
placeholders expanded twice, other pixels), on batches built by the real processor."""

import torch
from PIL import Image, ImageDraw

from rlk_mm import RLBatch
from rlk_mm.fixtures import qwen_vl_processor
from rlk_mm.parity import check_layout_parity


def _diagram(seed: int, size=(336, 224)) -> Image.Image:
    image = Image.new("RGB", size, (250, 250, 250))
    ImageDraw.Draw(image).ellipse((20 + seed, 20, 200, 180), outline=(0, 0, 0), width=3)
    return image


def _messages(image, **settings):
    return [{"role": "user", "content": [{"type": "image", "image": image, **settings}, {"type": "text", "text": "Find x."}]}]


def test_other_resize_settings_are_named(processor):
    question = [_messages(_diagram(0)), _messages(_diagram(1))]
    rollout = RLBatch.from_messages([question[0], _messages(_diagram(1), max_pixels=12544)], processor=processor)
    training = RLBatch.from_messages(question, processor=processor)
    report = check_layout_parity(rollout, training, tokenizer=processor.tokenizer)
    assert report.first.diagnosis == (
        "sample 1, image #0: rollout 12 placeholder tokens (grid 1×6×8, resized 112×84 from 336×224, min_pixels 3136, "
        "max_pixels 12544) vs training 54 placeholder tokens (grid 1×12×18, resized 252×168 from 336×224, min_pixels 3136, "
        "max_pixels 50176): "
        "the rollout resized with other settings (the recorded resize settings differ)"
    )
    text = report.first.describe()
    assert text.startswith(report.first.diagnosis) and "(media_ids: sample 1, position 15" in text  # the field-level detail stays
    assert str(report).splitlines()[1] == "first: " + report.first.diagnosis
    assert report.to_dict()["first"]["diagnosis"] == report.first.diagnosis


def test_other_processor_settings_are_named_without_recorded_settings(processor):
    narrow = qwen_vl_processor(max_pixels=12544)
    image = _diagram(0)
    text = processor.apply_chat_template(_messages(image), tokenize=False, add_generation_prompt=True)
    rollout = RLBatch.from_qwen_vl(narrow(text=[text], images=[image], return_tensors="pt"), processor=narrow)
    training = RLBatch.from_qwen_vl(processor(text=[text], images=[image], return_tensors="pt"), processor=processor)
    first = check_layout_parity(rollout, training).first
    assert first.diagnosis == ("sample 0, image #0: rollout 12 placeholder tokens (grid 1×6×8) vs training 54 placeholder tokens "
                               "(grid 1×12×18): the rollout's processor has other settings (the processor fingerprints differ)")


def test_placeholders_expanded_twice_are_named(processor):
    image = _diagram(0, size=(112, 84))
    text = processor.apply_chat_template(_messages(image), tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text, text], images=[image, image], return_tensors="pt")
    training = RLBatch.from_qwen_vl(inputs, processor=processor)
    # the rollout engine expanded sample 1's placeholders again (and listed the grid twice)
    ids = [row.tolist() for row in inputs["input_ids"]]
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    first = ids[1].index(pad)
    n = ids[1].count(pad)
    doubled = ids[1][:first] + [pad] * (2 * n) + ids[1][first + n :]
    grid = inputs["image_grid_thw"]
    rows = int(grid[0].prod())
    rollout = RLBatch.from_token_lists(
        [ids[0], doubled], processor=processor, image_grid_thw=torch.cat([grid, grid[1:]]),
        pixel_values=torch.cat([inputs["pixel_values"], inputs["pixel_values"][rows:]]),
    )
    first_mismatch = check_layout_parity(rollout, training).first
    assert first_mismatch.diagnosis == (
        f"sample 1, image #0: rollout {2 * n} placeholder tokens where its grid {'×'.join(map(str, grid[1].tolist()))} "
        f"implies {n}: placeholders expanded twice"
    )


def test_same_grid_other_pixels_and_no_diagnosis_without_media_drift(processor):
    a, b = _diagram(0), _diagram(9)
    rollout = RLBatch.from_messages([_messages(a)], processor=processor)
    training = RLBatch.from_messages([_messages(b)], processor=processor)
    first = check_layout_parity(rollout, training).first
    assert first.field == "media_ids" and first.diagnosis.endswith(
        "same grid, other pixel values: another image, or other resampling or normalization")
    # a text-only drift: no media diagnosis, the plain message
    other = RLBatch.from_messages([[{"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "Find y."}]}]],
                                  processor=processor)
    first = check_layout_parity(other, rollout).first
    assert first.field == "input_ids" and first.diagnosis is None and first.describe().startswith("input_ids: sample 0")
    assert check_layout_parity(rollout, rollout).ok
