"""Media items and their identity: the per-item record, token counts, fingerprints and keys.

- ``MediaItem`` is one image or video of a sample, as a batch records it.
- ``media_token_counts`` / ``vision_token_offsets``: an item's placeholder tokens and its
  first row in the vision tower's output (``token_counts`` / ``offsets``: the same on
  checked tensors, with no host sync, for the batch's own validation and views).
- ``processor_fingerprint`` hashes everything that shapes the token layout, so two
  batches built by differently configured processors never compare equal.
- ``media_cache_key`` hashes the vision-tower input of one item (its processed pixel
  rows and grid) together with the fingerprint: equal key ⇒ identical vision input.
- ``ResizeSettings`` are the resize settings an item was processed with, and the original
  size it was resized from (``from_messages`` and ``from_trajectories`` record them):
  ``settings_key`` appends them to its cache key, readable, so equal keys also mean equal
  settings, and ``key_settings`` reads them back (drift diagnosis, and the original size
  that ``parse_grounding`` converts coordinates to, through ``RLBatch.media_original_sizes``).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass, fields
from typing import Any, Optional

import numpy as np
import torch

from .checks import FLOAT_DTYPES, INTEGER_DTYPES, DeviceChecks, first_true, int_arg, readable, tensor_arg
from .layouts import layout_family_of
from .spans import Modality, SchemaError, refuse

__all__ = [
    "key_settings", "media_cache_key", "media_token_counts", "MediaItem", "processor_fingerprint", "ResizeSettings",
    "vision_token_offsets"
]


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


def grid_arg(name: str, grid) -> torch.Tensor:
    """``grid`` (a tensor or nested list of ints) as int64 ``[N, 3]`` rows ``(t, h, w)``;
    its shape and dtype only (``check_grid`` checks the values)."""
    if not isinstance(grid, torch.Tensor):
        try:
            grid = torch.as_tensor(grid)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name} must be an int tensor [N, 3] of (t, h, w) rows, got {type(grid).__name__}") from None
    if grid.dtype not in INTEGER_DTYPES:
        raise TypeError(f"{name} must be int (an int64 [N, 3] tensor of (t, h, w) rows), got {grid.dtype}")
    if grid.ndim != 2 or grid.shape[1] != 3:
        raise SchemaError(f"{name} must have shape [N, 3] (one (t, h, w) row per item), got {tuple(grid.shape)}")
    return grid.long()


def grid_row(name: str, grid) -> list[int]:
    """One item's grid ``(t, h, w)``: 3 ints >= 1 (a list, tuple or ``[3]`` tensor)."""
    values = grid.tolist() if isinstance(grid, torch.Tensor) else grid
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or len(values) != 3:
        raise ValueError(f"{name} must be 3 ints (t, h, w), got {grid!r}")
    return [int_arg(f"{name}[{i}]", g, min=1) for i, g in enumerate(values)]


def add_grid_checks(checks: DeviceChecks, name: str, grid: torch.Tensor, merge_size: int) -> None:
    """Adds to ``checks``: every (t, h, w) is >= 1 and h, w are multiples of ``merge_size``."""
    for bad, rule in (
        ((grid < 1).any(1), "t, h and w must be >= 1"),
        ((grid[:, 1:] % merge_size != 0).any(1), f"h and w must be multiples of the merge size {merge_size}"),
    ):
        checks.add(bad.any(), lambda bad=bad, rule=rule: refuse(f"{name}[{(i := first_true(bad)[0])}] is {grid[i].tolist()}: {rule}"))


def add_pixel_checks(checks: DeviceChecks, pixel_name: str, pixels: torch.Tensor, grid_name: str, grids: torch.Tensor,
                     label: str, *, finite: bool = True) -> None:
    """Adds to ``checks``: ``pixels`` has the rows ``grids`` need (the sum of t*h*w) and,
    with ``finite``, all are finite (one pass over the pixels)."""
    rows = grids.prod(1)
    checks.add(rows.sum() != pixels.shape[0], lambda: refuse(
        f"{pixel_name} has {pixels.shape[0]} rows; {grid_name} needs {int(rows.sum())} (the sum of t*h*w)"))
    if not finite:
        return

    def not_finite():
        r, c = first_true(~torch.isfinite(pixels))
        item = int(torch.searchsorted(torch.cumsum(rows, 0), torch.tensor([r], device=rows.device), right=True)[0])
        raise SchemaError(f"{pixel_name}: row {r}, column {c} is {float(pixels[r, c])} ({label} {item}); pixel values must be finite")

    checks.add(~torch.isfinite(pixels).all(), not_finite)


def token_counts(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """LLM tokens of each media item of a checked ``[N, 3]`` grid: t * h * w / merge_size²."""
    return grid_thw.long().prod(dim=1) // (merge_size * merge_size)


def media_token_counts(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """int64 [N]: LLM tokens of each media item, t * h * w / merge_size².

    ``grid_thw`` is ``[N, 3]`` (or one ``[3]`` row); every entry >= 1, h and w multiples of
    ``merge_size``. The check reads the grid on the host (one sync for a CUDA grid)."""
    merge_size = int_arg("merge_size", merge_size, min=1)
    if isinstance(grid_thw, torch.Tensor) and grid_thw.ndim == 1:
        grid_thw = grid_thw[None]
    grid = readable("grid_thw", grid_arg("grid_thw", grid_thw))
    checks = DeviceChecks()
    add_grid_checks(checks, "grid_thw", grid, merge_size)
    checks.run()
    return token_counts(grid, merge_size)


def offsets(counts: torch.Tensor, modality: torch.Tensor) -> torch.Tensor:
    """Each item's first row in its modality's output: the exclusive running sum of
    ``counts`` over the items of the same modality (no host sync)."""
    out = torch.zeros_like(counts)
    for mod in (Modality.IMAGE, Modality.VIDEO, Modality.AUDIO):
        same = modality == int(mod)
        mine = torch.where(same, counts, 0)
        out = torch.where(same, torch.cumsum(mine, 0) - mine, out)
    return out


def vision_token_offsets(grid_thw: torch.Tensor, modality: torch.Tensor, merge_size: int) -> torch.Tensor:
    """int64 [N]: row offset of each item's first output row in its modality's vision-tower
    output (items in grid order). ``modality`` is int [N]: 1 image, 2 video, 3 audio.
    The checks read the grid and modality on the host (one sync for CUDA tensors)."""
    counts = media_token_counts(grid_thw, merge_size)
    modality = readable("modality", tensor_arg("modality", modality, shape=(counts.numel(),), dtypes=INTEGER_DTYPES))
    not_media = (modality < int(Modality.IMAGE)) | (modality > int(Modality.AUDIO))
    if bool(not_media.any()):
        i = first_true(not_media)[0]
        raise ValueError(f"modality[{i}] is {int(modality[i])}; a media item is 1 (image), 2 (video) or 3 (audio)")
    return offsets(counts, modality.to(counts.device))


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


def _vocabulary(tokenizer: Any) -> dict:
    """The vocabulary part of the fingerprint (size, digest, special-token ids): hashing
    151k entries takes ~0.3 s, so it is cached on the tokenizer while its length holds."""
    cached = getattr(tokenizer, "_rlk_mm_vocabulary", None)
    if cached is not None and cached[0] == len(tokenizer):
        return cached[1]
    vocab = tokenizer.get_vocab()
    part = {
        "vocab_size": len(vocab),
        "vocab_sha256": _sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()),
        "special_token_ids": {t: vocab.get(t) for t in _SPECIAL_TOKENS},
    }
    try:
        tokenizer._rlk_mm_vocabulary = (len(tokenizer), part)
    except AttributeError:
        pass
    return part


def _layout(processor: Any) -> dict:
    """The fingerprint's layout part: the model family, and for Qwen3-VL the transformers
    version, on which its video layout depends (an outer vision_start/vision_end pair around
    the timestamped frames in some 5.x releases, not in others)."""
    family = layout_family_of(processor)  # refuses a processor of an unsupported family
    if family is None:
        return {}
    part = {"layout_family": family.value}
    if family.splits_video:
        part["video_layout"] = "timestamped temporal patches, transformers " + getattr(
            sys.modules.get("transformers"), "__version__", "unknown")
    return part


def processor_fingerprint(processor: Any) -> str:
    """sha256 over processor/tokenizer classes, vocabulary, special-token ids, chat template
    and image/video processor settings. Recomputed on every call (a changed setting changes
    it); only the vocabulary's digest is cached, on the tokenizer."""
    tokenizer = getattr(processor, "tokenizer", processor)
    if not callable(getattr(tokenizer, "get_vocab", None)):
        raise TypeError(f"processor must be a Qwen-VL processor or tokenizer (with get_vocab()), got {type(processor).__name__}")
    vocabulary = _vocabulary(tokenizer)
    description = {
        "processor_class": type(processor).__name__,
        "tokenizer_class": type(tokenizer).__name__,
        "vocab_size": vocabulary["vocab_size"],
        "vocab_sha256": vocabulary["vocab_sha256"],
        "special_token_ids": vocabulary["special_token_ids"],
        "bos_token_id": getattr(tokenizer, "bos_token_id", None),
        "eos_token_id": getattr(tokenizer, "eos_token_id", None),
        "pad_token_id": getattr(tokenizer, "pad_token_id", None),
        "chat_template": getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None),
        "image_processor_class": type(getattr(processor, "image_processor", None)).__name__,
        "image_processor": _vision_settings(getattr(processor, "image_processor", None)),
        "video_processor_class": type(getattr(processor, "video_processor", None)).__name__,
        "video_processor": _vision_settings(getattr(processor, "video_processor", None)),
        **_layout(processor),
    }
    return _sha256(json.dumps(_jsonable(description), sort_keys=True).encode())


_MEDIA_LABELS = tuple(m.label for m in Modality if m is not Modality.TEXT)


def media_cache_key(pixel_rows: torch.Tensor, grid_thw, modality: str, fingerprint: str) -> str:
    """Content key of one media item: its vision-tower input rows ``[t*h*w, D]`` (finite),
    grid ``(t, h, w)``, modality ("image", "video", "audio") and the processor fingerprint.
    Equal key ⇒ identical vision-tower input. Reads the rows on the host."""
    rows = readable("pixel_rows", tensor_arg("pixel_rows", pixel_rows, ndim=2, dtypes=FLOAT_DTYPES)).detach().cpu()
    grid = grid_row("grid_thw", grid_thw)
    if modality not in _MEDIA_LABELS:
        raise ValueError(f"modality={modality!r}: expected one of {', '.join(_MEDIA_LABELS)}")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise TypeError(f"fingerprint must be a str (processor_fingerprint(processor)), got {fingerprint!r}")
    if rows.shape[0] != grid[0] * grid[1] * grid[2]:
        raise ValueError(f"pixel_rows has {rows.shape[0]} rows; grid_thw {grid} needs {grid[0] * grid[1] * grid[2]} (t*h*w)")
    bad = ~torch.isfinite(rows)
    if bool(bad.any()):
        r, c = first_true(bad)
        raise ValueError(f"pixel_rows: row {r}, column {c} is {float(rows[r, c])}; pixel values must be finite")
    return content_key(rows, grid, modality, fingerprint)


def content_key(pixel_rows: torch.Tensor, grid: list[int], modality: str, fingerprint: str) -> str:
    """``media_cache_key`` of checked arguments (the builders check pixel rows in bulk)."""
    rows = pixel_rows.detach().contiguous().cpu()
    if rows.dtype == torch.bfloat16:
        rows = rows.view(torch.int16)
    return _sha256(fingerprint.encode(), modality.encode(), ",".join(map(str, grid)).encode(), rows.numpy().tobytes())


def default_media_id(cache_key: str, modality: str) -> str:
    """Derived media id when the caller gives none: stable for the same content."""
    return f"{modality}-{cache_key[:16]}"


class NotASettingsTag(ValueError):
    """Text after a cache key's separator that is no ``ResizeSettings`` tag (a caller's own key)."""


@dataclass(frozen=True)
class ResizeSettings:
    """The resize settings one media item was processed with: the requested pixel limits
    (``total_pixels``: a video's budget over all frames), the size it was resized to, for a
    video the frame rate of its frames and the indices of the frames used, and the size of
    the image (or frame) it was resized from (``original_size``), which coordinates in
    original pixels refer to."""

    min_pixels: int
    max_pixels: int
    resized_height: int
    resized_width: int
    total_pixels: Optional[int] = None
    fps: Optional[float] = None
    frames: Optional[tuple[int, ...]] = None
    original_height: Optional[int] = None
    original_width: Optional[int] = None

    def __post_init__(self):
        """Sizes and pixel counts are ints >= 1, fps finite and > 0, frames ints >= 0 (a tag read
        back from a key is checked as one written)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            if f.name == "fps":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                    raise ValueError(f"ResizeSettings.fps={value!r}: a frame rate is a finite number > 0")
            elif f.name == "frames":
                if not isinstance(value, tuple) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value):
                    raise ValueError(f"ResizeSettings.frames={value!r}: frame indices are a tuple of ints >= 0")
            else:
                int_arg(f"ResizeSettings.{f.name}", value, min=1)

    @property
    def original_size(self) -> Optional[tuple[int, int]]:
        """``(width, height)`` of the image it was resized from; None where not recorded."""
        if self.original_width is None or self.original_height is None:
            return None
        return self.original_width, self.original_height

    def tag(self) -> str:
        """``name=value`` pairs joined by ``;`` (frames as ``0,1,2``), the given fields only."""
        words = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                words.append(f"{f.name}={','.join(map(str, value)) if f.name == 'frames' else value}")
        return ";".join(words)

    @classmethod
    def from_tag(cls, tag: str) -> "ResizeSettings":
        """The settings ``tag()`` wrote. Text that is no such tag (not ``name=value`` pairs of the
        settings' names joined by ``;``) raises ``NotASettingsTag``; a tag of bad values (a zero
        size, a nan fps, a missing setting) a ``ValueError`` naming the setting."""
        kinds = {"fps": float, "frames": lambda v: tuple(int(x) for x in v.split(",") if x)}
        names = {f.name for f in fields(cls)}
        words = [word.split("=", 1) for word in tag.split(";")]
        if not all(len(w) == 2 and w[0] in names for w in words):
            raise NotASettingsTag(f"{tag!r} is not a ResizeSettings tag (name=value pairs of {sorted(names)} joined by ';')")
        try:
            return cls(**{name: kinds.get(name, int)(value) for name, value in words})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{tag!r} is a ResizeSettings tag of bad values: {e}") from None

    def describe(self) -> str:
        """For people: "resized 336×224 from 400×267, min_pixels 3136, max_pixels 12544" (the original
        size, total, fps and frames as given)."""
        origin = "" if self.original_size is None else f" from {self.original_width}×{self.original_height}"
        parts = [f"resized {self.resized_width}×{self.resized_height}{origin}", f"min_pixels {self.min_pixels}",
                 f"max_pixels {self.max_pixels}"]
        if self.total_pixels is not None:
            parts.append(f"total_pixels {self.total_pixels}")
        if self.fps is not None:
            parts.append(f"fps {self.fps:g}")
        if self.frames is not None:
            parts.append(f"frames {list(self.frames)}")
        return ", ".join(parts)


SETTINGS_SEPARATOR = "#"


def settings_key(cache_key: str, settings: ResizeSettings) -> str:
    """A cache key that also names the resize settings: ``<content key>#<settings tag>``."""
    return f"{cache_key}{SETTINGS_SEPARATOR}{settings.tag()}"


def key_settings(cache_key: str) -> Optional[ResizeSettings]:
    """The resize settings a ``settings_key`` names; None for a key that names none."""
    if not isinstance(cache_key, str):
        raise TypeError(f"cache_key must be a str, got {type(cache_key).__name__}")
    _, sep, tag = cache_key.partition(SETTINGS_SEPARATOR)
    return ResizeSettings.from_tag(tag) if sep else None
