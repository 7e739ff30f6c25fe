"""Unusual and bad input to the public API of ``rlk_mm.grounding`` (docs/api/grounding.md): parsing
(``parse_grounding``, ``find_regions``, ``check_values``, ``token_bytes``), the rewards (``box_iou``,
``box_giou``, ``point_in_box``, ``grounding_rewards``) and GUI actions (``parse_action``,
``action_match``), fed wrong types, bools for numbers, nan and inf, empty and huge values, mismatched
lengths, unicode and groundings of another batch. Each case must give its documented result or an
error of rlk_mm's naming the argument and saying what to change (``context_cases.classify``)."""

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from rlk_mm.grounding import (
    Convention,
    GroundingMetric,
    action_match,
    box_giou,
    box_iou,
    check_values,
    find_regions,
    grounding_rewards,
    parse_action,
    parse_grounding,
    point_in_box,
    token_bytes,
)
from rlk_mm.schema import RLBatch, SchemaError
from support.context_cases import Case, Raises, Returns, assert_well, fail
from support.helpers import raised_by_rlk_mm

ORIGINAL = (200, 150)  # resized by the processor to 196 x 140
CLICK = {"action": "click", "bbox_2d": [0, 0, 10, 10]}


@pytest.fixture(scope="module")
def ctx(processor):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    out = processor(text=[text], images=[Image.new("RGB", ORIGINAL, (250, 250, 250))], return_tensors="pt")
    c = type("Ctx", (), {})()
    c.processor = processor
    c.ids, c.grid, c.pixels = out["input_ids"][0].tolist(), out["image_grid_thw"], out["pixel_values"]
    c.batch = batch(c, ['{"bbox_2d": [49, 28, 98, 70]}', '{"point_2d": [98, 70]} ✓ 点'])
    c.other = batch(c, ['x' * 40 + '{"bbox_2d": [0, 0, 10, 10]}', "no"])
    c.g = [parse_grounding(c.batch, b, processor=processor) for b in range(2)]
    return c


def batch(c, texts: list[str]) -> RLBatch:
    B = len(texts)
    return RLBatch.from_token_lists([c.ids] * B, [c.processor.tokenizer.encode(t) + [151645] for t in texts],
                                    processor=c.processor, image_grid_thw=c.grid.repeat(B, 1), pixel_values=c.pixels.repeat(B, 1),
                                    screen_size=[ORIGINAL] * B, coordinate_system="absolute",
                                    bbox_targets=[[[50, 30, 100, 75]], [[90, 60, 110, 80]]][:B])


def ok(check):
    return Returns(lambda r, c: check(r, c) or fail(r))


BOX = torch.tensor([[0.0, 0.0, 2.0, 2.0]])
CASES = [
    # ---- check_values
    Case("check_values.short_box", lambda c: check_values("box", (1.0, 2.0), "normalized_1000", None),
         Raises(ValueError, r"values must be 4 numbers \(x1, y1, x2, y2\) for a box, got 2")),
    Case("check_values.kind", lambda c: check_values("circle", (1.0, 2.0), "normalized", None),
         Raises(ValueError, r"kind='circle': expected 'box' or 'point'")),
    Case("check_values.str_value", lambda c: check_values("point", ("a", 1.0), "normalized", None),
         Raises(TypeError, r"values\[0\] is str 'a'; coordinates are real numbers")),
    Case("check_values.bool_value", lambda c: check_values("point", (True, 0.5), "normalized", None),
         Raises(TypeError, r"values\[0\] is bool True; coordinates are real numbers")),
    Case("check_values.inside", lambda c: check_values("point", [1000, 0], "normalized_1000", None), ok(lambda r, c: r == "")),
    Case("check_values.numpy", lambda c: check_values("box", np.array([0.1, 0.1, 0.2, 0.2]), "normalized", None),
         ok(lambda r, c: r == "")),
    Case("check_values.nan", lambda c: check_values("point", (math.nan, 0.5), "normalized", None),
         ok(lambda r, c: "non-finite" in r)),
    Case("check_values.absolute", lambda c: check_values("point", (1, 1), "absolute", (10, 10)),
         Raises(SchemaError, r"system=absolute: a model writes resized, normalized or normalized_1000 coordinates")),
    Case("check_values.no_size", lambda c: check_values("point", (1, 1), "resized", None),
         Raises(TypeError, r"resized_size must be \(width, height\)")),
    # ---- find_regions / token_bytes
    Case("find_regions.bytearray", lambda c: find_regions(bytearray(b"{}"), "qwen2_5_vl"),
         Raises(TypeError, r"data must be bytes")),
    Case("find_regions.huge_number", lambda c: find_regions(b'"point_2d": [1e999, 2]', "qwen3_vl"),
         ok(lambda r, c: r[0].values == (math.inf, 2.0))),
    Case("find_regions.unicode", lambda c: find_regions('"bbox_2d": [1, 2, 3, 4] ✓'.encode(), Convention.QWEN2_5_VL),
         ok(lambda r, c: r[0].values == (1, 2, 3, 4))),
    Case("find_regions.many", lambda c: find_regions(b'"point_2d": [1, 2],' * 20_000, "ui_tars_1_5"),
         ok(lambda r, c: len(r) == 20_000)),
    Case("find_regions.empty", lambda c: find_regions(b"", "qwen2_vl"), ok(lambda r, c: r == [])),
    Case("token_bytes.negative", lambda c: token_bytes(c.processor.tokenizer, [-1]),
         Raises(ValueError, r"ids\[0\] is -1; token ids lie in \[0, \d+\)")),
    Case("token_bytes.str", lambda c: token_bytes(c.processor.tokenizer, "abc"),
         Raises(TypeError, r"ids must be a list of token ids \(ints\)")),
    Case("token_bytes.none_tokenizer", lambda c: token_bytes(None, [1]),
         Raises(TypeError, r"tokenizer must be a byte-level BPE tokenizer \(with convert_ids_to_tokens\)")),
    Case("token_bytes.tensor", lambda c: token_bytes(c.processor.tokenizer, torch.tensor([33, 34])),
         ok(lambda r, c: r == [b"B", b"C"])),
    # ---- parse_grounding
    Case("parse.sample_bool", lambda c: parse_grounding(c.batch, True, processor=c.processor),
         Raises(TypeError, r"sample must be an int, got bool")),
    Case("parse.image_bool", lambda c: parse_grounding(c.batch, 0, processor=c.processor, image=True),
         Raises(TypeError, r"image must be an int, got bool")),
    Case("parse.size_float", lambda c: parse_grounding(c.batch, 0, processor=c.processor, original_size=(200.0, 150)),
         Raises(TypeError, r"original_size\[0\] must be an int")),
    Case("parse.size_transposed", lambda c: parse_grounding(c.batch, 0, processor=c.processor, original_size=(150, 200)),
         Raises(SchemaError, r"original_size 150x200 cannot have been resized to the image's 196x140")),
    Case("parse.unicode", lambda c: parse_grounding(c.batch, 1, processor=c.processor),
         ok(lambda r, c: [g.absolute for g in r.regions] == [(100.0, 75.0)])),
    Case("parse.convention_enum", lambda c: parse_grounding(c.batch, 0, processor=c.processor, convention=Convention.QWEN3_VL),
         ok(lambda r, c: r.regions[0].absolute == (9.8, 4.2, 19.6, 10.5))),
    # ---- rewards
    Case("iou.int", lambda c: box_iou(BOX.long(), BOX), Raises(TypeError, r"pred must be float64/float32/float16/bfloat16")),
    Case("iou.empty", lambda c: box_iou(torch.zeros(0, 4), torch.zeros(0, 4)), ok(lambda r, c: r.shape == (0,))),
    Case("iou.mixed_dtypes", lambda c: box_iou(BOX.half(), BOX.double()), ok(lambda r, c: r.tolist() == [1.0])),
    Case("iou.meta", lambda c: box_iou(BOX.to("meta"), BOX.to("meta")),
         Raises(ValueError, r"pred is on the meta device, which holds no values")),
    Case("iou.devices", lambda c: box_iou(BOX, BOX.to("meta")), Raises(ValueError, r"target is on the meta device")),
    Case("giou.inf", lambda c: box_giou(torch.tensor([[0.0, 0.0, math.inf, 1.0]]), BOX),
         Raises(SchemaError, r"pred\[0\] is \[0.0, 0.0, inf, 1.0\]; coordinates must be finite")),
    Case("point_in_box.3d", lambda c: point_in_box(torch.zeros(1, 1, 2), BOX), Raises(ValueError, r"points must have shape")),
    Case("rewards.bool_failure", lambda c: grounding_rewards(c.batch, c.g, failure_reward=True),
         Raises(TypeError, r"failure_reward must be a number, got bool")),
    Case("rewards.metric_enum", lambda c: grounding_rewards(c.batch, c.g, metric=GroundingMetric.POINT_IN_BOX),
         ok(lambda r, c: r.sequence.tolist() == [0.0, 1.0])),
    Case("rewards.generator", lambda c: grounding_rewards(c.batch, (g for g in c.g)), ok(lambda r, c: r.sequence[0] == 1.0)),
    Case("rewards.set", lambda c: grounding_rewards(c.batch, frozenset()),
         Raises(TypeError, r"groundings must be a list of Grounding .* got frozenset: a set has no order")),
    Case("rewards.other_batch", lambda c: grounding_rewards(c.other, c.g),
         Raises(SchemaError, r"groundings\[1\]: span \[\d+, \d+\) is not inside a loss span of sample 1 of this batch "
                             r"\(its loss spans: \[\(\d+, \d+\)\]\): the groundings come from another batch; parse each sample")),
    Case("rewards.numpy_failure", lambda c: grounding_rewards(c.batch, c.g, failure_reward=np.float32(-1)),
         ok(lambda r, c: r.sequence.tolist() == [1.0, -1.0])),
    # ---- GUI actions
    Case("parse_action.deep", lambda c: parse_action('{"action": "click", "x": ' + "[" * 100_000),
         ok(lambda r, c: r is None)),
    Case("parse_action.nan", lambda c: parse_action('{"action": "click", "point_2d": [NaN, 1]}'),
         ok(lambda r, c: math.isnan(r["point_2d"][0]))),
    Case("parse_action.unicode", lambda c: parse_action('点击 {"action": "type", "text": "你好"}'),
         ok(lambda r, c: r == {"action": "type", "text": "你好"})),
    Case("parse_action.huge", lambda c: parse_action("{" * 200_000), ok(lambda r, c: r is None)),
    Case("action_match.nan_point", lambda c: action_match([{"action": "click", "point_2d": [math.nan, 1]}], [CLICK]),
         ok(lambda r, c: r.tolist() == [0.5])),
    Case("action_match.bool_box", lambda c: action_match([None], [{"action": "click", "bbox_2d": [0, 0, True, 1]}]),
         Raises(ValueError, r"targets\[0\]\['bbox_2d'\] is \[0, 0, True, 1\]; a target box is four real numbers")),
    Case("action_match.dict", lambda c: action_match({"a": 1}, [CLICK]), Raises(TypeError, r"actions must be a list")),
    Case("action_match.set", lambda c: action_match([None], frozenset()), Raises(TypeError, r"targets .* got frozenset")),
    Case("action_match.inf_failure", lambda c: action_match([None], [CLICK], failure_reward=math.inf),
         Raises(ValueError, r"failure_reward=inf must be a finite number")),
    Case("action_match.empty", lambda c: action_match([], []), ok(lambda r, c: r.shape == (0,))),
    Case("action_match.target_str", lambda c: action_match([None], ["click"]),
         Raises(ValueError, r"targets\[0\] is 'click'; a target is a dict with an 'action'")),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_input(case, ctx):
    assert_well(case, ctx)


VALUE = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2000, 2000), st.booleans(), st.none(),
                  st.text(max_size=3))


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["box", "point", "poly", 4]), st.lists(VALUE, max_size=5),
       st.sampled_from(["normalized", "normalized_1000", "resized"]))
def test_check_values_never_fails_raw(kind, values, system):
    """Any kind, any values, any system a model writes: a reason string ("" when inside the image)
    or an error of rlk_mm's naming the argument, never a raw Python error."""
    try:
        reason = check_values(kind, tuple(values), system, (196, 140))
    except (TypeError, ValueError) as e:
        assert raised_by_rlk_mm(e), f"{type(e).__name__}: {e}"
        assert re.search(r"kind=|values", str(e)), str(e)
        return
    width = {"normalized": 1, "normalized_1000": 1000, "resized": 196}[system]
    height = 140 if system == "resized" else width
    inside = all(math.isfinite(v) and 0 <= v <= (width, height)[i % 2] for i, v in enumerate(values))
    ordered = kind == "point" or (values[0] <= values[2] and values[1] <= values[3])
    assert (reason == "") == (inside and ordered), reason
