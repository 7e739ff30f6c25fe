"""Fused policy-loss kernel: one elementwise pass over the loss tokens, forward or backward.

Forward writes, per block of ``TOKENS_PER_BLOCK`` tokens, the partial sums named by
``loss.terms.Partial`` (weighted policy loss, KL and entropy sums; clip counts; ppo_kl;
mask sum) to ``partials[row, block]``; the caller sums blocks in a fixed order, so the
result is deterministic. Backward re-reads the same inputs and writes d/d log-prob (and
d/d entropy) from the gradients of the block partials, in one pass: nothing of size n is
saved between the two.

The math is the one of ``_torch/loss.py`` (the torch backend); keep them in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import triton
import triton.language as tl

from ..loss.terms import K3_EXPONENT_LIMIT, K3_VALUE_LIMIT, TOKENS_PER_BLOCK, KLEstimator, Partial

__all__ = ["launch", "LossKernelConfig"]

# the shared constants as values the kernel can read
_K1 = tl.constexpr(int(KLEstimator.K1))
_ABS = tl.constexpr(int(KLEstimator.ABS))
_K2 = tl.constexpr(int(KLEstimator.K2))
_NO_KL = tl.constexpr(int(KLEstimator.NONE))
_EXP_LIMIT = tl.constexpr(K3_EXPONENT_LIMIT)
_VALUE_LIMIT = tl.constexpr(K3_VALUE_LIMIT)
_PG = tl.constexpr(int(Partial.PG_LOSS))
_KL = tl.constexpr(int(Partial.KL_LOSS))
_ENT = tl.constexpr(int(Partial.ENTROPY_LOSS))
_CLIP = tl.constexpr(int(Partial.PG_CLIPFRAC))
_CLIP_LOWER = tl.constexpr(int(Partial.PG_CLIPFRAC_LOWER))
_PPO_KL = tl.constexpr(int(Partial.PPO_KL))
_MASK = tl.constexpr(int(Partial.MASK_SUM))


@dataclass(frozen=True)
class LossKernelConfig:
    """Launch settings of the policy-loss kernel (its block is ``TOKENS_PER_BLOCK``, shared
    with the torch backend because it fixes the summation order)."""

    num_warps: int = 4


@triton.jit
def _clamp(x, lo, hi):
    """``torch.clamp``: a NaN stays NaN (Triton's min/max drop it unless told, torch's keep it)."""
    return tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _policy_loss_kernel(
    logp_ptr, old_ptr, adv_ptr, coef_ptr,
    mask_ptr, seq_ptr, seq_lr_ptr, isw_ptr, ref_ptr, ent_ptr,
    partial_ptr, gpart_ptr, glogp_ptr, gent_ptr, gkl_ptr,
    N, row_length, num_blocks,
    clip_lo, clip_hi, clip_c, lr_min, lr_max,
    BLOCK: tl.constexpr,
    BACKWARD: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_COEF: tl.constexpr,
    PADDED: tl.constexpr,
    SEQ_RATIO: tl.constexpr,
    HAS_DUAL: tl.constexpr,
    HAS_ISW: tl.constexpr,
    KL_KIND: tl.constexpr,  # a KLEstimator code
    KL_ST: tl.constexpr,  # straight-through ("k3+"): k2's gradient
    HAS_ENT: tl.constexpr,
    SPLIT_KL: tl.constexpr,  # backward: the KL term's gradient to gkl_ptr, apart from the policy term's
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < N

    logp = tl.load(logp_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    if PADDED:
        seq = offs // row_length
    else:
        seq = tl.load(seq_ptr + offs, mask=inb, other=0)
    if HAS_MASK:
        m = tl.load(mask_ptr + offs, mask=inb, other=0).to(tl.float32)
    else:
        m = tl.where(inb, 1.0, 0.0)
    valid = m != 0.0
    if HAS_COEF:
        w = m * tl.load(coef_ptr + seq, mask=inb, other=0.0)
    else:
        w = m

    # ratio and its clip
    tok_lr = logp - old
    if SEQ_RATIO:
        lr_raw = tl.load(seq_lr_ptr + seq, mask=inb, other=0.0)
    else:
        lr_raw = tok_lr
    lr_pass = (lr_raw >= lr_min) & (lr_raw <= lr_max)
    lr = _clamp(lr_raw, lr_min, lr_max)
    ratio = tl.exp(lr)
    pg1 = -adv * ratio
    pg2 = -adv * _clamp(ratio, clip_lo, clip_hi)
    m1 = tl.maximum(pg1, pg2, propagate_nan=tl.PropagateNan.ALL)
    dpg = tl.where(pg1 >= pg2, -adv * ratio, 0.0)
    if HAS_DUAL:
        pg3 = -adv * clip_c
        neg = adv < 0.0
        lower = neg & (m1 > pg3)
        pg = tl.where(neg, tl.minimum(m1, pg3, propagate_nan=tl.PropagateNan.ALL), m1)
        dpg = tl.where(lower, 0.0, dpg)
    else:
        lower = offs < 0  # no dual clip: never clipped from below
        pg = m1
    dpg = tl.where(lr_pass, dpg, 0.0)
    if HAS_ISW:
        isw = tl.load(isw_ptr + offs, mask=inb, other=0.0).to(tl.float32)
        pg = pg * isw
        dpg = dpg * isw

    # KL to the reference policy
    if KL_KIND != _NO_KL:
        x = logp - tl.load(ref_ptr + offs, mask=inb, other=0.0).to(tl.float32)
        if KL_KIND == _K1:
            kl = x
            dkl = tl.full([BLOCK], 1.0, tl.float32)
        elif KL_KIND == _ABS:
            kl = tl.abs(x)
            dkl = tl.where(x > 0.0, 1.0, tl.where(x < 0.0, -1.0, 0.0))
        elif KL_KIND == _K2:
            kl = 0.5 * x * x
            dkl = x
        else:  # k3
            nx = -x
            klc = _clamp(nx, -_EXP_LIMIT, _EXP_LIMIT)
            r = tl.exp(klc)
            kld = r - klc - 1.0
            kl = _clamp(kld, -_VALUE_LIMIT, _VALUE_LIMIT)
            keep = (nx >= -_EXP_LIMIT) & (nx <= _EXP_LIMIT) & (kld >= -_VALUE_LIMIT) & (kld <= _VALUE_LIMIT)
            dkl = tl.where(keep, 1.0 - r, 0.0)
        if KL_ST:
            dkl = x

    if BACKWARD:
        g_pg = tl.load(gpart_ptr + _PG * num_blocks + pid)
        grad = g_pg * dpg
        if KL_KIND != _NO_KL:
            g_kl = tl.load(gpart_ptr + _KL * num_blocks + pid)
            if SPLIT_KL:
                tl.store(gkl_ptr + offs, tl.where(valid, w * (g_kl * dkl), 0.0), mask=inb)
            else:
                grad += g_kl * dkl
        grad = tl.where(valid, w * grad, 0.0)
        tl.store(glogp_ptr + offs, grad, mask=inb)
        if HAS_ENT:
            g_ent = tl.load(gpart_ptr + _ENT * num_blocks + pid)
            tl.store(gent_ptr + offs, tl.where(valid, w * g_ent, 0.0), mask=inb)
    else:
        zero = tl.zeros([BLOCK], tl.float32)
        tl.store(partial_ptr + _PG * num_blocks + pid, tl.sum(tl.where(valid, w * pg, zero), axis=0))
        if KL_KIND != _NO_KL:
            tl.store(partial_ptr + _KL * num_blocks + pid, tl.sum(tl.where(valid, w * kl, zero), axis=0))
        else:
            tl.store(partial_ptr + _KL * num_blocks + pid, 0.0)
        if HAS_ENT:
            ent = tl.load(ent_ptr + offs, mask=inb, other=0.0).to(tl.float32)
            tl.store(partial_ptr + _ENT * num_blocks + pid, tl.sum(tl.where(valid, w * ent, zero), axis=0))
        else:
            tl.store(partial_ptr + _ENT * num_blocks + pid, 0.0)
        clipped = (pg2 > pg1) & valid
        tl.store(partial_ptr + _CLIP * num_blocks + pid, tl.sum(tl.where(clipped, m, zero), axis=0))
        tl.store(partial_ptr + _CLIP_LOWER * num_blocks + pid, tl.sum(tl.where(lower & valid, m, zero), axis=0))
        if SEQ_RATIO:
            kl_old = -tok_lr
        else:
            kl_old = -lr
        tl.store(partial_ptr + _PPO_KL * num_blocks + pid, tl.sum(tl.where(valid, m * kl_old, zero), axis=0))
        tl.store(partial_ptr + _MASK * num_blocks + pid, tl.sum(m, axis=0))


def launch(
    *, backward, log_probs, old_log_probs, advantages, seq_coef, mask, sample_index, seq_log_ratio,
    rollout_weights, ref_log_probs, entropy, row_length, clip_low, clip_high, clip_c, log_ratio_min,
    log_ratio_max, kl_kind, kl_straight_through, partials=None, grad_partials=None, grad_log_probs=None,
    grad_entropy=None, grad_kl=None, config: Optional[LossKernelConfig] = None,
):
    """Run the kernel over all ``log_probs.numel()`` tokens (flat, contiguous inputs),
    ``TOKENS_PER_BLOCK`` tokens per program (``partials`` has one column per block). In the
    backward, given ``grad_kl`` (and a KL term), the KL term's gradient goes there and
    ``grad_log_probs`` gets the other terms' only (GSPO spreads those over the sequence)."""
    cfg = config or LossKernelConfig()
    n = log_probs.numel()
    num_blocks = triton.cdiv(n, TOKENS_PER_BLOCK)
    if num_blocks == 0:
        return
    dummy = log_probs  # stands in for absent optional pointers; never read
    _policy_loss_kernel[(num_blocks,)](
        log_probs, old_log_probs, advantages, dummy if seq_coef is None else seq_coef,
        dummy if mask is None else mask,
        dummy if sample_index is None else sample_index,
        dummy if seq_log_ratio is None else seq_log_ratio,
        dummy if rollout_weights is None else rollout_weights,
        dummy if ref_log_probs is None else ref_log_probs,
        dummy if entropy is None else entropy,
        dummy if partials is None else partials,
        dummy if grad_partials is None else grad_partials,
        dummy if grad_log_probs is None else grad_log_probs,
        dummy if grad_entropy is None else grad_entropy,
        dummy if grad_kl is None else grad_kl,
        n, max(row_length, 1), num_blocks,
        1.0 - clip_low, 1.0 + clip_high, clip_c, log_ratio_min, log_ratio_max,
        BLOCK=TOKENS_PER_BLOCK,
        BACKWARD=backward,
        HAS_MASK=mask is not None,
        HAS_COEF=seq_coef is not None,
        PADDED=sample_index is None,
        SEQ_RATIO=seq_log_ratio is not None,
        HAS_DUAL=clip_c != float("inf"),
        HAS_ISW=rollout_weights is not None,
        KL_KIND=int(kl_kind),
        KL_ST=kl_straight_through,
        HAS_ENT=entropy is not None,
        SPLIT_KL=grad_kl is not None,
        num_warps=cfg.num_warps,
    )
