"""`rlk-mm smoke --task point`: the synthetic screens, the reward in each JSON convention (through
rlk_mm.grounding, original pixels, never clamped), the shuffled-target control, and a short run
whose four gates pass on CPU."""

import json
import random

import numpy as np
import pytest
import torch

from rlk_mm import smoke
from rlk_mm.fixtures import processor_inputs
from rlk_mm.fixtures.palette import ANSWER_COLOURS
from rlk_mm.grounding import Convention
from rlk_mm.smoke.tasks import TASKS
from rlk_mm.smoke.tasks.point import (
    OUTCOMES,
    STRIP_SHADES,
    moved_mask,
    point_diagnostics,
    point_outcome,
    point_reward,
    point_sample,
    point_task,
    resized_size,
    third_edges,
)

GATES = ("(a) layout parity", "(b) log-prob consistency", "(c) loss masking", "(d) on-policy ratio")


def test_screens_masks_and_resized_sizes_agree_with_the_processor(processor):
    task = point_task()
    samples = task.batch(random.Random(0), 12, "t")
    grids = processor_inputs(processor, samples, padding_side="left")["image_grid_thw"]
    for s, grid in zip(samples, grids.tolist()):
        assert s.meta["resized"] == resized_size(s.meta["size"]) == (grid[2] * 14, grid[1] * 14)
        assert s.meta["resized"] != s.meta["size"]  # the answer's pixels are not the screen's
        assert s.meta["colour"] in s.messages[0]["content"][1]["text"] and s.meta["rewarded"] == s.meta["colour"]
        mask = s.meta["mask"]
        assert mask.shape == (s.meta["size"][1], s.meta["size"][0]) and 0 < mask.mean() < 0.3
        assert s.images[0].getpixel(tuple(int(v) for v in torch.nonzero(torch.from_numpy(mask))[0].flip(0))) == \
            ANSWER_COLOURS[s.meta["colour"]]
        assert point_reward(task.answer_text(s.answer), s) == 1.0  # the centre of the target is inside it


def test_reward_reads_the_convention_and_never_clamps():
    task = point_task()
    s = task.batch(random.Random(1), 1, "t")[0]
    rw, rh = s.meta["resized"]
    x, y = (int(v) for v in s.answer.split(", "))
    assert point_reward('I click {"point_2d": [%d, %d]} now' % (x, y), s) == 1.0
    outside = [(0, 0), (rw, rh), (rw + 40, y), (x, -3)]
    for px, py in outside:
        assert point_reward('{"point_2d": [%d, %d]}' % (px, py), s) == 0.0
    for text in ["", "%d, %d" % (x, y), '{"bbox_2d": [%d, %d, %d, %d]}' % (x, y, x, y), '{"point_2d": [%d]}' % x,
                 '{"point_2d": [%d, %d, 3]}' % (x, y), '{"point_2d": [1e9, %d]}' % y]:
        assert point_reward(text, s) == 0.0, text
    # the point is converted from resized to original pixels: every pixel of the shape, written in
    # resized pixels, is a hit; the same numbers written as if the screen were not resized miss somewhere
    w, h = s.meta["size"]
    rows, cols = s.meta["mask"].nonzero()
    resized_hits = [point_reward('{"point_2d": [%.3f, %.3f]}' % ((c + 0.5) * rw / w, (r + 0.5) * rh / h), s)
                    for r, c in zip(rows, cols)]
    unconverted = [point_reward('{"point_2d": [%.3f, %.3f]}' % (c + 0.5, r + 0.5), s) for r, c in zip(rows, cols)]
    assert all(v == 1.0 for v in resized_hits) and min(unconverted) == 0.0
    # Qwen3-VL: 0-1000 coordinates
    q3 = point_task("qwen3_vl")
    s3 = q3.batch(random.Random(1), 1, "t")[0]
    assert "0 to 1000" in s3.messages[0]["content"][1]["text"]
    assert point_reward(q3.answer_text(s3.answer), s3) == 1.0
    assert point_reward('{"point_2d": [1000, 1000]}', s3) == float(s3.meta["mask"][-1, -1])  # the corner is in range
    assert point_reward('{"point_2d": [1001, 5]}', s3) == 0.0
    with pytest.raises(ValueError, match="skip_special_tokens"):
        point_task("qwen2_vl")
    with pytest.raises(ValueError, match="convention='qwen9'"):
        point_task("qwen9")


def test_the_three_shape_control_rewards_a_random_shape():
    samples = point_task(shuffled=True, shapes=3).batch(random.Random(2), 60, "t")
    same = sum(s.meta["rewarded"] == s.meta["colour"] for s in samples)
    assert 5 < same < 40  # about a third: the rewarded shape is independent of the one asked for
    other = next(s for s in samples if s.meta["rewarded"] != s.meta["colour"])
    # clicking the named shape is not rewarded
    assert point_reward(point_task().answer_text(other.answer), other) == 0.0
    assert {"point-three", "point-three-shuffled"} <= set(TASKS) and TASKS["point-three"](None).name == "point-three"
    for bad in (2, 0, True, "3", None):
        with pytest.raises(ValueError, match=rf"shapes={bad!r}: a point screen holds 1 shape \(point\) or 3"):
            point_task(shapes=bad)
        with pytest.raises(ValueError, match=r"a point screen holds 1 shape"):
            point_sample(random.Random(0), "x", Convention.QWEN2_5_VL, False, bad)


def test_each_shape_fills_most_of_its_third_and_the_thirds_are_token_columns(processor):
    samples = point_task(shapes=3).batch(random.Random(3), 24, "t")
    grids = processor_inputs(processor, samples, padding_side="left")["image_grid_thw"]
    assert {tuple(g) for g in grids.tolist()} == {(1, 6, 6)}  # 84 x 84 resized: 3 x 3 tokens after the 2 x 2 merge
    for s in samples:
        width = s.meta["size"][0]
        for colour in s.meta["masks"]:
            cols = s.meta["masks"][colour].any(0).nonzero()[0]
            edges = [round(k * width / 3) for k in range(4)]
            third = [k for k in range(3) if edges[k] <= cols.min() and cols.max() < edges[k + 1]]
            assert len(third) == 1 and cols.size >= 0.7 * width / 3, (s.id, colour)
    # in the answer's pixels a third is one x range on every screen: the centres' tens digit names the third
    assert {s.answer.split(", ")[0][0] for s in samples} <= set("14567")


def test_outcomes_say_where_each_answer_lands():
    task = point_task(shapes=3)
    s = task.batch(random.Random(4), 1, "t")[0]
    x, y = (int(v) for v in s.answer.split(", "))
    other = next(c for c in s.meta["masks"] if c != s.meta["rewarded"])
    rows, cols = s.meta["masks"][other].nonzero()
    rw, rh = s.meta["resized"]
    w, h = s.meta["size"]
    ox, oy = (cols[0] + 0.5) * rw / w, (rows[0] + 0.5) * rh / h
    background = (~(sum(s.meta["masks"].values()).astype(bool))).nonzero()
    bx, by = (background[1][0] + 0.5) * rw / w, (background[0][0] + 0.5) * rh / h
    cases = {'{"point_2d": [%d, %d]}' % (x, y): "hit", '{"point_2d": [%.2f, %.2f]}' % (ox, oy): "other shape",
             '{"point_2d": [%.2f, %.2f]}' % (bx, by): "background", '{"point_2d": [%d, 85]}' % x: "out of range",
             '{"point_2d": [%d]}' % x: "malformed", '{"bbox_2d": [1, 2, 3, 4]}': "box", "red": "no point"}
    assert sorted(cases.values()) == sorted(OUTCOMES)
    for text, outcome in cases.items():
        assert point_outcome(text, s) == outcome, text
        assert point_reward(text, s) == float(outcome == "hit")
    texts = list(cases)
    rewards = [point_reward(t, s) for t in texts]
    assert task.diagnostics(texts, rewards, []) == point_diagnostics(texts, rewards) == dict(
        parsable=4 / 7, failures={"malformed": 1, "box": 1, "no point": 1}, parsable_reward=0.25)
    assert task.diagnostics([], [], []) == dict(parsable=None, failures={"malformed": 0, "box": 0, "no point": 0},
                                            parsable_reward=None)
    with pytest.raises(ValueError, match="2 texts for 1 rewards"):
        point_diagnostics(texts[:2], rewards[:1])


def test_the_video_control_rewards_a_random_direction():
    from rlk_mm.smoke.tasks.video import DIRECTIONS, direction_reward, video_direction_task

    task, control = video_direction_task(), TASKS["video-direction-shuffled"](None)
    assert control.name == "video-direction-shuffled" and task.name == "video-direction"
    assert all(s.meta["rewarded"] == s.answer for s in task.batch(random.Random(5), 20, "t"))
    samples = control.batch(random.Random(5), 80, "t")
    same = sum(s.meta["rewarded"] == s.answer for s in samples)
    assert 5 < same < 45 and {s.meta["rewarded"] for s in samples} == set(DIRECTIONS)
    s = samples[0]
    assert direction_reward(" %s." % s.meta["rewarded"].upper(), s) == 1.0
    assert direction_reward(next(d for d in DIRECTIONS if d != s.meta["rewarded"]), s) == 0.0


def test_point_smoke_gates_pass_on_cpu(tmp_path):
    args = smoke.parse_args(["--task", "point", "--steps", "1", "--prompts", "2", "--samples", "2",
                             "--warmup-steps", "1", "--quiet", "--out", str(tmp_path)])
    code = smoke.run_smoke(args)
    report = json.loads((tmp_path / "smoke_report.json").read_text())
    assert code == 0, report.get("learning")
    assert report["task"] == "point" and {g["name"]: g["ok"] for g in report["gates"]} == dict.fromkeys(GATES, True)
    assert len(report["steps"]) == 1 and report["steps"][0]["response_tokens"] > 1


def test_the_tiny_policy_cannot_tell_columns_apart_by_their_rotary_positions():
    """The cause the strip greys answer: in the smoke policy's M-RoPE the width section takes the
    lowest frequencies, so the next image column turns a query by under 2e-4 rad (the next row
    by 0.03, the next text token by 1): an untrained 2-layer policy does not learn where a
    shape is from its position, even supervised (bench/results/smoke_tasks/h200/2026-11-28-default.json)."""
    from rlk_mm.fixtures import tiny_qwen2_5_vl
    from rlk_mm.smoke.policy import TINY_MODEL

    rotary = tiny_qwen2_5_vl(0, **TINY_MODEL).model.language_model.rotary_emb
    # (t, h, w) of an image token, the next column, the next row, and a text token one further
    positions = torch.tensor([[[5, 5, 5, 6]], [[5, 5, 6, 6]], [[5, 6, 5, 6]]])
    cos, sin = rotary(torch.zeros(1, 1, TINY_MODEL["hidden_size"] // 4), positions)
    angle = torch.atan2(sin, cos)[0]
    turn = (angle[1:] - angle[:1]).abs().amax(-1)
    assert turn[0] < 2e-4 and 0.01 < turn[1] < 0.05 and turn[2] == pytest.approx(1.0)


def test_each_third_has_its_own_grey_behind_the_shapes():
    """The tiny policy tells places apart only by what they look like (its M-RoPE width section
    turns adjacent columns by under 2e-4 rad): every pixel outside the shapes is its third's grey."""
    for s in point_task().batch(random.Random(5), 12, "t") + point_task(shapes=3).batch(random.Random(5), 12, "t"):
        pixels = np.asarray(s.images[0])
        shapes = sum(s.meta["masks"].values()).astype(bool)
        edges = third_edges(s.meta["size"][0])
        for k, grey in enumerate(STRIP_SHADES):
            third = pixels[:, edges[k]:edges[k + 1]][~shapes[:, edges[k]:edges[k + 1]]]
            assert third.size and (third == grey).all(), (s.id, k)


def test_point_draws_one_shape_in_a_random_third_and_its_control_rewards_a_place():
    samples = point_task().batch(random.Random(6), 60, "t")
    thirds = []
    for s in samples:
        (colour, mask), = s.meta["masks"].items()
        assert s.meta["rewarded"] == colour and s.meta["mask"] is mask
        assert point_reward(point_task().answer_text(s.answer), s) == 1.0
        edges = third_edges(s.meta["size"][0])
        thirds.append(next(k for k in range(3) if mask[:, edges[k]:edges[k + 1]].any()))
    assert set(thirds) == {0, 1, 2}
    controls = point_task(shuffled=True).batch(random.Random(6), 60, "t")
    moved = 0
    for s in controls:
        (colour, shape), = s.meta["masks"].items()
        rewarded = s.meta["mask"]
        assert rewarded.sum() == shape.sum()  # the same shape, moved whole along x
        shift = int(rewarded.any(0).nonzero()[0][0] - shape.any(0).nonzero()[0][0])
        assert np.array_equal(rewarded, moved_mask(shape, shift))
        moved += shift != 0
    assert 20 < moved < 60  # about two thirds go to another third: the reward ignores what is drawn
    assert {"point", "point-shuffled"} <= set(TASKS) and TASKS["point-shuffled"](None).name == "point-shuffled"


@pytest.mark.parametrize("shift", [-30, -1, 0, 1, 29, 200])
def test_moved_mask_drops_what_leaves_the_image(shift):
    mask = np.zeros((4, 90), bool)
    mask[1:3, 30:60] = True
    out = moved_mask(mask, shift)
    cols = [c + shift for c in range(30, 60) if 0 <= c + shift < 90]
    assert out.sum() == 2 * len(cols) and all(out[1:3, c].all() for c in cols)
