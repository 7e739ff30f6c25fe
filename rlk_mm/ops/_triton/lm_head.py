"""The LM-head tile code the Triton kernels share: logits tiles that never reach memory.

The selected log-prob (``logprob.py``), the fused policy loss (``linear_loss.py``) and
sampling from hidden states (``sample_hidden.py``) all form logits the same way, so a
token's log-prob is bitwise the same in each:

* ``LMHeadConfig`` / ``default_config``: every tile, launch setting and budget of the LM-head
  kernels (the selected log-prob's, the fused loss's and the sampler's tiles), a function of
  dtype and device (and for a decode batch of the rows, with the same per-row arithmetic);
* ``logits_tile``: one ``[BLOCK_M, BLOCK_N]`` tile of tempered logits, ``(h[rows] · Wᵀ + b) / T``
  in an fp32 accumulator (``mma``: the dot product at the precision ``ieee`` picks);
* ``forward_tiles_kernel`` / ``store_partials``: each tile reduced at once to per-(row,
  segment) partials (max, Σ exp(z - max), Σ exp(z - max)·(z - max)) and the target logit
  (optionally also storing the tile, relative to its segments' maxima);
* ``combine_kernel``: each row's partials folded over the segments: lanes of interleaved
  partials in vocabulary order, then the lanes in a fixed tree (elementwise steps only, no
  cross-thread reduction whose tree would follow the launch);
* ``Operands``: how kernels read hidden rows and W (tensor descriptors where alignment
  allows, else pointers with the row gather in the kernel); ``bias_arg``, ``accumulate_mm``.

Reduction order: the vocabulary is cut on one global grid, segments of ``VOCAB_ALIGN`` = 128
columns from column 0 (``partial_columns``: a tile narrower than a segment, fp32's 64 and the
interpreter's 32, makes partials of its own width, which divide the segment). A partial is
reduced from its own columns only (a 256-column tile as two 128-column halves), so it does
not depend on where its segment sits in a tile; every logit is one dot product over H in
the same order; the combine folds a row's partials in an order fixed by their global index
(lane ``j % LANES`` in order, then the lanes' tree).
So a row's log-prob, entropy and log-sum-exp are the same whatever else is in the batch,
wherever the row stands, and whichever ranks hold the vocabulary: a vocabulary shard that
starts on the grid computes exactly its segments' partials, and the group folds the
gathered partials in the same order (``_vocab_parallel``), bitwise the single device's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .._head_inputs import VOCAB_ALIGN
from ._common import grouped_tile_ids, interpreted

Tensor = torch.Tensor
#: a vocabulary shard's exchange (``_vocab_parallel``): (this shard's partials ``[k, n_parts, m]``
#: fp32, its target logits ``[m]`` (0 where the target is on another shard), the chunk's first
#: scored row, columns per partial) -> (every shard's partials ``[k, total parts, m]`` in
#: vocabulary order, each row's target logit ``[m]`` from the shard that holds it); collective
Exchange = Callable[[Tensor, Tensor, int, int], tuple[Tensor, Tensor]]

__all__ = [
    "Exchange", "LMHeadConfig", "Operands", "accumulate_mm", "bias_arg", "combine_kernel", "default_config",
    "forward_tiles_kernel", "ieee", "logits_tile", "mma", "partial_columns", "store_partials", "tma_ok", "VOCAB_ALIGN",
]


@dataclass(frozen=True)
class LMHeadConfig:
    """Tiles, launch settings and workspace budgets of the LM-head kernels: the selected
    log-prob (``logprob``), the fused policy loss (``linear_loss``) and sampling from hidden
    states (``sampling.hidden``, whose tiles must be the selected log-prob's).

    Tiles depend on the dtype and device (``block_m`` also on the rows, which leaves every
    row's arithmetic as it is), so a row's reduction order is fixed. ``tma``: read tiles with
    the copy engine (tensor descriptors) where alignment allows. ``partials_budget``: bytes of
    per-(row, segment) partials one forward launch may hold. ``dz_budget``: bytes of the
    backward's ``dz`` chunk ``[rows, chunk]``; its size sets the vocabulary columns per chunk
    (184 MiB: 5888 columns at 16,384 rows, a width at which cuBLAS's chunk products ran faster
    than at wider ones; ``bench/bench_logprob.py --sweep`` re-times budgets).
    ``linear_budget``: bytes of the fused loss's chunk workspace (a chunk's ``[rows, V]``
    logits, fp32 d hidden rows and partials: its rows per chunk). ``hidden_budget``: bytes of
    the backward's fp32 d hidden rows held at once (its rows per pass over the vocabulary, for
    16-bit hidden states). ``combine_block`` / ``combine_lanes``: rows per program and lanes
    (partials folded at once, a power of two) of the combine kernel. ``dz_block_m`` /
    ``dz_warps``: rows per program and warps of the fused loss's in-place ``dz`` pass, a
    memory-bound pass, so a small tile (no register spills). ``scale_block`` /
    ``scale_warps``: entries per program and warps of the fused loss's gradient scale."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    tma: bool = True
    partials_budget: int = 128 << 20
    dz_budget: int = 184 << 20
    linear_budget: int = 960 << 20
    hidden_budget: int = 256 << 20
    combine_block: int = 4
    combine_lanes: int = 128
    dz_block_m: int = 16
    dz_warps: int = 8
    scale_block: int = 8192
    scale_warps: int = 8


def default_config(dtype: torch.dtype, device: torch.device, rows: Optional[int] = None) -> LMHeadConfig:
    """The tuned settings (``bench_logprob.py --sweep``) for dtype and device. 16-bit tiles
    on CUDA take 64 rows instead of 128 when at most 64 are computed (``rows``: a decode
    batch): one read of W instead of half-empty tiles. Such a batch only streams W, so its
    tiles are 128 columns wide (twice the tiles: a partly filled last wave costs half as
    much), with one warpgroup and a deeper pipeline, and its combine takes a row per program
    (64 rows in blocks of 4 would leave most of the GPU idle). The arithmetic per row
    is the same in every case (each warpgroup's tensor-core product covers 64 rows and its
    columns one by one, a partial covers 128 columns in any tile, and the combine's order does
    not depend on its rows per program; ``test_logprob_gpu`` checks them bitwise), so the
    choice never changes a result."""
    if device.type != "cuda":  # Triton's interpreter (tests): small tiles, fast enough
        return LMHeadConfig(block_m=16, block_n=32, block_k=16, group_m=4, num_warps=1, num_stages=1,
                             combine_block=4, combine_lanes=4)
    if dtype == torch.float32:  # exact fp32 dot products (no TF32): FMA path
        return LMHeadConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=2)
    if rows is not None and rows <= 64:
        return LMHeadConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4,
                             combine_block=1)
    return LMHeadConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)


def partial_columns(cfg: LMHeadConfig) -> int:
    """Vocabulary columns per partial: a ``VOCAB_ALIGN`` segment, or a tile narrower than one
    (which divides it). Partial ``j`` covers columns ``[j·cols, (j + 1)·cols)`` of the shard."""
    cols = min(cfg.block_n, VOCAB_ALIGN)
    if cfg.block_n % cols or VOCAB_ALIGN % cols:
        raise ValueError(f"block_n={cfg.block_n} must be a multiple or a divisor of VOCAB_ALIGN={VOCAB_ALIGN}")
    return cols


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
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), n_vblocks, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < n_rows
    rows = tl.load(rows_ptr + offs_m, mask=m_ok, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < V
    z = logits_tile(h_src, w_src, b_ptr, rows, pid_m * BLOCK_M, pid_n * BLOCK_N, V, H, stride_h, stride_w,
                     inv_temp, HAS_BIAS, IEEE, EVEN_K, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
    z = tl.where(n_ok[None, :], z, -float("inf"))
    shifted = store_partials(z, pid_n, offs_m, m_ok, n_rows, n_parts, part_max_ptr, part_sum_ptr, part_zsum_ptr,
                             WITH_ENTROPY, BLOCK_M, BLOCK_N, SEG)
    if STORE_Z:
        out = z_ptr + offs_m.to(tl.int64)[:, None] * V + offs_n[None, :]
        tl.store(out, shifted.to(z_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    tgt = tl.load(tgt_ptr + offs_m, mask=m_ok, other=-1)
    hit = offs_n[None, :] == tgt[:, None]
    mine = m_ok & (tgt >= pid_n * BLOCK_N) & (tgt < pid_n * BLOCK_N + BLOCK_N)
    tl.store(tgt_logit_ptr + offs_m, tl.sum(tl.where(hit, z, 0.0), axis=1), mask=mine)


@triton.jit
def _fold(top, total, zsum, part_top, part_total, part_zsum, ok, WITH_ENTROPY: tl.constexpr):
    """The running (max, Σ exp(z - max), Σ exp(z - max)·(z - max)) with another such triple
    folded in: the max rescaling the sums as it grows (elementwise)."""
    new_top = tl.maximum(top, part_top)
    safe_top = tl.where(new_top == -float("inf"), 0.0, new_top)  # no row value seen yet
    old_shift = tl.where(total > 0, top - safe_top, 0.0)  # <= 0
    seen = ok & (part_top > -float("inf"))  # a segment masked whole adds nothing
    part_shift = tl.where(seen, part_top - safe_top, 0.0)  # <= 0
    old_scale = tl.exp(old_shift)
    part_scale = tl.where(seen, tl.exp(part_shift), 0.0)
    if WITH_ENTROPY:
        zsum = old_scale * (zsum + old_shift * total) + part_scale * (part_zsum + part_shift * part_total)
    total = old_scale * total + part_scale * part_total
    return new_top, total, zsum


@triton.jit
def combine_kernel(
    part_max_ptr, part_sum_ptr, part_zsum_ptr, tgt_logit_ptr,
    logp_ptr, entropy_ptr, lse_ptr, n_rows, n_parts,
    WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr, LANES: tl.constexpr,
):
    """Per row: log-sum-exp, log-prob and entropy from the partials ``[n_parts, n_rows]`` of
    the whole vocabulary (a shard's group passes the gathered partials of every shard).

    Partial ``j`` belongs to lane ``j % LANES``: each lane folds its partials in vocabulary
    order (``_fold``, all lanes and ``BLOCK`` rows at once, so ``LANES`` partials' loads are in
    flight per step), then the lanes fold pairwise in a fixed binary tree (lanes 2i and 2i + 1,
    then their pairs, ...). Every step is elementwise, so a row's arithmetic is this sequence
    whatever the launch's rows or the layout Triton picks: no cross-thread reduction tree.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_rows
    lanes = tl.arange(0, LANES)
    top = tl.full((BLOCK, LANES), -float("inf"), tl.float32)
    total = tl.zeros((BLOCK, LANES), tl.float32)
    zsum = tl.zeros((BLOCK, LANES), tl.float32)  # Σ exp(z - top) (z - top): entropy without cancellation
    for j0 in range(0, n_parts, LANES):
        j_ok = ok[:, None] & (j0 + lanes < n_parts)[None, :]
        at = (j0 + lanes)[None, :] * n_rows + offs[:, None]
        part_max = tl.load(part_max_ptr + at, mask=j_ok, other=-float("inf"))
        part_sum = tl.load(part_sum_ptr + at, mask=j_ok, other=0.0)
        part_zsum = part_sum
        if WITH_ENTROPY:
            part_zsum = tl.load(part_zsum_ptr + at, mask=j_ok, other=0.0)
        top, total, zsum = _fold(top, total, zsum, part_max, part_sum, part_zsum, j_ok, WITH_ENTROPY)
    for _ in tl.static_range(16):  # fold lane pairs until one lane is left (LANES <= 2^16)
        if top.shape[1] > 1:
            top_a, top_b = tl.split(tl.reshape(top, (BLOCK, top.shape[1] // 2, 2)))
            total_a, total_b = tl.split(tl.reshape(total, (BLOCK, total.shape[1] // 2, 2)))
            zsum_a, zsum_b = tl.split(tl.reshape(zsum, (BLOCK, zsum.shape[1] // 2, 2)))
            top, total, zsum = _fold(top_a, total_a, zsum_a, top_b, total_b, zsum_b, ok[:, None], WITH_ENTROPY)
    top = tl.where(ok, tl.reshape(top, (BLOCK,)), 0.0)
    total = tl.where(ok, tl.reshape(total, (BLOCK,)), 1.0)
    zsum = tl.reshape(zsum, (BLOCK,))
    log_total = tl.log(total)
    lse = top + log_total
    tl.store(lse_ptr + offs, lse, mask=ok)
    tgt_logit = tl.load(tgt_logit_ptr + offs, mask=ok, other=0.0)
    tl.store(logp_ptr + offs, tgt_logit - lse, mask=ok)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + offs, log_total - zsum / total, mask=ok)


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
