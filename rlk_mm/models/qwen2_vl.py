"""Qwen2-VL: the module patches ``batch_invariant()`` applies to its classes (registered on
import): its RMSNorm, vision attention and the projections that share an input. The runners
every family shares live in ``rlk_mm.models.forward``; the family in ``rlk_mm.models.family``."""

from __future__ import annotations

from ..ops.invariant.mode import register_module_patches
from .patches import family_patches

__all__: list[str] = []


def _module_patches() -> list:
    return family_patches(
        "transformers.models.qwen2_vl.modeling_qwen2_vl", rms_norms=("Qwen2RMSNorm", "Qwen2VLRMSNorm"),
        vision_attentions=("VisionAttention",),
        shared_inputs=(("Qwen2VLAttention", ("q_proj", "k_proj", "v_proj"), "hidden_states"),
                       ("Qwen2MLP", ("gate_proj", "up_proj"), "x")))


register_module_patches(_module_patches)
