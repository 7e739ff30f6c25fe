"""PPO-Lagrangian: a reward-cost objective without mixed signs, and its multiplier on the device.

Reward and cost are never added into one column: their group advantages are normalized
each on its own (``group_advantages`` on a ``[B, 2]`` tensor), then combined as

    A = (A_r - lam * A_c) / (1 + lam)

so a higher cost always lowers the advantage and the scale stays that of one normalized
advantage. ``lam`` >= 0 is a 0-d device tensor; ``Lagrangian.step`` moves it by a projected
dual step on the mean episode cost against the budget, ``lam <- clip(lam + lr * (mean cost -
budget), 0, max_lam)``, in place and with no host synchronization (safe-rlhf reads its
multiplier with ``.item()`` every step). Nothing here reads the device: the updates work
under ``torch.compile(fullgraph=True)``, in CUDA graphs and on the meta device. Values are
not checked for finiteness (that would read the device): a NaN cost makes ``lam`` NaN, and
the advantages NaN, which a loss then shows.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..schema import RLBatch
from ..schema.checks import FLOAT_DTYPES, float_arg, tensor_arg
from .options import Estimator
from .rewards import group_advantages, groups_of

__all__ = ["Lagrangian", "LagrangianAdvantages", "lagrangian_advantages"]


class LagrangianAdvantages(NamedTuple):
    """The combined advantage and its two separately normalized parts, each ``[B]``."""

    advantages: Tensor
    reward_advantages: Tensor
    cost_advantages: Tensor


class Lagrangian:
    """The multiplier ``value`` (0-d float32 tensor on ``device``) of a cost constraint
    ``E[episode cost] <= budget``, its dual step and the combined advantages.

    ``budget``: the allowed mean episode cost; ``lr``: the dual step size (> 0); ``init``:
    the starting multiplier (>= 0); ``max_value``: an upper bound (None: unbounded)."""

    def __init__(self, budget: float, *, lr: float = 0.05, init: float = 0.0, max_value: Optional[float] = None, device="cpu"):
        self.budget = float_arg("budget", budget)
        self.lr = float_arg("lr", lr, min=0.0, min_open=True)
        init = float_arg("init", init, min=0.0)
        self.max_value = None if max_value is None else float_arg("max_value", max_value, min=init)
        self.value = torch.tensor(init, dtype=torch.float32, device=device)

    def step(self, episode_costs: Tensor) -> Tensor:
        """One projected dual step on the mean of ``episode_costs`` (float ``[E]``, E >= 1, on
        ``value``'s device), in place: ``value`` grows while the cost is over budget and
        shrinks (to 0 at least) under it. Returns ``value``."""
        tensor_arg("episode_costs", episode_costs, ndim=1, dtypes=FLOAT_DTYPES, device=self.value.device)
        if episode_costs.shape[0] == 0:
            raise ValueError("episode_costs is empty: the dual step needs at least one episode's cost")
        violation = episode_costs.to(torch.float32).mean() - self.budget
        updated = (self.value + self.lr * violation).clamp(min=0.0, max=self.max_value)
        return self.value.copy_(updated)

    def advantages(self, rewards: Tensor, costs: Tensor, group_ids: Optional[Tensor] = None, *,
                   batch: Optional[RLBatch] = None, estimator: Estimator | str = Estimator.GRPO,
                   eps: float = 1e-6) -> LagrangianAdvantages:
        """``(A_r - lam * A_c) / (1 + lam)`` of per-sample ``rewards`` and ``costs`` (float ``[B]``)
        with group advantages of each normalized on its own (``group_advantages``; same
        groups (``group_ids`` or ``batch=``), ``estimator`` and ``eps``). ``rewards`` and
        ``costs`` must be separate tensors."""
        return lagrangian_advantages(rewards, costs, group_ids, self.value, batch=batch, estimator=estimator, eps=eps)


def lagrangian_advantages(rewards: Tensor, costs: Tensor, group_ids: Optional[Tensor] = None,
                          lam: Optional[Tensor] = None, *, batch: Optional[RLBatch] = None,
                          estimator: Estimator | str = Estimator.GRPO, eps: float = 1e-6) -> LagrangianAdvantages:
    """The PPO-Lagrangian advantages (see ``Lagrangian.advantages``) for a multiplier ``lam``
    (a 0-d float tensor on the scores' device, >= 0 by construction of ``Lagrangian``;
    required). The groups: ``group_ids`` or ``batch=``, as ``group_advantages`` takes them;
    ``estimator`` an ``Estimator`` or its string. Rewards and costs sharing memory are
    refused (under ``torch.compile`` only the same tensor twice)."""
    if lam is None:
        raise TypeError("lagrangian_advantages needs lam, the multiplier (a 0-d float tensor; Lagrangian.value)")
    tensor_arg("rewards", rewards, ndim=1, dtypes=FLOAT_DTYPES)
    tensor_arg("costs", costs, shape=tuple(rewards.shape), dtypes=FLOAT_DTYPES, device=rewards.device)
    tensor_arg("lam", lam, shape=(), dtypes=FLOAT_DTYPES, device=rewards.device)
    if rewards is costs or (not torch.compiler.is_compiling() and rewards.numel() and rewards.device.type != "meta"
                            and rewards.untyped_storage().data_ptr() == costs.untyped_storage().data_ptr()):
        raise ValueError("rewards and costs share memory: a cost must never enter a reward column; pass the batch's "
                         "rewards and costs as separate tensors")
    dtype = torch.promote_types(rewards.dtype, costs.dtype)
    group_ids = groups_of(group_ids, batch, rewards.device)
    both = group_advantages(torch.stack([rewards.to(dtype), costs.to(dtype)], 1), group_ids, estimator=estimator, eps=eps)
    a_r, a_c = both[:, 0], both[:, 1]
    lam = lam.to(dtype)
    return LagrangianAdvantages((a_r - lam * a_c) / (1 + lam), a_r, a_c)
