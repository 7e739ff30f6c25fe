"""RLBatch: the typed batch between a processor's output and the loss (docs/batch_contract.md).

Tokens of all samples are stored unpadded and concatenated (``input_ids[T]``,
``cu_seqlens[B+1]``); spans are ``SpanTable``s (CSR by sample). This module holds the model
and its views; the invariants (``_validate``), per-sample assembly (``_assemble``),
save/load (``io``) and the builders (``qwen_vl``, ``verl``) have their own modules, which
never import this one. A violation of the contract raises ``SchemaError`` naming the
field, sample, span and positions.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from . import io
from ._assemble import SAMPLE_FIELDS, assemble, present_fields, sample_parts
from ._validate import check, schema_error
from .checks import device_arg, group_id_list, int_arg, sample_index, sample_indices, tensor_arg
from .choice import Choice
from .coordinates import size_arg
from .io import BatchFileError
from .media import NotASettingsTag, key_settings, token_counts
from .messages import fields_from_messages
from .qwen_vl import fields_from_qwen_vl, fields_from_token_lists
from .spans import Modality, SchemaError, Span, SpanTable
from .trajectories import fields_from_trajectories
from .unsupported import require_supported
from .verl import fields_from_verl

__all__ = ["dense_group_index", "PaddingSide", "RLBatch"]

Tensor = torch.Tensor


class PaddingSide(Choice):
    """Where a padded row's real entries sit."""

    LEFT = "left"  # at the end of the row
    RIGHT = "right"  # at the start of the row


def dense_group_index(group_ids: Sequence, device=None) -> Tensor:
    """int64 [B]: group ids as dense numbers 0..G-1 in first-appearance order.

    ``group_ids``: str or int ids, as a list, a numpy array (verl's ``uid``) or a 1-D
    integer tensor; None, floats and bools are refused (nan never equals itself, 1.0 and
    True would silently join group 1)."""
    seen: dict = {}
    dense = [seen.setdefault(g, len(seen)) for g in group_id_list(group_ids)]
    return torch.tensor(dense, dtype=torch.int64, device=None if device is None else device_arg(device))


def batch_arg(name: str, value) -> "RLBatch":
    """``value`` itself when it is an ``RLBatch`` of modalities the ops support (the check every function taking one makes first)."""
    if not isinstance(value, RLBatch):
        raise TypeError(f"{name} must be an RLBatch (rlk_mm.RLBatch, e.g. RLBatch.from_qwen_vl(...)), got {type(value).__name__}")
    return require_supported(name, value)


def _builder(fields_from):
    """A classmethod that builds an RLBatch from what ``fields_from`` returns (same parameters)."""

    def build(cls, *args, **kwargs):
        return cls(**fields_from(*args, **kwargs))

    signature = inspect.signature(fields_from)
    build.__signature__ = signature.replace(
        parameters=[inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD), *signature.parameters.values()],
        return_annotation="RLBatch",
    )
    build.__name__ = fields_from.__name__.replace("fields_", "")
    build.__doc__ = (fields_from.__doc__ or "").replace("The fields of an RLBatch", "An RLBatch", 1)
    return classmethod(build)


class PackedRows:
    """``num_samples`` and ``num_tokens`` of sequences packed in one row: a ``cu_seqlens``
    ``[B + 1]`` of sequence boundaries over ``input_ids`` ``[T]`` (an ``RLBatch``, or a
    ``PackedBatch`` whose sequences are its slots, padding included)."""

    @property
    def num_samples(self) -> int:
        """The sequences (samples, or a pack's slots)."""
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        """The tokens ``T``, a pack's alignment padding included."""
        return self.input_ids.numel()


class RLBatch(PackedRows, BaseModel):
    """A batch of image/video-text RL samples; docs/batch_contract.md gives each field's meaning.

    Constructing one checks every invariant (one host sync, also for a batch on CUDA); no
    field is coerced (``strict``: an id is an int, a media id a str, a list a list)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, validate_assignment=False, extra="forbid", strict=True)

    # tokens
    input_ids: Tensor  # int64 [T]
    cu_seqlens: Tensor  # int32 [B+1]
    position_ids: Tensor  # int64 [3, T]
    modality_spans: SpanTable
    loss_spans: SpanTable
    processor_fingerprint: str
    image_token_id: Optional[int] = None
    video_token_id: Optional[int] = None
    spatial_merge_size: int = 2
    layout_family: Optional[str] = None  # LayoutFamily of the processor that built it; None: unknown (a bare tokenizer)
    prompt_lengths: Optional[Tensor] = None  # int64 [B]: tokens before the response (multi-turn: before the first scored turn)
    # media, one entry per item; order: images (order of image_grid_thw), then videos
    media_ids: list[str] = []
    media_cache_keys: list[str] = []
    media_modality: Optional[Tensor] = None  # int8 [M]
    media_sample: Optional[Tensor] = None  # int64 [M]
    media_grid_thw: Optional[Tensor] = None  # int64 [M, 3]
    vision_token_offsets: Optional[Tensor] = None  # int64 [M]
    # model inputs (vision-tower input rows; order of the grids)
    pixel_values: Optional[Tensor] = None
    image_grid_thw: Optional[Tensor] = None
    pixel_values_videos: Optional[Tensor] = None
    video_grid_thw: Optional[Tensor] = None
    second_per_grid_ts: Optional[Tensor] = None
    # RL
    group_ids: Optional[list[str]] = None
    rewards: Optional[Tensor] = None  # float32 [B]
    costs: Optional[Tensor] = None  # float32 [B]
    # grounding
    region_spans: Optional[SpanTable] = None
    region_rewards: Optional[Tensor] = None  # float32 [num region spans]
    action_spans: Optional[SpanTable] = None
    turn_rewards: Optional[Tensor] = None  # float32 [num action spans]
    bbox_targets: Optional[Tensor] = None  # float32 [K, 4] (x0, y0, x1, y1)
    bbox_sample: Optional[Tensor] = None  # int64 [K]
    point_targets: Optional[Tensor] = None  # float32 [P, 2]
    point_sample: Optional[Tensor] = None  # int64 [P]
    coordinate_system: Optional[str] = None
    screen_size: Optional[Tensor] = None  # int64 [B, 2] (width, height)

    # ------------------------------------------------------------------ validation
    def __init__(self, **data):
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise schema_error(e) from None

    @model_validator(mode="after")
    def _validate(self) -> "RLBatch":
        check(self)
        return self

    # ------------------------------------------------------------------ basic views
    @property
    def num_media(self) -> int:
        return len(self.media_ids)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def seq_lengths(self) -> Tensor:
        return torch.diff(self.cu_seqlens).long()

    def sample_tokens(self, b: int) -> Tensor:
        b = sample_index(b, self.num_samples, "batch")
        return self.input_ids[int(self.cu_seqlens[b]) : int(self.cu_seqlens[b + 1])]

    def sample_positions(self, b: int) -> Tensor:
        b = sample_index(b, self.num_samples, "batch")
        return self.position_ids[:, int(self.cu_seqlens[b]) : int(self.cu_seqlens[b + 1])]

    def modality_spans_of(self, b: int) -> list[Span]:
        return self.modality_spans.spans_of(sample_index(b, self.num_samples, "batch"))

    def loss_spans_of(self, b: int) -> list[Span]:
        return self.loss_spans.spans_of(sample_index(b, self.num_samples, "batch"))

    def token_modality(self) -> Tensor:
        """int8 [T]: the modality of every token (from the modality spans)."""
        return self.per_token(self.modality_spans.modality)

    def per_token(self, span_values: Tensor) -> Tensor:
        """A value per modality span spread to its tokens: ``[S, *]`` (``S`` the batch's modality
        spans, in table order) to ``[T, *]``. The spans partition every sample in token order, so
        this is one ``repeat_interleave``."""
        S = self.modality_spans.num_spans
        tensor_arg("span_values", span_values, device=self.device)
        if span_values.dim() == 0 or span_values.shape[0] != S:
            raise ValueError(f"span_values must have shape [{S}, *] (one value per modality span, in the order of "
                             f"modality_spans), got {tuple(span_values.shape)}")
        lengths = self.modality_spans.lengths().long()
        return torch.repeat_interleave(span_values, lengths, dim=0, output_size=self.num_tokens)

    def loss_mask(self) -> Tensor:
        """bool [T]: True at target tokens (inside loss spans)."""
        ls = self.loss_spans
        offset = self.cu_seqlens.long()[ls.span_sample()]
        edges = torch.zeros(self.num_tokens + 1, dtype=torch.int32, device=self.device)
        edges.index_add_(0, offset + ls.starts.long(), torch.ones_like(ls.starts))
        edges.index_add_(0, offset + ls.ends.long(), -torch.ones_like(ls.ends))
        return torch.cumsum(edges[:-1], 0) > 0

    # ------------------------------------------------------------------ loss tokens
    def loss_token_index(self, padded_length: Optional[int] = None, padding: Optional[str] = None) -> tuple[Tensor, Tensor]:
        """(rows, targets) int64 [n] in loss-span order.

        Target ``t`` of sample ``b`` is scored from the hidden state at ``t - 1``: rows index
        the packed ``[T, H]`` layout (``cu_seqlens[b] + t - 1``), or, with
        ``padded_length=L`` and ``padding``, a padded ``[B, L, H]`` viewed as ``[B*L, H]``:
        ``padding="right"`` (each sample's tokens start its row: ``b*L + t - 1``) or ``"left"``
        (they end it). The padding side is never guessed. Checking ``L`` against the longest
        sample reads it on the host (one sync on CUDA)."""
        if (padded_length is None) != (padding is None):
            raise ValueError(
                "padded_length and padding go together: give both for a padded [B, L, H] layout "
                "(padding='right' or 'left'), or neither for the packed [T, H] layout"
            )
        sample, pos, _ = self.loss_spans.token_positions()
        starts = self.cu_seqlens.long()
        targets = self.input_ids[starts[sample] + pos]
        if padded_length is None:
            return starts[sample] + pos - 1, targets
        L = int_arg("padded_length", padded_length, min=0)
        side = PaddingSide.parse(padding, "padding")
        lengths = self.seq_lengths()
        longest = int(lengths.max()) if self.num_samples else 0
        if L < longest:
            b = int(torch.argmax(lengths))
            raise ValueError(f"a padded length of {L} is shorter than the longest sample (sample {b}, {longest} tokens)")
        first = (L - lengths)[sample] if side is PaddingSide.LEFT else 0
        return sample * L + first + pos - 1, targets

    def loss_token_sample(self) -> Tensor:
        """int64 [n]: the sample of each loss token, in loss-span order."""
        return self.loss_spans.token_positions()[0]

    # ------------------------------------------------------------------ groups
    def group_index(self) -> Tensor:
        """int64 [B]: dense group number (0..G-1, first-appearance order); each sample its
        own group when ``group_ids`` is None."""
        if self.group_ids is None:
            return torch.arange(self.num_samples, device=self.device)
        return dense_group_index(self.group_ids, self.device)

    def iter_groups(self) -> Iterator[tuple[str, "RLBatch"]]:
        """(group id, sub-batch) in first-appearance order."""
        ids = self.group_ids or [str(b) for b in range(self.num_samples)]
        members: dict[str, list[int]] = {}
        for b, g in enumerate(ids):
            members.setdefault(g, []).append(b)
        for g, idx in members.items():
            yield g, self.select(idx)

    # ------------------------------------------------------------------ per-item views
    def media_token_counts(self) -> Tensor:
        """int64 [M]: placeholder tokens (= vision-tower output rows) of each media item."""
        if self.media_grid_thw is None:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return token_counts(self.media_grid_thw, self.spatial_merge_size)

    def media_pixel_rows(self) -> list[Optional[Tensor]]:
        """Vision-tower input rows of each media item (None where the batch keeps no pixels)."""
        out: list[Optional[Tensor]] = [None] * self.num_media
        for modality, pixels in ((Modality.IMAGE, self.pixel_values), (Modality.VIDEO, self.pixel_values_videos)):
            if pixels is None or self.media_modality is None:
                continue
            items = torch.nonzero(self.media_modality == int(modality)).flatten().tolist()
            start = 0
            for g in items:
                rows = int(self.media_grid_thw[g].prod())
                out[g] = pixels[start : start + rows]
                start += rows
        return out

    def media_original_sizes(self) -> list[Optional[tuple[int, int]]]:
        """Each media item's original ``(width, height)`` in pixels, the size it was resized from,
        as its builder recorded it with its resize settings (``key_settings`` of its cache key:
        ``from_trajectories`` and ``from_messages`` record it, ``select``, ``concat``, ``save`` and
        ``load`` keep it); None where none is recorded (a batch built from a processor's output,
        or a caller-given key that names no settings)."""
        out: list[Optional[tuple[int, int]]] = []
        for g, key in enumerate(self.media_cache_keys):
            try:
                settings = key_settings(key)
            except NotASettingsTag:  # a caller-given key holding the separator but no settings tag: it records nothing
                settings = None
            except ValueError as e:  # a settings tag of bad values: it records them wrongly
                raise ValueError(f"media_cache_keys[{g}]: {e}") from None
            size = None if settings is None else settings.original_size
            out.append(None if size is None else size_arg(f"media_cache_keys[{g}]: the recorded original size", size))
        return out

    def _common(self) -> dict:
        return dict(
            processor_fingerprint=self.processor_fingerprint,
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
            spatial_merge_size=self.spatial_merge_size,
            coordinate_system=self.coordinate_system,
            layout_family=self.layout_family,
        )

    def select(self, indices: Sequence[int]) -> "RLBatch":
        """A new batch of the given samples, in the given order (media re-indexed), with
        every field of this one (an optional field the samples leave empty stays, empty).
        ``indices``: ints, a 1-D integer tensor or numpy array; never a bool mask."""
        indices = sample_indices(indices, self.num_samples, "batch")
        pixels = self.media_pixel_rows()
        parts = [sample_parts(self, i, pixels) for i in indices]
        return RLBatch(**assemble(parts, present=present_fields(self), device=self.device, **self._common()))

    @staticmethod
    def concat(batches: Sequence["RLBatch"]) -> "RLBatch":
        """One batch of all samples of ``batches`` in order. They must be built the same way
        (fingerprint, placeholder ids, merge size, coordinate system), lie on one device and
        have the same optional fields: a field that some lack is refused, never dropped."""
        if isinstance(batches, (RLBatch, str, bytes, set, frozenset)) or not hasattr(batches, "__iter__"):
            why = ": a set has no order; pass a list in the intended order" if isinstance(batches, (set, frozenset)) else ""
            raise TypeError(f"batches must be a list of RLBatch, got {type(batches).__name__}{why}")
        batches = list(batches)
        if not batches:
            raise ValueError("RLBatch.concat needs at least one batch")
        for i, batch in enumerate(batches):
            if not isinstance(batch, RLBatch):
                raise TypeError(f"batches[{i}] is {type(batch).__name__}; RLBatch.concat joins RLBatch objects")
        _check_joinable(batches)
        first = batches[0]
        parts = []
        for batch in batches:
            pixels = batch.media_pixel_rows()
            parts += [sample_parts(batch, i, pixels) for i in range(batch.num_samples)]
        return RLBatch(**assemble(parts, present=present_fields(first), device=first.device, **first._common()))

    def to(self, device) -> "RLBatch":
        """A copy with every tensor on ``device`` (spans included); no re-check, no host sync."""
        device = device_arg(device)
        values = {}
        for name in type(self).model_fields:
            v = getattr(self, name)
            if isinstance(v, (Tensor, SpanTable)):
                v = v.to(device)
            elif isinstance(v, list):
                v = list(v)
            values[name] = v
        return RLBatch.model_construct(**values)

    # ------------------------------------------------------------------ equality
    def equals(self, other) -> bool:
        """True when ``other`` is an ``RLBatch`` whose every field equals this one's bitwise:
        tensors (span tables included) of one dtype, shape and device holding the same bits
        (so ``-0.0`` differs from ``0.0``, and a nan equals a nan of the same bits), the same
        ids, keys, fingerprint and settings, and the same optional fields present (a field
        one batch has and the other lacks makes them differ). ``==`` is this method; it reads
        both batches on the host."""
        if not isinstance(other, RLBatch):
            return False
        return all(_same_value(getattr(self, name), getattr(other, name)) for name in type(self).model_fields)

    def __eq__(self, other) -> bool:
        if not isinstance(other, RLBatch):
            return NotImplemented
        return self.equals(other)

    __hash__ = None  # a batch holds mutable tensors: equal batches need not stay equal

    # ------------------------------------------------------------------ save / load
    def save(self, path) -> Path:
        """Write one safetensors file: tensors, plus the other fields as JSON metadata."""
        return io.save(self, path)

    @classmethod
    def load(cls, path) -> "RLBatch":
        """Read a file written by ``save``. Nothing that identifies content is trusted: every field
        is checked against the identity record saved with it, each media item's pixel rows against
        the content saved with its cache key, a key derived from pixels must name its own item's
        (never another's), and the invariants are checked again; a ``BatchFileError`` names the
        field and the item (``schema.io`` says what a file written before the record gets)."""
        fields, record = io.load_fields(path, cls.model_fields)
        if record["identity"] is not None:  # all but the pixel values are as saved: their items are read as saved
            io.check_media(cls.model_construct(**fields), record, path)
        try:
            batch = cls(**fields)
        except SchemaError as e:
            raise BatchFileError(f"{path}: {e}") from None
        if record["identity"] is None:
            io.check_media(batch, record, path)
        return batch

    # ------------------------------------------------------------------ reading
    def summary(self, max_rows: int = 16) -> str:
        """A per-sample layout table: tokens per modality, media, loss tokens, position range
        (the first ``max_rows`` samples). Reads the batch on the host."""
        max_rows = int_arg("max_rows", max_rows, min=0)
        lengths = self.seq_lengths().tolist()
        mod_counts = torch.zeros(self.num_samples, 4, dtype=torch.int64)
        sample = self.modality_spans.span_sample().cpu()
        mod_counts.index_put_(
            (sample, self.modality_spans.modality.long().cpu()), self.modality_spans.lengths().long().cpu(), accumulate=True
        )
        loss = self.loss_spans.token_counts().cpu().tolist()
        media_per = torch.bincount(self.media_sample.cpu(), minlength=self.num_samples).tolist() if self.num_media else [0] * self.num_samples
        lines = [
            f"RLBatch: {self.num_samples} samples, {self.num_tokens} tokens, {self.num_media} media items, "
            f"{sum(loss)} loss tokens, fingerprint {self.processor_fingerprint[:12]}",
            f"{'sample':>6} {'group':>10} {'tokens':>7} {'text':>6} {'image':>6} {'video':>6} "
            f"{'media':>5} {'loss':>6} {'positions':>12} {'reward':>7}",
        ]
        for b in range(min(self.num_samples, max_rows)):
            lo, hi = int(self.cu_seqlens[b]), int(self.cu_seqlens[b + 1])
            pos = self.position_ids[:, lo:hi]
            prange = f"{int(pos.min())}..{int(pos.max())}" if hi > lo else "-"
            group = "-" if self.group_ids is None else _last(self.group_ids[b], 10)
            reward = "-" if self.rewards is None else f"{float(self.rewards[b]):.3f}"
            t, i, v = (int(x) for x in mod_counts[b, :3])
            lines.append(f"{b:>6} {group:>10} {lengths[b]:>7} {t:>6} {i:>6} {v:>6} {media_per[b]:>5} {loss[b]:>6} {prange:>12} {reward:>7}")
        if self.num_samples > max_rows:
            lines.append(f"... {self.num_samples - max_rows} more samples")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        loss = "?" if self.device.type == "meta" else int(self.loss_spans.lengths().sum())
        return f"RLBatch(samples={self.num_samples}, tokens={self.num_tokens}, media={self.num_media}, loss_tokens={loss})"

    # ------------------------------------------------------------------ builders
    from_qwen_vl = _builder(fields_from_qwen_vl)
    from_token_lists = _builder(fields_from_token_lists)
    from_verl = _builder(fields_from_verl)
    from_trajectories = _builder(fields_from_trajectories)
    from_messages = _builder(fields_from_messages)


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """Same dtype, shape and device, and the same bits (floats compared as their bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.is_floating_point() or a.is_complex():
        a, b = a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)
    return torch.equal(a, b)


def _same_value(a, b) -> bool:
    """One field of two batches, equal bitwise (``RLBatch.equals``)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and _same_tensor(a, b)
    if isinstance(a, SpanTable) or isinstance(b, SpanTable):
        return (isinstance(a, SpanTable) and isinstance(b, SpanTable)
                and all(_same_tensor(getattr(a, k), getattr(b, k)) for k in SpanTable.__slots__))
    return type(a) is type(b) and a == b


def _last(text: str, width: int) -> str:
    """``text``, or its last ``width - 1`` characters after "…" (ids differ at their ends)."""
    return text if len(text) <= width else "…" + text[1 - width :]


def _check_joinable(batches: list[RLBatch]) -> None:
    """The batches of a concat were built alike, lie on one device and have the same fields."""
    first = batches[0]
    for i, other in enumerate(batches[1:], start=1):
        for key, value in first._common().items():
            if other._common()[key] != value:
                raise SchemaError(
                    f"RLBatch.concat: batch {i} has {key}={other._common()[key]!r}, batch 0 has {value!r}; "
                    "only batches built the same way can be concatenated"
                )
        if other.device != first.device:
            raise SchemaError(f"RLBatch.concat: batch {i} is on {other.device}, batch 0 on {first.device}: move them to one device first")
    media_fields = (("pixel_values", Modality.IMAGE), ("pixel_values_videos", Modality.VIDEO), ("second_per_grid_ts", Modality.VIDEO))
    for name in (*SAMPLE_FIELDS, *(name for name, _ in media_fields)):
        modality = dict(media_fields).get(name)
        holders = [(i, getattr(b, name) is not None) for i, b in enumerate(batches)
                   if modality is None or (b.media_modality is not None and bool((b.media_modality == int(modality)).any()))]
        differ = [(i, has) for i, has in holders if has != holders[0][1]]
        if differ:
            (i, has), j = differ[0], holders[0][0]
            which = f"has {name} but batch {j} has none" if has else f"has no {name} but batch {j} has"
            raise SchemaError(f"RLBatch.concat: batch {i} {which}: give every batch {name}, or none of them")
