"""Qwen3-VL on CUDA at Qwen3-VL-2B / 8B widths (few layers, random weights): under
``batch_invariant()`` (Triton) every layout, the vision cache and the KV-cache decode give the
forward's bits, and ``generate_on_policy``'s log-probs are ``batch_logprobs``' bitwise, on an
image + video prompt, in bfloat16 and float32. Run on the GPU machine: ``pytest -m gpu``."""

import pytest
import torch

from rlk_mm import fixtures
from rlk_mm.models import VisionCache, batch_logprobs, forward_hidden, generate_on_policy
from rlk_mm.models.decode import decode_hidden
from rlk_mm.ops import batch_invariant

pytestmark = pytest.mark.gpu

#: the released checkpoints' widths (text hidden / heads / kv heads / MLP, vision hidden / heads),
#: at 3 text layers and 3 vision blocks, each a DeepStack tap
WIDTHS = {
    "2b": dict(hidden_size=2048, num_heads=16, num_kv_heads=8, intermediate_size=6144, vision_hidden_size=1024,
               vision_heads=16),
    "8b": dict(hidden_size=4096, num_heads=32, num_kv_heads=8, intermediate_size=12288, vision_hidden_size=1152,
               vision_heads=16),
}


@pytest.fixture(scope="module")
def processor():
    return fixtures.qwen3_vl_processor()


@pytest.fixture(scope="module", params=[(w, d) for w in WIDTHS for d in (torch.bfloat16, torch.float32)],
                ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}")
def model(request):
    width, dtype = request.param
    built = fixtures.tiny_qwen3_vl(seed=0, num_layers=3, vision_depth=3, deepstack_visual_indexes=(0, 1, 2),
                                   **WIDTHS[width])
    yield built.to("cuda", dtype)
    del built
    torch.cuda.empty_cache()


def _prompts(processor):
    return fixtures.processor_inputs(processor, fixtures.synthetic_video_text(3, seed=2, num_frames=4, with_image=True))


def test_decode_cache_and_layouts_are_the_forward_bitwise(processor, model):
    rollout = generate_on_policy(model, _prompts(processor), processor=processor, max_new_tokens=6, samples_per_prompt=2,
                                 seed=1)
    batch = rollout.batch
    with torch.no_grad(), batch_invariant():
        reference = forward_hidden(model, batch)
        rows = VisionCache(model)(batch)
        for padding in (None, "left", "right"):
            assert torch.equal(forward_hidden(model, batch, padding=padding), reference), padding
            assert torch.equal(forward_hidden(model, batch, padding=padding, media_embeds=rows), reference), padding
        assert torch.equal(decode_hidden(model, batch), reference)


def test_rollout_log_probs_are_the_training_log_probs(processor, model):
    cache = VisionCache(model)
    rollout = generate_on_policy(model, _prompts(processor), processor=processor, max_new_tokens=8, samples_per_prompt=2,
                                 seed=3, vision_cache=cache)
    with torch.no_grad(), batch_invariant():
        for padding in (None, "left"):
            got = batch_logprobs(model, rollout.batch, padding=padding)
            assert torch.equal(got.cpu(), rollout.flat_log_probs.cpu()), padding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_qwen3_vl_moe_rollout_and_decode_are_the_forward_bitwise(processor, dtype):
    """Qwen3-VL-MoE at the 30B-A3B text width (2048, head dim 128), 16 experts with 4 a token."""
    model = fixtures.tiny_qwen3_vl_moe(seed=0, hidden_size=2048, num_heads=16, num_kv_heads=4, num_experts=16,
                                       num_experts_per_tok=4, moe_intermediate_size=768, num_layers=3,
                                       vision_hidden_size=1024, vision_heads=16, vision_depth=3).to("cuda", dtype)
    rollout = generate_on_policy(model, _prompts(processor), processor=processor, max_new_tokens=6, samples_per_prompt=2,
                                 seed=4)
    with torch.no_grad(), batch_invariant():
        assert torch.equal(batch_logprobs(model, rollout.batch).cpu(), rollout.flat_log_probs.cpu())
        assert torch.equal(decode_hidden(model, rollout.batch), forward_hidden(model, rollout.batch, padding="right"))
