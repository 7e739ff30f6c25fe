"""Every supported family, exact: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (DeepStack, timestamped video)
and Qwen3-VL-MoE, each with its own real processor and a tiny random model of its own config
class, over (image, several images, video, image + video) x (packed, left, right) x (vision
cache off / on):

- positions equal the model's own ``get_rope_index``;
- ``forward_hidden`` equals the model's own forward within the contract;
- under ``batch_invariant()``: every layout and the vision cache give the same bits, a sample
  alone equals it in the batch, ``decode_hidden`` equals the forward, and
  ``generate_on_policy``'s log-probs equal ``batch_logprobs`` on its own batch, bitwise.

Hypothesis varies prompt lengths, image sizes and frame counts for Qwen3-VL."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlk_mm import fixtures
from rlk_mm.fixtures import IM_END_TOKEN_ID, processor_inputs
from rlk_mm.models import VisionCache, batch_logprobs, forward_hidden, generate_on_policy, model_family
from rlk_mm.models.decode import decode_hidden
from rlk_mm.ops import batch_invariant
from rlk_mm.parity.contract import LOGPROB_MAX_ABS
from rlk_mm.parity.invariance import invariance_sweep
from rlk_mm.schema import RLBatch

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = {
    "qwen2_vl": (fixtures.qwen2_vl_processor, fixtures.tiny_qwen2_vl),
    "qwen2_5_vl": (fixtures.qwen_vl_processor, fixtures.tiny_qwen2_5_vl),
    "qwen3_vl": (fixtures.qwen3_vl_processor, fixtures.tiny_qwen3_vl),
    "qwen3_vl_moe": (fixtures.qwen3_vl_processor, fixtures.tiny_qwen3_vl_moe),
}
CONTENTS = ("image", "images", "video", "image+video")
PADDINGS = (None, "left", "right")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(name, processor, model) of one family; the processor's and model's family agree."""
    make_processor, make_model = FAMILIES[request.param]
    processor, model = make_processor(), make_model(seed=0)
    assert model_family(model).name == request.param
    return request.param, processor, model


def _samples(content: str, n: int = 3, seed: int = 0):
    if content == "image":
        return fixtures.synthetic_image_text(n, seed=seed)
    if content == "images":
        return fixtures.synthetic_image_text(n, seed=seed, max_images=3)
    return fixtures.synthetic_video_text(n, seed=seed, num_frames=4, with_image=content == "image+video")


def _batch(processor, samples, padding_side="left"):
    """The samples' prompts with a short response each (EOS included), and the processor output."""
    out = processor_inputs(processor, samples, padding_side=padding_side)
    responses = [processor.tokenizer.encode(f"answer {i}") + [IM_END_TOKEN_ID] for i in range(len(samples))]
    return RLBatch.from_qwen_vl(out, processor=processor, responses=responses), out


def _model_positions(model, out):
    """Each sample's positions from the model's own get_rope_index (unpadded)."""
    kw = {k: out.get(k) for k in ("image_grid_thw", "video_grid_thw")}
    if "second_per_grid_ts" in out and "second_per_grid_ts" in model.model.get_rope_index.__code__.co_varnames:
        kw["second_per_grid_ts"] = out["second_per_grid_ts"]
    pos, _ = model.model.get_rope_index(out["input_ids"], mm_token_type_ids=out["mm_token_type_ids"],
                                        attention_mask=out["attention_mask"], **kw)
    mask = out["attention_mask"].bool()
    return [pos[:, b, mask[b]] for b in range(mask.shape[0])]


@pytest.mark.parametrize("content", CONTENTS)
def test_positions_are_the_models_own(family, content):
    _, processor, model = family
    batch, out = _batch(processor, _samples(content))
    for b, want in enumerate(_model_positions(model, out)):
        got = batch.sample_positions(b)[:, : want.shape[1]]
        assert torch.equal(got, want), f"sample {b}"


@pytest.mark.parametrize("content", CONTENTS)
def test_forward_hidden_is_the_models_own_forward(family, content):
    _, processor, model = family
    batch, out = _batch(processor, _samples(content), padding_side="right")
    with torch.no_grad():
        ours = forward_hidden(model, batch)
        own = model.model(**{k: v for k, v in out.items()}).last_hidden_state
    cu = batch.cu_seqlens.long().tolist()
    for b in range(batch.num_samples):
        prompt = int(out["attention_mask"][b].sum())
        diff = (ours[cu[b] : cu[b] + prompt] - own[b, :prompt]).abs().max()
        assert diff <= LOGPROB_MAX_ABS.fp32, f"sample {b}: {diff}"  # fp32: the contract's log-prob bound


@pytest.mark.parametrize("content", CONTENTS)
def test_every_layout_cache_and_decode_are_bitwise_one_under_the_mode(family, content):
    _, processor, model = family
    batch, _ = _batch(processor, _samples(content))
    with torch.no_grad(), batch_invariant(backend="torch"):
        reference = forward_hidden(model, batch)
        rows = VisionCache(model)(batch)
        for padding in PADDINGS:
            assert torch.equal(forward_hidden(model, batch, padding=padding), reference), padding
            assert torch.equal(forward_hidden(model, batch, padding=padding, media_embeds=rows), reference), padding
        assert torch.equal(decode_hidden(model, batch), reference)
        assert torch.equal(decode_hidden(model, batch, media_embeds=rows), reference)
        cu = batch.cu_seqlens.long().tolist()
        for b in range(batch.num_samples):
            alone = forward_hidden(model, batch.select([b]))
            assert torch.equal(alone, reference[cu[b] : cu[b + 1]]), f"sample {b}"


@pytest.mark.parametrize("cached", [False, True], ids=["tower", "vision_cache"])
@pytest.mark.parametrize("content", CONTENTS)
def test_rollout_log_probs_are_the_training_log_probs(family, content, cached):
    _, processor, model = family
    prompts = processor_inputs(processor, _samples(content, n=2))
    cache = VisionCache(model) if cached else None
    rollout = generate_on_policy(model, prompts, processor=processor, max_new_tokens=4, samples_per_prompt=2, seed=5,
                                 backend="torch", vision_cache=cache)
    assert rollout.batch is not None and rollout.batch.layout_family == model_family(model).layout.value
    with torch.no_grad(), batch_invariant(backend="torch"):
        rows = VisionCache(model)(rollout.batch) if cached else None
        for padding in PADDINGS:
            got = batch_logprobs(model, rollout.batch, padding=padding, media_embeds=rows)
            assert torch.equal(got, rollout.flat_log_probs), padding


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.integers(1, 5), width=st.sampled_from([64, 96, 128]), height=st.sampled_from([64, 96]),
       words=st.integers(0, 6), seed=st.integers(0, 100))
def test_qwen3_vl_video_positions_and_decode_hold_for_any_shape(frames, width, height, words, seed):
    processor, model = _qwen3()
    sample = fixtures.synthetic_video_text(1, seed=seed, num_frames=frames, size=(width, height), with_image=seed % 2 == 0)[0]
    sample.messages[-1]["content"][-1]["text"] += " please" * words
    batch, out = _batch(processor, [sample])
    assert torch.equal(batch.sample_positions(0)[:, : out["input_ids"].shape[1]], _model_positions(model, out)[0])
    with torch.no_grad(), batch_invariant(backend="torch"):
        assert torch.equal(decode_hidden(model, batch), forward_hidden(model, batch, padding="left"))


_QWEN3 = {}


def _qwen3():
    if not _QWEN3:
        _QWEN3["pair"] = (fixtures.qwen3_vl_processor(), fixtures.tiny_qwen3_vl(seed=1))
    return _QWEN3["pair"]


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_the_invariance_sweep_is_bitwise_for_every_family(name):
    make_processor, make_model = FAMILIES[name]
    report = invariance_sweep(make_model(seed=0), make_processor(), _samples("image+video"), backend="torch",
                              control=False, probe=False)
    cases = [r for r in report.results if r.mode == "batch_invariant"]
    assert cases and all(r.bitwise for r in cases), [r for r in cases if not r.bitwise]
    assert {"decode", "vision_cache", "group_cache", "video_frames"} <= {r.case for r in cases}
