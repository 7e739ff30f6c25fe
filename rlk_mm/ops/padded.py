"""Padded tensors ↔ packed rows: ``pack_padded`` and ``unpack_to_padded``, bitwise.

``pack_padded(x, mask)`` / ``unpack_to_padded(packed, cu_seqlens, length, padding)``:
``[B, L, *]`` with one run of real rows per sample (left, right or middle padding, as verl's
prompt + response) ↔ ``[T, *]``. Custom ops ``rlk_mm::pack_padded`` and
``rlk_mm::unpack_to_padded`` (Triton on CUDA, ``index_select``/``index_copy_`` elsewhere),
each the other's backward. Each output element is written once: bitwise copies,
deterministic, no atomics. (An ``RLBatch`` is packed by ``packed_batch.pack``.)

Every public function checks its arguments before any work and reads what it needs from
the device in one host sync; the custom ops trust their index arguments (the public
functions and the ops' own backward pass checked ones) and never sync. Values are copied
as they are: NaN and inf pass through.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, NoReturn, Optional, Union

import torch

from ..deprecations import renamed_keywords
from ..schema import PaddingSide
from ..schema.checks import INTEGER_DTYPES, DeviceChecks, int_arg, tensor_arg
from ._backend import readable_args, use_triton

Tensor = torch.Tensor

__all__ = ["pack_padded", "unpack_to_padded"]

#: packed row counts must fit int32 ``cu_seqlens``
INT32_LIMIT = 2**31
#: the dtypes pack/unpad copies
DTYPES = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)
DTYPE_NAMES = ", ".join(str(d).replace("torch.", "") for d in DTYPES)


def data_arg(name: str, value, min_dim: int, layout: str) -> Tensor:
    """A tensor that pack/unpad copy.

    Parameters
    ----------
    name : str
        The argument's name, for the error message.
    value : Tensor
        The tensor given.
    min_dim : int
        Its fewest dims.
    layout : str
        Its layout for the error message, e.g. "[T, *]".

    Returns
    -------
    Tensor

    Raises
    ------
    TypeError, ValueError
        For a non-tensor, too few dims, or a dtype the copy does not support.
    """
    value = tensor_arg(name, value)
    if value.dim() < min_dim:
        raise ValueError(f"{name} must be a {layout} tensor ({min_dim}-D or more), got shape {tuple(value.shape)}")
    if value.dtype not in DTYPES:
        raise TypeError(f"{name} is {value.dtype}; pack/unpad copies {DTYPE_NAMES}")
    return value


def fill_arg(fill, dtype: torch.dtype) -> float:
    """``fill`` as a float that is a value of ``dtype``.

    Parameters
    ----------
    fill : int or float
        The value given.
    dtype : torch.dtype
        The tensor's dtype: exact for integer dtypes (within ±2**53, what a float carries exactly);
        for float dtypes NaN and ±inf are values, a finite number that rounds to inf is not.

    Returns
    -------
    float

    Raises
    ------
    TypeError, ValueError
        For a value that is not one of ``dtype``.
    """
    if isinstance(fill, bool) or not isinstance(fill, numbers.Real):
        raise TypeError(f"fill must be an int or float, got {type(fill).__name__} {fill!r}")
    try:
        value = float(fill)
    except OverflowError:  # an int beyond any float
        value = math.inf
    if dtype.is_floating_point:
        fits = not math.isfinite(value) or math.isfinite(torch.tensor(value, dtype=torch.float64).to(dtype).item())
    else:
        low, high = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
        fits = math.isfinite(value) and value == int(value) and low <= int(value) <= high and abs(value) <= 2**53
    if not fits:
        within = "" if dtype.is_floating_point else " (integers within ±2**53)"
        raise ValueError(f"fill {fill!r} is not a value of {dtype}{within}")
    return value


def pack_padded(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The rows of ``x [B, L, *]`` where ``mask [B, L]`` is set, packed.

    Parameters
    ----------
    x : Tensor
        ``[B, L, *]``.
    mask : Tensor
        ``[B, L]``, bool or integer 0/1, on ``x``'s device; each row one contiguous run (left, right
        or middle padding).

    Returns
    -------
    tuple of Tensor
        ``(packed [T, *], cu_seqlens [B + 1])``, ``cu_seqlens`` int32. Differentiable: the gradient
        of ``x`` is the packed gradient scattered back, zero at padding (the backward never syncs).

    Raises
    ------
    ValueError, TypeError
        For a mask with a hole or another value (naming the sample and position), or of another
        shape or device. One host sync: the mask checks and the output size, read together.
    """
    x = data_arg("x", x, 2, "[B, L, *]")
    readable_args("pack_padded", x=x)  # (the mask must be on its device)
    checks = DeviceChecks()
    starts, lengths = mask_runs(x, mask, checks)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    (total,) = checks.run(cu[-1])
    if total >= INT32_LIMIT:
        raise ValueError(f"x: {total} packed rows do not fit int32 cu_seqlens; pack fewer samples at a time")
    cu = cu.to(torch.int32)
    return torch.ops.rlk_mm.pack_padded(x, starts, cu, total), cu


@renamed_keywords
def unpack_to_padded(
    packed: Tensor, cu_seqlens: Tensor, length: int, padding: PaddingSide | str | Tensor = PaddingSide.RIGHT, *,
    fill: Union[int, float] = 0,
) -> Tensor:
    """``[B, length, *]`` from ``packed [T, *]``: sample ``b``'s rows ``cu_seqlens[b]:cu_seqlens[b+1]``, placed.

    Parameters
    ----------
    packed : Tensor
        ``[T, *]``.
    cu_seqlens : Tensor
        ``[B + 1]``, any integer dtype, from 0 to ``T`` without decreasing; no sample longer than
        ``length``.
    length : int
        The padded length L.
    padding : PaddingSide, str or Tensor
        ``"right"`` (rows from 0), ``"left"`` (rows ending at ``length``), or the ``[B, length]`` mask
        the rows came from. ``side=`` is its deprecated old name.
    fill : int or float
        A value of ``packed``'s dtype, everywhere else.

    Returns
    -------
    Tensor
        ``[B, length, *]``, differentiable.

    Raises
    ------
    ValueError, TypeError
        For bad ``cu_seqlens``, mask or ``fill``, naming the sample. One host sync: the
        ``cu_seqlens`` and mask checks, read together.
    """
    packed = data_arg("packed", packed, 1, "[T, *]")
    readable_args("unpack_to_padded", packed=packed, cu_seqlens=cu_seqlens, padding=padding)
    cu = tensor_arg("cu_seqlens", cu_seqlens, ndim=1, dtypes=INTEGER_DTYPES)
    if cu.numel() == 0:
        raise ValueError("cu_seqlens must hold B+1 >= 1 offsets (0, then each sample's end), got none")
    length = int_arg("length", length, min=0)
    fill = fill_arg(fill, packed.dtype)
    B, T = cu.numel() - 1, packed.shape[0]
    if T >= INT32_LIMIT:
        raise ValueError(f"packed: {T} rows do not fit int32 cu_seqlens; unpad fewer samples at a time")
    cu = cu.to(packed.device, torch.int64)
    lengths = torch.diff(cu)
    checks = DeviceChecks()
    _cu_checks(checks, cu, lengths, T, length)
    if isinstance(padding, Tensor):
        if padding.shape != (B, length):
            raise ValueError(f"padding as a mask must have shape (B, length) = ({B}, {length}); got {tuple(padding.shape)}")
        starts, mask_lengths = mask_runs(None, padding.to(packed.device), checks, "padding")
        differ = mask_lengths != lengths
        checks.add(differ.any(), lambda: _raise_count(differ, mask_lengths, lengths))
    else:
        try:
            padding = PaddingSide(padding)
        except ValueError:
            raise ValueError(f"padding must be 'left', 'right' or a [B, length] mask; got {padding!r}") from None
        starts = torch.zeros_like(lengths) if padding is PaddingSide.RIGHT else length - lengths
    checks.run()
    return torch.ops.rlk_mm.unpack_to_padded(packed, starts, cu.to(torch.int32), length, fill)


def mask_runs(x: Optional[Tensor], mask, checks: DeviceChecks, name: str = "mask") -> tuple[Tensor, Tensor]:
    """The first set position and the count of each row of a mask; adds its value checks to ``checks``.

    Parameters
    ----------
    x : Tensor, optional
        When given, the mask is shaped like its first two dims.
    mask : Tensor
        ``[B, L]``, bool or integer 0/1.
    checks : DeviceChecks
        Collects the value checks (only 0/1, each row one contiguous run); the caller runs them.
    name : str
        The mask's name, for the error message.

    Returns
    -------
    tuple of Tensor
        ``(first, count)``, int64 ``[B]``. No host sync.
    """
    mask = tensor_arg(name, mask)
    if mask.dim() != 2:
        raise ValueError(f"{name} must be a [B, L] mask, got shape {tuple(mask.shape)}")
    if x is not None:
        if tuple(x.shape[:2]) != tuple(mask.shape):
            raise ValueError(f"{name} has shape {tuple(mask.shape)} but x is [B, L, *] = {tuple(x.shape)}")
        if mask.device != x.device:
            raise ValueError(f"{name} is on {mask.device} but x is on {x.device}")
    if mask.dtype != torch.bool and mask.dtype not in INTEGER_DTYPES:
        raise TypeError(f"{name} must be bool or integer 0/1, got {mask.dtype}")
    B, L = mask.shape
    on = mask if mask.dtype == torch.bool else mask != 0
    lengths = on.sum(1)
    first = on.to(torch.int8).argmax(1) if L else torch.zeros(B, dtype=torch.int64, device=mask.device)
    if mask.dtype != torch.bool:
        odd = (mask != 0) & (mask != 1)
        checks.add(odd.any(), lambda: _raise_at(odd, lambda b, p: f"{name}: sample {b}, position {p} holds "
                                                f"{int(mask[b, p])}; a mask holds only 0 and 1"))
    holes = _holes(on, first, lengths)
    checks.add(holes.any(), lambda: _raise_at(holes, lambda b, p: f"{name}: sample {b} has a hole at position {p}: its set "
                                              "positions are not one contiguous run (left, right or middle padding only)"))
    return first.long(), lengths.long()


def _holes(on: Tensor, first: Tensor, lengths: Tensor) -> Tensor:
    """[B, L] bool: where a row differs from one run of ``lengths`` set positions from ``first``."""
    j = torch.arange(on.shape[1], device=on.device)
    return on != ((j >= first[:, None]) & (j < (first + lengths)[:, None]))


def _raise_at(bad: Tensor, message: Callable[[int, int], str]) -> NoReturn:
    b, p = torch.nonzero(bad)[0].tolist()
    raise ValueError(message(b, p))


def _cu_checks(checks: DeviceChecks, cu: Tensor, lengths: Tensor, T: int, length: int) -> None:
    """Adds to ``checks``: int64 ``cu_seqlens`` must run from 0 to ``T`` without decreasing, no
    sample over ``length`` rows."""

    def first(bad: Tensor) -> int:
        return int(torch.nonzero(bad)[0])

    def wrong_range():
        raise ValueError(f"cu_seqlens must run from 0 to the packed row count {T}; got {int(cu[0])}..{int(cu[-1])}")

    def decreasing():
        raise ValueError(f"cu_seqlens decreases at sample {first(lengths < 0)}; it must be non-decreasing")

    def too_long():
        b = first(lengths > length)
        raise ValueError(f"cu_seqlens: sample {b} has {int(lengths[b])} rows, more than the padded length {length}")

    checks.add((cu[0] != 0) | (cu[-1] != T), wrong_range)
    checks.add((lengths < 0).any(), decreasing)
    checks.add((lengths > length).any(), too_long)


def _raise_count(differ: Tensor, mask_lengths: Tensor, lengths: Tensor) -> NoReturn:
    b = int(torch.nonzero(differ)[0])
    raise ValueError(f"padding: sample {b} has {int(mask_lengths[b])} set positions but cu_seqlens gives it "
                     f"{int(lengths[b])} rows")


def cu_seqlens_of(lengths: Tensor) -> Tensor:
    """Boundaries of runs of ``lengths``.

    Parameters
    ----------
    lengths : Tensor
        ``[B]`` integer run lengths.

    Returns
    -------
    Tensor
        int32 ``[B + 1]``, from 0, on ``lengths``' device.

    Raises
    ------
    ValueError
        When the total does not fit int32.
    """
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    if lengths.numel() and int(cu[-1]) >= INT32_LIMIT:
        raise ValueError(f"{int(cu[-1])} packed rows do not fit int32 cu_seqlens")
    return cu.to(torch.int32)


# ---------------------------------------------------------------------- the custom ops (indices trusted)
def _check_op_args(values: Tensor, starts: Tensor, cu: Tensor, B: int) -> None:
    """Shapes, dtypes and devices of an op's arguments (its index values are the caller's to check)."""
    if values.dtype not in DTYPES:
        raise TypeError(f"pack/unpad copies {DTYPE_NAMES}; got {values.dtype}")
    if starts.dtype != torch.int64 or starts.shape != (B,):
        raise ValueError(f"starts must be int64 [B={B}]; got {starts.dtype} {tuple(starts.shape)}")
    if cu.dtype != torch.int32 or cu.shape != (B + 1,):
        raise ValueError(f"cu_seqlens must be int32 [B+1={B + 1}]; got {cu.dtype} {tuple(cu.shape)}")
    for name, t in (("starts", starts), ("cu_seqlens", cu)):
        if t.device != values.device:
            raise ValueError(f"{name} is on {t.device} but the data is on {values.device}")


def packed_source_rows(starts: Tensor, cu: Tensor, L: int, T: int) -> Tensor:
    """For each packed row, its row in the padded tensor viewed as ``[B*L, F]``.

    Parameters
    ----------
    starts, cu : Tensor
        Each sample's first padded position, and the packed boundaries ``[B + 1]``.
    L, T : int
        The padded length and the packed row count.

    Returns
    -------
    Tensor
        int64 ``[T]``.
    """
    B = starts.numel()
    lengths = torch.diff(cu).long()
    sample = torch.repeat_interleave(torch.arange(B, device=cu.device), lengths, output_size=T)
    k = torch.arange(T, device=cu.device) - cu.long()[sample]
    return sample * L + starts[sample] + k


def padded_source_rows(starts: Tensor, cu: Tensor, L: int) -> Tensor:
    """For each padded row, its packed row, or -1 at padding.

    Parameters
    ----------
    starts, cu : Tensor
        Each sample's first padded position, and the packed boundaries ``[B + 1]``.
    L : int
        The padded length.

    Returns
    -------
    Tensor
        int64 ``[B*L]``.
    """
    lengths = torch.diff(cu).long()
    k = torch.arange(L, device=cu.device)[None, :] - starts[:, None]
    inside = (k >= 0) & (k < lengths[:, None])
    return torch.where(inside, cu.long()[:-1, None] + k, -1).reshape(-1)


@torch.library.custom_op("rlk_mm::pack_padded", mutates_args=())
def _pack_op(x: Tensor, starts: Tensor, cu_seqlens: Tensor, total: int) -> Tensor:
    """``[total, *]``: the rows ``starts[b]:starts[b] + n_b`` of every ``x[b]``, sample by sample."""
    B, L, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    _check_op_args(x, starts, cu_seqlens, B)
    F = math.prod(rest)
    flat = x.contiguous().reshape(B * L, F)
    rows = packed_source_rows(starts, cu_seqlens, L, total)
    if use_triton(x):
        from ._triton import pack as _tri

        out = _tri.gather_rows(flat, rows, flat.new_zeros(1))
    else:
        out = flat.index_select(0, rows)
    return out.reshape((total,) + rest)


@_pack_op.register_fake
def _(x, starts, cu_seqlens, total):
    _check_op_args(x, starts, cu_seqlens, x.shape[0])
    return x.new_empty((total,) + tuple(x.shape[2:]))


@torch.library.custom_op("rlk_mm::unpack_to_padded", mutates_args=())
def _unpack_op(packed: Tensor, starts: Tensor, cu_seqlens: Tensor, length: int, fill: float) -> Tensor:
    """``[B, length, *]``: packed rows of sample ``b`` at ``starts[b]:``, ``fill`` elsewhere."""
    B, T, rest = starts.shape[0], packed.shape[0], tuple(packed.shape[1:])
    _check_op_args(packed, starts, cu_seqlens, B)
    F = math.prod(rest)
    flat = packed.contiguous().reshape(T, F)
    if use_triton(packed):
        from ._triton import pack as _tri

        index = padded_source_rows(starts, cu_seqlens, length)
        out = _tri.gather_rows(flat, index, torch.full((1,), fill, dtype=packed.dtype, device=packed.device))
    else:
        out = flat.new_full((B * length, F), fill)
        out.index_copy_(0, packed_source_rows(starts, cu_seqlens, length, T), flat)
    return out.reshape((B, length) + rest)


@_unpack_op.register_fake
def _(packed, starts, cu_seqlens, length, fill):
    B = starts.shape[0]
    _check_op_args(packed, starts, cu_seqlens, B)
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
