"""The batch contract where a batch is built, combined, selected or loaded:
a GRPO group answers one prompt; group ids keep one type; a media id names one content."""

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from rlk_mm import BatchFileError, RLBatch, SchemaError
from rlk_mm.fixtures import processor_inputs, synthetic_image_text
from rlk_mm.ops import group_seeds
from rlk_mm.schema import dense_group_index

IM_END = 151645


def tokens(processor, prompts, responses, **kw):
    return RLBatch.from_token_lists(prompts, responses, processor=processor, **kw)


@pytest.fixture(scope="module")
def two_prompts(processor):
    """Two image prompts (different images), each answered twice."""
    samples = synthetic_image_text(2, seed=3) * 2
    out = processor_inputs(processor, samples)
    responses = [[5, IM_END], [6, 7, IM_END], [8, IM_END], [9, IM_END]]
    return out, responses


def test_builders_refuse_a_group_of_several_prompts(processor, two_prompts):
    out, responses = two_prompts
    ok = RLBatch.from_qwen_vl(out, processor=processor, responses=responses, group_ids=["a", "b", "a", "b"])
    assert ok.group_index().tolist() == [0, 1, 0, 1]
    with pytest.raises(SchemaError, match=r"group_ids: sample 1 is in group 'a' with sample 0 .* answers one prompt"):
        RLBatch.from_qwen_vl(out, processor=processor, responses=responses, group_ids=["a", "a", "b", "b"])


def test_same_text_other_image_is_another_prompt(processor):
    """Same prompt tokens (one image of one size), other pixels: the media keys differ."""
    a, b = synthetic_image_text(2, seed=5, sizes=[(56, 56)], max_images=1)
    b = dataclasses.replace(b, messages=a.messages)  # a's text with b's image
    out = processor_inputs(processor, [a, b])
    assert torch.equal(out["input_ids"][0], out["input_ids"][1])
    with pytest.raises(SchemaError, match=r"prompts differ at position \d+ \(token, position or media item\)"):
        RLBatch.from_qwen_vl(out, processor=processor, responses=[[5, IM_END], [6, IM_END]], group_ids=["g", "g"])


def test_concat_select_and_load_check_groups(processor, tmp_path):
    a = tokens(processor, [[1, 2, 3]], [[7, 8]], group_ids=["g0"])
    b = tokens(processor, [[4, 5, 6]], [[7, 8]], group_ids=["g0"])
    with pytest.raises(SchemaError, match=r"sample 1 is in group 'g0' with sample 0 but their prompts differ at "
                                          r"position 0"):
        RLBatch.concat([a, b])
    c = tokens(processor, [[1, 2, 3]], [[9]], group_ids=["g0"])
    assert RLBatch.concat([a, c]).group_index().tolist() == [0, 0]
    fields = {name: getattr(b, name) for name in type(b).model_fields}
    path = tmp_path / "b.safetensors"
    both = RLBatch.concat([a, RLBatch(**{**fields, "group_ids": ["g1"]})])
    both.save(path)
    # a file whose group ids were edited to collide
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    values = json.loads(meta["fields"])
    values["group_ids"] = ["g0", "g0"]
    save_file(tensors, str(path), metadata={**meta, "fields": json.dumps(values)})
    with pytest.raises(BatchFileError, match=r"group_ids is \['g0', 'g0'\], not the value saved: the file was changed"):
        RLBatch.load(path)
    # a file from before the identity record: the group invariant refuses the edit
    save_file(tensors, str(path), metadata={**{k: v for k, v in meta.items() if k != "identity"},
                                            "fields": json.dumps(values)})
    with pytest.raises(BatchFileError, match=r"group 'g0' with sample 0"):
        RLBatch.load(path)


def test_prompt_length_differs(processor):
    with pytest.raises(SchemaError, match=r"its prompt has 2 tokens, sample 0's 3"):
        tokens(processor, [[1, 2, 3], [1, 2]], [[7], [7]], group_ids=["g", "g"])


@pytest.mark.parametrize("ids, error, match", [
    ([1, "1"], TypeError, r"group_ids mixes str and int ids \(group_ids\[0\] is int 1, group_ids\[1\] is str '1'\)"),
    (["1", 1], TypeError, r"mixes str and int ids"),
    ([True, False], TypeError, r"group_ids\[0\] is bool True"),
    ([1.0, 1.0], TypeError, r"a group id is a str or an int"),
])
def test_group_id_types_are_one_rule(processor, ids, error, match):
    """The builders, dense_group_index and group_seeds take the same ids and refuse the same mixes."""
    with pytest.raises(error, match=match):
        tokens(processor, [[1, 2, 3], [1, 2, 3]], [[7], [8]], group_ids=ids)
    with pytest.raises(error, match=match):
        dense_group_index(ids)
    with pytest.raises(error, match=match):
        group_seeds(0, ids, 0)


def test_media_id_names_one_content(processor, two_prompts):
    out, responses = two_prompts
    batch = RLBatch.from_qwen_vl(out, processor=processor, responses=responses, group_ids=["a", "b", "a", "b"])
    fields = {name: getattr(batch, name) for name in type(batch).model_fields}
    ids = list(batch.media_ids)
    assert batch.media_cache_keys[0] != batch.media_cache_keys[1]
    with pytest.raises(SchemaError, match=r"media_ids: media items 0 and 1 share the id .* different media_cache_keys"):
        RLBatch(**{**fields, "media_ids": [ids[0], ids[0], *ids[2:]]})
    same = RLBatch(**{**fields, "media_ids": [ids[0], ids[1], ids[0], ids[1]]})  # equal contents may share an id
    assert same.media_ids[2] == same.media_ids[0]


@settings(max_examples=30, deadline=None)
@given(prompts=st.lists(st.sampled_from([(1, 2, 3), (1, 2, 4), (5, 6)]), min_size=1, max_size=5),
       groups=st.lists(st.sampled_from(["x", "y", "z"]), min_size=5, max_size=5))
def test_accepted_exactly_when_each_group_has_one_prompt(processor, prompts, groups):
    """Property: a batch is accepted exactly when samples sharing a group id share their prompt."""
    groups = groups[: len(prompts)]
    one_prompt = all(len({p for p, g in zip(prompts, groups) if g == gid}) == 1 for gid in set(groups))
    try:
        batch = tokens(processor, [list(p) for p in prompts], [[9, IM_END]] * len(prompts), group_ids=groups)
    except SchemaError as e:
        assert not one_prompt and "answers one prompt" in str(e)
    else:
        assert one_prompt
        assert batch.select(list(reversed(range(batch.num_samples)))).num_samples == len(prompts)


@pytest.mark.parametrize("path", [None, 3, b"batch.safetensors", "", 1.5])
def test_save_and_load_take_a_path(processor, path):
    batch = tokens(processor, [[1, 2, 3]], [[7]])
    with pytest.raises(TypeError, match=r"path must be a file path \(a non-empty str or pathlib.Path\), got"):
        RLBatch.load(path)
    with pytest.raises(TypeError, match=r"path must be a file path"):
        batch.save(path)


def _rewrite(path, edit_tensors=None, edit_meta=None):
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    if edit_tensors:
        edit_tensors(tensors)
    if edit_meta:
        edit_meta(meta)
    save_file(tensors, str(path), metadata=meta)


def test_a_file_whose_pixels_changed_is_refused(processor, two_prompts, tmp_path):
    """Same shapes, same metadata, other pixel values: the saved cache keys no longer name the content."""
    out, responses = two_prompts
    batch = RLBatch.from_qwen_vl(out, processor=processor, responses=responses, group_ids=["a", "b", "a", "b"])
    path = tmp_path / "b.safetensors"
    batch.save(path)
    assert RLBatch.load(path) == batch

    def bump(tensors):
        tensors["pixel_values"][:4] += 1

    _rewrite(path, edit_tensors=bump)
    with pytest.raises(BatchFileError, match=r"media item 0 .* its pixel rows \(or its grid.*\) are not those saved with its "
                                             r"cache key"):
        RLBatch.load(path)
    batch.save(path)
    _rewrite(path, edit_meta=lambda meta: meta.pop("identity"))  # a file from before the identity record: loads
    assert RLBatch.load(path) == batch
    _rewrite(path, edit_meta=lambda meta: meta.update(identity="[1"))
    with pytest.raises(BatchFileError, match=r"batch metadata 'identity' is damaged"):
        RLBatch.load(path)


def test_a_transposed_group_of_three_is_not_guessed(processor, tiny_model):
    """A GRPO group of 3 identical image prompts: (B, 3, L) positions have the shape of (3, B, L);
    read that way its text tokens look fine, but its image tokens get t = h = w."""
    samples = synthetic_image_text(1, seed=8, max_images=1, sizes=[(56, 56)]) * 3
    out = processor_inputs(processor, samples, padding_side="left")
    pos, _ = tiny_model.model.get_rope_index(out["input_ids"], out["mm_token_type_ids"], out["image_grid_thw"],
                                             attention_mask=out["attention_mask"])
    ok = RLBatch.from_qwen_vl(out, processor=processor, position_ids=pos)  # (3, B, L), as transformers returns it
    assert torch.equal(ok.position_ids, RLBatch.from_qwen_vl(out, processor=processor).position_ids)
    with pytest.raises(SchemaError,
                       match=r"media tokens all have t = h = w, which M-RoPE never gives: .*\.transpose\(0, 1\)"):
        RLBatch.from_qwen_vl(out, processor=processor, position_ids=pos.transpose(0, 1).contiguous())


def test_a_prompts_only_batch_is_all_prompt(processor, two_prompts):
    """Without responses (a rollout's prompt batch) the whole sample is the prompt."""
    out, _ = two_prompts
    assert RLBatch.from_qwen_vl(out, processor=processor, group_ids=["a", "b", "a", "b"]).group_ids == list("abab")
    with pytest.raises(SchemaError, match=r"sample 1 is in group 'a' with sample 0"):
        RLBatch.from_qwen_vl(out, processor=processor, group_ids=["a", "a", "b", "b"])
