"""The static decode loop on CUDA, its step captured in a CUDA graph and replayed per token:
under the Triton batch-invariant kernels its tokens and log-probs are bitwise the eager loop's
and the training forward's, for Qwen2.5-VL and Qwen3-VL (DeepStack), bf16, rows stopping at
different steps, several row counts (each its own capture), and a rollout long enough to pass
the loop's early-exit reads. Run on the GPU machine: ``pytest -m gpu tests/models/test_static_decode_gpu.py``."""

import pytest
import torch

from rlk_mm import fixtures
from rlk_mm.models import batch_logprobs, generate_on_policy
from rlk_mm.models.static_decode import CHECK_EVERY, WARMUP_STEPS
from rlk_mm.ops import batch_invariant

pytestmark = pytest.mark.gpu

FAMILIES = {
    "qwen2_5_vl": (fixtures.qwen_vl_processor, fixtures.tiny_qwen2_5_vl),
    "qwen3_vl": (fixtures.qwen3_vl_processor, fixtures.tiny_qwen3_vl),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    make_processor, make_model = FAMILIES[request.param]
    processor = make_processor()
    model = make_model(0).eval().to("cuda", torch.bfloat16)
    return processor, model


def _rollout(family, prompts, loop, **kw):
    processor, model = family
    kw = {"max_new_tokens": 2 * CHECK_EVERY + WARMUP_STEPS + 3, "seed": 5, "backend": "triton", **kw}
    return generate_on_policy(model, prompts, processor=processor, loop=loop, **kw)


def _same(a, b) -> bool:
    return (a.rows == b.rows and a.rejected == b.rejected and a.steps == b.steps and a.stopped == b.stopped
            and all(torch.equal(x, y) for x, y in zip(a.responses, b.responses))
            and all(torch.equal(x, y) for x, y in zip(a.log_probs, b.log_probs)))


@pytest.mark.parametrize("prompts,answers", [(1, 1), (3, 2), (2, 5)])
def test_graph_replay_equals_the_eager_loop_and_the_training_forward(family, prompts, answers):
    processor, model = family
    inputs = fixtures.processor_inputs(processor, fixtures.synthetic_image_text(prompts, seed=prompts, max_images=2))
    first = _rollout(family, inputs, "eager", samples_per_prompt=answers)
    stop = sorted({int(r[min(i * 7 + 4, len(r) - 1)]) for i, r in enumerate(first.responses)})[:2]
    eager, static = (_rollout(family, inputs, loop, samples_per_prompt=answers, stop_token_ids=stop)
                     for loop in ("eager", "static"))
    assert static.settings["loop"] == "static"
    assert _same(eager, static)
    if static.batch is not None:
        with torch.no_grad(), batch_invariant(backend="triton"):
            assert torch.equal(batch_logprobs(model, static.batch).cpu(), static.flat_log_probs)


def test_auto_is_the_static_loop_on_cuda(family):
    processor, _ = family
    inputs = fixtures.processor_inputs(processor, fixtures.synthetic_image_text(1, seed=0, max_images=1))
    assert _rollout(family, inputs, "auto", max_new_tokens=4).settings["loop"] == "static"


def test_the_default_kernels_run_through_the_graphs(family):
    processor, _ = family
    inputs = fixtures.processor_inputs(processor, fixtures.synthetic_image_text(2, seed=2, max_images=1))
    rollout = _rollout(family, inputs, "static", kernels="default", backend=None, samples_per_prompt=2,
                       stop_token_ids=[])
    assert all(len(r) == rollout.settings["max_new_tokens"] for r in rollout.responses)
    assert all(torch.isfinite(lp).all() for lp in rollout.log_probs)
