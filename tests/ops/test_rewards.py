"""Reward scatter and group advantages against the plain-Python references (hypothesis)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oracles import rewards as ref
from rlk_mm.ops.rewards import SpanReward, group_advantages, overlong_penalty, scatter_rewards
from rlk_mm.schema import RLBatch
from rlk_mm.schema.spans import SchemaError, Span, SpanTable

TOL = 1e-5  # float32 ops vs float64 references on scores of order 1-10


# ----------------------------------------------------------------------------- advantages
group_lists = st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=6).flatmap(
    lambda ids: st.lists(st.sampled_from(ids), min_size=1, max_size=40)
)


@settings(max_examples=60, deadline=None)
@given(groups=group_lists, seed=st.integers(0, 2**16), estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]))
def test_group_advantages_match_reference(groups, seed, estimator):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(len(groups), generator=g) * 3
    actual = group_advantages(scores, torch.tensor(groups), estimator=estimator)
    expected = ref.group_advantages(scores.double().tolist(), groups, estimator)
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=TOL, atol=TOL)


@settings(max_examples=30, deadline=None)
@given(groups=group_lists, seed=st.integers(0, 2**16))
def test_columns_are_normalized_separately(groups, seed):
    """Rewards and costs as two columns: each normalized on its own, bitwise as alone."""
    g = torch.Generator().manual_seed(seed)
    rewards, costs = torch.rand(len(groups), generator=g), torch.rand(len(groups), generator=g) * 100
    ids = torch.tensor(groups)
    both = group_advantages(torch.stack([rewards, costs], -1), ids)
    assert torch.equal(both[:, 0], group_advantages(rewards, ids))
    assert torch.equal(both[:, 1], group_advantages(costs, ids))


def test_group_order_and_ids_do_not_matter():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, generator=g)
    dense = torch.arange(64) // 4
    perm = torch.randperm(64, generator=g)
    sparse = dense * 7919 - 10**12  # arbitrary, negative, large ids
    a = group_advantages(scores, dense)
    b = group_advantages(scores[perm], sparse[perm])
    torch.testing.assert_close(b, a[perm], rtol=0, atol=2e-7)
    assert torch.equal(group_advantages(scores, dense), a)  # run to run: bitwise


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_equal_scores_give_exact_zero(estimator):
    """verl's float32 group mean of 16 x 0.3 is off by one ulp and yields advantages ~0.03."""
    scores = torch.full((32,), 0.3)
    assert not group_advantages(scores, torch.arange(32) // 16, estimator=estimator).any()


def test_singletons_follow_verl():
    scores = torch.tensor([2.0, -1.0, 0.5, 0.7])
    ids = torch.tensor([5, 3, 3, 9])
    grpo = group_advantages(scores, ids)
    assert grpo[0] == pytest.approx(2.0 / (1 + 1e-6)) and grpo[3] == pytest.approx(0.7 / (1 + 1e-6))
    assert group_advantages(scores, ids, estimator="rloo")[[0, 3]].tolist() == pytest.approx([2.0, 0.7])
    assert group_advantages(scores, ids, estimator="dr_grpo")[[0, 3]].tolist() == pytest.approx([2.0, 0.7])


def test_group_advantages_errors_and_dtypes():
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        group_advantages(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="estimator='ppo'"):
        group_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), estimator="ppo")
    assert group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)
    assert group_advantages(torch.rand(4, dtype=torch.float64), torch.zeros(4, dtype=torch.long)).dtype == torch.float64
    assert group_advantages(torch.rand(4).bfloat16(), torch.zeros(4, dtype=torch.int32)).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- scatter
@st.composite
def disjoint_spans(draw, length, min_start=0, max_spans=3):
    cuts = sorted(draw(st.lists(st.integers(min_start, length), min_size=0, max_size=2 * max_spans, unique=True)))
    return [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2) if cuts[i] < cuts[i + 1]]


@st.composite
def scatter_case(draw):
    B = draw(st.integers(1, 4))
    lengths = [draw(st.integers(2, 30)) for _ in range(B)]
    loss = [draw(disjoint_spans(L, min_start=1)) for L in lengths]
    regions = [draw(disjoint_spans(L)) for L in lengths]
    turns = [draw(disjoint_spans(L)) for L in lengths]
    return lengths, loss, regions, turns


def table(spans):
    return SpanTable.from_lists([[Span(s, e) for s, e in row] for row in spans])


def covered_values(spans, tokens, seed):
    """A value per span, zero where the span holds no loss token (a non-zero one there is an error)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b, row in enumerate(spans):
        out.append([float(torch.randn(1, generator=g)) if any(tb == b and s <= p < e for tb, p in tokens) else 0.0
                    for s, e in row])
    return out


@settings(max_examples=60, deadline=None)
@given(case=scatter_case(), seed=st.integers(0, 2**16), mode=st.sampled_from(["last", "spread"]),
       penalty=st.sampled_from([None, (8, 4), (20, 10)]))
def test_scatter_rewards_match_reference(case, seed, mode, penalty):
    lengths, loss, regions, turns = case
    tokens = ref.loss_tokens(loss)
    B = len(lengths)
    g = torch.Generator().manual_seed(seed)
    rewards = [float(v) if any(tb == b for tb, _ in tokens) else 0.0 for b, v in enumerate(torch.randn(B, generator=g))]
    region_values = covered_values(regions, tokens, seed + 1)
    turn_values = covered_values(turns, tokens, seed + 2)

    actual = scatter_rewards(
        table(loss), torch.tensor(rewards), mode=mode, length_penalty=penalty,
        spans=[
            SpanReward(table(regions), torch.tensor([v for row in region_values for v in row]), "spread"),
            SpanReward(table(turns), torch.tensor([v for row in turn_values for v in row]), "last"),
        ],
    )
    counts = [sum(1 for tb, _ in tokens if tb == b) for b in range(B)]
    seq = [r + (ref.overlong_penalty(c, *penalty) if penalty else 0.0) for r, c in zip(rewards, counts)]
    whole = [[(0, 2**31)] for _ in range(B)]
    expected = [
        a + b + c
        for a, b, c in zip(
            ref.place(tokens, whole, [[v] for v in seq], mode),
            ref.place(tokens, regions, region_values, "spread"),
            ref.place(tokens, turns, turn_values, "last"),
        )
    ]
    assert actual.dtype == torch.float32 and actual.shape == (len(tokens),)
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=TOL, atol=TOL)
    # sequence rewards keep their sum per sample in both modes
    only_seq = scatter_rewards(table(loss), torch.tensor(rewards), mode=mode)
    sample = torch.tensor([tb for tb, _ in tokens], dtype=torch.long)
    sums = torch.zeros(B).index_add_(0, sample, only_seq)
    torch.testing.assert_close(sums, torch.tensor(rewards), rtol=TOL, atol=TOL)


def test_overlong_penalty():
    lengths = torch.tensor([0, 12, 16, 18, 20, 25])
    expected = [ref.overlong_penalty(int(x), 20, 8) for x in lengths]
    assert overlong_penalty(lengths, 20, 8).tolist() == pytest.approx(expected)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 20, 0)


def test_scatter_errors_name_sample_and_span():
    loss = table([[(2, 5)], [], [(1, 4)]])
    with pytest.raises(SchemaError, match=r"rewards: sample 1 .* covers no loss token"):
        scatter_rewards(loss, torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(SchemaError, match=r"rewards: sample 0 .* finite"):
        scatter_rewards(loss, torch.tensor([float("nan"), 0.0, 3.0]))
    with pytest.raises(SchemaError, match=r"rewards has shape \(2,\)"):
        scatter_rewards(loss, torch.tensor([1.0, 2.0]))
    regions = table([[(0, 4), (3, 6)], [], []])
    with pytest.raises(SchemaError, match=r"regions: sample 0, span \[3, 6\) overlaps"):
        scatter_rewards(loss, spans=[SpanReward(regions, torch.tensor([1.0, 1.0]), name="regions")])
    outside = table([[(6, 9)], [], []])
    with pytest.raises(SchemaError, match=r"turns: sample 0, span \[6, 9\) .* covers no loss token"):
        scatter_rewards(loss, spans=[SpanReward(outside, torch.tensor([1.0]), "last", name="turns")])
    # unchecked: no host read beyond the given token count, same result on valid input
    fine = torch.tensor([1.0, 0.0, 3.0])
    assert torch.equal(scatter_rewards(loss, fine, num_tokens=6, check=False), scatter_rewards(loss, fine))


def test_scatter_from_rlbatch():
    """An RLBatch supplies loss spans, rewards, region rewards (spread) and turn rewards (last)."""
    lengths = [10, 8]
    batch = RLBatch(
        input_ids=torch.arange(18),
        cu_seqlens=torch.tensor([0, 10, 18], dtype=torch.int32),
        position_ids=torch.arange(18).expand(3, 18).clone(),
        modality_spans=table([[(0, L)] for L in lengths]),
        loss_spans=table([[(4, 10)], [(3, 8)]]),
        processor_fingerprint="test",
        rewards=torch.tensor([1.0, -1.0]),
        region_spans=table([[(5, 7)], []]),
        region_rewards=torch.tensor([0.5]),
        action_spans=table([[(4, 6), (6, 10)], [(3, 8)]]),
        turn_rewards=torch.tensor([0.2, 0.3, 0.4]),
    )
    out = scatter_rewards(batch)
    expected = torch.tensor([0, 0.2 + 0.25, 0.25, 0, 0, 1 + 0.3, 0, 0, 0, 0, -1 + 0.4])
    torch.testing.assert_close(out, expected)
    assert out.shape == batch.loss_token_sample().shape
