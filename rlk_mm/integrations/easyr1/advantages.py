"""EasyR1's outcome advantage estimators, vectorized, with its signatures: GRPO
(``compute_grpo_outcome_advantage``) and RLOO (``compute_rloo_outcome_advantage``), by EasyR1's
names in ``ADVANTAGES``. A sample's score is the sum of its token-level rewards; every group
(EasyR1's ``index``) needs two samples or more, as EasyR1's own estimators do.
"""

from __future__ import annotations

import torch

from ...ops.rewards import group_advantages
from ...schema import dense_group_index
from ...schema.checks import float_arg
from ..args import outcome_inputs

__all__ = ["ADVANTAGES", "compute_grpo_outcome_advantage", "compute_rloo_outcome_advantage"]


def _groups(ids: list, estimator: str) -> torch.Tensor:
    """EasyR1 group ids -> dense int64 group numbers; every group needs two samples or more."""
    groups = dense_group_index(ids)
    single = torch.nonzero(torch.bincount(groups) < 2).flatten()
    if single.numel():
        sample = int(torch.nonzero(groups == single[0])[0])
        raise ValueError(
            f"{estimator}: group {ids[sample]!r} (sample {sample}) has a single response; "
            f"{estimator} needs rollout.n > 1"
        )
    return groups


def _outcome_advantage(token_level_rewards, response_mask, index, estimator, eps):
    ids = outcome_inputs(token_level_rewards, response_mask, index)
    eps = float_arg("eps", eps, min=0.0, min_open=True)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        groups = _groups(ids, estimator.upper()).to(scores.device)
        adv = group_advantages(scores, groups, estimator=estimator, eps=eps)
        returns = adv.unsqueeze(-1) * response_mask
    return returns, returns


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, eps: float = 1e-6, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """EasyR1's GRPO: (s - mean_g) / (std_g + eps) on every response token.

    Parameters
    ----------
    token_level_rewards, response_mask : Tensor
        ``[B, R]``; a sample's score is its rewards' sum.
    index : array-like
        Each sample's group id.
    eps, **kwargs
        Added to the std; the rest is ignored.

    Returns
    -------
    tuple of Tensor
        ``(advantages, returns)``.
    """
    return _outcome_advantage(token_level_rewards, response_mask, index, "grpo", eps)


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """EasyR1's RLOO: the score minus the mean of the group's other scores.

    Parameters
    ----------
    token_level_rewards, response_mask : Tensor
        ``[B, R]``; a sample's score is its rewards' sum.
    index, **kwargs
        Each sample's group id; the rest is ignored.

    Returns
    -------
    tuple of Tensor
        ``(advantages, returns)``.
    """
    return _outcome_advantage(token_level_rewards, response_mask, index, "rloo", 1e-6)


ADVANTAGES = {"grpo": compute_grpo_outcome_advantage, "rloo": compute_rloo_outcome_advantage}
