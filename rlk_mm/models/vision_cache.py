"""``VisionCache``: vision-tower rows of media items by ``media_cache_key`` (each unique
item through the tower once; for a DeepStack family its DeepStack levels with it), and
``check_pixels``, the check every runner makes first (every media item's vision-tower input
rows are in the batch)."""

from __future__ import annotations

import torch

from ..schema import Modality
from ..schema.batch import batch_arg
from ..schema.checks import DeviceChecks, bool_arg
from .family import check_batch_family, model_family

__all__ = ["VisionCache"]


def check_pixels(batch) -> None:
    """Every media item has its vision-tower input rows in the batch."""
    images = 0 if batch.image_grid_thw is None else batch.image_grid_thw.shape[0]
    videos = 0 if batch.video_grid_thw is None else batch.video_grid_thw.shape[0]
    for kind, first, count, pixels in (("image", 0, images, batch.pixel_values), ("video", images, videos, batch.pixel_values_videos)):
        if count and pixels is None:
            raise ValueError(f"media item {first} ({kind}) has no pixel values in the batch: keep the processor's pixel values "
                             "in the batch, or pass media_embeds (a VisionCache's rows) to forward_hidden / batch_logprobs")


def _raise(message: str):
    raise ValueError(message)


class _GatherRows(torch.autograd.Function):
    """``table[index]`` whose backward sums each table row's users in a fixed (item) order."""

    @staticmethod
    def forward(ctx, table, index, ranks):
        ctx.ranks, ctx.rows = ranks, table.shape[0]
        return table.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        for dst, src in ctx.ranks:  # rank r: the r-th user of every shared row; dst rows distinct
            out[dst] += grad[src]
        return out, None, None


class VisionCache:
    """Vision-tower rows of media items by ``media_cache_key``: each unique item runs once.

    ``cache(batch)`` returns every media item's rows, items in batch order, concatenated
    (the ``media_embeds`` of ``forward_hidden``): ``[R, H]``, or ``[R, 1 + k, H]`` for a
    DeepStack family (Qwen3-VL: the merged rows, then the ``k`` DeepStack levels). Items sharing a key (a GRPO
    group's image) go through the tower once and are gathered to each user; the backward
    of that gather sums the users' gradients in item order (no atomics). With
    ``keep=True`` rows also stay cached across calls until ``clear()`` (no-grad use, e.g.
    old/reference log-probs of one step that see the same images).

    Items sharing a key must have one grid, modality and pixel values (checked, one host
    sync); a key kept from an earlier call must come with the grid it had then (its pixels
    are not kept: keys that are not content hashes need ``clear()`` between batches).
    """

    def __init__(self, model, *, keep: bool = False):
        self.family = model_family(model)
        self.model = model
        self.keep = bool_arg("keep", keep)
        self._kept: dict[str, torch.Tensor] = {}
        self._kept_grid: dict[str, tuple[list[int], int]] = {}  # the (grid, modality) each kept key had
        self.items_requested = 0
        self.items_encoded = 0

    def clear(self) -> None:
        self._kept.clear()
        self._kept_grid.clear()

    def __call__(self, batch) -> torch.Tensor:
        visual = self.model.model.visual
        m = batch_arg("batch", batch).num_media
        check_batch_family(self.family, batch)
        if self.keep and torch.is_grad_enabled():
            raise RuntimeError("VisionCache(keep=True) keeps rows across calls; use it under torch.no_grad()")
        if m == 0:
            levels = [1 + self.family.deepstack_levels(self.model)] if self.family.deepstack else []
            return torch.zeros((0, *levels, self.model.config.text_config.hidden_size), dtype=visual.dtype,
                               device=visual.device)
        check_pixels(batch)
        keys, pixels = batch.media_cache_keys, batch.media_pixel_rows()
        grids, modality = batch.media_grid_thw.tolist(), batch.media_modality.tolist()
        users = self._users(keys, grids, modality, pixels)
        self.items_requested += m
        rows = dict(self._kept)
        missing = [users[k][0] for k in users if k not in rows]
        for kind in (int(Modality.IMAGE), int(Modality.VIDEO)):
            todo = [i for i in missing if modality[i] == kind]
            if not todo:
                continue
            grid = torch.tensor([grids[i] for i in todo], device=visual.device)
            out = self.family.vision_rows(self.model, torch.cat([pixels[i] for i in todo]), grid)
            counts = [g[0] * g[1] * g[2] // batch.spatial_merge_size**2 for g in (grids[i] for i in todo)]
            for i, part in zip(todo, torch.split(out, counts)):
                rows[keys[i]] = part
            self.items_encoded += len(todo)
        if self.keep:
            self._kept.update({k: v.detach() for k, v in rows.items()})
            self._kept_grid.update({k: (grids[u[0]], modality[u[0]]) for k, u in users.items()})
        unique = list(users)
        table = torch.cat([rows[k] for k in unique])
        counts = batch.media_token_counts()
        sizes = torch.tensor([rows[k].shape[0] for k in unique])
        start_of_key = dict(zip(unique, (torch.cumsum(sizes, 0) - sizes).tolist()))
        out_start = (torch.cumsum(counts, 0) - counts).tolist()
        index = torch.cat([torch.arange(start_of_key[k], start_of_key[k] + int(c)) for k, c in zip(keys, counts)])
        ranks = []
        for r in range(max(len(u) for u in users.values())):
            pairs = [(start_of_key[k], out_start[u[r]], int(counts[u[r]])) for k, u in users.items() if len(u) > r]
            dst = torch.cat([torch.arange(a, a + n) for a, _, n in pairs]).to(table.device)
            src = torch.cat([torch.arange(b, b + n) for _, b, n in pairs]).to(table.device)
            ranks.append((dst, src))
        return _GatherRows.apply(table, index.to(table.device), ranks)

    def _users(self, keys: list[str], grids: list, modality: list, pixels: list) -> dict[str, list[int]]:
        """The items of each key (first-appearance order), after checking that equal keys mean
        one vision-tower input: within the batch (grid, modality, pixels) and against kept rows."""
        users: dict[str, list[int]] = {}
        checks = DeviceChecks()
        for item, key in enumerate(keys):
            first = users.setdefault(key, [item])[0]
            kept = self._kept_grid.get(key)
            if kept is not None and kept != (grids[item], modality[item]):
                raise ValueError(
                    f"media_cache_keys: item {item}'s key {key!r} is kept from an earlier call with grid {kept[0]} (modality "
                    f"{kept[1]}) but has grid {grids[item]} (modality {modality[item]}) here; equal keys must mean identical "
                    "vision-tower input: call clear() between batches whose keys are not content hashes"
                )
            if first == item:
                continue
            if grids[first] != grids[item] or modality[first] != modality[item]:
                raise ValueError(
                    f"media_cache_keys: items {first} and {item} share key {key!r} but have grids {grids[first]} / "
                    f"{grids[item]} (modality {modality[first]} / {modality[item]}); equal keys must mean identical vision-tower input"
                )
            checks.add((pixels[first] != pixels[item]).any(), lambda first=first, item=item, key=key: _raise(
                f"media_cache_keys: items {first} and {item} share key {key!r} but their pixel values differ; equal keys "
                "must mean identical vision-tower input"))
            users[key].append(item)
        checks.run()
        return users
