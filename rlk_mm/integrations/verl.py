"""verl 0.9.1 adapter: rlk_mm's fused policy loss and advantage estimators in verl's registries.

Registered names (importing this module registers them):

* policy losses: ``rlk_mm`` (verl's ``vanilla`` PPO: dual clip, rollout importance weights,
  every ``loss_agg_mode``) and ``rlk_mm_gspo`` (verl's ``gspo``), selected with
  ``actor_rollout_ref.actor.policy_loss.loss_mode=rlk_mm``;
* advantage estimators: ``rlk_mm_grpo`` (honours ``algorithm.norm_adv_by_std_in_grpo``;
  False = Dr.GRPO) and ``rlk_mm_rloo``, selected with ``algorithm.adv_estimator=rlk_mm_grpo``.

verl imports every ``verl.plugins`` entry point when ``verl`` is imported (in the driver
and in each Ray worker), unless ``VERL_USE_EXTERNAL_PLUGINS=none``. It only *imports*
the target — ``rlk_mm.integrations.verl:register`` — and logs plugin errors at debug
level only, so this module registers on import and turns any error there into a warning;
``register()`` is idempotent and tolerates a re-import of this module (call it to see the
traceback). With ``RLK_MM_VERL_FUSED=1``, ``register()`` also calls
``rlk_mm.integrations.verl_fused.enable()``: fused LM-head log-probs in verl's actor and,
for ``loss_mode=rlk_mm``, the whole actor loss in the LM head (three products).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Optional

import numpy as np
import torch

from ..ops.loss.config import PolicyLossConfig
from ..ops.loss.op import policy_loss
from ..ops.options import Estimator, RatioMode
from ..ops.rewards import group_advantages
from ..schema import dense_group_index
from ..schema.checks import bool_arg, float_arg
from ._args import actor_config, clip_ratios, outcome_inputs, padded_inputs, setting

__all__ = [
    "ADV_ESTIMATORS", "compute_grpo_outcome_advantage", "compute_policy_loss", "compute_policy_loss_gspo",
    "compute_rloo_outcome_advantage", "disable", "enable", "enabled", "FusedLinearForPPO", "loss_config",
    "POLICY_LOSSES", "register", "response_rows", "scoring",
]

POLICY_LOSSES = ("rlk_mm", "rlk_mm_gspo")
ADV_ESTIMATORS = ("rlk_mm_grpo", "rlk_mm_rloo")


def loss_config(config, loss_agg_mode: str, *, gspo: bool = False) -> PolicyLossConfig:
    """The ``PolicyLossConfig`` of verl's actor config for ``loss_agg_mode``.

    Parameters
    ----------
    config : ActorConfig or Mapping
        verl's actor config (its clip ratios, dual clip and ``global_batch_info``), or a mapping of
        those fields.
    loss_agg_mode : str
        verl's ``loss_agg_mode``.
    gspo : bool
        verl's ``gspo`` (sequence ratio, log-ratio clamped at 10, no dual clip) instead of its
        vanilla PPO loss.

    Returns
    -------
    PolicyLossConfig
        The global counts are checked against each micro-batch by ``policy_loss``: at least what the
        micro-batch shows.

    Raises
    ------
    ValueError, TypeError
        For a missing or bad field, naming it.
    """
    low, high = clip_ratios(config)
    if gspo:
        ratio = dict(clip_ratio_c=None, ratio=RatioMode.GSPO_TOKEN, log_ratio_clamp=(None, 10.0))
    else:
        ratio = dict(clip_ratio_c=setting(config, "clip_ratio_c", 3.0))
    return PolicyLossConfig(clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode=loss_agg_mode, **ratio,
                            **_global_batch_info(config))


def _policy_loss_inputs(old_log_prob, log_prob, advantages, response_mask, config, rollout_is_weights):
    """Checks types and shapes under verl's names (``policy_loss`` checks the values)."""
    actor_config(config)
    padded_inputs({"log_prob": log_prob, "old_log_prob": old_log_prob, "advantages": advantages,
                   "rollout_is_weights": rollout_is_weights, "response_mask": response_mask}, mask="response_mask")
    clip_ratios(config)


def _metrics(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    names = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")
    values = torch.stack([metrics[k] for k in names]).tolist()  # one host read, as verl's three .item()
    return {f"actor/{k}": v for k, v in zip(names, values)}


def _global_batch_info(config) -> dict[str, Any]:
    info = dict(setting(config, "global_batch_info") or {})
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
    """verl's ``compute_policy_loss_vanilla``, fused: same signature, loss, gradient and metrics.

    When verl's LM head already computed the loss for this micro-batch (``RLK_MM_VERL_FUSED=1`` with
    ``use_fused_kernels=True``: ``rlk_mm.integrations.verl_fused``), that loss is returned.

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
    _policy_loss_inputs(old_log_prob, log_prob, advantages, response_mask, config, rollout_is_weights)
    from . import verl_fused

    fused = verl_fused.take_fused_loss(log_prob, response_mask)
    if fused is not None:
        return fused[0], _metrics(fused[1])
    loss, metrics = policy_loss(log_prob, old_log_prob, advantages, response_mask,
                                rollout_is_weights=rollout_is_weights, config=loss_config(config, loss_agg_mode))
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
    """verl's ``compute_policy_loss_gspo``, fused: sequence ratio (log clamped at 10), no dual clip.

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
        ``(loss, metrics)``, as ``compute_policy_loss``.

    Raises
    ------
    ValueError, TypeError
        For a bad argument or value, naming it (the checks of ``policy_loss``).
    """
    _policy_loss_inputs(old_log_prob, log_prob, advantages, response_mask, config, rollout_is_weights)
    knobs = loss_config(config, loss_agg_mode, gspo=True)
    loss, metrics = policy_loss(log_prob, old_log_prob, advantages, response_mask,
                                rollout_is_weights=rollout_is_weights, config=knobs)
    return loss, _metrics(metrics)


def _outcome_advantage(token_level_rewards, response_mask, index, estimator, epsilon):
    """(advantages, returns) of verl's outcome estimators: ``score_adv[:, None] * response_mask``."""
    groups = dense_group_index(outcome_inputs(token_level_rewards, response_mask, index))
    epsilon = float_arg("epsilon", epsilon, min=0.0, min_open=True)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = group_advantages(scores, groups.to(scores.device), estimator=estimator, eps=epsilon)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GRPO (and Dr.GRPO), vectorized.

    Parameters
    ----------
    token_level_rewards, response_mask : Tensor
        ``[B, R]``; a sample's score is its rewards' sum.
    index : numpy.ndarray
        verl's ``uid`` of each sample: its group.
    epsilon : float
        GRPO's ``eps``.
    norm_adv_by_std_in_grpo : bool
        False (or the config's flag): Dr.GRPO, no division by the std.
    config : AlgoConfig, optional
        verl's algorithm config.
    **kwargs
        Ignored, as verl's estimators take them.

    Returns
    -------
    tuple of Tensor
        ``(advantages, returns)``, both ``score_adv[:, None] * response_mask``.

    Raises
    ------
    ValueError, TypeError
        For inputs of mismatched shapes or a bad ``epsilon``.
    """
    if config is not None:
        norm_adv_by_std_in_grpo = config.get("norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)
    norm = bool_arg("norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)
    estimator = Estimator.GRPO if norm else Estimator.DR_GRPO
    return _outcome_advantage(token_level_rewards, response_mask, index, estimator, epsilon)


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's RLOO, vectorized: the score minus the mean of the group's other scores.

    Parameters
    ----------
    token_level_rewards, response_mask : Tensor
        ``[B, R]``; a sample's score is its rewards' sum.
    index : numpy.ndarray
        verl's ``uid`` of each sample: its group.
    epsilon : float
        Unused by RLOO; verl's signature.
    config : AlgoConfig, optional
        verl's algorithm config.
    **kwargs
        Ignored, as verl's estimators take them.

    Returns
    -------
    tuple of Tensor
        ``(advantages, returns)``.

    Raises
    ------
    ValueError, TypeError
        For inputs of mismatched shapes.
    """
    return _outcome_advantage(token_level_rewards, response_mask, index, Estimator.RLOO, epsilon)


def register() -> None:
    """Register the policy losses and advantage estimators with verl.

    Idempotent: replaces what an earlier import of this module registered.

    Raises
    ------
    ValueError
        verl's, when one of the names is already taken by someone else's estimator.
    """
    from verl.trainer.ppo import core_algos

    for name, loss in zip(POLICY_LOSSES, (compute_policy_loss, compute_policy_loss_gspo)):
        core_algos.register_policy_loss(name)(loss)
    for name, estimator in zip(ADV_ESTIMATORS, (compute_grpo_outcome_advantage, compute_rloo_outcome_advantage)):
        if getattr(core_algos.ADV_ESTIMATOR_REGISTRY.get(name), "__module__", None) == __name__:
            del core_algos.ADV_ESTIMATOR_REGISTRY[name]  # ours, from an earlier import of this module
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


def _register_on_import() -> None:
    """Register, turning an error into a warning: verl's plugin loader would log it at debug level only."""
    try:
        register()
    except Exception as error:
        warnings.warn(
            f"rlk_mm's verl plugin did not register ({type(error).__name__}: {error}); verl runs without rlk_mm. "
            "Call rlk_mm.integrations.verl.register() to see the traceback",
            RuntimeWarning, stacklevel=2,
        )


_register_on_import()
