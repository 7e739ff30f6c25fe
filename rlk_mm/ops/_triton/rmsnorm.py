"""Batch-invariant RMSNorm in Triton: a fixed block of rows per program, one reduction tree.

Each row is reduced in one ``tl.sum`` over a block whose width, like the number of rows
per program, is fixed by the hidden size, so a row's result never depends on how many
rows there are or where it sits. Semantics
follow transformers' Qwen RMSNorm: normalise in fp32, round to the input dtype, then
multiply by the weight in the promoted dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["default_config", "rms_norm", "RMSNormConfig"]


@dataclass(frozen=True)
class RMSNormConfig:
    """Rows per program, the row block width and warps of the RMSNorm kernel."""

    rows: int
    block: int
    num_warps: int


def default_config(hidden: int) -> RMSNormConfig:
    """A function of the hidden size alone: every row is reduced by one fixed tree."""
    block = triton.next_power_of_2(hidden)
    rows = max(1, min(64, 4096 // block))
    return RMSNormConfig(rows=rows, block=block, num_warps=4 if block * rows <= 4096 else 8)


@triton.jit(do_not_specialize=["n_rows"])
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, n_rows, H, s_x, s_out, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < H)
    x = tl.load(x_ptr + rows[:, None] * s_x + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / H
    y = (xf * (1.0 / tl.sqrt(var + eps))[:, None]).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
    out = w.to(tl.float32)[None, :] * y.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * s_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, config: RMSNormConfig | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape); weight [H]."""
    h = x.shape[-1]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    rows = x.reshape(-1, h)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0] and h:
        cfg = config or default_config(h)
        _rmsnorm_kernel[(triton.cdiv(rows.shape[0], cfg.rows),)](
            rows, weight.contiguous(), out, rows.shape[0], h, rows.stride(0), out.stride(0), float(eps),
            ROWS=cfg.rows, BLOCK=cfg.block, num_warps=cfg.num_warps,
        )
    return out.reshape(*x.shape[:-1], h)
