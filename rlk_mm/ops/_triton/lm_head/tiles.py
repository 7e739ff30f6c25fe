"""The LM head's logits tiles, which never reach memory, and their per-segment partials.

``logits_tile``: one ``[BLOCK_M, BLOCK_N]`` tile of tempered logits, ``(h[rows] · Wᵀ + b) / T``,
in an fp32 accumulator (``mma``: the dot product at the precision ``operands.ieee`` picks);
``tile_logits``: a launch's tile of them, where every LM-head tiles kernel starts;
``store_partials``: a tile reduced at once to per-(row, segment) partials; and
``forward_tiles_kernel``: the forward's launch (partials, target logits, and for the fused loss
the tile itself, relative to its segments' maxima).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._common import grouped_tile_ids

__all__ = ["forward_tiles_kernel", "logits_tile", "mma", "store_partials", "tile_logits"]


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr):
    """``acc + a · bᵀ``; IEEE: fp32 products and sums (fp32 inputs, no TF32; and 16-bit
    inputs in Triton's interpreter, see ``_common.interpreted``)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b), acc)


@triton.jit
def logits_tile(
    h_src, w_src, b_ptr, rows, m0, n0, V, H, stride_h, stride_w, inv_temp,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """fp32 ``[BLOCK_M, BLOCK_N]`` tile of tempered logits, vocabulary columns from ``n0``.

    With ``TMA``, ``h_src``/``w_src`` are tensor descriptors of the selected rows (tile rows
    from ``m0``) and of W, read by the copy engine (out-of-range reads are zeros).
    Otherwise they are pointers: hidden rows ``rows`` are gathered, and out-of-range
    vocabulary columns are read from the last row of W; the caller discards them.
    """
    cols = tl.minimum(n0 + tl.arange(0, BLOCK_N), V - 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            a = h_src.load([m0, k * BLOCK_K])
            b = w_src.load([n0, k * BLOCK_K])
            acc = mma(a, b, acc, IEEE)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = h_src + rows[:, None] * stride_h + offs_k[None, :]
        b_ptrs = w_src + cols[:, None] * stride_w + offs_k[None, :]
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k[None, :] < H - k * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok, other=0.0)
                b = tl.load(b_ptrs, mask=k_ok, other=0.0)
            acc = mma(a, b, acc, IEEE)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    return acc * inv_temp


@triton.jit
def tile_logits(
    h_src, w_src, b_ptr, rows_ptr, n_rows, V, H, stride_h, stride_w, inv_temp, n_vblocks,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """This program's tile of a launch over (row block, vocabulary block) tiles in the grouped
    schedule: ``(pid_n, offs_m, m_ok, offs_n, n_ok, z)``, ``z`` the tile's tempered logits
    (``logits_tile``, the scored rows from ``rows_ptr``) with -inf past V. Every tiles kernel
    of the LM head starts here, so their logits are one computation."""
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), n_vblocks, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < n_rows
    rows = tl.load(rows_ptr + offs_m, mask=m_ok, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < V
    z = logits_tile(h_src, w_src, b_ptr, rows, pid_m * BLOCK_M, pid_n * BLOCK_N, V, H, stride_h, stride_w,
                     inv_temp, HAS_BIAS, IEEE, EVEN_K, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
    z = tl.where(n_ok[None, :], z, -float("inf"))
    return pid_n, offs_m, m_ok, offs_n, n_ok, z


@triton.jit
def store_partials(
    z, pid_n, offs_m, m_ok, n_rows, n_parts, part_max_ptr, part_sum_ptr, part_zsum_ptr,
    WITH_ENTROPY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEG: tl.constexpr,
):
    """Tile ``pid_n``'s partials per (row, ``SEG``-column segment): max, Σ exp(z - max) and with
    ``WITH_ENTROPY`` Σ exp(z - max)·(z - max), stored ``[n_parts, n_rows]`` (coalesced); each
    reduced from its own columns only (the tile viewed ``[BLOCK_M, BLOCK_N / SEG, SEG]``), so
    a segment's partial does not depend on where it sits in the tile. Returns ``z`` less its
    segment's row max ``[BLOCK_M, BLOCK_N]``. A segment whose logits are all -inf (masked by
    a bias of -inf, or past V) has max -inf and sums 0."""
    SEGS: tl.constexpr = BLOCK_N // SEG
    z3 = tl.reshape(z, (BLOCK_M, SEGS, SEG))
    z_max = tl.max(z3, 2)
    safe = tl.where(z_max == -float("inf"), 0.0, z_max)
    shifted = z3 - safe[:, :, None]
    e = tl.exp(shifted)
    segs = pid_n * SEGS + tl.arange(0, SEGS)
    part = segs[None, :] * n_rows + offs_m[:, None]
    ok = m_ok[:, None] & (segs < n_parts)[None, :]
    tl.store(part_max_ptr + part, z_max, mask=ok)
    tl.store(part_sum_ptr + part, tl.sum(e, 2), mask=ok)
    if WITH_ENTROPY:
        centered = tl.where(e > 0, shifted, 0.0)  # masked entries add 0, not 0 x -inf
        tl.store(part_zsum_ptr + part, tl.sum(e * centered, 2), mask=ok)
    return tl.reshape(shifted, (BLOCK_M, BLOCK_N))


@triton.jit
def forward_tiles_kernel(
    h_src, w_src, b_ptr, rows_ptr, tgt_ptr,
    part_max_ptr, part_sum_ptr, part_zsum_ptr, tgt_logit_ptr, z_ptr,
    n_rows, V, H, stride_h, stride_w, inv_temp, n_vblocks, n_parts,
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SEG: tl.constexpr,
    STORE_Z: tl.constexpr = False,
):
    """Each tile's per-(row, segment) partials (``store_partials``) and target logits; with
    ``STORE_Z`` also the tile's logits less their segment's row max, ``z_ptr [n_rows, V]`` in
    its dtype (the fused loss's chunk buffer: entries near the max, the ones with
    probability, keep the dtype's full precision)."""
    pid_n, offs_m, m_ok, offs_n, n_ok, z = tile_logits(
        h_src, w_src, b_ptr, rows_ptr, n_rows, V, H, stride_h, stride_w, inv_temp, n_vblocks,
        HAS_BIAS, IEEE, EVEN_K, TMA, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    shifted = store_partials(z, pid_n, offs_m, m_ok, n_rows, n_parts, part_max_ptr, part_sum_ptr, part_zsum_ptr,
                             WITH_ENTROPY, BLOCK_M, BLOCK_N, SEG)
    if STORE_Z:
        out = z_ptr + offs_m.to(tl.int64)[:, None] * V + offs_n[None, :]
        tl.store(out, shifted.to(z_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    tgt = tl.load(tgt_ptr + offs_m, mask=m_ok, other=-1)
    hit = offs_n[None, :] == tgt[:, None]
    mine = m_ok & (tgt >= pid_n * BLOCK_N) & (tgt < pid_n * BLOCK_N + BLOCK_N)
    tl.store(tgt_logit_ptr + offs_m, tl.sum(tl.where(hit, z, 0.0), axis=1), mask=mine)
