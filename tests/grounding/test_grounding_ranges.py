"""Grounding never converts a coordinate outside the image: ``parse_grounding`` records a model's
out-of-range box or point as a failure (never a region, never clamped), and ``grounding_rewards``
refuses a target outside its image in the target's own system (normalized, normalized_1000,
resized or absolute pixels), naming the target and the sample, before any conversion."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from rlk_mm.grounding import grounding_rewards, parse_grounding
from rlk_mm.schema import RLBatch, SchemaError
from support.context_cases import Case, Raises, Returns, assert_well, fail

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
ORIGINAL, RESIZED = (200, 150), (196, 140)  # (width, height): the processor resizes 200x150 to 196x140


@pytest.fixture(scope="module")
def ctx(processor):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    out = processor(text=[text], images=[Image.new("RGB", ORIGINAL, (250, 250, 250))], return_tensors="pt")
    return {"processor": processor, "ids": out["input_ids"][0].tolist(), "grid": out["image_grid_thw"],
            "pixels": out["pixel_values"]}


def batch(c, response: str, system: str = "absolute", target=None, construct: bool = False) -> RLBatch:
    """One sample answering ``response`` with one box target (field by field with ``construct``: a
    batch whose targets no builder checked, as a framework might hold it)."""
    tokens = c["processor"].tokenizer.encode(response) + [151645]
    built = RLBatch.from_token_lists([c["ids"]], [tokens], processor=c["processor"], image_grid_thw=c["grid"],
                                     pixel_values=c["pixels"], screen_size=[ORIGINAL])
    if target is None:
        return built
    fields = {**dict(built), "coordinate_system": system, "bbox_targets": torch.tensor([target], dtype=torch.float32),
              "bbox_sample": torch.tensor([0])}
    return RLBatch.model_construct(**fields) if construct else RLBatch(**fields)


def rewards(c, response: str, system: str, target, construct: bool = False):
    b = batch(c, response, system, target, construct)
    return grounding_rewards(b, [parse_grounding(b, 0, processor=c["processor"])])


def sequence(want):
    return Returns(lambda r, c: r.sequence.tolist() == pytest.approx(want) or fail(r.sequence))


ANSWER = '{"bbox_2d": [49, 28, 98, 70]}'  # resized pixels: (50, 30, 100, 75) of the original
CASES = [
    Case("target.absolute.beyond_width", lambda c: rewards(c, ANSWER, "absolute", [0, 0, 201, 10]),
         Raises(SchemaError, r"bbox_targets\[0\] \(sample 0\) is \[0\.0, 0\.0, 201\.0, 10\.0\] in absolute coordinates: it "
                             r"lies outside the 200x150 image \(0\.\.200 x 0\.\.150 in absolute coordinates\): fix or drop")),
    Case("target.resized.beyond_height", lambda c: rewards(c, ANSWER, "resized", [0, 0, 10, 141]),
         Raises(SchemaError, r"bbox_targets\[0\] \(sample 0\) is \[0\.0, 0\.0, 10\.0, 141\.0\] in resized coordinates: it lies "
                             r"outside the 200x150 image \(0\.\.196 x 0\.\.140 in resized coordinates\)")),
    Case("target.normalized.unchecked_batch", lambda c: rewards(c, ANSWER, "normalized", [0, 0, 1.5, 1], construct=True),
         Raises(SchemaError, r"bbox_targets\[0\] \(sample 0\) is \[0\.0, 0\.0, 1\.5, 1\.0\] in normalized coordinates: it lies "
                             r"outside the 200x150 image \(0\.\.1 x 0\.\.1")),
    Case("target.normalized_1000.negative", lambda c: rewards(c, ANSWER, "normalized_1000", [-5, 0, 10, 10], construct=True),
         Raises(SchemaError, r"bbox_targets\[0\] \(sample 0\) is \[-5\.0, 0\.0, 10\.0, 10\.0\] in normalized_1000")),
    Case("target.normalized_1000.built", lambda c: batch(c, ANSWER, "normalized_1000", [0, 0, 1000.5, 10]),
         Raises(SchemaError, r"bbox_targets\[0\] \(sample 0\) is \[0\.0, 0\.0, 1000\.5, 10\.0\]; it lies outside the image")),
    Case("target.edges.absolute", lambda c: rewards(c, '{"bbox_2d": [0, 0, 196, 140]}', "absolute", [0, 0, 200, 150]),
         sequence([1.0])),
    Case("target.edges.normalized", lambda c: rewards(c, '{"bbox_2d": [0, 0, 196, 140]}', "normalized", [0, 0, 1, 1]),
         sequence([1.0])),
    Case("answer.outside.failure", lambda c: rewards(c, '{"bbox_2d": [0, 0, 197, 140]}', "absolute", [0, 0, 200, 150]),
         Returns(lambda r, c: (r.sequence.tolist() == [0.0] and r.region.values.tolist() == [0.0]) or fail(r))),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_input(case, ctx):
    assert_well(case, ctx)


@settings(max_examples=20, **SETTINGS)
@given(st.sampled_from(["qwen2_5_vl", "qwen3_vl"]), st.lists(st.integers(-50, 1100), min_size=2, max_size=2))
def test_an_answer_outside_the_image_is_a_failure_never_a_region(ctx, convention, point):
    """A model's point at random coordinates (some off the image): a region converted to original
    pixels exactly when it lies inside the image in the convention's system, else a recorded failure."""
    b = batch(ctx, '{"point_2d": [%d, %d]}' % tuple(point))
    g = parse_grounding(b, 0, processor=ctx["processor"], convention=convention)
    width, height = RESIZED if convention == "qwen2_5_vl" else (1000, 1000)
    if 0 <= point[0] <= width and 0 <= point[1] <= height:
        assert not g.failures and len(g.regions) == 1
        want = (point[0] * ORIGINAL[0] / width, point[1] * ORIGINAL[1] / height)
        assert g.regions[0].absolute == pytest.approx(want, rel=1e-12)
    else:
        assert not g.regions and len(g.failures) == 1
        assert "lies outside the image" in g.failures[0].reason
