"""Build an ``RLBatch`` from what Qwen2-VL / Qwen2.5-VL pipelines produce.

Three entry points share one core (``_build``):
- ``from_qwen_vl``: a processor output (left- or right-padded), plus rollout responses;
- ``from_verl``: verl-style tensors (left-padded prompt + right-padded response);
- ``from_token_lists``: raw token lists as a rollout engine returns them.

Positions are computed here with the same algorithm as transformers'
``Qwen2_5_VLModel.get_rope_index`` (bitwise equal; tested against the real model),
unless the caller passes the positions its framework actually used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .batch import RLBatch, _SampleParts, assemble, media_token_counts
from .media import default_media_id, media_cache_key, processor_fingerprint
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


# ---------------------------------------------------------------------- core
@dataclass
class _MediaPool:
    """Grids and pixel rows of one modality across the batch, consumed in order."""

    modality: Modality
    grids: Tensor  # [N, 3]
    pixels: Optional[Tensor]
    seconds: Optional[Tensor]
    next: int = 0
    row: int = 0

    def take(self) -> tuple[Tensor, Optional[Tensor], Optional[float]]:
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
        return grid, pix, second

    @property
    def remaining(self) -> int:
        return self.grids.shape[0] - self.next


def _media_runs(ids: Tensor, token: int) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in spans_from_mask(ids == token)]


def _build(
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
) -> RLBatch:
    pools = {
        Modality.IMAGE: _MediaPool(Modality.IMAGE, _grid(image_grid_thw), pixel_values, None),
        Modality.VIDEO: _MediaPool(Modality.VIDEO, _grid(video_grid_thw), pixel_values_videos, second_per_grid_ts),
    }
    tokens = {Modality.IMAGE: info.image_token_id, Modality.VIDEO: info.video_token_id}
    labels = {Modality.IMAGE: "image", Modality.VIDEO: "video"}
    parts: list[_SampleParts] = []
    B = len(prompts)
    group_ids = _per_sample("group_ids", group_ids, B)
    rewards = _per_sample("rewards", rewards, B)
    costs = _per_sample("costs", costs, B)
    previous = _PreviousSample()
    for b in range(B):
        prompt = prompts[b].long().cpu()
        response = responses[b]
        response = torch.zeros(0, dtype=torch.int64) if response is None else response.long().cpu()
        for mod, tok in tokens.items():
            hit = torch.nonzero(response == tok).flatten()
            if hit.numel():
                raise SchemaError(
                    f"responses: sample {b}, response position {int(hit[0])} (sequence position {prompt.numel() + int(hit[0])}) "
                    f"is the {labels[mod]} placeholder token {tok}: the policy generated a media placeholder; "
                    "mask or reject this response before building the batch"
                )
        ids = torch.cat([prompt, response])
        P, L = prompt.numel(), ids.numel()
        # media spans: runs of placeholders, each split into items by the next grids
        items = []  # (start, end, modality, grid, pixels, second)
        for mod in (Modality.IMAGE, Modality.VIDEO):
            for run_start, run_end in _media_runs(prompt, tokens[mod]):
                cursor = run_start
                while cursor < run_end:
                    pool = pools[mod]
                    if pool.remaining == 0:
                        raise SchemaError(
                            f"input_ids: sample {b} has {labels[mod]} placeholders at positions [{cursor}, {run_end}) "
                            f"but {labels[mod]}_grid_thw has no item left for them ({pool.grids.shape[0]} items in all): "
                            f"the placeholder count does not match the grids"
                        )
                    grid, pix, second = pool.take()
                    need = int(media_token_counts(grid, info.merge_size)[0])
                    have = run_end - cursor
                    if have < need:
                        truncated = run_end == P
                        hint = (
                            "the media span was cut by truncation: raise the prompt length limit (max_prompt_length) "
                            "or lower max_pixels so the item needs fewer tokens"
                            if truncated
                            else "the placeholder count does not match the grid (was the image re-processed at another size?)"
                        )
                        raise SchemaError(
                            f"modality_spans: sample {b}, {labels[mod]} {pool.next - 1} at positions [{cursor}, {run_end}) has "
                            f"{have} placeholder tokens but {labels[mod]}_grid_thw {grid.tolist()} implies {need}; {hint}"
                        )
                    items.append((cursor, cursor + need, mod, grid, pix, second))
                    cursor += need
        items.sort(key=lambda it: it[0])
        spans, media, cursor = [], [], 0
        keys = previous.media_keys(items, info)
        for j, (start, end, mod, grid, pix, second) in enumerate(items):
            if start > cursor:
                spans.append(Span(cursor, start))
            spans.append(Span(start, end, mod, j))
            key = keys[j]
            media.append(dict(modality=mod, grid=grid.long(), id=None, key=key, pixels=pix, second_per_grid=second))
            cursor = end
        if cursor < L:
            spans.append(Span(cursor, L))
        # positions
        if position_ids is not None:
            pos = position_ids[b].long().cpu()
            if pos.shape != (3, L):
                raise SchemaError(f"position_ids: sample {b} has shape {tuple(pos.shape)}, expected (3, {L})")
        else:
            pos = previous.positions(prompt, ids, items, info)
        previous.remember(prompt, items, keys)
        # loss spans: the response (EOS included) and/or the assistant mask
        if loss_masks is not None:
            mask = loss_masks[b].bool().cpu()
            if mask.numel() != L:
                raise SchemaError(f"loss mask: sample {b} has {mask.numel()} entries for {L} tokens")
            loss = spans_from_mask(mask)
        else:
            loss = [Span(P, L)] if L > P else []
        parts.append(
            _SampleParts(
                input_ids=ids,
                position_ids=pos,
                modality_spans=spans,
                loss_spans=loss,
                media=media,
                group_id=group_ids[b],
                reward=rewards[b],
                cost=costs[b],
                prompt_length=P if any(r is not None and r.numel() for r in responses) else None,
            )
        )
    for mod, pool in pools.items():
        if pool.remaining:
            raise SchemaError(
                f"{labels[mod]}_grid_thw has {pool.grids.shape[0]} items but the prompts hold placeholders for "
                f"{pool.next}: a media span was cut by truncation (raise the prompt length limit or lower max_pixels) "
                "or placeholders were removed"
            )
    _name_media(parts, info, media_ids, media_cache_keys)
    return assemble(
        parts,
        processor_fingerprint=info.fingerprint,
        image_token_id=info.image_token_id,
        video_token_id=info.video_token_id,
        spatial_merge_size=info.merge_size,
    )


class _PreviousSample:
    """The previous sample's prompt, media items, media keys and prompt positions. A GRPO
    batch repeats each prompt G times in a row: an equal media item reuses its content key,
    and an equal prompt with equal media its M-RoPE positions (the response continues the
    text after them), instead of recomputing them per sample."""

    def __init__(self):
        self.prompt: Optional[Tensor] = None
        self.items: list = []  # (start, end, modality, grid, pixels, second) per item
        self.keys: list = []
        self.prompt_positions: Optional[Tensor] = None

    def media_keys(self, items: list, info: LayoutInfo) -> list[Optional[str]]:
        """Content key of each item (None without pixels); the previous sample's key where
        the item at the same index has the same modality, grid and pixel rows."""
        keys = []
        for j, (_, _, mod, grid, pix, _) in enumerate(items):
            prev = self.items[j] if j < len(self.items) else None
            if pix is None:
                keys.append(None)
            elif prev is not None and prev[4] is not None and prev[2] == mod and torch.equal(prev[3], grid) and torch.equal(prev[4], pix):
                keys.append(self.keys[j])
            else:
                keys.append(media_cache_key(pix, grid, mod.label, info.fingerprint))
        return keys

    def positions(self, prompt: Tensor, ids: Tensor, items: list, info: LayoutInfo) -> Tensor:
        media = [(s, m, g, sec) for s, _, m, g, _, sec in items]
        if items and items[-1][1] >= prompt.numel():  # the prompt ends in a media span: no text to continue
            self.prompt_positions = None
            return mrope_positions(ids, media, info.merge_size, info.tokens_per_second)
        same = (
            self.prompt_positions is not None
            and torch.equal(self.prompt, prompt)
            and len(items) == len(self.items)
            and all(a[2] == b[2] and torch.equal(a[3], b[3]) and a[5] == b[5] for a, b in zip(items, self.items))
        )
        if not same:
            self.prompt_positions = mrope_positions(prompt, media, info.merge_size, info.tokens_per_second)
        response = torch.arange(1, ids.numel() - prompt.numel() + 1, dtype=torch.int64)
        return torch.cat([self.prompt_positions, self.prompt_positions[:, -1:] + response], dim=1)

    def remember(self, prompt: Tensor, items: list, keys: list) -> None:
        self.prompt, self.items, self.keys = prompt, items, keys


def _grid(grid: Optional[Tensor]) -> Tensor:
    return torch.zeros(0, 3, dtype=torch.int64) if grid is None else torch.as_tensor(grid).long().reshape(-1, 3).cpu()


def _per_sample(name: str, values, B: int) -> list:
    if values is None:
        return [None] * B
    values = values.tolist() if isinstance(values, Tensor) else list(values)
    if len(values) != B:
        raise SchemaError(f"{name} has {len(values)} entries; expected one per sample ({B})")
    if name == "group_ids":
        return [str(v) for v in values]
    return [float(v) for v in values]


def _name_media(parts, info: LayoutInfo, media_ids, media_cache_keys) -> None:
    """Fill media ids and keys in the batch's media order (images, then videos)."""
    order = [m for mod in (Modality.IMAGE, Modality.VIDEO) for p in parts for m in p.media if m["modality"] == mod]
    for name, given in (("media_ids", media_ids), ("media_cache_keys", media_cache_keys)):
        if given is not None and len(given) != len(order):
            raise SchemaError(f"{name} has {len(given)} entries; the batch has {len(order)} media items (images first, then videos)")
    for g, m in enumerate(order):
        if media_cache_keys is not None:
            m["key"] = str(media_cache_keys[g])
        if m["key"] is None:
            raise SchemaError(
                f"media item {g} ({m['modality'].label}) has no pixel values to hash: pass pixel_values/pixel_values_videos "
                "or media_cache_keys"
            )
        m["id"] = str(media_ids[g]) if media_ids is not None else default_media_id(m["key"], m["modality"].label)


def _unpad(row: Tensor, mask: Tensor, what: str, b: int) -> Tensor:
    mask = mask.bool()
    kept = torch.nonzero(mask).flatten()
    if kept.numel() and int(kept[-1] - kept[0]) + 1 != kept.numel():
        raise SchemaError(f"{what}: sample {b}'s attention mask has holes; expected one contiguous run of real tokens (left or right padding)")
    return row[mask]


def _positions_3(position_ids: Tensor, b: int, mask: Tensor, *, batch_first: bool) -> Tensor:
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


# ---------------------------------------------------------------------- entry points
def from_qwen_vl(
    processor_output,
    *,
    processor,
    responses=None,
    response_mask: Optional[Tensor] = None,
    assistant_mask: Optional[Tensor] = None,
    position_ids: Optional[Tensor] = None,
    group_ids=None,
    rewards=None,
    costs=None,
    media_ids: Optional[Sequence[str]] = None,
    tokens_per_second: Optional[float] = None,
) -> RLBatch:
    """An RLBatch from a Qwen2-VL / Qwen2.5-VL processor output.

    - Padding (left or right) is stripped with ``attention_mask``.
    - ``responses``: per-sample token sequences appended to the prompts (a list of 1-D
      sequences, or a ``[B, R]`` tensor with ``response_mask``); they become the loss
      spans, EOS included, padding excluded.
    - ``assistant_mask`` (``[B, L]`` like ``input_ids``): multi-turn; only the tokens it
      marks are scored (the appended responses are scored too).
    - ``position_ids``: the positions a framework actually used, to record instead of
      computing them (e.g. a rollout that fell back to 1-D positions): ``(3, B, L)`` as
      transformers' ``get_rope_index`` returns, or ``(B, L)``.
    """
    info = LayoutInfo.of(processor, tokens_per_second)
    input_ids = torch.as_tensor(processor_output["input_ids"])
    if input_ids.ndim != 2:
        raise SchemaError(f"input_ids has shape {tuple(input_ids.shape)}; expected (batch, length) as the processor returns")
    attention = processor_output.get("attention_mask")
    attention = torch.ones_like(input_ids) if attention is None else torch.as_tensor(attention)
    B = input_ids.shape[0]
    prompts = [_unpad(input_ids[b], attention[b], "attention_mask", b) for b in range(B)]
    resp = _responses(responses, response_mask, B, info)
    mm_types = processor_output.get("mm_token_type_ids")
    if mm_types is not None:
        _check_mm_types(torch.as_tensor(mm_types), attention, prompts, info)
    loss_masks = None
    if assistant_mask is not None:
        loss_masks = []
        for b in range(B):
            m = _unpad(torch.as_tensor(assistant_mask)[b], attention[b], "attention_mask", b).bool()
            r = resp[b]
            loss_masks.append(torch.cat([m, torch.ones(0 if r is None else r.numel(), dtype=torch.bool)]))
    positions = None
    if position_ids is not None:
        positions = [_positions_3(torch.as_tensor(position_ids), b, attention[b], batch_first=False) for b in range(B)]
        positions = [_extend_positions(p, resp[b]) for b, p in enumerate(positions)]
    return _build(
        prompts,
        resp,
        info,
        image_grid_thw=processor_output.get("image_grid_thw"),
        video_grid_thw=processor_output.get("video_grid_thw"),
        pixel_values=processor_output.get("pixel_values"),
        pixel_values_videos=processor_output.get("pixel_values_videos"),
        second_per_grid_ts=processor_output.get("second_per_grid_ts"),
        position_ids=positions,
        loss_masks=loss_masks,
        group_ids=group_ids,
        rewards=rewards,
        costs=costs,
        media_ids=media_ids,
    )


def _extend_positions(pos: Tensor, response: Optional[Tensor]) -> Tensor:
    """Text positions for an appended response, continuing from the prompt's last + 1."""
    if response is None or response.numel() == 0:
        return pos
    start = int(pos.max()) + 1 if pos.numel() else 0
    tail = (torch.arange(response.numel()) + start).unsqueeze(0).expand(3, -1)
    return torch.cat([pos.long(), tail], dim=1)


def _responses(responses, response_mask, B: int, info: LayoutInfo) -> list[Optional[Tensor]]:
    if responses is None:
        return [None] * B
    if isinstance(responses, Tensor):
        if responses.ndim != 2 or responses.shape[0] != B:
            raise SchemaError(f"responses has shape {tuple(responses.shape)}; expected ({B}, R)")
        if response_mask is None:
            raise SchemaError(
                "responses given as a padded [B, R] tensor need response_mask (1 for generated tokens, EOS included), "
                "since padding and EOS can share an id"
            )
        return [_unpad(responses[b], response_mask[b], "response_mask", b) for b in range(B)]
    if len(responses) != B:
        raise SchemaError(f"responses has {len(responses)} entries; expected one per sample ({B})")
    return [torch.as_tensor(r, dtype=torch.int64).flatten() for r in responses]


def _check_mm_types(mm_types: Tensor, attention: Tensor, prompts: Sequence[Tensor], info: LayoutInfo) -> None:
    for b, ids in enumerate(prompts):
        types = mm_types[b][attention[b].bool()]
        expected = torch.zeros_like(ids)
        expected[ids == info.image_token_id] = 1
        expected[ids == info.video_token_id] = 2
        bad = torch.nonzero(types.long().cpu() != expected.cpu()).flatten()
        if bad.numel():
            p = int(bad[0])
            raise SchemaError(
                f"mm_token_type_ids: sample {b}, position {p} says {int(types[p])} but token {int(ids[p])} implies {int(expected[p])}"
            )


def from_token_lists(
    prompt_token_ids: Sequence[Sequence[int]],
    response_token_ids: Optional[Sequence[Sequence[int]]] = None,
    *,
    processor,
    image_grid_thw: Optional[Tensor] = None,
    video_grid_thw: Optional[Tensor] = None,
    pixel_values: Optional[Tensor] = None,
    pixel_values_videos: Optional[Tensor] = None,
    second_per_grid_ts: Optional[Tensor] = None,
    position_ids: Optional[Sequence[Tensor]] = None,
    group_ids=None,
    rewards=None,
    costs=None,
    media_ids: Optional[Sequence[str]] = None,
    media_cache_keys: Optional[Sequence[str]] = None,
    tokens_per_second: Optional[float] = None,
) -> RLBatch:
    """An RLBatch from raw token lists as a rollout engine returns them (prompt ids with
    placeholders already expanded, and generated ids). ``position_ids``: optional
    per-sample (3, L) positions the engine used."""
    info = LayoutInfo.of(processor, tokens_per_second)
    prompts = [torch.as_tensor(list(p), dtype=torch.int64) for p in prompt_token_ids]
    B = len(prompts)
    if response_token_ids is not None and len(response_token_ids) != B:
        raise SchemaError(f"response_token_ids has {len(response_token_ids)} entries; prompt_token_ids has {B}")
    resp = [None] * B if response_token_ids is None else [torch.as_tensor(list(r), dtype=torch.int64) for r in response_token_ids]
    return _build(
        prompts, resp, info,
        image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
        pixel_values=pixel_values, pixel_values_videos=pixel_values_videos,
        second_per_grid_ts=second_per_grid_ts, position_ids=position_ids,
        group_ids=group_ids, rewards=rewards, costs=costs,
        media_ids=media_ids, media_cache_keys=media_cache_keys,
    )


def from_verl(
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    *,
    processor,
    responses: Optional[Tensor] = None,
    response_mask: Optional[Tensor] = None,
    multi_modal_inputs: Optional[Sequence[dict]] = None,
    group_ids=None,
    rewards=None,
    media_ids: Optional[Sequence[str]] = None,
    tokens_per_second: Optional[float] = None,
) -> RLBatch:
    """An RLBatch from verl-style tensors: ``input_ids``/``attention_mask`` ``[B, L]`` are a
    left-padded prompt followed by a right-padded response of width ``R`` =
    ``responses.shape[1]``; ``response_mask`` ``[B, R]`` marks scored response tokens;
    ``position_ids`` ``(B, 4, L)`` (verl's text row + M-RoPE), ``(B, 3, L)`` or ``(B, L)``
    are recorded as given; ``multi_modal_inputs`` holds each sample's
    ``pixel_values``/``image_grid_thw`` (verl's per-sample dicts). ``group_ids`` is verl's uid."""
    info = LayoutInfo.of(processor, tokens_per_second)
    B, L = input_ids.shape
    R = 0 if responses is None else responses.shape[1]
    if responses is not None and not torch.equal(input_ids[:, L - R :], responses):
        raise SchemaError("input_ids[:, -R:] differ from responses: verl's input_ids are the prompt followed by the response")
    if response_mask is None and R:
        response_mask = attention_mask[:, L - R :]
    prompts, resp, masks, positions = [], [], [], []
    for b in range(B):
        p = _unpad(input_ids[b, : L - R], attention_mask[b, : L - R], "attention_mask (prompt part)", b)
        r = _unpad(input_ids[b, L - R :], attention_mask[b, L - R :], "attention_mask (response part)", b)
        prompts.append(p)
        resp.append(r)
        if R:
            rm = response_mask[b][attention_mask[b, L - R :].bool()].bool()
            masks.append(torch.cat([torch.zeros(p.numel(), dtype=torch.bool), rm.cpu()]))
        positions.append(_positions_3(position_ids, b, attention_mask[b], batch_first=True))
    mm = list(multi_modal_inputs or [])
    if mm and len(mm) != B:
        raise SchemaError(f"multi_modal_inputs has {len(mm)} entries; expected one per sample ({B})")

    def _cat(key: str) -> Optional[Tensor]:
        items = [torch.as_tensor(d[key]) for d in mm if d and key in d and d[key] is not None]
        return torch.cat(items) if items else None

    return _build(
        prompts, resp, info,
        image_grid_thw=_cat("image_grid_thw"), video_grid_thw=_cat("video_grid_thw"),
        pixel_values=_cat("pixel_values"), pixel_values_videos=_cat("pixel_values_videos"),
        second_per_grid_ts=_cat("second_per_grid_ts"),
        position_ids=positions, loss_masks=masks if R else None,
        group_ids=group_ids, rewards=rewards, media_ids=media_ids,
    )
