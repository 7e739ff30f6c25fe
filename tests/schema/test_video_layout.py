"""VideoLayout: per-frame token ranges and temporal positions checked against the tiny
model's own get_rope_index (videos, multi-image and mixed samples), the row permutations
against the real processor's patch order, per-frame masks and per-frame cache keys
through the real VisionCache."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from rlk_mm import RLBatch
from rlk_mm.fixtures import processor_inputs, synthetic_image_text, synthetic_video_text
from rlk_mm.models import VisionCache
from rlk_mm.schema import Modality
from rlk_mm.schema.video import VideoLayout


def _model_positions(model, inputs, b):
    """(3, L) unpadded positions of row b from the model's own get_rope_index."""
    pos, _ = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw"), inputs.get("video_grid_thw"),
        inputs.get("second_per_grid_ts"), attention_mask=inputs["attention_mask"])
    return pos[:, b][:, inputs["attention_mask"][b].bool()]


@pytest.mark.parametrize("fps", [2.0, 0.5])
def test_frames_and_temporal_positions_match_get_rope_index(processor, tiny_model, fps):
    samples = (synthetic_video_text(2, seed=1, num_frames=6, with_image=True)
               + synthetic_image_text(2, seed=2, max_images=3))
    inputs = processor_inputs(processor, samples, padding_side="left")
    inputs["second_per_grid_ts"] = torch.full((2,), 2 / fps)  # the processor's value at that frame rate
    tps = tiny_model.config.vision_config.tokens_per_second
    batch = RLBatch.from_qwen_vl(inputs, processor=processor, tokens_per_second=tps)
    layout = VideoLayout(batch)
    assert layout.num_videos == 2 and [layout.num_frames(v) for v in range(2)] == [3, 3]
    for v in range(layout.num_videos):
        b = layout.samples[v]
        model_pos = _model_positions(tiny_model, inputs, b)
        assert torch.equal(batch.sample_positions(b), model_pos)  # the batch's positions are the model's
        ids = batch.sample_tokens(b)
        for f, (lo, hi) in enumerate(layout.frame_ranges(v)):
            assert hi - lo == layout.tokens_per_frame(v)
            assert bool((ids[lo:hi] == batch.video_token_id).all())
            # one temporal id per frame, the one the model gives every token of that frame
            assert set(model_pos[0, lo:hi].tolist()) == {int(layout.temporal_positions(v, tps)[f])}
        span = layout.frame_ranges(v)
        assert span[0][0] == layout.starts[v] and int(ids[span[-1][1]]) != batch.video_token_id
    # the multi-image samples agree too (no video there: the layout lists none of their items)
    for b in (2, 3):
        assert torch.equal(batch.sample_positions(b), _model_positions(tiny_model, inputs, b))
    assert all(layout.samples[v] in (0, 1) for v in range(layout.num_videos))


def test_row_permutations_follow_the_processor_patch_order(processor):
    # each 14 x 14 patch of the frame has its own grey level, rising in raster order
    h, w = 4, 6
    frame = Image.new("L", (w * 14, h * 14))
    for y in range(h):
        for x in range(w):
            frame.paste(10 + 8 * (y * w + x), (x * 14, y * 14, (x + 1) * 14, (y + 1) * 14))
    frames = [frame.convert("RGB")] * 2
    inputs = processor(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[frames], return_tensors="pt")
    batch = RLBatch.from_qwen_vl(inputs, processor=processor)
    layout = VideoLayout(batch)
    rows = batch.pixel_values_videos
    frame_major = rows[layout.frame_major_index()]
    level = frame_major[:, 0]
    assert bool((level[1:] > level[:-1]).all())  # raster order after the permutation
    assert not bool((rows[1:, 0] > rows[:-1, 0]).all())  # and the processor's own order is not raster
    assert torch.equal(frame_major[layout.token_major_index()], rows)


@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 3), hm=st.integers(2, 4), wm=st.integers(2, 4))
def test_permutations_are_inverse(processor, t, hm, wm):
    size = (wm * 28, hm * 28)  # at least 56 x 56, the processor's smallest size: not resized
    frames = [Image.new("RGB", size, (t * 30, 0, 0))] * (2 * t)
    inputs = processor(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[frames], return_tensors="pt")
    layout = VideoLayout(RLBatch.from_qwen_vl(inputs, processor=processor))
    fm, tm = layout.frame_major_index(), layout.token_major_index()
    n = t * hm * wm * 4
    assert sorted(fm.tolist()) == list(range(n))
    assert torch.equal(fm[tm], torch.arange(n)) and torch.equal(tm[fm], torch.arange(n))


def test_frame_mask_drops_frames_and_keeps_positions(processor):
    samples = synthetic_video_text(2, seed=3, num_frames=6)
    batch = RLBatch.from_qwen_vl(processor_inputs(processor, samples), processor=processor, responses=[[11, 12], [13]])
    layout = VideoLayout(batch)
    mask = layout.frame_token_mask([[True, False, True], [False, False, True]])
    dropped = torch.nonzero(~mask).flatten()
    expected = []
    for v, frames in enumerate(([1], [0, 1])):
        offset = int(batch.cu_seqlens[layout.samples[v]])
        for f in frames:
            lo, hi = layout.frame_ranges(v)[f]
            expected += range(offset + lo, offset + hi)
    assert dropped.tolist() == expected
    assert bool((batch.token_modality()[~mask] == int(Modality.VIDEO)).all())
    assert bool(layout.frame_token_mask([[True] * 3, [True] * 3]).all())


@pytest.mark.parametrize(
    "keep, message",
    [
        ([[True, True, True]], "one per-frame bool list per video"),
        ([[True, True], [True, True, True]], r"keep\[0\] must be 3 bools"),
        ([[1, 0, 1], [True, True, True]], r"keep\[0\] must be 3 bools"),
        ("yes", "one per-frame bool list per video"),
    ],
)
def test_frame_mask_refuses_bad_keep(processor, keep, message):
    batch = RLBatch.from_qwen_vl(processor_inputs(processor, synthetic_video_text(2, seed=3, num_frames=6)),
                                 processor=processor)
    with pytest.raises(ValueError, match=message):
        VideoLayout(batch).frame_token_mask(keep)


def test_bad_video_index_and_batches_without_videos(processor):
    batch = RLBatch.from_qwen_vl(processor_inputs(processor, synthetic_image_text(2, seed=1)), processor=processor)
    layout = VideoLayout(batch)
    assert layout.num_videos == 0 and layout.frame_keys() == [] and layout.frame_major_index().numel() == 0
    with pytest.raises(ValueError, match="no video items"):
        layout.frame_ranges(0)
    with pytest.raises(TypeError, match="must be an RLBatch"):
        VideoLayout("batch")
    videos = VideoLayout(RLBatch.from_qwen_vl(processor_inputs(processor, synthetic_video_text(1)),
                                              processor=processor))
    with pytest.raises(ValueError, match="video"):
        videos.frame_ranges(1)


def test_frame_keys_let_vision_cache_encode_a_shared_frame_once(processor, tiny_model):
    still = synthetic_video_text(1, seed=5, num_frames=2)[0].videos[0]  # one frame pair
    moving = synthetic_video_text(1, seed=6, num_frames=2)[0].videos[0]
    # two clips that share their first frame pair (temporal patch) and differ in the second
    clip_a, clip_b = still + moving, still + still
    text = "<|vision_start|><|video_pad|><|vision_end|>Which way?"
    inputs = processor(text=[text, text], videos=[clip_a, clip_b], padding=True, return_tensors="pt")
    batch = RLBatch.from_qwen_vl(inputs, processor=processor)
    layout = VideoLayout(batch)
    keys = layout.frame_keys()
    assert keys[0][0] == keys[1][0] == keys[1][1] and keys[0][1] != keys[0][0]
    frames = layout.frame_batch()
    assert frames.num_media == 4 and frames.media_cache_keys == [k for v in keys for k in v]
    assert torch.equal(frames.position_ids, batch.position_ids) and torch.equal(frames.input_ids, batch.input_ids)
    assert torch.equal(frames.pixel_values_videos, batch.pixel_values_videos)
    cache = VisionCache(tiny_model)
    with torch.no_grad():
        per_frame = cache(frames)
        whole = VisionCache(tiny_model)(batch)
    assert cache.items_requested == 4 and cache.items_encoded == 2  # the shared frame ran once
    torch.testing.assert_close(per_frame, whole, rtol=1e-5, atol=1e-5)  # a frame's rows depend on that frame only


def test_bad_arguments_are_refused(processor):
    batch = RLBatch.from_qwen_vl(processor_inputs(processor, synthetic_video_text(1, num_frames=4)),
                                 processor=processor)
    layout = VideoLayout(batch)
    with pytest.raises(ValueError, match="tokens_per_second"):
        layout.temporal_positions(0, tokens_per_second=-1.0)
    with pytest.raises(ValueError, match="video"):
        layout.num_frames(-1)
    bare = VideoLayout(batch.model_copy(update={"pixel_values_videos": None}))
    with pytest.raises(ValueError, match="keeps no pixel_values_videos"):
        bare.frame_keys()
    first = int(layout.starts[0])
    assert layout.temporal_positions(0, tokens_per_second=None).tolist() == [first, first + 1]
