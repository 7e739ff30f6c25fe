"""``LayoutFamily``: which Qwen-VL generation's token layout and position rule a batch follows.

Three generations of processors write media differently, and each model computes M-RoPE
positions its own way:

- ``qwen2_vl``: one placeholder run per image or video; a video's temporal index is its
  frame index (one per temporal patch).
- ``qwen2_5_vl``: the same layout; a video's temporal index is scaled by
  ``tokens_per_second * second_per_grid`` (``vision_config.tokens_per_second``, 2 in the
  released checkpoints).
- ``qwen3_vl`` (Qwen3-VL and Qwen3-VL-MoE): images as before; a video is written per
  temporal patch, ``<t seconds>`` text, its own ``<|vision_start|>``, its placeholders and
  ``<|vision_end|>`` (time lives in the timestamp text). The batch holds each temporal
  patch as one media item of grid ``(1, h, w)``, which is how the model's own
  ``get_rope_index`` splits ``video_grid_thw``; the vision tower attends within a temporal
  patch only, so its rows are the same either way.

The family is read from the processor's class hierarchy (the transformers processor class
it derives from), never guessed from a class name, and recorded in the batch
(``RLBatch.layout_family``) and its fingerprint so that a model of another family refuses it.
"""

from __future__ import annotations

from typing import Any, Optional

from .choice import Choice

__all__ = ["LayoutFamily", "layout_family_of"]


class LayoutFamily(Choice):
    """A Qwen-VL generation's token layout and position rule."""

    QWEN2_VL = "qwen2_vl"
    QWEN2_5_VL = "qwen2_5_vl"
    QWEN3_VL = "qwen3_vl"

    @property
    def label(self) -> str:
        return {"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL"}[self.value]

    @property
    def scales_video_time(self) -> bool:
        """Whether a video's temporal positions are scaled by ``tokens_per_second`` (Qwen2.5-VL)."""
        return self is LayoutFamily.QWEN2_5_VL

    @property
    def splits_video(self) -> bool:
        """Whether each temporal patch of a video is its own media item with timestamp text (Qwen3-VL)."""
        return self is LayoutFamily.QWEN3_VL


#: (transformers module, processor class) of each family's processor
PROCESSOR_CLASSES = {
    LayoutFamily.QWEN2_VL: ("transformers.models.qwen2_vl.processing_qwen2_vl", "Qwen2VLProcessor"),
    LayoutFamily.QWEN2_5_VL: ("transformers.models.qwen2_5_vl.processing_qwen2_5_vl", "Qwen2_5_VLProcessor"),
    LayoutFamily.QWEN3_VL: ("transformers.models.qwen3_vl.processing_qwen3_vl", "Qwen3VLProcessor"),
}
_BY_CLASS = {cls: family for family, cls in PROCESSOR_CLASSES.items()}


def layout_family_of(processor: Any) -> Optional[LayoutFamily]:
    """The family of ``processor``: the first transformers Qwen-VL processor class in its
    class hierarchy (a subclass under any name resolves to its base). None for a bare
    tokenizer (no image processor: the caller's positions or tokens decide). Any other
    processor is refused, naming its class and the supported ones."""
    for cls in type(processor).__mro__:
        family = _BY_CLASS.get((cls.__module__, cls.__name__))
        if family is not None:
            return family
    if getattr(processor, "image_processor", None) is None and getattr(processor, "video_processor", None) is None:
        if not callable(getattr(getattr(processor, "tokenizer", processor), "get_vocab", None)):
            raise TypeError(f"processor must be a Qwen-VL processor or a tokenizer (with get_vocab()), got "
                            f"{type(processor).__name__}")
        return None
    supported = ", ".join(f"{name} ({family.label})" for family, (_, name) in PROCESSOR_CLASSES.items())
    raise TypeError(f"processor {type(processor).__name__} is not a supported Qwen-VL processor: rlk_mm builds batches "
                    f"with {supported} or a subclass of one (Qwen3-VL-MoE uses Qwen3VLProcessor)")


def layout_family_arg(value, name: str = "layout_family", error: type[Exception] = ValueError) -> Optional[LayoutFamily]:
    """None, or the ``LayoutFamily`` named by ``value`` (a member or its string)."""
    return None if value is None else LayoutFamily.parse(value, name, error)
