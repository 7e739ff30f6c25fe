"""Layout parity: do a rollout and a trainer see the same token layout?

``check_layout_parity`` compares two ``RLBatch``es sample by sample, vectorized over
all tokens: token ids, valid-token counts, media placeholder spans, M-RoPE positions
(t, h, w separately), loss spans, media ids and cache keys, and the processor
fingerprint. Padding is stripped when a batch is built, so the same content left- or
right-padded compares equal. Every log-prob comparison must pass it first.

The first mismatch carries a diagnosis where the cause can be told from the two batches: a
differing media item (both sides' placeholder counts, grids and recorded resize settings, and
the cause: other processor settings, another input image, other pixel values, placeholders
expanded twice), a text difference among a Qwen3-VL video's frames (other timestamps, or the
outer vision pair some transformers releases write), a text difference under other processors
(the chat template or tokenizer),
or 1-D positions where M-RoPE was expected. Otherwise it is None: the cause is unknown, and no
guess is made.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch

from ..counts import plural
from ..schema import Modality, RLBatch, Span, key_settings
from ..schema.batch import batch_arg

__all__ = ["check_layout_parity", "LayoutParityError", "LayoutParityReport", "Mismatch"]

#: compared per-token fields, in the order used to break ties at one position
_TOKEN_FIELDS = ("input_ids", "modality_spans", "position_ids.t", "position_ids.h", "position_ids.w", "loss_spans")
_CONTEXT_TOKENS = 3


class LayoutParityError(ValueError):
    """Two batches do not share a token layout; ``.report`` holds the details."""

    def __init__(self, report: "LayoutParityReport"):
        self.report = report
        super().__init__(str(report))


@dataclass
class Mismatch:
    """One field of one sample that differs (``sample``/``position`` are None for batch-level fields)."""

    field: str
    sample: Optional[int]
    position: Optional[int]
    rollout: Any
    training: Any
    count: int = 1  # differing positions (or items) of this field in this sample
    span: Optional[str] = None  # the rollout-side span holding the position, e.g. "image #0[14, 30)"
    context_rollout: Optional[str] = None
    context_training: Optional[str] = None
    diagnosis: Optional[str] = None  # the likely cause, on the first mismatch where media items differ

    def describe(self) -> str:
        where = "batch" if self.sample is None else f"sample {self.sample}" + ("" if self.position is None else f", position {self.position}")
        span = f" in {self.span}" if self.span else ""
        more = f" ({self.count} differing)" if self.count > 1 else ""
        text = f"{self.field}: {where}{span}: rollout {self.rollout!r} vs training {self.training!r}{more}"
        if self.context_rollout is not None:
            text += f"\n    rollout : {self.context_rollout}\n    training: {self.context_training}"
        return text if self.diagnosis is None else f"{self.diagnosis}\n    ({text})"


@dataclass
class LayoutParityReport:
    """Result of ``check_layout_parity``: ``ok``, every mismatch ordered by (sample, position), ``first``."""

    mismatches: list[Mismatch] = field(default_factory=list)
    num_samples: int = 0
    num_tokens: int = 0

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def first(self) -> Optional[Mismatch]:
        """The earliest per-token mismatch; a batch-level one (fingerprint, sample count) if none."""
        per_sample = [m for m in self.mismatches if m.sample is not None]
        return (per_sample or self.mismatches or [None])[0]

    def fields(self) -> list[str]:
        return sorted({m.field for m in self.mismatches})

    def raise_if_mismatch(self) -> "LayoutParityReport":
        if not self.ok:
            raise LayoutParityError(self)
        return self

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "first": None if self.first is None else asdict(self.first),
            "mismatches": [asdict(m) for m in self.mismatches],
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        if self.ok:
            return f"layout parity OK: {plural(self.num_samples, 'sample')}, {plural(self.num_tokens, 'token')} match"
        lines = [f"layout parity FAILED: {plural(len(self.mismatches), 'mismatch')} over {plural(self.num_samples, 'sample')}",
                 "first: " + self.first.describe()]
        others = [m for m in self.mismatches if m is not self.first]
        for m in others[:20]:
            lines.append("  - " + m.describe().replace("\n", "\n    "))
        if len(others) > 20:
            lines.append(f"  ... {len(others) - 20} more (report.to_dict() has them all)")
        return "\n".join(lines)


def _segment_first(diff: torch.Tensor, sample_of: torch.Tensor, position: torch.Tensor, num_samples: int):
    """Per sample: first differing position (or -1) and the number of differing positions."""
    big = torch.iinfo(torch.int64).max
    first = torch.full((num_samples,), big, dtype=torch.int64)
    first.scatter_reduce_(0, sample_of[diff], position[diff], reduce="amin")
    count = torch.bincount(sample_of[diff], minlength=num_samples)
    first[first == big] = -1
    return first, count


def _token_views(batch: RLBatch) -> dict[str, torch.Tensor]:
    """Per-token integer views of the compared fields, all [T]."""
    ms = batch.modality_spans
    # media spans are numbered 1.. in sequence order within their sample; text is 0
    is_media = (ms.modality != int(Modality.TEXT)).long()
    before = torch.cumsum(is_media, 0) - is_media
    rank = before - before[ms.sample_ptr[:-1].long()][ms.span_sample()]
    span_code = ms.modality.long() * (1 << 20) + (rank + 1) * is_media
    pos = batch.position_ids
    return {
        "input_ids": batch.input_ids,
        "modality_spans": batch.per_token(span_code),
        "position_ids.t": pos[0],
        "position_ids.h": pos[1],
        "position_ids.w": pos[2],
        "loss_spans": batch.loss_mask().long(),
    }


def _describe_value(field_name: str, value: int) -> Any:
    if field_name == "modality_spans":
        modality, media = divmod(int(value), 1 << 20)
        label = Modality(modality).label
        return label if media == 0 else f"{label} #{media - 1}"
    if field_name == "loss_spans":
        return "scored" if value else "not scored"
    return int(value)


def _span_at(batch: RLBatch, b: int, p: int) -> Optional[str]:
    if b >= batch.num_samples:
        return None
    for s in batch.modality_spans_of(b):
        if p in s:
            if s.modality == Modality.TEXT:
                return str(s)
            local = sum(1 for t in batch.modality_spans_of(b) if t.media_index >= 0 and t.start < s.start)
            return str(Span(s.start, s.end, s.modality, local))
    return None


def _context(batch: RLBatch, b: int, p: int, decode: Optional[Callable]) -> str:
    ids = batch.sample_tokens(b).tolist()
    lo, hi = max(0, p - _CONTEXT_TOKENS), min(len(ids), p + _CONTEXT_TOKENS + 1)

    def show(tok: int) -> str:
        return repr(decode([tok])) if decode else str(tok)

    left = " ".join(show(t) for t in ids[lo:p])
    here = f"[{show(ids[p])}]" if p < len(ids) else "[<end>]"
    right = " ".join(show(t) for t in ids[p + 1 : hi])
    return f"...{left} {here} {right}...".replace("  ", " ")


def check_layout_parity(rollout: RLBatch, training: RLBatch, *, tokenizer=None) -> LayoutParityReport:
    """Compare two batches' layouts; ``tokenizer`` (optional, anything with ``decode(ids)``)
    decodes the context tokens around the first mismatch."""
    batch_arg("rollout", rollout)
    batch_arg("training", training)
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(f"tokenizer must have a decode(ids) method (e.g. processor.tokenizer), got {type(tokenizer).__name__}")
    decode = None if tokenizer is None else (lambda ids: tokenizer.decode(ids))
    report = LayoutParityReport(num_samples=training.num_samples, num_tokens=training.num_tokens)
    found: list[Mismatch] = []
    if rollout.processor_fingerprint != training.processor_fingerprint:
        found.append(Mismatch("processor_fingerprint", None, None, rollout.processor_fingerprint[:16], training.processor_fingerprint[:16]))
    if rollout.num_samples != training.num_samples:
        found.append(Mismatch("num_samples", None, None, rollout.num_samples, training.num_samples))
    B = min(rollout.num_samples, training.num_samples)
    ra, tb = rollout.to("cpu"), training.to("cpu")
    if rollout.num_samples != B:
        ra = ra.select(range(B))
    if training.num_samples != B:
        tb = tb.select(range(B))
    la, lb = ra.seq_lengths(), tb.seq_lengths()
    views_a, views_b = _token_views(ra), _token_views(tb)
    # compare the common prefix of every sample, vectorized over the whole batch
    common = torch.minimum(la, lb)
    total = int(common.sum())
    sample_of = torch.repeat_interleave(torch.arange(B), common, output_size=total)
    starts = torch.cumsum(common, 0) - common
    position = torch.arange(total) - starts[sample_of]
    same_lengths = bool(torch.equal(la, lb))
    if not same_lengths:
        idx_a = ra.cu_seqlens.long()[sample_of] + position
        idx_b = tb.cu_seqlens.long()[sample_of] + position
    per_field = {}
    for name in _TOKEN_FIELDS:
        if same_lengths:  # the common case: both batches index tokens the same way
            diff = views_a[name] != views_b[name]
        else:
            diff = views_a[name][idx_a] != views_b[name][idx_b]
        per_field[name] = _segment_first(diff, sample_of, position, B)
    for b in torch.nonzero(la != lb).flatten().tolist():
        found.append(Mismatch("length", b, int(common[b]), int(la[b]), int(lb[b]), count=abs(int(la[b] - lb[b]))))
    for name, (first, count) in per_field.items():
        for b in torch.nonzero(first >= 0).flatten().tolist():
            p = int(first[b])
            va = views_a[name][int(ra.cu_seqlens[b]) + p]
            vb = views_b[name][int(tb.cu_seqlens[b]) + p]
            found.append(Mismatch(name, b, p, _describe_value(name, va), _describe_value(name, vb), count=int(count[b])))
    # media ids / keys, per sample in sequence order
    for name in ("media_ids", "media_cache_keys"):
        found += _compare_media(ra, tb, name, B)
    order = {n: i for i, n in enumerate(("length",) + _TOKEN_FIELDS + ("media_ids", "media_cache_keys"))}
    found.sort(key=lambda m: (-1 if m.sample is None else m.sample, -1 if m.position is None else m.position, order.get(m.field, -1)))
    for m in found:
        if m.sample is not None and m.position is not None:
            m.span = _span_at(tb, m.sample, m.position) or _span_at(ra, m.sample, m.position)
    first = next((m for m in found if m.sample is not None), None)
    if first is not None:
        first.diagnosis = _diagnose(ra, tb, first, rollout.processor_fingerprint != training.processor_fingerprint)
    if first is not None and first.position is not None:
        first.context_rollout = _context(ra, first.sample, first.position, decode)
        first.context_training = _context(tb, first.sample, first.position, decode)
    report.mismatches = found
    return report


def _media_by_sample(batch: RLBatch, name: str, B: int) -> list[list[tuple[int, str]]]:
    """Per sample, (span start, value of ``name``) of its media items in sequence order."""
    ms = batch.modality_spans
    sel = ms.media_index >= 0
    values = getattr(batch, name)
    out: list[list[tuple[int, str]]] = [[] for _ in range(B)]
    for g, b, start in zip(ms.media_index[sel].tolist(), ms.span_sample()[sel].tolist(), ms.starts[sel].tolist()):
        out[b].append((start, values[g]))
    return out


def _compare_media(ra: RLBatch, tb: RLBatch, name: str, B: int) -> list[Mismatch]:
    if not ra.num_media and not tb.num_media:
        return []
    out = []
    for b, (ma, mb) in enumerate(zip(_media_by_sample(ra, name, B), _media_by_sample(tb, name, B))):
        va, vb = [v for _, v in ma], [v for _, v in mb]
        if va == vb:
            continue
        n = max(len(va), len(vb))
        va += [None] * (n - len(va))
        vb += [None] * (n - len(vb))
        differing = [k for k in range(n) if va[k] != vb[k]]
        k = differing[0]
        position = (mb[k] if k < len(mb) else ma[k])[0]
        out.append(Mismatch(name, b, position, va[k], vb[k], count=len(differing)))
    return out


# ----------------------------------------------------------------------------- drift diagnosis
@dataclass
class _Item:
    label: str  # "image #0": the sample's first image
    modality: int
    start: int
    end: int
    grid: list[int]
    key: str
    index: int  # the batch's media index

    def describe(self) -> str:
        settings = key_settings(self.key)
        extra = "" if settings is None else ", " + settings.describe()
        return f"{plural(self.end - self.start, 'placeholder token')} (grid {'×'.join(map(str, self.grid))}{extra})"


def _items(batch: RLBatch, b: int) -> list[_Item]:
    """Sample ``b``'s media items in sequence order."""
    out, seen = [], {}
    for s in batch.modality_spans_of(b):
        if s.media_index < 0:
            continue
        n = seen.setdefault(s.modality, 0)
        seen[s.modality] += 1
        out.append(_Item(f"{Modality(s.modality).label} #{n}", int(s.modality), s.start, s.end,
                         batch.media_grid_thw[s.media_index].tolist(), batch.media_cache_keys[s.media_index],
                         int(s.media_index)))
    return out


def _runs(items: list[_Item]) -> list[list[_Item]]:
    """Items in runs of adjacent placeholders of one modality (one run per placeholder as written)."""
    runs: list[list[_Item]] = []
    for item in items:
        if runs and runs[-1][-1].end == item.start and runs[-1][-1].modality == item.modality:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _diagnose(ra: RLBatch, tb: RLBatch, first: Mismatch, fingerprints_differ: bool) -> Optional[str]:
    """The likely cause of the first mismatch (``first``) of sample ``first.sample``, told from
    the two batches alone; None when it cannot be told (no cause is guessed)."""
    b = first.sample
    if b >= ra.num_samples or b >= tb.num_samples:
        return None
    media = _media_cause(ra, tb, b, fingerprints_differ)
    if media is not None:
        return media
    if first.field in ("input_ids", "modality_spans") and first.position is not None:
        video = _video_text_cause(ra, tb, b, first.position)
        if video is not None:
            return video
    if fingerprints_differ and first.field == "input_ids" and first.position is not None:
        return (f"sample {b}, position {first.position}: a text token differs and the processor fingerprints differ: "
                "most likely the processors' chat templates or tokenizers differ (or the prompts' text does)")
    if first.field.startswith("position_ids") and _one_d_media_positions(ra, b) and not _one_d_media_positions(tb, b):
        return (f"sample {b}: the rollout's positions are 1-D (t = h = w, one step per token) on its media tokens where "
                "the training batch has M-RoPE positions: the rollout computed positions without mm_token_type_ids / "
                "image_grid_thw")
    return None


def _media_cause(ra: RLBatch, tb: RLBatch, b: int, fingerprints_differ: bool) -> Optional[str]:
    """The first media item of sample ``b`` whose difference has a cause to name; None when the
    media agree, or differ only in keys explained by other processor fingerprints."""
    pixels_a, pixels_b = ra.media_pixel_rows(), tb.media_pixel_rows()
    for rr, rt in zip(_runs(_items(ra, b)), _runs(_items(tb, b))):
        for side, many, one in (("rollout", rr, rt), ("training", rt, rr)):
            if len(one) == 1 and len(many) > 1 and all(i.grid == one[0].grid for i in many):
                times = "twice" if len(many) == 2 else f"{len(many)} times"
                return (f"sample {b}, {one[0].label}: {side} {many[-1].end - many[0].start} placeholder tokens where its grid "
                        f"{'×'.join(map(str, one[0].grid))} implies {one[0].end - one[0].start}: placeholders expanded {times}")
        for ir, it in zip(rr, rt):
            if ir.grid == it.grid and ir.key == it.key:
                continue
            head = f"sample {b}, {it.label}: rollout {ir.describe()} vs training {it.describe()}"
            sr, st = key_settings(ir.key), key_settings(it.key)
            settings_differ = sr is not None and st is not None and sr != st
            if ir.grid != it.grid:
                if fingerprints_differ:
                    return f"{head}: the rollout's processor has other settings (the processor fingerprints differ)"
                if settings_differ:
                    return f"{head}: the rollout resized with other settings (the recorded resize settings differ)"
                return (f"{head}: the processor fingerprints are equal: the input image differs (another size, or "
                        "re-encoded before the processor), or per-call resize arguments differ")
            if settings_differ:
                return f"{head}: the rollout resized with other settings (the recorded resize settings differ)"
            pa, pb = pixels_a[ir.index], pixels_b[it.index]
            if pa is None or pb is None:
                if fingerprints_differ:
                    return None  # the fingerprint is part of the key: other pixels cannot be told from it
                return f"{head}: other cache keys for one grid; a batch keeps no pixel rows to tell whether the pixels differ"
            if pa.shape == pb.shape and torch.equal(pa, pb):
                if fingerprints_differ:
                    continue  # identical pixels: the keys differ through the fingerprint only
                return f"{head}: identical pixel rows under other cache keys: the keys were given differently"
            return f"{head}: same grid, other pixel values: another image, or other resampling or normalization"
    return None


#: how far before a Qwen3-VL video's first temporal patch its own text may start: an outer
#: <|vision_start|> and the timestamp text ("<0.2 seconds>") with the patch's own <|vision_start|>
_VIDEO_LEAD = 12


def _video_text(batch: RLBatch, b: int) -> Optional[tuple[int, int, bool]]:
    """(start, end, outer pair) of the stretch of sample ``b`` that holds its timestamped video
    frames (Qwen3-VL layout: each temporal patch its own item between its own vision markers);
    ``outer pair``: one vision-start token more than frames there. None without video."""
    if batch.layout_family != "qwen3_vl":
        return None
    frames = [s for s in batch.modality_spans_of(b) if s.modality == int(Modality.VIDEO)]
    if not frames or frames[0].start == 0:
        return None
    ids = batch.input_ids[int(batch.cu_seqlens[b]) : int(batch.cu_seqlens[b + 1])]
    start, end = max(frames[0].start - _VIDEO_LEAD, 0), min(frames[-1].end + 2, ids.numel())
    vision_start = ids[frames[0].start - 1]  # each temporal patch's own marker
    return start, end, int((ids[start:end] == vision_start).sum()) > len(frames)


def _video_text_cause(ra: RLBatch, tb: RLBatch, b: int, p: int) -> Optional[str]:
    """A text difference among a Qwen3-VL video's frames: the outer vision pair, or the timestamps."""
    vr, vt = _video_text(ra, b), _video_text(tb, b)
    if vr is None or vt is None or not (vr[0] <= p < vr[1] or vt[0] <= p < vt[1]):
        return None
    if vr[2] != vt[2]:
        side = "the rollout" if vr[2] else "the training batch"
        return (f"sample {b}, position {p}: {side} writes an outer <|vision_start|> ... <|vision_end|> pair around the "
                "video's timestamped frames and the other does not (transformers 5.x releases differ here; the "
                "processor fingerprints record the version): build rollout and training batches with the same "
                "transformers")
    return (f"sample {b}, position {p}: the text between the video's temporal patches differs: the timestamps "
            "('<t seconds>' before each patch) come from another frame rate or other sampled frame indices "
            "(the video metadata given to the processor)")


def _one_d_media_positions(batch: RLBatch, b: int) -> bool:
    """Sample ``b`` has media tokens and 1-D positions: t = h = w on every token, one step per token."""
    if not any(s.media_index >= 0 for s in batch.modality_spans_of(b)):
        return False
    pos = batch.sample_positions(b)
    return bool((pos[0] == pos[1]).all() and (pos[1] == pos[2]).all() and (torch.diff(pos[0]) == 1).all())
