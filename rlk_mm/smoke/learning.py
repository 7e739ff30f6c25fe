"""The learning check: the first update must raise the log-probs of above-average answers,
and a long colour run must climb from chance to a high reward."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from ..counts import plural
from ..schema import RLBatch
from .tasks import Task

__all__: list[str] = []

LEARNING_MIN_STEPS = 100
"""Runs at least this long must show learning: start <= `LEARNING_MAX_START`, last 10
steps >= `LEARNING_MIN_FINAL` (colour task only)."""
LEARNING_MAX_START = 0.4
LEARNING_MIN_FINAL = 0.8
LEARNING_WINDOW = 10


def update_direction(tb: RLBatch, before: Tensor, after: Tensor) -> Optional[float]:
    """Mean over loss tokens of (reward - group mean reward) x (logp after - before): > 0
    when the update made above-average answers more likely. Plain torch from the rewards,
    independent of the advantage and loss code it checks. None without reward spread."""
    r = tb.rewards.double()
    g = tb.group_index()
    mean = torch.zeros(int(g.max()) + 1, dtype=torch.float64).index_add_(0, g, r) / torch.bincount(g).double()
    centred = (r - mean[g])[tb.loss_token_sample()]
    if not bool((centred != 0).any()):
        return None
    return float((centred * (after.double() - before.double())).mean())


def learning_check(task: Task, args, steps: list[dict], direction: Optional[float]) -> dict:
    """The update direction at step 1 (always, when rewards differ within a group), and
    the reward thresholds for colour runs of at least `LEARNING_MIN_STEPS` steps."""
    checks, ok = [], True
    if direction is None:
        checks.append("first-update direction: n/a (no reward spread within any group)")
    else:
        good = direction > 0
        ok &= good
        checks.append(f"first update {'raised' if good else 'LOWERED'} the log-probs of above-average answers "
                      f"(mean centred-reward x Δlogp = {direction:+.2e})")
    result = dict(direction=direction)
    if task.name == "colour" and len(steps) >= LEARNING_MIN_STEPS:
        start = steps[0]["reward_mean"]
        final = float(np.mean([s["reward_mean"] for s in steps[-LEARNING_WINDOW:]]))
        good = start <= LEARNING_MAX_START and final >= LEARNING_MIN_FINAL
        ok &= good
        checks.append(f"reward {start:.3f} at step 1 (need <= {LEARNING_MAX_START}) -> {final:.3f} over the last "
                      f"{plural(LEARNING_WINDOW, 'step')} (need >= {LEARNING_MIN_FINAL})")
        result.update(start_reward=start, final_reward=final)
    elif steps:
        checks.append(f"reward thresholds not applied ({task.name} task, {plural(len(steps), 'step')}; they need the colour task and "
                      f">= {LEARNING_MIN_STEPS} steps)")
    result.update(ok=ok, detail="; ".join(checks) + (" -> OK" if ok else " -> FAILED"))
    return result
