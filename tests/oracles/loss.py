"""Plain-torch references of the policy losses, written from the documented formulas of
verl 0.9.1 and EasyR1, on padded ``[B, R]`` tensors with a 0/1 mask, autograd for gradients.

They are the oracle of the tests for what has no installed peer (EasyR1, GSPO variants,
the entropy/KL terms combined, compact layouts after padding).
"""

from __future__ import annotations

import math

import torch


def masked_mean(x, mask, dim=None):
    return (x * mask).sum(dim) / (mask.sum(dim) + 1e-8) if dim is not None else (x * mask).sum() / (mask.sum() + 1e-8)


def agg(loss, mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    """verl's five modes and EasyR1's ``token`` / ``seq``, one formula each."""
    mask = mask.float()
    if mode == "token-mean":
        n = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return (loss * mask).sum() / n * dp_size
    if mode == "token-sum":
        return (loss * mask).sum() * dp_size
    if mode == "token":
        return masked_mean(loss, mask)
    if mode == "seq":
        return ((loss * mask).sum(-1) / (mask.sum(-1) + 1e-8)).mean()
    tokens = mask.sum(-1)
    present = (tokens > 0).float()
    g = present.sum() if global_batch_size is None else global_batch_size
    if mode == "seq-mean-token-mean":
        per_seq = (loss * mask).sum(-1) / (tokens + 1e-8)
        return (per_seq * present).sum() / g * dp_size
    per_seq = (loss * mask).sum(-1)
    out = (per_seq * present).sum() / g * dp_size
    if mode == "seq-mean-token-sum-norm":
        out = out / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return out


def kl(logp, ref, kind):
    """KL estimators; a trailing '+' keeps the value with k2's gradient."""
    base = kind.rstrip("+")
    d = logp - ref
    if base in ("kl", "k1"):
        v = d
    elif base == "abs":
        v = d.abs()
    elif base in ("mse", "k2"):
        v = 0.5 * d**2
    else:
        k = (ref - logp).clamp(-20, 20)
        v = (k.exp() - k - 1).clamp(-10, 10)
    if kind.endswith("+") and base not in ("mse", "k2"):
        k2 = 0.5 * d**2
        return k2 - k2.detach() + v.detach()
    return v


def ppo_loss(logp, old, adv, mask, *, clip_low=0.2, clip_high=0.2, clip_c=3.0, rollout_is_weights=None,
             mode="token-mean", ratio="token", log_ratio_clamp=(-20.0, 20.0), **agg_kw):
    """verl's vanilla PPO loss (``ratio="token"``), its GSPO (``"gspo_token"``, sg trick), and
    EasyR1's GSPO (``"gspo"``, gradient through the sequence mean). Returns (loss, metrics)."""
    maskf = mask.float()
    lo = -math.inf if log_ratio_clamp[0] is None else log_ratio_clamp[0]
    hi = math.inf if log_ratio_clamp[1] is None else log_ratio_clamp[1]
    nkl = logp - old
    if ratio == "token":
        lr = nkl.clamp(lo, hi)
        ppo_kl_src = lr
    else:
        seq = (nkl * maskf).sum(-1) / maskf.sum(-1).clamp(min=1)
        if ratio == "gspo_token":
            lr = logp - logp.detach() + seq.detach()[:, None]
        else:
            lr = seq[:, None].expand_as(logp)
        lr = lr.clamp(lo, hi)
        ppo_kl_src = nkl
    r = lr.exp()
    l1 = -adv * r
    l2 = -adv * r.clamp(1 - clip_low, 1 + clip_high)
    c1 = torch.maximum(l1, l2)
    if clip_c is None:
        loss_mat = c1
        lower = torch.zeros_like(c1)
    else:
        l3 = -adv * clip_c
        loss_mat = torch.where(adv < 0, torch.minimum(c1, l3), c1)
        lower = ((c1 > l3) & (adv < 0)).float()
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights
    loss = agg(loss_mat, maskf, mode, **agg_kw)
    metrics = {
        "pg_clipfrac": masked_mean((l2 > l1).float(), maskf),
        "pg_clipfrac_lower": masked_mean(lower, maskf),
        "ppo_kl": masked_mean(-ppo_kl_src, maskf),
    }
    return loss, metrics


def easyr1_policy_loss(old, logp, adv, mask, clip_low, clip_high, clip_dual, loss_type, avg_mode):
    """EasyR1's compute_policy_loss (default / gspo / gspo_token), from its documented
    semantics: log-space clipping, ±20 clamp before exp. Returns (loss, metrics floats)."""
    maskf = mask.float()
    nkl = logp - old
    if loss_type in ("gspo", "gspo_token"):
        seq = masked_mean(nkl, maskf, dim=-1)
        lr = seq.detach()[:, None] + logp - logp.detach() if loss_type == "gspo_token" else seq[:, None] * maskf
    else:
        lr = nkl
    r = lr.clamp(-20, 20).exp()
    rc = lr.clamp(math.log(1 - clip_low), math.log(1 + clip_high)).exp()
    l1, l2, l3 = -adv * r, -adv * rc, -adv * clip_dual
    hi_ = torch.max(l1, l2)
    lo_ = torch.min(hi_, l3)
    final = torch.where(adv < 0, lo_, hi_)
    per = {
        "ppo_kl": -nkl,
        "entropy_loss": agg(-logp, maskf, avg_mode),
        "pg_clipfrac_higher": (l1 < l2).float(),
        "pg_clipfrac_lower": (hi_ > l3).float() * (adv < 0).float(),
    }
    metrics = {k: float(masked_mean(v, maskf).detach()) for k, v in per.items()}
    return agg(final, maskf, avg_mode), metrics
