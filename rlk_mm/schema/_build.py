"""The builders' core: per-sample prompt and response tokens plus media → batch fields.

``build`` is shared by ``from_qwen_vl``, ``from_token_lists`` and ``from_verl``: it finds
each media item's placeholder run, takes the item's grid and pixel rows in order, computes
M-RoPE positions with the algorithm of transformers' ``Qwen2_5_VLModel.get_rope_index``
(bitwise equal; tested against the real model) unless the caller passes the positions its
framework used, and assembles the fields (``RLBatch(**fields)`` validates them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ._assemble import SampleParts, assemble
from .media import MediaItem, default_media_id, media_cache_key, media_token_counts, processor_fingerprint
from .spans import Modality, SchemaError, Span, spans_from_mask

Tensor = torch.Tensor


@dataclass(frozen=True)
class LayoutInfo:
    """What the builder needs to know about a processor."""

    fingerprint: str
    image_token_id: int
    video_token_id: int
    merge_size: int
    tokens_per_second: Optional[float]  # Qwen2.5-VL temporal spacing; None for Qwen2-VL
    pad_token_id: Optional[int]

    @classmethod
    def of(cls, processor: Any, tokens_per_second: Optional[float] = None) -> "LayoutInfo":
        tokenizer = getattr(processor, "tokenizer", processor)
        image_id = getattr(processor, "image_token_id", None) or tokenizer.convert_tokens_to_ids("<|image_pad|>")
        video_id = getattr(processor, "video_token_id", None) or tokenizer.convert_tokens_to_ids("<|video_pad|>")
        image_processor = getattr(processor, "image_processor", None)
        merge = int(getattr(image_processor, "merge_size", 2) or 2)
        if tokens_per_second is None and "2_5" in type(processor).__name__:
            tokens_per_second = 2.0  # Qwen2.5-VL's vision_config.tokens_per_second default
        return cls(processor_fingerprint(processor), int(image_id), int(video_id), merge, tokens_per_second, tokenizer.pad_token_id)


# ---------------------------------------------------------------------- M-RoPE positions
def mrope_positions(
    ids: Tensor,
    media: Sequence[tuple[int, int, Tensor, Optional[float]]],
    merge_size: int,
    tokens_per_second: Optional[float],
) -> Tensor:
    """int64 (3, L) positions of one unpadded sequence, as Qwen2(.5)-VL's ``get_rope_index``.

    ``media``: (start, modality, grid_thw, second_per_grid) for each media span in order.
    Text runs continue from the current position; a media item of grid (t, h, w) gets
    t/h/w indices offset by the current position, which then advances by max(h, w)/merge.
    """
    L = ids.numel()
    out = torch.empty(3, L, dtype=torch.int64)
    current, cursor = 0, 0
    for start, modality, grid, second in media:
        if start > cursor:
            n = start - cursor
            out[:, cursor:start] = torch.arange(n, dtype=torch.int64) + current
            current += n
        t, h, w = int(grid[0]), int(grid[1]) // merge_size, int(grid[2]) // merge_size
        interval = 1.0
        if modality == Modality.VIDEO and tokens_per_second is not None:
            interval = tokens_per_second * (1.0 if second is None else second)
        pt = (torch.arange(t) * torch.tensor(interval, dtype=torch.float32)).long()
        ph = torch.arange(h) + current
        pw = torch.arange(w) + current
        tt, hh, ww = torch.meshgrid(pt, ph, pw, indexing="ij")
        vis = torch.stack([tt, hh, ww]).reshape(3, -1)
        vis[0] += current
        out[:, start : start + vis.shape[1]] = vis
        cursor = start + vis.shape[1]
        current += max(int(grid[1]), int(grid[2])) // merge_size
    if cursor < L:
        out[:, cursor:] = torch.arange(L - cursor, dtype=torch.int64) + current
    return out


# ---------------------------------------------------------------------- media placement
@dataclass
class _MediaPool:
    """Grids and pixel rows of one modality across the batch, consumed in order."""

    modality: Modality
    grids: Tensor  # [N, 3]
    pixels: Optional[Tensor]
    seconds: Optional[Tensor]
    next: int = 0
    row: int = 0

    def take(self) -> MediaItem:
        grid = self.grids[self.next]
        rows = int(grid.prod())
        pix = None if self.pixels is None else self.pixels[self.row : self.row + rows]
        if pix is not None and pix.shape[0] != rows:
            raise SchemaError(
                f"{'pixel_values' if self.modality == Modality.IMAGE else 'pixel_values_videos'} has too few rows "
                f"for {self.modality.label} {self.next} (grid {grid.tolist()} needs {rows})"
            )
        second = None if self.seconds is None else float(self.seconds[self.next])
        self.next += 1
        self.row += rows
        return MediaItem(self.modality, grid.long(), pix, second)

    @property
    def remaining(self) -> int:
        return self.grids.shape[0] - self.next


@dataclass
class _Placed:
    """A media item and its placeholder tokens ``[start, end)`` in the sample."""

    start: int
    end: int
    media: MediaItem


def _place_media(b: int, prompt: Tensor, pools: dict, info: LayoutInfo) -> list[_Placed]:
    """Each media item of the prompt at its placeholder run (runs split by the next grids), in order."""
    P = prompt.numel()
    tokens = {Modality.IMAGE: info.image_token_id, Modality.VIDEO: info.video_token_id}
    placed = []
    for mod, token in tokens.items():
        for run in spans_from_mask(prompt == token):
            cursor = run.start
            while cursor < run.end:
                pool = pools[mod]
                if pool.remaining == 0:
                    raise SchemaError(
                        f"input_ids: sample {b} has {mod.label} placeholders at positions [{cursor}, {run.end}) "
                        f"but {mod.label}_grid_thw has no item left for them ({pool.grids.shape[0]} items in all): "
                        f"the placeholder count does not match the grids"
                    )
                item = pool.take()
                need = int(media_token_counts(item.grid, info.merge_size)[0])
                have = run.end - cursor
                if have < need:
                    hint = (
                        "the media span was cut by truncation: raise the prompt length limit (max_prompt_length) "
                        "or lower max_pixels so the item needs fewer tokens"
                        if run.end == P
                        else "the placeholder count does not match the grid (was the image re-processed at another size?)"
                    )
                    raise SchemaError(
                        f"modality_spans: sample {b}, {mod.label} {pool.next - 1} at positions [{cursor}, {run.end}) has "
                        f"{have} placeholder tokens but {mod.label}_grid_thw {item.grid.tolist()} implies {need}; {hint}"
                    )
                placed.append(_Placed(cursor, cursor + need, item))
                cursor += need
    return sorted(placed, key=lambda p: p.start)


def _check_response(b: int, prompt: Tensor, response: Tensor, info: LayoutInfo) -> None:
    for mod, token in ((Modality.IMAGE, info.image_token_id), (Modality.VIDEO, info.video_token_id)):
        hit = torch.nonzero(response == token).flatten()
        if hit.numel():
            raise SchemaError(
                f"responses: sample {b}, response position {int(hit[0])} (sequence position {prompt.numel() + int(hit[0])}) "
                f"is the {mod.label} placeholder token {token}: the policy generated a media placeholder; "
                "mask or reject this response before building the batch"
            )


# ---------------------------------------------------------------------- the core
def build(
    prompts: Sequence[Tensor],
    responses: Sequence[Optional[Tensor]],
    info: LayoutInfo,
    *,
    image_grid_thw: Optional[Tensor] = None,
    video_grid_thw: Optional[Tensor] = None,
    pixel_values: Optional[Tensor] = None,
    pixel_values_videos: Optional[Tensor] = None,
    second_per_grid_ts: Optional[Tensor] = None,
    position_ids: Optional[Sequence[Tensor]] = None,
    loss_masks: Optional[Sequence[Tensor]] = None,
    group_ids=None,
    rewards=None,
    costs=None,
    media_ids: Optional[Sequence[str]] = None,
    media_cache_keys: Optional[Sequence[str]] = None,
) -> dict:
    """A batch's fields from unpadded per-sample prompts (placeholders expanded) and responses.

    Loss spans are the responses (EOS included), or the runs of ``loss_masks`` (one bool per
    prompt + response token). ``position_ids``: per-sample (3, L) positions to record instead
    of computing them."""
    pools = {
        Modality.IMAGE: _MediaPool(Modality.IMAGE, _grid(image_grid_thw), pixel_values, None),
        Modality.VIDEO: _MediaPool(Modality.VIDEO, _grid(video_grid_thw), pixel_values_videos, second_per_grid_ts),
    }
    B = len(prompts)
    group_ids = per_sample("group_ids", group_ids, B)
    rewards = per_sample("rewards", rewards, B)
    costs = per_sample("costs", costs, B)
    has_responses = any(r is not None and r.numel() for r in responses)
    previous = _PreviousSample()
    parts: list[SampleParts] = []
    for b in range(B):
        prompt = prompts[b].long().cpu()
        response = responses[b]
        response = torch.zeros(0, dtype=torch.int64) if response is None else response.long().cpu()
        _check_response(b, prompt, response, info)
        ids = torch.cat([prompt, response])
        P, L = prompt.numel(), ids.numel()
        placed = _place_media(b, prompt, pools, info)
        keys = previous.media_keys(placed, info)
        spans, cursor = [], 0
        for j, (p, key) in enumerate(zip(placed, keys)):
            if p.start > cursor:
                spans.append(Span(cursor, p.start))
            spans.append(Span(p.start, p.end, p.media.modality, j))
            p.media.key = key
            cursor = p.end
        if cursor < L:
            spans.append(Span(cursor, L))
        if position_ids is not None:
            pos = position_ids[b].long().cpu()
            if pos.shape != (3, L):
                raise SchemaError(f"position_ids: sample {b} has shape {tuple(pos.shape)}, expected (3, {L})")
        else:
            pos = previous.positions(prompt, ids, placed, info)
        previous.remember(prompt, placed, keys)
        if loss_masks is not None:
            mask = loss_masks[b].bool().cpu()
            if mask.numel() != L:
                raise SchemaError(f"loss mask: sample {b} has {mask.numel()} entries for {L} tokens")
            loss = spans_from_mask(mask)
        else:
            loss = [Span(P, L)] if L > P else []
        parts.append(SampleParts(
            input_ids=ids, position_ids=pos, modality_spans=spans, loss_spans=loss, media=[p.media for p in placed],
            group_id=group_ids[b], reward=rewards[b], cost=costs[b], prompt_length=P if has_responses else None,
        ))
    for mod, pool in pools.items():
        if pool.remaining:
            raise SchemaError(
                f"{mod.label}_grid_thw has {pool.grids.shape[0]} items but the prompts hold placeholders for "
                f"{pool.next}: a media span was cut by truncation (raise the prompt length limit or lower max_pixels) "
                "or placeholders were removed"
            )
    _name_media(parts, media_ids, media_cache_keys)
    return assemble(
        parts,
        processor_fingerprint=info.fingerprint,
        image_token_id=info.image_token_id,
        video_token_id=info.video_token_id,
        spatial_merge_size=info.merge_size,
    )


class _PreviousSample:
    """The previous sample's prompt, media, media keys and prompt positions. A GRPO batch
    repeats each prompt G times in a row: an equal media item reuses its content key, and
    an equal prompt with equal media its M-RoPE positions (the response continues the
    text after them), instead of recomputing them per sample."""

    def __init__(self):
        self.prompt: Optional[Tensor] = None
        self.placed: list[_Placed] = []
        self.keys: list[Optional[str]] = []
        self.prompt_positions: Optional[Tensor] = None

    def media_keys(self, placed: list[_Placed], info: LayoutInfo) -> list[Optional[str]]:
        """Content key of each item (None without pixels); the previous sample's key where
        the item at the same index has the same modality, grid and pixel rows."""
        keys = []
        for j, p in enumerate(placed):
            item = p.media
            prev = self.placed[j].media if j < len(self.placed) else None
            if item.pixels is None:
                keys.append(None)
            elif (prev is not None and prev.pixels is not None and prev.modality == item.modality
                  and torch.equal(prev.grid, item.grid) and torch.equal(prev.pixels, item.pixels)):
                keys.append(self.keys[j])
            else:
                keys.append(media_cache_key(item.pixels, item.grid, item.modality.label, info.fingerprint))
        return keys

    def positions(self, prompt: Tensor, ids: Tensor, placed: list[_Placed], info: LayoutInfo) -> Tensor:
        media = [(p.start, p.media.modality, p.media.grid, p.media.second_per_grid) for p in placed]
        if placed and placed[-1].end >= prompt.numel():  # the prompt ends in a media span: no text to continue
            self.prompt_positions = None
            return mrope_positions(ids, media, info.merge_size, info.tokens_per_second)
        same = (
            self.prompt_positions is not None
            and torch.equal(self.prompt, prompt)
            and len(placed) == len(self.placed)
            and all(a.media.modality == b.media.modality and torch.equal(a.media.grid, b.media.grid)
                    and a.media.second_per_grid == b.media.second_per_grid for a, b in zip(placed, self.placed))
        )
        if not same:
            self.prompt_positions = mrope_positions(prompt, media, info.merge_size, info.tokens_per_second)
        response = torch.arange(1, ids.numel() - prompt.numel() + 1, dtype=torch.int64)
        return torch.cat([self.prompt_positions, self.prompt_positions[:, -1:] + response], dim=1)

    def remember(self, prompt: Tensor, placed: list[_Placed], keys: list[Optional[str]]) -> None:
        self.prompt, self.placed, self.keys = prompt, placed, keys


def _grid(grid: Optional[Tensor]) -> Tensor:
    return torch.zeros(0, 3, dtype=torch.int64) if grid is None else torch.as_tensor(grid).long().reshape(-1, 3).cpu()


def per_sample(name: str, values, B: int) -> list:
    """One value per sample (None for all when ``values`` is None); group ids as str, others as float."""
    if values is None:
        return [None] * B
    values = values.tolist() if isinstance(values, Tensor) else list(values)
    if len(values) != B:
        raise SchemaError(f"{name} has {len(values)} entries; expected one per sample ({B})")
    if name == "group_ids":
        return [str(v) for v in values]
    return [float(v) for v in values]


def _name_media(parts: list[SampleParts], media_ids, media_cache_keys) -> None:
    """Fill media ids and keys in the batch's media order (images, then videos)."""
    order = [m for mod in (Modality.IMAGE, Modality.VIDEO) for p in parts for m in p.media if m.modality == mod]
    for name, given in (("media_ids", media_ids), ("media_cache_keys", media_cache_keys)):
        if given is not None and len(given) != len(order):
            raise SchemaError(f"{name} has {len(given)} entries; the batch has {len(order)} media items (images first, then videos)")
    for g, m in enumerate(order):
        if media_cache_keys is not None:
            m.key = str(media_cache_keys[g])
        if m.key is None:
            raise SchemaError(
                f"media item {g} ({m.modality.label}) has no pixel values to hash: pass pixel_values/pixel_values_videos "
                "or media_cache_keys"
            )
        m.id = str(media_ids[g]) if media_ids is not None else default_media_id(m.key, m.modality.label)


# ---------------------------------------------------------------------- padded inputs
def unpad(row: Tensor, mask: Tensor, what: str, b: int) -> Tensor:
    """The entries of ``row`` where ``mask`` is set: one contiguous run (left or right padding)."""
    mask = mask.bool()
    kept = torch.nonzero(mask).flatten()
    if kept.numel() and int(kept[-1] - kept[0]) + 1 != kept.numel():
        raise SchemaError(f"{what}: sample {b}'s attention mask has holes; expected one contiguous run of real tokens (left or right padding)")
    return row[mask]


def unpad_positions(position_ids: Tensor, b: int, mask: Tensor, *, batch_first: bool) -> Tensor:
    """(3, L) positions of sample b from padded positions: (B, L) 1-D, or 3-D as
    (B, 4, L) / (B, 3, L) when ``batch_first`` (verl) else (3, B, L) (transformers)."""
    keep = mask.bool()
    if position_ids.ndim == 2:
        return position_ids[b][keep].unsqueeze(0).expand(3, -1).clone()
    if position_ids.ndim == 3 and batch_first and position_ids.shape[1] == 4:
        return position_ids[b, 1:][:, keep]  # verl: row 0 text positions, rows 1-3 M-RoPE
    if position_ids.ndim == 3 and batch_first and position_ids.shape[1] == 3:
        return position_ids[b][:, keep]
    if position_ids.ndim == 3 and not batch_first and position_ids.shape[0] == 3:
        return position_ids[:, b][:, keep]
    expected = "(B, L), (B, 3, L) or (B, 4, L)" if batch_first else "(B, L) or (3, B, L)"
    raise SchemaError(f"position_ids has shape {tuple(position_ids.shape)}; expected {expected}")
