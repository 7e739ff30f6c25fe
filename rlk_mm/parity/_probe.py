"""Runs of a Qwen2.5-VL model on a batch for the invariance sweep, where one sample's rows
sit in each tower call of a run, and the probe that names the first module whose output
differs between two runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..models.forward import forward_hidden, group_hidden, layout_inputs, prompt_lengths
from ..models.vision_cache import VisionCache
from ..schema import PaddingSide, RLBatch
from .invariance_report import Divergence

__all__ = [
    "cached_views", "first_divergence", "forward_run", "forward_views", "group_run", "item_rows", "Recorder", "Run",
    "Views", "vision_cache_run",
]


@dataclass
class Views:
    """Where one sample's rows are in each tower call of a run (for the probe).

    vision: per vision-tower call, (patch rows, merged rows) of the sample's items;
    text: per language-model call, (batch, length, rows of the flattened output)."""

    vision: list[tuple[int, torch.Tensor, torch.Tensor]]
    text: list[tuple[int, int, torch.Tensor]]
    merge: int  # vision patches per merged row


@dataclass
class Run:
    """One way of scoring a batch: ``execute()`` gives the hidden states scoring each loss token."""

    batch: RLBatch
    execute: Callable[[], torch.Tensor]
    views: Callable[[int], Views]


def item_rows(batch: RLBatch, items: list[int], sample: int, merge: int):
    """Patch / merged rows of ``sample``'s items when ``items`` go through the tower in this order."""
    grids = batch.media_grid_thw.long()
    patch, merged, p0 = [], [], 0
    mine = [] if batch.media_sample is None else [int(batch.media_sample[i]) == sample for i in range(batch.num_media)]
    for i in items:
        n = int(grids[i].prod())
        if mine[i]:
            patch.append(torch.arange(p0, p0 + n))
            merged.append(torch.arange(p0 // merge, (p0 + n) // merge))
        p0 += n
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)  # noqa: E731
    return p0, cat(patch), cat(merged)


def forward_views(batch: RLBatch, padding: PaddingSide | str | None, sample: int) -> Views:
    inputs, rows = layout_inputs(batch, padding)
    shape = inputs["input_ids"].shape
    cu = batch.cu_seqlens.long().tolist()
    merge = batch.spatial_merge_size**2
    vision = []
    for kind in (1, 2):  # images, then videos: one tower call each
        items = [] if batch.media_modality is None else [i for i in range(batch.num_media) if int(batch.media_modality[i]) == kind]
        if items:
            vision.append(item_rows(batch, items, sample, merge))
    return Views(vision, [(shape[0], shape[1], rows[cu[sample] : cu[sample + 1]].cpu())], merge)


def cached_views(batch: RLBatch, sample: int) -> Views:
    """Views of ``group_hidden``: VisionCache tower calls on unique items, then per group the
    prompt call and the responses call."""
    merge = batch.spatial_merge_size**2
    vision = []
    first: dict[str, int] = {}
    for i, key in enumerate(batch.media_cache_keys):
        first.setdefault(key, i)
    for kind in (1, 2):
        uniq = [i for i in first.values() if int(batch.media_modality[i]) == kind]
        if uniq:
            total, _, _ = item_rows(batch, uniq, sample, merge)
            mine = [i for i in range(batch.num_media) if int(batch.media_sample[i]) == sample
                    and int(batch.media_modality[i]) == kind]
            grids = batch.media_grid_thw.long()
            offsets = {}
            p0 = 0
            for i in uniq:
                offsets[i] = p0
                p0 += int(grids[i].prod())
            patch = [torch.arange(offsets[first[batch.media_cache_keys[i]]],
                                  offsets[first[batch.media_cache_keys[i]]] + int(grids[i].prod())) for i in mine]
            patch = torch.cat(patch) if patch else torch.zeros(0, dtype=torch.int64)
            merged = torch.unique_consecutive(patch // merge)
            vision.append((total, patch, merged))
    text = []
    cu = batch.cu_seqlens.long().tolist()
    group = batch.group_index().tolist()
    prompt = prompt_lengths(batch)
    for g in range(max(group) + 1):
        members = [b for b, x in enumerate(group) if x == g]
        p = prompt[members[0]]
        text.append((1, p, torch.arange(p) if sample in members else torch.zeros(0, dtype=torch.int64)))
        lengths = [cu[b + 1] - cu[b] - p for b in members]
        width = max(lengths)
        if width:
            rows = torch.zeros(0, dtype=torch.int64)
            if sample in members:
                j = members.index(sample)
                rows = j * width + torch.arange(lengths[j])
            text.append((len(members), width, rows))
    return Views(vision, text, merge)


def forward_run(model, batch: RLBatch, padding: PaddingSide | str | None) -> Run:
    rows, _ = batch.loss_token_index()
    return Run(batch, lambda: forward_hidden(model, batch, padding=padding)[rows],
                lambda s: forward_views(batch, padding, s))


def vision_cache_run(model, batch: RLBatch, media: Optional[RLBatch] = None) -> Run:
    """The forward with ``VisionCache`` embeddings of ``media`` (default: the batch itself; the
    batch's videos frame by frame, ``VideoLayout.frame_batch``, for the frames case)."""
    rows, _ = batch.loss_token_index()
    media = batch if media is None else media

    def execute():
        return forward_hidden(model, batch, media_embeds=VisionCache(model)(media))[rows]

    def views(s):
        cached = cached_views(media, s)
        return Views(cached.vision, forward_views(batch, None, s).text, cached.merge)

    return Run(batch, execute, views)


def group_run(model, batch: RLBatch) -> Run:
    return Run(batch, lambda: group_hidden(model, batch), lambda s: cached_views(batch, s))


class Recorder:
    """Forward hooks on every module inside the vision tower and the language model, keeping
    only one sample's rows (so the probe's memory is one sample's activations)."""

    def __init__(self, model, views: Views):
        self.views = views
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self.ops: dict[str, str] = {}
        self.calls = {"vision": -1, "text": -1}
        self.handles = []
        towers = {"vision": model.model.visual, "text": model.model.language_model}
        for tower, root in towers.items():
            self.handles.append(root.register_forward_pre_hook(self._count(tower)))
            prefix = "model.visual." if tower == "vision" else "model.language_model."
            for name, module in root.named_modules():
                if name:
                    self.handles.append(module.register_forward_hook(self._keep(tower, prefix + name)))

    def _count(self, tower):
        def hook(module, args):
            self.calls[tower] += 1
        return hook

    def _keep(self, tower, name):
        def hook(module, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if not torch.is_tensor(out):
                return
            rows = self._rows(tower, out)
            if rows is not None:
                self.outputs.setdefault(name, []).append(rows.detach().float().cpu())
                self.ops[name] = type(module).__name__
        return hook

    def _rows(self, tower, out):
        c = self.calls[tower]
        if tower == "vision":
            if c >= len(self.views.vision) or out.dim() < 1:
                return None
            total, patch, merged = self.views.vision[c]
            if out.shape[0] == total:
                return out[patch.to(out.device)]
            if out.shape[0] * self.views.merge == total:
                return out[merged.to(out.device)]
            return None
        if c >= len(self.views.text) or out.dim() < 2:
            return None
        b, length, rows = self.views.text[c]
        if tuple(out.shape[:2]) != (b, length):
            return None
        return out.reshape(b * length, *out.shape[2:])[rows.to(out.device)]

    def close(self):
        for h in self.handles:
            h.remove()

    def merged(self) -> dict[str, torch.Tensor]:
        return {k: torch.cat([v.reshape(v.shape[0], -1) for v in vs]) for k, vs in self.outputs.items()}


def first_divergence(model, ref: Run, case: Run, ref_sample: int, case_sample: int, score_diff: float) -> Divergence:
    """Re-run both with hooks; the first module (reference execution order) whose rows for the sample differ."""
    recorded = []
    for run, s in ((ref, ref_sample), (case, case_sample)):
        rec = Recorder(model, run.views(s))
        try:
            with torch.no_grad():
                run.execute()
        finally:
            rec.close()
        recorded.append(rec)
    a, b = recorded[0].merged(), recorded[1].merged()
    index = {name: k for k, (name, _) in enumerate(model.named_modules())}
    for name in a:
        if name not in b:
            continue
        if a[name].shape != b[name].shape:
            return Divergence(ref_sample, name, recorded[0].ops[name], float("nan"), index[name], len(a))
        if not torch.equal(a[name], b[name]):
            diff = float((a[name] - b[name]).abs().max())
            return Divergence(ref_sample, name, recorded[0].ops[name], diff, index[name], len(a))
    return Divergence(ref_sample, "lm_head", "selected_logprob", score_diff, len(index), len(a))
