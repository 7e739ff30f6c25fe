"""Qwen3-VL and Qwen3-VL-MoE: the module patches ``batch_invariant()`` applies to their classes
(registered on import): the text RMSNorm (also the per-head q/k norms), vision attention,
the projections that share an input and, for MoE, the routed experts (``patches``: each
token's experts added in ascending expert order).

What the runners do for these families (``rlk_mm.models.forward``): the vision tower's DeepStack
features travel with its merged rows (``VisionCache`` and the rollout keep ``[R, 1 + k, H]``)
and are added to the visual tokens after the first ``k`` decoder layers, as the model's own
forward adds them. MoE routing is a per-token function of the token's hidden state (router
product, softmax, top-k), so under the mode a token's experts and its output do not depend
on the batch.

Its token layout and M-RoPE positions (interleaved sections, timestamped video held as one item
per temporal patch) are the batch's, built by the schema: ``rlk_mm.schema.layouts``
(``LayoutFamily.QWEN3_VL``) and ``rlk_mm.schema.mrope_positions``, checked against the model's own
``get_rope_index`` by ``tests/models/test_model_families.py``.
"""

from __future__ import annotations

from ..ops.invariant.mode import register_module_patches
from .patches import family_patches

__all__: list[str] = []


def _module_patches() -> list:
    dense = family_patches(
        "transformers.models.qwen3_vl.modeling_qwen3_vl", rms_norms=("Qwen3VLTextRMSNorm",),
        vision_attentions=("Qwen3VLVisionAttention",),
        shared_inputs=(("Qwen3VLTextAttention", ("q_proj", "k_proj", "v_proj"), "hidden_states"),
                       ("Qwen3VLTextMLP", ("gate_proj", "up_proj"), "x")))
    moe = family_patches(
        "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", rms_norms=("Qwen3VLMoeTextRMSNorm",),
        vision_attentions=("Qwen3VLMoeVisionAttention",), experts=("Qwen3VLMoeTextExperts",),
        shared_inputs=(("Qwen3VLMoeTextAttention", ("q_proj", "k_proj", "v_proj"), "hidden_states"),
                       ("Qwen3VLMoeTextMLP", ("gate_proj", "up_proj"), "x")))
    return dense + moe


register_module_patches(_module_patches)
