"""RLBatch: the typed batch between a processor's output and the loss (DESIGN.md contract).

Tokens of all samples are stored unpadded and concatenated (``input_ids[T]``,
``cu_seqlens[B+1]``); spans are ``SpanTable``s (CSR by sample). Invariants are checked,
vectorized, whenever a batch is built or loaded; a violation raises ``SchemaError``
naming the field, sample, span and positions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from .grounding import CoordinateSystem
from .spans import Modality, SchemaError, Span, SpanTable

FORMAT = "rlk_mm.RLBatch"
FORMAT_VERSION = "1"

Tensor = torch.Tensor

# (field, dtype, per-sample?) of the optional per-sample/per-item tensors
_SAMPLE_FLOATS = ("rewards", "costs")


class BatchFileError(SchemaError):
    """A saved batch cannot be read: corrupt, truncated, or not written by rlk_mm."""


def media_token_counts(grid_thw: Tensor, merge_size: int) -> Tensor:
    """LLM tokens of each media item: t * h * w / merge_size²."""
    grid = grid_thw.long().reshape(-1, 3)
    return grid.prod(dim=1) // (merge_size * merge_size)


@dataclass
class _SampleParts:
    """One sample's slice of every field, with media renumbered 0.. within the sample."""

    input_ids: Tensor
    position_ids: Tensor
    modality_spans: list[Span]
    loss_spans: list[Span]
    media: list[dict]  # modality, grid, id, key, pixels (or None), second_per_grid
    group_id: Optional[str] = None
    reward: Optional[float] = None
    cost: Optional[float] = None
    prompt_length: Optional[int] = None
    region_spans: list[Span] = field(default_factory=list)
    region_rewards: list[float] = field(default_factory=list)
    action_spans: list[Span] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    bboxes: Optional[Tensor] = None
    points: Optional[Tensor] = None
    screen_size: Optional[Tensor] = None


class RLBatch(BaseModel):
    """A batch of image/video-text RL samples with the meaning DESIGN.md gives each field."""

    model_config = ConfigDict(arbitrary_types_allowed=True, validate_assignment=False, extra="forbid")

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
    prompt_lengths: Optional[Tensor] = None  # int64 [B]: tokens before the response
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
            raise _schema_error(e) from None

    @model_validator(mode="after")
    def _validate(self) -> "RLBatch":
        _check(self)
        return self

    # ------------------------------------------------------------------ basic views
    @property
    def num_samples(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_media(self) -> int:
        return len(self.media_ids)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def seq_lengths(self) -> Tensor:
        return torch.diff(self.cu_seqlens).long()

    def sample_tokens(self, b: int) -> Tensor:
        self._check_sample_index(b)
        return self.input_ids[int(self.cu_seqlens[b]) : int(self.cu_seqlens[b + 1])]

    def sample_positions(self, b: int) -> Tensor:
        self._check_sample_index(b)
        return self.position_ids[:, int(self.cu_seqlens[b]) : int(self.cu_seqlens[b + 1])]

    def modality_spans_of(self, b: int) -> list[Span]:
        self._check_sample_index(b)
        return self.modality_spans.spans_of(b)

    def loss_spans_of(self, b: int) -> list[Span]:
        self._check_sample_index(b)
        return self.loss_spans.spans_of(b)

    def token_modality(self) -> Tensor:
        """int8 [T]: the modality of every token (from the modality spans)."""
        return self.per_token(self.modality_spans.modality)

    def per_token(self, span_values: Tensor) -> Tensor:
        """A value per modality span spread to its tokens, [T]. The spans partition every
        sample in token order, so this is one ``repeat_interleave``."""
        lengths = self.modality_spans.lengths().long()
        return torch.repeat_interleave(span_values, lengths, output_size=self.num_tokens)

    def loss_mask(self) -> Tensor:
        """bool [T]: True at target tokens (inside loss spans)."""
        ls = self.loss_spans
        offset = self.cu_seqlens.long()[ls.span_sample()]
        edges = torch.zeros(self.num_tokens + 1, dtype=torch.int32, device=self.device)
        edges.index_add_(0, offset + ls.starts.long(), torch.ones_like(ls.starts))
        edges.index_add_(0, offset + ls.ends.long(), -torch.ones_like(ls.ends))
        return torch.cumsum(edges[:-1], 0) > 0

    def _check_sample_index(self, b: int) -> None:
        if not 0 <= b < self.num_samples:
            raise IndexError(f"sample {b} out of range for a batch of {self.num_samples}")

    # ------------------------------------------------------------------ loss tokens
    def loss_token_index(self, padded_length: Optional[int] = None) -> tuple[Tensor, Tensor]:
        """(rows, targets) int64 [n] in loss-span order.

        Target ``t`` of sample ``b`` is scored from the hidden state at ``t - 1``: rows index
        the packed ``[T, H]`` layout (``cu_seqlens[b] + t - 1``), or, with
        ``padded_length=L``, a right-padded ``[B, L, H]`` viewed as ``[B*L, H]`` (``b*L + t - 1``).
        """
        sample, pos, _ = self.loss_spans.token_positions()
        targets = self.input_ids[self.cu_seqlens.long()[sample] + pos]
        if padded_length is None:
            rows = self.cu_seqlens.long()[sample] + pos - 1
        else:
            longest = int(self.seq_lengths().max()) if self.num_samples else 0
            if padded_length < longest:
                raise ValueError(f"padded_length={padded_length} is shorter than the longest sample ({longest} tokens)")
            rows = sample * padded_length + pos - 1
        return rows, targets

    def loss_token_sample(self) -> Tensor:
        """int64 [n]: the sample of each loss token, in loss-span order."""
        return self.loss_spans.token_positions()[0]

    # ------------------------------------------------------------------ groups
    def group_index(self) -> Tensor:
        """int64 [B]: dense group number (0..G-1, first-appearance order); each sample its
        own group when ``group_ids`` is None."""
        if self.group_ids is None:
            return torch.arange(self.num_samples, device=self.device)
        seen: dict[str, int] = {}
        dense = [seen.setdefault(g, len(seen)) for g in self.group_ids]
        return torch.tensor(dense, dtype=torch.int64, device=self.device)

    def iter_groups(self) -> Iterator[tuple[str, "RLBatch"]]:
        """(group id, sub-batch) in first-appearance order."""
        ids = self.group_ids or [str(b) for b in range(self.num_samples)]
        members: dict[str, list[int]] = {}
        for b, g in enumerate(ids):
            members.setdefault(g, []).append(b)
        for g, idx in members.items():
            yield g, self.select(idx)

    # ------------------------------------------------------------------ reshaping
    def _parts(self, b: int) -> _SampleParts:
        lo, hi = int(self.cu_seqlens[b]), int(self.cu_seqlens[b + 1])
        media_here = [] if self.media_sample is None else torch.nonzero(self.media_sample == b).flatten().tolist()
        local = {g: i for i, g in enumerate(media_here)}
        pixels = self.media_pixel_rows()
        media = []
        for g in media_here:
            modality = Modality(int(self.media_modality[g]))
            media.append(
                dict(
                    modality=modality,
                    grid=self.media_grid_thw[g].clone(),
                    id=self.media_ids[g],
                    key=self.media_cache_keys[g],
                    pixels=pixels[g],
                    second_per_grid=self._second_per_grid(g),
                )
            )
        spans = [
            Span(s.start, s.end, s.modality, local[s.media_index] if s.media_index >= 0 else -1)
            for s in self.modality_spans.spans_of(b)
        ]

        def _rows(values: Optional[Tensor], owner: Optional[Tensor]) -> Optional[Tensor]:
            return None if values is None else values[owner == b]

        def _span_values(table: Optional[SpanTable], values: Optional[Tensor]) -> tuple[list[Span], list[float]]:
            if table is None:
                return [], []
            lo_s, hi_s = int(table.sample_ptr[b]), int(table.sample_ptr[b + 1])
            vals = [] if values is None else values[lo_s:hi_s].tolist()
            return table.spans_of(b), vals

        region, region_r = _span_values(self.region_spans, self.region_rewards)
        action, turn_r = _span_values(self.action_spans, self.turn_rewards)
        return _SampleParts(
            input_ids=self.input_ids[lo:hi],
            position_ids=self.position_ids[:, lo:hi],
            modality_spans=spans,
            loss_spans=self.loss_spans.spans_of(b),
            media=media,
            group_id=None if self.group_ids is None else self.group_ids[b],
            reward=None if self.rewards is None else float(self.rewards[b]),
            cost=None if self.costs is None else float(self.costs[b]),
            prompt_length=None if self.prompt_lengths is None else int(self.prompt_lengths[b]),
            region_spans=region,
            region_rewards=region_r,
            action_spans=action,
            turn_rewards=turn_r,
            bboxes=_rows(self.bbox_targets, self.bbox_sample),
            points=_rows(self.point_targets, self.point_sample),
            screen_size=None if self.screen_size is None else self.screen_size[b],
        )

    def media_token_counts(self) -> Tensor:
        """int64 [M]: placeholder tokens (= vision-tower output rows) of each media item."""
        if self.media_grid_thw is None:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return media_token_counts(self.media_grid_thw, self.spatial_merge_size)

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

    def _second_per_grid(self, g: int) -> Optional[float]:
        if self.second_per_grid_ts is None or int(self.media_modality[g]) != int(Modality.VIDEO):
            return None
        video_rank = int((self.media_modality[:g] == int(Modality.VIDEO)).sum())
        return float(self.second_per_grid_ts[video_rank])

    def _common(self) -> dict:
        return dict(
            processor_fingerprint=self.processor_fingerprint,
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
            spatial_merge_size=self.spatial_merge_size,
            coordinate_system=self.coordinate_system,
        )

    def select(self, indices: Sequence[int]) -> "RLBatch":
        """A new batch of the given samples, in the given order (media re-indexed)."""
        indices = [int(i) for i in (indices.tolist() if isinstance(indices, Tensor) else indices)]
        for i in indices:
            self._check_sample_index(i)
        return assemble([self._parts(i) for i in indices], **self._common())

    @staticmethod
    def concat(batches: Sequence["RLBatch"]) -> "RLBatch":
        """One batch of all samples of ``batches`` in order; their fingerprints must agree."""
        if not batches:
            raise ValueError("RLBatch.concat needs at least one batch")
        first = batches[0]
        for i, other in enumerate(batches[1:], start=1):
            for key, value in first._common().items():
                if other._common()[key] != value:
                    raise SchemaError(
                        f"RLBatch.concat: batch {i} has {key}={other._common()[key]!r}, batch 0 has {value!r}; "
                        "only batches built the same way can be concatenated"
                    )
        parts = [b._parts(i) for b in batches for i in range(b.num_samples)]
        return assemble(parts, **first._common())

    def to(self, device) -> "RLBatch":
        """A copy with every tensor on ``device`` (spans included)."""
        values = {}
        for name in type(self).model_fields:
            v = getattr(self, name)
            if isinstance(v, (Tensor, SpanTable)):
                v = v.to(device)
            values[name] = v
        return RLBatch.model_construct(**values)

    # ------------------------------------------------------------------ save / load
    def save(self, path) -> Path:
        """Write one safetensors file: tensors, plus the other fields as JSON metadata."""
        from safetensors.torch import save_file

        tensors: dict[str, Tensor] = {}
        meta: dict = {}
        for name in type(self).model_fields:
            v = getattr(self, name)
            if isinstance(v, SpanTable):
                tensors.update(v.tensors(name))
            elif isinstance(v, Tensor):
                tensors[name] = v.detach().contiguous().cpu()
            else:
                meta[name] = v
        path = Path(path)
        save_file(tensors, str(path), metadata={"format": FORMAT, "version": FORMAT_VERSION, "fields": json.dumps(meta)})
        return path

    @classmethod
    def load(cls, path) -> "RLBatch":
        """Read a file written by ``save``; the invariants are checked again."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise BatchFileError(f"{path}: no such file")
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises several types for bad headers/data
            raise BatchFileError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        if metadata.get("format") != FORMAT:
            raise BatchFileError(f"{path}: not an rlk_mm batch (format={metadata.get('format')!r})")
        if metadata.get("version") != FORMAT_VERSION:
            raise BatchFileError(f"{path}: batch format version {metadata.get('version')!r}, this rlk_mm reads {FORMAT_VERSION!r}")
        try:
            fields = json.loads(metadata["fields"])
        except (KeyError, json.JSONDecodeError) as e:
            raise BatchFileError(f"{path}: batch metadata is damaged ({e})") from None
        values = dict(fields)
        for name, annotation in cls.model_fields.items():
            if name in values:
                continue
            if f"{name}.starts" in tensors:
                values[name] = SpanTable.from_tensors(tensors, name)
            elif name in tensors:
                values[name] = tensors[name]
        unknown = set(values) - set(cls.model_fields)
        if unknown:
            raise BatchFileError(f"{path}: unknown batch fields {sorted(unknown)}")
        try:
            return cls(**values)
        except SchemaError as e:
            raise BatchFileError(f"{path}: {e}") from None

    # ------------------------------------------------------------------ reading
    def summary(self, decode=None, max_rows: int = 16) -> str:
        """A per-sample layout table: tokens per modality, media, loss tokens, position range."""
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
            f"{'sample':>6} {'group':>10} {'tokens':>7} {'text':>6} {'image':>6} {'video':>6} {'media':>5} {'loss':>6} {'positions':>12} {'reward':>7}",
        ]
        for b in range(min(self.num_samples, max_rows)):
            lo, hi = int(self.cu_seqlens[b]), int(self.cu_seqlens[b + 1])
            pos = self.position_ids[:, lo:hi]
            prange = f"{int(pos.min())}..{int(pos.max())}" if hi > lo else "-"
            group = "-" if self.group_ids is None else str(self.group_ids[b])[:10]
            reward = "-" if self.rewards is None else f"{float(self.rewards[b]):.3f}"
            t, i, v = (int(x) for x in mod_counts[b, :3])
            lines.append(f"{b:>6} {group:>10} {lengths[b]:>7} {t:>6} {i:>6} {v:>6} {media_per[b]:>5} {loss[b]:>6} {prange:>12} {reward:>7}")
        if self.num_samples > max_rows:
            lines.append(f"... {self.num_samples - max_rows} more samples")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"RLBatch(samples={self.num_samples}, tokens={self.num_tokens}, media={self.num_media}, loss_tokens={self.loss_spans.lengths().sum().item()})"

    # builders live in their own modules; these are the public entry points
    @classmethod
    def from_qwen_vl(cls, processor_output, *, processor, **kwargs) -> "RLBatch":
        from .qwen_vl import from_qwen_vl

        return from_qwen_vl(processor_output, processor=processor, **kwargs)

    @classmethod
    def from_verl(cls, *args, **kwargs) -> "RLBatch":
        from .qwen_vl import from_verl

        return from_verl(*args, **kwargs)

    @classmethod
    def from_token_lists(cls, *args, **kwargs) -> "RLBatch":
        from .qwen_vl import from_token_lists

        return from_token_lists(*args, **kwargs)


# ---------------------------------------------------------------------- assembly
def assemble(parts: Sequence[_SampleParts], *, processor_fingerprint: str, **common) -> RLBatch:
    """Build a batch from per-sample parts: media ordered images-then-videos by sample."""
    B = len(parts)
    ids = [p.input_ids.long() for p in parts]
    lengths = torch.tensor([t.numel() for t in ids], dtype=torch.int64)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    # global media order: images of every sample, then videos of every sample
    order: list[tuple[int, int]] = []
    for modality in (Modality.IMAGE, Modality.VIDEO, Modality.AUDIO):
        order += [(b, j) for b, p in enumerate(parts) for j, m in enumerate(p.media) if m["modality"] == modality]
    global_index = {key: g for g, key in enumerate(order)}
    media = [parts[b].media[j] for b, j in order]
    mod_spans = [
        [Span(s.start, s.end, s.modality, global_index[(b, s.media_index)] if s.media_index >= 0 else -1) for s in p.modality_spans]
        for b, p in enumerate(parts)
    ]
    merge = common.get("spatial_merge_size", 2)
    values: dict = dict(common)
    values.update(
        input_ids=torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64),
        cu_seqlens=cu,
        position_ids=torch.cat([p.position_ids.long() for p in parts], dim=1) if parts else torch.zeros(3, 0, dtype=torch.int64),
        modality_spans=SpanTable.from_lists(mod_spans),
        loss_spans=SpanTable.from_lists([p.loss_spans for p in parts]),
        processor_fingerprint=processor_fingerprint,
        media_ids=[m["id"] for m in media],
        media_cache_keys=[m["key"] for m in media],
    )
    if media:
        grid = torch.stack([m["grid"].long() for m in media])
        modality = torch.tensor([int(m["modality"]) for m in media], dtype=torch.int8)
        values.update(
            media_modality=modality,
            media_sample=torch.tensor([b for b, _ in order], dtype=torch.int64),
            media_grid_thw=grid,
            vision_token_offsets=vision_token_offsets(grid, modality, merge),
        )
        for mod, pix_name, grid_name in ((Modality.IMAGE, "pixel_values", "image_grid_thw"), (Modality.VIDEO, "pixel_values_videos", "video_grid_thw")):
            items = [m for m in media if m["modality"] == mod]
            if not items:
                continue
            values[grid_name] = torch.stack([m["grid"].long() for m in items])
            if all(m["pixels"] is not None for m in items):
                values[pix_name] = torch.cat([m["pixels"] for m in items])
        videos = [m for m in media if m["modality"] == Modality.VIDEO]
        if videos and all(m["second_per_grid"] is not None for m in videos):
            values["second_per_grid_ts"] = torch.tensor([m["second_per_grid"] for m in videos], dtype=torch.float32)
    if all(p.group_id is not None for p in parts) and parts:
        values["group_ids"] = [p.group_id for p in parts]
    for name, attr in (("rewards", "reward"), ("costs", "cost")):
        if parts and all(getattr(p, attr) is not None for p in parts):
            values[name] = torch.tensor([getattr(p, attr) for p in parts], dtype=torch.float32)
    if parts and all(p.prompt_length is not None for p in parts):
        values["prompt_lengths"] = torch.tensor([p.prompt_length for p in parts], dtype=torch.int64)
    if any(p.region_spans for p in parts):
        values["region_spans"] = SpanTable.from_lists([p.region_spans for p in parts])
        if all(len(p.region_rewards) == len(p.region_spans) for p in parts):
            values["region_rewards"] = torch.tensor([r for p in parts for r in p.region_rewards], dtype=torch.float32)
    if any(p.action_spans for p in parts):
        values["action_spans"] = SpanTable.from_lists([p.action_spans for p in parts])
        if all(len(p.turn_rewards) == len(p.action_spans) for p in parts):
            values["turn_rewards"] = torch.tensor([r for p in parts for r in p.turn_rewards], dtype=torch.float32)
    for name, owner, attr in (("bbox_targets", "bbox_sample", "bboxes"), ("point_targets", "point_sample", "points")):
        rows = [(b, getattr(p, attr)) for b, p in enumerate(parts) if getattr(p, attr) is not None and len(getattr(p, attr))]
        if rows:
            values[name] = torch.cat([r for _, r in rows]).float()
            values[owner] = torch.cat([torch.full((len(r),), b, dtype=torch.int64) for b, r in rows])
    if parts and all(p.screen_size is not None for p in parts):
        values["screen_size"] = torch.stack([p.screen_size.long() for p in parts])
    return RLBatch(**values)


def vision_token_offsets(grid_thw: Tensor, modality: Tensor, merge_size: int) -> Tensor:
    """Row offset of each item's first output row in its modality's vision-tower output."""
    counts = media_token_counts(grid_thw, merge_size)
    out = torch.zeros_like(counts)
    for mod in torch.unique(modality).tolist():
        sel = modality == mod
        c = counts[sel]
        out[sel] = torch.cumsum(c, 0) - c
    return out


# ---------------------------------------------------------------------- invariants
def _schema_error(error: ValidationError) -> SchemaError:
    """pydantic wraps our SchemaError; unwrap it, or name the fields pydantic rejected."""
    problems = []
    for item in error.errors():
        inner = (item.get("ctx") or {}).get("error")
        if isinstance(inner, SchemaError):
            return inner
        field_name = ".".join(str(x) for x in item.get("loc", ())) or "batch"
        problems.append(f"{field_name}: {item.get('msg')}")
    return SchemaError("invalid RLBatch: " + "; ".join(problems))


def _span_name(table: SpanTable, i: int) -> str:
    s = Span(int(table.starts[i]), int(table.ends[i]), int(table.modality[i]), int(table.media_index[i]))
    return str(s)


def _check(batch: RLBatch) -> None:  # noqa: C901 - one list of contract clauses
    ids, cu, pos = batch.input_ids, batch.cu_seqlens, batch.position_ids
    if not isinstance(ids, Tensor) or ids.ndim != 1 or ids.dtype != torch.int64:
        raise SchemaError(f"input_ids must be a 1-D int64 tensor of all samples' tokens, got {getattr(ids, 'dtype', type(ids))} {tuple(getattr(ids, 'shape', ()))}")
    if cu.ndim != 1 or cu.dtype != torch.int32 or cu.numel() < 1:
        raise SchemaError(f"cu_seqlens must be a 1-D int32 tensor of length num_samples + 1, got {cu.dtype} {tuple(cu.shape)}")
    B, T = cu.numel() - 1, ids.numel()
    if int(cu[0]) != 0 or int(cu[-1]) != T:
        raise SchemaError(f"cu_seqlens must run from 0 to the token count {T}, got {int(cu[0])}..{int(cu[-1])}")
    lengths = torch.diff(cu).long()
    if B and bool((lengths <= 0).any()):
        b = int(torch.nonzero(lengths <= 0)[0])
        raise SchemaError(f"cu_seqlens: sample {b} has {int(lengths[b])} tokens; every sample needs at least one")
    if pos.shape != (3, T) or pos.dtype != torch.int64:
        raise SchemaError(f"position_ids must be int64 of shape (3, {T}) (t, h, w per token), got {pos.dtype} {tuple(pos.shape)}")
    dev = ids.device
    cu_l = cu.long()

    # ---- per-sample field lengths
    for name in ("rewards", "costs", "prompt_lengths"):
        v = getattr(batch, name)
        if v is not None and (v.ndim != 1 or v.numel() != B):
            raise SchemaError(f"{name} has shape {tuple(v.shape)}; expected one value per sample ({B})")
    if batch.group_ids is not None and len(batch.group_ids) != B:
        raise SchemaError(f"group_ids has {len(batch.group_ids)} entries; expected one per sample ({B})")
    for name in _SAMPLE_FLOATS:
        v = getattr(batch, name)
        if v is not None:
            if v.dtype != torch.float32:
                raise SchemaError(f"{name} must be float32, got {v.dtype}")
            bad = ~torch.isfinite(v)
            if bool(bad.any()):
                b = int(torch.nonzero(bad)[0])
                raise SchemaError(f"{name}[{b}] is {float(v[b])} (sample {b}); rewards and costs must be finite")
    if batch.coordinate_system is not None:
        CoordinateSystem.parse(batch.coordinate_system)

    # ---- modality spans: a partition of each sample
    ms = batch.modality_spans
    if ms.num_samples != B:
        raise SchemaError(f"modality_spans covers {ms.num_samples} samples; the batch has {B}")
    _check_span_bounds("modality_spans", ms, lengths, allow_empty=False)
    if ms.num_spans:
        first = ms.sample_ptr[:-1].long()
        last = ms.sample_ptr[1:].long() - 1
        has = ms.sample_ptr[1:] > ms.sample_ptr[:-1]
        if not bool(has.all()):
            b = int(torch.nonzero(~has)[0])
            raise SchemaError(f"modality_spans: sample {b} has no spans; they must partition its {int(lengths[b])} tokens")
        bad_first = ms.starts.long()[first] != 0
        if bool(bad_first.any()):
            b = int(torch.nonzero(bad_first)[0])
            raise SchemaError(f"modality_spans: sample {b} starts at position {int(ms.starts[first[b]])}; its first span must start at 0")
        bad_last = ms.ends.long()[last] != lengths
        if bool(bad_last.any()):
            b = int(torch.nonzero(bad_last)[0])
            raise SchemaError(
                f"modality_spans: sample {b} ends at position {int(ms.ends[last[b]])} but has {int(lengths[b])} tokens; "
                "the spans must cover every token"
            )
        same = ms.span_sample()[1:] == ms.span_sample()[:-1]
        gap = same & (ms.starts[1:] != ms.ends[:-1])
        if bool(gap.any()):
            i = int(torch.nonzero(gap)[0]) + 1
            b = int(ms.span_sample()[i])
            kind = "overlaps" if int(ms.starts[i]) < int(ms.ends[i - 1]) else "leaves a gap after"
            raise SchemaError(
                f"modality_spans: sample {b}, span {_span_name(ms, i)} {kind} span {_span_name(ms, i - 1)}; "
                "modality spans must partition the sample"
            )
    elif B:
        raise SchemaError("modality_spans is empty; every token must lie in exactly one span")
    _check_media(batch, lengths)

    # ---- placeholder tokens agree with the media spans
    modality = batch.token_modality() if T else torch.zeros(0, dtype=torch.int8, device=dev)
    for mod, tok, label in ((Modality.IMAGE, batch.image_token_id, "<|image_pad|>"), (Modality.VIDEO, batch.video_token_id, "<|video_pad|>")):
        if tok is None:
            continue
        is_tok = ids == tok
        in_span = modality == int(mod)
        wrong = is_tok != in_span
        if bool(wrong.any()):
            t = int(torch.nonzero(wrong)[0])
            b = int(torch.searchsorted(cu_l, torch.tensor([t], device=dev), right=True)[0]) - 1
            p = t - int(cu_l[b])
            span = next(s for s in ms.spans_of(b) if p in s)
            if bool(is_tok[t]):
                where = "in the response" if batch.prompt_lengths is not None and p >= int(batch.prompt_lengths[b]) else "outside any media span"
                raise SchemaError(
                    f"input_ids: sample {b}, position {p} holds the placeholder {label} {where} (span {span}); "
                    + ("the policy generated a media placeholder token: mask or reject this response" if "response" in where else "every placeholder must lie in its media item's span")
                )
            raise SchemaError(f"input_ids: sample {b}, position {p} is token {int(ids[t])} inside media span {span}; a media span covers only {label} tokens")

    # ---- loss spans
    ls = batch.loss_spans
    if ls.num_samples != B:
        raise SchemaError(f"loss_spans covers {ls.num_samples} samples; the batch has {B}")
    _check_span_bounds("loss_spans", ls, lengths, allow_empty=False)
    if ls.num_spans:
        at_zero = ls.starts == 0
        if bool(at_zero.any()):
            i = int(torch.nonzero(at_zero)[0])
            raise SchemaError(
                f"loss_spans: sample {int(ls.span_sample()[i])}, span {_span_name(ls, i)} starts at position 0; "
                "target t is scored from position t-1, so a loss span starts at 1 or later"
            )
        _check_sorted_disjoint("loss_spans", ls)
        sample, p, span_id = ls.token_positions()
        media_hit = modality[cu_l[sample] + p] != int(Modality.TEXT)
        if bool(media_hit.any()):
            k = int(torch.nonzero(media_hit)[0])
            b, q = int(sample[k]), int(p[k])
            mspan = next(s for s in ms.spans_of(b) if q in s)
            raise SchemaError(
                f"loss_spans: sample {b}, span {_span_name(ls, int(span_id[k]))} intersects media span {mspan} at position {q}; "
                "loss spans must not score media placeholder tokens"
            )
        if batch.prompt_lengths is not None:
            early = p < batch.prompt_lengths.to(dev)[sample]
            if bool(early.any()):
                k = int(torch.nonzero(early)[0])
                b = int(sample[k])
                raise SchemaError(
                    f"loss_spans: sample {b}, span {_span_name(ls, int(span_id[k]))} covers prompt position {int(p[k])} "
                    f"(the prompt has {int(batch.prompt_lengths[b])} tokens); loss spans lie inside the response"
                )
    for name in ("region_spans", "action_spans"):
        table = getattr(batch, name)
        if table is not None:
            if table.num_samples != B:
                raise SchemaError(f"{name} covers {table.num_samples} samples; the batch has {B}")
            _check_span_bounds(name, table, lengths, allow_empty=False)
    for values, table, name in ((batch.region_rewards, batch.region_spans, "region_rewards"), (batch.turn_rewards, batch.action_spans, "turn_rewards")):
        if values is not None:
            n = 0 if table is None else table.num_spans
            if values.shape != (n,):
                raise SchemaError(f"{name} has shape {tuple(values.shape)}; expected one value per span ({n})")
            if not bool(torch.isfinite(values).all()):
                i = int(torch.nonzero(~torch.isfinite(values))[0])
                raise SchemaError(f"{name}[{i}] is {float(values[i])}; rewards must be finite")
    for targets, owner, width, name in ((batch.bbox_targets, batch.bbox_sample, 4, "bbox_targets"), (batch.point_targets, batch.point_sample, 2, "point_targets")):
        if targets is None:
            continue
        if targets.ndim != 2 or targets.shape[1] != width:
            raise SchemaError(f"{name} must have shape [K, {width}], got {tuple(targets.shape)}")
        if owner is None or owner.shape != (targets.shape[0],):
            raise SchemaError(f"{name} needs its owner tensor ({name.split('_')[0]}_sample) with one sample per row")
        if targets.shape[0] and (int(owner.min()) < 0 or int(owner.max()) >= B):
            raise SchemaError(f"{name}: owner sample out of range [0, {B})")
        if batch.coordinate_system is None:
            raise SchemaError(f"{name} given without coordinate_system; say which system the coordinates are in")
    if batch.screen_size is not None and batch.screen_size.shape != (B, 2):
        raise SchemaError(f"screen_size has shape {tuple(batch.screen_size.shape)}; expected ({B}, 2) (width, height)")


def _check_span_bounds(name: str, table: SpanTable, lengths: Tensor, *, allow_empty: bool) -> None:
    if not table.num_spans:
        return
    sample = table.span_sample()
    bad = (table.starts < 0) | (table.ends.long() > lengths.to(table.device)[sample]) | (table.ends < table.starts)
    if not allow_empty:
        bad |= table.ends == table.starts
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        b = int(sample[i])
        raise SchemaError(
            f"{name}: sample {b}, span [{int(table.starts[i])}, {int(table.ends[i])}) is empty or out of range "
            f"(the sample has {int(lengths[b])} tokens)"
        )


def _check_sorted_disjoint(name: str, table: SpanTable) -> None:
    sample = table.span_sample()
    same = sample[1:] == sample[:-1]
    bad = same & (table.starts[1:] < table.ends[:-1])
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0]) + 1
        raise SchemaError(
            f"{name}: sample {int(sample[i])}, span {_span_name(table, i)} overlaps or precedes span {_span_name(table, i - 1)}; "
            "spans must be sorted and disjoint"
        )


def _check_media(batch: RLBatch, lengths: Tensor) -> None:
    ms = batch.modality_spans
    M = len(batch.media_ids)
    per_item = {
        "media_cache_keys": len(batch.media_cache_keys),
        "media_modality": None if batch.media_modality is None else batch.media_modality.numel(),
        "media_sample": None if batch.media_sample is None else batch.media_sample.numel(),
        "media_grid_thw": None if batch.media_grid_thw is None else batch.media_grid_thw.shape[0],
        "vision_token_offsets": None if batch.vision_token_offsets is None else batch.vision_token_offsets.numel(),
    }
    for name, n in per_item.items():
        if (n or 0) != M:
            raise SchemaError(f"{name} has {n or 0} entries; media_ids has {M} (one per media item)")
    media_spans = ms.modality != int(Modality.TEXT)
    n_media_spans = int(media_spans.sum())
    if n_media_spans != M:
        raise SchemaError(f"modality_spans has {n_media_spans} media spans but the batch lists {M} media items; each item has exactly one span")
    text_with_index = (~media_spans) & (ms.media_index >= 0)
    if bool(text_with_index.any()):
        i = int(torch.nonzero(text_with_index)[0])
        raise SchemaError(f"modality_spans: text span {_span_name(ms, i)} of sample {int(ms.span_sample()[i])} carries a media index")
    if M == 0:
        return
    idx = ms.media_index[media_spans].long()
    if int(idx.min()) < 0 or int(idx.max()) >= M or torch.unique(idx).numel() != M:
        raise SchemaError(f"modality_spans: media spans must reference each of the {M} media items exactly once, got indices {idx.tolist()[:16]}")
    span_ids = torch.nonzero(media_spans).flatten()
    sample = ms.span_sample()[span_ids]
    wrong_sample = batch.media_sample.to(ms.device)[idx] != sample
    wrong_mod = batch.media_modality.to(ms.device)[idx] != ms.modality[span_ids]
    for bad, what in ((wrong_sample, "media_sample"), (wrong_mod, "media_modality")):
        if bool(bad.any()):
            k = int(torch.nonzero(bad)[0])
            raise SchemaError(f"modality_spans: sample {int(sample[k])}, span {_span_name(ms, int(span_ids[k]))} disagrees with {what}[{int(idx[k])}]")
    counts = media_token_counts(batch.media_grid_thw, batch.spatial_merge_size).to(ms.device)
    span_len = ms.lengths()[span_ids].long()
    mismatch = span_len != counts[idx]
    if bool(mismatch.any()):
        k = int(torch.nonzero(mismatch)[0])
        g = int(idx[k])
        grid = batch.media_grid_thw[g].tolist()
        b = int(sample[k])
        at_end = int(ms.ends[span_ids[k]]) == int(lengths[b])
        hint = (
            "; the media span was cut by truncation: raise the prompt length limit or lower max_pixels"
            if at_end and int(span_len[k]) < int(counts[g])
            else "; the placeholders and the grid come from different processing (another size or max_pixels?)"
        )
        raise SchemaError(
            f"modality_spans: sample {b}, {_span_name(ms, int(span_ids[k]))} has {int(span_len[k])} placeholder tokens "
            f"but grid_thw {grid} of media item {g} implies {int(counts[g])} (t*h*w/{batch.spatial_merge_size}²){hint}"
        )
    expected = vision_token_offsets(batch.media_grid_thw, batch.media_modality, batch.spatial_merge_size)
    if not torch.equal(expected.cpu(), batch.vision_token_offsets.long().cpu()):
        g = int(torch.nonzero(expected.cpu() != batch.vision_token_offsets.long().cpu())[0])
        raise SchemaError(
            f"vision_token_offsets[{g}] is {int(batch.vision_token_offsets[g])}, expected {int(expected[g])}: "
            "the row offset of the item in its modality's vision-tower output (order of the grids)"
        )
