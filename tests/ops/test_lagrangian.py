"""rlk_mm.ops.lagrangian: reward and cost normalized separately, combined (A_r - lam A_c)/(1 + lam);
signs; a cost never enters a reward column; the dual step moves lam the right way, in place,
with no host read (torch.compile fullgraph, the meta device); bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm.ops import group_advantages
from rlk_mm.ops.lagrangian import Lagrangian, lagrangian_advantages

GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def test_combination_matches_separately_normalized_parts():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.2, 0.9, 0.1])
    costs = torch.tensor([5.0, 1.0, 0.0, 3.0, 0.0, 0.0, 10.0, 2.0])
    lam = Lagrangian(budget=1.0, init=0.5)
    out = lam.advantages(rewards, costs, GROUPS)
    a_r, a_c = group_advantages(rewards, GROUPS), group_advantages(costs, GROUPS)
    assert torch.equal(out.reward_advantages, a_r) and torch.equal(out.cost_advantages, a_c)
    torch.testing.assert_close(out.advantages, (a_r - 0.5 * a_c) / 1.5)


def test_a_cost_never_enters_the_reward_column():
    """The reward advantages do not depend on the costs at all, and the inputs are untouched."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.2, 0.9, 0.1])
    costs_a, costs_b = torch.zeros(8), torch.arange(8.0) * 100
    lam = torch.tensor(2.0)
    a = lagrangian_advantages(rewards, costs_a, GROUPS, lam)
    b = lagrangian_advantages(rewards, costs_b.clone(), GROUPS, lam)
    assert torch.equal(a.reward_advantages, b.reward_advantages)
    assert torch.equal(a.advantages, a.reward_advantages / 3)  # zero costs: only the reward, scaled by 1/(1+lam)
    assert torch.equal(costs_b, torch.arange(8.0) * 100) and rewards.tolist()[0] == 1.0
    with pytest.raises(ValueError, match="rewards and costs share memory"):
        lagrangian_advantages(rewards, rewards, GROUPS, lam)
    scores = torch.arange(16.0)
    with pytest.raises(ValueError, match="share memory"):  # overlapping views
        lagrangian_advantages(scores[:8], scores[4:12], GROUPS, lam)
    with pytest.raises(ValueError, match="share memory"):
        lagrangian_advantages(scores[::2], scores[::2].clone().set_(scores.untyped_storage(), 0, (8,), (2,)), GROUPS,
                              lam)


def test_disjoint_views_of_one_tensor_are_accepted():
    """The reward and cost columns of one [B, 2] scores tensor (or two halves of
    one [2B] tensor) are disjoint: accepted, with the result of separate tensors."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.2, 0.9, 0.1])
    costs = torch.tensor([5.0, 1.0, 0.0, 3.0, 0.0, 0.0, 10.0, 2.0])
    lam = torch.tensor(0.5)
    expected = lagrangian_advantages(rewards, costs, GROUPS, lam)
    both = torch.stack([rewards, costs], 1)
    halves = torch.cat([rewards, costs])
    odd = torch.stack([costs, rewards], 1).reshape(-1)  # interleaved: costs at even, rewards at odd entries
    for r, c in ((both[:, 0], both[:, 1]), (halves[:8], halves[8:]), (odd[1::2], odd[0::2])):
        out = lagrangian_advantages(r, c, GROUPS, lam)
        assert all(torch.equal(a, b) for a, b in zip(out, expected))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=4, max_size=4), st.lists(st.floats(0, 5), min_size=4, max_size=4),
       st.floats(0.01, 20), st.integers(0, 3), st.floats(0.1, 5))
def test_higher_cost_lowers_the_advantage(rewards, costs, lam, k, extra):
    """Raising one sample's cost (others fixed) lowers its advantage; lam = 0 ignores costs."""
    r, c = torch.tensor(rewards, dtype=torch.float64), torch.tensor(costs, dtype=torch.float64)
    g = torch.zeros(4, dtype=torch.long)
    more = c.clone()
    more[k] += extra
    lam_t = torch.tensor(lam, dtype=torch.float64)
    est = "dr_grpo"  # unscaled: the sign is exact (GRPO's std also moves with the cost)
    before = lagrangian_advantages(r, c, g, lam_t, estimator=est).advantages[k]
    after = lagrangian_advantages(r, more, g, lam_t, estimator=est).advantages[k]
    assert after < before
    zero = lagrangian_advantages(r, more, g, torch.tensor(0.0, dtype=torch.float64), estimator=est)
    assert torch.equal(zero.advantages, group_advantages(r, g, estimator=est))


def test_lam_grows_over_budget_and_shrinks_under_it_never_below_zero():
    lam = Lagrangian(budget=1.0, lr=0.5, init=0.2)
    value = lam.value
    trace = [float(lam.step(torch.tensor([2.0, 3.0]))) for _ in range(3)]  # mean 2.5: over by 1.5
    assert trace == pytest.approx([0.95, 1.7, 2.45])
    assert lam.value is value  # updated in place: a captured graph or optimizer keeps seeing it
    trace = [float(lam.step(torch.tensor([0.0, 0.5]))) for _ in range(8)]  # mean 0.25: under by 0.75
    assert trace[0] == pytest.approx(2.075) and all(a > b for a, b in zip(trace, trace[1:6])) and trace[-1] == 0.0
    capped = Lagrangian(budget=0.0, lr=10.0, max_value=3.0)
    assert float(capped.step(torch.tensor([1.0]))) == 3.0
    assert float(lam.step(torch.tensor([1.0]))) == 0.0  # at budget: unchanged


def test_no_host_read_compile_fullgraph_and_meta_device():
    """A host read (.item(), float(), bool on a tensor) would break a fullgraph compile and fail on meta."""
    lam = Lagrangian(budget=1.0, lr=0.5)

    def train_step(costs, rewards, groups):
        lam.step(costs)
        return lam.advantages(rewards, costs, groups).advantages

    compiled = torch.compile(train_step, fullgraph=True, backend="aot_eager")
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.2, 0.9, 0.1])
    costs = torch.tensor([5.0, 1.0, 0.0, 3.0, 0.0, 0.0, 10.0, 2.0])
    out = compiled(costs, rewards, GROUPS)
    assert float(lam.value) == pytest.approx(0.5 * (costs.mean() - 1.0))
    eager = Lagrangian(budget=1.0, lr=0.5)
    eager.step(costs)
    torch.testing.assert_close(out, eager.advantages(rewards, costs, GROUPS).advantages)

    meta = Lagrangian(budget=1.0, lr=0.5, device="meta")
    meta.step(torch.ones(4, device="meta"))
    result = meta.advantages(torch.ones(8, device="meta"), torch.zeros(8, device="meta"), GROUPS.to("meta"))
    assert result.advantages.device.type == "meta" and result.advantages.shape == (8,)


def test_a_negative_multiplier_gives_nan_not_a_flipped_sign():
    """A lam < 0 would make a cost raise the advantage (lam = -1 divides by 0). The op
    never reads the device: such a lam gives NaN advantages (documented), as a NaN lam does."""
    rewards, costs = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1])
    for lam in (-0.5, -1.0, -2.0, math.nan, -math.inf, math.inf):
        out = lagrangian_advantages(rewards, costs, groups, torch.tensor(lam))
        assert out.advantages.isnan().all(), lam
        assert not out.reward_advantages.isnan().any()  # the parts stay as they are
    assert not lagrangian_advantages(rewards, costs, groups, torch.tensor(0.0)).advantages.isnan().any()


@pytest.mark.parametrize("costs", [[math.inf], [-math.inf, 1.0], [math.inf, -math.inf], [1e39]])
def test_an_infinite_mean_cost_makes_lam_nan_not_a_bound(costs):
    """An infinite mean episode cost gave lam at its clamp bound (0 or max_value)
    silently; like a NaN cost, it now makes lam NaN."""
    for max_value in (None, 5.0):
        lam = Lagrangian(budget=0.5, lr=0.1, init=0.5, max_value=max_value)
        lam.step(torch.tensor(costs))
        assert math.isnan(float(lam.value)), (costs, max_value)


def test_step_keeps_no_autograd_graph():
    """Costs with autograd history (e.g. from a cost model) leave lam a plain value."""
    lam = Lagrangian(budget=0.5, lr=0.1)
    w = torch.ones(3, requires_grad=True)
    lam.step(w * 2)
    assert not lam.value.requires_grad and lam.value.grad_fn is None
    assert float(lam.value) == pytest.approx(0.15)
    out = lam.advantages(torch.ones(2), (w[:2] * 2), torch.zeros(2, dtype=torch.long))
    assert out.advantages.shape == (2,)


def test_nan_cost_is_loud_not_silent():
    lam = Lagrangian(budget=1.0)
    lam.step(torch.tensor([math.nan]))
    assert math.isnan(float(lam.value))
    assert torch.isnan(lam.advantages(torch.ones(2), torch.zeros(2), torch.zeros(2, dtype=torch.long)).advantages).all()


@pytest.mark.parametrize("call,error,match", [
    (lambda: Lagrangian(budget=math.inf), ValueError, "budget=inf must be a finite number"),
    (lambda: Lagrangian(budget=1.0, lr=0.0), ValueError, "lr=0.0 is out of range"),
    (lambda: Lagrangian(budget=1.0, init=-1.0), ValueError, "init=-1.0 is out of range"),
    (lambda: Lagrangian(budget=1.0, init=2.0, max_value=1.0), ValueError, "max_value=1.0 is out of range"),
    (lambda: Lagrangian(budget=1.0).step(torch.zeros(0)), ValueError, "episode_costs is empty"),
    (lambda: Lagrangian(budget=1.0).step(torch.zeros(2, 2)), ValueError, "episode_costs must be 1-D"),
    (lambda: Lagrangian(budget=1.0).step(torch.zeros(2, dtype=torch.long)), TypeError, "episode_costs must be float"),
    (lambda: Lagrangian(budget=1.0).step([1.0]), TypeError, "episode_costs must be a torch.Tensor"),
    (lambda: Lagrangian(budget=1.0, device="meta").step(torch.zeros(2)), ValueError,
     "episode_costs is on cpu; expected meta"),
    (lambda: Lagrangian(budget=1.0, device="gpu"), ValueError, r"device='gpu' is not a torch device"),
    (lambda: Lagrangian(budget=1.0, device=3.5), ValueError, r"device=3\.5 is not a torch device"),
    (lambda: lagrangian_advantages(torch.zeros(3), torch.zeros(4), GROUPS[:3], torch.tensor(1.0)), ValueError,
     r"costs must have shape \[3\]"),
    (lambda: lagrangian_advantages(torch.zeros(3), torch.zeros(3), GROUPS[:3], torch.tensor([1.0])), ValueError,
     r"lam must have shape \[\]"),
    (lambda: lagrangian_advantages(torch.zeros(3), torch.zeros(3), GROUPS[:3], 1.0), TypeError,
     "lam must be a torch.Tensor"),
    (lambda: lagrangian_advantages(torch.zeros(3), torch.zeros(3), GROUPS[:2], torch.tensor(1.0)), ValueError,
     r"group_ids must be an integer tensor of shape \(3,\)"),
])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
