"""Bad and unusual inputs to the model runners (forward_hidden, layout_inputs, batch_logprobs, group_logprobs,
VisionCache)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm import RLBatch, fixtures
from rlk_mm.models import VisionCache, batch_logprobs, forward_hidden, generate_on_policy, group_logprobs, layout_inputs
from rlk_mm.schema import SchemaError
from support.context_cases import (
    Case,
    Raises,
    Returns,
    assert_well,
    fail,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _kept_twice(c):
    cache = VisionCache(c.model, keep=True)
    with torch.no_grad():
        cache(c.key_small)
        return cache(c.key_big)


def _rollout(c):
    """One two-row rollout of the tiny model (one new token), built once per context."""
    if not hasattr(c, "rollout"):
        prompts = fixtures.processor_inputs(c.processor, c.samples[:1])
        c.rollout = generate_on_policy(c.model, prompts, processor=c.processor, max_new_tokens=1, samples_per_prompt=2,
                                       seed=0, backend="torch")
    return c.rollout


BAD = [
    # ---------------------------------------------------------------- OnPolicyRollout.set_rewards
    Case("generate_on_policy.max_new_tokens.huge",
         lambda c: generate_on_policy(c.model, fixtures.processor_inputs(c.processor, c.samples[:1]),
                                      processor=c.processor, max_new_tokens=10**12),
         Raises(ValueError, r"max_new_tokens=1000000000000 is out of range: it must be .*<= 1048576")),
    Case("set_rewards.meta", lambda c: _rollout(c).set_rewards(torch.zeros(2, device="meta")),
         Raises(ValueError, r"rewards is on the meta device.*CPU or CUDA tensor")),
    Case("set_rewards.set", lambda c: _rollout(c).set_rewards({0.0, 1.0}),
         Raises(TypeError, r"rewards must be in row order.*got a set")),
    Case("set_rewards.huge_int", lambda c: _rollout(c).set_rewards([10**400, 0]),
         Raises(ValueError, r"rewards\[0\]=1000.* beyond float32's range.*rescale")),
    Case("set_rewards.beyond_float32", lambda c: _rollout(c).set_rewards([0.0, 1e39]),
         Raises(ValueError, r"rewards\[1\]=1e\+39 is beyond float32's range")),
    # ---------------------------------------------------------------- layout_inputs(batch, padding, pad_token_id)
    Case("layout_inputs.batch.list", lambda c: layout_inputs([c.batch]),
         Raises(TypeError, r"batch must be an RLBatch")),
    Case("layout_inputs.padding.word", lambda c: layout_inputs(c.batch, "middle"),
         Raises(ValueError, r"padding='middle': expected None \(packed")),
    Case("layout_inputs.padding.int", lambda c: layout_inputs(c.batch, 1),
         Raises(ValueError, r"padding=1: expected None")),
    Case("layout_inputs.pad.negative", lambda c: layout_inputs(c.batch, "right", -1),
         Raises(ValueError, r"pad_token_id=-1 is out of range")),
    Case("layout_inputs.pad.bool", lambda c: layout_inputs(c.batch, "right", True),
         Raises(TypeError, r"pad_token_id must be an int")),
    Case("layout_inputs.pad.float", lambda c: layout_inputs(c.batch, "right", 0.5),
         Raises(TypeError, r"pad_token_id must be an int")),
    Case("layout_inputs.pad.image_placeholder", lambda c: layout_inputs(c.batch, "left", c.batch.image_token_id),
         Raises(ValueError, r"pad_token_id=\d+ is the batch's image placeholder token")),
    # ---------------------------------------------------------------- forward_hidden / batch_logprobs
    Case("forward_hidden.model.none", lambda c: forward_hidden(None, c.image_batch),
         Raises(TypeError, r"model \w+ is not a supported model family")),
    Case("forward_hidden.model.linear", lambda c: forward_hidden(torch.nn.Linear(2, 2), c.image_batch),
         Raises(TypeError, r"model \w+ is not a supported model family")),
    Case("forward_hidden.batch.dict", lambda c: forward_hidden(c.model, {"input_ids": c.batch.input_ids}),
         Raises(TypeError, r"batch must be an RLBatch")),
    Case("forward_hidden.padding", lambda c: forward_hidden(c.model, c.image_batch, padding="packd"),
         Raises(ValueError, r"padding='packd'")),
    Case("forward_hidden.media_embeds.rows",
         lambda c: forward_hidden(c.model, c.image_batch, media_embeds=torch.zeros(3, 64)),
         Raises(ValueError, r"media_embeds has 3 rows; the batch's media items need 8")),
    Case("forward_hidden.media_embeds.width",
         lambda c: forward_hidden(c.model, c.image_batch, media_embeds=torch.zeros(8, 32)),
         Raises(ValueError, r"media_embeds must be \[8, 64\]")),
    Case("forward_hidden.media_embeds.int",
         lambda c: forward_hidden(c.model, c.image_batch, media_embeds=torch.zeros(8, 64, dtype=torch.long)),
         Raises(TypeError, r"media_embeds must be float")),
    Case("forward_hidden.media_embeds.list",
         lambda c: forward_hidden(c.model, c.image_batch, media_embeds=[[0.0] * 64] * 8),
         Raises(TypeError, r"media_embeds must be a torch\.Tensor")),
    Case("forward_hidden.token_beyond_vocab", lambda c: forward_hidden(c.model, c.big_id),
         Raises(ValueError, r"input_ids: sample 0, position 2 holds 200000.*vocabulary of 151669")),
    Case("forward_hidden.no_pixels", lambda c: forward_hidden(c.model, c.no_pixels),
         Raises(ValueError, r"media item 0 \(image\) has no pixel values.*media_embeds")),
    Case("forward_hidden.image_token_id",
         lambda c: forward_hidden(c.model, RLBatch.model_construct(**{**dict(c.image_batch), "image_token_id": 7})),
         Raises(ValueError, r"batch\.image_token_id=7 but the model's image_token_id is 151655")),
    Case("batch_logprobs.temperature.zero", lambda c: batch_logprobs(c.model, c.image_batch, temperature=0),
         Raises(ValueError, r"temperature must be a finite number >= 1e-05; got 0.0")),
    Case("batch_logprobs.temperature.nan", lambda c: batch_logprobs(c.model, c.image_batch, temperature=math.nan),
         Raises(ValueError, r"temperature must be a finite number >= 1e-05; got nan")),
    Case("batch_logprobs.temperature.str", lambda c: batch_logprobs(c.model, c.image_batch, temperature="1"),
         Raises(TypeError, r"temperature must be a number")),
    Case("batch_logprobs.temperature.bool", lambda c: batch_logprobs(c.model, c.image_batch, temperature=True),
         Raises(TypeError, r"temperature must be a number")),
    Case("batch_logprobs.model.none", lambda c: batch_logprobs(None, c.image_batch),
         Raises(TypeError, r"model \w+ is not a supported model family")),
    # ---------------------------------------------------------------- VisionCache
    Case("VisionCache.model.none", lambda c: VisionCache(None),
         Raises(TypeError, r"model \w+ is not a supported model family")),
    Case("VisionCache.keep.int", lambda c: VisionCache(c.model, keep=1),
         Raises(TypeError, r"keep must be True or False")),
    Case("VisionCache.batch.list", lambda c: VisionCache(c.model)([c.image_batch]),
         Raises(TypeError, r"batch must be an RLBatch")),
    Case("VisionCache.no_pixels", lambda c: VisionCache(c.model)(c.no_pixels),
         Raises(ValueError, r"media item 0 \(image\) has no pixel values")),
    Case("VisionCache.shared_key.pixels", lambda c: VisionCache(c.model)(c.same_key),
         Raises(ValueError, r"media_cache_keys: items 0 and 1 share key 'k' but their pixel values differ")),
    Case("VisionCache.kept_key.grid", lambda c: _kept_twice(c),
         Raises(ValueError, r"media_cache_keys: item 0's key 'k' is kept .*grid \[1, 2, 2\].*\[1, 4, 4\]")),
    # ---------------------------------------------------------------- group_logprobs / group_hidden
    Case("group_logprobs.cache.other_model",
         lambda c: group_logprobs(c.model, c.image_batch, vision_cache=VisionCache(c.other_model)),
         Raises(ValueError, r"vision_cache runs another model")),
    Case("group_logprobs.cache.type", lambda c: group_logprobs(c.model, c.image_batch, vision_cache={}),
         Raises(TypeError, r"vision_cache must be a VisionCache")),
    Case("group_logprobs.temperature", lambda c: group_logprobs(c.model, c.image_batch, temperature=-1.0),
         Raises(ValueError, r"temperature must be a finite number >= 1e-05; got -1.0")),
    Case("group_logprobs.batch.none", lambda c: group_logprobs(c.model, None),
         Raises(TypeError, r"batch must be an RLBatch")),
    Case("group_logprobs.model.none", lambda c: group_logprobs(None, c.image_batch),
         Raises(TypeError, r"model \w+ is not a supported model family")),
]


GOOD = [
    Case("layout_inputs.empty_batch", lambda c: layout_inputs(c.batch.select([]), "left")[0]["input_ids"],
         Returns(lambda r, c: r.shape == (0, 0) or fail(r))),
]


@pytest.mark.parametrize("case", BAD + GOOD, ids=lambda case: case.id)
def test_input(case, input_context):
    assert_well(case, input_context)


_ENTRIES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6), st.booleans(),
                     st.none(), st.text(max_size=2))


@settings(deadline=None, max_examples=40)
@given(st.lists(_ENTRIES, max_size=4))
def test_set_rewards_accepts_exactly_finite_numbers_of_the_right_count(input_context, rewards):
    """set_rewards keeps the rewards (as float32) exactly when every entry is a finite real number (not a bool)
    and there is one per row; otherwise it raises our error and leaves the batch's rewards unchanged."""
    rollout = _rollout(input_context)
    before = rollout.batch.rewards
    ok = len(rewards) == rollout.batch.num_samples and all(
        not isinstance(r, bool) and isinstance(r, (int, float)) and math.isfinite(r) and abs(r) <= torch.finfo(torch.float32).max
        for r in rewards)
    if ok:
        got = rollout.set_rewards(rewards).rewards
        assert torch.equal(got, torch.tensor([float(r) for r in rewards], dtype=torch.float32))
    else:
        with pytest.raises((TypeError, ValueError, SchemaError)):
            rollout.set_rewards(rewards)
        assert rollout.batch.rewards is before


@settings(deadline=None, max_examples=16)
@given(st.booleans(), st.sampled_from([None, "torch"]), st.sampled_from(["invariant", "default"]),
       st.sampled_from([None, "torch"]))
def test_generate_on_policy_runs_the_kernels_it_reports(input_context, inside, block_backend, kernels, backend):
    """Inside or outside an active batch_invariant() block, generate_on_policy either reports the kernels it ran
    (.kernels, settings['backend']: None for the model's own, else the invariant backend) or refuses by name."""
    from rlk_mm.ops import batch_invariant

    c = input_context
    prompts = fixtures.processor_inputs(c.processor, c.samples[:1])
    call = lambda: generate_on_policy(c.model, prompts, processor=c.processor, max_new_tokens=1, seed=0,  # noqa: E731
                                      kernels=kernels, backend=backend)
    refused = (kernels == "default" and (backend is not None or inside)) or (inside and backend is not None
                                                                             and block_backend != backend)
    with batch_invariant(backend=block_backend) if inside else contextlib.nullcontext():
        if refused:
            with pytest.raises(ValueError, match=r"kernels='default'|backend"):
                call()
            return
        rollout = call()
    assert str(rollout.kernels) == kernels
    assert rollout.settings["backend"] == (None if kernels == "default" else "torch")
