"""Typed batch objects: spans, media identity, grounding and RLBatch.

Imports nothing else of rlk_mm. Modules, bottom up: ``checks`` and ``_args`` (argument
checks), ``spans``, ``choice``, ``media``, ``grounding``; ``_assemble`` (per-sample parts ↔
fields), ``_inputs`` (the builders' arguments), ``_build`` (the builders' core),
``_validate`` (the contract's invariants, docs/batch_contract.md), ``io`` (save/load);
``qwen_vl`` and ``verl`` (builders); ``batch`` (the ``RLBatch`` model, its views and
constructors).
"""

from ._build import mrope_positions
from .batch import PaddingSide, RLBatch, dense_group_index
from .choice import Choice
from .grounding import CoordinateSystem, convert_boxes, convert_points
from .io import BatchFileError
from .media import MediaItem, media_cache_key, media_token_counts, processor_fingerprint, vision_token_offsets
from .spans import (
    Modality,
    SchemaError,
    Span,
    SpanTable,
    complement,
    intersect,
    mask_from_spans,
    normalize,
    spans_from_mask,
    subtract,
    union,
)

#: the builders, as functions (the same as ``RLBatch.from_qwen_vl`` etc.)
from_qwen_vl = RLBatch.from_qwen_vl
from_token_lists = RLBatch.from_token_lists
from_verl = RLBatch.from_verl

__all__ = [
    "BatchFileError", "Choice", "CoordinateSystem", "MediaItem", "Modality", "PaddingSide", "RLBatch", "SchemaError", "Span",
    "SpanTable", "complement", "convert_boxes", "convert_points", "dense_group_index", "from_qwen_vl",
    "from_token_lists", "from_verl", "intersect", "mask_from_spans", "media_cache_key", "media_token_counts",
    "mrope_positions", "normalize", "processor_fingerprint", "spans_from_mask", "subtract", "union",
    "vision_token_offsets",
]
