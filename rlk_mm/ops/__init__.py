"""rlk_mm operators. Each public op checks its inputs, then runs a Triton kernel (CUDA) or torch.

Names are imported on first use so that ``import rlk_mm`` stays light (Triton and the
kernels load only when an op that needs them is called). Ops depend only on
``rlk_mm.schema``; model runners live in ``rlk_mm.models``. The option sets the ops take
(``AggMode``, ``KLType``, ``RatioMode``, ``Estimator``, ``RewardPlacement``, ``Backend``,
``PaddingSide``) live in ``rlk_mm.ops.options``; the policy loss's knobs are one
``PolicyLossConfig``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..deprecations import moved_name
from ..lazy import lazy_exports

if TYPE_CHECKING:  # what the lazy names below are, for IDEs and type checkers
    from ._backend import BackendUnavailableError  # noqa: F401
    from .invariant.mode import batch_invariant  # noqa: F401
    from .lagrangian import Lagrangian, LagrangianAdvantages, lagrangian_advantages  # noqa: F401
    from .logprob import selected_logprob  # noqa: F401
    from .loss import PolicyLoss, PolicyLossConfig, PolicyLossOutput, agg_loss, kl_penalty, linear_policy_loss, policy_loss  # noqa: F401
    from .options import AggMode, Backend, Estimator, KLType, PaddingSide, RatioMode, RewardPlacement  # noqa: F401
    from .packed_batch import PackedBatch, pack, unpack  # noqa: F401
    from .padded import pack_padded, unpack_to_padded  # noqa: F401
    from .rewards import SpanReward, group_advantages, overlong_penalty, scatter_rewards  # noqa: F401
    from .sampling import SampleResult, group_seeds, sample, sample_from_hidden  # noqa: F401

_EXPORTS = {
    "selected_logprob": "logprob",
    "policy_loss": "loss",
    "linear_policy_loss": "loss",
    "PolicyLossOutput": "loss",
    "kl_penalty": "loss",
    "PolicyLoss": "loss",
    "PolicyLossConfig": "loss",
    "agg_loss": "loss",
    "AggMode": "options",
    "KLType": "options",
    "RatioMode": "options",
    "Backend": "options",
    "BackendUnavailableError": "_backend",
    "scatter_rewards": "rewards",
    "group_advantages": "rewards",
    "SpanReward": "rewards",
    "overlong_penalty": "rewards",
    "Estimator": "options",
    "RewardPlacement": "options",
    "Lagrangian": "lagrangian",
    "LagrangianAdvantages": "lagrangian",
    "lagrangian_advantages": "lagrangian",
    "pack": "packed_batch",
    "unpack": "packed_batch",
    "PackedBatch": "packed_batch",
    "PaddingSide": "options",
    "pack_padded": "padded",
    "unpack_to_padded": "padded",
    "batch_invariant": "invariant.mode",
    "sample": "sampling",
    "sample_from_hidden": "sampling",
    "group_seeds": "sampling",
    "SampleResult": "sampling",
}

__all__ = sorted(_EXPORTS)


#: a name not served here may have moved (the model runners to rlk_mm.models): rlk_mm.deprecations says
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, missing=moved_name, listed=__all__)
