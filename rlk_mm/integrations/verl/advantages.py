"""verl's outcome advantage estimators, vectorized: ``compute_grpo_outcome_advantage`` (GRPO,
and Dr.GRPO with ``algorithm.norm_adv_by_std_in_grpo=False``) and
``compute_rloo_outcome_advantage``, with verl's estimator signatures, registered under
``ADV_ESTIMATORS`` and selected with ``algorithm.adv_estimator=rlk_mm_grpo``.

A sample's score is the sum of its token-level rewards; ``rlk_mm.ops.group_advantages`` turns
the scores of each group (verl's ``uid``) into advantages in one pass over the batch, where
verl's own estimators loop over the groups in Python.
"""

from __future__ import annotations

import numpy as np
import torch

from ...ops.options import Estimator
from ...ops.rewards import group_advantages
from ...schema import dense_group_index
from ...schema.checks import bool_arg, float_arg
from ..args import outcome_inputs

__all__ = ["ADV_ESTIMATORS", "compute_grpo_outcome_advantage", "compute_rloo_outcome_advantage"]

#: the names the estimators are registered under in verl: GRPO, then RLOO
ADV_ESTIMATORS = ("rlk_mm_grpo", "rlk_mm_rloo")


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


def compute_rloo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray,
                                   epsilon: float = 1e-6, config=None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's RLOO, vectorized: the score minus the mean of the group's other scores.

    The arguments, the result and the errors are ``compute_grpo_outcome_advantage``'s (verl's
    outcome-estimator signature), without ``norm_adv_by_std_in_grpo``; ``epsilon`` is unused, as
    in verl's own RLOO.
    """
    return _outcome_advantage(token_level_rewards, response_mask, index, Estimator.RLOO, epsilon)
