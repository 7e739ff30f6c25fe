"""rlk_mm.schema grounding: convert_points / convert_boxes between the coordinate systems
(absolute, resized, normalized, normalized_1000): round trips between every pair, known
values, dtypes, and the errors for bad input."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm.schema import CoordinateSystem, SchemaError, convert_boxes, convert_points

SYSTEMS = list(CoordinateSystem)
ORIGINAL, RESIZED = (640, 480), (448, 336)  # (width, height)
SIZES = dict(original_size=ORIGINAL, resized_size=RESIZED)

#: one point in every system: the middle of the image, and a corner-ish point
KNOWN = {
    CoordinateSystem.ABSOLUTE: [[320.0, 240.0], [64.0, 432.0]],
    CoordinateSystem.NORMALIZED: [[0.5, 0.5], [0.1, 0.9]],
    CoordinateSystem.NORMALIZED_1000: [[500.0, 500.0], [100.0, 900.0]],
    CoordinateSystem.RESIZED: [[224.0, 168.0], [44.8, 302.4]],
}


def test_the_four_systems():
    assert [s.value for s in SYSTEMS] == ["absolute", "resized", "normalized", "normalized_1000"]
    assert CoordinateSystem.parse("normalized_1000", "system") is CoordinateSystem.NORMALIZED_1000


@pytest.mark.parametrize("source,target", list(itertools.product(SYSTEMS, SYSTEMS)), ids=lambda s: s.value)
def test_known_values_between_every_pair(source, target):
    points = torch.tensor(KNOWN[source], dtype=torch.float64)
    expected = torch.tensor(KNOWN[target], dtype=torch.float64)
    got = convert_points(points, source, target, **SIZES)
    assert got.dtype == torch.float64 and got.shape == points.shape
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # the same as plain strings, and as boxes made of the two points
    assert torch.equal(convert_points(points, source.value, target.value, **SIZES), got)
    boxes = convert_boxes(points.reshape(1, 4), source, target, **SIZES)
    torch.testing.assert_close(boxes, expected.reshape(1, 4), rtol=1e-12, atol=1e-12)


def test_width_scales_x_and_height_scales_y():
    """A non-square image: x goes with the width, y with the height, in every box corner."""
    box = torch.tensor([[0.25, 0.5, 0.75, 1.0]])
    assert convert_boxes(box, "normalized", "absolute", original_size=(200, 100)).tolist() == [[50.0, 50.0, 150.0, 100.0]]
    assert convert_boxes(box, "normalized", "resized", resized_size=(28, 56)).tolist() == [[7.0, 28.0, 21.0, 56.0]]
    assert convert_points(torch.tensor([1000.0, 0.0]), "normalized_1000", "normalized").tolist() == [1.0, 0.0]


def test_same_system_is_the_identity():
    fractions = torch.rand(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for system in SYSTEMS:
        points = fractions * torch.tensor(EXTENT[system], dtype=torch.float64)
        assert torch.equal(convert_points(points, system, system, **SIZES), points)


SIZE = st.tuples(st.integers(1, 4096), st.integers(1, 4096))
#: the image's (width, height) in each system at SIZES
EXTENT = {CoordinateSystem.ABSOLUTE: ORIGINAL, CoordinateSystem.RESIZED: RESIZED,
          CoordinateSystem.NORMALIZED: (1, 1), CoordinateSystem.NORMALIZED_1000: (1000, 1000)}


@st.composite
def fractions(draw, last):
    """A float64 tensor [..., last] of (x, y) fractions of the image, in [0, 1] (edges included)."""
    lead = draw(st.sampled_from([(), (0,), (3,), (2, 3)]))
    n = last * (torch.Size(lead).numel())
    values = draw(st.lists(st.one_of(st.floats(0, 1), st.sampled_from([0.0, 1.0])), min_size=n, max_size=n))
    return torch.tensor(values, dtype=torch.float64).reshape(*lead, last)


def inside(system, fraction: torch.Tensor, sizes: dict) -> torch.Tensor:
    """Coordinates of ``system`` at those fractions of the image (boxes sorted: x0 <= x1, y0 <= y1)."""
    width, height = {CoordinateSystem.ABSOLUTE: sizes["original_size"], CoordinateSystem.RESIZED: sizes["resized_size"],
                     CoordinateSystem.NORMALIZED: (1, 1), CoordinateSystem.NORMALIZED_1000: (1000, 1000)}[system]
    return fraction * torch.tensor([width, height], dtype=torch.float64).repeat(fraction.shape[-1] // 2)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(SYSTEMS), st.sampled_from(SYSTEMS), st.sampled_from(SYSTEMS),
    fractions(2), fractions(4), SIZE, SIZE,
)
def test_round_trips_between_every_pair(source, target, via, points, boxes, original, resized):
    """source -> target -> source gives the input back; going through a third system gives
    the direct conversion; boxes convert as their two corner points (points inside the image,
    which the conversion keeps inside up to rounding, so each step converts)."""
    sizes = dict(original_size=original, resized_size=resized)
    points, boxes = inside(source, points, sizes), inside(source, boxes, sizes)
    close = dict(rtol=1e-12, atol=1e-9)
    there = convert_points(points, source, target, **sizes)
    assert there.shape == points.shape and there.dtype == torch.float64
    torch.testing.assert_close(convert_points(there, target, source, **sizes), points, **close)
    through = convert_points(convert_points(points, source, via, **sizes), via, target, **sizes)
    torch.testing.assert_close(through, there, **close)
    box_there = convert_boxes(boxes, source, target, **sizes)
    assert box_there.shape == boxes.shape
    corners = convert_points(boxes.reshape(*boxes.shape[:-1], 2, 2), source, target, **sizes)
    assert torch.equal(box_there, corners.reshape(boxes.shape))
    torch.testing.assert_close(convert_boxes(box_there, target, source, **sizes), boxes, **close)


@pytest.mark.parametrize(
    "dtype,out",
    [
        (torch.int64, torch.float32), (torch.int32, torch.float32), (torch.uint8, torch.float32),
        (torch.float64, torch.float64), (torch.float32, torch.float32), (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtypes(dtype, out):
    """Integer coordinates come back float32; floating ones keep their dtype (computed in fp64)."""
    points = torch.tensor([[160, 240], [64, 200]]).to(dtype)  # exact in every dtype here
    got = convert_points(points, "absolute", "normalized_1000", original_size=ORIGINAL)
    assert got.dtype == out
    expected = torch.tensor([[250.0, 500.0], [100.0, 1000 * 200 / 480]], dtype=torch.float64)
    torch.testing.assert_close(got.double(), expected, rtol=torch.finfo(out).eps, atol=0)  # one rounding of the fp64 result
    assert convert_boxes(points.reshape(1, 4), "absolute", "normalized", original_size=ORIGINAL).dtype == out


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: convert_points(torch.zeros(3, 3), "absolute", "normalized", **SIZES),
         r"points must have a last dimension of 2 \(x, y\), got shape \(3, 3\)"),
        (lambda: convert_points(torch.zeros(4), "normalized", "normalized"),
         r"points must have a last dimension of 2 .* got shape \(4,\)"),
        (lambda: convert_boxes(torch.zeros(5, 2), "absolute", "normalized", **SIZES),
         r"boxes must have a last dimension of 4 \(x0, y0, x1, y1\), got shape \(5, 2\)"),
        (lambda: convert_points(torch.zeros(1, 2), "pixels", "normalized"),
         r"source='pixels': expected one of absolute, resized, normalized, normalized_1000"),
        (lambda: convert_boxes(torch.zeros(1, 4), "normalized", "Normalized"),
         r"target='Normalized': expected one of absolute, resized, normalized, normalized_1000"),
        (lambda: convert_points(torch.zeros(1, 2), "absolute", "normalized", resized_size=RESIZED),
         r"converting absolute coordinates needs the original image size \(width, height\)"),
        (lambda: convert_points(torch.zeros(1, 2), "normalized", "absolute"),
         r"converting absolute coordinates needs the original image size"),
        (lambda: convert_boxes(torch.zeros(1, 4), "resized", "normalized_1000", original_size=ORIGINAL),
         r"converting resized coordinates needs the resized image size \(width, height\)"),
        (lambda: convert_points(torch.zeros(1, 2), "absolute", "resized", original_size=ORIGINAL),
         r"converting resized coordinates needs the resized image size"),
    ],
    ids=["points-last-dim", "points-flat", "boxes-last-dim", "unknown-source", "unknown-target",
         "absolute-no-original", "to-absolute-no-original", "resized-no-resized", "to-resized-no-resized"],
)
def test_bad_input_raises_a_schema_error_naming_it(call, match):
    with pytest.raises(SchemaError, match=match):
        call()


def test_normalized_systems_need_no_sizes():
    points = torch.tensor([[0.5, 0.25]])
    assert convert_points(points, "normalized", "normalized_1000").tolist() == [[500.0, 250.0]]
    assert convert_boxes(torch.tensor([[0, 0, 1000, 500]]), "normalized_1000", "normalized").tolist() == [[0.0, 0.0, 1.0, 0.5]]
