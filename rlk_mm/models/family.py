"""The model families rlk_mm runs, and the one lookup from a model or processor to its family.

A family names the transformers model class(es) it serves, the token layout and position
rule its processor writes (``rlk_mm.schema.LayoutFamily``) and whether its vision tower feeds
DeepStack features into the first decoder layers. Every runner (``forward_hidden``,
``batch_logprobs``, ``group_logprobs``, ``decode_hidden``, ``generate_on_policy``,
``VisionCache``, the invariance sweep, the smoke test) asks ``model_family`` first: any other
model class is refused by name, and a batch or processor of another family is refused naming
both.

| family | model classes | layout | DeepStack |
|---|---|---|---|
| Qwen2-VL | ``Qwen2VLForConditionalGeneration`` | ``qwen2_vl`` | no |
| Qwen2.5-VL | ``Qwen2_5_VLForConditionalGeneration`` | ``qwen2_5_vl`` | no |
| Qwen3-VL | ``Qwen3VLForConditionalGeneration`` | ``qwen3_vl`` | yes |
| Qwen3-VL-MoE | ``Qwen3VLMoeForConditionalGeneration`` | ``qwen3_vl`` | yes |

Each family's batch-invariant module patches live in its own module (``qwen2_vl``,
``qwen2_5_vl``, ``qwen3_vl``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..schema import LayoutFamily, Modality, layout_family_of

__all__ = ["FAMILIES", "ModelFamily", "model_family"]


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its transformers class, token layout and vision-output shape."""

    name: str  # "qwen3_vl_moe"
    label: str  # "Qwen3-VL-MoE"
    module: str  # the transformers modeling module
    model_class: str  # the ...ForConditionalGeneration class the runners drive
    layout: LayoutFamily
    deepstack: bool  # the vision tower's DeepStack features are added after the first decoder layers
    #: a decode step can be captured in a CUDA graph (no host read inside it); routed experts read
    #: their token counts on the host, so a mixture-of-experts family decodes its static loop eagerly
    graph_capture: bool = True

    def deepstack_levels(self, model) -> int:
        """How many DeepStack feature levels the model's vision tower returns (0 without DeepStack)."""
        return len(model.config.vision_config.deepstack_visual_indexes) if self.deepstack else 0

    def vision_rows(self, model, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The vision tower's rows for ``pixels`` of the items ``grid_thw``: ``[R, H]``, or with
        DeepStack ``[R, 1 + k, H]`` (level 0 the merged rows that replace the placeholders,
        level ``i`` the features added after decoder layer ``i - 1``)."""
        visual = model.model.visual
        out = visual(pixels.type(visual.dtype), grid_thw=grid_thw)
        rows = out.pooler_output
        if not self.deepstack:
            return rows
        return torch.stack([rows, *out.deepstack_features], dim=1)


FAMILIES = (
    ModelFamily("qwen2_vl", "Qwen2-VL", "transformers.models.qwen2_vl.modeling_qwen2_vl",
                "Qwen2VLForConditionalGeneration", LayoutFamily.QWEN2_VL, deepstack=False),
    ModelFamily("qwen2_5_vl", "Qwen2.5-VL", "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                "Qwen2_5_VLForConditionalGeneration", LayoutFamily.QWEN2_5_VL, deepstack=False),
    ModelFamily("qwen3_vl", "Qwen3-VL", "transformers.models.qwen3_vl.modeling_qwen3_vl",
                "Qwen3VLForConditionalGeneration", LayoutFamily.QWEN3_VL, deepstack=True),
    ModelFamily("qwen3_vl_moe", "Qwen3-VL-MoE", "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
                "Qwen3VLMoeForConditionalGeneration", LayoutFamily.QWEN3_VL, deepstack=True, graph_capture=False),
)
_BY_CLASS = {(f.module, f.model_class): f for f in FAMILIES}
#: families of transformers models known not to run exactly here yet, and why
_NOT_YET = {
    "Qwen3_5ForConditionalGeneration": "Qwen3.5's Gated-DeltaNet layers have no batch-invariant kernels and no "
                                        "decode twin of their chunked forward yet",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3.5's Gated-DeltaNet layers have no batch-invariant kernels and no "
                                           "decode twin of their chunked forward yet",
}


def _supported() -> str:
    return ", ".join(f"{f.label} ({f.model_class})" for f in FAMILIES)


def model_family(model) -> ModelFamily:
    """The family of ``model`` (by its class hierarchy: a subclass resolves to its base), or
    ``TypeError`` naming its class and the supported families."""
    if isinstance(model, torch.nn.Module):
        for cls in type(model).__mro__:
            family = _BY_CLASS.get((cls.__module__, cls.__name__))
            if family is not None:
                return family
    name = type(model).__name__
    why = next((reason for cls in type(model).__mro__ if (reason := _NOT_YET.get(cls.__name__))), None)
    reason = f": {why}" if why else ""
    raise TypeError(f"model {name} is not a supported model family{reason}. rlk_mm runs {_supported()}; any other model "
                    "is refused rather than run approximately")


def check_batch_family(family: ModelFamily, batch) -> None:
    """A batch built for another family is refused naming both; so is a video batch that
    records no family (built from a bare tokenizer: its video layout cannot be checked)."""
    recorded = batch.layout_family
    if recorded is None:
        videos = batch.media_modality is not None and bool((batch.media_modality == int(Modality.VIDEO)).any())
        if videos:
            raise ValueError(f"batch records no layout_family (built from a tokenizer, not a processor) and holds videos, "
                             f"whose positions differ between model families: build it with the {family.label} "
                             "processor")
        return
    if recorded != family.layout.value:
        other = LayoutFamily(recorded)
        raise ValueError(f"batch was built by a {other.label} processor (layout_family {recorded!r}) but the model is "
                         f"{family.model_class} ({family.label}, layout {family.layout.value!r}): the two write other "
                         f"tokens or positions; build the batch with the {family.label} processor")


def check_processor_family(family: ModelFamily, processor) -> None:
    """A processor of another family than the model's is refused naming both."""
    layout = layout_family_of(processor)
    if layout is not None and layout is not family.layout:
        raise ValueError(f"processor {type(processor).__name__} is a {layout.label} processor but the model is "
                         f"{family.model_class} ({family.label}): pass the model's own processor")
