"""Qwen2.5-VL: the module patches ``batch_invariant()`` applies to its classes (registered on
import): its RMSNorm, vision attention (one segment attention over all windows) and the
projections that share an input (one launch in no-grad calls). The runners every family
shares live in ``rlk_mm.models.forward``; the family itself in ``rlk_mm.models.family``.
"""

from __future__ import annotations

from ..ops.invariant.mode import register_module_patches
from .patches import family_patches

__all__: list[str] = []


# --------------------------------------------------------------------------- batch-invariant module patches
def _module_patches() -> list:
    return family_patches(
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", rms_norms=("Qwen2_5_VLRMSNorm",),
        vision_attentions=("Qwen2_5_VLVisionAttention",),
        shared_inputs=(("Qwen2_5_VLAttention", ("q_proj", "k_proj", "v_proj"), "hidden_states"),
                       ("Qwen2MLP", ("gate_proj", "up_proj"), "x"), ("Qwen2_5_VLMLP", ("gate_proj", "up_proj"), "hidden_state")))


register_module_patches(_module_patches)
