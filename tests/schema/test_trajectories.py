"""RLBatch.from_trajectories: GUI episodes on synthetic browser and mobile screens (PIL), action
JSON (click/type/scroll/done), the real processor and the tiny model's rope index: action-only
loss masks, turn rewards, the last-k screenshot window, screenshot dedup by cache key, GiGPO
step groups, and the errors for bad input."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw

from rlk_mm.ops import group_advantages, scatter_rewards
from rlk_mm.schema import Modality, RLBatch, SchemaError, Step, Trajectory, step_group_index

IM_END = 151645


def browser(page: str, typed: str = "", scrolled: int = 0) -> Image.Image:
    """A 224x168 browser window: address bar, a search field (with ``typed``) and two buttons."""
    image = Image.new("RGB", (224, 168), (245, 245, 245))
    d = ImageDraw.Draw(image)
    d.rectangle((0, 0, 223, 20), fill=(210, 210, 220))
    d.text((6, 5), f"https://{page}", fill=(20, 20, 20))
    d.rectangle((20, 40 - scrolled, 200, 60 - scrolled), outline=(90, 90, 90), fill=(255, 255, 255))
    d.text((24, 45 - scrolled), typed, fill=(0, 0, 0))
    d.rectangle((20, 80 - scrolled, 100, 104 - scrolled), fill=(40, 80, 220))
    d.text((34, 86 - scrolled), "Search", fill=(255, 255, 255))
    d.rectangle((120, 80 - scrolled, 200, 104 - scrolled), fill=(200, 60, 60))
    d.text((136, 86 - scrolled), "Cancel", fill=(255, 255, 255))
    return image


def mobile(screen: str) -> Image.Image:
    """A 112x196 phone screen: status bar, a title and a list of tappable rows."""
    image = Image.new("RGB", (112, 196), (255, 255, 255))
    d = ImageDraw.Draw(image)
    d.rectangle((0, 0, 111, 12), fill=(30, 30, 30))
    d.text((4, 16), screen, fill=(0, 0, 0))
    for i in range(4):
        d.rectangle((6, 40 + 36 * i, 105, 68 + 36 * i), outline=(120, 120, 120), fill=(235, 240, 250) if i % 2 else (250, 250, 250))
    return image


def action(kind: str, **fields) -> str:
    return json.dumps({"action": kind, **fields})


def browser_episode(eid: str, query: str, group: str = "search") -> Trajectory:
    return Trajectory(eid, "Search the web for cats.", [
        Step(browser("example.com"), action("click", point_2d=[110, 50]), 0.0, "The search field is focused."),
        Step(browser("example.com"), action("type", text=query), 0.0, f"Typed {query!r}."),
        Step(browser("example.com", typed=query), action("click", point_2d=[60, 92]), 0.5, "Results loaded."),
        Step(browser("results.com/cats", scrolled=10), action("done"), 1.0 if query == "cats" else 0.0),
    ], group_id=group)


def mobile_episode() -> Trajectory:
    return Trajectory("phone-0", "Open the settings.", [
        Step(mobile("Home"), action("scroll", direction="down"), 0.0, None),
        Step(mobile("Home 2"), action("click", point_2d=[50, 100]), 1.0, "Settings opened."),
        Step(mobile("Settings"), action("done"), 0.0),
    ], group_id="phone")


def processor_view(processor, traj: Trajectory, upto: int, kept: list[int]):
    """The real processor's input_ids for the chat up to step ``upto`` with the screenshots ``kept``."""
    messages = []
    for t in range(upto + 1):
        content = [{"type": "text", "text": traj.task}] if t == 0 else (
            [] if traj.steps[t - 1].observation is None else [{"type": "text", "text": traj.steps[t - 1].observation}])
        if t in kept:
            content.insert(0 if t == 0 else len(content), {"type": "image"})
        messages += [{"role": "user", "content": content}, {"role": "assistant", "content": traj.steps[t].action}]
    text = processor.apply_chat_template(messages)
    out = processor(text=[text], images=[traj.steps[t].screenshot for t in kept] or None, return_tensors="pt")
    return out["input_ids"][0], out["image_grid_thw"]


def real_positions(model, ids, grid):
    types = (ids == 151655).int()[None]
    pos, _ = model.model.get_rope_index(ids[None], types, grid, None, None)
    return pos[:, 0]


def grid_of(batch, b):
    return batch.media_grid_thw[batch.media_sample == b]


def check_action_spans(processor, batch, trajs_steps):
    """Loss spans are exactly the action spans; each decodes to its action and <|im_end|>; none
    touches a media span; the turn rewards are the step rewards, in order."""
    assert batch.loss_spans == batch.action_spans
    tok = processor.tokenizer
    k = 0
    for b in range(batch.num_samples):
        ids = batch.sample_tokens(b)
        for span in batch.action_spans.spans_of(b):
            step = trajs_steps[k]
            assert tok.decode(ids[span.start : span.end - 1].tolist()) == step.action
            assert int(ids[span.end - 1]) == IM_END
            assert float(batch.turn_rewards[k]) == step.reward
            k += 1
        media = [s for s in batch.modality_spans_of(b) if s.modality != Modality.TEXT]
        assert all(s.end <= a.start or a.end <= s.start for s in media for a in batch.action_spans.spans_of(b))
    assert k == batch.turn_rewards.numel()


def test_episode_mode_matches_the_processor_and_the_rope_index(processor, tiny_model):
    trajs = [browser_episode("web-0", "cats"), mobile_episode()]
    batch = RLBatch.from_trajectories(trajs, processor=processor)
    assert batch.num_samples == 2 and batch.group_ids == ["search", "phone"]
    check_action_spans(processor, batch, [s for t in trajs for s in t.steps])
    for b, traj in enumerate(trajs):
        n = len(traj.steps)
        ids, grid = processor_view(processor, traj, n - 1, list(range(n)))
        assert torch.equal(batch.sample_tokens(b), ids)
        assert torch.equal(grid_of(batch, b), grid)
        assert torch.equal(batch.sample_positions(b), real_positions(tiny_model, ids, grid))
    assert batch.screen_size.tolist() == [[224, 168], [112, 196]]
    # the observation text and the prompt are never scored
    mask = batch.loss_mask()
    text = processor.tokenizer.decode(batch.input_ids[mask].tolist())
    assert "Results loaded" not in text and "Search the web" not in text and "focused" not in text


def test_history_window_positions_as_the_truncated_sequence_and_dedup(processor, tiny_model):
    """history=2: one sample per step, the last 2 screenshots kept (older steps as text), positions
    of that truncated sequence; equal screenshots share one cache key."""
    traj = browser_episode("web-0", "cats")
    batch = RLBatch.from_trajectories([traj], processor=processor, history=2)
    assert batch.num_samples == 4 and batch.action_spans.token_counts().gt(0).all()
    check_action_spans(processor, batch, list(traj.steps))
    for t in range(4):
        kept = list(range(max(0, t - 1), t + 1))
        ids, grid = processor_view(processor, traj, t, kept)
        assert torch.equal(batch.sample_tokens(t), ids)
        assert torch.equal(batch.sample_positions(t), real_positions(tiny_model, ids, grid))
        assert len(batch.action_spans.spans_of(t)) == 1
    assert batch.media_ids == ["web-0/step0", "web-0/step0", "web-0/step1", "web-0/step1", "web-0/step2", "web-0/step2",
                               "web-0/step3"]
    # steps 0 and 1 show the same page: one key for all four copies; 3 distinct screens in all
    keys = batch.media_cache_keys
    assert len(set(keys)) == 3 and keys[0] == keys[1] == keys[2] == keys[3]
    # a window of 1 differs from a window of 2 only by the dropped screenshots
    one = RLBatch.from_trajectories([traj], processor=processor, history=1)
    assert [int(one.media_sample.eq(b).sum()) for b in range(4)] == [1, 1, 1, 1]
    assert one.num_tokens < batch.num_tokens


def test_step_groups_gigpo(processor):
    """Episodes of one task that start alike share step groups while their states agree."""
    a, b, c = browser_episode("a", "cats"), browser_episode("b", "dogs"), browser_episode("c", "cats")
    c = Trajectory("c", c.task, [*c.steps[:3], Step(c.steps[3].screenshot, c.steps[3].action, 0.0)], group_id="search")
    for history in (None, 2):
        batch = RLBatch.from_trajectories([a, b, c], processor=processor, history=history)
        groups = step_group_index(batch).tolist()
        # step 0 and 1: same screens, same actions so far -> shared; step 2 of "b" typed dogs -> its own
        assert groups[0] == groups[4] == groups[8] and groups[1] == groups[5] == groups[9]
        assert groups[2] == groups[10] != groups[6] and groups[3] == groups[11] != groups[7]
        assert len(set(groups)) == 6
        adv = group_advantages(batch.turn_rewards, step_group_index(batch))
        # the shared first steps carry no signal; of one state, the better final step wins; a state of its own gets no baseline
        assert adv[0] == adv[1] == 0 and adv[3] > 0 > adv[11] and adv[7] == 0
    phone = RLBatch.from_trajectories([mobile_episode()], processor=processor, history=1)
    assert step_group_index(phone).tolist() == [0, 1, 2]


def test_turn_rewards_land_on_each_action_span(processor):
    traj = browser_episode("web-0", "cats")
    batch = RLBatch.from_trajectories([traj], processor=processor)
    tokens = scatter_rewards(batch)  # turn rewards on each action's last token (its <|im_end|>)
    pos = batch.loss_spans.token_positions()[1]
    ends = [s.end - 1 for s in batch.action_spans.spans_of(0)]
    for end, step in zip(ends, traj.steps):
        assert float(tokens[pos == end]) == step.reward
    assert float(tokens.sum()) == sum(s.reward for s in traj.steps)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["Home", "Mail", "Maps"]), st.sampled_from(["click", "scroll", "type", "done"]),
                          st.one_of(st.none(), st.text("abc xyz.", max_size=8))), min_size=1, max_size=4),
       st.one_of(st.none(), st.integers(1, 3)))
def test_any_episode_layout_holds(processor, steps, history):
    traj = Trajectory("e", "Do it.", [Step(mobile(screen), action(kind), float(i), obs) for i, (screen, kind, obs) in enumerate(steps)])
    batch = RLBatch.from_trajectories([traj], processor=processor, history=history)
    check_action_spans(processor, batch, list(traj.steps))
    assert batch.num_samples == (1 if history is None else len(steps))
    for b in range(batch.num_samples):
        t = len(steps) - 1 if history is None else b
        assert int((batch.media_sample == b).sum()) == (t + 1 if history is None else min(history, t + 1))
    assert len(set(batch.media_cache_keys)) == len({screen for screen, _, _ in steps})


def test_bad_input(processor):
    good = Step(mobile("Home"), action("done"))
    cases = [
        (lambda: RLBatch.from_trajectories([], processor=processor), SchemaError, "trajectories is empty"),
        (lambda: RLBatch.from_trajectories("episode", processor=processor), TypeError, "trajectories must be a list"),
        (lambda: RLBatch.from_trajectories([{"steps": []}], processor=processor), TypeError, r"trajectories\[0\] is dict"),
        (lambda: RLBatch.from_trajectories([Trajectory("e", "t", [])], processor=processor), SchemaError,
         r"trajectories\[0\] \('e'\) has no steps"),
        (lambda: RLBatch.from_trajectories([Trajectory("e", "t", [good, "click"])], processor=processor), TypeError,
         r"trajectories\[0\] \('e'\), step 1 is str"),
        (lambda: RLBatch.from_trajectories([Trajectory("e", "t", [Step("shot.png", "x")])], processor=processor), TypeError,
         "step 0: screenshot must be a PIL image"),
        (lambda: RLBatch.from_trajectories([Trajectory("e", "t", [Step(mobile("H"), "  ")])], processor=processor),
         SchemaError, "step 0: action must be a non-empty str"),
        (lambda: RLBatch.from_trajectories([Trajectory("e", "t", [Step(mobile("H"), "x", float("nan"))])], processor=processor),
         SchemaError, "step 0: reward is nan; a step reward is a finite number"),
        (lambda: RLBatch.from_trajectories([Trajectory("e", "t", [Step(mobile("H"), "x", True)])], processor=processor),
         SchemaError, "reward is True"),
        (lambda: RLBatch.from_trajectories([Trajectory("e", "t", [Step(mobile("H"), "x", 0.0, 5)])], processor=processor),
         TypeError, "observation must be a str or None"),
        (lambda: RLBatch.from_trajectories([Trajectory(3, "t", [good])], processor=processor), TypeError,
         r"trajectories\[0\].id must be a str"),
        (lambda: RLBatch.from_trajectories([Trajectory("e", "t", [good])], processor=processor, history=0), ValueError,
         "history=0 is out of range"),
        (lambda: RLBatch.from_trajectories([Trajectory("e", "t", [good])], processor=processor, history=1.5), TypeError,
         "history must be an int"),
        (lambda: step_group_index(RLBatch.from_token_lists([[1, 2, 3]], [[4, IM_END]], processor=processor)), SchemaError,
         "step_group_index needs action_spans"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
