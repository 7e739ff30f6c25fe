"""Grounding: conversions exact at the image's edges and ``action_match``'s
equality (bools are not numbers, a point is any two real numbers)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm.grounding import action_match
from rlk_mm.schema import convert_boxes, convert_points

sizes = st.tuples(st.integers(1, 20_000), st.integers(1, 20_000))
systems = st.sampled_from(["resized", "normalized", "normalized_1000"])


def edge(system, size):
    return {"resized": size, "normalized": (1, 1), "normalized_1000": (1000, 1000)}[system]


@settings(max_examples=200, deadline=None)
@given(original=sizes, resized=sizes, source=systems, dtype=st.sampled_from([torch.float64, torch.float32]))
def test_edges_stay_edges(original, resized, source, dtype):
    """Property: (0, 0) and the far corner of any system land exactly on (0, 0) and the original
    image's far corner, bitwise, in float64 and float32, and back."""
    w, h = edge(source, resized)
    points = torch.tensor([[0, 0], [w, h]], dtype=dtype)
    got = convert_points(points, source, "absolute", original_size=original, resized_size=resized)
    assert torch.equal(got, torch.tensor([[0, 0], list(original)], dtype=dtype))
    back = convert_points(got, "absolute", source, original_size=original, resized_size=resized)
    assert torch.equal(back, points)
    box = convert_boxes(points.reshape(1, 4), source, "absolute", original_size=original, resized_size=resized)
    assert torch.equal(box, torch.tensor([[0, 0, *original]], dtype=dtype))


def test_the_60x203_corner():
    """The probe's case: the resized corner (56, 196) of a 60x203 image is (60, 203)."""
    got = convert_points(torch.tensor([[56.0, 196.0]], dtype=torch.float64), "resized", "absolute",
                         original_size=(60, 203), resized_size=(56, 196))
    assert got.tolist() == [[60.0, 203.0]]


CLICK_BOX = {"action": "click", "bbox_2d": [0, 0, 10, 10]}


@pytest.mark.parametrize("point", [[5, 5], (5, 5), np.array([5, 5]), np.array([5.0, 5.0]), torch.tensor([5, 5]),
                                   [np.int64(5), np.int64(5)], (5.0, 5)])
def test_a_point_is_any_two_real_numbers(point):
    assert action_match([{"action": "click", "point_2d": point}], [CLICK_BOX]).tolist() == [1.0]


@pytest.mark.parametrize("point", [[True, True], ["5", "5"], [5], [5, 5, 5], None, [float("nan"), 5], "5,5"])
def test_a_malformed_point_is_a_miss(point):
    assert action_match([{"action": "click", "point_2d": point}], [CLICK_BOX]).tolist() == [0.5]


@pytest.mark.parametrize("action, target, score", [
    ({"action": "type", "text": True}, {"action": "type", "text": 1}, 0.5),
    ({"action": "type", "text": 1.0}, {"action": "type", "text": True}, 0.5),
    ({"action": "type", "text": 1}, {"action": "type", "text": 1.0}, 1.0),
    ({"action": "type", "text": False}, {"action": "type", "text": False}, 1.0),
    ({"action": "scroll", "delta": (1, 2)}, {"action": "scroll", "delta": [1, 2]}, 1.0),
    ({"action": "scroll", "delta": [True, 2]}, {"action": "scroll", "delta": [1, 2]}, 0.5),
    ({"action": "type", "text": "1"}, {"action": "type", "text": 1}, 0.5),
])
def test_equality_keeps_bools_apart(action, target, score):
    assert action_match([action], [target]).tolist() == [score]


@pytest.mark.parametrize("box, match", [
    (["0", "0", "10", "10"],
     r"targets\[0\]\['bbox_2d'\] is \['0', '0', '10', '10'\]; a target box is four real numbers"),
    (None, r"targets\[0\]\['bbox_2d'\] is None"),
    ([0, 0, 10], r"four real numbers"),
    ([True, 0, 10, 10], r"four real numbers"),
    ([0, 0, float("inf"), 10], r"targets\[0\]\['bbox_2d'\]\[0\] .* coordinates must be finite"),
    ([10, 0, 0, 10], r"a box has x1 <= x2"),
])
def test_a_bad_target_box_is_refused_naming_it(box, match):
    with pytest.raises(ValueError, match=match):
        action_match([{"action": "click", "point_2d": [5, 5]}], [{"action": "click", "bbox_2d": box}])


@settings(max_examples=100, deadline=None)
@given(x=st.integers(-5, 15), y=st.integers(-5, 15), as_type=st.sampled_from([list, tuple, np.array, torch.tensor]))
def test_point_form_does_not_change_the_score(x, y, as_type):
    """Property: a point scores the same as a list, a tuple, an array or a tensor."""
    target = [CLICK_BOX]
    plain = action_match([{"action": "click", "point_2d": [x, y]}], target)
    assert torch.equal(action_match([{"action": "click", "point_2d": as_type([x, y])}], target), plain)
    assert plain.item() == (1.0 if 0 <= x <= 10 and 0 <= y <= 10 else 0.5)

