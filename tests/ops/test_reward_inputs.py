"""Bad and unusual inputs to group_advantages, scatter_rewards and overlong_penalty, and a property: a non-finite
score stays in its group."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm.ops import (
    SpanReward,
    group_advantages,
    overlong_penalty,
    scatter_rewards,
)
from rlk_mm.schema import SchemaError
from rlk_mm.schema.spans import Span, SpanTable
from support.op_cases import (
    GROUPS,
    INF,
    NAN,
    SCORES,
    Case,
    assert_well,
    bad,
    ok,
    table,
    with_value,
)


def _adv(**kw):
    args = dict(scores=SCORES, group_ids=GROUPS)
    args.update(kw)
    return lambda: group_advantages(**args)


def _group_advantages_cases() -> list[Case]:
    return [
        bad("scores list", _adv(scores=SCORES.tolist()), TypeError, r"scores must be a torch.Tensor"),
        bad("scores int", _adv(scores=SCORES.long()), TypeError, r"scores must be float"),
        bad("scores 0-d", _adv(scores=SCORES[0]), ValueError, r"scores must be \[B\] or \[B, K\]"),
        bad("scores 3-D", _adv(scores=SCORES[:, None, None]), ValueError, r"scores must be \[B\] or \[B, K\]"),
        bad("group_ids list", _adv(group_ids=GROUPS.tolist()), TypeError, r"group_ids must be a torch.Tensor"),
        bad("group_ids float", _adv(group_ids=GROUPS.float()), ValueError, r"group_ids must be an integer tensor"),
        bad("group_ids bool", _adv(group_ids=GROUPS > 0), ValueError, r"group_ids must be an integer tensor"),
        bad("group_ids length", _adv(group_ids=GROUPS[:5]), ValueError,
            r"group_ids must be an integer tensor of shape \(6,\)"),
        bad("group_ids on meta", _adv(group_ids=GROUPS.to("meta")), ValueError, r"group_ids is on meta"),
        bad("estimator", _adv(estimator="ppo"), ValueError, r"estimator='ppo'"),
        bad("eps 0", _adv(eps=0.0), ValueError, r"eps=0\.0 is out of range: it must be >= 1\.17"),
        bad("eps 0 in float32", _adv(eps=1e-60), ValueError, r"eps=1e-60 is out of range"),
        bad("eps negative", _adv(eps=-1e-6), ValueError, r"eps=-1e-06 is out of range"),
        bad("eps nan", _adv(eps=NAN), ValueError, r"eps=nan must be a finite number"),
        bad("eps str", _adv(eps="1e-6"), TypeError, r"eps must be a number"),
        ok("no samples", _adv(scores=SCORES[:0], group_ids=GROUPS[:0]), lambda r: r.shape == (0,)),
        ok("no columns", _adv(scores=SCORES[:, None][:, :0]), lambda r: r.shape == (6, 0)),
        # documented: a non-finite score makes its own group NaN, no other
        ok("nan score propagates to its group", _adv(scores=with_value(SCORES, 2, NAN)),
           lambda r: bool(r[2:4].isnan().all()) and bool(r[[0, 1, 4, 5]].isfinite().all())),
        # squares of deviations beyond ~1e19 overflow float32 (1e154 float64): the advantages stay the scale-free ones
        ok("scores beyond the squares' range", _adv(scores=SCORES * 1e30),
           lambda r: torch.allclose(r, group_advantages(SCORES, GROUPS), rtol=1e-5)),
        ok("float64 scores beyond the squares' range", _adv(scores=SCORES.double() * 1e300),
           lambda r: torch.allclose(r, group_advantages(SCORES.double(), GROUPS), rtol=1e-5)),
        ok("an infinite score still makes its group NaN", _adv(scores=with_value(SCORES * 1e30, 0, INF)),
           lambda r: bool(r[:2].isnan().all()) and torch.allclose(r[2:], group_advantages(SCORES, GROUPS)[2:])),
    ]


LOSS = SpanTable.from_lists([[Span(2, 5)], [], [Span(1, 4)]])  # 3 + 0 + 3 loss tokens
REWARDS = torch.tensor([1.0, 0.0, 3.0])
REGIONS = SpanTable.from_lists([[Span(0, 4)], [], []])


def _sr(**kw):
    args = dict(batch=LOSS, rewards=REWARDS)
    args.update(kw)
    return lambda: scatter_rewards(**args)


def _reward_cases() -> list[Case]:
    regions = SpanReward(REGIONS, torch.tensor([1.0]), name="regions")
    return [
        bad("batch list", _sr(batch=[[Span(2, 5)]]), TypeError,
            r"batch must be an RLBatch or its loss_spans SpanTable, got list"),
        bad("rewards list", _sr(rewards=[1.0, 0.0, 3.0]), TypeError, r"rewards must be a torch.Tensor"),
        bad("rewards shape", _sr(rewards=REWARDS[:2]), SchemaError, r"rewards has shape \(2,\)"),
        bad("rewards int", _sr(rewards=REWARDS.long()), SchemaError, r"rewards must be floating point"),
        bad("rewards nan", _sr(rewards=with_value(REWARDS, 0, NAN)), SchemaError, r"rewards: sample 0 .* finite"),
        bad("reward on a sample without loss tokens", _sr(rewards=with_value(REWARDS, 1, 2.0)), SchemaError,
            r"rewards: sample 1 .* covers no loss token"),
        bad("mode", _sr(mode="first"), ValueError, r"mode='first'"),
        bad("spans a single SpanReward", _sr(spans=regions), TypeError, r"spans must be a list or tuple of SpanReward"),
        bad("spans of tuples", _sr(spans=[(REGIONS, torch.tensor([1.0]))]), TypeError,
            r"spans\[0\] must be a SpanReward, got tuple"),
        bad("span table samples",
            _sr(spans=[SpanReward(SpanTable.from_lists([[Span(0, 4)]]), torch.tensor([1.0]), name="regions")]),
            SchemaError, r"regions: its span table covers 1 samples"),
        bad("overlapping spans", _sr(spans=[SpanReward(SpanTable.from_lists([[Span(0, 4), Span(3, 6)], [], []]),
                                                       torch.tensor([1.0, 1.0]), name="regions")]),
            SchemaError, r"regions: sample 0, span \[3, 6\) overlaps"),
        bad("length_penalty scalar", _sr(length_penalty=20), TypeError,
            r"length_penalty must be a pair \(max_length, buffer\)"),
        bad("length_penalty buffer 0", _sr(length_penalty=(20, 0)), ValueError, r"buffer"),
        bad("length_penalty float", _sr(length_penalty=(20.5, 4)), TypeError, r"max_length must be an int"),
        bad("num_tokens wrong", _sr(num_tokens=5), ValueError, r"num_tokens=5 but the loss spans hold 6 tokens"),
        bad("num_tokens negative", _sr(num_tokens=-1), ValueError, r"num_tokens=-1 is out of range"),
        bad("num_tokens float", _sr(num_tokens=6.0), TypeError, r"num_tokens must be an int"),
        bad("check str", _sr(check="yes"), TypeError, r"check must be True or False"),
        ok("region rewards", _sr(spans=[regions]), lambda r: r.shape == (6,) and r[:2].sum() == 1.0),
        ok("no samples", lambda: scatter_rewards(SpanTable.from_lists([]), torch.zeros(0)), lambda r: r.shape == (0,)),
        bad("SpanReward spans list", lambda: SpanReward([[Span(0, 4)]], torch.tensor([1.0])), TypeError,
            r"SpanReward spans must be a SpanTable, got list"),
        bad("SpanReward values list", lambda: SpanReward(REGIONS, [1.0]), TypeError,
            r"span rewards: values must be a torch.Tensor"),
        bad("SpanReward values shape", lambda: SpanReward(REGIONS, torch.tensor([1.0, 2.0]), name="regions"),
            ValueError,
            r"regions: values has shape \(2,\); expected \(1,\)"),
        bad("SpanReward values int", lambda: SpanReward(REGIONS, torch.tensor([1]), name="regions"), SchemaError,
            r"regions: values must be floating point"),
        bad("SpanReward mode", lambda: SpanReward(REGIONS, torch.tensor([1.0]), mode="first", name="regions"),
            ValueError,
            r"regions: mode='first'"),
        bad("SpanReward name", lambda: SpanReward(REGIONS, torch.tensor([1.0]), name=3), TypeError,
            r"SpanReward name must be a str"),
        bad("overlong lengths list", lambda: overlong_penalty([3, 4], 20, 8), TypeError,
            r"lengths must be a torch.Tensor"),
        bad("overlong lengths float", lambda: overlong_penalty(torch.tensor([3.0]), 20, 8), TypeError,
            r"lengths must be int64"),
        bad("overlong lengths negative", lambda: overlong_penalty(torch.tensor([3, -3]), 20, 8), ValueError,
            r"lengths\[1\] = -3 is negative"),
        bad("overlong max_length float", lambda: overlong_penalty(torch.tensor([3]), 20.0, 8), TypeError,
            r"max_length must be an int"),
        bad("overlong max_length bool", lambda: overlong_penalty(torch.tensor([3]), True, 1), TypeError,
            r"max_length must be an int"),
        bad("overlong buffer 0", lambda: overlong_penalty(torch.tensor([3]), 20, 0), ValueError, r"buffer=0"),
        bad("overlong buffer above max_length", lambda: overlong_penalty(torch.tensor([3]), 20, 21), ValueError,
            r"buffer=21"),
        ok("overlong", lambda: overlong_penalty(torch.tensor([0, 16, 25]), 20, 8),
           lambda r: r.tolist() == [0.0, -0.5, -1.0]),
        bad("overlong lengths bool", lambda: overlong_penalty(torch.tensor([True]), 20, 8), TypeError,
            r"lengths must be int64"),
        bad("overlong max_length 0", lambda: overlong_penalty(torch.tensor([3]), 0, 1), ValueError,
            r"max_length=0 is out of range: it must be >= 1"),
        bad("overlong max_length beyond int64 math", lambda: overlong_penalty(torch.tensor([3]), 2**70, 8), ValueError,
            r"max_length=1180591620717411303424 is out of range"),
        ok("overlong no lengths", lambda: overlong_penalty(torch.zeros(0, dtype=torch.long), 20, 8),
           lambda r: r.shape == (0,)),
        ok("overlong counts above 2^24 are not rounded", lambda: overlong_penalty(torch.tensor([2**24 + 3]), 2**24 + 4, 2),
           lambda r: r.tolist() == [-0.5]),
        bad("overlong lengths on meta", lambda: overlong_penalty(torch.tensor([3], device="meta"), 20, 8), ValueError,
            r"lengths is on the meta device"),
        bad("rewards on meta", _sr(rewards=REWARDS.to("meta")), ValueError, r"rewards is on the meta device"),
        bad("num_tokens wrong, trusted (check=False)", _sr(num_tokens=5, check=False), ValueError,
            r"num_tokens=5 is not the loss spans' token count \(check=False trusts it\)"),
    ]


CASES = {"group_advantages": _group_advantages_cases, "rewards": _reward_cases}


@pytest.mark.parametrize("case", table(CASES))
def test_inputs(case):
    assert_well(case)


@settings(max_examples=40, deadline=None)
@given(groups=st.lists(st.integers(0, 4), min_size=1, max_size=20), data=st.data(),
       estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]), value=st.sampled_from([NAN, INF, -INF]))
def test_a_non_finite_score_stays_in_its_group(groups, data, estimator, value):
    """Documented: a non-finite score propagates to its own group's advantages, no further."""
    ids = torch.tensor(groups)
    scores = torch.randn(len(groups), generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    i = data.draw(st.integers(0, len(groups) - 1))
    out = group_advantages(with_value(scores, i, value), ids, estimator=estimator)
    others = ids != ids[i]
    assert torch.equal(out[others], group_advantages(scores[others], ids[others], estimator=estimator))



@settings(max_examples=60, deadline=None)
@given(max_length=st.integers(1, 2**40), data=st.data())
def test_the_overlong_penalty_is_its_formula_at_any_length(max_length, data):
    """The penalty is ``clamp((max_length - buffer - length) / buffer, -1, 0)`` to float32's
    precision at every length, counts above 2^24 included (they are not rounded first)."""
    buffer = data.draw(st.integers(1, max_length))
    lengths = data.draw(st.lists(st.integers(0, 2**41), min_size=1, max_size=8))
    got = overlong_penalty(torch.tensor(lengths), max_length, buffer)
    for length, value in zip(lengths, got.tolist()):
        exact = min(0.0, max(-1.0, ((max_length - buffer) - length) / buffer))
        assert abs(value - exact) <= 2**-22 * abs(exact) + 2**-126, (length, value, exact)
