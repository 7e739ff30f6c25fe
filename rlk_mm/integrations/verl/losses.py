"""verl's policy losses, fused, with verl's policy-loss signature: ``compute_policy_loss``
(verl's ``vanilla`` PPO: dual clip, rollout importance weights, every ``loss_agg_mode``) and
``compute_policy_loss_gspo`` (verl's ``gspo``), registered under ``POLICY_LOSSES`` and selected
with ``actor_rollout_ref.actor.policy_loss.loss_mode=rlk_mm``.

Both run ``rlk_mm.ops.policy_loss`` under ``loss_config`` (``verl.config``) and report verl's
metrics; where verl's LM head already computed the whole actor loss for the micro-batch (the
fused path, ``verl.fused``), the vanilla loss hands verl that loss instead (``take_fused_loss``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...ops.loss.op import policy_loss
from ..args import padded_inputs
from .config import actor_config, clip_ratios, loss_config
from .fused_loss import take_fused_loss

__all__ = ["compute_policy_loss", "compute_policy_loss_gspo", "POLICY_LOSSES"]

#: the names the losses are registered under in verl: vanilla PPO, then GSPO
POLICY_LOSSES = ("rlk_mm", "rlk_mm_gspo")


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``compute_policy_loss_vanilla``, fused: same signature, loss, gradient and metrics.

    When verl's LM head already computed the loss for this micro-batch (``RLK_MM_VERL_FUSED=1`` with
    ``use_fused_kernels=True``: ``rlk_mm.integrations.verl.fused``), that loss is returned.

    Parameters
    ----------
    old_log_prob, log_prob, advantages, response_mask : Tensor
        ``[B, R]``, as verl passes them.
    loss_agg_mode : str
        verl's aggregation mode.
    config : ActorConfig or Mapping, optional
        verl's actor config (see ``loss_config``).
    rollout_is_weights : Tensor, optional
        ``[B, R]`` importance-sampling weights.

    Returns
    -------
    tuple
        ``(loss, metrics)``: the scalar loss and verl's metrics (``actor/pg_loss``, ``pg_clipfrac``,
        ``pg_clipfrac_lower``, ``ppo_kl``).

    Raises
    ------
    ValueError, TypeError
        For a bad argument or value, naming it (the checks of ``policy_loss``).
    """
    return _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                        gspo=False)


def compute_policy_loss_gspo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                             response_mask: torch.Tensor, loss_agg_mode: str = "seq-mean-token-mean", config=None,
                             rollout_is_weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``compute_policy_loss_gspo``, fused: sequence ratio (log clamped at 10), no dual clip.

    The arguments, the result and the errors are ``compute_policy_loss``'s (verl's policy-loss
    signature), but for ``loss_agg_mode``'s default, verl's GSPO default ``seq-mean-token-mean``.
    It never hands verl a loss computed in the LM head: a sequence ratio needs every token of the
    sequence before a gradient, so the fused path leaves ``loss_mode=rlk_mm_gspo`` to this function.
    """
    return _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                        gspo=True)


def _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, *,
                 gspo: bool):
    """Both losses: types and shapes checked under verl's names (``policy_loss`` checks the
    values), then the loss the LM head computed (vanilla only) or ``policy_loss``'s, with verl's metrics."""
    actor_config(config)
    padded_inputs({"log_prob": log_prob, "old_log_prob": old_log_prob, "advantages": advantages,
                   "rollout_is_weights": rollout_is_weights, "response_mask": response_mask}, mask="response_mask")
    clip_ratios(config)
    if not gspo:
        fused = take_fused_loss(log_prob, response_mask)
        if fused is not None:
            return fused[0], _metrics(fused[1])
    loss, metrics = policy_loss(log_prob, old_log_prob, advantages, response_mask,
                                rollout_is_weights=rollout_is_weights, config=loss_config(config, loss_agg_mode, gspo=gspo))
    return loss, _metrics(metrics)


def _metrics(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    names = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")
    values = torch.stack([metrics[k] for k in names]).tolist()  # one host read, as verl's three .item()
    return {f"actor/{k}": v for k, v in zip(names, values)}
