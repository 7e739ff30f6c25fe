"""Triton kernels of the selected log-prob: logits tiles that never reach memory.

Forward: one program per (row block, vocab block) tile computes the tile's logits
``z = (h[rows] · Wᵀ + b) / T`` in an fp32 accumulator and reduces it at once to per-row
partials of each 128-column vocabulary segment (max, Σ exp(z - max), Σ exp(z - max)·(z -
max); ``lm_head``); the program whose block holds a row's target also writes that logit. A
second kernel folds the partials of each row over the segments in vocabulary order. A
vocabulary shard (``_vocab_parallel``) gathers every shard's partials between the two
(``exchange``), so the fold is the single device's. Backward: the same tiles are recomputed
and turned into ``dz`` for one vocabulary chunk at a time (``[rows, chunk]``, the only buffer
of that shape), which cuBLAS multiplies into ``d hidden`` (fp32 accumulator, a pass of rows at
a time) and the chunk's rows of ``d weight``.

Tiles are read by the copy engine (tensor descriptors; hidden rows gathered into one
copy first unless all rows are scored in order) or, where alignment does not allow it,
by pointers with the row gather inside the kernel.

Reduction order: the global segment grid of ``lm_head`` (tile sizes depend only on the dtype
and the device, every logit is one dot product over H in the same order, each segment's
partial reduced from its own columns, and the combine is each row's own sequential sum over
segments 0, 1, 2, ...), so a row's log-prob, entropy and log-sum-exp are bitwise the same
whatever else is in the batch, wherever the row stands and however the vocabulary is
sharded over ranks. No float atomics anywhere; gradients are deterministic (cuBLAS, fixed
chunk order).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import equal_chunks, grouped_tile_ids, persistent_programs
from .lm_head import (
    Exchange,
    LMHeadConfig,
    Operands,
    accumulate_mm,
    bias_arg,
    default_config,
    forward_chunk,
    ieee,
    logits_tile,
    partial_columns,
)

Tensor = torch.Tensor

__all__ = ["LMHeadConfig", "backward", "default_config", "dz_chunk_columns", "forward"]


@triton.jit
def _dlogits_kernel(
    h_src, w_src, b_ptr, rows_ptr, tgt_ptr, lse_ptr, entropy_ptr, g_ptr, ge_ptr, dz_ptr,
    n_rows, V, H, stride_h, stride_w, inv_temp, chunk_start, chunk_cols, num_programs,
    HAS_BIAS: tl.constexpr, HAS_GE: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``dz`` (gradient w.r.t. ``h Wᵀ + b``) for vocabulary columns
    ``[chunk_start, chunk_start + chunk_cols)``, stored as ``[n_rows, chunk_cols]``.

    Persistent: ``num_programs`` programs walk the tiles, the loop flattened so that the
    next tile's loads overlap this tile's ``dz`` math and store (faster than one program
    per tile; ``bench/bench_logprob.py --sweep`` times the bare kernels)."""
    n_cblocks = tl.cdiv(chunk_cols, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M) * n_cblocks, num_programs, flatten=True):
        pid_m, pid_n = grouped_tile_ids(tile, tl.cdiv(n_rows, BLOCK_M), n_cblocks, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < n_rows
        rows = tl.load(rows_ptr + offs_m, mask=m_ok, other=0)
        local_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n = chunk_start + local_n
        n_ok = (local_n < chunk_cols) & (offs_n < V)
        z = logits_tile(h_src, w_src, b_ptr, rows, pid_m * BLOCK_M, chunk_start + pid_n * BLOCK_N, V, H,
                         stride_h, stride_w, inv_temp, HAS_BIAS, IEEE, EVEN_K, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
        lse = tl.load(lse_ptr + offs_m, mask=m_ok, other=0.0)
        g = tl.load(g_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
        log_p = z - lse[:, None]
        p = tl.exp(log_p)
        coef = g  # d logp / dz = onehot - p;  d entropy / dz = -p (log p + entropy)
        if HAS_GE:
            entropy = tl.load(entropy_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
            ge = tl.load(ge_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
            coef += ge * (tl.where(p > 0, log_p, 0.0) + entropy)  # masked (-inf) entries: p = 0, dz = 0
        tgt = tl.load(tgt_ptr + offs_m, mask=m_ok, other=-1)
        dz = tl.where(offs_n[None, :] == tgt[:, None], g, 0.0) - p * coef
        dz = dz * inv_temp
        out = dz_ptr + offs_m[:, None] * chunk_cols + local_n[None, :]
        tl.store(out, dz.to(dz_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def forward(
    hidden: Tensor, weight: Tensor, rows: Tensor, targets: Tensor,
    bias: Optional[Tensor], temperature: float, with_entropy: bool, all_rows: bool,
    config: Optional[LMHeadConfig] = None, exchange: Optional[Exchange] = None, total_vocab: Optional[int] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log-prob, entropy or empty, log-sum-exp), fp32 ``[n]``; inputs already validated,
    ``all_rows`` whether the rows are 0, 1, ..., T - 1. ``config`` replaces
    ``default_config`` (tile sweeps). A vocabulary shard (``_vocab_parallel``) passes
    ``exchange`` (called once per chunk of rows, between the tiles and the combine; targets
    off the shard are -1) and ``total_vocab``, the group's vocabulary: every rank then cuts
    the same chunks, and the results are the whole vocabulary's."""
    n, V = rows.numel(), weight.shape[0]
    dev = hidden.device
    logp = torch.empty(n, dtype=torch.float32, device=dev)
    entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return logp, entropy, lse
    cfg = config or default_config(weight.dtype, dev, rows=n)
    cols = partial_columns(cfg)
    ops = Operands(hidden, weight, rows, cfg, all_rows)
    n_parts = triton.cdiv(V, cols)
    k = 3 if with_entropy else 2
    per_row = triton.cdiv(total_vocab or V, cols) * 4 * k * (2 if exchange is not None else 1)
    step = min(n, equal_chunks(n, cfg.partials_budget // per_row, cfg.block_m))
    parts = torch.empty((k, n_parts * step), dtype=torch.float32, device=dev)
    tgt_logit = torch.empty(step, dtype=torch.float32, device=dev)
    for s in range(0, n, step):
        forward_chunk(ops, bias, targets, temperature, s, min(step, n - s), parts, tgt_logit, logp, entropy, lse,
                      with_entropy, exchange)
    return logp, entropy, lse


def dz_chunk_columns(n: int, V: int, dtype: torch.dtype, cfg: LMHeadConfig) -> int:
    """Vocabulary columns per backward chunk: as many as ``cfg.dz_budget`` allows, whole tiles."""
    block_n = cfg.block_n
    cols = cfg.dz_budget // max(n * torch.finfo(dtype).bits // 8, 1) // block_n * block_n
    return max(block_n, min(cols, triton.cdiv(V, block_n) * block_n))


def backward(
    grad_logp: Tensor, grad_entropy: Optional[Tensor], hidden: Tensor, weight: Tensor,
    rows: Tensor, targets: Tensor, bias: Optional[Tensor], lse: Tensor, entropy: Tensor, all_rows: bool,
    temperature: float, need_hidden: bool, need_weight: bool, need_bias: bool,
    config: Optional[LMHeadConfig] = None, rows_dtype: torch.dtype = torch.float32,
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(d hidden[rows] [n, H] in rows_dtype, d weight [V, H], d bias fp32 [V])``, each None
    when not needed. ``hidden`` is the full ``[T, H]``; ``rows`` index it (``all_rows`` as in
    ``forward``); ``entropy`` (the forward's) is read only with ``grad_entropy``.

    The rows go in passes over the vocabulary. Each pass accumulates its rows' d hidden over
    the vocabulary chunks in fp32 and rounds them once to ``rows_dtype``; a 16-bit
    ``rows_dtype`` takes as many rows per pass as ``cfg.hidden_budget`` bytes of fp32 rows
    hold, so that memory does not grow with the rows; an fp32 ``rows_dtype`` (a vocabulary
    shard's, summed over the group) is one pass. d weight and d bias add the passes' products
    (d weight in its dtype)."""
    n, (V, H) = rows.numel(), weight.shape
    dev = hidden.device
    cfg = config or default_config(weight.dtype, dev)
    ops = Operands(hidden, weight, rows, cfg, all_rows, need_sel=need_weight)
    step = equal_chunks(n, cfg.hidden_budget // (4 * H), cfg.block_m) if rows_dtype != torch.float32 else n
    passes = step < n and need_hidden  # else one pass: its fp32 rows are rounded after the loop
    # not zero-filled: each pass's first vocabulary chunk writes its rows (callers keep V = 0 shards out)
    d_rows = torch.empty((n, H), dtype=rows_dtype if passes else torch.float32, device=dev) if need_hidden else None
    d_pass = torch.empty((step, H), dtype=torch.float32, device=dev) if passes else None
    d_weight = torch.empty_like(weight) if need_weight else None
    d_bias = torch.empty(V, dtype=torch.float32, device=dev) if need_bias else None
    cols = dz_chunk_columns(step, V, weight.dtype, cfg)
    dz_buf = torch.empty(step * cols, dtype=weight.dtype, device=dev)
    has_ge = grad_entropy is not None
    for r0 in range(0, n, step):
        m = min(step, n - r0)
        h_src, w_src, rows_r = ops.args(r0, m)
        acc = d_pass[:m] if passes else d_rows[r0 : r0 + m] if need_hidden else None
        for c0 in range(0, V, cols):
            c = min(cols, V - c0)
            dz = dz_buf[: m * c].view(m, c)
            programs = persistent_programs(triton.cdiv(m, cfg.block_m) * triton.cdiv(c, cfg.block_n), dev)
            _dlogits_kernel[(programs,)](
                h_src, w_src, bias_arg(bias, weight), rows_r, targets[r0:], lse[r0:],
                entropy[r0:] if has_ge else lse, grad_logp[r0:], grad_entropy[r0:] if has_ge else grad_logp, dz,
                m, V, H, hidden.stride(0), weight.stride(0), 1.0 / temperature, c0, c, programs,
                HAS_BIAS=bias is not None, HAS_GE=has_ge, IEEE=ieee(weight),
                EVEN_K=H % cfg.block_k == 0, TMA=ops.tma,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
            if need_hidden:
                accumulate_mm(acc, dz, weight[c0 : c0 + c], add=c0 > 0)
            if need_weight:
                h_r, d_w = ops.h_sel[r0 : r0 + m], d_weight[c0 : c0 + c]
                if r0 == 0:
                    torch.mm(dz.T, h_r, out=d_w)
                else:
                    d_w.addmm_(dz.T, h_r)
            if need_bias:
                d_b = dz.sum(0, dtype=torch.float32)
                if r0 == 0:
                    d_bias[c0 : c0 + c] = d_b
                else:
                    d_bias[c0 : c0 + c] += d_b
        if passes:
            d_rows[r0 : r0 + m] = acc
    dz = dz_buf = None  # freed before one pass's rows are rounded: the loop's buffers stay the peak
    if need_hidden and not passes:
        d_rows = d_rows.to(rows_dtype)
    return d_rows, d_weight, d_bias
