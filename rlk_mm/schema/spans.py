"""Spans: half-open ``[start, end)`` token ranges within one sequence, and their tensors.

``Span`` is the view for people and error messages; ``SpanTable`` stores the spans of a
whole batch as int32 tensors in CSR form by sample (``sample_ptr[b]:sample_ptr[b+1]``
are sample ``b``'s spans), so ops consume them on the device with no Python loop.
Positions are 0-based token indices within one sequence, before padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Iterable, Sequence

import torch


class SchemaError(ValueError):
    """A batch violates the batch contract. The message names field, sample, span and positions."""


class Modality(IntEnum):
    TEXT = 0
    IMAGE = 1
    VIDEO = 2
    AUDIO = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, order=True)
class Span:
    """Tokens ``[start, end)`` of one sample; media spans carry the batch-wide media index."""

    start: int
    end: int
    modality: Modality = Modality.TEXT
    media_index: int = -1

    def __post_init__(self):
        if self.start < 0 or self.end < self.start:
            raise SchemaError(f"span [{self.start}, {self.end}) is not a valid half-open range")
        object.__setattr__(self, "modality", Modality(self.modality))

    def __len__(self) -> int:
        return self.end - self.start

    def __contains__(self, position: int) -> bool:
        return self.start <= position < self.end

    def __str__(self) -> str:
        media = f" #{self.media_index}" if self.media_index >= 0 else ""
        return f"{self.modality.label}{media}[{self.start}, {self.end})"


# ----------------------------------------------------------------------------- algebra
def normalize(spans: Iterable[Span]) -> list[Span]:
    """Sorted union of the spans' positions as text spans: overlapping/touching ones merge, empty ones drop."""
    merged: list[list[int]] = []
    for s in sorted(spans, key=lambda s: (s.start, s.end)):
        if len(s) == 0:
            continue
        if merged and s.start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], s.end)
        else:
            merged.append([s.start, s.end])
    return [Span(a, b) for a, b in merged]


def union(a: Iterable[Span], b: Iterable[Span]) -> list[Span]:
    return normalize([*a, *b])


def intersect(a: Iterable[Span], b: Iterable[Span]) -> list[Span]:
    """Positions in both ``a`` and ``b``, normalized."""
    a, b = normalize(a), normalize(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i].start, b[j].start), min(a[i].end, b[j].end)
        if lo < hi:
            out.append(Span(lo, hi))
        if a[i].end < b[j].end:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Span], b: Iterable[Span]) -> list[Span]:
    """Positions in ``a`` and not in ``b``, normalized."""
    out = []
    b = normalize(b)
    for s in normalize(a):
        start = s.start
        for cut in b:
            if cut.end <= start or cut.start >= s.end:
                continue
            if cut.start > start:
                out.append(Span(start, cut.start))
            start = max(start, cut.end)
        if start < s.end:
            out.append(Span(start, s.end))
    return out


def complement(spans: Iterable[Span], length: int) -> list[Span]:
    """Positions of ``[0, length)`` not covered by ``spans``."""
    return subtract([Span(0, length)], spans)


def spans_from_mask(mask: Sequence[bool] | torch.Tensor) -> list[Span]:
    """Maximal runs of True in a 1-D mask, as text spans."""
    m = torch.as_tensor(mask, dtype=torch.bool).flatten()
    if m.numel() == 0:
        return []
    padded = torch.cat([torch.zeros(1, dtype=torch.int8), m.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    edges = torch.diff(padded)
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return [Span(s, e) for s, e in zip(starts, ends)]


def mask_from_spans(spans: Iterable[Span], length: int) -> torch.Tensor:
    mask = torch.zeros(length, dtype=torch.bool)
    for s in spans:
        if s.end > length:
            raise SchemaError(f"span {s} ends past the sequence length {length}")
        mask[s.start : s.end] = True
    return mask


# ----------------------------------------------------------------------------- tensors
class SpanTable:
    """The spans of a batch, CSR by sample, as int32 tensors (int8 modality).

    ``starts``/``ends``/``modality``/``media_index`` have one entry per span; spans of
    sample ``b`` are rows ``sample_ptr[b]:sample_ptr[b + 1]``, sorted by start.
    """

    __slots__ = ("starts", "ends", "modality", "media_index", "sample_ptr")

    def __init__(self, starts, ends, sample_ptr, modality=None, media_index=None):
        self.starts = torch.as_tensor(starts, dtype=torch.int32)
        self.ends = torch.as_tensor(ends, dtype=torch.int32, device=self.starts.device)
        self.sample_ptr = torch.as_tensor(sample_ptr, dtype=torch.int32, device=self.starts.device)
        n = self.starts.numel()
        self.modality = (
            torch.zeros(n, dtype=torch.int8, device=self.starts.device)
            if modality is None
            else torch.as_tensor(modality, dtype=torch.int8, device=self.starts.device)
        )
        self.media_index = (
            torch.full((n,), -1, dtype=torch.int32, device=self.starts.device)
            if media_index is None
            else torch.as_tensor(media_index, dtype=torch.int32, device=self.starts.device)
        )
        for name in ("ends", "modality", "media_index"):
            if getattr(self, name).shape != (n,):
                raise SchemaError(f"SpanTable.{name} has shape {tuple(getattr(self, name).shape)}, expected ({n},)")
        if self.sample_ptr.ndim != 1 or self.sample_ptr.numel() < 1:
            raise SchemaError("SpanTable.sample_ptr must be a 1-D tensor of length num_samples + 1")
        if int(self.sample_ptr[0]) != 0 or int(self.sample_ptr[-1]) != n:
            raise SchemaError(f"SpanTable.sample_ptr must run from 0 to the span count {n}")
        if bool((torch.diff(self.sample_ptr) < 0).any()):
            raise SchemaError("SpanTable.sample_ptr must be non-decreasing")

    # construction ---------------------------------------------------------------
    @classmethod
    def from_lists(cls, per_sample: Sequence[Sequence[Span]]) -> "SpanTable":
        rows = [sorted(spans, key=lambda s: (s.start, s.end)) for spans in per_sample]
        flat = [s for spans in rows for s in spans]
        ptr = [0]
        for spans in rows:
            ptr.append(ptr[-1] + len(spans))
        return cls(
            [s.start for s in flat],
            [s.end for s in flat],
            ptr,
            [int(s.modality) for s in flat],
            [s.media_index for s in flat],
        )

    # views ----------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return self.sample_ptr.numel() - 1

    @property
    def num_spans(self) -> int:
        return self.starts.numel()

    @property
    def device(self) -> torch.device:
        return self.starts.device

    def lengths(self) -> torch.Tensor:
        return self.ends - self.starts

    def span_sample(self) -> torch.Tensor:
        """int64[num_spans]: the sample each span belongs to."""
        counts = torch.diff(self.sample_ptr).long()
        return torch.repeat_interleave(torch.arange(self.num_samples, device=self.device), counts, output_size=self.num_spans)

    def spans_of(self, sample: int) -> list[Span]:
        lo, hi = int(self.sample_ptr[sample]), int(self.sample_ptr[sample + 1])
        s, e = self.starts[lo:hi].tolist(), self.ends[lo:hi].tolist()
        m, k = self.modality[lo:hi].tolist(), self.media_index[lo:hi].tolist()
        return [Span(*row) for row in zip(s, e, m, k)]

    def to_lists(self) -> list[list[Span]]:
        return [self.spans_of(b) for b in range(self.num_samples)]

    def token_positions(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every covered token, in span order: (sample int64, position int64, span id int64).

        Vectorized: one ``repeat_interleave`` over span lengths, no Python loop.
        """
        lengths = self.lengths().long()
        total = int(lengths.sum()) if lengths.device.type == "cpu" else None  # no host sync on the GPU
        span_id = torch.repeat_interleave(torch.arange(self.num_spans, device=self.device), lengths, output_size=total)
        first = torch.cumsum(lengths, 0) - lengths
        position = torch.arange(span_id.numel(), device=self.device) - first[span_id] + self.starts.long()[span_id]
        return self.span_sample()[span_id], position, span_id

    def token_counts(self) -> torch.Tensor:
        """int64[num_samples]: covered tokens per sample."""
        per_span = self.lengths().long()
        out = torch.zeros(self.num_samples, dtype=torch.int64, device=self.device)
        return out.index_add_(0, self.span_sample(), per_span)

    def select(self, indices: Sequence[int]) -> "SpanTable":
        return SpanTable.from_lists([self.spans_of(int(i)) for i in indices])

    def to(self, device) -> "SpanTable":
        """The same spans on ``device`` (already validated: no re-check, no host sync)."""
        moved = object.__new__(SpanTable)
        for name in self.__slots__:
            setattr(moved, name, getattr(self, name).to(device))
        return moved

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Flat dict for safetensors; ``from_tensors`` reads it back."""
        return {
            f"{prefix}.starts": self.starts.contiguous().cpu(),
            f"{prefix}.ends": self.ends.contiguous().cpu(),
            f"{prefix}.sample_ptr": self.sample_ptr.contiguous().cpu(),
            f"{prefix}.modality": self.modality.contiguous().cpu(),
            f"{prefix}.media_index": self.media_index.contiguous().cpu(),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "SpanTable":
        try:
            return cls(
                tensors[f"{prefix}.starts"], tensors[f"{prefix}.ends"], tensors[f"{prefix}.sample_ptr"],
                tensors[f"{prefix}.modality"], tensors[f"{prefix}.media_index"],
            )
        except KeyError as e:
            raise SchemaError(f"saved batch lacks the tensor {e.args[0]!r} of field {prefix!r}") from None

    def equal(self, other: "SpanTable") -> bool:
        return all(torch.equal(getattr(self, k).cpu(), getattr(other, k).cpu()) for k in self.__slots__)

    def __eq__(self, other) -> bool:
        return isinstance(other, SpanTable) and self.equal(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"SpanTable(samples={self.num_samples}, spans={self.num_spans})"
