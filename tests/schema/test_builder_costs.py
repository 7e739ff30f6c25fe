"""Costs on every builder: ``from_verl`` takes ``costs`` as ``from_qwen_vl``, ``from_token_lists`` and
``from_messages`` do (one real number per sample, finite, within float32), checked the same way and
kept apart from the rewards, so the reward-cost path can start from verl's batch."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlk_mm import RLBatch
from rlk_mm.schema import SchemaError
from support.context_cases import Case, Raises, Returns, assert_well, fail, make_schema_context

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def ctx(processor, tmp_path_factory):
    return make_schema_context(processor, tmp_path_factory.mktemp("costs"))


def verl(c, **kwargs) -> RLBatch:
    v = {**c.verl, **kwargs}
    return RLBatch.from_verl(v.pop("input_ids"), v.pop("attention_mask"), v.pop("position_ids"), **v)


def lists(c, **kwargs) -> RLBatch:
    prompts, responses = c.verl_lists
    return RLBatch.from_token_lists(prompts, responses, processor=c.processor, **kwargs)


BUILDERS = {"verl": verl, "lists": lists}


def costs_are(want):
    return Returns(lambda b, c: (b.costs is not None and b.costs.dtype == torch.float32 and b.costs.tolist() == want
                                 and b.rewards is None) or fail(b.costs))


CASES = [case for name, build in BUILDERS.items() for case in [
    Case(f"{name}.costs", lambda c, build=build: build(c, costs=[0.5, 2.0]), costs_are([0.5, 2.0])),
    Case(f"{name}.costs.tensor", lambda c, build=build: build(c, costs=torch.tensor([1, -3])), costs_are([1.0, -3.0])),
    Case(f"{name}.costs.numpy", lambda c, build=build: build(c, costs=np.array([0.25, 0.0])), costs_are([0.25, 0.0])),
    Case(f"{name}.costs.ints", lambda c, build=build: build(c, costs=[1, 0]), costs_are([1.0, 0.0])),
    Case(f"{name}.costs.with_rewards", lambda c, build=build: build(c, costs=[1.0, 0.0], rewards=[0.0, 1.0]),
         Returns(lambda b, c: (b.costs.tolist(), b.rewards.tolist()) == ([1.0, 0.0], [0.0, 1.0]) or fail(b))),
    Case(f"{name}.costs.short", lambda c, build=build: build(c, costs=[1.0]),
         Raises(SchemaError, r"costs has 1 entries; expected one per sample \(2\)")),
    Case(f"{name}.costs.nan", lambda c, build=build: build(c, costs=[0.0, math.nan]),
         Raises(SchemaError, r"costs\[1\] is nan \(sample 1\); costs are finite numbers within float32's range")),
    Case(f"{name}.costs.inf", lambda c, build=build: build(c, costs=[-math.inf, 0.0]),
         Raises(SchemaError, r"costs\[0\] is -inf \(sample 0\)")),
    Case(f"{name}.costs.beyond_float32", lambda c, build=build: build(c, costs=[1e39, 0.0]),
         Raises(SchemaError, r"costs\[0\] is 1e\+39 \(sample 0\); .*float32's range \(\|x\| <= 3.403e\+38\)")),
    Case(f"{name}.costs.bool", lambda c, build=build: build(c, costs=[True, 0.0]),
         Raises(TypeError, r"costs\[0\] is bool True; costs are numbers")),
    Case(f"{name}.costs.none", lambda c, build=build: build(c, costs=[None, 0.0]),
         Raises(TypeError, r"costs\[0\] is None; costs are numbers")),
    Case(f"{name}.costs.str", lambda c, build=build: build(c, costs="01"),
         Raises(TypeError, r"costs must be a list of numbers, one per sample, got str")),
    Case(f"{name}.costs.2d", lambda c, build=build: build(c, costs=torch.zeros(2, 1)),
         Raises(SchemaError, r"costs must have shape \[2\] \(one value per sample\), got \(2, 1\)")),
    Case(f"{name}.costs.scalar", lambda c, build=build: build(c, costs=0.5),
         Raises(TypeError, r"costs must be a list of numbers, one per sample, got float")),
]]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_input(case, ctx):
    assert_well(case, ctx)


@settings(max_examples=15, **SETTINGS)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=2, max_size=2),
       st.one_of(st.none(), st.lists(st.floats(-1, 1, width=32), min_size=2, max_size=2)))
def test_verl_costs_are_the_other_builders_costs(ctx, costs, rewards):
    """Any finite float32 costs (and rewards or none): from_verl stores exactly what from_token_lists
    stores for the same samples, costs and rewards apart, and select, concat and save keep them."""
    a, b = verl(ctx, costs=costs, rewards=rewards), lists(ctx, costs=costs, rewards=rewards)
    assert a.costs.tolist() == b.costs.tolist() == torch.tensor(costs, dtype=torch.float32).tolist()
    assert (a.rewards is None) == (rewards is None) and (rewards is None or a.rewards.tolist() == b.rewards.tolist())
    assert torch.equal(a.input_ids, b.input_ids) and a.loss_spans == b.loss_spans
    assert RLBatch.concat([a.select([1]), a.select([0])]).costs.tolist() == a.costs.tolist()[::-1]
