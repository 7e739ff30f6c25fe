"""Spans: half-open ``[start, end)`` token ranges within one sequence, and their tensors.

``Span`` is the view for people and error messages; ``SpanTable`` stores the spans of a
whole batch as int32 tensors in CSR form by sample (``sample_ptr[b]:sample_ptr[b+1]``
are sample ``b``'s spans), so ops consume them on the device with no Python loop.
Positions are 0-based token indices within one sequence, before padding.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Iterable, NoReturn, Sequence

import numpy as np
import torch

from .checks import INTEGER_DTYPES, DeviceChecks, device_arg, first_true, int_arg, readable, sample_index, sample_indices, sequence_arg

__all__ = [
    "complement", "intersect", "mask_from_spans", "Modality", "normalize", "SchemaError", "Span", "spans_from_mask",
    "SpanTable", "subtract", "union"
]


class SchemaError(ValueError):
    """A batch violates the batch contract. The message names field, sample, span and positions."""


def refuse(message: str) -> NoReturn:
    """Raises ``SchemaError(message)``: the failure callback of a ``DeviceChecks`` check."""
    raise SchemaError(message)


class Modality(IntEnum):
    TEXT = 0
    IMAGE = 1
    VIDEO = 2
    AUDIO = 3

    @property
    def label(self) -> str:
        return self.name.lower()


_MODALITY_CHOICES = "text (0), image (1), video (2), audio (3)"
_INT32 = (-(2**31), 2**31 - 1)  # span positions are int32 in a SpanTable


@dataclass(frozen=True, order=True)
class Span:
    """Tokens ``[start, end)`` of one sample; media spans carry the batch-wide media index
    (a text span carries -1)."""

    start: int
    end: int
    modality: Modality = Modality.TEXT
    media_index: int = -1

    def __post_init__(self):
        start, end, media_index = self.start, self.end, self.media_index
        if type(start) is not int or type(end) is not int or type(media_index) is not int:  # plain ints: the fast path
            start, end, media_index = (int_arg(f"Span.{name}", getattr(self, name)) for name in ("start", "end", "media_index"))
        if start < 0 or end < start:
            raise SchemaError(f"span [{start}, {end}) is not a valid half-open range: it needs 0 <= start <= end")
        if end > _INT32[1]:
            raise SchemaError(f"span [{start}, {end}) ends beyond {_INT32[1]}: positions are int32 in a SpanTable (and a "
                              "batch); split the sequence")
        m = self.modality
        if type(m) is not Modality:
            if isinstance(m, bool) or not isinstance(m, numbers.Integral) or int(m) not in Modality._value2member_map_:
                raise ValueError(f"Span.modality={m!r}: expected one of {_MODALITY_CHOICES}")
            m = Modality(int(m))
        if media_index < -1:
            raise ValueError(f"Span.media_index={media_index} is out of range: it must be >= -1 (-1: no media item)")
        if m is Modality.TEXT and media_index != -1:
            raise ValueError(f"a text span has media_index -1, got {media_index}: only media spans carry an item index")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)
        object.__setattr__(self, "modality", m)
        object.__setattr__(self, "media_index", media_index)

    def __len__(self) -> int:
        return self.end - self.start

    def __contains__(self, position: int) -> bool:
        return self.start <= position < self.end

    def __str__(self) -> str:
        media = f" #{self.media_index}" if self.media_index >= 0 else ""
        return f"{self.modality.label}{media}[{self.start}, {self.end})"


# ----------------------------------------------------------------------------- algebra
def _spans(name: str, spans) -> list[Span]:
    """The argument ``name`` as a list of ``Span`` (any iterable of them, never a str or one Span)."""
    items = sequence_arg(name, spans, "Span")
    for i, s in enumerate(items):
        if not isinstance(s, Span):
            raise TypeError(f"{name}[{i}] is {type(s).__name__}; expected a Span")
    return items


def _within(spans: list[Span], length: int) -> None:
    for s in spans:
        if s.end > length:
            raise SchemaError(f"span {s} ends past the sequence length {length}")


def _merged(spans: list[Span]) -> list[Span]:
    merged: list[list[int]] = []
    for s in sorted(spans, key=lambda s: (s.start, s.end)):
        if len(s) == 0:
            continue
        if merged and s.start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], s.end)
        else:
            merged.append([s.start, s.end])
    return [Span(a, b) for a, b in merged]


def _subtracted(a: list[Span], b: list[Span]) -> list[Span]:
    out = []
    b = _merged(b)
    for s in _merged(a):
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


def normalize(spans: Iterable[Span]) -> list[Span]:
    """Sorted union of the spans' positions as text spans: overlapping/touching ones merge, empty ones drop."""
    return _merged(_spans("spans", spans))


def union(a: Iterable[Span], b: Iterable[Span]) -> list[Span]:
    return _merged([*_spans("a", a), *_spans("b", b)])


def intersect(a: Iterable[Span], b: Iterable[Span]) -> list[Span]:
    """Positions in both ``a`` and ``b``, normalized."""
    a, b = _merged(_spans("a", a)), _merged(_spans("b", b))
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
    return _subtracted(_spans("a", a), _spans("b", b))


def complement(spans: Iterable[Span], length: int) -> list[Span]:
    """Positions of ``[0, length)`` not covered by ``spans`` (which must lie inside it)."""
    spans, length = _spans("spans", spans), int_arg("length", length, min=0, max=_INT32[1])
    _within(spans, length)
    return _subtracted([Span(0, length)], spans)


def spans_from_mask(mask: Sequence[bool] | torch.Tensor) -> list[Span]:
    """Maximal runs of True in a 1-D mask (bools, or integers 0/1: a tensor, a numpy array or a
    list), as text spans."""
    if isinstance(mask, np.ndarray):
        if mask.dtype != np.bool_ and not np.issubdtype(mask.dtype, np.integer):
            raise TypeError(f"mask must be bool or integer (0/1), got numpy {mask.dtype}")
        mask = torch.from_numpy(np.ascontiguousarray(mask))
    if not isinstance(mask, torch.Tensor):
        if isinstance(mask, (str, bytes)) or not isinstance(mask, Sequence):
            raise TypeError(f"mask must be a 1-D bool tensor or a list of bools, got {type(mask).__name__}")
        try:
            mask = torch.as_tensor(mask) if len(mask) else torch.zeros(0, dtype=torch.bool)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError("mask must be a 1-D bool tensor or a list of bools (0/1), got a list of other values") from None
    if mask.dtype != torch.bool and mask.dtype not in INTEGER_DTYPES:
        raise TypeError(f"mask must be bool or integer (0/1), got {mask.dtype}")
    if mask.ndim != 1:
        raise ValueError(f"mask must be 1-D, got shape {tuple(mask.shape)}")
    readable("mask", mask)
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            (p,) = first_true(bad)
            raise ValueError(f"mask[{p}] is {int(mask[p])}; expected 0 or 1 (or bools)")
    m = mask.bool().cpu()
    if m.numel() == 0:
        return []
    padded = torch.cat([torch.zeros(1, dtype=torch.int8), m.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    edges = torch.diff(padded)
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return [Span(s, e) for s, e in zip(starts, ends)]


def mask_from_spans(spans: Iterable[Span], length: int) -> torch.Tensor:
    """bool [length]: True inside ``spans`` (which must lie inside ``[0, length)``)."""
    spans, length = _spans("spans", spans), int_arg("length", length, min=0, max=_INT32[1])
    _within(spans, length)
    mask = torch.zeros(length, dtype=torch.bool)
    for s in spans:
        mask[s.start : s.end] = True
    return mask


# ----------------------------------------------------------------------------- tensors


def _column(name: str, value, device=None) -> torch.Tensor:
    """One SpanTable column as a 1-D integer tensor (its own integer dtype, on ``device``)."""
    if not isinstance(value, torch.Tensor):
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise TypeError(f"SpanTable.{name} must be a 1-D integer tensor or a list of ints, got {type(value).__name__}")
        try:
            value = torch.as_tensor(value, device=device) if len(value) else torch.zeros(0, dtype=torch.int64, device=device)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"SpanTable.{name} must be a 1-D integer tensor or a list of ints") from None
    if value.dtype not in INTEGER_DTYPES:
        raise TypeError(f"SpanTable.{name} must be int (int32/int64/...), got {value.dtype}")
    if value.ndim != 1:
        raise SchemaError(f"SpanTable.{name} must be 1-D, got shape {tuple(value.shape)}")
    return value if device is None else value.to(device)


def _check_table(starts, ends, ptr, modality, media_index) -> None:
    """The CSR invariants of a SpanTable's columns, with one host sync (``DeviceChecks``)."""
    n, B = starts.numel(), ptr.numel() - 1
    checks = DeviceChecks()
    checks.add((ptr[0] != 0) | (ptr[-1] != n), lambda: refuse(
        f"SpanTable.sample_ptr must run from 0 to the span count {n}, got {int(ptr[0])}..{int(ptr[-1])}"))
    falls = ptr[1:] < ptr[:-1]
    checks.add(falls.any(), lambda: refuse(
        f"SpanTable.sample_ptr must be non-decreasing: sample {first_true(falls)[0]} ends before it starts"))
    for name, column, (low, high), expected in (
        ("starts", starts, _INT32, "int32"), ("ends", ends, _INT32, "int32"), ("sample_ptr", ptr, _INT32, "int32"),
        ("modality", modality, (0, 3), _MODALITY_CHOICES), ("media_index", media_index, (-1, _INT32[1]), "-1 (no media item) or an item index"),
    ):
        out = (column < low) | (column > high)
        checks.add(out.any(), lambda name=name, column=column, out=out, expected=expected: refuse(
            f"SpanTable.{name}[{first_true(out)[0]}] is {int(column[first_true(out)[0]])}; expected {expected}"))
    if n:
        sample = torch.searchsorted(ptr[1:].contiguous(), torch.arange(n, device=starts.device), right=True).clamp(max=max(B - 1, 0))

        def where(i: int) -> tuple[int, int, str]:
            """(sample, span index within it, the span as text) of span row ``i``."""
            b = int(sample[i])
            return b, i - int(ptr[b]), f"[{int(starts[i])}, {int(ends[i])})"

        def invalid_span():
            b, k, text = where(first_true(invalid)[0])
            raise SchemaError(f"SpanTable: sample {b}, span {k} is {text}; spans are half-open ranges with 0 <= start <= end")

        def unsorted_span():
            i = first_true(unsorted)[0] + 1
            (b, k, text), (_, _, before) = where(i), where(i - 1)
            raise SchemaError(f"SpanTable: sample {b}, span {k} {text} starts before span {k - 1} {before}; each sample's spans are sorted by start")

        invalid = (starts < 0) | (ends < starts)
        checks.add(invalid.any(), invalid_span)
        unsorted = (sample[1:] == sample[:-1]) & (starts[1:] < starts[:-1])
        checks.add(unsorted.any(), unsorted_span)
    checks.run()


class SpanTable:
    """The spans of a batch, CSR by sample, as int32 tensors (int8 modality).

    ``starts``/``ends``/``modality``/``media_index`` have one entry per span; spans of
    sample ``b`` are rows ``sample_ptr[b]:sample_ptr[b + 1]``, sorted by start, each with
    ``0 <= start <= end``. The constructor checks this with one host sync.
    """

    __slots__ = ("starts", "ends", "modality", "media_index", "sample_ptr")

    def __init__(self, starts, ends, sample_ptr, modality=None, media_index=None):
        starts = _column("starts", starts)
        device, n = starts.device, starts.numel()
        ends, ptr = _column("ends", ends, device), _column("sample_ptr", sample_ptr, device)
        modality = torch.zeros(n, dtype=torch.int8, device=device) if modality is None else _column("modality", modality, device)
        media_index = torch.full((n,), -1, dtype=torch.int32, device=device) if media_index is None else _column("media_index", media_index, device)
        for name, column in (("ends", ends), ("modality", modality), ("media_index", media_index)):
            if column.shape != (n,):
                raise SchemaError(f"SpanTable.{name} has shape {tuple(column.shape)}, expected ({n},) like starts")
        if ptr.numel() < 1:
            raise SchemaError("SpanTable.sample_ptr must be a 1-D tensor of length num_samples + 1")
        _check_table(starts, ends, ptr, modality, media_index)
        self.starts, self.ends, self.sample_ptr = starts.to(torch.int32), ends.to(torch.int32), ptr.to(torch.int32)
        self.modality, self.media_index = modality.to(torch.int8), media_index.to(torch.int32)

    # construction ---------------------------------------------------------------
    @classmethod
    def from_lists(cls, per_sample: Sequence[Sequence[Span]]) -> "SpanTable":
        """A table of the spans of each sample (each list sorted by start here)."""
        per_sample = sequence_arg("per_sample", per_sample, "lists of Span", ordered=True)
        rows = [sorted(_spans(f"per_sample[{b}]", spans), key=lambda s: (s.start, s.end)) for b, spans in enumerate(per_sample)]
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
        sample = sample_index(sample, self.num_samples, "table")
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
        """A table of the given samples' spans, in the given order."""
        return SpanTable.from_lists([self.spans_of(i) for i in sample_indices(indices, self.num_samples, "table")])

    def to(self, device) -> "SpanTable":
        """The same spans on ``device`` (already validated: no re-check, no host sync)."""
        device = device_arg(device)
        moved = object.__new__(SpanTable)
        for name in self.__slots__:
            setattr(moved, name, getattr(self, name).to(device))
        return moved

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Flat dict for safetensors; ``from_tensors`` reads it back."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str (the field name), got {type(prefix).__name__}")
        return {
            f"{prefix}.starts": self.starts.contiguous().cpu(),
            f"{prefix}.ends": self.ends.contiguous().cpu(),
            f"{prefix}.sample_ptr": self.sample_ptr.contiguous().cpu(),
            f"{prefix}.modality": self.modality.contiguous().cpu(),
            f"{prefix}.media_index": self.media_index.contiguous().cpu(),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "SpanTable":
        if not isinstance(tensors, Mapping):
            raise TypeError(f"tensors must be a dict of tensors (what SpanTable.tensors returned), got {type(tensors).__name__}")
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
