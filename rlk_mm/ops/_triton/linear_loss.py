"""The fused LM-head policy loss on CUDA: one logits product per chunk of scored rows.

For each chunk of rows (``chunk_rows``: equal chunks whose workspace fits
``LMHeadConfig.linear_budget``, in order):

1. ``lm_head.forward_tiles_kernel`` with ``STORE_Z``: each tile reduced to its per-(row,
   segment) partials in fp32 (so the log-sum-exp, log-prob and entropy are
   ``selected_logprob``'s, bitwise), and the tile's logits, less their segment's row
   maximum, stored in the weight's dtype;
2. the combine kernel: log-prob, entropy and log-sum-exp of the chunk's rows (a vocabulary
   shard first gathers every shard's partials: ``exchange``);
3. the caller's ``upstream``: each token's loss gradient with respect to its log-prob and
   entropy (a function of that token alone and of inputs known before the forward);
4. ``_dz_kernel``: the stored logits become d loss / d logits in place;
5. cuBLAS: d hidden of the chunk's rows (fp32, then rounded to the caller's dtype), d weight
   (the first chunk's product, then the others added in the weight's dtype: no zero-filled
   buffer) and d bias (fp32).

Three logits-sized products in all (forward, d hidden, d weight) instead of four. The stored
difference to the segment's max keeps the dtype's precision where probability mass is (near the
max); entries far below it have probabilities that round to what they are anyway.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from ._common import equal_chunks
from .lm_head import Exchange, LMHeadConfig, Operands, accumulate_mm, default_config, forward_chunk, partial_columns

Tensor = torch.Tensor

__all__ = ["Exchange", "Upstream", "chunk_rows", "default_config", "loss_grads", "scale_"]
#: (chunk start, chunk end, log-prob [m], entropy [m]) -> (d loss / d log-prob, d loss / d entropy
#: or None when the loss has no entropy term), fp32 [m]
Upstream = Callable[[int, int, Tensor, Tensor], tuple[Tensor, Optional[Tensor]]]


@triton.jit
def _dz_kernel(
    z_ptr, part_max_ptr, lse_ptr, entropy_ptr, g_ptr, ge_ptr, tgt_ptr,
    n_rows, V, inv_temp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """In place: the stored ``z - segment max`` of tile (row block, segment) becomes
    ``dz = (onehot g - p (g + ge (log p + entropy))) / T`` with ``log p = (z - segment max) +
    (segment max - lse)``; masked (-inf) entries give 0. ``BLOCK_N``: the partials' columns."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < n_rows
    n_ok = offs_n < V
    ptrs = z_ptr + offs_m.to(tl.int64)[:, None] * V + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    u = tl.load(ptrs, mask=ok, other=-float("inf")).to(tl.float32)
    top = tl.load(part_max_ptr + pid_n * n_rows + offs_m, mask=m_ok, other=0.0)
    top = tl.where(top == -float("inf"), 0.0, top)  # a segment masked whole: every u is -inf
    lse = tl.load(lse_ptr + offs_m, mask=m_ok, other=0.0)
    log_p = u + (top - lse)[:, None]
    p = tl.exp(log_p)
    g = tl.load(g_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    entropy = tl.load(entropy_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    ge = tl.load(ge_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    coef = g + ge * (tl.where(p > 0, log_p, 0.0) + entropy)
    tgt = tl.load(tgt_ptr + offs_m, mask=m_ok, other=-1)
    dz = (tl.where(offs_n[None, :] == tgt[:, None], g, 0.0) - p * coef) * inv_temp
    tl.store(ptrs, dz.to(z_ptr.dtype.element_ty), mask=ok)


def chunk_rows(n: int, V: int, H: int, dtype: torch.dtype, cfg: LMHeadConfig) -> int:
    """Rows per chunk: the fewest equal chunks (``equal_chunks``) whose workspace
    ``cfg.linear_budget`` holds (per row: its logits in ``dtype``, its fp32 d hidden and its
    three fp32 partials per segment)."""
    per_row = V * torch.finfo(dtype).bits // 8 + 4 * H + 12 * triton.cdiv(V, partial_columns(cfg))
    return equal_chunks(n, cfg.linear_budget // per_row, cfg.block_m)


def loss_grads(
    hidden: Tensor, weight: Tensor, rows: Tensor, targets: Tensor, bias: Optional[Tensor], temperature: float,
    all_rows: bool, upstream: Upstream, need_hidden: bool, need_weight: bool, need_bias: bool,
    config: Optional[LMHeadConfig] = None, exchange: Optional[Exchange] = None, chunk_vocab: Optional[int] = None,
    rows_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(log-prob [n], entropy [n], d hidden of the scored rows [n, H] in ``rows_dtype``, d
    weight [V, H], d bias fp32 [V])`` for the scored ``rows`` of ``hidden`` at ``targets``, each
    gradient None when not needed. A chunk's d hidden rows are one fp32 product, rounded once
    to ``rows_dtype`` (a 16-bit dtype needs only a chunk's fp32 rows at a time). Inputs are
    validated by the caller; ``all_rows`` as in ``logprob.forward``. A vocabulary shard
    (``_vocab_parallel``) gives ``exchange`` (as ``logprob.forward``: once per chunk, between
    the tiles and the combine; targets off the shard are -1) and ``chunk_vocab``, the group's
    largest shard: every rank then cuts the same chunks."""
    n, (V, H) = rows.numel(), weight.shape
    dev = hidden.device
    cfg = config or default_config(weight.dtype, dev)
    logp = torch.empty(n, dtype=torch.float32, device=dev)
    entropy = torch.empty(n, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    d_bias = torch.zeros(V, dtype=torch.float32, device=dev) if need_bias else None
    if n == 0:
        d_sel = torch.zeros((0, H), dtype=rows_dtype, device=dev) if need_hidden else None
        return logp, entropy, d_sel, torch.zeros_like(weight) if need_weight else None, d_bias
    # written by the chunks' products (the first chunk's d weight is a plain product): no zero fill
    d_sel = torch.empty((n, H), dtype=rows_dtype, device=dev) if need_hidden else None
    d_weight = torch.empty_like(weight) if need_weight else None
    ops = Operands(hidden, weight, rows, cfg, all_rows, need_sel=need_weight)
    cols = partial_columns(cfg)
    n_parts = triton.cdiv(V, cols)
    step = chunk_rows(n, chunk_vocab or V, H, weight.dtype, cfg)
    z = torch.empty(step * V, dtype=weight.dtype, device=dev)
    rounded = need_hidden and rows_dtype != torch.float32
    d_chunk = torch.empty((step, H), dtype=torch.float32, device=dev) if rounded else None
    parts = torch.empty((3, n_parts * step), dtype=torch.float32, device=dev)
    tgt_logit = torch.empty(step, dtype=torch.float32, device=dev)
    for s in range(0, n, step):
        m = min(step, n - s)
        forward_chunk(ops, bias, targets, temperature, s, m, parts, tgt_logit, logp, entropy, lse, True, exchange, z=z)
        if not (need_hidden or need_weight or need_bias):
            continue
        g, ge = upstream(s, s + m, logp[s : s + m], entropy[s : s + m])
        ge = torch.zeros_like(g) if ge is None else ge
        _dz_kernel[(triton.cdiv(m, cfg.dz_block_m), n_parts)](
            z, parts[0], lse[s:], entropy[s:], g.float().contiguous(), ge.float().contiguous(), targets[s:],
            m, V, 1.0 / temperature, BLOCK_M=cfg.dz_block_m, BLOCK_N=cols, num_warps=cfg.dz_warps,
        )
        dz = z[: m * V].view(m, V)
        if need_hidden:
            out = d_chunk[:m] if rounded else d_sel[s : s + m]
            accumulate_mm(out, dz, weight, add=False)
            if rounded:
                d_sel[s : s + m] = out
        if need_weight:
            h_rows = ops.h_sel[s : s + m] if ops.h_sel is not None else hidden.index_select(0, rows[s : s + m])
            if s == 0:
                torch.mm(dz.T, h_rows, out=d_weight)
            else:
                d_weight.addmm_(dz.T, h_rows)
        if need_bias:
            d_bias += dz.sum(0, dtype=torch.float32)
    return logp, entropy, d_sel, d_weight, d_bias


@triton.jit
def _scale_kernel(x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    """In place: ``x · scale`` (fp32 product, rounded to x's dtype, as torch's ``mul_``).
    Where the scale is 1 nothing is read or written: ``x · 1`` is ``x``, bit for bit."""
    s = tl.load(scale_ptr).to(tl.float32)
    if s != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(x_ptr + offs, mask=ok)
        tl.store(x_ptr + offs, (x.to(tl.float32) * s).to(x_ptr.dtype.element_ty), mask=ok)


def scale_(x: Tensor, scale: Tensor, config: Optional[LMHeadConfig] = None) -> Tensor:
    """``x.mul_(scale)`` for a contiguous ``x`` and a 0-dim ``scale`` of x's dtype on its device,
    without reading the scale on the host; free when it is 1 (a loss's usual backward), where
    torch's broadcast multiply reads and writes every entry. ``config`` replaces
    ``default_config`` (its ``scale_block``, ``scale_warps``)."""
    cfg = config or default_config(x.dtype, x.device)
    flat = x.view(-1)
    _scale_kernel[(triton.cdiv(flat.numel(), cfg.scale_block),)](flat, scale, flat.numel(), BLOCK=cfg.scale_block,
                                                                  num_warps=cfg.scale_warps)
    return x
