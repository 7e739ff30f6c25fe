"""The fused policy loss in plain torch: the CPU backend of ``rlk_mm::policy_loss_partials``.

The same per-token math as the Triton kernel (``_triton/loss.py``), written with torch
ops: one pass computes every loss term and metric and sums them in blocks of
``TOKENS_PER_BLOCK`` tokens; the backward recomputes the terms and applies the blocks'
gradients. Keep the two in step.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..loss.terms import K3_EXPONENT_LIMIT, K3_VALUE_LIMIT, TOKENS_PER_BLOCK, KLEstimator, Partial, num_blocks

__all__ = ["partials", "partials_backward"]


def _token_terms(
    log_probs, old_log_probs, advantages, seq_coef, mask, seq, seq_log_ratio, rollout_weights, ref_log_probs,
    clip_low, clip_high, clip_c, log_ratio_min, log_ratio_max, kl_kind, kl_straight_through,
):
    """Per-token values and d/d log-prob of each loss term: the kernel's math, in torch."""
    logp = log_probs.float()
    adv = advantages.float()
    m = torch.ones_like(logp) if mask is None else mask.to(torch.float32)
    valid = m != 0
    w = m if seq_coef is None else m * seq_coef[seq]
    tok_lr = logp - old_log_probs.float()
    lr_raw = seq_log_ratio[seq] if seq_log_ratio is not None else tok_lr
    lr_pass = (lr_raw >= log_ratio_min) & (lr_raw <= log_ratio_max)
    lr = torch.clamp(lr_raw, log_ratio_min, log_ratio_max)
    ratio = torch.exp(lr)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    m1 = torch.maximum(pg1, pg2)
    dpg = torch.where(pg1 >= pg2, -adv * ratio, 0.0)
    if math.isinf(clip_c):
        lower = torch.zeros_like(valid)
        pg = m1
    else:
        pg3 = -adv * clip_c
        neg = adv < 0
        lower = neg & (m1 > pg3)
        pg = torch.where(neg, torch.minimum(m1, pg3), m1)
        dpg = torch.where(lower, 0.0, dpg)
    dpg = torch.where(lr_pass, dpg, 0.0)
    if rollout_weights is not None:
        isw = rollout_weights.float()
        pg, dpg = pg * isw, dpg * isw
    kl = dkl = None
    if kl_kind != KLEstimator.NONE:
        x = logp - ref_log_probs.float()
        if kl_kind == KLEstimator.K1:
            kl, dkl = x, torch.ones_like(x)
        elif kl_kind == KLEstimator.ABS:
            kl, dkl = x.abs(), torch.sign(x)
        elif kl_kind == KLEstimator.K2:
            kl, dkl = 0.5 * x * x, x
        else:
            klc = torch.clamp(-x, -K3_EXPONENT_LIMIT, K3_EXPONENT_LIMIT)
            r = torch.exp(klc)
            kld = r - klc - 1.0
            kl = torch.clamp(kld, -K3_VALUE_LIMIT, K3_VALUE_LIMIT)
            keep = ((-x >= -K3_EXPONENT_LIMIT) & (-x <= K3_EXPONENT_LIMIT)
                    & (kld >= -K3_VALUE_LIMIT) & (kld <= K3_VALUE_LIMIT))
            dkl = torch.where(keep, 1.0 - r, 0.0)
        if kl_straight_through:
            dkl = x
    kl_old = -tok_lr if seq_log_ratio is not None else -lr
    return dict(m=m, valid=valid, w=w, pg=pg, dpg=dpg, kl=kl, dkl=dkl, clipped=(pg2 > pg1) & valid, lower=lower & valid,
                kl_old=kl_old)


def _block_sums(values: Tensor, blocks: int) -> Tensor:
    padded = torch.nn.functional.pad(values, (0, blocks * TOKENS_PER_BLOCK - values.numel()))
    return padded.view(blocks, TOKENS_PER_BLOCK).sum(-1)


def partials(args: dict) -> Tensor:
    """float32 ``[len(Partial), num_blocks]``: per-block sums of the loss terms and metrics."""
    nb = num_blocks(args["log_probs"].numel())
    t = _token_terms(**_term_args(args))
    zero = torch.zeros((), device=t["m"].device)

    def masked(x):
        return torch.where(t["valid"], x, zero)

    rows = [  # in Partial order
        masked(t["w"] * t["pg"]),
        masked(t["w"] * t["kl"]) if t["kl"] is not None else torch.zeros_like(t["m"]),
        masked(t["w"] * args["entropy"].float()) if args["entropy"] is not None else torch.zeros_like(t["m"]),
        torch.where(t["clipped"], t["m"], zero),
        torch.where(t["lower"], t["m"], zero),
        masked(t["m"] * t["kl_old"]),
        t["m"],
    ]
    return torch.stack([_block_sums(r, nb) for r in rows])


def partials_backward(
    grad_partials: Tensor, args: dict, *, separate_kl: bool = False,
) -> tuple[Tensor, Optional[Tensor], Tensor]:
    """(d/d log_probs, the KL term's part of it or None, d/d entropy — empty without entropy)
    from the partials' gradient. By default the first holds every term and the second is None;
    with ``separate_kl`` the first holds the policy term only and the second the KL term (None
    without KL), both float32: GSPO spreads the policy term over its sequence, not the KL."""
    n = args["log_probs"].numel()
    t = _token_terms(**_term_args(args))
    block = torch.arange(n, device=t["m"].device) // TOKENS_PER_BLOCK
    zero = torch.zeros((), device=t["m"].device)
    grad = grad_partials[Partial.PG_LOSS][block] * t["dpg"]
    grad_kl = None
    if t["dkl"] is not None:
        kl = grad_partials[Partial.KL_LOSS][block] * t["dkl"]
        if separate_kl:
            grad_kl = torch.where(t["valid"], t["w"] * kl, zero)
        else:
            grad = grad + kl
    grad_logp = torch.where(t["valid"], t["w"] * grad, zero)
    if not separate_kl:
        grad_logp = grad_logp.to(args["log_probs"].dtype)
    if args["entropy"] is None:
        return grad_logp, grad_kl, grad_logp.new_empty(0, dtype=args["log_probs"].dtype)
    grad_ent = torch.where(t["valid"], t["w"] * grad_partials[Partial.ENTROPY_LOSS][block],
                           zero).to(args["entropy"].dtype)
    return grad_logp, grad_kl, grad_ent


def _term_args(args: dict) -> dict:
    n = args["log_probs"].numel()
    seq = args["sample_index"]
    if seq is None:  # padded [B, R]
        seq = torch.arange(n, device=args["log_probs"].device) // max(args["row_length"], 1)
    return dict(
        log_probs=args["log_probs"], old_log_probs=args["old_log_probs"], advantages=args["advantages"],
        seq_coef=args["seq_coef"], mask=args["mask"], seq=seq, seq_log_ratio=args["seq_log_ratio"],
        rollout_weights=args["rollout_weights"], ref_log_probs=args["ref_log_probs"],
        clip_low=args["clip_low"], clip_high=args["clip_high"], clip_c=args["clip_c"],
        log_ratio_min=args["log_ratio_min"], log_ratio_max=args["log_ratio_max"],
        kl_kind=args["kl_kind"], kl_straight_through=args["kl_straight_through"],
    )
