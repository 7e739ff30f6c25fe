"""Per-sample parts ↔ batch fields: how builders, ``select`` and ``concat`` make a batch.

A batch is assembled from ``SampleParts`` (one sample's slice of every field, media
numbered 0.. within the sample) and split back into them by ``sample_parts``. Assembly
orders the media images-then-videos by sample (the order of ``image_grid_thw`` and
``video_grid_thw``) and returns the fields as a dict: ``RLBatch(**fields)`` validates them.
The optional per-sample fields it fills are named by the caller (``present``), so a
selection keeps every field of its batch, even one that its samples leave empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .media import MediaItem, offsets, token_counts
from .spans import Modality, Span, SpanTable

__all__ = ["assemble", "present_fields", "SAMPLE_FIELDS", "sample_parts", "SampleParts"]

Tensor = torch.Tensor

#: the optional per-sample fields (and grounding tables) a batch has or lacks as a whole
SAMPLE_FIELDS = (
    "group_ids", "rewards", "costs", "prompt_lengths", "region_spans", "region_rewards",
    "action_spans", "turn_rewards", "bbox_targets", "point_targets", "screen_size",
)


@dataclass
class SampleParts:
    """One sample's slice of every field, with media renumbered 0.. within the sample."""

    input_ids: Tensor
    position_ids: Tensor
    modality_spans: list[Span]
    loss_spans: list[Span]
    media: list[MediaItem]
    group_id: Optional[str] = None
    reward: Optional[float] = None
    cost: Optional[float] = None
    prompt_length: Optional[int] = None
    region_spans: list[Span] = field(default_factory=list)
    region_rewards: list[float] = field(default_factory=list)
    action_spans: list[Span] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    bboxes: Optional[Tensor] = None  # [k, 4] rows of this sample
    points: Optional[Tensor] = None
    screen_size: Optional[Tensor] = None


def sample_parts(batch, b: int, pixels: list[Optional[Tensor]]) -> SampleParts:
    """Sample ``b`` of an ``RLBatch`` as parts (media renumbered within the sample);
    ``pixels`` is ``batch.media_pixel_rows()``."""
    lo, hi = int(batch.cu_seqlens[b]), int(batch.cu_seqlens[b + 1])
    media_here = [] if batch.media_sample is None else torch.nonzero(batch.media_sample == b).flatten().tolist()
    local = {g: i for i, g in enumerate(media_here)}
    media = [
        MediaItem(
            modality=Modality(int(batch.media_modality[g])),
            grid=batch.media_grid_thw[g].clone(),
            pixels=pixels[g],
            second_per_grid=_second_per_grid(batch, g),
            key=batch.media_cache_keys[g],
            id=batch.media_ids[g],
        )
        for g in media_here
    ]
    spans = [
        Span(s.start, s.end, s.modality, local[s.media_index] if s.media_index >= 0 else -1)
        for s in batch.modality_spans.spans_of(b)
    ]

    def rows(values: Optional[Tensor], owner: Optional[Tensor]) -> Optional[Tensor]:
        return None if values is None else values[owner == b]

    def span_values(table: Optional[SpanTable], values: Optional[Tensor]) -> tuple[list[Span], list[float]]:
        if table is None:
            return [], []
        lo_s, hi_s = int(table.sample_ptr[b]), int(table.sample_ptr[b + 1])
        return table.spans_of(b), ([] if values is None else values[lo_s:hi_s].tolist())

    region, region_rewards = span_values(batch.region_spans, batch.region_rewards)
    action, turn_rewards = span_values(batch.action_spans, batch.turn_rewards)
    return SampleParts(
        input_ids=batch.input_ids[lo:hi],
        position_ids=batch.position_ids[:, lo:hi],
        modality_spans=spans,
        loss_spans=batch.loss_spans.spans_of(b),
        media=media,
        group_id=None if batch.group_ids is None else batch.group_ids[b],
        reward=None if batch.rewards is None else float(batch.rewards[b]),
        cost=None if batch.costs is None else float(batch.costs[b]),
        prompt_length=None if batch.prompt_lengths is None else int(batch.prompt_lengths[b]),
        region_spans=region,
        region_rewards=region_rewards,
        action_spans=action,
        turn_rewards=turn_rewards,
        bboxes=rows(batch.bbox_targets, batch.bbox_sample),
        points=rows(batch.point_targets, batch.point_sample),
        screen_size=None if batch.screen_size is None else batch.screen_size[b],
    )


def _second_per_grid(batch, g: int) -> Optional[float]:
    if batch.second_per_grid_ts is None or int(batch.media_modality[g]) != int(Modality.VIDEO):
        return None
    video_rank = int((batch.media_modality[:g] == int(Modality.VIDEO)).sum())
    return float(batch.second_per_grid_ts[video_rank])


def present_fields(batch) -> frozenset[str]:
    """The optional per-sample fields ``batch`` has (``SAMPLE_FIELDS``)."""
    return frozenset(name for name in SAMPLE_FIELDS if getattr(batch, name) is not None)


def assemble(parts: Sequence[SampleParts], *, present: frozenset[str], processor_fingerprint: str, device=None, **common) -> dict:
    """A batch's fields from per-sample parts on ``device`` (default CPU): media ordered
    images-then-videos by sample, and each optional field named in ``present`` filled from
    the parts (empty where they hold none).

    ``common`` holds the batch-wide fields (token ids of the placeholders, merge size,
    coordinate system)."""
    B = len(parts)
    ids = [p.input_ids.long().cpu() for p in parts]
    lengths = torch.tensor([t.numel() for t in ids], dtype=torch.int64)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    order: list[tuple[int, int]] = []  # (sample, item within it), images of every sample first
    for modality in (Modality.IMAGE, Modality.VIDEO, Modality.AUDIO):
        order += [(b, j) for b, p in enumerate(parts) for j, m in enumerate(p.media) if m.modality == modality]
    global_index = {key: g for g, key in enumerate(order)}
    media = [parts[b].media[j] for b, j in order]
    mod_spans = [
        [Span(s.start, s.end, s.modality, global_index[(b, s.media_index)] if s.media_index >= 0 else -1) for s in p.modality_spans]
        for b, p in enumerate(parts)
    ]
    values: dict = dict(common)
    values.update(
        input_ids=torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64),
        cu_seqlens=cu,
        position_ids=torch.cat([p.position_ids.long().cpu() for p in parts], dim=1) if parts else torch.zeros(3, 0, dtype=torch.int64),
        modality_spans=SpanTable.from_lists(mod_spans),
        loss_spans=SpanTable.from_lists([p.loss_spans for p in parts]),
        processor_fingerprint=processor_fingerprint,
        media_ids=[m.id for m in media],
        media_cache_keys=[m.key for m in media],
    )
    if media:
        values.update(_media_fields(media, [b for b, _ in order], common.get("spatial_merge_size", 2)))
    if "group_ids" in present:
        values["group_ids"] = [p.group_id for p in parts]
    for name, attr in (("rewards", "reward"), ("costs", "cost")):
        if name in present:
            values[name] = torch.tensor([getattr(p, attr) for p in parts], dtype=torch.float32)
    if "prompt_lengths" in present:
        values["prompt_lengths"] = torch.tensor([p.prompt_length for p in parts], dtype=torch.int64)
    for spans, rewards in (("region_spans", "region_rewards"), ("action_spans", "turn_rewards")):
        if spans in present:
            values[spans] = SpanTable.from_lists([getattr(p, spans) for p in parts])
        if rewards in present:
            values[rewards] = torch.tensor([r for p in parts for r in getattr(p, rewards)], dtype=torch.float32)
    for name, owner, attr, width in (("bbox_targets", "bbox_sample", "bboxes", 4), ("point_targets", "point_sample", "points", 2)):
        if name in present:
            rows = [getattr(p, attr).cpu() for p in parts]
            values[name] = torch.cat([torch.zeros(0, width), *rows]).float()
            values[owner] = torch.cat([torch.zeros(0, dtype=torch.int64), *(torch.full((len(r),), b, dtype=torch.int64) for b, r in enumerate(rows))])
    if "screen_size" in present:
        values["screen_size"] = torch.stack([p.screen_size.long().cpu() for p in parts]) if parts else torch.zeros(0, 2, dtype=torch.int64)
    return {k: v.to(device) if isinstance(v, (Tensor, SpanTable)) and device is not None else v for k, v in values.items()}


def _media_fields(media: list[MediaItem], owners: list[int], merge: int) -> dict:
    """The per-item fields and the model inputs (grids, pixel rows) of the ordered items."""
    grid = torch.stack([m.grid.long().cpu() for m in media])
    modality = torch.tensor([int(m.modality) for m in media], dtype=torch.int8)
    values = dict(
        media_modality=modality,
        media_sample=torch.tensor(owners, dtype=torch.int64),
        media_grid_thw=grid,
        vision_token_offsets=offsets(token_counts(grid, merge), modality),
    )
    for mod, pix_name, grid_name in ((Modality.IMAGE, "pixel_values", "image_grid_thw"), (Modality.VIDEO, "pixel_values_videos", "video_grid_thw")):
        items = [m for m in media if m.modality == mod]
        if not items:
            continue
        values[grid_name] = torch.stack([m.grid.long().cpu() for m in items])
        if all(m.pixels is not None for m in items):
            values[pix_name] = torch.cat([m.pixels.cpu() for m in items])
    videos = [m for m in media if m.modality == Modality.VIDEO]
    if videos and all(m.second_per_grid is not None for m in videos):
        values["second_per_grid_ts"] = torch.tensor([m.second_per_grid for m in videos], dtype=torch.float32)
    return values
