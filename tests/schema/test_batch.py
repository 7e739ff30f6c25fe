"""RLBatch from the real Qwen2.5-VL processor: layout, positions, views, save/load, bad input."""

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm import BatchFileError, Modality, RLBatch, SchemaError, Span, SpanTable
from rlk_mm.fixtures import load_geo3k, processor_inputs, synthetic_image_text, synthetic_video_text
from support.helpers import count_syncs

IM_END = 151645


def responses_for(processor, n):
    tok = processor.tokenizer
    texts = ["red", "The answer is \\boxed{80}.", "blue", "I think it is 13"]
    return [tok.encode(texts[i % len(texts)]) + [IM_END] for i in range(n)]


def real_positions(model, ids, grids, seconds=None):
    """Positions from the real model's get_rope_index on one unpadded sequence."""
    ids = ids.unsqueeze(0)
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == 151655] = 1
    types[ids == 151656] = 2
    pos, _ = model.model.get_rope_index(ids, types, grids.get("image"), grids.get("video"), seconds)
    return pos[:, 0]


def grids_of(batch, b):
    out = {}
    for mod, name in ((Modality.IMAGE, "image"), (Modality.VIDEO, "video")):
        sel = (batch.media_sample == b) & (batch.media_modality == int(mod))
        if bool(sel.any()):
            out[name] = batch.media_grid_thw[sel]
    return out


@pytest.mark.parametrize("side", ["left", "right"])
def test_geo3k_real_images(processor, tiny_model, geo3k_dir, side):
    samples = (load_geo3k(geo3k_dir) * 2)[:4]  # the sample's 3 problems, then the first again
    out = processor_inputs(processor, samples, padding_side=side)
    responses = responses_for(processor, len(samples))
    media_ids = [m for s in samples for m in s.media_ids]
    batch = RLBatch.from_qwen_vl(out, processor=processor, responses=responses, group_ids=["g", "h", "i", "g"],
                                 rewards=[1, 0, 0.5, 0], media_ids=media_ids)
    assert batch.num_samples == 4 and batch.media_ids == media_ids
    mask = out["attention_mask"].bool()
    for b in range(4):
        prompt = out["input_ids"][b][mask[b]]
        assert torch.equal(batch.sample_tokens(b), torch.cat([prompt, torch.tensor(responses[b])]))
        # loss span = the whole response, EOS included
        assert batch.loss_spans_of(b) == [Span(len(prompt), len(prompt) + len(responses[b]))]
        assert batch.sample_tokens(b)[-1] == IM_END
        # positions bitwise equal to the real model's rope index over prompt + response
        assert torch.equal(batch.sample_positions(b), real_positions(tiny_model, batch.sample_tokens(b), grids_of(batch, b)))
        image_spans = [s for s in batch.modality_spans_of(b) if s.modality == Modality.IMAGE]
        assert len(image_spans) == 1
        grid = batch.media_grid_thw[image_spans[0].media_index]
        assert len(image_spans[0]) == int(grid.prod()) // 4
        assert bool((batch.sample_tokens(b)[image_spans[0].start : image_spans[0].end] == 151655).all())
    assert torch.equal(batch.group_index(), torch.tensor([0, 1, 2, 0]))
    # vision_token_offsets map media items to rows of the vision tower output
    counts = batch.media_grid_thw.prod(1) // 4
    assert batch.vision_token_offsets.tolist() == (torch.cumsum(counts, 0) - counts).tolist()
    # the same content, left- or right-padded, gives the same batch
    other = RLBatch.from_qwen_vl(processor_inputs(processor, samples,
                                                  padding_side="right" if side == "left" else "left"),
                                 processor=processor, responses=responses, group_ids=["g", "h", "i", "g"],
                                 rewards=[1, 0, 0.5, 0], media_ids=media_ids)
    assert torch.equal(other.input_ids, batch.input_ids) and torch.equal(other.position_ids, batch.position_ids)
    assert other.media_cache_keys == batch.media_cache_keys


def test_multi_image_text_only_and_loss_rows(processor, tiny_model):
    samples = synthetic_image_text(6, seed=3, max_images=3, allow_text_only=True)
    assert any(not s.images for s in samples) and any(len(s.images) > 1 for s in samples)
    out = processor_inputs(processor, samples, padding_side="left")
    responses = responses_for(processor, 6)
    batch = RLBatch.from_qwen_vl(out, processor=processor, responses=responses)
    for b, s in enumerate(samples):
        assert sum(1 for sp in batch.modality_spans_of(b) if sp.modality == Modality.IMAGE) == len(s.images)
        assert torch.equal(batch.sample_positions(b), real_positions(tiny_model, batch.sample_tokens(b), grids_of(batch, b)))
    rows, targets = batch.loss_token_index()
    sample = batch.loss_token_sample()
    assert torch.equal(targets, batch.input_ids[rows + 1])
    assert torch.equal(targets, torch.cat([torch.tensor(r) for r in responses]))
    L = int(batch.seq_lengths().max())
    prow, ptargets = batch.loss_token_index(padded_length=L, padding="right")
    assert torch.equal(ptargets, targets)
    assert torch.equal(prow - sample * L, rows - batch.cu_seqlens.long()[sample])
    lrow, _ = batch.loss_token_index(padded_length=L + 3, padding="left")
    shift = (L + 3 - batch.seq_lengths())[sample]
    assert torch.equal(lrow - sample * (L + 3) - shift, rows - batch.cu_seqlens.long()[sample])
    with pytest.raises(ValueError, match="padded_length and padding go together"):
        batch.loss_token_index(padded_length=L)


def test_group_repeats_reuse_positions_and_keys_exactly(processor, tiny_model):
    """A GRPO batch repeats each prompt G times in a row (the builder reuses the previous
    sample's positions and media keys then): positions stay bitwise those of the real rope
    index, and keys those of building each sample alone. The same prompt tokens with
    another image of the same grid, or with a transposed grid (same placeholder count),
    are not confused with the repeat."""
    wide, tall = (synthetic_image_text(1, seed=11, sizes=(size,), max_images=1)[0] for size in ((112, 56), (56, 112)))
    other = synthetic_image_text(1, seed=12, sizes=((112, 56),), max_images=1)[0]
    tall, other = (dataclasses.replace(s, messages=wide.messages) for s in (tall, other))  # the same prompt tokens
    samples = [wide, wide, other, wide, tall, wide]
    out = processor_inputs(processor, samples, padding_side="left")
    responses = responses_for(processor, len(samples))
    batch = RLBatch.from_qwen_vl(out, processor=processor, responses=responses)
    grids = batch.image_grid_thw.tolist()
    assert grids[0] == grids[1] == grids[2] == grids[3] != grids[4]
    for b in range(len(samples)):
        assert torch.equal(batch.sample_positions(b), real_positions(tiny_model, batch.sample_tokens(b), grids_of(batch, b)))
    alone = [RLBatch.from_qwen_vl(processor_inputs(processor, [s]), processor=processor, responses=[r]).media_cache_keys[0]
             for s, r in zip(samples, responses)]
    assert batch.media_cache_keys == alone
    assert len(set(alone)) == 3


def test_video_and_image_positions(processor, tiny_model):
    samples = synthetic_video_text(2, seed=1, with_image=True)
    out = processor_inputs(processor, samples, padding_side="right")
    assert "video_grid_thw" in out
    batch = RLBatch.from_qwen_vl(out, processor=processor, responses=responses_for(processor, 2))
    seconds = out.get("second_per_grid_ts")
    for b in range(2):
        mods = [s.modality for s in batch.modality_spans_of(b) if s.modality != Modality.TEXT]
        assert mods == [Modality.IMAGE, Modality.VIDEO]
        sec = None if seconds is None else seconds[b : b + 1]
        assert torch.equal(batch.sample_positions(b), real_positions(tiny_model, batch.sample_tokens(b), grids_of(batch, b), sec))
    assert batch.video_grid_thw.shape == (2, 3) and batch.pixel_values_videos is not None


def test_padded_responses_and_assistant_mask(processor):
    samples = synthetic_image_text(2, seed=5, max_images=1)
    out = processor_inputs(processor, samples, padding_side="left")
    resp = responses_for(processor, 2)
    R = max(map(len, resp))
    padded = torch.full((2, R), 151643)
    mask = torch.zeros(2, R, dtype=torch.long)
    for b, r in enumerate(resp):
        padded[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = 1
    a = RLBatch.from_qwen_vl(out, processor=processor, responses=padded, response_mask=mask)
    b = RLBatch.from_qwen_vl(out, processor=processor, responses=resp)
    assert torch.equal(a.input_ids, b.input_ids) and a.loss_spans == b.loss_spans
    with pytest.raises(SchemaError, match="response_mask"):
        RLBatch.from_qwen_vl(out, processor=processor, responses=padded)
    # multi-turn: only assistant-marked tokens are scored
    assistant = torch.zeros_like(out["input_ids"])
    assistant[:, -3:] = 1  # the generation prompt's last tokens stand in for an assistant turn
    c = RLBatch.from_qwen_vl(out, processor=processor, assistant_mask=assistant)
    for s in range(2):
        n = int(c.seq_lengths()[s])
        assert c.loss_spans_of(s) == [Span(n - 3, n)]


def test_views_select_concat_groups_device(processor):
    samples = synthetic_image_text(2, seed=7) * 2  # groups 1 and 2 each answer one prompt twice
    out = processor_inputs(processor, samples)
    batch = RLBatch.from_qwen_vl(out, processor=processor, responses=responses_for(processor, 4), group_ids=[1, 2, 1, 2], rewards=[1, 0, 1, 0])
    picked = batch.select([2, 0])
    assert torch.equal(picked.sample_tokens(0), batch.sample_tokens(2))
    assert picked.group_ids == ["1", "1"] and picked.rewards.tolist() == [1.0, 1.0]
    # media travel with their samples, pixel rows included
    keys2 = [batch.media_cache_keys[i] for i in torch.nonzero(batch.media_sample == 2).flatten().tolist()]
    assert picked.media_cache_keys[: len(keys2)] == keys2
    assert picked.pixel_values.shape[0] == int(picked.media_grid_thw.prod(1).sum())
    whole = RLBatch.concat([batch.select([0, 1]), batch.select([2, 3])])
    assert torch.equal(whole.input_ids, batch.input_ids) and torch.equal(whole.pixel_values, batch.pixel_values)
    assert whole.media_cache_keys == batch.media_cache_keys and torch.equal(whole.position_ids, batch.position_ids)
    groups = dict(batch.iter_groups())
    assert list(groups) == ["1", "2"] and groups["2"].num_samples == 2
    moved = batch.to("meta")
    assert moved.input_ids.device.type == "meta" and moved.loss_spans.device.type == "meta"
    text = batch.summary()
    assert "4 samples" in text and "loss" in text


@pytest.fixture(scope="module")
def small_batch(processor):
    samples = synthetic_image_text(2, seed=11, sizes=[(56, 56), (84, 56)]) * 2  # groups a and b: one prompt each
    return RLBatch.from_qwen_vl(processor_inputs(processor, samples), processor=processor,
                                responses=responses_for(processor, 4), rewards=[0.5, 1, 0, 1], group_ids=list("abab"))


@settings(max_examples=15, deadline=None)
@given(indices=st.lists(st.integers(0, 3), min_size=1, max_size=6))
def test_save_load_round_trip(tmp_path_factory, small_batch, indices):
    sub = small_batch.select(indices)
    path = tmp_path_factory.mktemp("b") / "batch.safetensors"
    sub.save(path)
    back = RLBatch.load(path)
    for name in type(back).model_fields:
        a, b = getattr(sub, name), getattr(back, name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
        else:
            assert a == b, name
    assert back.equals(sub) and back == sub


# ----------------------------------------------------------------------------- equality
@settings(max_examples=20, deadline=None)
@given(indices=st.lists(st.integers(0, 3), min_size=1, max_size=6), cut=st.integers(0, 6))
def test_select_concat_round_trips_are_equal_batches(small_batch, indices, cut):
    """Selecting in two parts and concatenating is the one selection, field for field, bitwise."""
    cut = min(cut, len(indices))
    whole = small_batch.select(indices)
    parts = [small_batch.select(part) for part in (indices[:cut], indices[cut:]) if part]
    joined = RLBatch.concat(parts)
    assert joined == whole and joined.equals(whole) and not joined != whole
    assert small_batch.select(range(small_batch.num_samples)) == small_batch
    if sorted(set(indices)) != list(range(small_batch.num_samples)) or len(indices) != small_batch.num_samples:
        assert whole != small_batch


def test_equality_compares_every_field_bitwise(small_batch):
    b = small_batch
    values = {name: getattr(b, name) for name in type(b).model_fields}

    def changed(**fields):
        return RLBatch(**{**values, **fields})

    assert changed() == b and b == changed()
    assert changed(rewards=b.rewards.clone()) == b  # equal values, another tensor
    assert changed(rewards=b.rewards + 1) != b
    assert changed(rewards=torch.where(b.rewards == 0, torch.tensor(-0.0), b.rewards)) != b  # -0.0 is not 0.0, bitwise
    assert changed(rewards=None) != b  # a field one batch lacks
    assert changed(group_ids=list("abcd")) != b
    assert changed(media_ids=[m + "x" for m in b.media_ids]) != b
    assert changed(pixel_values=b.pixel_values.double()) != b  # another dtype
    assert changed(loss_spans=SpanTable.from_lists([[Span(s.start + 1, s.end) for s in b.loss_spans_of(i)] for i in range(4)])) != b
    assert b.select([1, 0, 2, 3]) != b
    assert (b == "a batch") is False and b != 1 and not b.equals(None)
    assert b.to("meta") != b  # another device differs (its values are never read)
    with pytest.raises(TypeError, match="unhashable"):
        hash(b)


# ----------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def good(processor):
    samples = synthetic_image_text(2, seed=2, max_images=1, sizes=[(112, 112)])
    out = processor_inputs(processor, samples, padding_side="right")
    return out, RLBatch.from_qwen_vl(out, processor=processor, responses=responses_for(processor, 2))


def replace(batch, **changes):
    values = {name: getattr(batch, name) for name in type(batch).model_fields}
    values.update(changes)
    return RLBatch(**values)


def test_placeholder_count_mismatch(processor, good):
    out, _ = good
    ids = out["input_ids"].clone()
    first = int(torch.nonzero(ids[0] == 151655)[0])
    ids[0, first + 3] = 1000  # one placeholder overwritten by text
    bad = dict(out, input_ids=ids)
    bad.pop("mm_token_type_ids")
    with pytest.raises(SchemaError, match=r"sample 0, image 0 at positions \[\d+, \d+\) has 3 placeholder tokens "
                                          r"but image_grid_thw \[1, 8, 8\] implies 16"):
        RLBatch.from_qwen_vl(bad, processor=processor)


def test_truncated_media_span(processor, good):
    out, _ = good
    first = int(torch.nonzero(out["input_ids"][0] == 151655)[0])
    cut = {k: (v[:, : first + 5] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v) for k, v in out.items()}
    with pytest.raises(SchemaError, match="cut by truncation: raise the prompt length limit .* or lower max_pixels"):
        RLBatch.from_qwen_vl(cut, processor=processor)


def test_leftover_grid_is_truncation(processor, good):
    out, _ = good
    first = int(torch.nonzero(out["input_ids"][1] == 151655)[0])
    cut = {k: (v[:, :first] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v) for k, v in out.items()}
    with pytest.raises(SchemaError, match="image_grid_thw has 2 items but the prompts hold placeholders for 0: a media span was cut by truncation"):
        RLBatch.from_qwen_vl(cut, processor=processor)


def test_span_errors(good):
    _, batch = good
    n0, n1 = batch.seq_lengths().tolist()
    p0 = int(batch.prompt_lengths[0])
    image = next(s for s in batch.modality_spans_of(0) if s.modality == Modality.IMAGE)
    cases = {
        "overlaps or precedes": [[Span(p0, p0 + 2), Span(p0 + 1, n0)], [Span(int(batch.prompt_lengths[1]), n1)]],
        "out of range": [[Span(p0, n0 + 5)], [Span(int(batch.prompt_lengths[1]), n1)]],
        "starts at position 0": [[Span(0, n0)], []],
        f"intersects media span image #0\\[{image.start}, {image.end}\\)": [[Span(image.start - 1, image.start + 1)], []],
    }
    for message, spans in cases.items():
        with pytest.raises(SchemaError, match=message):
            replace(batch, loss_spans=SpanTable.from_lists(spans), prompt_lengths=None)
    with pytest.raises(SchemaError, match="covers prompt position"):
        replace(batch, loss_spans=SpanTable.from_lists([[Span(p0 - 1, n0)], []]))
    bad_partition = [list(batch.modality_spans_of(0))[:-1], batch.modality_spans_of(1)]
    with pytest.raises(SchemaError, match="sample 0 ends at position"):
        replace(batch, modality_spans=SpanTable.from_lists(bad_partition))


def test_placeholder_in_response(processor, good):
    out, _ = good
    with pytest.raises(SchemaError, match=r"responses: sample 1, response position 1 .* the policy generated a media placeholder"):
        RLBatch.from_qwen_vl(out, processor=processor, responses=[[1, 2, IM_END], [5, 151655, IM_END]])


def test_per_sample_lengths_and_rewards(processor, good):
    out, batch = good
    with pytest.raises(SchemaError, match="group_ids has 3 entries; expected one per sample \\(2\\)"):
        RLBatch.from_qwen_vl(out, processor=processor, group_ids=["a", "b", "c"])
    with pytest.raises(SchemaError, match="rewards has shape \\(3,\\)"):
        replace(batch, rewards=torch.zeros(3))
    for value in (math.nan, math.inf):
        with pytest.raises(SchemaError, match=r"rewards\[1\] is (nan|inf) \(sample 1\)"):
            replace(batch, rewards=torch.tensor([0.0, value]))
    with pytest.raises(SchemaError, match="costs\\[0\\]"):
        replace(batch, costs=torch.tensor([-math.inf, 0.0]))
    with pytest.raises(SchemaError, match="media_ids has 1 entries; the batch has 2 media items"):
        RLBatch.from_qwen_vl(out, processor=processor, media_ids=["x"])


def test_unknown_coordinate_system(good):
    _, batch = good
    with pytest.raises(SchemaError, match="coordinate_system='pixels': expected one of absolute"):
        replace(batch, coordinate_system="pixels")
    ok = replace(batch, coordinate_system="normalized_1000", bbox_targets=torch.tensor([[1.0, 2.0, 30.0, 40.0]]), bbox_sample=torch.tensor([1]))
    assert ok.select([1]).bbox_targets.tolist() == [[1.0, 2.0, 30.0, 40.0]]


def test_corrupt_and_foreign_files(tmp_path, good):
    _, batch = good
    path = batch.save(tmp_path / "b.safetensors")
    data = path.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(BatchFileError, match="not a readable safetensors file"):
        RLBatch.load(tmp_path / "trunc.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(BatchFileError):
        RLBatch.load(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(BatchFileError, match="not an rlk_mm batch"):
        RLBatch.load(tmp_path / "model.safetensors")
    with pytest.raises(BatchFileError, match="no such file"):
        RLBatch.load(tmp_path / "missing.safetensors")


def test_readme_tour_runs(tmp_path, monkeypatch):
    """The README's tour runs as printed, on data shipped with the package, and its GRPO
    groups are the rollouts of one prompt each."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    tour = re.search(r"## A 15-line tour.*?```python\n(.*?)```", readme, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(tour, "README.md (tour)", "exec"), scope)
    batch = RLBatch.load(tmp_path / "batch.safetensors")
    assert batch.group_ids == [s.id for s in scope["samples"]] and batch.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    for members in (batch.select([0, 1]), batch.select([2, 3])):  # one group each: the same prompt and media
        prompt = [members.sample_tokens(b)[: int(members.prompt_lengths[b])] for b in range(2)]
        keys, half = members.media_cache_keys, members.num_media // 2  # media in sample order
        assert torch.equal(*prompt) and keys[:half] == keys[half:]


@pytest.mark.gpu
def test_checks_of_a_cuda_batch_sync_once(processor):
    """RLBatch(**fields) of CUDA tensors checks every invariant with one host sync (GRPO
    repeats share media keys; grounding fields included); select and concat stay on CUDA."""
    samples = [s for s in synthetic_image_text(2, seed=7) for _ in range(2)]
    batch = RLBatch.from_qwen_vl(processor_inputs(processor, samples), processor=processor, responses=responses_for(processor, 4),
                                 group_ids=[s.id for s in samples], rewards=[1.0, 0.0, 0.5, 0.0])
    batch = replace(batch, coordinate_system="normalized", bbox_targets=torch.tensor([[0.1, 0.1, 0.5, 0.5]]), bbox_sample=torch.tensor([3]),
                    screen_size=torch.tensor([[640, 480]] * 4))
    cuda = batch.to("cuda")
    fields = {name: getattr(cuda, name) for name in type(cuda).model_fields}
    RLBatch(**fields)  # warm-up: first CUDA calls initialize
    assert count_syncs(lambda: RLBatch(**fields)) == 1
    with pytest.raises(SchemaError, match=r"rewards\[2\] is nan \(sample 2\)"):
        RLBatch(**{**fields, "rewards": cuda.rewards.clone().index_fill_(0, torch.tensor([2], device="cuda"), math.nan)})
    whole = RLBatch.concat([cuda.select([0, 1]), cuda.select([2, 3])])
    assert whole.device.type == "cuda"
    for name in type(batch).model_fields:
        a, b = getattr(whole, name), getattr(batch, name)
        assert (torch.equal(a.cpu(), b) if isinstance(a, torch.Tensor) else a.to("cpu") == b if isinstance(a, SpanTable) else a == b), name
