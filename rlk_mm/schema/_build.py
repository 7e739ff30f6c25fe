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
from ._inputs import check_positions, coordinate_system_arg, per_sample_targets, per_sample_values, screen_sizes, str_list
from .checks import FLOAT_DTYPES, INTEGER_DTYPES, DeviceChecks, bool_arg, float_arg, int_arg, sequence_arg, tensor_arg
from .coordinates import CoordinateSystem
from .layouts import LayoutFamily, layout_family_of
from .media import (
    MediaItem,
    add_grid_checks,
    add_pixel_checks,
    content_key,
    default_media_id,
    grid_arg,
    grid_row,
    processor_fingerprint,
    token_counts,
)
from .spans import Modality, SchemaError, Span, spans_from_mask

__all__ = ["build", "LayoutInfo", "mrope_positions"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class LayoutInfo:
    """What the builder needs to know about a processor."""

    fingerprint: str
    image_token_id: int
    video_token_id: int
    merge_size: int
    tokens_per_second: Optional[float]  # Qwen2.5-VL temporal spacing; None for Qwen2-VL and Qwen3-VL
    pad_token_id: Optional[int]
    vocab_size: int  # len(tokenizer): every token id is below it
    family: Optional[LayoutFamily] = None  # None: a bare tokenizer (the caller's positions or tokens decide)

    @classmethod
    def of(cls, processor: Any, tokens_per_second: Optional[float] = None) -> "LayoutInfo":
        fingerprint = processor_fingerprint(processor)  # refuses what is no processor or tokenizer
        family = layout_family_of(processor)  # refuses a processor of another model family
        tokenizer = getattr(processor, "tokenizer", processor)
        image_id = getattr(processor, "image_token_id", None) or tokenizer.convert_tokens_to_ids("<|image_pad|>")
        video_id = getattr(processor, "video_token_id", None) or tokenizer.convert_tokens_to_ids("<|video_pad|>")
        image_processor = getattr(processor, "image_processor", None)
        merge = int(getattr(image_processor, "merge_size", 2) or 2)
        if tokens_per_second is not None:
            tokens_per_second = float_arg("tokens_per_second", tokens_per_second, min=0.0, min_open=True)
            if family is not None and not family.scales_video_time:
                raise ValueError(f"tokens_per_second={tokens_per_second}: {family.label} does not scale video time by it "
                                 "(only Qwen2.5-VL's positions do); leave it None")
        elif family is LayoutFamily.QWEN2_5_VL:
            tokens_per_second = 2.0  # Qwen2.5-VL's vision_config.tokens_per_second in the released checkpoints
        return cls(fingerprint, int(image_id), int(video_id), merge, tokens_per_second, tokenizer.pad_token_id,
                   len(tokenizer), family)


# ---------------------------------------------------------------------- M-RoPE positions
def mrope_positions(
    ids: Tensor,
    media: Sequence[tuple[int, int, Tensor, Optional[float]]],
    merge_size: int,
    tokens_per_second: Optional[float],
) -> Tensor:
    """int64 (3, L) positions of one unpadded sequence, as Qwen2(.5)-VL's ``get_rope_index``.

    ``ids``: the sequence's int token ids [L]. ``media``: (start, modality, grid_thw,
    second_per_grid) for each media span, in order, each inside the sequence and after the
    previous one. Text runs continue from the current position; a media item of grid
    (t, h, w) gets t/h/w indices offset by the current position, which then advances by
    max(h, w)/merge.
    """
    ids = tensor_arg("ids", ids, ndim=1, dtypes=INTEGER_DTYPES)
    merge_size = int_arg("merge_size", merge_size, min=1)
    if tokens_per_second is not None:
        tokens_per_second = float_arg("tokens_per_second", tokens_per_second, min=0.0, min_open=True)
    _check_media_runs(media, ids.numel(), merge_size)
    return _mrope_positions(ids.numel(), media, merge_size, tokens_per_second)


def _check_media_runs(media, L: int, merge_size: int) -> None:
    """``mrope_positions``' media spans: in order, disjoint, inside the sequence, grids that merge."""
    previous = (0, 0)
    for i, item in enumerate(sequence_arg("media", media, "(start, modality, grid_thw, second_per_grid) tuples", ordered=True)):
        if not isinstance(item, (tuple, list)) or len(item) != 4:
            raise TypeError(f"media[{i}] must be (start, modality, grid_thw, second_per_grid), got {item!r}")
        start, modality, grid, second = item
        start = int_arg(f"media[{i}] start", start, min=0)
        if modality not in (Modality.IMAGE, Modality.VIDEO):
            raise ValueError(f"media[{i}] modality={modality!r}: expected Modality.IMAGE or Modality.VIDEO")
        t, h, w = grid_row(f"media[{i}] grid_thw", grid)
        if h % merge_size or w % merge_size:
            raise ValueError(f"media[{i}] grid_thw {[t, h, w]}: h and w must be multiples of the merge size {merge_size}")
        if second is not None:
            float_arg(f"media[{i}] second_per_grid", second, min=0.0, min_open=True)
        stop = start + t * h * w // merge_size**2
        if start < previous[1]:
            raise ValueError(f"media[{i}] starts at {start}, inside media[{i - 1}] at [{previous[0]}, {previous[1]})")
        if stop > L:
            raise ValueError(f"media[{i}] at [{start}, {stop}) runs past the {L} tokens of ids")
        previous = (start, stop)


def _mrope_positions(L: int, media, merge_size: int, tokens_per_second: Optional[float]) -> Tensor:
    """``mrope_positions`` on checked arguments."""
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
    sources: Tensor  # int64 [N]: the input grid row each item comes from (a split video's temporal patches share one)
    next: int = 0
    row: int = 0

    def take(self) -> tuple[MediaItem, int]:
        """The next item and the input grid row it comes from."""
        grid = self.grids[self.next]
        rows = int(grid.prod())
        pix = None if self.pixels is None else self.pixels[self.row : self.row + rows]
        second = None if self.seconds is None else float(self.seconds[self.next])
        source = int(self.sources[self.next])
        self.next += 1
        self.row += rows
        return MediaItem(self.modality, grid.long(), pix, second), source

    @property
    def remaining(self) -> int:
        return self.grids.shape[0] - self.next


@dataclass
class _Placed:
    """A media item and its placeholder tokens ``[start, end)`` in the sample."""

    start: int
    end: int
    media: MediaItem
    source: int  # the input grid row (video: the video, also for one temporal patch of it)


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
                item, source = pool.take()
                need = int(token_counts(item.grid[None], info.merge_size)[0])
                have = run.end - cursor
                if have < need:
                    raise SchemaError(f"modality_spans: sample {b}, {_item_name(pool, mod, source)} at positions [{cursor}, "
                                      f"{run.end}) has {have} placeholder tokens but {mod.label}_grid_thw "
                                      f"{item.grid.tolist()} implies {need}; {_short_run_hint(item, have, need, run.end == P, info)}")
                placed.append(_Placed(cursor, cursor + need, item, source))
                cursor += need
    return sorted(placed, key=lambda p: p.start)


def _item_name(pool: _MediaPool, mod: Modality, source: int) -> str:
    """An item in errors: ``image 2``, ``video 0``, or ``video 0 (temporal patch 1)`` for a split video."""
    patch = int((pool.sources[: pool.next - 1] == source).sum())
    split = int((pool.sources == source).sum()) > 1
    return f"{mod.label} {source}" + (f" (temporal patch {patch})" if split else "")


def _short_run_hint(item: MediaItem, have: int, need: int, at_end: bool, info: LayoutInfo) -> str:
    """Why a placeholder run is shorter than its item's grid, and what to change."""
    frames = int(item.grid[0])
    if item.modality is Modality.VIDEO and frames > 1 and have == need // frames:
        family = "a tokenizer without a processor" if info.family is None else f"{info.family.label}'s processor"
        return ("the run holds one temporal patch's placeholders: the prompt writes the video per temporal patch with "
                f"timestamps (Qwen3-VL's layout), but the batch is built with {family}; build it with the model's own "
                "processor (a Qwen3VLProcessor for Qwen3-VL)")
    if at_end:
        return ("the media span was cut by truncation: raise the prompt length limit (max_prompt_length) or lower "
                "max_pixels so the item needs fewer tokens")
    return "the placeholder count does not match the grid (was the image re-processed at another size?)"


def _check_response(b: int, prompt: Tensor, response: Tensor, info: LayoutInfo) -> None:
    for mod, token in ((Modality.IMAGE, info.image_token_id), (Modality.VIDEO, info.video_token_id)):
        hit = torch.nonzero(response == token).flatten()
        if hit.numel():
            raise SchemaError(
                f"responses: sample {b}, response position {int(hit[0])} (sequence position {prompt.numel() + int(hit[0])}) "
                f"is the {mod.label} placeholder token {token}: the policy generated a media placeholder; "
                "mask or reject this response before building the batch"
            )


def _media_pool(mod: Modality, grids, pixels, seconds, info: LayoutInfo) -> _MediaPool:
    """One modality's checked grids, pixel rows (as many as the grids need) and seconds per
    temporal patch (one per video). Their values' finiteness is checked once, by RLBatch."""
    grid_name = f"{mod.label}_grid_thw"
    pixel_name = "pixel_values" if mod is Modality.IMAGE else "pixel_values_videos"
    if grids is None and pixels is not None:
        raise SchemaError(f"{pixel_name} given without {grid_name}: the vision tower needs each item's grid")
    grids = torch.zeros(0, 3, dtype=torch.int64) if grids is None else grid_arg(grid_name, grids).cpu()
    checks = DeviceChecks()
    add_grid_checks(checks, grid_name, grids, info.merge_size)
    if pixels is not None:
        pixels = tensor_arg(pixel_name, pixels, ndim=2, dtypes=FLOAT_DTYPES, error=SchemaError).cpu()
        add_pixel_checks(checks, pixel_name, pixels, grid_name, grids, mod.label, finite=False)  # RLBatch checks finiteness
    if seconds is not None:
        seconds = tensor_arg("second_per_grid_ts", seconds, ndim=1, dtypes=FLOAT_DTYPES, error=SchemaError).cpu()
        if seconds.shape[0] != grids.shape[0]:
            raise SchemaError(f"second_per_grid_ts has {seconds.shape[0]} entries; video_grid_thw has {grids.shape[0]} videos")
    checks.run()
    sources = torch.arange(grids.shape[0])
    if mod is Modality.VIDEO and info.family is not None and info.family.splits_video:
        # one item per temporal patch, as the model's own get_rope_index splits video_grid_thw
        frames = grids[:, 0]
        sources = torch.repeat_interleave(sources, frames)
        grids = torch.repeat_interleave(grids, frames, dim=0)
        grids[:, 0] = 1
        seconds = None if seconds is None else torch.repeat_interleave(seconds, frames)
    return _MediaPool(mod, grids, pixels, seconds, sources)


_DRIFT_FIX = (", or, if the rollout really ran with these positions, pass allow_position_drift=True to record them "
              "(check_layout_parity then reports the drift)")


def _recorded_positions(position_ids, B: int) -> list[Tensor]:
    """Per-sample (3, L) int positions a framework used (shapes checked per sample later)."""
    items = sequence_arg("position_ids", position_ids, "per-sample (3, L) int tensors", ordered=True)
    if len(items) != B:
        raise SchemaError(f"position_ids has {len(items)} entries; expected one per sample ({B})")
    for b, pos in enumerate(items):
        tensor_arg(f"position_ids[{b}]", pos)
        if pos.dtype not in INTEGER_DTYPES:
            raise TypeError(f"position_ids[{b}] must be int (int64 positions), got {pos.dtype}")
    return [pos.long().cpu() for pos in items]


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
    allow_position_drift: bool = False,
    loss_masks: Optional[Sequence[Tensor]] = None,
    group_ids=None,
    rewards=None,
    costs=None,
    media_ids: Optional[Sequence[str]] = None,
    media_cache_keys: Optional[Sequence[str]] = None,
    media_per_sample: Optional[Sequence[dict]] = None,
    media_source: str = "",
    bbox_targets=None,
    point_targets=None,
    screen_size=None,
    coordinate_system=None,
) -> dict:
    """A batch's fields from checked, unpadded per-sample prompts (placeholders expanded) and responses.

    Loss spans are the responses (EOS included), or the runs of ``loss_masks`` (one bool per
    prompt + response token; the prompt length then ends at the first scored token).
    ``position_ids``: per-sample (3, L) positions to record instead of computing them; they
    must equal the computed ones unless ``allow_position_drift`` (a rollout that really used
    other positions, recorded so that ``check_layout_parity`` reports the drift).
    ``media_per_sample``: how many items of each modality each sample's inputs hold
    (``media_source`` names them in errors). ``bbox_targets`` / ``point_targets`` (per
    sample), ``screen_size`` and ``coordinate_system``: the grounding fields
    (``_inputs.per_sample_targets``, ``screen_sizes``)."""
    B = len(prompts)
    pools = {
        Modality.IMAGE: _media_pool(Modality.IMAGE, image_grid_thw, pixel_values, None, info),
        Modality.VIDEO: _media_pool(Modality.VIDEO, video_grid_thw, pixel_values_videos, second_per_grid_ts, info),
    }
    given = {name: per_sample_values(name, value, B) for name, value in (("group_ids", group_ids), ("rewards", rewards), ("costs", costs))}
    group_ids, rewards, costs = (given[name] or [None] * B for name in ("group_ids", "rewards", "costs"))
    media_ids, media_cache_keys = str_list("media_ids", media_ids), str_list("media_cache_keys", media_cache_keys)
    coordinate_system = coordinate_system_arg(coordinate_system)
    grounding = {
        "bbox_targets": per_sample_targets("bbox_targets", bbox_targets, B, "box", coordinate_system),
        "point_targets": per_sample_targets("point_targets", point_targets, B, "point", coordinate_system),
        "screen_size": screen_sizes(screen_size, B),
    }
    for name in ("bbox_targets", "point_targets"):
        if grounding[name] is not None and coordinate_system is None:
            raise SchemaError(f"{name} given without coordinate_system: say which system the coordinates are in "
                              f"({', '.join(c.value for c in CoordinateSystem)})")
    positions = None if position_ids is None else _recorded_positions(position_ids, B)
    allow_position_drift = bool_arg("allow_position_drift", allow_position_drift)
    has_responses = any(r is not None and r.numel() for r in responses)
    previous = _PreviousSample()
    parts: list[SampleParts] = []
    for b in range(B):
        prompt = prompts[b]
        response = torch.zeros(0, dtype=torch.int64) if responses[b] is None else responses[b]
        _check_response(b, prompt, response, info)
        ids = torch.cat([prompt, response])
        P, L = prompt.numel(), ids.numel()
        placed = _place_media(b, prompt, pools, info)
        if media_per_sample is not None:
            _check_media_count(b, placed, media_per_sample[b], media_source)
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
        if positions is None:
            pos = previous.positions(prompt, ids, placed, info)
        else:
            pos = positions[b]
            if pos.shape != (3, L):
                raise SchemaError(f"position_ids: sample {b} has shape {tuple(pos.shape)}, expected (3, {L})")
            if not allow_position_drift:
                check_positions("position_ids", pos, previous.positions(prompt, ids, placed, info), b, ids, fix=_DRIFT_FIX)
        previous.remember(prompt, placed, keys)
        prompt_length = P
        if loss_masks is not None:
            mask = loss_masks[b]
            loss = spans_from_mask(mask)
            prompt_length = min(P, loss[0].start) if loss else P
        else:
            loss = [Span(P, L)] if L > P else []
        parts.append(SampleParts(
            input_ids=ids, position_ids=pos, modality_spans=spans, loss_spans=loss, media=[p.media for p in placed],
            group_id=group_ids[b], reward=rewards[b], cost=costs[b], prompt_length=prompt_length,
            bboxes=None if grounding["bbox_targets"] is None else grounding["bbox_targets"][b],
            points=None if grounding["point_targets"] is None else grounding["point_targets"][b],
            screen_size=None if grounding["screen_size"] is None else grounding["screen_size"][b],
        ))
    for mod, pool in pools.items():
        if pool.remaining:
            raise SchemaError(
                f"{mod.label}_grid_thw has {pool.grids.shape[0]} items but the prompts hold placeholders for "
                f"{pool.next}: a media span was cut by truncation (raise the prompt length limit or lower max_pixels) "
                "or placeholders were removed"
            )
    _name_media(parts, media_ids, media_cache_keys)
    present = frozenset([name for name, values in {**given, **grounding}.items() if values is not None]
                        + (["prompt_lengths"] if has_responses else []))
    return assemble(
        parts,
        present=present,
        coordinate_system=coordinate_system,
        processor_fingerprint=info.fingerprint,
        image_token_id=info.image_token_id,
        video_token_id=info.video_token_id,
        spatial_merge_size=info.merge_size,
        layout_family=None if info.family is None else info.family.value,
    )


def _check_media_count(b: int, placed: list[_Placed], held: dict, source: str) -> None:
    for mod in (Modality.IMAGE, Modality.VIDEO):
        used = len({p.source for p in placed if p.media.modality == mod})
        if used != held.get(mod, 0):
            raise SchemaError(f"{source}: sample {b} holds {held.get(mod, 0)} {mod.label}(s) but its prompt has placeholders "
                              f"for {used}: each sample's inputs hold exactly its own media")


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
                keys.append(content_key(item.pixels, item.grid.tolist(), item.modality.label, info.fingerprint))
        return keys

    def positions(self, prompt: Tensor, ids: Tensor, placed: list[_Placed], info: LayoutInfo) -> Tensor:
        media = [(p.start, p.media.modality, p.media.grid, p.media.second_per_grid) for p in placed]
        if placed and placed[-1].end >= prompt.numel():  # the prompt ends in a media span: no text to continue
            self.prompt_positions = None
            return _mrope_positions(ids.numel(), media, info.merge_size, info.tokens_per_second)
        same = (
            self.prompt_positions is not None
            and torch.equal(self.prompt, prompt)
            and len(placed) == len(self.placed)
            and all(a.media.modality == b.media.modality and torch.equal(a.media.grid, b.media.grid)
                    and a.media.second_per_grid == b.media.second_per_grid for a, b in zip(placed, self.placed))
        )
        if not same:
            self.prompt_positions = _mrope_positions(prompt.numel(), media, info.merge_size, info.tokens_per_second)
        response = torch.arange(1, ids.numel() - prompt.numel() + 1, dtype=torch.int64)
        return torch.cat([self.prompt_positions, self.prompt_positions[:, -1:] + response], dim=1)

    def remember(self, prompt: Tensor, placed: list[_Placed], keys: list[Optional[str]]) -> None:
        self.prompt, self.placed, self.keys = prompt, placed, keys


def _name_media(parts: list[SampleParts], media_ids: Optional[list[str]], media_cache_keys: Optional[list[str]]) -> None:
    """Fill media ids and keys in the batch's media order (images, then videos); caller-given
    keys must name one content each (equal key: equal modality, grid and pixel rows)."""
    order = [m for mod in (Modality.IMAGE, Modality.VIDEO) for p in parts for m in p.media if m.modality == mod]
    for name, given in (("media_ids", media_ids), ("media_cache_keys", media_cache_keys)):
        if given is not None and len(given) != len(order):
            raise SchemaError(f"{name} has {len(given)} entries; the batch has {len(order)} media items (images first, then videos)")
    first: dict[str, int] = {}
    for g, m in enumerate(order):
        if media_cache_keys is not None:
            m.key = media_cache_keys[g]
            i = first.setdefault(m.key, g)
            _check_same_content(i, order[i], g, m)
        if m.key is None:
            raise SchemaError(
                f"media item {g} ({m.modality.label}) has no pixel values to hash: pass pixel_values/pixel_values_videos "
                "or media_cache_keys"
            )
        m.id = media_ids[g] if media_ids is not None else default_media_id(m.key, m.modality.label)


def _check_same_content(i: int, a: MediaItem, j: int, b: MediaItem) -> None:
    differ = ("modalities" if a.modality != b.modality else "grids" if not torch.equal(a.grid, b.grid)
              else "pixel rows" if a.pixels is not None and b.pixels is not None and not torch.equal(a.pixels, b.pixels) else None)
    if differ:
        raise SchemaError(f"media_cache_keys: media items {i} and {j} share the key {a.key!r} but their {differ} differ: "
                          "a key names one vision-tower input")
