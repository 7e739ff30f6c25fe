"""Typed batch objects: spans, media identity, grounding and RLBatch."""

from .batch import BatchFileError, RLBatch, media_token_counts
from .grounding import CoordinateSystem, convert_boxes, convert_points
from .media import media_cache_key, processor_fingerprint
from .qwen_vl import from_qwen_vl, from_token_lists, from_verl, mrope_positions
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

__all__ = [
    "BatchFileError", "CoordinateSystem", "Modality", "RLBatch", "SchemaError", "Span", "SpanTable",
    "complement", "convert_boxes", "convert_points", "from_qwen_vl", "from_token_lists", "from_verl",
    "intersect", "mask_from_spans", "media_cache_key", "media_token_counts", "mrope_positions", "normalize",
    "processor_fingerprint", "spans_from_mask", "subtract", "union",
]
