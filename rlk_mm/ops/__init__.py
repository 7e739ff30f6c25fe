"""rlk_mm operators. Each public op dispatches to a Triton kernel (CUDA) or torch.

Names are imported on first use so that ``import rlk_mm`` stays light (Triton and the
kernels load only when an op that needs them is called).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "selected_logprob": "logprob",
    "policy_loss": "loss",
    "kl_penalty": "loss",
    "agg_loss": "loss",
    "scatter_rewards": "rewards",
    "group_advantages": "rewards",
    "SpanReward": "rewards",
    "overlong_penalty": "rewards",
    "pack": "packing",
    "unpack": "packing",
    "PackedBatch": "packing",
    "pack_padded": "packing",
    "unpack_to_padded": "packing",
    "batch_invariant": "prefill",
    "batch_logprobs": "prefill",
    "forward_hidden": "prefill",
    "VisionCache": "cache",
    "group_logprobs": "cache",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlk_mm.ops' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
