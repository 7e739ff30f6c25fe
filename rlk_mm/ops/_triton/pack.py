"""Triton row gather for pack/unpad: ``out[r] = src[index[r]]``, or ``fill`` where ``index[r] < 0``.

Both directions of ``[B, L, F] ↔ [T, F]`` are this one gather, indexed by the output:
packing reads the valid rows of the padded tensor; unpadding reads, for every padded row,
its packed row or the fill value. Each output element is written exactly once (no
atomics, no separate memset), so results are deterministic and bitwise copies.

One program copies a ``[BLOCK_R, BLOCK_F]`` tile: ``BLOCK_R`` output rows, ``BLOCK_F``
contiguous features of each (16-byte accesses when ``F`` and the base pointers allow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["default_config", "gather_rows", "GatherConfig"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class GatherConfig:
    """Output rows and features per program, and warps, of the row gather."""

    block_r: int
    block_f: int
    num_warps: int


def default_config(F: int, device: torch.device) -> GatherConfig:
    """A function of the row width and the device only: 4096 elements a program on CUDA,
    at most 512 contiguous features (16-byte accesses)."""
    if device.type != "cuda":  # Triton's interpreter (tests): small tiles
        return GatherConfig(block_r=4, block_f=min(triton.next_power_of_2(max(F, 1)), 32), num_warps=1)
    block_f = min(triton.next_power_of_2(max(F, 1)), 512)
    return GatherConfig(block_r=max(1, 4096 // block_f), block_f=block_f, num_warps=4)


@triton.jit
def _gather_rows_kernel(
    src_ptr, index_ptr, out_ptr, fill_ptr, n_out, F,
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_ok = rows < n_out
    col_ok = cols < F
    src_row = tl.load(index_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    fill = tl.load(fill_ptr)
    offs = src_row[:, None] * F + cols[None, :]
    take = (src_row >= 0)[:, None] & col_ok[None, :]
    values = tl.load(src_ptr + offs, mask=take, other=fill)
    dst = rows.to(tl.int64)[:, None] * F + cols[None, :]
    tl.store(out_ptr + dst, values, mask=row_ok[:, None] & col_ok[None, :])


def gather_rows(src: Tensor, index: Tensor, fill: Tensor, *, config: GatherConfig | None = None) -> Tensor:
    """``[len(index), F]`` rows of the contiguous ``src [N, F]``; rows with ``index < 0`` get ``fill``.

    ``index`` is int64 with values in ``[-1, N)`` (checked by the caller); ``fill`` a
    one-element tensor of ``src``'s dtype. ``config`` overrides ``default_config`` (benchmarks).
    """
    n_out, F = index.numel(), src.shape[1]
    out = src.new_empty((n_out, F))
    if n_out == 0 or F == 0:
        return out
    as_bytes = src.dtype == torch.bool  # Triton has no bool pointer of byte width: copy bytes
    s, o, f = (t.view(torch.uint8) for t in (src, out, fill)) if as_bytes else (src, out, fill)
    cfg = config or default_config(F, src.device)
    grid = (triton.cdiv(n_out, cfg.block_r), triton.cdiv(F, cfg.block_f))
    _gather_rows_kernel[grid](s, index, o, f, n_out, F, BLOCK_R=cfg.block_r, BLOCK_F=cfg.block_f,
                              num_warps=cfg.num_warps)
    return out
