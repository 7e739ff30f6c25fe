"""TRL adapter: TRL's ``GRPOTrainer`` with rlk_mm's LM head and loss.

The switch: ``from rlk_mm.integrations.trl import GRPOTrainer`` in place of
``from trl import GRPOTrainer``, same arguments. For a ``GRPOTrainer`` subclass of your own,
put ``RLKGRPOMixin`` first: ``class MyTrainer(RLKGRPOMixin, MyGRPOTrainer)``.

What changes: TRL's fused LM head (``model(..., labels=..., fused_lm_head=True)``) becomes
``selected_logprob`` over the labelled rows only, i.e. the completion tokens (policy, reference
and old log-probs alike), and ``_compute_loss`` becomes rlk_mm's; generation, rewards and
advantages stay TRL's. The training loss runs, by default, in ``linear_policy_loss`` (the LM
head fused with the loss: three logits-sized products, the gradient formed in the forward)
wherever TRL's loss is expressible there: ``beta == 0`` and ``entropy_coef == 0`` unless
``loss_type="bnpo"`` (with old log-probs, or on-policy without them: ``num_iterations=1``). Elsewhere it runs ``grpo_loss`` on
``selected_logprob``'s log-probs (four products), and says why once. ``linear_loss=False``
keeps that path throughout.

``grpo_loss`` reproduces TRL 1.16's loss types (``LOSS_TYPES``) with TRL's semantics (no
log-ratio clamp, ``delta`` as the dual clip, TRL's k3 KL); the options refused at construction
are listed in ``docs/guides/trl.md``, among them a processor that pads on the right.

Importing this package imports neither TRL nor transformers: ``GRPOTrainer`` is built (and TRL
imported) on first access.

The package, one module a concept: ``config`` (``loss_config``, the one builder of TRL's loss
settings, and the checks of what rlk_mm reproduces), ``losses`` (``grpo_loss``,
``dapo_normalizer``), ``lm_head`` (rlk_mm's LM head in the policy), ``trainer``
(``RLKGRPOMixin``, ``GRPOTrainer``) and ``on_policy`` (``OnPolicyGRPOTrainer``: exactly on-policy
rollouts). Every name but ``on_policy``'s is served here.
"""

from __future__ import annotations

import importlib

from .config import LOSS_TYPES, loss_config
from .losses import dapo_normalizer, grpo_loss
from .trainer import RLKGRPOMixin

__all__ = ["dapo_normalizer", "grpo_loss", "GRPOTrainer", "loss_config", "LOSS_TYPES", "RLKGRPOMixin"]


def __getattr__(name: str):
    """``GRPOTrainer``: built on first access, so that importing this package does not import TRL."""
    if name == "GRPOTrainer":
        return getattr(importlib.import_module(f"{__name__}.trainer"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
