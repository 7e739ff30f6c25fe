"""EasyR1 adapter against references written from EasyR1's documented semantics."""

import inspect
import math

import numpy as np
import pytest
import torch

from rlk_mm.integrations import easyr1
from oracles import loss as ref
from oracles import rewards as ref_rewards
from rlk_mm.parity.contract import ELEMENTWISE_LOSS_MAX_ABS

TOL = ELEMENTWISE_LOSS_MAX_ABS.fp32


def close(a, b):
    torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


def batch(seed, B=6, R=17):
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(B, R, generator=g) * 0.5 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, R, generator=g) * 0.3
    old[0, :2] = logp[0, :2].detach() + torch.tensor([22.0, -1.2])  # ±20 clamp; dual clip
    adv = torch.randn(B, R, generator=g)
    mask = (torch.arange(R)[None] < torch.randint(1, R + 1, (B,), generator=g)[:, None]).long()
    mask[2] = 0
    return logp, old, adv, mask


def test_defaults_are_easyr1s():
    params = inspect.signature(easyr1.compute_policy_loss).parameters
    assert params["clip_ratio_low"].default == 0.2
    assert params["clip_ratio_high"].default == 0.3
    assert params["clip_ratio_dual"].default == 3.0
    assert list(params)[:11] == [
        "old_log_probs", "log_probs", "advantages", "response_mask", "clip_ratio_low", "clip_ratio_high",
        "clip_ratio_dual", "tau_positive", "tau_negative", "loss_type", "loss_avg_mode",
    ]


@pytest.mark.parametrize("loss_type", ["default", "gspo", "gspo_token"])
@pytest.mark.parametrize("avg_mode", ["token", "seq"])
def test_policy_loss_matches_easyr1_semantics(backend, loss_type, avg_mode):
    logp, old, adv, mask = batch(1)
    if loss_type != "default":
        old = logp.detach() + torch.randn(mask.shape, generator=torch.Generator().manual_seed(5)) * 0.05
    expected, m_expected = ref.easyr1_policy_loss(old, logp, adv, mask, 0.2, 0.3, 3.0, loss_type, avg_mode)
    (g_expected,) = torch.autograd.grad(expected, logp)
    actual, m_actual = easyr1.compute_policy_loss(
        old, logp, adv, mask, 0.2, 0.3, 3.0, 1.0, 1.05, loss_type=loss_type, loss_avg_mode=avg_mode,
    )
    (g_actual,) = torch.autograd.grad(actual, logp)
    close(actual, expected)
    close(g_actual, g_expected)
    assert m_actual.keys() == m_expected.keys()
    for k in m_expected:
        assert m_actual[k] == pytest.approx(m_expected[k], abs=TOL), k


def test_gspo_gradient_flows_through_the_sequence_mean():
    """EasyR1's gspo differentiates the sequence mean: with token-varying advantages its
    gradient differs from gspo_token's, and matches the reference's autograd."""
    logp, old, adv, mask = batch(2)
    old = logp.detach() + 0.01
    grads = {}
    for loss_type in ("gspo", "gspo_token"):
        loss, _ = easyr1.compute_policy_loss(old, logp, adv, mask, loss_type=loss_type)
        (grads[loss_type],) = torch.autograd.grad(loss, logp)
    assert not torch.allclose(grads["gspo"], grads["gspo_token"])
    # with one advantage per sequence the two gradients agree (GSPO paper, eq. 11 vs 13)
    seq_adv = adv[:, :1].expand_as(adv)
    same = [torch.autograd.grad(easyr1.compute_policy_loss(old, logp, seq_adv, mask, loss_type=t)[0], logp)[0] for t in ("gspo", "gspo_token")]
    close(same[0], same[1])


@pytest.mark.parametrize("mode", ["token", "seq"])
def test_average_loss(mode):
    logp, _, _, mask = batch(3)
    close(easyr1.average_loss(logp, mask, mode), ref.agg(logp, mask, mode))
    with pytest.raises(ValueError, match="'mean'"):
        easyr1.average_loss(logp, mask, "mean")


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl"])
def test_compute_kl(kind):
    logp, old, _, _ = batch(4)
    actual = easyr1.compute_kl(logp.bfloat16(), old, kind)
    assert actual.dtype == torch.float32
    close(actual, ref.kl(logp.bfloat16().float(), old, kind))
    with pytest.raises(ValueError, match="'full'"):
        easyr1.compute_kl(logp, old, "full")


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_outcome_advantages(name):
    B, R = 12, 6
    g = torch.Generator().manual_seed(6)
    mask = torch.ones(B, R)
    mask[4, 3:] = 0
    rewards = torch.randn(B, R, generator=g) * mask
    index = np.array([f"q{i % 3}" for i in range(B)], dtype=object)
    fn = getattr(easyr1, f"compute_{name}_outcome_advantage")
    adv, returns = fn(token_level_rewards=rewards, response_mask=mask, index=index)
    scores = rewards.sum(-1).double().tolist()
    expected = ref_rewards.group_advantages(scores, [hash(u) for u in index], name)
    close(adv, torch.tensor(expected, dtype=torch.float32)[:, None] * mask)
    assert returns is adv
    with pytest.raises(ValueError, match=r"group 'solo' \(sample 3\) has a single response"):
        fn(token_level_rewards=rewards, response_mask=mask, index=np.array([*index[:3], "solo", *index[4:]], dtype=object))


def test_unsupported_loss_types_are_refused():
    logp, old, adv, mask = batch(7)
    with pytest.raises(ValueError, match="cispo and sapo"):
        easyr1.compute_policy_loss(old, logp, adv, mask, loss_type="sapo")
    assert math.isfinite(easyr1.compute_policy_loss(old, logp, adv, mask)[0].item())


def test_patch_refuses_verl_itself(requires_verl):
    """The installed package named 'verl' here is verl 0.9.1, not EasyR1: patch() says so."""
    with pytest.raises(ImportError, match="not EasyR1"):
        easyr1.patch()
