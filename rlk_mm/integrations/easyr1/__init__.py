"""EasyR1 adapter: drop-in functions with the signatures of EasyR1's ``verl/trainer/core_algos.py``.

EasyR1 (hiyouga/EasyR1) is not on PyPI; these follow its semantics (checked against its own
functions by ``tests/integrations/frameworks/easyr1_equivalence.py`` where its source is at hand):
PPO clipping in log space with ``clip_ratio_high`` 0.3 by default (DAPO's clip-higher),
the ratio's log clamped to ±20 before ``exp``, dual clip for negative advantages,
``loss_avg_mode`` ``token`` (masked mean over the batch) or ``seq`` (mean of per-sequence
means), metrics as floats, and GRPO / RLOO that need at least two samples per group.
Clipping ``exp(clamp(log r, log(1 - lo), log(1 + hi)))`` equals ``clamp(r, 1 - lo, 1 + hi)``
up to one rounding of ``exp`` at the band edges; rlk_mm's fused kernel uses the latter.
``patch()`` swaps them into an installed EasyR1 (``examples/easyr1_swap.py``);
``micro_batch_loss`` fuses the LM head with the loss in an actor's own loop (not patched in).

This package imports neither EasyR1 nor transformers: ``pip install rlk-mm`` sits beside
EasyR1's transformers 4.5x.

The package, one module a concept: ``config`` (``loss_config``, the one builder of EasyR1's loss
settings, and what rlk_mm implements of them), ``losses`` (``compute_policy_loss``,
``compute_kl``, ``average_loss``), ``advantages`` (GRPO and RLOO), ``actor``
(``micro_batch_loss``: the LM head fused with the loss) and ``patching`` (``patch``,
``runtime_env_hook``: swapping them into EasyR1). Every name is served here.
"""

from __future__ import annotations

from .actor import micro_batch_loss
from .advantages import ADVANTAGES, compute_grpo_outcome_advantage, compute_rloo_outcome_advantage
from .config import LOSS_TYPES, loss_config
from .losses import average_loss, compute_kl, compute_policy_loss
from .patching import SETUP_HOOK, SUPPORTED, patch, runtime_env_hook

__all__ = [
    "ADVANTAGES", "average_loss", "compute_grpo_outcome_advantage", "compute_kl", "compute_policy_loss",
    "compute_rloo_outcome_advantage", "loss_config", "LOSS_TYPES", "micro_batch_loss", "patch", "runtime_env_hook",
    "SETUP_HOOK", "SUPPORTED",
]
