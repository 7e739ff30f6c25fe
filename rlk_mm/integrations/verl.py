"""verl 0.9.1 adapter: rlk_mm's fused policy loss and advantage estimators in verl's registries.

Registered names (importing this module registers them):

* policy losses: ``rlk_mm`` (verl's ``vanilla`` PPO: dual clip, rollout importance weights,
  every ``loss_agg_mode``) and ``rlk_mm_gspo`` (verl's ``gspo``), selected with
  ``actor_rollout_ref.actor.policy_loss.loss_mode=rlk_mm``;
* advantage estimators: ``rlk_mm_grpo`` (honours ``algorithm.norm_adv_by_std_in_grpo``;
  False = Dr.GRPO) and ``rlk_mm_rloo``, selected with ``algorithm.adv_estimator=rlk_mm_grpo``.

verl imports every ``verl.plugins`` entry point when ``verl`` is imported (in the driver
and in each Ray worker), unless ``VERL_USE_EXTERNAL_PLUGINS=none``. It only *imports*
the target — ``rlk_mm.integrations.verl:register`` — and hides plugin errors at debug
level, so this module registers on import and ``register()`` is idempotent; import this
module yourself to see any error. With ``RLK_MM_VERL_FUSED=1``, ``register()`` also calls
``rlk_mm.integrations.verl_fused.enable()`` (fused LM-head log-probs in verl's actor).
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import numpy as np
import torch

from verl.trainer.ppo import core_algos

from ..ops.loss import policy_loss
from ..ops.rewards import Estimator, group_advantages
from ..schema import dense_group_index

POLICY_LOSSES = ("rlk_mm", "rlk_mm_gspo")
ADV_ESTIMATORS = ("rlk_mm_grpo", "rlk_mm_rloo")


def _clip_ratios(config) -> tuple[float, float]:
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return low, high


def _metrics(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    names = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")
    values = torch.stack([metrics[k] for k in names]).tolist()  # one host read, as verl's three .item()
    return {f"actor/{k}": v for k, v in zip(names, values)}


def _global_batch_info(config) -> dict[str, Any]:
    info = dict(getattr(config, "global_batch_info", None) or {})
    return {k: info[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor") if info.get(k) is not None}


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``compute_policy_loss_vanilla``, fused: same signature, loss, gradient and metrics."""
    if config is None:
        raise ValueError("config (verl's ActorConfig) is required: it holds the clip ratios")
    low, high = _clip_ratios(config)
    clip_c = config.get("clip_ratio_c", 3.0)
    loss, metrics = policy_loss(
        log_prob, old_log_prob, advantages, response_mask,
        clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=clip_c,
        rollout_is_weights=rollout_is_weights, loss_agg_mode=loss_agg_mode, **_global_batch_info(config),
    )
    return loss, _metrics(metrics)


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``compute_policy_loss_gspo``, fused: sequence ratio (log clamped at 10), no dual clip."""
    if config is None:
        raise ValueError("config (verl's ActorConfig) is required: it holds the clip ratios")
    low, high = _clip_ratios(config)
    loss, metrics = policy_loss(
        log_prob, old_log_prob, advantages, response_mask,
        clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=None,
        ratio="gspo_token", log_ratio_clamp=(None, 10.0),
        rollout_is_weights=rollout_is_weights, loss_agg_mode=loss_agg_mode, **_global_batch_info(config),
    )
    return loss, _metrics(metrics)


def _group_index(index, device) -> torch.Tensor:
    """verl's ``uid`` array (strings or ints) -> int64 group numbers on ``device``."""
    return dense_group_index(np.asarray(index).reshape(-1).tolist()).to(device)


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GRPO (and Dr.GRPO with ``norm_adv_by_std_in_grpo=False`` or the config's flag),
    vectorized: returns (advantages, returns), both ``score_adv[:, None] * response_mask``."""
    if config is not None:
        norm_adv_by_std_in_grpo = config.get("norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = group_advantages(
            scores, _group_index(index, scores.device),
            estimator=Estimator.GRPO if norm_adv_by_std_in_grpo else Estimator.DR_GRPO, eps=epsilon,
        )
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's RLOO, vectorized: the score minus the mean of the group's other scores."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = group_advantages(scores, _group_index(index, scores.device), estimator=Estimator.RLOO, eps=epsilon)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def register() -> None:
    """Register the policy losses and advantage estimators with verl (idempotent)."""
    for name, loss in zip(POLICY_LOSSES, (compute_policy_loss, compute_policy_loss_gspo)):
        core_algos.register_policy_loss(name)(loss)
    for name, estimator in zip(ADV_ESTIMATORS, (compute_grpo_outcome_advantage, compute_rloo_outcome_advantage)):
        core_algos.register_adv_est(name)(estimator)
    importlib.import_module("rlk_mm.integrations.verl_fused").register()  # honours RLK_MM_VERL_FUSED


# ---------------------------------------------------------------------------------------------
# Fused LM-head path: ``FusedLinearForPPO``, ``enable`` and ``disable`` live in
# ``rlk_mm.integrations.verl_fused`` and are re-exported here, imported on first use.
_FUSED_EXPORTS = ("FusedLinearForPPO", "enable", "disable", "enabled", "scoring", "response_rows")


def __getattr__(name: str):
    if name in _FUSED_EXPORTS:
        return getattr(importlib.import_module("rlk_mm.integrations.verl_fused"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register()
