"""Episode grounding: ``parse_grounding`` on GUI episodes (``from_trajectories``,
several screenshots per sample) converts each action's coordinates with the size of the
screenshot that action answers, recorded per media item by the builder (its resize settings,
``RLBatch.media_original_sizes``) and kept by select / concat / save / load; where no size is
recorded, or sizes contradict each other, it refuses, naming the sample, the image and what to pass.
Real Qwen-VL processor throughout."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from rlk_mm.grounding import grounding_rewards, parse_grounding
from rlk_mm.schema import ResizeSettings, RLBatch, SchemaError, Step, Trajectory, key_settings
from rlk_mm.schema.messages import vision_process

IM_END = 151645
FIRST, SECOND = (224, 168), (112, 84)  # a 2-screen episode: the click answers the first, larger screen
MIN_PIXELS, MAX_PIXELS = 3136, 50176  # the fixture processor's pixel limits (checked in the property)


def click(x, y) -> str:
    return json.dumps({"action": "click", "point_2d": [x, y]})


def screen(size, shade=0) -> Image.Image:
    return Image.new("RGB", size, (shade % 256, (3 * shade) % 256, 200))


@pytest.fixture(scope="module")
def episode(processor):
    """The issue's episode: a click at (28, 28) on a 224x168 screen, then one at (28, 28) on a 112x84 screen."""
    steps = [Step(screen(FIRST, 1), click(28, 28), 1.0, "Clicked."), Step(screen(SECOND, 2), click(28, 28), 0.5)]
    return RLBatch.from_trajectories([Trajectory("g", "Click the button.", steps)], processor=processor)


@pytest.fixture(scope="module")
def two_images(processor):
    """A batch built from a processor's output (no recorded sizes): one prompt with a 224x168
    and a 112x84 image, screen_size the last image's, and a response clicking (28, 28)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Click."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    out = processor(text=[text], images=[screen(FIRST), screen(SECOND)], return_tensors="pt")
    return dict(prompt_token_ids=[out["input_ids"][0].tolist()],
                response_token_ids=[processor.tokenizer.encode(click(28, 28)) + [IM_END]],
                processor=processor, image_grid_thw=out["image_grid_thw"], pixel_values=out["pixel_values"])


# ----------------------------------------------------------------------------- the case
def test_a_click_on_the_first_224x168_screen_comes_back_as_28_28(processor, episode):
    assert episode.media_original_sizes() == [FIRST, SECOND]
    g = parse_grounding(episode, 0, processor=processor)  # each action with the screenshot it answers
    assert [(r.values, r.absolute, r.image) for r in g.regions] == [((28.0, 28.0), (28.0, 28.0), 0),
                                                                    ((28.0, 28.0), (28.0, 28.0), 1)]
    assert [(s.image, s.original, s.resized) for s in g.images] == [(0, FIRST, FIRST), (1, SECOND, SECOND)]
    first = parse_grounding(episode, 0, processor=processor, image=0)  # the caller names the first screen
    assert first.regions[0].absolute == (28.0, 28.0) and first.original_size == FIRST
    # image= keeps the actions that answer that screenshot: the other is never converted with its size
    assert [(r.image, r.absolute) for r in first.regions] == [(0, (28.0, 28.0))]
    second = parse_grounding(episode, 0, processor=processor, image=1)
    assert [(r.image, r.absolute) for r in second.regions] == [(1, (28.0, 28.0))]
    assert parse_grounding(episode, 0, processor=processor, image=0, original_size=FIRST).regions[0].absolute == (28.0, 28.0)
    for history in (1, 2):  # one sample per step: its own action, with its own screenshot
        steps = RLBatch.from_trajectories([Trajectory("g", "Click the button.", [
            Step(screen(FIRST, 1), click(28, 28), 1.0, "Clicked."), Step(screen(SECOND, 2), click(28, 28), 0.5)])],
            processor=processor, history=history)
        gs = [parse_grounding(steps, b, processor=processor) for b in range(2)]
        assert [g.regions[0].absolute for g in gs] == [(28.0, 28.0)] * 2
        assert [g.original_size for g in gs] == [FIRST, SECOND]


def test_the_recorded_sizes_travel_with_select_concat_save_and_load(processor, episode, tmp_path):
    other = RLBatch.from_trajectories([Trajectory("h", "Click.", [Step(screen((100, 61), 3), click(10, 10))])],
                                      processor=processor)
    joined = RLBatch.concat([other, episode])
    assert joined.media_original_sizes() == [(100, 61), FIRST, SECOND]
    picked = joined.select([1, 0])
    assert picked.media_original_sizes() == [FIRST, SECOND, (100, 61)]
    loaded = RLBatch.load(picked.save(tmp_path / "episodes.safetensors"))
    assert loaded.media_original_sizes() == picked.media_original_sizes()
    want = parse_grounding(episode, 0, processor=processor)
    for batch, b in ((joined, 1), (picked, 0), (loaded, 0)):
        got = parse_grounding(batch, b, processor=processor)
        assert [(r.absolute, r.image) for r in got.regions] == [(r.absolute, r.image) for r in want.regions]
        assert got.images == want.images


def test_naming_one_screenshot_of_an_episode_keeps_its_own_actions(processor):
    """A resized first screen (448x336) and a 112x84 one: by default each click converts with its
    own screenshot's factor; image=1 returns the second click only, never the first one
    converted with the second screen's factor."""
    steps = [Step(screen((448, 336), 1), click(28, 28), 1.0, "Clicked."), Step(screen(SECOND, 2), click(28, 28), 0.5)]
    batch = RLBatch.from_trajectories([Trajectory("g2", "Click the button.", steps)], processor=processor)
    h, w = vision_process().smart_resize(336, 448, factor=28, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    both = parse_grounding(batch, 0, processor=processor)
    assert [(r.image, r.absolute) for r in both.regions] == [(0, (28 * 448 / w, 28 * 336 / h)), (1, (28.0, 28.0))]
    assert [(r.image, r.absolute) for r in parse_grounding(batch, 0, processor=processor, image=1).regions] == \
        [(1, (28.0, 28.0))]


def _older_screens(processor):
    """history=2 on a 3-step episode: the last step's sample shows two screenshots, scores one action."""
    steps = [Step(screen(FIRST, 1), click(28, 28), 1.0, "Clicked."), Step(screen(SECOND, 2), click(28, 28), 0.5, "Ok."),
             Step(screen(SECOND, 3), click(14, 14), 0.5)]
    return RLBatch.from_trajectories([Trajectory("g3", "Click the button.", steps)], processor=processor, history=2)


def test_from_messages_records_each_images_original_size(processor):
    """A conversation of two images of other sizes: each image's own size, with image=."""
    conv = [{"role": "user", "content": [{"type": "image", "image": screen((300, 201))}, {"type": "image", "image": screen(SECOND)},
                                         {"type": "text", "text": "Click."}]}]
    batch = RLBatch.from_messages([conv], processor=processor, responses=[processor.tokenizer.encode(click(28, 28)) + [IM_END]])
    assert batch.media_original_sizes() == [(300, 201), SECOND]
    s = key_settings(batch.media_cache_keys[0])
    assert s.original_size == (300, 201) and ResizeSettings.from_tag(s.tag()) == s and "from 300×201" in s.describe()
    h, w = vision_process().smart_resize(201, 300, factor=28, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    g = parse_grounding(batch, 0, processor=processor, image=0)
    assert g.resized_size == (w, h) and g.regions[0].absolute == (28 * 300 / w, 28 * 201 / h)
    assert parse_grounding(batch, 0, processor=processor, image=1).regions[0].absolute == (28.0, 28.0)


def test_a_key_naming_no_settings_records_no_size(processor, two_images):
    """A caller-given key holding the separator but no settings tag records nothing: screen_size holds."""
    batch = RLBatch.from_token_lists(**two_images, screen_size=[SECOND], media_cache_keys=["a#b", "c"])
    assert batch.media_original_sizes() == [None, None]
    assert parse_grounding(batch, 0, processor=processor, image=1).regions[0].absolute == (28.0, 28.0)


def test_grounding_rewards_place_each_region_on_its_own_screen(processor):
    """One sample per step: each step's click is checked inside, and scored against, its own screen."""
    steps = RLBatch.from_trajectories([Trajectory("g", "Click.", [
        Step(screen(FIRST, 1), click(200, 150), 0.0, "Clicked."), Step(screen(SECOND, 2), click(28, 28))])],
        processor=processor, history=2)
    fields = {name: getattr(steps, name) for name in RLBatch.model_fields}
    boxes = dict(bbox_targets=torch.tensor([[190.0, 140, 210, 160], [20, 20, 30, 30]]), bbox_sample=torch.tensor([0, 1]),
                 coordinate_system="absolute")
    scored = RLBatch(**{**fields, **boxes})
    gs = [parse_grounding(scored, b, processor=processor) for b in range(2)]
    assert grounding_rewards(scored, gs, metric="point_in_box").sequence.tolist() == [1.0, 1.0]
    whole = RLBatch.from_trajectories([Trajectory("g", "Click.", [
        Step(screen(FIRST, 1), click(200, 150), 0.0, "Clicked."), Step(screen(SECOND, 2), click(28, 28))])],
        processor=processor)
    fields = {name: getattr(whole, name) for name in RLBatch.model_fields}
    one = RLBatch(**{**fields, **boxes, "bbox_sample": torch.tensor([0, 0])})
    with pytest.raises(SchemaError, match=r"sample 0: its coordinates refer to images of different sizes \(#0 224x168, "
                                          r"#1 112x84\).*history=k"):
        grounding_rewards(one, [parse_grounding(one, 0, processor=processor)], metric="point_in_box")


# ----------------------------------------------------------------------------- a property
def _side():
    return st.integers(29, 420).filter(lambda n: n % 28)  # never a multiple of 28: the processor resizes it


def _resized(size) -> tuple[int, int]:
    """(width, height) qwen-vl-utils' own smart_resize gives, under the processor's pixel limits."""
    h, w = vision_process().smart_resize(size[1], size[0], factor=28, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return w, h


@st.composite
def episodes(draw):
    sizes = draw(st.lists(st.tuples(_side(), _side()).filter(lambda s: max(s) / min(s) <= 6), min_size=1, max_size=4))
    points = []
    for size in sizes:
        w, h = _resized(size)
        edge = st.sampled_from(["low", "high", "inside"])
        x, y = ({"low": 0, "high": side, "inside": draw(st.integers(0, side))}[draw(edge)] for side in (w, h))
        points.append((x, y))
    return sizes, points, draw(st.sampled_from([None, 1, 2]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=episodes())
def test_every_action_converts_with_its_own_screenshot(processor, case):
    """Property: for random screenshot sizes (none a multiple of 28), each step's click, written
    in its resized screenshot's pixels, comes back in that screenshot's original pixels exactly
    as resized * original_size / resized_size (edges stay edges), whatever the history window."""
    sizes, points, history = case
    assert (processor.image_processor.size["shortest_edge"], processor.image_processor.size["longest_edge"]) == (MIN_PIXELS, MAX_PIXELS)
    steps = [Step(screen(size, t), click(*point), float(t), f"Step {t} done.") for t, (size, point) in enumerate(zip(sizes, points))]
    batch = RLBatch.from_trajectories([Trajectory("e", "Click everything.", steps)], processor=processor, history=history)
    want = []
    for size, (x, y) in zip(sizes, points):
        w, h = _resized(size)
        want.append(((x * size[0] / w, y * size[1] / h), size, (w, h)))
        if x in (0, w) and y in (0, h):
            assert want[-1][0] == (0 if x == 0 else size[0], 0 if y == 0 else size[1])
    got = []
    for b in range(batch.num_samples):
        g = parse_grounding(batch, b, processor=processor)
        assert g.failures == ()
        for r in g.regions:
            size = g.size_of(r.image)
            got.append((r.absolute, size.original, size.resized))
    assert got == want
    step_of = [int(m.rsplit("step", 1)[1]) for m in batch.media_ids]
    assert batch.media_original_sizes() == [sizes[t] for t in step_of]


# ----------------------------------------------------------------------------- bad input
def _no_image(processor):
    text = processor.apply_chat_template([{"role": "user", "content": "Click."}], add_generation_prompt=True)
    ids = processor.tokenizer.encode(text)
    return RLBatch.from_token_lists([ids], [processor.tokenizer.encode(click(1, 1)) + [IM_END]], processor=processor)


def _text_before_images(processor):
    """An episode-like batch (action spans) whose first action comes before any image."""
    conv = [{"role": "user", "content": "Start."}, {"role": "assistant", "content": click(1, 1)},
            {"role": "user", "content": [{"type": "image", "image": screen(SECOND)}, {"type": "image", "image": screen(FIRST)}]}]
    batch = RLBatch.from_messages([conv], processor=processor, responses=[processor.tokenizer.encode(click(2, 2)) + [IM_END]],
                                  assistant_turns=True)
    fields = {name: getattr(batch, name) for name in RLBatch.model_fields}
    return RLBatch(**{**fields, "action_spans": batch.loss_spans, "turn_rewards": torch.zeros(batch.loss_spans.num_spans)})


def _swapped_screen(episode):
    fields = {name: getattr(episode, name) for name in RLBatch.model_fields}
    return RLBatch(**{**fields, "screen_size": torch.tensor([[100, 75]])})


def _bad_key(two_images):
    tag = "min_pixels=3136;max_pixels=50176;resized_height=168;resized_width=224;original_height=0;original_width=224"
    return RLBatch.from_token_lists(**two_images, media_cache_keys=[f"k0#{tag}", "k1"])


BAD = [
    ("image past the last", lambda p, e, t: parse_grounding(e, 0, processor=p, image=2), SchemaError,
     r"image=2, but sample 0 has 2 images: pass image= 0\.\.1"),
    ("negative image", lambda p, e, t: parse_grounding(e, 0, processor=p, image=-1), ValueError,
     r"image=-1 is out of range: it must be >= 0"),
    ("bool image", lambda p, e, t: parse_grounding(e, 0, processor=p, image=True), TypeError, r"image must be an int, got bool"),
    ("str image", lambda p, e, t: parse_grounding(e, 0, processor=p, image="0"), TypeError, r"image must be an int, got str"),
    ("a sample without images", lambda p, e, t: parse_grounding(_no_image(p), 0, processor=p), SchemaError,
     r"sample 0 has no image: coordinates refer to one"),
    ("another size than recorded", lambda p, e, t: parse_grounding(e, 0, processor=p, image=0, original_size=(225, 168)),
     SchemaError, r"sample 0, image #0: original_size=225x168, but the batch records 224x168 for that image "
                  r"\(media_cache_keys\[0\]\): leave original_size out"),
    ("swapped size", lambda p, e, t: parse_grounding(e, 0, processor=p, image=0, original_size=(168, 224)),
     SchemaError, r"sample 0, image #0: original_size=168x224, but the batch records 224x168"),
    ("one size for several screens", lambda p, e, t: parse_grounding(e, 0, processor=p, original_size=FIRST), SchemaError,
     r"sample 0: original_size is one image's size, but its actions answer the screenshots \[0, 1\]: pass image= with it"),
    ("screen_size against the recorded size", lambda p, e, t: parse_grounding(_swapped_screen(e), 0, processor=p, image=1),
     SchemaError, r"sample 0, image #1: screen_size\[0\] is 100x75, but the batch records 112x84 for that image, the "
                  r"sample's last"),
    ("unknown size, screen_size another image's",
     lambda p, e, t: parse_grounding(RLBatch.from_token_lists(**t, screen_size=[SECOND]), 0, processor=p, image=0),
     SchemaError, r"sample 0, image #0: its original size is unknown: the batch records no size for it \(built from a "
                  r"processor's output, not from the images\), and screen_size is the size of the sample's last image "
                  r"\(#1\): pass image=0 with original_size=\(width, height\)"),
    ("unknown size, no screen_size", lambda p, e, t: parse_grounding(RLBatch.from_token_lists(**t), 0, processor=p, image=1),
     SchemaError, r"sample 0, image #1: its original size is unknown: .* from_trajectories \(which record each image's "
                  r"size\) or with screen_size"),
    ("several images, none named", lambda p, e, t: parse_grounding(RLBatch.from_token_lists(**t), 0, processor=p),
     SchemaError, r"sample 0 has 2 images: pass image= \(0\.\.1\)"),
    ("unrecorded size of another aspect",
     lambda p, e, t: parse_grounding(RLBatch.from_token_lists(**t), 0, processor=p, image=0, original_size=(168, 224)),
     SchemaError, r"sample 0, image #0: original_size 168x224 cannot have been resized to the image's 224x168"),
    ("an action before any screenshot", lambda p, e, t: parse_grounding(_text_before_images(p), 0, processor=p),
     SchemaError, r"sample 0, loss span \[\d+, \d+\): no image precedes it, so it answers no screenshot: pass image= \(0\.\.1\)"),
    ("a recorded size of a zero side", lambda p, e, t: parse_grounding(_bad_key(t), 0, processor=p, image=0), ValueError,
     r"media_cache_keys\[0\]: '.*' is a ResizeSettings tag of bad values: ResizeSettings.original_height=0 is out of range"),
    ("size_of an image not parsed", lambda p, e, t: parse_grounding(e, 0, processor=p, image=0).size_of(1), SchemaError,
     r"sample 0: image=1 is not one its coordinates refer to \(images \[0\]\)"),
    ("a screenshot no scored action answers", lambda p, e, t: parse_grounding(_older_screens(p), 2, processor=p, image=0),
     SchemaError, r"sample 2: no scored action answers screenshot 0: name the screenshot an action answers, or leave "
                  r"image= out"),
    ("one size of a sample of several", lambda p, e, t: parse_grounding(e, 0, processor=p).original_size, SchemaError,
     r"sample 0: its coordinates refer to images of different sizes \(#0 224x168, #1 112x84\)"),
]


@pytest.mark.parametrize("call, error, match", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_is_refused_naming_sample_image_and_what_to_pass(processor, episode, two_images, call, error, match):
    with pytest.raises(error, match=match):
        call(processor, episode, two_images)
