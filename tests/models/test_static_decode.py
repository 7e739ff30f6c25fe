"""The static decode loop (``generate_on_policy(loop="static")``) on the CPU, without graphs:
its tokens and log-probs are bitwise the eager loop's under ``batch_invariant()`` (rows that stop
at different steps, several answers per prompt, Qwen2.5-VL and Qwen3-VL with DeepStack), hence
the training forward's; the default-kernels control runs through it; ``DecodeSegments`` and
``StaticKV`` refuse what would read past the cache; a hypothesis property over lengths,
answers and stops."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlk_mm import fixtures
from rlk_mm.models import DecodeLoop, batch_logprobs, generate_on_policy
from rlk_mm.models.static_decode import StaticKV
from rlk_mm.ops import batch_invariant
from rlk_mm.ops.invariant.attention import DecodeSegments

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def families():
    """(processor, tiny model, image prompts) of the two layouts the loop serves."""
    out = {}
    for name, processor, model in (("qwen2_5_vl", fixtures.qwen_vl_processor(), fixtures.tiny_qwen2_5_vl(0)),
                                   ("qwen3_vl", fixtures.qwen3_vl_processor(), fixtures.tiny_qwen3_vl(0))):
        prompts = fixtures.processor_inputs(processor, fixtures.synthetic_image_text(3, seed=1, max_images=2))
        out[name] = (processor, model.eval(), prompts)
    return out


def _rollout(family, loop, **kw):
    processor, model, prompts = family
    kw = {"max_new_tokens": 6, "samples_per_prompt": 2, "seed": 3, "backend": "torch", **kw}
    return generate_on_policy(model, prompts, processor=processor, loop=loop, **kw)


def _same(a, b) -> bool:
    return (a.rows == b.rows and a.rejected == b.rejected and a.steps == b.steps and a.stopped == b.stopped
            and all(torch.equal(x, y) for x, y in zip(a.responses, b.responses))
            and all(torch.equal(x, y) for x, y in zip(a.log_probs, b.log_probs))
            and all(torch.equal(x, y) for x, y in zip(a.sampled_log_probs, b.sampled_log_probs)))


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_static_equals_eager_and_the_training_forward(families, name):
    family = families[name]
    first = _rollout(family, "eager")
    stop = [int(first.responses[0][1]), int(first.responses[3][4])]  # rows stop at different steps
    eager, static = (_rollout(family, loop, stop_token_ids=stop) for loop in ("eager", "static"))
    assert len({len(r) for r in static.responses}) > 1 and any(static.stopped)
    assert _same(eager, static)
    assert static.settings["loop"] == "static" and eager.settings["loop"] == "eager"
    with torch.no_grad(), batch_invariant(backend="torch"):
        assert torch.equal(batch_logprobs(family[1], static.batch), static.flat_log_probs)


def test_auto_is_eager_on_the_cpu(families):
    assert _rollout(families["qwen2_5_vl"], "auto", max_new_tokens=2).settings["loop"] == "eager"


def test_the_default_kernels_run_through_the_static_loop(families):
    rollout = _rollout(families["qwen2_5_vl"], "static", kernels="default", backend=None)
    assert rollout.batch is not None and all(len(r) == 6 for r in rollout.responses)
    assert all(torch.isfinite(lp).all() for lp in rollout.log_probs)


def test_a_bad_loop_is_refused_by_name(families):
    with pytest.raises(ValueError, match="loop"):
        _rollout(families["qwen2_5_vl"], "graphs")
    assert [str(c) for c in DecodeLoop] == ["auto", "static", "eager"]


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(new=st.integers(1, 5), answers=st.integers(1, 3), stop_at=st.integers(0, 4))
def test_static_equals_eager_property(families, new, answers, stop_at):
    family = families["qwen2_5_vl"]
    first = _rollout(family, "eager", max_new_tokens=new, samples_per_prompt=answers)
    stop = [int(first.responses[-1][min(stop_at, len(first.responses[-1]) - 1)])]
    kw = dict(max_new_tokens=new, samples_per_prompt=answers, stop_token_ids=stop)
    assert _same(_rollout(family, "eager", **kw), _rollout(family, "static", **kw))


# ------------------------------------------------------------------ the parts' bad inputs
def _ints(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("first_key,keys,steps,capacity,error,match", [
    (_ints(0, 2), _ints(3, 1), 5, 7, ValueError, "reach column 8, past the cache's 7 columns"),
    (_ints(0, 2), _ints(3), 1, 9, ValueError, "keys has 1 entries but first_key has 2"),
    (_ints(0, 2).long(), _ints(3, 1), 1, 9, TypeError, "first_key"),
    (_ints(0, 2), _ints(3, 1).float(), 1, 9, TypeError, "keys"),
])
def test_decode_segments_refuse_ranges_past_the_cache(first_key, keys, steps, capacity, error, match):
    with pytest.raises(error, match=match):
        DecodeSegments(first_key, keys, steps=steps, capacity=capacity)


def test_decode_segments_are_the_rows_of_one_query_each():
    rows, q0, ql, k0, kl = DecodeSegments(_ints(0, 2), _ints(3, 1), steps=4, capacity=7)
    assert rows.tolist() == [0, 1] and q0.tolist() == [0, 0] and ql.tolist() == [1, 1]
    assert k0.tolist() == [0, 2] and kl.tolist() == [3, 1]


def test_static_kv_writes_its_column_and_refuses_a_short_capacity():
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 4), 0)
    with pytest.raises(ValueError, match="3 columns, more than the cache's capacity of 2"):
        StaticKV.from_prefill(cache, 2)
    kv = StaticKV.from_prefill(cache, 5)
    kv.column.fill_(3)
    keys, values = kv.update(torch.full((2, 1, 1, 4), 7.0), torch.full((2, 1, 1, 4), 8.0), 0)
    assert keys.shape == (2, 1, 5, 4) and keys[:, :, 3].eq(7).all() and values[:, :, 3].eq(8).all()
    assert keys[:, :, :3].eq(1).all() and keys[:, :, 4].eq(0).all()
