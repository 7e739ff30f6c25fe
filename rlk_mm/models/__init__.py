"""Model-specific runners and patches; ops never import a model.

``qwen2_5_vl``: Qwen2.5-VL on an RLBatch (layouts: ``padding=None`` packed or
``"left"``/``"right"``; forward, group scoring) and the module patches ``batch_invariant()``
applies to its classes. ``vision_cache``: ``VisionCache``, each unique media item through the
vision tower once. ``rollout``: ``generate_on_policy``, exactly on-policy rollouts (decode
under ``batch_invariant()``, log-probs bitwise those of the training forward).
"""

import warnings

from . import qwen2_5_vl, rollout, vision_cache
from .qwen2_5_vl import batch_logprobs, forward_hidden, group_logprobs, layout_inputs
from .rollout import Kernels, OnPolicyRollout, generate_on_policy
from .vision_cache import VisionCache

__all__ = [
    "Kernels", "OnPolicyRollout", "VisionCache", "batch_logprobs", "forward_hidden", "generate_on_policy",
    "group_logprobs", "layout_inputs", "qwen2_5_vl", "rollout", "vision_cache",
]


def __getattr__(name: str):
    if name == "Layout":  # deprecated: padding= and rlk_mm.schema.PaddingSide replace it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            layout = qwen2_5_vl.Layout
        warnings.warn("rlk_mm.models.Layout is deprecated and will be removed in the next release: pass padding=None "
                      "(packed), 'left' or 'right' (rlk_mm.schema.PaddingSide)", DeprecationWarning, stacklevel=2)
        return layout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
