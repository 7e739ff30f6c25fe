"""TRL ``GRPOTrainer``'s loss by TRL's names: ``grpo_loss`` (``_compute_loss`` without the entropy
bonus) on ``rlk_mm.ops.policy_loss``, with TRL's k3 KL and ``dapo``'s divisor
(``dapo_normalizer``); ``importance_ratio`` (TRL's ``coef_1``) and ``per_token_is_ratio`` (vLLM's
importance-sampling correction) also serve the trainer's fused path and its metrics.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...ops.loss.op import agg_loss, policy_loss
from ...schema.checks import FLOAT_DTYPES, INTEGER_DTYPES, bool_arg, float_arg, int_arg, tensor_arg
from .config import check_options, loss_config

__all__ = ["dapo_normalizer", "grpo_loss"]


def grpo_loss(
    per_token_logps: Tensor,
    old_per_token_logps: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: Optional[float] = None,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_per_token_logps: Optional[Tensor] = None,
    use_bias_correction_kl: bool = True,
    importance_sampling_ratio: Optional[Tensor] = None,
    max_completion_length: Optional[int] = None,
    num_items: Optional[float | Tensor] = None,
    gradient_accumulation_steps: int = 1,
) -> tuple[Tensor, dict[str, Optional[Tensor]]]:
    """TRL ``GRPOTrainer``'s loss (``_compute_loss`` without the entropy bonus), by TRL's names.

    Parameters
    ----------
    per_token_logps, old_per_token_logps, completion_mask : Tensor
        Padded ``[B, C]`` over the completions.
    advantages : Tensor
        ``[B, C]`` or ``[B]``.
    loss_type : str
        ``grpo`` (mean of per-sequence means), ``bnpo`` (token mean), ``dr_grpo`` (sum / (B *
        ``max_completion_length``)), ``dapo`` (sum / ``num_items``), ``luspo`` (mean of per-sequence
        sums); all but ``dapo`` are then divided by ``gradient_accumulation_steps``.
    epsilon_low, epsilon_high, delta : float
        The clip and the dual clip (None: off).
    importance_sampling_level : str
        ``token`` or ``sequence`` (GSPO).
    beta, ref_per_token_logps : float, Tensor
        The KL weight and the reference log-probs (needed when ``beta > 0``).
    use_bias_correction_kl : bool
        TRL's setting of that name.
    importance_sampling_ratio : Tensor, optional
        ``[B, C]`` or ``[B, 1]`` vLLM importance-sampling correction.
    max_completion_length, num_items : int, float or Tensor, optional
        ``dr_grpo``'s and ``dapo``'s divisors (see ``dapo_normalizer``).
    gradient_accumulation_steps : int

    Returns
    -------
    tuple
        ``(loss, stats)``: ``policy_loss`` (the loss before the accumulation division, detached),
        ``ratio`` (TRL's ``coef_1``, detached: ``[B, C]``, or ``[B, 1]`` at the sequence level) and
        ``kl`` (the per-token KL term, detached; None without ``beta``).

    Raises
    ------
    ValueError, TypeError
        For a bad argument, naming TRL's name for it.
    """
    C = tensor_arg("per_token_logps", per_token_logps, ndim=2, dtypes=FLOAT_DTYPES).shape[1]
    B = per_token_logps.shape[0]
    tensor_arg("old_per_token_logps", old_per_token_logps, shape=(B, C), dtypes=FLOAT_DTYPES)
    tensor_arg("completion_mask", completion_mask, shape=(B, C))
    tensor_arg("advantages", advantages, ndim=(1, 2), dtypes=FLOAT_DTYPES)
    if advantages.shape not in ((B,), (B, 1), (B, C)):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [B={B}] (one per completion) or [B, C={C}]")
    loss_type, level, low, high, delta, beta = check_options(
        loss_type, importance_sampling_level, epsilon_low, epsilon_high, delta, beta
    )
    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError(f"beta={beta} needs ref_per_token_logps (the reference model's log-probs); or set beta=0")
        tensor_arg("ref_per_token_logps", ref_per_token_logps, shape=(B, C), dtypes=FLOAT_DTYPES)
    use_bias_correction_kl = bool_arg("use_bias_correction_kl", use_bias_correction_kl)
    if importance_sampling_ratio is not None:
        importance_sampling_ratio = per_token_is_ratio(importance_sampling_ratio, B, C)
    gradient_accumulation_steps = int_arg("gradient_accumulation_steps", gradient_accumulation_steps, min=1)
    config = loss_config(loss_type, level, low, high, delta, num_completions=B,
                         max_completion_length=max_completion_length)
    normalizer = dapo_normalizer(num_items) if loss_type == "dapo" else None

    ratio = importance_ratio(per_token_logps, old_per_token_logps, completion_mask, level)
    loss, _ = policy_loss(
        per_token_logps, old_per_token_logps, advantages.reshape(B, -1).expand(B, C), completion_mask,
        rollout_is_weights=importance_sampling_ratio, config=config,
    )
    kl = None
    if beta != 0.0:
        # TRL's k3, unclamped: exp(ref - logp) - (ref - logp) - 1, times the ratio for the bias correction
        diff = ref_per_token_logps - per_token_logps
        kl = torch.exp(diff) - diff - 1.0
        if use_bias_correction_kl:
            kl = kl * ratio
        # policy_loss has checked the mask: a 0/1 integer mask as bool needs no second check (host read)
        kl_mask = completion_mask if completion_mask.is_floating_point() else completion_mask.bool()
        loss = loss + beta * agg_loss(kl, kl_mask, config.loss_agg_mode,
                                      global_batch_size=config.global_batch_size,
                                      loss_scale_factor=config.loss_scale_factor)
        kl = kl.detach()
    if normalizer is not None:
        loss = loss / normalizer
    stats = {"policy_loss": loss.detach(), "ratio": ratio.detach(), "kl": kl}
    if loss_type != "dapo":
        loss = loss / gradient_accumulation_steps
    return loss, stats


def dapo_normalizer(num_items) -> float | Tensor:
    """TRL's ``dapo`` divisor ``num_items``.

    ``num_items_in_batch`` clamped at 1, divided by the processes, rescaled to one accumulation window.

    Parameters
    ----------
    num_items : float or Tensor
        A number > 0 (checked), or a 0-d float tensor (not read on the host).

    Returns
    -------
    float or Tensor
        The divisor; a tensor is NaN where it is <= 0 or not finite, so the loss shows it.

    Raises
    ------
    ValueError, TypeError
        For a number that is not > 0, or another type.
    """
    if num_items is None:
        raise ValueError("loss_type='dapo' needs num_items (TRL's normalizer: the active tokens of the accumulation "
                         "window, num_items_in_batch clamped at 1, per process)")
    if not isinstance(num_items, Tensor):
        return float_arg("num_items", num_items, min=0.0, min_open=True)
    tensor_arg("num_items", num_items, ndim=0, dtypes=FLOAT_DTYPES + INTEGER_DTYPES)
    n = num_items.to(torch.float32)
    return torch.where((n > 0) & torch.isfinite(n), n, torch.full_like(n, float("nan")))


def per_token_is_ratio(ratio: Tensor, B: int, C: int) -> Tensor:
    """vLLM's importance-sampling ratio (per token ``[B, C]`` or per sequence ``[B, 1]``) as ``[B, C]``."""
    tensor_arg("importance_sampling_ratio", ratio, dtypes=FLOAT_DTYPES)
    if ratio.shape not in ((B, C), (B, 1)):
        raise ValueError(
            f"importance_sampling_ratio has shape {tuple(ratio.shape)}; expected [B={B}, C={C}] (per token) or "
            "[B, 1] (per sequence)"
        )
    return ratio.expand(B, C)


def importance_ratio(logps: Tensor, old: Tensor, mask: Tensor, level: str) -> Tensor:
    """TRL's ``coef_1``: exp of the log-ratio per token ``[B, C]``, or of its masked sequence mean ``[B, 1]``."""
    log_ratio = logps - old
    if level == "sequence":
        mask = mask.float()
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return torch.exp(log_ratio)
