"""generate_on_policy: rollout log-probs are bitwise the training log-probs of the returned
RLBatch under batch_invariant() (packed, left- and right-padded), for several images per
prompt, a video prompt, prompts of different lengths, rows stopping at different steps,
with and without VisionCache, fp32 and bf16, the torch backend and Triton under the
interpreter; the default-kernels control; a bad-input table and hypothesis properties."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlk_mm import fixtures
from rlk_mm.models import Kernels, VisionCache, batch_logprobs, generate_on_policy
from rlk_mm.ops import batch_invariant
from rlk_mm.parity.contract import LOGPROB_MAX_ABS
from rlk_mm.schema import RLBatch

pytestmark = pytest.mark.usefixtures("one_thread")

PADDINGS = [None, "left", "right"]


@pytest.fixture(scope="module")
def image_prompts(processor):
    """Three image prompts of different lengths (1 or 2 images each), left-padded."""
    return fixtures.processor_inputs(processor, fixtures.synthetic_image_text(3, seed=1, max_images=2))


def _rollout(model, prompts, processor, **kw):
    kw = {"max_new_tokens": 5, "samples_per_prompt": 2, "seed": 3, "backend": "torch", **kw}
    return generate_on_policy(model, prompts, processor=processor, **kw)


def _stopping(model, prompts, processor, **kw):
    """A rollout whose rows stop at different steps: the stop ids are tokens two rows drew
    (the draws before a stop do not change: each is a function of its row's seed and step)."""
    first = _rollout(model, prompts, processor, **kw)
    stop = [int(first.responses[0][1]), int(first.responses[3][3])]
    return _rollout(model, prompts, processor, stop_token_ids=stop, **kw)


def _training(model, batch, padding, backend="torch", media_embeds=None):
    with torch.no_grad(), batch_invariant(backend=backend):
        return batch_logprobs(model, batch, padding=padding, media_embeds=media_embeds)


def _assert_on_policy(model, rollout, backend="torch", media_embeds=None):
    assert rollout.batch is not None and rollout.kernels is Kernels.INVARIANT
    spans = rollout.batch.loss_token_index()[1].cpu()
    assert torch.equal(spans, torch.cat(rollout.responses))  # the batch scores exactly the responses
    for padding in PADDINGS:
        got = _training(model, rollout.batch, padding, backend, media_embeds)
        assert torch.equal(got.cpu(), rollout.flat_log_probs), padding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollout_log_probs_are_the_training_log_probs(processor, image_prompts, dtype):
    model = fixtures.tiny_qwen2_5_vl(seed=0).eval().to(dtype)
    rollout = _stopping(model, image_prompts, processor)
    lengths = [len(r) for r in rollout.responses]
    assert lengths[0] == 2 and lengths[3] == 4 and max(lengths) == 5 and rollout.stopped[0]
    assert rollout.rows == list(range(6)) and rollout.rejected == []
    assert rollout.batch.group_ids == ["0", "0", "1", "1", "2", "2"]
    _assert_on_policy(model, rollout)


def test_vision_cache_gives_the_same_rollout_and_training_bits(tiny_model, processor, image_prompts):
    plain = _stopping(tiny_model, image_prompts, processor)
    cached = _stopping(tiny_model, image_prompts, processor, vision_cache=VisionCache(tiny_model))
    with torch.no_grad(), batch_invariant(backend="torch"):  # training encodes the media under the mode too
        media = VisionCache(tiny_model)(plain.batch)
    assert all(torch.equal(a, b) for a, b in zip(plain.responses, cached.responses))
    assert torch.equal(plain.flat_log_probs, cached.flat_log_probs)
    _assert_on_policy(tiny_model, cached, media_embeds=media)


def test_a_video_prompt_and_the_other_input_forms(tiny_model, processor):
    samples = fixtures.synthetic_video_text(2, seed=2, with_image=True)
    inputs = fixtures.processor_inputs(processor, samples)
    rollout = _rollout(tiny_model, inputs, processor, max_new_tokens=3, samples_per_prompt=1)
    assert rollout.batch.video_grid_thw.shape[0] == 2
    _assert_on_policy(tiny_model, rollout)
    prompts = RLBatch.from_qwen_vl(inputs, processor=processor)
    again = _rollout(tiny_model, prompts, processor, max_new_tokens=3, samples_per_prompt=1)
    assert torch.equal(again.flat_log_probs, rollout.flat_log_probs)


def test_rows_that_draw_a_padded_head_row_are_rejected(processor, image_prompts):
    """A head with more rows than the tokenizer has ids (Qwen2.5-VL's padded 151,936 / 152,064): a
    row that draws one of the extra ids stops and is left out of the batch, which scores the rest."""
    model = fixtures.tiny_qwen2_5_vl(seed=0, vocab_size=len(processor.tokenizer) + 64).eval()
    with torch.no_grad():
        model.lm_head.weight[len(processor.tokenizer):] *= 40  # the padding rows: likely draws
    rollout = _rollout(model, image_prompts, processor, max_new_tokens=4)
    assert rollout.rejected and len(rollout.rows) + len(rollout.rejected) == 6
    if rollout.batch is not None:
        assert all(int(r.max()) < len(processor.tokenizer) for r in rollout.responses)
        _assert_on_policy(model, rollout)


def test_a_row_does_not_depend_on_its_batch(tiny_model, processor, image_prompts):
    """The second prompt alone (its own seeds) decodes the same tokens and log-probs as in the batch."""
    together = _rollout(tiny_model, image_prompts, processor)
    alone_inputs = fixtures.processor_inputs(processor, fixtures.synthetic_image_text(3, seed=1, max_images=2)[1:2])
    alone = _rollout(tiny_model, alone_inputs, processor, seed=None, seeds=together.seeds[2:4])
    for i in range(2):
        assert torch.equal(alone.responses[i], together.responses[2 + i])
        assert torch.equal(alone.log_probs[i], together.log_probs[2 + i])


def test_default_kernels_are_the_control(tiny_model, processor, image_prompts):
    rollout = _rollout(tiny_model, image_prompts, processor, kernels="default", backend=None)
    assert rollout.kernels is Kernels.DEFAULT
    with torch.no_grad():
        training = batch_logprobs(tiny_model, rollout.batch)
    assert (training - rollout.flat_log_probs).abs().max() < LOGPROB_MAX_ABS.for_dtype(torch.float32)


def test_rewards_and_sampling_filters(tiny_model, processor, image_prompts):
    rollout = _rollout(tiny_model, image_prompts, processor, top_k=5, top_p=0.9, temperature=0.7, max_new_tokens=2)
    assert all((s >= lp).all() for s, lp in zip(rollout.sampled_log_probs, rollout.log_probs))
    with torch.no_grad(), batch_invariant(backend="torch"):
        training = batch_logprobs(tiny_model, rollout.batch, temperature=0.7)
    assert torch.equal(training, rollout.flat_log_probs)
    batch = rollout.set_rewards([float(i) for i in range(6)])
    assert batch.rewards.tolist() == [float(i) for i in range(6)] and rollout.batch is batch
    with pytest.raises(ValueError, match="rewards has 2 entries but the batch has 6"):
        rollout.set_rewards([1.0, 2.0])


@pytest.mark.parametrize("rewards,error,match", [
    (["1", "0", "1", "0", "1", "0"], TypeError, r"rewards\[0\] must be a number, got str"),
    ([1.0, 2.0, True, 0.0, 1.0, 0.0], TypeError, r"rewards\[2\] must be a number, got bool"),
    ([1.0, float("nan"), 0.0, 0.0, 1.0, 0.0], ValueError, r"rewards\[1\]=nan must be a finite number"),
    (torch.ones(2, 3), ValueError, "rewards"),
    (torch.ones(6, dtype=torch.bool), TypeError, "rewards must be a float or integer tensor"),
    ("101010", TypeError, "rewards"),
])
def test_set_rewards_names_the_bad_entry(tiny_model, processor, image_prompts, rewards, error, match):
    rollout = _rollout(tiny_model, image_prompts, processor, max_new_tokens=1)
    with pytest.raises(error, match=match):
        rollout.set_rewards(rewards)
    with pytest.raises(TypeError, match="tokenizer must have a decode method"):
        rollout.texts("tokenizer")
    assert rollout.set_rewards(torch.arange(6)).rewards.tolist() == [float(i) for i in range(6)]


def test_the_kernels_asked_for_are_the_kernels_that_run(tiny_model, processor, image_prompts):
    """Inside an active batch_invariant() block the default kernels cannot run, nor another
    backend: both are refused by name, and a rollout's settings say which backend ran."""
    with batch_invariant(backend="torch"):
        with pytest.raises(ValueError, match="kernels='default' inside an active batch_invariant"):
            _rollout(tiny_model, image_prompts, processor, kernels="default", backend=None, max_new_tokens=1)
        with pytest.raises(ValueError, match="backend='triton' inside an active batch_invariant\\(backend='torch'\\)"):
            _rollout(tiny_model, image_prompts, processor, backend="triton", max_new_tokens=1)
        inside = _rollout(tiny_model, image_prompts, processor, backend=None, max_new_tokens=1)
    assert inside.settings["backend"] == "torch"
    default = _rollout(tiny_model, image_prompts, processor, kernels="default", backend=None, max_new_tokens=1)
    assert default.settings["backend"] is None and default.kernels is Kernels.DEFAULT


@pytest.mark.slow
def test_triton_under_the_interpreter(processor):
    model = fixtures.tiny_qwen2_5_vl(seed=0, hidden_size=32, num_heads=2, num_kv_heads=1, vision_depth=1).eval()
    samples = fixtures.synthetic_image_text(1, seed=4, max_images=1, sizes=[(56, 56)])
    inputs = fixtures.processor_inputs(processor, samples)
    rollout = _rollout(model, inputs, processor, backend="triton", max_new_tokens=2)
    _assert_on_policy(model, rollout, backend="triton")


def _bad_cases(model, inputs, processor):
    other = fixtures.tiny_qwen2_5_vl(seed=1).eval()
    answered = RLBatch.from_qwen_vl(inputs, processor=processor, responses=[[5], [6], [7]])
    return [
        ({"processor": None}, TypeError, "processor must be the model's Qwen2.5-VL processor"),
        ({"kernels": "fast"}, ValueError, "kernels"),
        ({"kernels": "default"}, ValueError, "with kernels='default' leave it None"),
        ({"backend": "cuda"}, ValueError, "backend must be None, 'torch' or 'triton'"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"samples_per_prompt": 0}, ValueError, "samples_per_prompt"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"top_k": 0}, ValueError, "top_k"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"seeds": torch.arange(6)}, ValueError, "give one of seeds"),
        ({"seed": None}, ValueError, "give one of seeds"),
        ({"seed": None, "seeds": torch.arange(5)}, ValueError, "seeds has 5 entries but the rollout has 6 rows"),
        ({"seed": None, "seeds": torch.zeros(6)}, TypeError, "seeds"),
        ({"group_ids": ["a", "b"]}, ValueError, "group_ids has 2 entries but there are 3 prompts"),
        ({"stop_token_ids": [-1]}, ValueError, r"stop_token_ids\[0\]"),
        ({"stop_token_ids": [10**7]}, ValueError, r"stop_token_ids\[0\]"),
        ({"vision_cache": object()}, TypeError, "vision_cache must be a VisionCache"),
        ({"vision_cache": VisionCache(other)}, ValueError, "vision_cache runs another model"),
        ({"prompts": answered}, ValueError, "prompts is an RLBatch with loss spans"),
        ({"prompts": "a cat"}, TypeError, "prompts must be a processor output"),
    ]


def test_bad_inputs_are_refused_before_any_work(tiny_model, processor, image_prompts):
    for change, error, message in _bad_cases(tiny_model, image_prompts, processor):
        kw = {"prompts": image_prompts, "processor": processor, "max_new_tokens": 2, "samples_per_prompt": 2,
              "seed": 0, "backend": "torch", **change}
        with pytest.raises(error, match=message):
            generate_on_policy(tiny_model, kw.pop("prompts"), **kw)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), group=st.integers(1, 3), steps=st.integers(1, 4), stop_at=st.integers(0, 3))
def test_property_any_seed_group_and_stop_is_on_policy(tiny_model, processor, image_prompts, seed, group, steps,
                                                       stop_at):
    first = _rollout(tiny_model, image_prompts, processor, seed=seed, samples_per_prompt=group, max_new_tokens=steps)
    stop = [int(first.responses[0][min(stop_at, steps - 1)])]
    rollout = _rollout(tiny_model, image_prompts, processor, seed=seed, samples_per_prompt=group,
                       max_new_tokens=steps, stop_token_ids=stop)
    assert len(rollout.responses[0]) == min(stop_at, steps - 1) + 1 and rollout.stopped[0]
    for a, b in zip(first.responses, rollout.responses):
        assert torch.equal(a[: len(b)], b)  # a stop only cuts a row short
    got = _training(tiny_model, rollout.batch, None)
    assert torch.equal(got, rollout.flat_log_probs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_rollout_and_decode_are_the_training_forward(processor, dtype):
    """On CUDA with the Triton kernels: rollout log-probs equal the training log-probs and the
    KV-cache decode equals the one-pass forward, bitwise, in every layout; the default
    kernels' control runs (its drift is measured, not bounded, here)."""
    from rlk_mm.models import forward_hidden
    from rlk_mm.models.decode import decode_hidden

    model = fixtures.tiny_qwen2_5_vl(seed=0, hidden_size=256, num_heads=4, num_kv_heads=2).eval().to("cuda", dtype)
    samples = fixtures.synthetic_image_text(3, seed=1, max_images=2) + fixtures.synthetic_video_text(1, seed=2)
    inputs = fixtures.processor_inputs(processor, samples)
    rollout = _stopping(model, inputs, processor, backend=None, max_new_tokens=8, samples_per_prompt=3)
    _assert_on_policy(model, rollout, backend=None)
    with torch.no_grad(), batch_invariant():
        decoded = decode_hidden(model, rollout.batch)
        for padding in PADDINGS:
            assert torch.equal(decoded, forward_hidden(model, rollout.batch, padding=padding)), padding
    control = _rollout(model, inputs, processor, backend=None, kernels="default", max_new_tokens=8)
    with torch.no_grad():
        training = batch_logprobs(model, control.batch)
    assert training.shape == control.flat_log_probs.shape and torch.isfinite(training).all()  # drift is allowed


@pytest.mark.slow
def test_the_benchmark_dry_run_writes_its_json(tmp_path):
    from bench import bench_on_policy

    data = bench_on_policy.main(["--dry-run", "--out", str(tmp_path)])
    written = (tmp_path / "on_policy.json").read_text()
    assert '"headline"' in written and data["setup"]["dry_run"]
    result = data["results"]["tiny"]
    for kernels in ("default", "invariant"):
        step = result[kernels]["rl_step"]
        assert all(step[k] > 0 for k in ("rollout_ms", "old_logprob_ms", "train_ms", "forward_ms"))
    for row in data["headline"]:  # times in ms, invariant (ours) against default kernels (peer)
        assert set(row) - {"note"} == {"metric", "ours", "peer", "unit"} and row["unit"] == "ms", row
