"""The batch contract's media clauses (docs/batch_contract.md): per-item fields, the vision
tower's inputs, cache keys and token offsets, each added to the caller's ``DeviceChecks``.

``_validate.check`` runs them with the rest of the contract; ``field`` (a field's dtype and
shape, read on the host) serves both modules.
"""

from __future__ import annotations

from typing import Optional

import torch

from .checks import FLOAT_DTYPES, DeviceChecks, first_true
from .media import add_grid_checks, add_pixel_checks, offsets, token_counts
from .spans import Modality, SchemaError, refuse

__all__: list[str] = []

Tensor = torch.Tensor


def field(batch, name: str, dtypes, shape: tuple, meaning: str) -> Optional[Tensor]:
    """The tensor field ``name`` (None if absent) after checking its dtype and shape
    (``None`` in ``shape``: any size)."""
    value = getattr(batch, name)
    if value is None:
        return None
    if value.dtype not in dtypes:
        raise SchemaError(f"{name} must be {' or '.join(str(d).replace('torch.', '') for d in dtypes)}, got {value.dtype}")
    if value.dim() != len(shape) or any(s is not None and s != v for s, v in zip(shape, value.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise SchemaError(f"{name} has shape {tuple(value.shape)}; expected {want} ({meaning})")
    return value


def check_media(batch, checks: DeviceChecks) -> None:
    M = len(batch.media_ids)
    if len(batch.media_cache_keys) != M:
        raise SchemaError(f"media_cache_keys has {len(batch.media_cache_keys)} entries; media_ids has {M} (one per media item)")
    for name in ("media_ids", "media_cache_keys"):
        blank = next((g for g, v in enumerate(getattr(batch, name)) if not v.strip()), None)
        if blank is not None:
            raise SchemaError(f"{name}[{blank}] is empty: {'an id names one item' if name == 'media_ids' else 'a key names one content'}"
                              f" (an empty one would name every item alike); give a non-blank str, or leave {name} to the builder")
    per_item = {
        "media_modality": ((torch.int8,), (M,), "one per media item"),
        "media_sample": ((torch.int64,), (M,), "one per media item"),
        "media_grid_thw": ((torch.int64,), (M, 3), "a (t, h, w) row per media item"),
        "vision_token_offsets": ((torch.int64,), (M,), "one per media item"),
    }
    values = {name: field(batch, name, *spec) for name, spec in per_item.items()}
    for name, value in values.items():
        if value is None and M:
            raise SchemaError(f"{name} is missing; the batch lists {M} media items (media_ids)")
    device = batch.input_ids.device
    modality = torch.zeros(0, dtype=torch.int8, device=device) if values["media_modality"] is None else values["media_modality"]
    grid = torch.zeros(0, 3, dtype=torch.int64, device=device) if values["media_grid_thw"] is None else values["media_grid_thw"]
    B, merge = batch.num_samples, batch.spatial_merge_size
    not_media = (modality < int(Modality.IMAGE)) | (modality > int(Modality.AUDIO))
    checks.add(not_media.any(), lambda: refuse(
        f"media_modality[{(g := first_true(not_media)[0])}] is {int(modality[g])}; a media item is 1 (image), 2 (video) or 3 (audio)"))
    if M:
        sample = values["media_sample"]
        outside = (sample < 0) | (sample >= B)
        checks.add(outside.any(), lambda: refuse(
            f"media_sample[{(g := first_true(outside)[0])}] is {int(sample[g])}; the batch has samples 0..{B - 1}"))
        add_grid_checks(checks, "media_grid_thw", grid, merge)
    for mod, grid_name, pixel_name in ((Modality.IMAGE, "image_grid_thw", "pixel_values"), (Modality.VIDEO, "video_grid_thw", "pixel_values_videos")):
        _check_model_inputs(batch, checks, mod, grid_name, pixel_name, modality, grid)
    videos = 0 if batch.video_grid_thw is None else batch.video_grid_thw.shape[0]
    seconds = field(batch, "second_per_grid_ts", FLOAT_DTYPES, (videos,), "one per video")
    if seconds is not None:
        bad_second = ~torch.isfinite(seconds) | (seconds <= 0)
        checks.add(bad_second.any(), lambda: refuse(
            f"second_per_grid_ts[{(v := first_true(bad_second)[0])}] is {float(seconds[v])}; seconds per temporal patch are finite and > 0"))
    _check_keys(batch, checks, modality, grid)


def check_offsets(batch, checks: DeviceChecks) -> None:
    """``vision_token_offsets`` follow from the grids (checked last: a wrong grid is reported as itself)."""
    if not batch.media_ids:
        return
    expected = offsets(token_counts(batch.media_grid_thw, batch.spatial_merge_size), batch.media_modality)
    offset = batch.vision_token_offsets
    wrong = offset != expected
    checks.add(wrong.any(), lambda: refuse(
        f"vision_token_offsets[{(g := first_true(wrong)[0])}] is {int(offset[g])}, expected {int(expected[g])}: "
        "the row offset of the item in its modality's vision-tower output (order of the grids)"))


def _check_model_inputs(batch, checks, mod: Modality, grid_name: str, pixel_name: str, modality: Tensor, grid: Tensor) -> None:
    """``image_grid_thw``/``video_grid_thw`` are the grids of the items of that modality in
    order; the pixel rows are as many as the grids need, all finite."""
    label = mod.label
    grids = field(batch, grid_name, (torch.int64,), (None, 3), f"a (t, h, w) row per {label}")
    mine = modality == int(mod)
    if grids is None:
        checks.add(mine.any(), lambda: refuse(
            f"{grid_name} is missing: the batch has {int(mine.sum())} {label} items (the model needs their grids)"))
    else:
        n = grids.shape[0]
        checks.add(mine.sum() != n, lambda: refuse(f"{grid_name} has {n} rows; the batch has {int(mine.sum())} {label} items"))
        rank = (torch.cumsum(mine.long(), 0) - 1).clamp(0, max(n - 1, 0))
        differ = (mine & (grids[rank] != grid).any(1)) if n else torch.zeros_like(mine)

        def disagree():
            g = first_true(differ)[0]
            k = int(rank[g])
            raise SchemaError(f"{grid_name}[{k}] is {grids[k].tolist()} but media item {g} ({label}) has grid {grid[g].tolist()}: "
                  "the model inputs and the media records disagree")

        checks.add(differ.any(), disagree)
    pixels = getattr(batch, pixel_name)
    if pixels is None:
        return
    if grids is None:
        raise SchemaError(f"{pixel_name} given without {grid_name}: the vision tower needs each item's grid")
    pixels = field(batch, pixel_name, FLOAT_DTYPES, (None, None), f"vision-tower input rows of the {label}s")
    add_pixel_checks(checks, pixel_name, pixels, grid_name, grids, label)


def _check_keys(batch, checks: DeviceChecks, modality: Tensor, grid: Tensor) -> None:
    """Media items that share a cache key share their modality and grid (a key names one
    vision-tower input), and items that share a media id share their key (an id names one
    content); pairs found on the host from the strings."""
    named: dict[str, int] = {}
    for g, (media_id, key) in enumerate(zip(batch.media_ids, batch.media_cache_keys)):
        i = named.setdefault(media_id, g)
        if batch.media_cache_keys[i] != key:
            raise SchemaError(f"media_ids: media items {i} and {g} share the id {media_id!r} but have different "
                              "media_cache_keys (different contents): give each content its own media id")
    first: dict[str, int] = {}
    pairs = []
    for g, key in enumerate(batch.media_cache_keys):
        i = first.setdefault(key, g)
        if i != g:
            pairs.append((i, g))
    if not pairs:
        return
    a, b = (ints_on(list(side), grid.device) for side in zip(*pairs))
    differ = (grid[a] != grid[b]).any(1) | (modality[a] != modality[b])

    def shared():
        i, j = pairs[first_true(differ)[0]]
        raise SchemaError(f"media_cache_keys: media items {i} and {j} share a key but have different grids ({grid[i].tolist()} and "
              f"{grid[j].tolist()}) or modalities: a key names one vision-tower input")

    checks.add(differ.any(), shared)
    lead = list(range(len(batch.media_cache_keys)))
    for i, j in pairs:
        lead[j] = i
    for mod, pixel_name in ((Modality.IMAGE, "pixel_values"), (Modality.VIDEO, "pixel_values_videos")):
        pixels = getattr(batch, pixel_name)
        if pixels is not None and pixels.dim() == 2:
            _check_shared_rows(batch, checks, mod, pixel_name, pixels, modality, grid, ints_on(lead, grid.device))


def _check_shared_rows(batch, checks: DeviceChecks, mod: Modality, pixel_name: str, pixels: Tensor, modality: Tensor,
                       grid: Tensor, lead: Tensor) -> None:
    """Items of ``mod`` that share a cache key with an earlier item (``lead``: the first item of
    each key) have its pixel rows, bitwise equal values: equal key means identical vision-tower
    input. One pass over the rows, no host sync (the rows of an item whose grid differs from its
    key's first item compare with themselves: that pair is refused by its grid)."""
    rows = grid.prod(1)
    mine = modality == int(mod)
    start = offsets(rows, modality)  # each item's first row in its modality's pixel tensor
    end = torch.cummax(torch.where(mine, start + rows, 0), 0).values  # non-decreasing: items of mod end in order
    R = pixels.shape[0]
    row = torch.arange(R, device=pixels.device)
    item = torch.searchsorted(end, row, right=True).clamp(max=max(len(lead) - 1, 0))
    leader = lead[item]
    comparable = (leader != item) & mine[leader] & (grid[leader] == grid[item]).all(1)
    source = torch.where(comparable, start[leader] + row - start[item], row).clamp(0, max(R - 1, 0))
    differ = comparable & (pixels[source] != pixels).any(1)

    def unequal():
        r = first_true(differ)[0]
        g, i = int(item[r]), int(leader[r])
        raise SchemaError(f"media_cache_keys: media items {i} and {g} share the key {batch.media_cache_keys[g][:40]!r} but "
                          f"their pixel rows differ ({pixel_name} row {r}, row {r - int(start[g])} of item {g}): a key "
                          "names one vision-tower input; give different contents different keys (the builders derive "
                          "each key from the pixels when none is given)")

    checks.add(differ.any(), unequal)


def ints_on(values: list[int], device: torch.device) -> Tensor:
    """Host ints as an int64 tensor on ``device`` without a host sync (on CUDA a pinned,
    non-blocking copy: a plain one from pageable memory waits for the device)."""
    host = torch.tensor(values, dtype=torch.int64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
