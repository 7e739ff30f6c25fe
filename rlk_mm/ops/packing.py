"""Pack / unpad: an ``RLBatch`` or padded ``[B, L, *]`` tensors to a packed layout and back, bitwise.

Two layers:

- ``pack(batch)`` → ``PackedBatch``: the batch's tokens, M-RoPE positions, ``cu_seqlens``
  and spans in one packed sequence, optionally with every sample padded to a multiple of
  ``align`` tokens (pad tokens never scored, ``valid`` False, positions continuing) and
  split into several packs of at most ``max_tokens_per_pack`` tokens (a sample is never
  split). ``unpack`` gives back the batch (or per-token values) bitwise.
- ``pack_padded(x, mask)`` / ``unpack_to_padded(packed, cu_seqlens, length, side)``:
  ``[B, L, *]`` with one run of real rows per sample (left, right or middle padding, as
  verl's prompt + response) ↔ ``[T, *]``. Custom ops ``rlk_mm::pack_padded`` and
  ``rlk_mm::unpack_to_padded`` (Triton on CUDA, ``index_select``/``index_copy_``
  elsewhere), each the other's backward. Each output element is written once: bitwise
  copies, deterministic, no atomics.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from ..schema import Choice, RLBatch, SpanTable
from ._backend import use_triton

Tensor = torch.Tensor

_DTYPES = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)


class PaddingSide(Choice):
    """Where a padded row's real entries sit."""

    LEFT = "left"  # at the end of the row
    RIGHT = "right"  # at the start of the row


# ====================================================================== padded ↔ packed tensors
def pack_padded(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(``packed [T, *]``, int32 ``cu_seqlens [B+1]``): the rows of ``x [B, L, *]`` where ``mask [B, L]`` is set.

    Each mask row must be one contiguous run (left, right or middle padding); a hole is an
    error naming the sample and position. Differentiable: the gradient of ``x`` is the
    packed gradient scattered back, zero at padding.
    """
    starts, lengths, bad = _mask_runs(x, mask)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    is_bad, total = torch.stack([bad.long(), cu[-1]]).tolist()  # the output size and the mask check: one host sync
    if is_bad:
        _raise_mask_error(mask)
    if total >= 2**31:
        raise ValueError(f"{total} packed rows do not fit int32 cu_seqlens")
    cu = cu.to(torch.int32)
    return torch.ops.rlk_mm.pack_padded(x, starts, cu, total), cu


def unpack_to_padded(
    packed: Tensor, cu_seqlens: Tensor, length: int, side: Union[str, Tensor] = "right", *, fill: Union[int, float] = 0
) -> Tensor:
    """``[B, length, *]`` from ``packed [T, *]``: sample ``b``'s rows ``cu_seqlens[b]:cu_seqlens[b+1]``
    placed by ``side`` (``"right"`` padding: at 0; ``"left"``: ending at ``length``; or the
    ``[B, length]`` mask the rows came from), ``fill`` elsewhere. Differentiable."""
    if not isinstance(packed, Tensor) or packed.dim() < 1:
        raise ValueError(f"packed must be a [T, *] tensor; got {type(packed).__name__} {tuple(getattr(packed, 'shape', ()))}")
    cu = _as_cu_seqlens(cu_seqlens, packed)
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be an int >= 0 (the padded length L); got {length!r}")
    lengths = torch.diff(cu).long()
    if isinstance(side, Tensor):
        if side.shape != (lengths.numel(), length):
            raise ValueError(f"side as a mask must have shape (B, length) = ({lengths.numel()}, {length}); got {tuple(side.shape)}")
        starts, mask_lengths, bad = _mask_runs(None, side)
        differ = mask_lengths != lengths.to(mask_lengths.device)
        is_bad, any_differ = torch.stack([bad, differ.any()]).tolist()
        if is_bad:
            _raise_mask_error(side)
        if any_differ:
            b = int(torch.nonzero(differ).flatten()[0])
            raise ValueError(f"mask: sample {b} has {int(mask_lengths[b])} set positions but cu_seqlens gives it {int(lengths[b])} rows")
    else:
        try:
            side = PaddingSide(side)
        except ValueError:
            raise ValueError(f"side must be 'left', 'right' or a [B, length] mask; got {side!r}") from None
        starts = torch.zeros_like(lengths) if side is PaddingSide.RIGHT else length - lengths
    return torch.ops.rlk_mm.unpack_to_padded(packed, starts.to(packed.device), cu.to(packed.device), length, _fill(fill, packed.dtype))


def _mask_runs(x: Optional[Tensor], mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(first set position, count) int64 ``[B]`` of each mask row, and a 0-d bool tensor that
    is True when a row is not one contiguous run of 0/1 values. No host sync: the caller reads
    the flag with whatever else it needs from the device, then ``_raise_mask_error`` names the
    culprit."""
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise ValueError(f"mask must be a [B, L] tensor; got {type(mask).__name__} {tuple(getattr(mask, 'shape', ()))}")
    if x is not None:
        if not isinstance(x, Tensor) or x.dim() < 2:
            raise ValueError(f"x must be a [B, L, *] tensor; got {type(x).__name__} {tuple(getattr(x, 'shape', ()))}")
        if tuple(x.shape[:2]) != tuple(mask.shape):
            raise ValueError(f"mask has shape {tuple(mask.shape)} but x is [B, L, *] = {tuple(x.shape)}")
        if mask.device != x.device:
            raise ValueError(f"mask is on {mask.device} but x is on {x.device}")
    if mask.dtype != torch.bool and (mask.dtype.is_floating_point or mask.is_complex()):
        raise TypeError(f"mask must be bool or integer 0/1; got {mask.dtype}")
    B, L = mask.shape
    on = mask if mask.dtype == torch.bool else mask != 0
    lengths = on.sum(1)
    first = on.to(torch.int8).argmax(1) if L else torch.zeros(B, dtype=torch.int64, device=mask.device)
    bad = (_holes(on, first, lengths).any() if L else torch.zeros((), dtype=torch.bool, device=mask.device))
    if mask.dtype != torch.bool:
        bad = bad | ((mask != 0) & (mask != 1)).any()
    return first.long(), lengths.long(), bad


def _holes(on: Tensor, first: Tensor, lengths: Tensor) -> Tensor:
    """[B, L] bool: where a row differs from one run of ``lengths`` set positions from ``first``."""
    j = torch.arange(on.shape[1], device=on.device)
    return on != ((j >= first[:, None]) & (j < (first + lengths)[:, None]))


def _raise_mask_error(mask: Tensor) -> None:
    """The first value other than 0/1, or else the first hole, of a mask ``_mask_runs`` flagged."""
    if mask.dtype != torch.bool:
        odd = (mask != 0) & (mask != 1)
        if bool(odd.any()):
            b, p = torch.nonzero(odd)[0].tolist()
            raise ValueError(f"mask: sample {b}, position {p} holds {int(mask[b, p])}; a mask holds only 0 and 1")
        mask = mask != 0
    b, p = torch.nonzero(_holes(mask, mask.to(torch.int8).argmax(1), mask.sum(1)))[0].tolist()
    raise ValueError(
        f"mask: sample {b} has a hole at position {p}: its set positions are not one contiguous run "
        "(left, right or middle padding only)"
    )


def _cu_seqlens(lengths: Tensor) -> Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    if lengths.numel() and int(cu[-1]) >= 2**31:
        raise ValueError(f"{int(cu[-1])} packed rows do not fit int32 cu_seqlens")
    return cu.to(torch.int32)


def _as_cu_seqlens(cu: Tensor, packed: Tensor) -> Tensor:
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [B+1]; got {type(cu).__name__} {getattr(cu, 'dtype', '')} {tuple(getattr(cu, 'shape', ()))}")
    return cu.to(torch.int32)


def _fill(fill, dtype: torch.dtype) -> float:
    """``fill`` as the op's float argument, checked exact for integer dtypes."""
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        raise TypeError(f"fill must be an int or float; got {type(fill).__name__}")
    if not dtype.is_floating_point:
        info = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
        if float(fill) != int(fill) or not info[0] <= int(fill) <= info[1] or abs(int(fill)) > 2**53:
            raise ValueError(f"fill {fill!r} is not a value of {dtype}")
    return float(fill)


# ---------------------------------------------------------------------- checks (all backends)
def _check_layout(values: Tensor, starts: Tensor, cu: Tensor, B: int, L: int, T: int, *, data: bool = True) -> None:
    """Shapes, dtypes and devices; with ``data``, that every sample's rows fit ``[0, L)`` and ``cu`` spans ``[0, T]``."""
    if values.dtype not in _DTYPES:
        raise TypeError(f"pack/unpad supports {', '.join(str(d).replace('torch.', '') for d in _DTYPES)}; got {values.dtype}")
    if starts.dtype != torch.int64 or starts.shape != (B,):
        raise ValueError(f"starts must be int64 [B={B}]; got {starts.dtype} {tuple(starts.shape)}")
    if cu.dtype != torch.int32 or cu.shape != (B + 1,):
        raise ValueError(f"cu_seqlens must be int32 [B+1={B + 1}]; got {cu.dtype} {tuple(cu.shape)}")
    for name, t in (("starts", starts), ("cu_seqlens", cu)):
        if t.device != values.device:
            raise ValueError(f"{name} is on {t.device} but the data is on {values.device}")
    if not data:
        return
    lengths = torch.diff(cu).long()
    wrong = torch.stack([cu[0] != 0, cu[-1] != T, (lengths < 0).any(), (lengths > L).any(), ((starts < 0) | (starts + lengths > L)).any()])
    if not bool(wrong.any()):  # one host sync on the good path; the messages below find the culprit
        return
    if int(cu[0]) != 0 or int(cu[-1]) != T:
        raise ValueError(f"cu_seqlens must run from 0 to the packed row count {T}; got {int(cu[0])}..{int(cu[-1])}")
    bad = torch.nonzero(lengths < 0).flatten()
    if bad.numel():
        raise ValueError(f"cu_seqlens decreases at sample {int(bad[0])}; it must be non-decreasing")
    bad = torch.nonzero(lengths > L).flatten()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"cu_seqlens: sample {b} has {int(lengths[b])} rows, more than the padded length {L}")
    b = int(torch.nonzero((starts < 0) | (starts + lengths > L)).flatten()[0])
    raise ValueError(f"sample {b}: rows [{int(starts[b])}, {int(starts[b] + lengths[b])}) do not fit the padded length {L}")


def _packed_source_rows(starts: Tensor, cu: Tensor, L: int, T: int) -> Tensor:
    """int64 ``[T]``: for each packed row, its row in the padded tensor viewed as ``[B*L, F]``."""
    B = starts.numel()
    lengths = torch.diff(cu).long()
    sample = torch.repeat_interleave(torch.arange(B, device=cu.device), lengths, output_size=T)
    k = torch.arange(T, device=cu.device) - cu.long()[sample]
    return sample * L + starts[sample] + k


def _padded_source_rows(starts: Tensor, cu: Tensor, L: int) -> Tensor:
    """int64 ``[B*L]``: for each padded row, its packed row, or -1 at padding."""
    lengths = torch.diff(cu).long()
    k = torch.arange(L, device=cu.device)[None, :] - starts[:, None]
    inside = (k >= 0) & (k < lengths[:, None])
    return torch.where(inside, cu.long()[:-1, None] + k, -1).reshape(-1)


# ---------------------------------------------------------------------- the custom ops
@torch.library.custom_op("rlk_mm::pack_padded", mutates_args=())
def _pack_op(x: Tensor, starts: Tensor, cu_seqlens: Tensor, total: int) -> Tensor:
    """``[total, *]``: the rows ``starts[b]:starts[b] + n_b`` of every ``x[b]``, sample by sample."""
    B, L, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    _check_layout(x, starts, cu_seqlens, B, L, total)
    F = math.prod(rest)
    flat = x.contiguous().reshape(B * L, F)
    rows = _packed_source_rows(starts, cu_seqlens, L, total)
    if use_triton(x):
        from ._triton import pack as _tri

        out = _tri.gather_rows(flat, rows, flat.new_zeros(1))
    else:
        out = flat.index_select(0, rows)
    return out.reshape((total,) + rest)


@_pack_op.register_fake
def _(x, starts, cu_seqlens, total):
    _check_layout(x, starts, cu_seqlens, x.shape[0], x.shape[1], total, data=False)
    return x.new_empty((total,) + tuple(x.shape[2:]))


@torch.library.custom_op("rlk_mm::unpack_to_padded", mutates_args=())
def _unpack_op(packed: Tensor, starts: Tensor, cu_seqlens: Tensor, length: int, fill: float) -> Tensor:
    """``[B, length, *]``: packed rows of sample ``b`` at ``starts[b]:``, ``fill`` elsewhere."""
    B, T, rest = starts.shape[0], packed.shape[0], tuple(packed.shape[1:])
    _check_layout(packed, starts, cu_seqlens, B, length, T)
    F = math.prod(rest)
    flat = packed.contiguous().reshape(T, F)
    if use_triton(packed):
        from ._triton import pack as _tri

        index = _padded_source_rows(starts, cu_seqlens, length)
        out = _tri.gather_rows(flat, index, torch.full((1,), fill, dtype=packed.dtype, device=packed.device))
    else:
        out = flat.new_full((B * length, F), fill)
        out.index_copy_(0, _packed_source_rows(starts, cu_seqlens, length, T), flat)
    return out.reshape((B, length) + rest)


@_unpack_op.register_fake
def _(packed, starts, cu_seqlens, length, fill):
    B = starts.shape[0]
    _check_layout(packed, starts, cu_seqlens, B, length, packed.shape[0], data=False)
    return packed.new_empty((B, length) + tuple(packed.shape[1:]))


def _pack_setup(ctx, inputs, output):
    x, starts, cu, _ = inputs
    ctx.save_for_backward(starts, cu)
    ctx.length = x.shape[1]


def _pack_backward(ctx, grad):
    starts, cu = ctx.saved_tensors
    return torch.ops.rlk_mm.unpack_to_padded(grad, starts, cu, ctx.length, 0.0), None, None, None


def _unpack_setup(ctx, inputs, output):
    packed, starts, cu, _, _ = inputs
    ctx.save_for_backward(starts, cu)
    ctx.total = packed.shape[0]


def _unpack_backward(ctx, grad):
    starts, cu = ctx.saved_tensors
    return torch.ops.rlk_mm.pack_padded(grad, starts, cu, ctx.total), None, None, None, None


_pack_op.register_autograd(_pack_backward, setup_context=_pack_setup)
_unpack_op.register_autograd(_unpack_backward, setup_context=_unpack_setup)


# ====================================================================== RLBatch ↔ PackedBatch
@dataclass(frozen=True, eq=False)
class PackedBatch:
    """The samples of one pack in one packed sequence ("slots" in order), ready for varlen attention.

    Positions below are positions in the pack. Slot ``i`` holds sample ``sample_index[i]``
    of the batch given to ``pack``: its ``seq_lengths[i]`` tokens at
    ``cu_seqlens[i]:cu_seqlens[i] + seq_lengths[i]``, then alignment padding up to
    ``cu_seqlens[i + 1]`` (pad id, positions continuing, ``valid`` False, in no span, so
    never scored; causal attention keeps it from touching the real tokens).
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

    @property
    def num_samples(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def offsets(self) -> Tensor:
        """int32 [n]: the first position of each slot (its sample's stable offset)."""
        return self.cu_seqlens[:-1]

    @property
    def max_seqlen(self) -> int:
        """The longest slot, padding included (flash-attn varlen's ``max_seqlen``)."""
        return int(torch.diff(self.cu_seqlens).max()) if self.num_samples else 0

    def loss_token_index(self) -> tuple[Tensor, Tensor]:
        """(rows, targets) int64 [n] in loss-span order: target at pack position ``p`` is scored
        from hidden row ``p - 1`` of the packed ``[T', H]`` hidden states."""
        _, position, _ = self.loss_spans.token_positions()
        return position - 1, self.input_ids[position]

    def pack_tokens(self, values: Tensor, fill: Union[int, float] = 0) -> Tensor:
        """``[T', *]`` from per-token ``values [T, *]`` of the batch given to ``pack``; ``fill`` at padding."""
        if not isinstance(values, Tensor) or values.dim() < 1 or values.shape[0] != self.source_tokens:
            raise ValueError(
                f"values must be [T, *] with T = {self.source_tokens} (tokens of the batch given to pack); "
                f"got {tuple(getattr(values, 'shape', ()))}"
            )
        out = values.new_full((self.num_tokens,) + tuple(values.shape[1:]), _fill(fill, values.dtype))
        out[self.valid] = values[self.source_rows[self.valid].to(values.device)]
        return out

    def to(self, device) -> "PackedBatch":
        """A copy with every tensor on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), (Tensor, SpanTable, RLBatch))
        }
        return dataclasses.replace(self, **moved)


def pack(
    batch: RLBatch, *, align: int = 1, max_tokens_per_pack: Optional[int] = None, pad_token_id: int = 0
) -> Union[PackedBatch, list[PackedBatch]]:
    """Pack ``batch``: one ``PackedBatch``, or with ``max_tokens_per_pack`` a list of them.

    ``align``: each sample is padded to a multiple of this many tokens (e.g. 8 or 64) with
    ``pad_token_id``. ``max_tokens_per_pack``: samples are taken in order and a new pack
    starts when the next (aligned) sample would not fit; a sample longer than the limit is
    an error naming it (samples are never split).
    """
    if not isinstance(batch, RLBatch):
        raise TypeError(f"pack takes an RLBatch; got {type(batch).__name__} (padded tensors: use pack_padded)")
    for name, value, low in (("align", align, 1), ("pad_token_id", pad_token_id, 0), ("max_tokens_per_pack", max_tokens_per_pack, 1)):
        if name == "max_tokens_per_pack" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}; got {value!r}")
    source_cu = batch.cu_seqlens.long()
    if max_tokens_per_pack is None:
        everything = torch.arange(batch.num_samples, device=batch.device)
        return _pack_samples(batch, everything, source_cu, batch.num_tokens, align, pad_token_id)
    lengths = batch.seq_lengths().tolist()
    packs, current, used = [], [], 0
    for b, n in enumerate(lengths):
        slot = -(-n // align) * align
        if slot > max_tokens_per_pack:
            raise ValueError(
                f"sample {b} has {n} tokens" + (f" ({slot} aligned to {align})" if slot != n else "")
                + f", more than max_tokens_per_pack={max_tokens_per_pack}; a sample is never split across packs: "
                f"raise max_tokens_per_pack or shorten or drop sample {b}"
            )
        if used + slot > max_tokens_per_pack:
            packs.append(current)
            current, used = [], 0
        current.append(b)
        used += slot
    if current:
        packs.append(current)
    return [
        _pack_samples(batch.select(idx), torch.tensor(idx, device=batch.device), source_cu, batch.num_tokens, align, pad_token_id)
        for idx in packs
    ]


def _pack_samples(sub: RLBatch, sample_index: Tensor, source_cu: Tensor, source_tokens: int, align: int, pad: int) -> PackedBatch:
    """Pack all of ``sub`` (samples ``sample_index`` of the source batch); vectorized on its device."""
    dev, n = sub.device, sub.num_samples
    lengths = sub.seq_lengths()
    slots = (lengths + align - 1) // align * align
    cu = _cu_seqlens(slots)
    total = int(cu[-1])
    slot = torch.repeat_interleave(torch.arange(n, device=dev), slots, output_size=total)
    k = torch.arange(total, device=dev) - cu.long()[slot]
    valid = k < lengths[slot]
    src = torch.where(valid, sub.cu_seqlens.long()[slot] + k, 0)
    # pad positions continue (t = h = w) from one past the sample's largest position
    token_slot = torch.repeat_interleave(torch.arange(n, device=dev), lengths, output_size=sub.num_tokens)
    top = torch.full((n,), -1, dtype=torch.int64, device=dev)
    top.scatter_reduce_(0, token_slot, sub.position_ids.amax(0), "amax")
    pad_position = top[slot] + 1 + k - lengths[slot]
    return PackedBatch(
        input_ids=torch.where(valid, sub.input_ids[src], pad),
        position_ids=torch.where(valid, sub.position_ids[:, src], pad_position),
        cu_seqlens=cu,
        seq_lengths=lengths,
        sample_index=sample_index.long(),
        valid=valid,
        source_rows=torch.where(valid, source_cu[sample_index.long()][slot] + k, -1),
        modality_spans=_shift(sub.modality_spans, cu, +1),
        loss_spans=_shift(sub.loss_spans, cu, +1),
        batch=sub,
        source_tokens=source_tokens,
        align=align,
        pad_token_id=pad,
    )


def _shift(table: SpanTable, cu: Tensor, sign: int) -> SpanTable:
    """``table`` with each span moved by ``sign`` × its slot's offset ``cu[slot]``."""
    offset = (sign * cu[:-1].to(table.device)[table.span_sample()]).to(torch.int32)
    return SpanTable(table.starts + offset, table.ends + offset, table.sample_ptr, table.modality, table.media_index)


def unpack(packed: Union[PackedBatch, Sequence[PackedBatch]], values=None):
    """Undo ``pack``, bitwise.

    - ``unpack(p)`` → the ``RLBatch`` of pack ``p``'s samples (``p.batch``), rebuilt from the
      packed tokens, positions and spans; ``unpack(packs)`` → the whole batch given to ``pack``.
    - ``unpack(p, values)``: per-token ``values [T', *]`` of the pack → ``[T, *]`` rows of
      ``p.batch`` (padding dropped); ``unpack(packs, values_list)`` → rows of the whole batch.
    """
    if isinstance(packed, PackedBatch):
        return _unpack_batch(packed) if values is None else _unpack_values(packed, values)
    packs = list(packed)
    if not packs or not all(isinstance(p, PackedBatch) for p in packs):
        raise TypeError("unpack takes a PackedBatch or a non-empty list of them (what pack returned)")
    order = torch.cat([p.sample_index.cpu() for p in packs])
    n = order.numel()
    seen = torch.bincount(order, minlength=n)[:n]
    bad = torch.nonzero(seen != 1).flatten()
    if bad.numel() or len({p.source_tokens for p in packs}) != 1:
        what = f"sample {int(bad[0])} {int(seen[bad[0]])} times" if bad.numel() else "packs of different batches"
        raise ValueError(f"the packs hold {what}; unpack needs every sample of one packed batch exactly once (all the packs pack returned)")
    if values is None:
        merged = RLBatch.concat([_unpack_batch(p) for p in packs])
        identity = torch.equal(order, torch.arange(order.numel()))
        return merged if identity else merged.select(torch.argsort(order).tolist())
    values = list(values)
    if len(values) != len(packs):
        raise ValueError(f"unpack got {len(values)} value tensors for {len(packs)} packs")
    for i, (p, v) in enumerate(zip(packs, values)):
        _check_values(p, v, f"values[{i}]")
    out = values[0].new_empty((packs[0].source_tokens,) + tuple(values[0].shape[1:]))
    for p, v in zip(packs, values):
        out[p.source_rows[p.valid].to(out.device)] = v[p.valid.to(v.device)]
    return out


def _check_values(p: PackedBatch, v, name: str) -> None:
    if not isinstance(v, Tensor) or v.dim() < 1 or v.shape[0] != p.num_tokens:
        raise ValueError(f"{name} must be [T', *] with T' = {p.num_tokens} (tokens of the pack); got {tuple(getattr(v, 'shape', ()))}")


def _unpack_values(p: PackedBatch, values: Tensor) -> Tensor:
    _check_values(p, values, "values")
    return values[p.valid.to(values.device)]


def _unpack_batch(p: PackedBatch) -> RLBatch:
    fields = {name: getattr(p.batch, name) for name in RLBatch.model_fields}
    fields.update(
        input_ids=p.input_ids[p.valid],
        position_ids=p.position_ids[:, p.valid],
        cu_seqlens=_cu_seqlens(p.seq_lengths),
        modality_spans=_shift(p.modality_spans, p.cu_seqlens, -1),
        loss_spans=_shift(p.loss_spans, p.cu_seqlens, -1),
    )
    return RLBatch(**fields)
