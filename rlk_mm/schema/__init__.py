"""Typed batch objects: spans, media identity, coordinates and RLBatch.

Imports nothing else of rlk_mm. Modules, bottom up: ``checks`` (argument checks), ``spans``,
``choice``, ``layouts`` (the Qwen-VL generations' token layouts), ``media``, ``coordinates`` (coordinate systems and their conversions),
``unsupported`` (the modalities the ops support, the check and the fallback), ``turns``
(assistant turns of a chat in token ids); ``_assemble`` (per-sample parts ↔ fields),
``_inputs`` (the builders' arguments), ``_build`` (the builders' core), ``_validate`` (the
contract's invariants, docs/batch_contract.md; its media clauses in ``_validate_media``), ``io`` (save/load); ``qwen_vl``, ``verl`` and
``messages`` (builders; ``messages``: chat messages through qwen-vl-utils); ``batch`` (the
``RLBatch`` model, its views and constructors); ``video`` (``VideoLayout``: a batch's videos
frame by frame); ``trajectories`` (GUI episodes).
"""

from ._build import mrope_positions
from .batch import PaddingSide, RLBatch, dense_group_index
from .choice import Choice
from .coordinates import CoordinateSystem, convert_boxes, convert_points
from .io import BatchFileError
from .layouts import LayoutFamily, layout_family_of
from .media import MediaItem, ResizeSettings, key_settings, media_cache_key, media_token_counts, processor_fingerprint, vision_token_offsets
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
from .trajectories import Step, Trajectory, step_group_index
from .unsupported import SUPPORTED_MODALITIES, UnsupportedModalityError, mask_unsupported_media
from .video import VideoLayout

#: the builders, as functions (the same as ``RLBatch.from_qwen_vl`` etc.)
from_qwen_vl = RLBatch.from_qwen_vl
from_token_lists = RLBatch.from_token_lists
from_verl = RLBatch.from_verl
from_messages = RLBatch.from_messages
from_trajectories = RLBatch.from_trajectories

__all__ = [
    "BatchFileError", "Choice", "CoordinateSystem", "LayoutFamily", "MediaItem", "Modality",
    "ResizeSettings", "PaddingSide", "RLBatch", "SchemaError", "Span",
    "SpanTable", "SUPPORTED_MODALITIES", "VideoLayout", "UnsupportedModalityError", "complement", "convert_boxes",
    "convert_points", "dense_group_index", "from_qwen_vl",
    "from_messages", "from_token_lists", "from_verl", "key_settings", "intersect", "mask_from_spans", "media_cache_key", "media_token_counts",
    "mask_unsupported_media", "mrope_positions", "normalize", "processor_fingerprint", "spans_from_mask", "subtract", "union",
    "vision_token_offsets", "layout_family_of", "Step", "Trajectory", "from_trajectories", "step_group_index",
]
