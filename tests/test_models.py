"""The Qwen2.5-VL runners' arguments (rlk_mm.models.qwen2_5_vl): the one temperature rule of
every op and runner (schema.checks.temperature_arg)."""

import math

import pytest
import torch

from rlk_mm import RLBatch
from rlk_mm.fixtures import processor_inputs, synthetic_image_text
from rlk_mm.models.qwen2_5_vl import batch_logprobs, group_logprobs
from rlk_mm.schema.checks import MIN_TEMPERATURE

IM_END = 151645


@pytest.fixture(scope="module")
def batch(processor):
    samples = synthetic_image_text(2, seed=3, max_images=1, sizes=[(56, 56), (84, 56)])
    responses = [processor.tokenizer.encode(t) + [IM_END] for t in ("red", "a blue one")]
    return RLBatch.from_qwen_vl(processor_inputs(processor, samples), processor=processor, responses=responses, group_ids=["a", "b"])


@pytest.mark.parametrize("runner", [batch_logprobs, group_logprobs], ids=["batch_logprobs", "group_logprobs"])
@pytest.mark.parametrize("temperature", [0, 1e-9, MIN_TEMPERATURE / 2, -1.0, math.nan, math.inf])
def test_runners_refuse_a_temperature_the_ops_refuse(tiny_model, batch, runner, temperature):
    """1e-9 used to pass the runners' "> 0" and fail later, inside selected_logprob."""
    with pytest.raises(ValueError, match=rf"temperature must be a finite number >= {MIN_TEMPERATURE}"):
        runner(tiny_model, batch, temperature=temperature)


@pytest.mark.parametrize("temperature", ["1", True, None])
def test_runners_refuse_a_temperature_that_is_no_number(tiny_model, batch, temperature):
    with pytest.raises(TypeError, match="temperature must be a number"):
        batch_logprobs(tiny_model, batch, temperature=temperature)


def test_the_smallest_temperature_runs(tiny_model, batch):
    with torch.no_grad():
        logp = batch_logprobs(tiny_model, batch, temperature=MIN_TEMPERATURE)
    assert logp.shape == (int(batch.loss_spans.token_counts().sum()),) and bool((logp <= 0).all())
