"""``VideoLayout``: a batch's videos frame by frame.

A *frame* here is one temporal patch: the ``temporal_patch_size`` consecutive input frames
(2 for Qwen2(.5)-VL) that the processor stacks into one grid step. It is the unit of the
model's temporal position ids and of the vision tower's attention (Qwen2(.5)-VL's tower
attends within a frame only, and its rotary embedding sees (h, w), not t), so a frame's
vision-tower output depends on its own pixel rows alone: equal frames can be encoded once.

Row orders of one video of grid (t, h, w) and merge size m:
- *token-major* (the processor's ``pixel_values_videos`` order): (t, h/m, w/m, m, m), the
  m × m patches of one LLM token consecutive; the tower's output rows are (t, h/m, w/m),
  the order of the video's placeholder tokens;
- *frame-major*: (t, h, w), each frame's patches in raster order.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from ._assemble import assemble, present_fields, sample_parts
from .batch import RLBatch
from .checks import float_arg, int_arg
from .media import MediaItem
from .spans import Modality, Span

Tensor = torch.Tensor


_BATCH = object()  # temporal_positions' default: read the batch's own positions

class VideoLayout:
    """The video items of an ``RLBatch``, in batch media order: per-frame token ranges,
    temporal positions, row permutations, per-frame masks and keys."""

    def __init__(self, batch: RLBatch):
        if not isinstance(batch, RLBatch):
            raise TypeError(f"batch must be an RLBatch, got {type(batch).__name__}")
        self.batch = batch
        modality = [] if batch.media_modality is None else batch.media_modality.tolist()
        self.items = [g for g, m in enumerate(modality) if m == int(Modality.VIDEO)]
        self.merge = batch.spatial_merge_size
        spans = batch.modality_spans
        media_index = spans.media_index.tolist()
        self._span = {media_index[s]: s for s in range(len(media_index)) if media_index[s] >= 0}
        self.grids = [batch.media_grid_thw[g].tolist() for g in self.items]
        self.samples = [int(batch.media_sample[g]) for g in self.items]
        self.starts = [int(spans.starts[self._span[g]]) for g in self.items]
        rows = [t * h * w for t, h, w in self.grids]
        self.row_starts = [sum(rows[:v]) for v in range(len(rows))]

    # ------------------------------------------------------------------ sizes
    @property
    def num_videos(self) -> int:
        return len(self.items)

    def _video(self, v) -> int:
        return int_arg("video", v, min=0, max=self.num_videos - 1) if self.num_videos else _no_videos()

    def num_frames(self, v: int) -> int:
        return self.grids[self._video(v)][0]

    def tokens_per_frame(self, v: int) -> int:
        _, h, w = self.grids[self._video(v)]
        return h * w // self.merge**2

    # ------------------------------------------------------------------ tokens and positions
    def frame_ranges(self, v: int) -> list[tuple[int, int]]:
        """Video ``v``'s frames as half-open position ranges ``[start, end)`` within its sample."""
        n, start = self.tokens_per_frame(v), self.starts[self._video(v)]
        return [(start + f * n, start + (f + 1) * n) for f in range(self.num_frames(v))]

    def temporal_positions(self, v: int, tokens_per_second=_BATCH) -> Tensor:
        """int64 [t]: the temporal (first-row) position id of each frame of video ``v``.

        By default the batch's own: ``position_ids[0]`` at each frame's first token (whatever
        ``tokens_per_second`` the batch was built with). With ``tokens_per_second`` given, what
        the model's ``get_rope_index`` computes with it: the video's start position plus
        ``int(f × tokens_per_second × second_per_grid)`` (Qwen2-VL: ``None``, one step per
        frame); ``second_per_grid`` is the batch's, else 1 (as the model).

        Raises
        ------
        ValueError
            ``v`` is not a video of the batch, or ``tokens_per_second`` is not > 0."""
        v = self._video(v)
        if tokens_per_second is _BATCH:
            offset = int(self.batch.cu_seqlens[self.samples[v]])
            firsts = torch.tensor([offset + lo for lo, _ in self.frame_ranges(v)], device=self.batch.device)
            return self.batch.position_ids[0, firsts].cpu()
        interval = 1.0
        if tokens_per_second is not None:
            tokens_per_second = float_arg("tokens_per_second", tokens_per_second, min=0.0, min_open=True)
            second = 1.0 if self.batch.second_per_grid_ts is None else self.batch.second_per_grid_ts[v].item()
            interval = tokens_per_second * second
        first = int(self.batch.cu_seqlens[self.samples[v]]) + self.starts[v]
        start = int(self.batch.position_ids[1, first])  # the h row of a video's first token is its start position
        return (torch.arange(self.num_frames(v)) * torch.tensor(interval, dtype=torch.float32)).long() + start

    def frame_token_mask(self, keep) -> Tensor:
        """bool [T] over the batch's tokens: False on the tokens of the frames ``keep`` drops,
        True elsewhere (text, images, kept frames). ``keep`` is one bool sequence (or 1-D bool
        tensor) per video, one entry per frame. Use it as an attention or scoring mask; the
        batch's position ids are untouched, so a dropped frame moves no other token."""
        if not isinstance(keep, Sequence) or isinstance(keep, (str, bytes)) or len(keep) != self.num_videos:
            raise ValueError(f"keep must hold one per-frame bool list per video ({self.num_videos} videos), got {keep!r:.80}")
        mask = torch.ones(self.batch.num_tokens, dtype=torch.bool)
        for v, flags in enumerate(keep):
            flags = flags.tolist() if isinstance(flags, Tensor) else flags
            if not isinstance(flags, Sequence) or len(flags) != self.num_frames(v) or not all(isinstance(f, bool) for f in flags):
                raise ValueError(f"keep[{v}] must be {self.num_frames(v)} bools (one per frame of video {v}), got {flags!r:.80}")
            offset = int(self.batch.cu_seqlens[self.samples[v]])
            for (lo, hi), kept in zip(self.frame_ranges(v), flags):
                if not kept:
                    mask[offset + lo : offset + hi] = False
        return mask.to(self.batch.device)

    # ------------------------------------------------------------------ vision-tower rows
    def frame_major_index(self) -> Tensor:
        """int64 [R] over ``pixel_values_videos``' rows: ``rows[index]`` puts every video's
        rows in frame-major (t, h, w) raster order; ``token_major_index`` undoes it."""
        out = []
        m = self.merge
        for (t, h, w), base in zip(self.grids, self.row_starts):
            tt, y, x = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            token_major = ((tt * (h // m) + y // m) * (w // m) + x // m) * m * m + (y % m) * m + x % m
            out.append(token_major.reshape(-1) + base)
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)

    def token_major_index(self) -> Tensor:
        """int64 [R]: the inverse of ``frame_major_index`` (frame-major rows back to the processor's order)."""
        index = self.frame_major_index()
        return torch.empty_like(index).scatter_(0, index, torch.arange(index.numel()))

    # ------------------------------------------------------------------ per-frame identity
    def frame_pixel_rows(self, v: int) -> list[Tensor]:
        """Video ``v``'s vision-tower input rows, one [h × w, D] block per frame."""
        v = self._video(v)
        if self.batch.pixel_values_videos is None:
            raise ValueError("the batch keeps no pixel_values_videos: per-frame rows need them")
        t, h, w = self.grids[v]
        rows = self.batch.pixel_values_videos[self.row_starts[v] : self.row_starts[v] + t * h * w]
        return list(rows.split(h * w))

    def frame_keys(self) -> list[list[str]]:
        """Per video, per frame: a content key of the frame's vision-tower input (its pixel
        rows, its (h, w) and the processor fingerprint). Equal key ⇒ equal tower output."""
        keys = []
        for v in range(self.num_videos):
            _, h, w = self.grids[v]
            keys.append([_frame_key(rows, h, w, self.batch.processor_fingerprint) for rows in self.frame_pixel_rows(v)])
        return keys

    def frame_batch(self):
        """The batch with every video split into one video item per frame (grid (1, h, w),
        the frame's key and pixel rows, id ``<video id>/frame<f>``), tokens and positions
        unchanged. ``VisionCache(model)(layout.frame_batch())`` encodes each distinct frame
        once, and its rows are the original batch's media rows in the same order (a
        frame's output depends on its own rows only), ready as ``media_embeds``."""
        batch = self.batch
        keys = {g: k for g, k in zip(self.items, self.frame_keys())}
        pixels = batch.media_pixel_rows()
        parts = []
        for b in range(batch.num_samples):
            part = sample_parts(batch, b, pixels)
            mine = [g for g in range(batch.num_media) if int(batch.media_sample[g]) == b]
            media, spans, renumber = [], [], {}
            for local, g in enumerate(mine):
                item = part.media[local]
                if g not in keys:
                    renumber[local] = [len(media)]
                    media.append(item)
                    continue
                t, h, w = item.grid.tolist()
                renumber[local] = list(range(len(media), len(media) + t))
                for f, (rows, key) in enumerate(zip(item.pixels.split(h * w), keys[g])):
                    media.append(MediaItem(Modality.VIDEO, torch.tensor([1, h, w]), rows, item.second_per_grid, key, f"{item.id}/frame{f}"))
            for s in part.modality_spans:
                if s.media_index < 0:
                    spans.append(s)
                    continue
                frames = renumber[s.media_index]
                n = (s.end - s.start) // len(frames)
                spans += [Span(s.start + k * n, s.start + (k + 1) * n, s.modality, i) for k, i in enumerate(frames)]
            part.media, part.modality_spans = media, spans
            parts.append(part)
        return RLBatch(**assemble(parts, present=present_fields(batch), device=batch.device, **batch._common()))


def _frame_key(rows: Tensor, h: int, w: int, fingerprint: str) -> str:
    data = rows.detach().contiguous().cpu()
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    digest = hashlib.sha256(f"{fingerprint}|video-frame|{h},{w}|".encode())
    digest.update(data.numpy().tobytes())
    return "frame-" + digest.hexdigest()


def _no_videos():
    raise ValueError("the batch has no video items")


__all__ = ["VideoLayout"]
