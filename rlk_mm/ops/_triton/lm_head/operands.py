"""How the LM-head kernels read their operands, and the cuBLAS products around them.

``Operands``: hidden rows and W as tensor descriptors (read by the copy engine) where
alignment allows (``tma_ok``), else pointers with the row gather inside the kernel; ``ieee``:
whether dot products run in full fp32; ``bias_arg``: a valid pointer whether or not there is
a bias; ``accumulate_mm``: ``acc += a @ b`` with an fp32 accumulator for 16-bit operands.
"""

from __future__ import annotations

from typing import Optional

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .._common import interpreted
from .config import LMHeadConfig

Tensor = torch.Tensor

__all__ = ["accumulate_mm", "bias_arg", "ieee", "Operands", "tma_ok"]


def ieee(weight: Tensor) -> bool:
    """fp32 dot products (see ``mma``): fp32 inputs, and the interpreter's 16-bit dots."""
    return weight.dtype == torch.float32 or interpreted(weight)


def bias_arg(bias: Optional[Tensor], weight: Tensor) -> Tensor:
    return weight if bias is None else bias  # any valid pointer when HAS_BIAS is off


def tma_ok(cfg: LMHeadConfig, *ts: Tensor) -> bool:
    """The copy engine needs 16-byte aligned bases and row strides."""
    return cfg.tma and all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in ts)


class Operands:
    """How the kernels read hidden rows and W: tensor descriptors over the selected rows
    (a gathered copy unless ``all_rows``: every row is scored, in order) when the copy
    engine can read them, else pointers and the row index (gathered inside the kernel)."""

    def __init__(self, hidden: Tensor, weight: Tensor, rows: Tensor, cfg: LMHeadConfig, all_rows: bool,
                 need_sel: bool = False):
        self.tma = tma_ok(cfg, hidden, weight)
        self.h_sel = hidden if all_rows else (hidden.index_select(0, rows) if self.tma or need_sel else None)
        self.hidden, self.weight, self.rows, self.cfg = hidden, weight, rows, cfg
        if self.tma:
            self.w_src = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])

    def args(self, start: int, count: int) -> tuple:
        """(h_src, w_src, rows) for the selected rows ``[start, start + count)``."""
        rows = self.rows[start : start + count]
        if not self.tma:
            return self.hidden, self.weight, rows
        h = TensorDescriptor.from_tensor(self.h_sel[start : start + count], [self.cfg.block_m, self.cfg.block_k])
        return h, self.w_src, rows


def accumulate_mm(acc: Tensor, a: Tensor, b: Tensor, add: bool = True) -> None:
    """``acc += a @ b`` (``acc = a @ b`` without ``add``: acc's old values, even NaN, are not
    read) with fp32 ``acc`` and fp32 accumulation for 16-bit ``a``, ``b``."""
    beta = 1 if add else 0
    if a.dtype == torch.float32:
        acc.addmm_(a, b, beta=beta)
    elif acc.is_cuda:  # cuBLAS: 16-bit operands, fp32 C updated in place
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    elif add:  # Triton's interpreter (tests)
        acc.addmm_(a.float(), b.float())
    else:
        torch.mm(a.float(), b.float(), out=acc)
