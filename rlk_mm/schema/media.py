"""Media items and their identity: the per-item record, token counts, fingerprints and keys.

- ``MediaItem`` is one image or video of a sample, as a batch records it.
- ``media_token_counts`` / ``vision_token_offsets``: an item's placeholder tokens and its
  first row in the vision tower's output.
- ``processor_fingerprint`` hashes everything that shapes the token layout, so two
  batches built by differently configured processors never compare equal.
- ``media_cache_key`` hashes the vision-tower input of one item (its processed pixel
  rows and grid) together with the fingerprint: equal key ⇒ identical vision input.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from .spans import Modality


@dataclass
class MediaItem:
    """One image or video of a sample.

    ``grid`` is its int64 ``(t, h, w)`` patch grid; ``pixels`` its vision-tower input rows
    (None where the batch keeps no pixels); ``second_per_grid`` a video's seconds per
    temporal patch; ``key`` its ``media_cache_key`` and ``id`` its media id (filled in
    once the whole batch is known)."""

    modality: Modality
    grid: torch.Tensor
    pixels: Optional[torch.Tensor] = None
    second_per_grid: Optional[float] = None
    key: Optional[str] = None
    id: Optional[str] = None


def media_token_counts(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """LLM tokens of each media item: t * h * w / merge_size²."""
    grid = grid_thw.long().reshape(-1, 3)
    return grid.prod(dim=1) // (merge_size * merge_size)


def vision_token_offsets(grid_thw: torch.Tensor, modality: torch.Tensor, merge_size: int) -> torch.Tensor:
    """Row offset of each item's first output row in its modality's vision-tower output."""
    counts = media_token_counts(grid_thw, merge_size)
    out = torch.zeros_like(counts)
    for mod in torch.unique(modality).tolist():
        sel = modality == mod
        c = counts[sel]
        out[sel] = torch.cumsum(c, 0) - c
    return out

#: image-processor settings that change pixel values or the number of image tokens
_IMAGE_PROCESSOR_KEYS = (
    "min_pixels", "max_pixels", "size", "patch_size", "merge_size", "temporal_patch_size",
    "image_mean", "image_std", "resample", "do_resize", "do_rescale", "rescale_factor",
    "do_normalize", "do_convert_rgb", "fps", "min_frames", "max_frames", "num_frames", "do_sample_frames",
)
#: special tokens whose ids shape the layout
_SPECIAL_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>", "<|endoftext|>",
)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return np.asarray(value).tolist()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def _sha256(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def _vision_settings(processor_part: Any) -> dict:
    if processor_part is None:
        return {}
    return {k: _jsonable(getattr(processor_part, k)) for k in _IMAGE_PROCESSOR_KEYS if hasattr(processor_part, k)}


def processor_fingerprint(processor: Any) -> str:
    """sha256 over processor/tokenizer classes, vocabulary, special-token ids, chat template
    and image/video processor settings. Cached on the processor object."""
    cached = getattr(processor, "_rlk_mm_fingerprint", None)
    if cached is not None:
        return cached
    tokenizer = getattr(processor, "tokenizer", processor)
    vocab = tokenizer.get_vocab()
    vocab_digest = _sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    description = {
        "processor_class": type(processor).__name__,
        "tokenizer_class": type(tokenizer).__name__,
        "vocab_size": len(vocab),
        "vocab_sha256": vocab_digest,
        "special_token_ids": {t: vocab.get(t) for t in _SPECIAL_TOKENS},
        "bos_token_id": getattr(tokenizer, "bos_token_id", None),
        "eos_token_id": getattr(tokenizer, "eos_token_id", None),
        "pad_token_id": getattr(tokenizer, "pad_token_id", None),
        "chat_template": getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None),
        "image_processor_class": type(getattr(processor, "image_processor", None)).__name__,
        "image_processor": _vision_settings(getattr(processor, "image_processor", None)),
        "video_processor_class": type(getattr(processor, "video_processor", None)).__name__,
        "video_processor": _vision_settings(getattr(processor, "video_processor", None)),
    }
    fingerprint = _sha256(json.dumps(_jsonable(description), sort_keys=True).encode())
    try:
        processor._rlk_mm_fingerprint = fingerprint
    except AttributeError:
        pass
    return fingerprint


def media_cache_key(pixel_rows: torch.Tensor, grid_thw, modality: str, fingerprint: str) -> str:
    """Content key of one media item: its vision-tower input rows, grid, modality and the
    processor fingerprint. Equal key ⇒ identical vision-tower input."""
    rows = pixel_rows.detach().contiguous().cpu()
    if rows.dtype == torch.bfloat16:
        rows = rows.view(torch.int16)
    grid = ",".join(str(int(g)) for g in grid_thw)
    return _sha256(fingerprint.encode(), modality.encode(), grid.encode(), rows.numpy().tobytes())


def default_media_id(cache_key: str, modality: str) -> str:
    """Derived media id when the caller gives none: stable for the same content."""
    return f"{modality}-{cache_key[:16]}"
