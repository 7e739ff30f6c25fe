"""The fused policy loss's custom ops and the checked form of their arguments.

``policy_loss`` (``op``) and ``linear_policy_loss`` (``fused``) both check their
inputs with ``checked_policy`` into a ``CheckedPolicy`` (the op's arguments, in the three
lists below, and how the op's per-block partial sums become the loss), then run the op
``rlk_mm::policy_loss_partials`` (one fused pass over the tokens: Triton on CUDA, the same
math in torch elsewhere) or, for the fused LM-head loss, its backward
``rlk_mm::policy_loss_partials_backward`` chunk by chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from ...schema.checks import DeviceChecks
from .._backend import use_triton
from .._torch import loss as _torch_loss
from ..options import AggMode, RatioMode
from .checks import Agg, Layout, agg_args, check_data, checked_mask, layout_of, like
from .config import PolicyLoss, PolicyLossConfig
from .terms import MEAN_EPS, KLEstimator, Partial, num_blocks

__all__: list[str] = []

# ----------------------------------------------------------------------------- aggregation
def aggregation(layout: Layout, mask: Optional[Tensor], agg: Agg):
    """How ``agg`` aggregates: ``(coef, scale)`` with ``loss = scale(mask_sum) * sum_t mask_t * coef[seq(t)] * loss_t``.

    ``coef`` is float32 ``[S]``, or None for the token modes (weight = mask); ``scale`` maps the
    batch's total mask sum (a 0-d tensor, known only after the token pass) to the outer factor.
    Divisions by a zero count give 0, not NaN (a zero count only ever meets a zero sum); a
    global count below what this batch shows (``agg_args``) makes the factor NaN.
    """
    mode, dp_size = agg.mode, agg.dp_size
    if mode is AggMode.TOKEN_MEAN:
        if agg.batch_num_tokens is None:
            return None, lambda total: _safe_div(dp_size, total)
        return None, lambda total: _unless_below(_safe_div(dp_size, agg.batch_num_tokens), agg.batch_num_tokens,
                                                 total * (1.0 - agg.slack))
    if mode is AggMode.TOKEN_SUM:
        return None, lambda total: dp_size
    if mode is AggMode.TOKEN:
        return None, lambda total: 1.0 / (total + MEAN_EPS)
    S = layout.num_seqs
    counts = layout.seq_sum(mask_f32(mask, layout.shape.numel(), layout.device))
    if mode is AggMode.SEQ:
        return 1.0 / (counts + MEAN_EPS), lambda total: _safe_div(1.0, S)
    present = (counts > 0).to(torch.float32)
    coef = present / (counts + MEAN_EPS) if mode is AggMode.SEQ_MEAN_TOKEN_MEAN else present
    if agg.global_batch_size is None:
        return coef, lambda total: _safe_div(_safe_div(dp_size, present.sum()), agg.norm)
    count = agg.global_batch_size
    return coef, lambda total: _unless_below(_safe_div(_safe_div(dp_size, count), agg.norm), count, present.sum())


def mask_f32(mask: Optional[Tensor], n: int, device) -> Tensor:
    return torch.ones(n, device=device) if mask is None else mask.reshape(-1).to(torch.float32)


def _safe_div(num, den):
    """num / den for a count den >= 0; a zero count only ever multiplies a zero sum, so it is
    clamped to the smallest normal float (0 * finite = 0, where num / 0 would give NaN)."""
    if isinstance(den, Tensor):
        return num / den.to(torch.float32).clamp(min=torch.finfo(torch.float32).tiny)
    return num / den if den else 0.0


def _unless_below(factor, count, least: Tensor) -> Tensor:
    """``factor`` (float32, 0-d), NaN where the global ``count`` is below ``least``, what this
    batch shows (no host read: ``agg_args`` refuses it where the call reads the device)."""
    factor = torch.as_tensor(factor, dtype=torch.float32, device=least.device)
    count = torch.as_tensor(count, device=least.device).to(torch.float32)
    return torch.where(count < least, torch.full_like(factor, math.nan), factor)


# ----------------------------------------------------------------------------- fused op (registration)
# The op takes its constant inputs packed in three lists (names below): torch's custom-op
# autograd re-binds every argument on each call at a cost that grows with the square of
# the argument count (measured by hand: bench/results/loss/unknown/2026-11-22-custom-op-arguments.json).
OP_TENSORS = (
    "old_log_probs", "advantages", "seq_coef", "mask", "sample_index", "seq_log_ratio", "rollout_weights",
    "ref_log_probs",
)
OP_FLOATS = ("clip_low", "clip_high", "clip_c", "log_ratio_min", "log_ratio_max")
OP_INTS = ("num_seqs", "row_length", "kl_kind", "kl_straight_through", "sequence_mean_grad")
#: the constant inputs (``OP_TENSORS``) that are per token; the rest are per sequence
PER_TOKEN = ("old_log_probs", "advantages", "mask", "sample_index", "rollout_weights", "ref_log_probs")
#: the index of ``seq_log_ratio`` in ``OP_TENSORS``
SEQ_LOG_RATIO = OP_TENSORS.index("seq_log_ratio")


def _unpack(log_probs, entropy, tensors, floats, ints) -> dict:
    args = dict(zip(OP_TENSORS, tensors), log_probs=log_probs, entropy=entropy)
    args.update(zip(OP_FLOATS, floats))
    args.update(zip(OP_INTS, ints))
    return args


@torch.library.custom_op("rlk_mm::policy_loss_partials", mutates_args=())
def policy_loss_partials(
    log_probs: Tensor, entropy: Optional[Tensor], tensors: list[Optional[Tensor]], floats: list[float], ints: list[int]
) -> Tensor:
    """float32 [len(Partial), num_blocks]: per-block partial sums of the loss terms and metrics."""
    args = _unpack(log_probs, entropy, tensors, floats, ints)
    if not use_triton(log_probs):
        return _torch_loss.partials(args)
    from .._triton import loss as kernels

    partials = torch.empty(len(Partial), num_blocks(log_probs.numel()), dtype=torch.float32, device=log_probs.device)
    kernels.launch(backward=False, partials=partials, **_launch_args(args))
    return partials


@policy_loss_partials.register_fake
def _(log_probs, entropy, tensors, floats, ints):
    return log_probs.new_empty((len(Partial), num_blocks(log_probs.numel())), dtype=torch.float32)


@torch.library.custom_op("rlk_mm::policy_loss_partials_backward", mutates_args=())
def policy_loss_partials_backward(
    grad_partials: Tensor, log_probs: Tensor, entropy: Optional[Tensor], tensors: list[Optional[Tensor]],
    floats: list[float], ints: list[int],
) -> tuple[Tensor, Tensor]:
    """(d/d log_probs, d/d entropy — empty when entropy is None) from the partials' gradient."""
    args = _unpack(log_probs, entropy, tensors, floats, ints)
    grad_partials = grad_partials.float().contiguous()
    # GSPO: the policy term's gradient goes through the sequence mean, the KL term's stays per token
    spread = bool(args["sequence_mean_grad"])
    if not use_triton(log_probs):
        grad_logp, grad_kl, grad_ent = _torch_loss.partials_backward(grad_partials, args, separate_kl=spread)
    else:
        from .._triton import loss as kernels

        grad_logp = torch.empty_like(log_probs, dtype=torch.float32 if spread else None)
        grad_kl = torch.empty_like(grad_logp) if spread and args["kl_kind"] != KLEstimator.NONE else None
        grad_ent = torch.empty_like(entropy) if entropy is not None else log_probs.new_empty(0)
        kernels.launch(
            backward=True, grad_partials=grad_partials, grad_log_probs=grad_logp,
            grad_entropy=grad_ent if entropy is not None else None, grad_kl=grad_kl, **_launch_args(args),
        )
    if spread:
        grad_logp = _spread_over_sequence(grad_logp, args)
        if grad_kl is not None:
            grad_logp = grad_logp + grad_kl
        grad_logp = grad_logp.to(log_probs.dtype)
    return grad_logp, grad_ent


@policy_loss_partials_backward.register_fake
def _(grad_partials, log_probs, entropy, tensors, floats, ints):
    return torch.empty_like(log_probs), (torch.empty_like(entropy) if entropy is not None else log_probs.new_empty(0))


def _launch_args(args: dict) -> dict:
    skip = ("sequence_mean_grad", "num_seqs")
    return {k: v for k, v in args.items() if k not in skip}


def _setup_context(ctx, inputs, output):
    log_probs, entropy, tensors, floats, ints = inputs
    ctx.save_for_backward(log_probs, entropy, *tensors)
    ctx.floats, ctx.ints = floats, ints


def _backward(ctx, grad_partials):
    log_probs, entropy, *tensors = ctx.saved_tensors
    grad_logp, grad_ent = policy_loss_partials_backward(grad_partials, log_probs, entropy, tensors, ctx.floats,
                                                        ctx.ints)
    return grad_logp, (grad_ent if entropy is not None else None), _no_grads(tensors), None, None


def _no_grads(tensors: list) -> Optional[list]:
    """The (absent) gradient of the constants ``tensors``, in the structure torch's custom-op
    autograd expects: it flattens a list of tensors into one leaf per entry, but keeps a list
    holding a None as one leaf; the returned gradient must flatten alike (a list of Nones where
    every slot holds a tensor, one None otherwise)."""
    return [None] * len(tensors) if all(t is not None for t in tensors) else None


def _spread_over_sequence(grad_logp: Tensor, args: dict) -> Tensor:
    """GSPO's gradient through the sequence mean: each token gets mask_u / |y| of its sequence's sum."""
    n, R = grad_logp.numel(), args["row_length"]
    layout = Layout(grad_logp.shape, grad_logp.device, args["num_seqs"], R, args["sample_index"])
    m = mask_f32(args["mask"], n, grad_logp.device)
    total = layout.seq_sum(grad_logp.float())
    counts = layout.seq_sum(m).clamp(min=1.0)
    return (m * (total / counts)[layout.token_seq()]).to(grad_logp.dtype)


torch.library.register_autograd("rlk_mm::policy_loss_partials", _backward, setup_context=_setup_context)


@dataclass
class CheckedPolicy:
    """``policy_loss``'s checked arguments in the form its op takes (``OP_TENSORS``,
    ``OP_FLOATS``, ``OP_INTS``), and how the op's partial sums become the loss."""

    layout: Layout
    mask: Optional[Tensor]
    tensors: list
    floats: list
    ints: list
    scale: Callable
    ratio: RatioMode
    kl_coef: float
    entropy_coeff: float
    with_kl: bool
    with_entropy: bool

    def grad_rows(self, mask_sum: Tensor) -> Tensor:
        """float32 [len(Partial)]: d loss / d (each partial sum), given the batch's mask sum."""
        scale = torch.as_tensor(self.scale(mask_sum), dtype=torch.float32, device=mask_sum.device)
        zero = torch.zeros((), device=mask_sum.device)
        return torch.stack([scale, self.kl_coef * scale if self.with_kl else zero,
                            -self.entropy_coeff * scale if self.with_entropy else zero] + [zero] * (len(Partial) - 3))

    def losses(self, partials: Tensor) -> PolicyLoss:
        """(loss, metrics) from the op's per-block partial sums."""
        sums = partials.sum(-1)
        mask_sum = sums[Partial.MASK_SUM].detach()
        scale_now = self.scale(mask_sum)
        pg, kl, ent = (sums[row] * scale_now for row in (Partial.PG_LOSS, Partial.KL_LOSS, Partial.ENTROPY_LOSS))
        clipfrac, clipfrac_lower, ppo_kl = (
            sums[row].detach() / (mask_sum + MEAN_EPS)
            for row in (Partial.PG_CLIPFRAC, Partial.PG_CLIPFRAC_LOWER, Partial.PPO_KL)
        )
        loss = pg
        metrics = {"pg_loss": pg.detach(), "pg_clipfrac": clipfrac, "pg_clipfrac_lower": clipfrac_lower,
                   "ppo_kl": ppo_kl}
        if self.with_kl:
            loss = loss + self.kl_coef * kl
            metrics["kl_loss"] = kl.detach()
        if self.with_entropy:
            loss = loss - self.entropy_coeff * ent
            metrics["entropy_loss"] = ent.detach()
        return PolicyLoss(loss, metrics)


def checked_policy(
    name: str, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Optional[Tensor], *,
    sample_index, num_samples, rollout_is_weights, ref_log_probs, entropy, config: PolicyLossConfig,
) -> CheckedPolicy:
    """Every tensor argument of ``policy_loss`` checked against ``config`` (the values in one
    host sync); ``log_probs`` (named ``name``) gives the layout. ``entropy`` may be True for an
    entropy the caller computes later."""
    checks = DeviceChecks()
    layout = layout_of(name, log_probs, sample_index, num_samples, checks)
    scored = checked_mask(layout, checks, mask)
    for arg, t in (("old_log_probs", old_log_probs), ("advantages", advantages), ("ref_log_probs", ref_log_probs)):
        check_data(layout, checks, scored, arg, t)
    check_data(layout, checks, scored, "rollout_is_weights", rollout_is_weights, weights=True)
    if entropy is not None and entropy is not True:  # True: the caller computes it later
        like(layout, "entropy", entropy)
    kl_kind, kl_st = config.kl_estimator
    if config.kl_coef != 0.0 and ref_log_probs is None:
        raise ValueError("kl_coef is set but ref_log_probs is None")
    if config.entropy_coeff != 0.0 and entropy is None:
        raise ValueError("entropy_coeff is set but entropy is None")
    if ref_log_probs is None:
        kl_kind, kl_st = KLEstimator.NONE, False
    agg = agg_args(layout, checks, config, mask)
    checks.run()  # the one host sync

    flat = lambda t: None if t is None else t.detach().reshape(-1).contiguous()  # noqa: E731
    coef, scale = aggregation(layout, mask, agg)
    lo, hi = config.log_ratio_clamp
    return CheckedPolicy(
        layout=layout, mask=mask,
        tensors=[flat(old_log_probs), flat(advantages), None if coef is None else coef.contiguous(), flat(mask),
                 layout.sample_index, None, flat(rollout_is_weights), flat(ref_log_probs)],  # OP_TENSORS
        floats=[config.clip_ratio_low, config.clip_ratio_high, config.dual_clip_bound, lo, hi],  # OP_FLOATS
        ints=[layout.num_seqs, layout.row_length, int(kl_kind), int(kl_st), int(config.ratio is RatioMode.GSPO)],
        scale=scale, ratio=config.ratio, kl_coef=config.kl_coef, entropy_coeff=config.entropy_coeff,
        with_kl=ref_log_probs is not None, with_entropy=entropy is not None,
    )


def seq_log_ratio(policy: CheckedPolicy, log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    """GSPO: each sequence's masked mean of ``log_probs - old_log_probs`` (a constant)."""
    layout = policy.layout
    m = mask_f32(policy.mask, log_probs.numel(), log_probs.device)
    tok_lr = log_probs.detach().reshape(-1).float() - old_log_probs.detach().reshape(-1).float()
    tok_lr = torch.where(m != 0, tok_lr * m, torch.zeros((), device=log_probs.device))
    return (layout.seq_sum(tok_lr) / layout.seq_sum(m).clamp(min=1.0)).contiguous()

