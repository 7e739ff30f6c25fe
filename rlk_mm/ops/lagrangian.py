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
therefore not refused but made loud: a non-finite mean episode cost (NaN, or ±inf, which the
clamp would otherwise turn into 0 or ``max_value``) makes ``lam`` NaN, and a multiplier that
is negative or not finite makes the combined advantages NaN, which a loss then shows.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np
import torch
from torch import Tensor

from ..schema import RLBatch
from ..schema.checks import FLOAT_DTYPES, device_arg, float_arg, tensor_arg
from .options import Estimator
from .rewards import group_advantages, groups_of

__all__ = ["Lagrangian", "LagrangianAdvantages", "lagrangian_advantages"]


class LagrangianAdvantages(NamedTuple):
    """The combined advantage and its two separately normalized parts.

    Attributes
    ----------
    advantages : Tensor
        ``(A_r - lam * A_c) / (1 + lam)``, ``[B]``.
    reward_advantages, cost_advantages : Tensor
        ``A_r`` and ``A_c``, each ``[B]``.
    """

    advantages: Tensor
    reward_advantages: Tensor
    cost_advantages: Tensor


class Lagrangian:
    """The multiplier of a cost constraint ``E[episode cost] <= budget``, its dual step and the advantages.

    Parameters
    ----------
    budget : float
        The allowed mean episode cost.
    lr : float
        The dual step size, > 0.
    init : float
        The starting multiplier, >= 0.
    max_value : float, optional
        An upper bound, > 0 and >= ``init`` (None or inf: unbounded).
    device : torch.device, str or int, optional
        Where ``value`` (a 0-d float32 tensor) lives.

    Raises
    ------
    ValueError, TypeError
        For a bad argument, naming it: values beyond float32's range (the multiplier's dtype), or a
        ``max_value`` of 0, which pins the multiplier at 0 (the cost would never count).
    """

    def __init__(self, budget: float, *, lr: float = 0.05, init: float = 0.0, max_value: Optional[float] = None, device="cpu"):
        self.budget = _f32("budget", float_arg("budget", budget))
        self.lr = _f32("lr", float_arg("lr", lr, min=0.0, min_open=True))
        init = _f32("init", float_arg("init", init, min=0.0))
        if max_value is not None:
            max_value = float_arg("max_value", max_value, min=init, finite=False)
            if max_value == 0.0:
                raise ValueError("max_value=0.0 pins the multiplier at 0, so the cost never enters the advantages: "
                                 "give a bound > 0, or None for no bound")
        self.max_value = None if max_value is None or math.isinf(max_value) else _f32("max_value", max_value)
        self.value = torch.tensor(init, dtype=torch.float32, device=device_arg(device))

    def step(self, episode_costs: Tensor) -> Tensor:
        """One projected dual step on the mean of ``episode_costs``, in place.

        Parameters
        ----------
        episode_costs : Tensor
            Float ``[E]``, E >= 1, on ``value``'s device; constants (no gradient flows to them).

        Returns
        -------
        Tensor
            ``value``: it grows while the cost is over budget and shrinks (to 0 at least) under it; it
            keeps no autograd graph. A non-finite mean cost makes it NaN.

        Raises
        ------
        ValueError, TypeError
            For costs of another shape, dtype or device.
        """
        tensor_arg("episode_costs", episode_costs, ndim=1, dtypes=FLOAT_DTYPES, device=self.value.device)
        if episode_costs.shape[0] == 0:
            raise ValueError("episode_costs is empty: the dual step needs at least one episode's cost")
        violation = episode_costs.detach().to(torch.float32).mean() - self.budget
        violation = torch.where(torch.isfinite(violation), violation, torch.full_like(violation, math.nan))
        updated = (self.value + self.lr * violation).clamp(min=0.0, max=self.max_value)
        return self.value.copy_(updated)

    def advantages(self, rewards: Tensor, costs: Tensor, group_ids: Optional[Tensor] = None, *,
                   batch: Optional[RLBatch] = None, estimator: Estimator | str = Estimator.GRPO,
                   eps: float = 1e-6) -> LagrangianAdvantages:
        """``(A_r - lam * A_c) / (1 + lam)``, each part a group advantage normalized on its own.

        The arguments are ``lagrangian_advantages``'s, with ``lam`` this multiplier's current
        value; the result is its ``LagrangianAdvantages``.
        """
        return lagrangian_advantages(rewards, costs, group_ids, self.value, batch=batch, estimator=estimator, eps=eps)


def lagrangian_advantages(rewards: Tensor, costs: Tensor, group_ids: Optional[Tensor] = None,
                          lam: Optional[Tensor] = None, *, batch: Optional[RLBatch] = None,
                          estimator: Estimator | str = Estimator.GRPO, eps: float = 1e-6) -> LagrangianAdvantages:
    """The PPO-Lagrangian advantages (see ``Lagrangian.advantages``) for a multiplier ``lam``.

    Parameters
    ----------
    rewards, costs : Tensor
        Per-sample float ``[B]``. Elements that share memory are refused (disjoint views of one
        tensor, such as the two columns of a ``[B, 2]`` scores tensor, are fine; under
        ``torch.compile`` only the same tensor twice is refused).
    group_ids : Tensor, optional
        The groups, as ``group_advantages`` takes them.
    lam : Tensor
        A 0-d float tensor on the scores' device, >= 0 by construction of ``Lagrangian``; required.
    batch : RLBatch, optional
        Instead of ``group_ids``.
    estimator : Estimator or str
        As ``group_advantages``'s.
    eps : float
        As ``group_advantages``'s.

    Returns
    -------
    LagrangianAdvantages

    Raises
    ------
    ValueError, TypeError
        For bad arguments, a missing ``lam``, or rewards and costs that share memory.

    Notes
    -----
    The value of ``lam`` is not read on the host: a negative or non-finite ``lam`` (which would let a
    cost raise the advantage, or divide by 0) gives NaN ``advantages``; the two parts are returned as
    they are.
    """
    if lam is None:
        raise TypeError("lagrangian_advantages needs lam, the multiplier (a 0-d float tensor; Lagrangian.value)")
    tensor_arg("rewards", rewards, ndim=1, dtypes=FLOAT_DTYPES)
    tensor_arg("costs", costs, shape=tuple(rewards.shape), dtypes=FLOAT_DTYPES, device=rewards.device)
    tensor_arg("lam", lam, shape=(), dtypes=FLOAT_DTYPES, device=rewards.device)
    if rewards is costs or (not torch.compiler.is_compiling() and rewards.device.type != "meta"
                            and _elements_overlap(rewards, costs)):
        raise ValueError("rewards and costs share memory: a cost must never enter a reward column; pass the batch's "
                         "rewards and costs as separate tensors")
    dtype = torch.promote_types(rewards.dtype, costs.dtype)
    group_ids = groups_of(group_ids, batch, rewards.device)
    both = group_advantages(torch.stack([rewards.to(dtype), costs.to(dtype)], 1), group_ids, estimator=estimator, eps=eps)
    a_r, a_c = both[:, 0], both[:, 1]
    lam = lam.to(dtype)
    combined = torch.where(lam >= 0, (a_r - lam * a_c) / (1 + lam), torch.full_like(a_r, math.nan))
    return LagrangianAdvantages(combined, a_r, a_c)


def _f32(name: str, value: float) -> float:
    """``value`` (a finite float), refused by ``name`` beyond float32's range: the multiplier and
    its step are float32, where it would be inf."""
    if abs(value) > torch.finfo(torch.float32).max:
        raise ValueError(f"{name}={value} is out of range: the multiplier is float32, so |{name}| must be <= "
                         f"{torch.finfo(torch.float32).max:.7g}")
    return value


def _elements_overlap(a: Tensor, b: Tensor) -> bool:
    """Whether an element of the 1-D tensor ``a`` shares a byte with one of ``b`` (from their
    strides on the host: no device read)."""
    if not (a.numel() and b.numel()) or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    starts = [t.data_ptr() + np.arange(t.numel(), dtype=np.int64) * t.stride(0) * t.element_size() for t in (a, b)]
    (sa, ea), (sb, eb) = ((s, t.element_size()) for s, t in zip(starts, (a, b)))
    sb = np.sort(sb)
    # for each element of a, the first element of b that ends after it starts: overlap if it starts before a's end
    j = np.searchsorted(sb, sa - eb, side="right")
    inside = j < sb.size
    return bool(np.any(sb[np.minimum(j, sb.size - 1)][inside] < (sa + ea)[inside]))
