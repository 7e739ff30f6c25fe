"""Policy losses over loss tokens: the clipped PPO/GSPO objective, KL penalties, aggregation.

Two layouts, one semantics:

* **padded** — tensors ``[B, R]`` (verl's and EasyR1's response layout) with an optional
  ``mask`` ``[B, R]`` (bool or 0/1; a float mask weights tokens); row ``b`` is sequence ``b``.
* **compact** — tensors ``[n]`` in loss-token order (what ``selected_logprob`` returns)
  with ``sample_index`` int64 ``[n]`` (``RLBatch.loss_token_sample()``: non-decreasing,
  in ``[0, num_samples)``) and ``num_samples``; ``mask`` ``[n]`` is optional.

Aggregation is ``scale * sum_t mask_t * c[seq(t)] * loss_t``: per-sequence weights ``c``
(the seq modes) and an outer factor (dp_size over token or sequence counts) from the mode —
verl 0.9.1's ``agg_loss`` formulas, plus EasyR1's ``token`` and ``seq``. ``policy_loss``
runs one fused pass over the tokens (Triton on CUDA, the same math in torch elsewhere) for
the forward and one for the backward; the per-block partial sums are added in a fixed
order, so results are deterministic.
``old_log_probs``, ``advantages``, ``rollout_is_weights`` and ``ref_log_probs`` are
constants (no gradient flows to them), as in PPO.

Deliberate differences from verl: a fully masked batch gives loss 0 (verl divides 0 by 0);
masked positions never leak NaN/inf into a sum (verl's seq-mean modes multiply by the mask);
arguments are checked (nonsense knobs, masks, non-finite data raise an error naming the
argument, sample and position; see ``policy_loss``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from ..schema.checks import FLOAT_DTYPES, DeviceChecks, float_arg, tensor_arg
from . import _loss_terms as terms
from ._backend import use_triton
from ._loss_args import (
    Agg, Layout, agg_args, check_data, checked_mask, dual_clip, f32_arg, kl_estimator,
    layout_of, like, log_ratio_bounds,
)
from ._loss_terms import K3_EXPONENT_LIMIT, K3_VALUE_LIMIT, LOG_RATIO_LIMIT, MEAN_EPS, KLEstimator, Partial
from ._torch import loss as _torch_loss
from .options import AggMode, KLType, RatioMode  # noqa: F401  (KLType: served here too)


# ----------------------------------------------------------------------------- aggregation
def _aggregation(layout: Layout, mask: Optional[Tensor], agg: Agg):
    """How ``agg`` aggregates: ``(coef, scale)`` with ``loss = scale(mask_sum) * sum_t mask_t * coef[seq(t)] * loss_t``.

    ``coef`` is float32 ``[S]``, or None for the token modes (weight = mask); ``scale`` maps the
    batch's total mask sum (a 0-d tensor, known only after the token pass) to the outer factor.
    Divisions by a zero count give 0, not NaN.
    """
    mode, dp_size = agg.mode, agg.dp_size
    if mode is AggMode.TOKEN_MEAN:
        if agg.batch_num_tokens is None:
            return None, lambda total: _safe_div(dp_size, total)
        return None, lambda total: _safe_div(dp_size, agg.batch_num_tokens)
    if mode is AggMode.TOKEN_SUM:
        return None, lambda total: dp_size
    if mode is AggMode.TOKEN:
        return None, lambda total: 1.0 / (total + MEAN_EPS)
    S = layout.num_seqs
    counts = layout.seq_sum(_mask_f32(mask, layout.shape.numel(), layout.device))
    if mode is AggMode.SEQ:
        return 1.0 / (counts + MEAN_EPS), lambda total: _safe_div(1.0, S)
    present = (counts > 0).to(torch.float32)
    global_batch_size = present.sum() if agg.global_batch_size is None else agg.global_batch_size
    coef = present / (counts + MEAN_EPS) if mode is AggMode.SEQ_MEAN_TOKEN_MEAN else present
    return coef, lambda total: _safe_div(_safe_div(dp_size, global_batch_size), agg.norm)


def _mask_f32(mask: Optional[Tensor], n: int, device) -> Tensor:
    return torch.ones(n, device=device) if mask is None else mask.reshape(-1).to(torch.float32)


def _safe_div(num, den):
    """num / den for a count den >= 0; a zero count only ever multiplies a zero sum, so it is
    clamped to the smallest normal float (0 * finite = 0, where num / 0 would give NaN)."""
    if isinstance(den, Tensor):
        return num / den.to(torch.float32).clamp(min=torch.finfo(torch.float32).tiny)
    return num / den if den else 0.0


def agg_loss(
    loss_mat: Tensor,
    mask: Optional[Tensor] = None,
    loss_agg_mode: str = "token-mean",
    *,
    sample_index: Optional[Tensor] = None,
    num_samples: Optional[int] = None,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> Tensor:
    """Aggregate per-token losses to a scalar: verl 0.9.1's ``agg_loss`` modes and EasyR1's ``token``/``seq``.

    ``token-mean``: sum / batch_num_tokens * dp_size; ``token-sum``: sum * dp_size;
    ``seq-mean-token-sum``: sum over sequences of their token sums / global_batch_size * dp_size
    (``-norm``: further / loss_scale_factor, default R); ``seq-mean-token-mean``: the same over
    per-sequence token means. Sequences with no token are left out of the default
    global_batch_size. EasyR1 ``token``: masked mean (eps ``MEAN_EPS``); ``seq``: mean over all rows
    of per-row masked means.

    Checks as ``policy_loss`` does (one host sync for a non-bool mask, ``sample_index`` or a
    tensor count; none otherwise). A non-finite ``loss_mat`` entry propagates where the mask is
    set and is ignored where it is not.
    """
    checks = DeviceChecks()
    layout = layout_of("loss_mat", loss_mat, sample_index, num_samples, checks)
    checked_mask(layout, checks, mask)
    agg = agg_args(layout, checks, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    checks.run()
    coef, scale = _aggregation(layout, mask, agg)
    m = _mask_f32(mask, loss_mat.numel(), loss_mat.device)
    w = m if coef is None else m * coef[layout.token_seq()]
    values = loss_mat.reshape(-1)
    total = torch.where(m != 0, values * w, torch.zeros((), dtype=values.dtype, device=values.device)).sum()
    return scale(m.sum()) * total


# ----------------------------------------------------------------------------- KL
def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token KL estimate of the policy to a reference (verl's ``kl_penalty``; EasyR1's ``compute_kl``).

    ``k1``/``kl``: x = logp - ref; ``abs``: |x|; ``k2``/``mse``: x^2 / 2;
    ``k3``/``low_var_kl``: exp(k) - k - 1 with k = clamp(-x, ±K3_EXPONENT_LIMIT), clamped to ±K3_VALUE_LIMIT.
    A trailing ``+`` (e.g. ``k3+``) keeps the value and takes k2's gradient (straight-through).
    Both inputs: float tensors of one shape (no broadcasting) and device; no host sync.
    Non-finite values propagate, except through k3's clamps.
    """
    tensor_arg("log_probs", log_probs, dtypes=FLOAT_DTYPES)
    tensor_arg("ref_log_probs", ref_log_probs, shape=log_probs.shape, dtypes=FLOAT_DTYPES, device=log_probs.device)
    estimator, straight_through = kl_estimator(kind, "kind")
    x = log_probs - ref_log_probs
    if estimator == KLEstimator.K1:
        value = x
    elif estimator == KLEstimator.ABS:
        value = x.abs()
    elif estimator == KLEstimator.K2:
        value = 0.5 * x.square()
    else:
        k = torch.clamp(-x, min=-K3_EXPONENT_LIMIT, max=K3_EXPONENT_LIMIT)
        value = torch.clamp(torch.exp(k) - k - 1.0, min=-K3_VALUE_LIMIT, max=K3_VALUE_LIMIT)
    if straight_through:
        k2 = 0.5 * x.square()
        return k2 - k2.detach() + value.detach()
    return value


# ----------------------------------------------------------------------------- fused op (registration)
# The op takes its constant inputs packed in three lists (names below): torch's custom-op
# autograd re-binds every argument on each call at a cost that grows with the square of
# the argument count (bench/results/README.md).
_OP_TENSORS = (
    "old_log_probs", "advantages", "seq_coef", "mask", "sample_index", "seq_log_ratio", "rollout_weights",
    "ref_log_probs",
)
_OP_FLOATS = ("clip_low", "clip_high", "clip_c", "log_ratio_min", "log_ratio_max")
_OP_INTS = ("num_seqs", "row_length", "kl_kind", "kl_straight_through", "sequence_mean_grad")


def _unpack(log_probs, entropy, tensors, floats, ints) -> dict:
    args = dict(zip(_OP_TENSORS, tensors), log_probs=log_probs, entropy=entropy)
    args.update(zip(_OP_FLOATS, floats))
    args.update(zip(_OP_INTS, ints))
    return args


@torch.library.custom_op("rlk_mm::policy_loss_partials", mutates_args=())
def _policy_loss_partials(
    log_probs: Tensor, entropy: Optional[Tensor], tensors: list[Optional[Tensor]], floats: list[float], ints: list[int]
) -> Tensor:
    """float32 [len(Partial), num_blocks]: per-block partial sums of the loss terms and metrics."""
    args = _unpack(log_probs, entropy, tensors, floats, ints)
    if not use_triton(log_probs):
        return _torch_loss.partials(args)
    from ._triton import loss as kernels

    partials = torch.empty(len(Partial), terms.num_blocks(log_probs.numel()), dtype=torch.float32, device=log_probs.device)
    kernels.launch(backward=False, partials=partials, **_launch_args(args))
    return partials


@_policy_loss_partials.register_fake
def _(log_probs, entropy, tensors, floats, ints):
    return log_probs.new_empty((len(Partial), terms.num_blocks(log_probs.numel())), dtype=torch.float32)


@torch.library.custom_op("rlk_mm::policy_loss_partials_backward", mutates_args=())
def _policy_loss_partials_backward(
    grad_partials: Tensor, log_probs: Tensor, entropy: Optional[Tensor], tensors: list[Optional[Tensor]],
    floats: list[float], ints: list[int],
) -> tuple[Tensor, Tensor]:
    """(d/d log_probs, d/d entropy — empty when entropy is None) from the partials' gradient."""
    args = _unpack(log_probs, entropy, tensors, floats, ints)
    grad_partials = grad_partials.float().contiguous()
    if not use_triton(log_probs):
        grad_logp, grad_ent = _torch_loss.partials_backward(grad_partials, args)
    else:
        from ._triton import loss as kernels

        grad_logp = torch.empty_like(log_probs)
        grad_ent = torch.empty_like(entropy) if entropy is not None else log_probs.new_empty(0)
        kernels.launch(
            backward=True, grad_partials=grad_partials, grad_log_probs=grad_logp,
            grad_entropy=grad_ent if entropy is not None else None, **_launch_args(args),
        )
    if args["sequence_mean_grad"]:
        grad_logp = _spread_over_sequence(grad_logp, args)
    return grad_logp, grad_ent


@_policy_loss_partials_backward.register_fake
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
    grad_logp, grad_ent = _policy_loss_partials_backward(grad_partials, log_probs, entropy, tensors, ctx.floats, ctx.ints)
    return grad_logp, (grad_ent if entropy is not None else None), None, None, None


def _spread_over_sequence(grad_logp: Tensor, args: dict) -> Tensor:
    """GSPO's gradient through the sequence mean: each token gets mask_u / |y| of its sequence's sum."""
    n, R = grad_logp.numel(), args["row_length"]
    layout = Layout(grad_logp.shape, grad_logp.device, args["num_seqs"], R, args["sample_index"])
    m = _mask_f32(args["mask"], n, grad_logp.device)
    total = layout.seq_sum(grad_logp.float())
    counts = layout.seq_sum(m).clamp(min=1.0)
    return (m * (total / counts)[layout.token_seq()]).to(grad_logp.dtype)


torch.library.register_autograd("rlk_mm::policy_loss_partials", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public op
def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Optional[Tensor] = None,
    *,
    sample_index: Optional[Tensor] = None,
    num_samples: Optional[int] = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = 3.0,
    ratio: str = "token",
    log_ratio_clamp: tuple[Optional[float], Optional[float]] = (-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT),
    rollout_is_weights: Optional[Tensor] = None,
    ref_log_probs: Optional[Tensor] = None,
    kl_type: str = "low_var_kl",
    kl_coef: float = 0.0,
    entropy: Optional[Tensor] = None,
    entropy_coeff: float = 0.0,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss (PPO / dual-clip / GSPO) + KL and entropy terms, fused.

    Per token: ``r = exp(clamp(logp - old, *log_ratio_clamp))``;
    ``l = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``; for ``A < 0`` the
    dual clip ``min(l, -A c)`` (``clip_ratio_c=None`` turns it off); times
    ``rollout_is_weights``. ``ratio="gspo_token"``/``"gspo"`` replace ``logp - old`` by the
    sequence's mean log-ratio (see ``RatioMode``). Total:
    ``agg(l) + kl_coef * agg(kl_penalty(logp, ref, kl_type)) - entropy_coeff * agg(entropy)``
    with ``agg`` = ``agg_loss(..., loss_agg_mode, ...)``.

    Returns ``(loss, metrics)``: a float32 scalar, and 0-d float32 tensors named as verl
    names them — ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` (mask means),
    plus ``kl_loss`` / ``entropy_loss`` when those inputs are given.

    Every argument is checked before any work, and the values in one host sync per call:
    ``sample_index`` (order, range), the mask (bool; integer 0 or 1; float weights finite and
    >= 0), ``old_log_probs``, ``advantages``, ``ref_log_probs`` (finite) and
    ``rollout_is_weights`` (finite, >= 0) where the mask is set, tensor counts (>= 0). The
    model's outputs are not checked: a non-finite ``log_probs`` or ``entropy`` value
    propagates to the loss where the mask is set (verl skips such steps by the gradient norm)
    and is ignored where it is not. Knobs: ``0 <= clip_ratio_low <= 1``,
    ``clip_ratio_high >= 0``, ``clip_ratio_c > 1`` or None, ``kl_coef >= 0``,
    ``entropy_coeff >= 0`` (a bonus), ``dp_size >= 1``.
    """
    policy = _checked_policy(
        "log_probs", log_probs, old_log_probs, advantages, mask, sample_index=sample_index, num_samples=num_samples,
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, ratio=ratio,
        log_ratio_clamp=log_ratio_clamp, rollout_is_weights=rollout_is_weights, ref_log_probs=ref_log_probs,
        kl_type=kl_type, kl_coef=kl_coef, entropy=entropy, entropy_coeff=entropy_coeff, loss_agg_mode=loss_agg_mode,
        dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    if policy.ratio is not RatioMode.TOKEN:
        policy.tensors[_SEQ_LOG_RATIO] = _seq_log_ratio(policy, log_probs, old_log_probs)
    partials = _policy_loss_partials(
        log_probs.reshape(-1).contiguous(), None if entropy is None else entropy.reshape(-1).contiguous(),
        policy.tensors, policy.floats, policy.ints,
    )
    return policy.losses(partials)


@dataclass
class _Policy:
    """``policy_loss``'s checked arguments in the form its op takes (``_OP_TENSORS``,
    ``_OP_FLOATS``, ``_OP_INTS``), and how the op's partial sums become the loss."""

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

    def losses(self, partials: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss, metrics) from the op's per-block partial sums."""
        sums = partials.sum(-1)
        mask_sum = sums[Partial.MASK_SUM].detach()
        scale_now = self.scale(mask_sum)
        pg, kl, ent = (sums[row] * scale_now for row in (Partial.PG_LOSS, Partial.KL_LOSS, Partial.ENTROPY_LOSS))
        clipfrac, clipfrac_lower, ppo_kl = (
            sums[row].detach() / (mask_sum + MEAN_EPS) for row in (Partial.PG_CLIPFRAC, Partial.PG_CLIPFRAC_LOWER, Partial.PPO_KL)
        )
        loss = pg
        metrics = {"pg_loss": pg.detach(), "pg_clipfrac": clipfrac, "pg_clipfrac_lower": clipfrac_lower, "ppo_kl": ppo_kl}
        if self.with_kl:
            loss = loss + self.kl_coef * kl
            metrics["kl_loss"] = kl.detach()
        if self.with_entropy:
            loss = loss - self.entropy_coeff * ent
            metrics["entropy_loss"] = ent.detach()
        return loss, metrics


#: the index of ``seq_log_ratio`` in ``_OP_TENSORS``
_SEQ_LOG_RATIO = 5


def _checked_policy(
    name: str, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Optional[Tensor], *,
    sample_index, num_samples, clip_ratio_low, clip_ratio_high, clip_ratio_c, ratio, log_ratio_clamp,
    rollout_is_weights, ref_log_probs, kl_type, kl_coef, entropy, entropy_coeff, loss_agg_mode, dp_size,
    batch_num_tokens, global_batch_size, loss_scale_factor,
) -> _Policy:
    """Every argument of ``policy_loss`` checked (the values in one host sync); ``log_probs``
    (named ``name``) gives the layout. ``entropy`` may be True for an entropy the caller
    computes later."""
    checks = DeviceChecks()
    layout = layout_of(name, log_probs, sample_index, num_samples, checks)
    scored = checked_mask(layout, checks, mask)
    for arg, t in (("old_log_probs", old_log_probs), ("advantages", advantages), ("ref_log_probs", ref_log_probs)):
        check_data(layout, checks, scored, arg, t)
    check_data(layout, checks, scored, "rollout_is_weights", rollout_is_weights, weights=True)
    if isinstance(entropy, Tensor):
        like(layout, "entropy", entropy)
    ratio = RatioMode.parse(ratio, "ratio")
    clip_ratio_low = float_arg("clip_ratio_low", clip_ratio_low, min=0.0, max=1.0)
    clip_ratio_high = f32_arg("clip_ratio_high", clip_ratio_high, min=0.0, inf_ok=True)
    clip_c = dual_clip("clip_ratio_c", clip_ratio_c)
    lo, hi = log_ratio_bounds(log_ratio_clamp)
    kl_coef = f32_arg("kl_coef", kl_coef, min=0.0)
    entropy_coeff = f32_arg("entropy_coeff", entropy_coeff, min=0.0)
    kl_kind, kl_st = kl_estimator(kl_type, "kl_type")
    if kl_coef != 0.0 and ref_log_probs is None:
        raise ValueError("kl_coef is set but ref_log_probs is None")
    if entropy_coeff != 0.0 and entropy is None:
        raise ValueError("entropy_coeff is set but entropy is None")
    if ref_log_probs is None:
        kl_kind, kl_st = KLEstimator.NONE, False
    agg = agg_args(layout, checks, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    checks.run()  # the one host sync

    flat = lambda t: None if t is None else t.detach().reshape(-1).contiguous()  # noqa: E731
    coef, scale = _aggregation(layout, mask, agg)
    return _Policy(
        layout=layout, mask=mask,
        tensors=[flat(old_log_probs), flat(advantages), None if coef is None else coef.contiguous(), flat(mask),
                 layout.sample_index, None, flat(rollout_is_weights), flat(ref_log_probs)],  # _OP_TENSORS
        floats=[clip_ratio_low, clip_ratio_high, clip_c, lo, hi],  # _OP_FLOATS
        ints=[layout.num_seqs, layout.row_length, int(kl_kind), int(kl_st), int(ratio is RatioMode.GSPO)],  # _OP_INTS
        scale=scale, ratio=ratio, kl_coef=kl_coef, entropy_coeff=entropy_coeff,
        with_kl=ref_log_probs is not None, with_entropy=entropy is not None,
    )


def _seq_log_ratio(policy: _Policy, log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    """GSPO: each sequence's masked mean of ``log_probs - old_log_probs`` (a constant)."""
    layout = policy.layout
    m = _mask_f32(policy.mask, log_probs.numel(), log_probs.device)
    tok_lr = log_probs.detach().reshape(-1).float() - old_log_probs.detach().reshape(-1).float()
    tok_lr = torch.where(m != 0, tok_lr * m, torch.zeros((), device=log_probs.device))
    return (layout.seq_sum(tok_lr) / layout.seq_sum(m).clamp(min=1.0)).contiguous()
