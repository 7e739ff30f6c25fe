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

from typing import Optional, Unpack

import torch
from torch import Tensor

from ...deprecations import renamed_keywords
from ...schema.checks import FLOAT_DTYPES, DeviceChecks, tensor_arg
from .._backend import readable_args
from ..options import AggMode, KLType, RatioMode
from .checks import agg_args, checked_mask, layout_of
from .config import PolicyLoss, PolicyLossConfig, PolicyLossKnobs, kl_estimator, policy_loss_config
from .custom_op import SEQ_LOG_RATIO, aggregation, checked_policy, mask_f32, policy_loss_partials, seq_log_ratio
from .terms import K3_EXPONENT_LIMIT, K3_VALUE_LIMIT, KLEstimator

__all__ = ["AggMode", "KLType", "PolicyLoss", "PolicyLossConfig", "RatioMode", "agg_loss", "kl_penalty", "policy_loss"]


def agg_loss(
    loss_mat: Tensor,
    mask: Optional[Tensor] = None,
    loss_agg_mode: AggMode | str = AggMode.TOKEN_MEAN,
    *,
    sample_index: Optional[Tensor] = None,
    num_samples: Optional[int] = None,
    dp_size: int = 1,
    batch_num_tokens: float | Tensor | None = None,
    global_batch_size: float | Tensor | None = None,
    loss_scale_factor: Optional[float] = None,
) -> Tensor:
    """Aggregate per-token losses to a scalar: verl 0.9.1's ``agg_loss`` modes and EasyR1's ``token``/``seq``.

    Parameters
    ----------
    loss_mat : Tensor
        Per-token losses: padded ``[B, R]`` with ``mask``, or compact ``[n]`` with ``sample_index``.
    mask : Tensor, optional
        ``[B, R]`` (or ``[n]``): bool, integer 0/1, or finite float weights >= 0. None: every token.
    loss_agg_mode : AggMode or str
        ``token-mean``: sum / batch_num_tokens * dp_size; ``token-sum``: sum * dp_size;
        ``seq-mean-token-sum``: sum over sequences of their token sums / global_batch_size * dp_size
        (``-norm``: further / loss_scale_factor, default R); ``seq-mean-token-mean``: the same over
        per-sequence token means. EasyR1 ``token``: masked mean (eps ``MEAN_EPS``); ``seq``: mean over
        all rows of per-row masked means.
    sample_index : Tensor, optional
        Compact layout: each token's sample, sorted, in ``[0, num_samples)``.
    num_samples : int, optional
        Compact layout: the number of samples.
    dp_size : int
        Data-parallel ranks the global counts span, >= 1.
    batch_num_tokens, global_batch_size : float or Tensor, optional
        The global token and sequence counts (``PolicyLossConfig``'s fields of the same names, with
        the same checks); None: this batch's. Sequences with no token are left out of the default
        ``global_batch_size``.
    loss_scale_factor : float, optional
        ``seq-mean-token-sum-norm``'s divisor, > 0 (None: the padded length R).

    Returns
    -------
    Tensor
        A float32 scalar.

    Raises
    ------
    ValueError, TypeError
        For a bad argument, naming it (checked before any work; one host sync for a non-bool mask,
        ``sample_index`` or a tensor count, none otherwise). A global count below what this batch
        shows is refused in that sync; where the call makes none it gives a NaN result.

    Notes
    -----
    A non-finite ``loss_mat`` entry propagates where the mask is set and is ignored where it is not.
    """
    checks = DeviceChecks()
    layout = layout_of("loss_mat", loss_mat, sample_index, num_samples, checks)
    checked_mask(layout, checks, mask)
    config = PolicyLossConfig(loss_agg_mode=loss_agg_mode, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                              global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor)
    # the counts are checked against the data where the call reads the device anyway (else: NaN)
    reads = ((mask is not None and mask.dtype != torch.bool) or (sample_index is not None and loss_mat.numel() > 0)
             or any(isinstance(c, Tensor) for c in (batch_num_tokens, global_batch_size)))
    if reads:
        readable_args("agg_loss", loss_mat=loss_mat)  # (the others must be on its device)
    agg = agg_args(layout, checks, config, mask, check_counts=reads)
    checks.run()
    coef, scale = aggregation(layout, mask, agg)
    m = mask_f32(mask, loss_mat.numel(), loss_mat.device)
    w = m if coef is None else m * coef[layout.token_seq()]
    values = loss_mat.reshape(-1)
    total = torch.where(m != 0, values * w, torch.zeros((), dtype=values.dtype, device=values.device)).sum()
    return scale(m.sum()) * total


# ----------------------------------------------------------------------------- KL
@renamed_keywords
def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kl_type: KLType | str = KLType.LOW_VAR_KL) -> Tensor:
    """Per-token KL estimate of the policy to a reference (verl's ``kl_penalty``; EasyR1's ``compute_kl``).

    Parameters
    ----------
    log_probs, ref_log_probs : Tensor
        Float tensors of one shape (no broadcasting) and device.
    kl_type : KLType or str
        ``k1``/``kl``: x = logp - ref; ``abs``: |x|; ``k2``/``mse``: x^2 / 2; ``k3``/``low_var_kl``:
        exp(k) - k - 1 with k = clamp(-x, ±K3_EXPONENT_LIMIT), clamped to ±K3_VALUE_LIMIT. A
        trailing ``+`` (e.g. ``k3+``) keeps the value and takes k2's gradient (straight-through).
        ``kind=`` is its deprecated old name.

    Returns
    -------
    Tensor
        The estimate, the inputs' shape and dtype.

    Raises
    ------
    ValueError, TypeError
        For an unknown ``kl_type`` or inputs of different shapes, dtypes or devices. No host sync.

    Notes
    -----
    Non-finite values propagate, except through k3's clamps.
    """
    tensor_arg("log_probs", log_probs, dtypes=FLOAT_DTYPES)
    tensor_arg("ref_log_probs", ref_log_probs, shape=log_probs.shape, dtypes=FLOAT_DTYPES, device=log_probs.device)
    estimator, straight_through = kl_estimator(kl_type, "kl_type")
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


# ----------------------------------------------------------------------------- public op
def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Optional[Tensor] = None,
    *,
    sample_index: Optional[Tensor] = None,
    num_samples: Optional[int] = None,
    rollout_is_weights: Optional[Tensor] = None,
    ref_log_probs: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None,
    config: Optional[PolicyLossConfig] = None,
    **knobs: Unpack[PolicyLossKnobs],
) -> PolicyLoss:
    """Clipped policy-gradient loss (PPO / dual-clip / GSPO) with KL and entropy terms, fused.

    Per token: ``r = exp(clamp(logp - old, *log_ratio_clamp))``;
    ``l = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``; for ``A < 0`` the dual
    clip ``min(l, -A c)``; times ``rollout_is_weights``. ``ratio="gspo_token"``/``"gspo"`` replace
    ``logp - old`` by the sequence's mean log-ratio (see ``RatioMode``). Total:
    ``agg(l) + kl_coef * agg(kl_penalty(logp, ref, kl_type)) - entropy_coeff * agg(entropy)`` with
    ``agg`` = ``agg_loss(..., loss_agg_mode, ...)``.

    Parameters
    ----------
    log_probs : Tensor
        The policy's log-probs: padded ``[B, R]`` with ``mask``, or the compact ``[n]`` output of
        ``selected_logprob`` with ``sample_index`` and ``num_samples``.
    old_log_probs, advantages : Tensor
        Same layout as ``log_probs``; finite where the mask is set.
    mask : Tensor, optional
        Bool, integer 0/1, or finite float weights >= 0. None: every token.
    sample_index : Tensor, optional
        Compact layout: each token's sample (``batch.loss_token_sample()``), sorted.
    num_samples : int, optional
        Compact layout: the number of samples.
    rollout_is_weights : Tensor, optional
        Importance-sampling weights, finite and >= 0 where the mask is set.
    ref_log_probs : Tensor, optional
        The reference policy's log-probs, finite; needed when ``kl_coef > 0``.
    entropy : Tensor, optional
        Per-token entropies; needed when ``entropy_coeff > 0``.
    config : PolicyLossConfig, optional
        The knobs (clips, ``ratio: RatioMode``, ``log_ratio_clamp``, ``kl_type: KLType``,
        ``kl_coef``, ``entropy_coeff``, ``loss_agg_mode: AggMode``, ``dp_size`` and the global
        counts); the enums of ``rlk_mm.ops.options`` or their string values.
    **knobs
        ``PolicyLossConfig``'s fields as keywords instead of ``config`` (not both).

    Returns
    -------
    PolicyLoss
        ``(loss, metrics)``: a float32 scalar, and 0-d float32 tensors named as verl names them:
        ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` (mask means), plus ``kl_loss``
        and ``entropy_loss`` when those inputs are given.

    Raises
    ------
    ValueError, TypeError
        For a bad argument or value, naming it, the sample and the position. The knobs are checked
        when the config is built, the values in one host sync per call: ``sample_index`` (order,
        range), the mask, ``old_log_probs``, ``advantages``, ``ref_log_probs`` and
        ``rollout_is_weights`` where the mask is set, and the global count the mode uses against the
        data (``batch_num_tokens`` at least the mask's sum, ``global_batch_size`` a whole number at
        least the sequences with a scored token, both before the ``dp_size`` factor).

    Notes
    -----
    The model's outputs are not checked: a non-finite ``log_probs`` or ``entropy`` value propagates to
    the loss where the mask is set (verl skips such steps by the gradient norm) and is ignored where
    it is not.
    """
    config = policy_loss_config(config, knobs, "policy_loss")
    readable_args("policy_loss", log_probs=log_probs)  # (the others must be on its device)
    policy = checked_policy(
        "log_probs", log_probs, old_log_probs, advantages, mask, sample_index=sample_index, num_samples=num_samples,
        rollout_is_weights=rollout_is_weights, ref_log_probs=ref_log_probs, entropy=entropy, config=config,
    )
    if policy.ratio is not RatioMode.TOKEN:
        policy.tensors[SEQ_LOG_RATIO] = seq_log_ratio(policy, log_probs, old_log_probs)
    partials = policy_loss_partials(
        log_probs.reshape(-1).contiguous(), None if entropy is None else entropy.reshape(-1).contiguous(),
        policy.tensors, policy.floats, policy.ints,
    )
    return policy.losses(partials)
