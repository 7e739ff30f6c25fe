"""``RLBatch`` ↔ ``PackedBatch``: ``pack`` and ``unpack``, bitwise.

``pack(batch)`` → ``PackedBatch``: the batch's tokens, M-RoPE positions, ``cu_seqlens`` and
spans in one packed sequence, optionally with every sample padded to a multiple of
``align`` tokens (pad tokens never scored, ``valid`` False, positions continuing) and split
into several packs of at most ``max_tokens_per_pack`` tokens (a sample is never split).
``unpack`` gives back the batch (or per-token values) bitwise. (Padded ``[B, L, *]``
tensors are packed by ``padded.pack_padded``.)

Every public function checks its arguments before any work and reads what it needs from
the device in one host sync. Values are copied as they are: NaN and inf pass through.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from ..schema import RLBatch, SpanTable
from ..schema.batch import PackedRows
from ..schema.checks import device_arg, int_arg, pad_token_arg
from .padded import INT32_LIMIT, cu_seqlens_of, data_arg, fill_arg

Tensor = torch.Tensor

__all__ = ["PackedBatch", "pack", "unpack"]

_PACK_CALLS = itertools.count()  # numbers each pack() call: unpack refuses to mix two calls' packs


@dataclass(frozen=True, eq=False)
class PackedBatch(PackedRows):
    """The samples of one pack in one packed sequence ("slots" in order), ready for varlen attention.

    Positions are positions in the pack. Slot ``i`` holds sample ``sample_index[i]`` of the batch
    given to ``pack``: its ``seq_lengths[i]`` tokens at ``cu_seqlens[i]:cu_seqlens[i] + seq_lengths[i]``,
    then alignment padding up to ``cu_seqlens[i + 1]`` (pad id, positions continuing, ``valid``
    False, in no span, so never scored; causal attention keeps it from touching the real tokens).

    Attributes
    ----------
    input_ids : Tensor
        int64 ``[T']``.
    position_ids : Tensor
        int64 ``[3, T']`` (M-RoPE t, h, w).
    cu_seqlens : Tensor
        int32 ``[n + 1]``: slot boundaries, padding included.
    seq_lengths : Tensor
        int64 ``[n]``: real tokens of each slot.
    sample_index : Tensor
        int64 ``[n]``: the sample of the batch given to ``pack`` in each slot.
    valid : Tensor
        bool ``[T']``: False at alignment padding.
    source_rows : Tensor
        int64 ``[T']``: the token of the batch given to ``pack``; -1 at padding.
    modality_spans, loss_spans : SpanTable
        CSR by slot, positions in the pack (media indices are ``batch``'s).
    batch : RLBatch
        This pack's samples in slot order (media, pixels, rewards, groups, ...).
    source_tokens, source_samples : int
        Tokens and samples of the batch given to ``pack``.
    align, pad_token_id : int
        ``pack``'s arguments.
    source_id : int
        The ``pack`` call that made this pack (the same for all its packs).
    """

    input_ids: Tensor  # int64 [T']
    position_ids: Tensor  # int64 [3, T'] (M-RoPE t, h, w)
    cu_seqlens: Tensor  # int32 [n+1]: slot boundaries, padding included
    seq_lengths: Tensor  # int64 [n]: real tokens of each slot
    sample_index: Tensor  # int64 [n]: the sample of the batch given to pack() in each slot
    valid: Tensor  # bool [T']: False at alignment padding
    source_rows: Tensor  # int64 [T']: the token of the batch given to pack(); -1 at padding
    modality_spans: SpanTable  # CSR by slot, positions in the pack; media_index → ``batch``'s media
    loss_spans: SpanTable  # CSR by slot, positions in the pack
    batch: RLBatch  # this pack's samples in slot order (media, pixels, rewards, groups, ...)
    source_tokens: int  # tokens of the batch given to pack()
    align: int
    pad_token_id: int
    source_samples: int  # samples of the batch given to pack()
    source_id: int  # the pack() call that made this pack (the same for all its packs)

    @property
    def offsets(self) -> Tensor:
        """int32 [n]: the first position of each slot (its sample's stable offset)."""
        return self.cu_seqlens[:-1]

    @property
    def max_seqlen(self) -> int:
        """The longest slot, padding included (flash-attn varlen's ``max_seqlen``)."""
        return int(torch.diff(self.cu_seqlens).max()) if self.num_samples else 0

    def loss_token_index(self) -> tuple[Tensor, Tensor]:
        """The scored rows and their targets, in loss-span order.

        Returns
        -------
        tuple of Tensor
            ``(rows, targets)`` int64 ``[n]``: the target at pack position ``p`` is scored from hidden row
            ``p - 1`` of the packed ``[T', H]`` hidden states.
        """
        _, position, _ = self.loss_spans.token_positions()
        return position - 1, self.input_ids[position]

    def _real_rows(self) -> Tensor:
        """int64 ``[T]``: the pack row of each real token, in slot order (no host sync)."""
        dev, n = self.seq_lengths.device, self.batch.num_tokens
        slot = torch.repeat_interleave(torch.arange(self.num_samples, device=dev), self.seq_lengths, output_size=n)
        first = torch.cumsum(self.seq_lengths, 0) - self.seq_lengths
        return self.cu_seqlens.long()[slot] + torch.arange(n, device=dev) - first[slot]

    def pack_tokens(self, values: Tensor, fill: Union[int, float] = 0) -> Tensor:
        """Per-token values of the batch given to ``pack``, laid out as the pack. No host sync.

        Parameters
        ----------
        values : Tensor
            ``[T, *]``, one row per token of that batch.
        fill : int or float
            A value of ``values``' dtype, at padding.

        Returns
        -------
        Tensor
            ``[T', *]``.

        Raises
        ------
        ValueError, TypeError
            For values of another length, or a ``fill`` that is not a value of the dtype.
        """
        values = data_arg("values", values, 1, "[T, *]")
        if values.shape[0] != self.source_tokens:
            raise ValueError(f"values must be [T, *] with T = {self.source_tokens} (tokens of the batch given to pack); "
                             f"got {tuple(values.shape)}")
        out = values.new_full((self.num_tokens,) + tuple(values.shape[1:]), fill_arg(fill, values.dtype))
        rows = self._real_rows().to(values.device)
        return out.index_copy_(0, rows, values.index_select(0, self.source_rows.to(values.device)[rows]))

    def to(self, device) -> "PackedBatch":
        """A copy with every tensor on ``device``.

        Parameters
        ----------
        device : torch.device or str
            Where to.

        Returns
        -------
        PackedBatch
        """
        device = device_arg(device)
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), (Tensor, SpanTable, RLBatch))
        }
        return dataclasses.replace(self, **moved)


def pack(
    batch: RLBatch, *, align: int = 1, max_tokens_per_pack: Optional[int] = None, pad_token_id: int = 0
) -> Union[PackedBatch, list[PackedBatch]]:
    """Pack ``batch`` into packed sequences for varlen attention.

    Parameters
    ----------
    batch : RLBatch
        The samples.
    align : int
        Each sample is padded to a multiple of this many tokens (e.g. 8 or 64) with ``pad_token_id``.
    max_tokens_per_pack : int, optional
        Samples are taken in order and a new pack starts when the next (aligned) sample would not
        fit; each pack's batch is ``batch.select`` of its samples. Samples are never split.
    pad_token_id : int
        The token id of the alignment padding (never scored); never one of the batch's media
        placeholders (``image_token_id``, ``video_token_id``), which the model would count as
        media tokens.

    Returns
    -------
    PackedBatch or list of PackedBatch
        One pack, or with ``max_tokens_per_pack`` a list of them.

    Raises
    ------
    ValueError, TypeError
        For bad arguments, or a sample longer than ``max_tokens_per_pack`` (named). One host sync
        (the samples' lengths).
    """
    if not isinstance(batch, RLBatch):
        raise TypeError(f"pack takes an RLBatch; got {type(batch).__name__} (padded tensors: use pack_padded)")
    align = int_arg("align", align, min=1, max=INT32_LIMIT - 1)
    pad_token_id = pad_token_arg("pad_token_id", pad_token_id, batch)
    if max_tokens_per_pack is not None:
        max_tokens_per_pack = int_arg("max_tokens_per_pack", max_tokens_per_pack, min=1)
    lengths = batch.seq_lengths().tolist()  # the one host sync
    slots = [-(-n // align) * align for n in lengths]
    call = next(_PACK_CALLS)
    if max_tokens_per_pack is None:
        return _pack_samples(batch, batch, 0, sum(slots), align, pad_token_id, call)
    return [
        _pack_samples(batch.select(idx), batch, idx[0], sum(slots[i] for i in idx), align, pad_token_id, call)
        for idx in _next_fit(lengths, slots, max_tokens_per_pack, align)  # runs of consecutive samples
    ]


def _next_fit(lengths: list[int], slots: list[int], limit: int, align: int) -> list[list[int]]:
    """Samples in order into packs (runs of consecutive samples) of at most ``limit`` tokens
    (``lengths``, ``slots`` once aligned)."""
    packs, current, used = [], [], 0
    for b, (n, slot) in enumerate(zip(lengths, slots)):
        if slot > limit:
            raise ValueError(
                f"sample {b} has {n} tokens" + (f" ({slot} aligned to {align})" if slot != n else "")
                + f", more than max_tokens_per_pack={limit}; a sample is never split across packs: "
                f"raise max_tokens_per_pack or shorten or drop sample {b}"
            )
        if used + slot > limit:
            packs.append(current)
            current, used = [], 0
        current.append(b)
        used += slot
    return packs + [current] if current else packs


def _pack_samples(sub: RLBatch, source: RLBatch, first: int, total: int, align: int, pad: int, call: int) -> PackedBatch:
    """Pack all of ``sub`` (the samples of ``source`` from ``first`` on, ``total`` tokens once
    aligned); vectorized on its device, no host sync."""
    dev, n = sub.device, sub.num_samples
    if total >= INT32_LIMIT:
        raise ValueError(f"the pack holds {total} tokens, more than int32 cu_seqlens count: set max_tokens_per_pack or lower align")
    lengths = sub.seq_lengths()
    slots_t = (lengths + align - 1) // align * align
    cu = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(slots_t, 0)
    slot = torch.repeat_interleave(torch.arange(n, device=dev), slots_t, output_size=total)
    k = torch.arange(total, device=dev) - cu.long()[slot]
    valid = k < lengths[slot]
    src = torch.where(valid, sub.cu_seqlens.long()[slot] + k, 0)
    # pad positions continue (t = h = w) from one past the sample's largest position
    token_slot = torch.repeat_interleave(torch.arange(n, device=dev), lengths, output_size=sub.num_tokens)
    top = torch.full((n,), -1, dtype=torch.int64, device=dev)
    top.scatter_reduce_(0, token_slot, sub.position_ids.amax(0), "amax")
    pad_position = top[slot] + 1 + k - lengths[slot]
    index = torch.arange(first, first + n, device=dev)
    return PackedBatch(
        input_ids=torch.where(valid, sub.input_ids[src], pad),
        position_ids=torch.where(valid, sub.position_ids[:, src], pad_position),
        cu_seqlens=cu,
        seq_lengths=lengths,
        sample_index=index,
        valid=valid,
        source_rows=torch.where(valid, source.cu_seqlens.long()[index][slot] + k, -1),
        modality_spans=_shift(sub.modality_spans, cu, +1),
        loss_spans=_shift(sub.loss_spans, cu, +1),
        batch=sub,
        source_tokens=source.num_tokens,
        align=align,
        pad_token_id=pad,
        source_samples=source.num_samples,
        source_id=call,
    )


def _shift(table: SpanTable, cu: Tensor, sign: int) -> SpanTable:
    """``table`` with each span moved by ``sign`` × its slot's offset ``cu[slot]``."""
    offset = (sign * cu[:-1].to(table.device)[table.span_sample()]).to(torch.int32)
    return SpanTable(table.starts + offset, table.ends + offset, table.sample_ptr, table.modality, table.media_index)


def unpack(packed: Union[PackedBatch, Sequence[PackedBatch]], values=None):
    """Undo ``pack``, bitwise.

    Parameters
    ----------
    packed : PackedBatch or sequence of PackedBatch
        One pack, or every pack of one ``pack`` call (any order), each once.
    values : Tensor or sequence of Tensor, optional
        Per-token values ``[T', *]`` of the pack, or one tensor per pack (one dtype and per-token
        shape). Values pass through as they are.

    Returns
    -------
    RLBatch or Tensor
        Without ``values``: the ``RLBatch`` of the pack's samples (``p.batch``), rebuilt from the
        packed tokens, positions and spans; for every pack, the whole batch given to ``pack``. With
        ``values``: ``[T, *]`` rows of that batch, padding dropped.

    Raises
    ------
    ValueError, TypeError
        For a missing pack, a repeated one or one of another call (naming the sample), or values of
        another shape. Host syncs: none for one pack's values; one for a list of packs.
    """
    if isinstance(packed, PackedBatch):
        if values is None:
            return _unpack_batch(packed)
        values = _values_of(packed, values, "values")
        return values.index_select(0, packed._real_rows().to(values.device))
    packs, order = _all_packs(packed)
    if values is None:
        merged = RLBatch.concat([_unpack_batch(p) for p in packs])
        if order != list(range(len(order))):
            merged = merged.select(sorted(range(len(order)), key=order.__getitem__))
        return merged
    if isinstance(values, Tensor) or not isinstance(values, (list, tuple)):
        raise TypeError(f"values must be a list of tensors, one per pack (each [T', *]), got {type(values).__name__}")
    if len(values) != len(packs):
        raise ValueError(f"unpack got {len(values)} value tensors for {len(packs)} packs")
    values = [_values_of(p, v, f"values[{i}]") for i, (p, v) in enumerate(zip(packs, values))]
    first = values[0]
    for i, v in enumerate(values[1:], start=1):
        if v.dtype != first.dtype:
            raise TypeError(f"values[{i}] is {v.dtype} but values[0] is {first.dtype}: give every pack's values one dtype")
        if v.shape[1:] != first.shape[1:] or v.device != first.device:
            raise ValueError(f"values[{i}] has shape {tuple(v.shape)} on {v.device} but values[0] has {tuple(first.shape)} on "
                             f"{first.device}: every pack's values need one per-token shape and device")
    out = first.new_empty((packs[0].source_tokens,) + tuple(first.shape[1:]))
    for p, v in zip(packs, values):
        rows = p._real_rows().to(v.device)
        out.index_copy_(0, p.source_rows.to(v.device)[rows], v.index_select(0, rows))
    return out


def _all_packs(packed) -> tuple[list[PackedBatch], list[int]]:
    """The packs, checked to be every pack of one ``pack`` call, and their samples' order."""
    if isinstance(packed, (str, bytes, dict)) or not hasattr(packed, "__iter__"):
        raise TypeError(f"unpack takes a PackedBatch or a non-empty list of them (what pack returned), got {type(packed).__name__}")
    packs = list(packed)
    if not packs or not all(isinstance(p, PackedBatch) for p in packs):
        raise TypeError("unpack takes a PackedBatch or a non-empty list of them (what pack returned)")
    if len({p.source_id for p in packs}) > 1:
        raise ValueError("these are packs of different pack() calls; unpack needs every pack of one pack() call")
    device = packs[0].sample_index.device
    order = torch.cat([p.sample_index.to(device) for p in packs]).tolist()  # the one host sync
    seen = [0] * packs[0].source_samples
    for b in order:
        seen[b] += 1
    missing = next((b for b, k in enumerate(seen) if k != 1), None)
    if missing is not None:
        raise ValueError(f"the packs hold sample {missing} {seen[missing]} times; unpack needs every sample of one packed "
                         "batch exactly once (all the packs pack returned)")
    return packs, order


def _values_of(p: PackedBatch, values, name: str) -> Tensor:
    values = data_arg(name, values, 1, "[T', *]")
    if values.shape[0] != p.num_tokens:
        raise ValueError(f"{name} must be [T', *] with T' = {p.num_tokens} (tokens of the pack); got {tuple(values.shape)}")
    return values


def _unpack_batch(p: PackedBatch) -> RLBatch:
    rows = p._real_rows()
    fields = {name: getattr(p.batch, name) for name in RLBatch.model_fields}
    fields.update(
        input_ids=p.input_ids[rows],
        position_ids=p.position_ids[:, rows],
        cu_seqlens=cu_seqlens_of(p.seq_lengths),
        modality_spans=_shift(p.modality_spans, p.cu_seqlens, -1),
        loss_spans=_shift(p.loss_spans, p.cu_seqlens, -1),
    )
    return RLBatch(**fields)
