"""Model families and their runners; ops never import a model.

``family``: the supported families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) and the one
lookup from a model or processor to its family; any other model is refused by name.
``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``: each family's batch-invariant module patches
(registered on import; ``patches`` holds the shared ones). ``forward``: the runners every family
shares on an RLBatch (layouts: ``padding=None`` packed or ``"left"``/``"right"``; forward,
DeepStack features, group scoring). ``vision_cache``: ``VisionCache``, each unique media item
through the vision tower once. ``decode``: the KV-cache prefill and ``decode_hidden``.
``rollout``: ``generate_on_policy``, exactly on-policy rollouts (decode under
``batch_invariant()``, log-probs bitwise those of the training forward); ``static_decode``: its
fast loop (a static KV cache, one CUDA graph per step on CUDA).
"""

from . import decode, family, forward, qwen2_5_vl, qwen2_vl, qwen3_vl, rollout, static_decode, vision_cache
from .family import FAMILIES, ModelFamily, model_family
from .forward import batch_logprobs, forward_hidden, group_logprobs, layout_inputs
from .rollout import DecodeLoop, Kernels, OnPolicyRollout, generate_on_policy
from .vision_cache import VisionCache

__all__ = [
    "FAMILIES", "DecodeLoop", "Kernels", "ModelFamily", "OnPolicyRollout", "VisionCache", "batch_logprobs", "decode",
    "family", "forward", "forward_hidden", "generate_on_policy", "group_logprobs", "layout_inputs", "model_family",
    "qwen2_5_vl", "qwen2_vl", "qwen3_vl", "rollout", "static_decode", "vision_cache",
]

