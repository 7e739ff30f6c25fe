"""Coordinates outside the image never convert and never enter a batch: ``convert_boxes`` and
``convert_points`` refuse a coordinate outside the source system's image (0..1 normalized, 0..1000
normalized_1000, the original or resized size where given) or not finite, naming its index; the
builders refuse normalized ``bbox_targets`` / ``point_targets`` outside the image naming the argument,
the sample and the row, and so does every construction of a batch (select, concat, load). Nothing is
clamped. A table (``context_cases``) and properties over random coordinates."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlk_mm import RLBatch
from rlk_mm.schema import SchemaError, convert_boxes, convert_points
from support.context_cases import Case, Raises, Returns, assert_well, fail, make_schema_context

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SIZES = dict(original_size=(640, 480), resized_size=(448, 336))
EXTENT = {"normalized": (1, 1), "normalized_1000": (1000, 1000), "absolute": (640, 480), "resized": (448, 336)}
OUTSIDE = r"it lies outside the image \(0\.\.{} x 0\.\.{} in {} coordinates\)"


@pytest.fixture(scope="module")
def ctx(processor, tmp_path_factory):
    return make_schema_context(processor, tmp_path_factory.mktemp("ranges"))


def boxes(c, system="normalized", **targets) -> RLBatch:
    """The context's verl samples as token lists, with grounding targets in ``system``."""
    prompts, responses = c.verl_lists
    return RLBatch.from_token_lists(prompts, responses, processor=c.processor, coordinate_system=system, **targets)


def with_targets(c, system: str, rows, owners) -> RLBatch:
    """The context's batch with ``bbox_targets`` set field by field (the constructor's check)."""
    return RLBatch(**{**dict(c.batch), "coordinate_system": system, "bbox_targets": torch.tensor(rows, dtype=torch.float32),
                      "bbox_sample": torch.tensor(owners)})


def equals(want):
    return Returns(lambda r, c: r.tolist() == want or fail(r))


CASES = [
    # ---- convert_boxes / convert_points: the source system's image
    Case("convert.normalized.above_1", lambda c: convert_boxes(torch.tensor([[0.1, 0.2, 1.2, 0.9]]), "normalized", "absolute",
                                                               **SIZES),
         Raises(SchemaError, r"boxes\[0\] is \[0\.1, 0\.2, 1\.2, 0\.9\]: " + OUTSIDE.format(1, 1, "normalized")
                + r"; only coordinates inside the image convert \(nothing is clamped\): fix or drop that row")),
    Case("convert.normalized.below_0", lambda c: convert_points(torch.tensor([[0.5, 0.5], [-0.01, 0.3]]), "normalized",
                                                                "resized", **SIZES),
         Raises(SchemaError, r"points\[1\] is \[-0\.01, 0\.3\]: " + OUTSIDE.format(1, 1, "normalized"))),
    Case("convert.normalized_1000.above", lambda c: convert_points(torch.tensor([[1000.5, 3.0]]), "normalized_1000",
                                                                   "normalized"),
         Raises(SchemaError, r"points\[0\] is \[1000\.5, 3\.0\]: " + OUTSIDE.format(1000, 1000, "normalized_1000"))),
    Case("convert.absolute.beyond_width", lambda c: convert_boxes(torch.tensor([[0, 0, 641, 10]]), "absolute", "normalized",
                                                                  **SIZES),
         Raises(SchemaError, r"boxes\[0\] is \[0\.0, 0\.0, 641\.0, 10\.0\]: " + OUTSIDE.format(640, 480, "absolute"))),
    Case("convert.resized.beyond_height", lambda c: convert_points(torch.tensor([[[1.0, 337.0]]]), "resized", "absolute",
                                                                   **SIZES),
         Raises(SchemaError, r"points\[0\]\[0\] is \[1\.0, 337\.0\]: " + OUTSIDE.format(448, 336, "resized"))),
    Case("convert.nan", lambda c: convert_boxes(torch.tensor([[0.1, math.nan, 0.2, 0.3]]), "normalized", "normalized_1000"),
         Raises(SchemaError, r"boxes\[0\] is \[0\.1, nan, 0\.2, 0\.3\]: it is not finite")),
    Case("convert.inf.identity", lambda c: convert_points(torch.tensor([[math.inf, 0.0]]), "normalized", "normalized"),
         Raises(SchemaError, r"points\[0\] is \[inf, 0\.0\]: it is not finite")),
    Case("convert.bf16.above", lambda c: convert_points(torch.tensor([[1.01, 0.0]]).bfloat16(), "normalized", "absolute",
                                                        **SIZES),
         Raises(SchemaError, r"points\[0\] is \[1\.00781, 0\.0\]: " + OUTSIDE.format(1, 1, "normalized"))),
    Case("convert.edges", lambda c: convert_boxes(torch.tensor([[0.0, 0.0, 1.0, 1.0]]), "normalized", "absolute", **SIZES),
         equals([[0.0, 0.0, 640.0, 480.0]])),
    Case("convert.int_edges", lambda c: convert_points(torch.tensor([[1000, 0]]), "normalized_1000", "resized", **SIZES),
         equals([[448.0, 0.0]])),
    Case("convert.empty", lambda c: convert_boxes(torch.zeros(0, 4), "normalized", "absolute", **SIZES), equals([])),
    Case("convert.missing_size.first", lambda c: convert_points(torch.tensor([[5.0, 5.0]]), "normalized", "absolute"),
         Raises(SchemaError, r"converting absolute coordinates needs the original image size")),
    # ---- the builders: the argument, the sample and the row
    Case("build.bbox.normalized", lambda c: boxes(c, bbox_targets=[[[0.1, 0.1, 0.5, 0.5]], [[0.2, 0.2, 1.5, 0.4]]]),
         Raises(SchemaError, r"bbox_targets: sample 1, box 0 is \[0\.2, 0\.2, 1\.5, 0\.4\]; it lies outside the image "
                             r"\(0\.\.1 x 0\.\.1 in normalized coordinates\): fix or drop it")),
    Case("build.point.normalized_1000", lambda c: boxes(c, "normalized_1000", point_targets=[None, [[10, 20], [-1, 20]]]),
         Raises(SchemaError, r"point_targets: sample 1, point 1 is \[-1\.0, 20\.0\]; it lies outside the image \(0\.\.1000 x "
                             r"0\.\.1000 in normalized_1000 coordinates\)")),
    Case("build.bbox.pixels_any", lambda c: boxes(c, "absolute", bbox_targets=[[[0, 0, 5000, 9000]], None]),
         Returns(lambda b, c: b.bbox_targets.tolist() == [[0, 0, 5000, 9000]] or fail(b))),
    Case("build.bbox.edges", lambda c: boxes(c, bbox_targets=[[[0, 0, 1, 1]], [[0.5, 0.5, 0.5, 0.5]]]),
         Returns(lambda b, c: b.bbox_sample.tolist() == [0, 1] or fail(b))),
    # ---- every construction
    Case("construct.bbox.normalized", lambda c: with_targets(c, "normalized", [[0.1, 0.1, 0.5, 0.5], [0, 0, 1, 1.25]], [0, 2]),
         Raises(SchemaError, r"bbox_targets\[1\] \(sample 2\) is \[0\.0, 0\.0, 1\.0, 1\.25\]; it lies outside the image "
                             r"\(0\.\.1 x 0\.\.1 in normalized coordinates\)")),
    Case("construct.select", lambda c: RLBatch.model_construct(**{**dict(c.batch), "coordinate_system": "normalized_1000",
                                                                  "bbox_targets": torch.tensor([[0.0, 0, 1001, 5]]),
                                                                  "bbox_sample": torch.tensor([1])}).select([1]),
         Raises(SchemaError, r"bbox_targets\[0\] \(sample 0\) is \[0\.0, 0\.0, 1001\.0, 5\.0\]; it lies outside")),
    Case("construct.load_keeps", lambda c: RLBatch.load(with_targets(c, "normalized", [[0, 0, 1, 1]], [2]).save(
        c.tmp / "t.safetensors")), Returns(lambda b, c: b.bbox_targets.tolist() == [[0, 0, 1, 1]] or fail(b))),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_input(case, ctx):
    assert_well(case, ctx)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(list(EXTENT)), st.sampled_from(list(EXTENT)),
       st.lists(st.floats(-0.5, 1.5, allow_nan=False), min_size=4, max_size=4))
def test_a_conversion_refuses_exactly_the_coordinates_outside_the_image(source, target, fractions):
    """A box at random fractions of the image (some below 0 or above 1): it converts (to the same
    fractions of the target image) exactly when every fraction is in [0, 1], else it is refused
    naming its row and the source system."""
    width, height = EXTENT[source]
    box = torch.tensor([[fractions[0] * width, fractions[1] * height, fractions[2] * width, fractions[3] * height]],
                       dtype=torch.float64)
    inside = all(0 <= v <= EXTENT[source][k % 2] for k, v in enumerate(box[0].tolist()))
    if not inside:
        with pytest.raises(SchemaError, match=rf"boxes\[0\] is .*: it lies outside the image .* in {source} coordinates"):
            convert_boxes(box, source, target, **SIZES)
        return
    got = convert_boxes(box, source, target, **SIZES)
    scale = torch.tensor(EXTENT[target] * 2, dtype=torch.float64) / torch.tensor(EXTENT[source] * 2, dtype=torch.float64)
    torch.testing.assert_close(got, box * scale, rtol=1e-12, atol=1e-9)


@settings(max_examples=15, **SETTINGS)
@given(st.sampled_from(["normalized", "normalized_1000"]),
       st.lists(st.lists(st.floats(-0.2, 1.2, allow_nan=False), min_size=2, max_size=2), min_size=0, max_size=3),
       st.lists(st.lists(st.floats(-0.2, 1.2, allow_nan=False), min_size=2, max_size=2), min_size=0, max_size=3))
def test_builders_refuse_exactly_the_targets_outside_the_image(ctx, system, first, second):
    """Point targets at random fractions of the image for two samples: the batch builds (keeping them,
    bitwise as float32) exactly when all lie inside, else the first outside names its sample and row."""
    scale = EXTENT[system][0]
    rows = [[[x * scale, y * scale] for x, y in sample] for sample in (first, second)]
    bad = next(((b, j) for b, sample in enumerate(rows) for j, p in enumerate(sample)
                if not all(0 <= v <= scale for v in p)), None)  # the values as given, before float32
    if bad is None:
        batch = boxes(ctx, system, point_targets=rows)
        assert batch.point_targets.tolist() == torch.tensor([p for s in rows for p in s], dtype=torch.float32).reshape(-1, 2).tolist()
    else:
        with pytest.raises(SchemaError, match=rf"point_targets: sample {bad[0]}, point {bad[1]} is .*; it lies outside the "
                                              rf"image \(0\.\.{scale} x 0\.\.{scale} in {system} coordinates\)"):
            boxes(ctx, system, point_targets=rows)
