"""EasyR1's loss functions, fused, with the signatures of EasyR1's ``verl/trainer/core_algos.py``:
``compute_policy_loss`` (``default``, ``gspo`` and ``gspo_token``), ``compute_kl`` and
``average_loss``, each for the settings rlk_mm implements (``patch`` runs EasyR1's own for the
others); ``policy_metrics`` computes EasyR1's policy-loss metrics for them and for
``micro_batch_loss``.
"""

from __future__ import annotations

from typing import Literal

import torch

from ...ops import loss as _loss
from ...ops.loss.op import agg_loss, policy_loss
from ...ops.loss.terms import MEAN_EPS
from ...schema.checks import FLOAT_DTYPES, tensor_arg
from ..args import padded_inputs
from .config import KL_PENALTIES, LOSS_TYPES, avg_mode_arg, loss_config

__all__ = ["average_loss", "compute_kl", "compute_policy_loss"]


def average_loss(values: torch.Tensor, mask: torch.Tensor, mode: Literal["token", "seq"], eps: float = MEAN_EPS) -> torch.Tensor:
    """EasyR1's ``average_loss``: ``token`` = masked mean, ``seq`` = mean over rows of row masked means.

    A bad argument raises ValueError or TypeError naming it, as every function here does.

    Parameters
    ----------
    values, mask : Tensor
        ``[B, R]`` per-token values and the response mask.
    mode : {"token", "seq"}
    eps : float
        Added to the denominators, as EasyR1 does.

    Returns
    -------
    Tensor
    """
    padded_inputs({"values": values, "mask": mask}, mask="mask")
    mode = avg_mode_arg("mode", mode)
    if eps != MEAN_EPS:
        raise ValueError(f"eps={eps}: rlk_mm implements EasyR1's default eps {MEAN_EPS} only (patch() runs EasyR1's own for others)")
    return agg_loss(values, mask, mode)


def compute_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """EasyR1's ``compute_kl`` (``kl``, ``abs``, ``mse``, ``low_var_kl``), in float32.

    Parameters
    ----------
    log_probs, ref_log_probs : Tensor
    kl_penalty : str

    Returns
    -------
    Tensor
    """
    if kl_penalty not in KL_PENALTIES:
        raise ValueError(
            f"kl_penalty={kl_penalty!r}: expected one of {', '.join(KL_PENALTIES)} ('full' needs whole distributions, "
            "not the selected log-probs rlk_mm works on: patch() runs EasyR1's own compute_kl for it)"
        )
    for name, t in (("log_probs", log_probs), ("ref_log_probs", ref_log_probs)):
        tensor_arg(name, t, dtypes=FLOAT_DTYPES)
        if t.is_meta:
            raise ValueError(f"{name} is on the meta device (no values); pass it on the CPU or a GPU")
    return _loss.kl_penalty(log_probs.float(), ref_log_probs.float(), kl_penalty)


def compute_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.3,
    clip_ratio_dual: float = 3.0,
    tau_positive: float = 1.0,
    tau_negative: float = 1.05,
    loss_type: str = "default",
    loss_avg_mode: str = "token",
    **kwargs,
) -> tuple[torch.Tensor, dict[str, float]]:
    """EasyR1's ``compute_policy_loss`` for ``default``, ``gspo`` and ``gspo_token``, fused.

    Parameters
    ----------
    old_log_probs, log_probs, advantages, response_mask : Tensor
        ``[B, R]``, as EasyR1 passes them.
    clip_ratio_low, clip_ratio_high, clip_ratio_dual, loss_type, loss_avg_mode
        EasyR1's settings (see ``loss_config``).
    tau_positive, tau_negative, **kwargs
        ``sapo``'s (not fused), and what EasyR1 passes besides: ignored.

    Returns
    -------
    tuple
        ``(pg_loss, metrics)`` with EasyR1's metric names: ``ppo_kl``, ``entropy_loss`` (mean of
        -log-prob, an entropy estimate), ``pg_clipfrac_higher``, ``pg_clipfrac_lower`` (floats).

    Raises
    ------
    ValueError, TypeError
        For a bad argument, naming it.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"loss_type={loss_type!r}: rlk_mm fuses {', '.join(LOSS_TYPES)}; EasyR1's own "
            "compute_policy_loss serves cispo and sapo (patch() falls back to it)"
        )
    padded_inputs({"log_probs": log_probs, "old_log_probs": old_log_probs, "advantages": advantages,
                   "response_mask": response_mask}, mask="response_mask")
    config = loss_config(clip_ratio_low, clip_ratio_high, clip_ratio_dual, loss_type, loss_avg_mode)
    loss, fused = policy_loss(log_probs, old_log_probs, advantages, response_mask, config=config)
    return loss, policy_metrics(old_log_probs, log_probs, response_mask, config.loss_agg_mode, fused)


@torch.no_grad()
def policy_metrics(old_log_probs, log_probs, response_mask, loss_avg_mode, fused: dict) -> dict[str, float]:
    """EasyR1's ``compute_policy_loss`` metrics (floats) from padded log-probs and ``policy_loss``'s metrics."""
    mask = response_mask.to(torch.float32)
    count = mask.sum() + MEAN_EPS
    # policy_loss has checked the mask: a 0/1 integer mask as bool needs no second check (no more host syncs)
    metric_mask = response_mask if response_mask.is_floating_point() else response_mask.bool()
    ppo_kl = agg_loss(old_log_probs.float() - log_probs.float(), metric_mask, "token")
    entropy = agg_loss(-log_probs.float(), metric_mask, loss_avg_mode)
    entropy = entropy * mask.sum() / count  # EasyR1 takes the masked mean of this scalar
    values = torch.stack([ppo_kl, entropy, fused["pg_clipfrac"], fused["pg_clipfrac_lower"]]).tolist()
    names = ("ppo_kl", "entropy_loss", "pg_clipfrac_higher", "pg_clipfrac_lower")
    return dict(zip(names, values))
