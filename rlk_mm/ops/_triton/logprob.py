"""Triton kernels of the selected log-prob: logits tiles that never reach memory.

Forward: one program per (row block, vocab block) tile computes the tile's logits
``z = (h[rows] · Wᵀ + b) / T`` in an fp32 accumulator and reduces it at once to a
per-row partial (max, Σ exp(z - max), Σ exp(z - max)·(z - max)); the program whose block holds a
row's target also writes that logit. A second kernel combines the partials of each row
over the vocabulary blocks in block order. Backward: the same tiles are recomputed and
turned into ``dz`` for one vocabulary chunk at a time (``[n, chunk]``, the only buffer of
that shape), which cuBLAS multiplies into ``d hidden`` (fp32 accumulator) and the chunk's
rows of ``d weight``.

Tiles are read by the copy engine (tensor descriptors; hidden rows gathered into one
copy first unless all rows are scored in order) or, where alignment does not allow it,
by pointers with the row gather inside the kernel.

Reduction order: tile sizes depend only on the dtype and the device (``config``), every
logit is one dot product over H in the same order, and the combine is each row's own
sequential sum over vocabulary blocks 0, 1, 2, ... (a cross-thread reduction there would
follow the layout Triton picks for a launch's row count), so a row's log-prob and entropy
are bitwise the same whatever else is in the batch and wherever the row stands. No float
atomics anywhere; gradients are deterministic (cuBLAS, fixed chunk order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import grouped_tile_ids, interpreted, persistent_programs

Tensor = torch.Tensor


@dataclass(frozen=True)
class LogprobConfig:
    """Tiles, launch settings and workspace budgets of the selected-log-prob kernels.

    Tiles depend on the dtype and device only (never on the number of rows), so a row's
    reduction order is fixed. ``tma``: read tiles with the copy engine (tensor descriptors)
    where alignment allows. ``partials_budget``: bytes of per-(row, vocab block) partials
    one forward launch may hold. ``dz_budget``: bytes of the backward's ``dz`` chunk
    ``[n, chunk]`` (its size sets the vocabulary columns per chunk; bench/results/README.md
    says how it was chosen). ``linear_budget``: bytes of the fused loss's chunk logits
    ``[rows, V]`` (its rows per chunk). ``combine_block`` / ``combine_unroll``: rows per
    program and vocabulary blocks per unrolled step of the combine kernel."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    tma: bool = True
    partials_budget: int = 128 << 20
    dz_budget: int = 184 << 20
    linear_budget: int = 640 << 20
    combine_block: int = 128
    combine_unroll: int = 8


def default_config(dtype: torch.dtype, device: torch.device) -> LogprobConfig:
    """The tuned settings (``bench_logprob.py --sweep``): a function of dtype and device only."""
    if device.type != "cuda":  # Triton's interpreter (tests): small tiles, fast enough
        return LogprobConfig(16, 32, 16, 4, 1, 1, combine_block=16, combine_unroll=4)
    if dtype == torch.float32:  # exact fp32 dot products (no TF32): FMA path
        return LogprobConfig(64, 64, 32, 8, 4, 2)
    return LogprobConfig(128, 256, 64, 8, 8, 3)


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    """``acc + a · bᵀ``; IEEE: fp32 products and sums (fp32 inputs, no TF32; and 16-bit
    inputs in Triton's interpreter, see ``_common.interpreted``)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _logits_tile(
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
            acc = _mma(a, b, acc, IEEE)
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
            acc = _mma(a, b, acc, IEEE)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    return acc * inv_temp


@triton.jit
def _forward_tiles_kernel(
    h_src, w_src, b_ptr, rows_ptr, tgt_ptr,
    part_max_ptr, part_sum_ptr, part_zsum_ptr, tgt_logit_ptr, z_ptr,
    n_rows, V, H, stride_h, stride_w, inv_temp, n_vblocks,
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    STORE_Z: tl.constexpr = False,
):
    """Each tile's row partials (max, sum of exp, entropy sum) and target logits; with
    ``STORE_Z`` also the tile's logits less the tile's row max, ``z_ptr [n_rows, V]`` in its
    dtype (the fused loss's chunk buffer: entries near the max, the ones with probability,
    keep the dtype's full precision)."""
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), n_vblocks, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < n_rows
    rows = tl.load(rows_ptr + offs_m, mask=m_ok, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < V
    z = _logits_tile(h_src, w_src, b_ptr, rows, pid_m * BLOCK_M, pid_n * BLOCK_N, V, H, stride_h, stride_w,
                     inv_temp, HAS_BIAS, IEEE, EVEN_K, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
    z = tl.where(n_ok[None, :], z, -float("inf"))
    z_max = tl.max(z, axis=1)
    # a block whose logits are all -inf (a bias of -inf masks it) has max -inf and sums 0
    safe_max = tl.where(z_max == -float("inf"), 0.0, z_max)[:, None]
    e = tl.exp(z - safe_max)
    part = pid_n * n_rows + offs_m  # partials are [n_vblocks, n_rows]: coalesced stores
    tl.store(part_max_ptr + part, z_max, mask=m_ok)
    tl.store(part_sum_ptr + part, tl.sum(e, axis=1), mask=m_ok)
    if STORE_Z:
        out = z_ptr + offs_m.to(tl.int64)[:, None] * V + offs_n[None, :]
        tl.store(out, (z - safe_max).to(z_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    if WITH_ENTROPY:
        centered = tl.where(e > 0, z, safe_max) - safe_max  # masked entries add 0, not 0 x -inf
        tl.store(part_zsum_ptr + part, tl.sum(e * centered, axis=1), mask=m_ok)
    tgt = tl.load(tgt_ptr + offs_m, mask=m_ok, other=-1)
    hit = offs_n[None, :] == tgt[:, None]
    mine = m_ok & (tgt >= pid_n * BLOCK_N) & (tgt < pid_n * BLOCK_N + BLOCK_N)
    tl.store(tgt_logit_ptr + offs_m, tl.sum(tl.where(hit, z, 0.0), axis=1), mask=mine)


@triton.jit
def _combine_kernel(
    part_max_ptr, part_sum_ptr, part_zsum_ptr, tgt_logit_ptr,
    logp_ptr, entropy_ptr, lse_ptr, n_rows, n_vblocks,
    WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr, RAW_TARGET: tl.constexpr = False,
):
    """Per row: log-sum-exp, log-prob and entropy from the vocabulary blocks' partials
    (with ``RAW_TARGET``, the target logit in place of the log-prob: a vocabulary shard's part).

    Each row is one thread's sequential online sum over blocks 0, 1, 2, ... (no
    cross-thread reduction, whose tree would follow the layout Triton picks for this
    launch's row count): one pass, the running max rescaling the sums as it grows,
    unrolled so that several blocks' loads are in flight at once.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_rows
    top = tl.full((BLOCK,), -float("inf"), tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    zsum = tl.zeros((BLOCK,), tl.float32)  # Σ exp(z - top) (z - top): entropy without cancellation
    for j0 in range(0, n_vblocks, UNROLL):
        for u in tl.static_range(UNROLL):
            j_ok = ok & (offs * 0 + j0 + u < n_vblocks)
            at = (j0 + u) * n_rows + offs
            block_max = tl.load(part_max_ptr + at, mask=j_ok, other=-float("inf"))
            block_sum = tl.load(part_sum_ptr + at, mask=j_ok, other=0.0)
            new_top = tl.maximum(top, block_max)
            safe_top = tl.where(new_top == -float("inf"), 0.0, new_top)  # no row value seen yet
            old_shift = tl.where(total > 0, top - safe_top, 0.0)  # <= 0
            seen = j_ok & (block_max > -float("inf"))  # a block masked whole adds nothing
            block_shift = tl.where(seen, block_max - safe_top, 0.0)  # <= 0
            old_scale = tl.exp(old_shift)
            block_scale = tl.where(seen, tl.exp(block_shift), 0.0)
            if WITH_ENTROPY:
                block_zsum = tl.load(part_zsum_ptr + at, mask=j_ok, other=0.0)
                zsum = old_scale * (zsum + old_shift * total) + block_scale * (block_zsum + block_shift * block_sum)
            total = old_scale * total + block_scale * block_sum
            top = new_top
    top = tl.where(ok, top, 0.0)
    total = tl.where(ok, total, 1.0)
    log_total = tl.log(total)
    lse = top + log_total
    tl.store(lse_ptr + offs, lse, mask=ok)
    tgt_logit = tl.load(tgt_logit_ptr + offs, mask=ok, other=0.0)
    tl.store(logp_ptr + offs, tgt_logit if RAW_TARGET else tgt_logit - lse, mask=ok)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + offs, log_total - zsum / total, mask=ok)


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
    per tile: bench/results/README.md)."""
    n_cblocks = tl.cdiv(chunk_cols, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M) * n_cblocks, num_programs, flatten=True):
        pid_m, pid_n = grouped_tile_ids(tile, tl.cdiv(n_rows, BLOCK_M), n_cblocks, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < n_rows
        rows = tl.load(rows_ptr + offs_m, mask=m_ok, other=0)
        local_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n = chunk_start + local_n
        n_ok = (local_n < chunk_cols) & (offs_n < V)
        z = _logits_tile(h_src, w_src, b_ptr, rows, pid_m * BLOCK_M, chunk_start + pid_n * BLOCK_N, V, H,
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


def _ieee(weight: Tensor) -> bool:
    """fp32 dot products (see ``_mma``): fp32 inputs, and the interpreter's 16-bit dots."""
    return weight.dtype == torch.float32 or interpreted(weight)


def _bias_arg(bias: Optional[Tensor], weight: Tensor) -> Tensor:
    return weight if bias is None else bias  # any valid pointer when HAS_BIAS is off


def _tma_ok(cfg: LogprobConfig, *ts: Tensor) -> bool:
    """The copy engine needs 16-byte aligned bases and row strides."""
    return cfg.tma and all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in ts)


class _Operands:
    """How the kernels read hidden rows and W: tensor descriptors over the selected rows
    (a gathered copy unless ``all_rows``: every row is scored, in order) when the copy
    engine can read them, else pointers and the row index (gathered inside the kernel)."""

    def __init__(self, hidden: Tensor, weight: Tensor, rows: Tensor, cfg: LogprobConfig, all_rows: bool,
                 need_sel: bool = False):
        self.tma = _tma_ok(cfg, hidden, weight)
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


def forward(
    hidden: Tensor, weight: Tensor, rows: Tensor, targets: Tensor,
    bias: Optional[Tensor], temperature: float, with_entropy: bool, all_rows: bool,
    config: Optional[LogprobConfig] = None, raw_target: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log-prob, entropy or empty, log-sum-exp), fp32 ``[n]``; inputs already validated,
    ``all_rows`` whether the rows are 0, 1, ..., T - 1. ``config`` replaces
    ``default_config`` (tile sweeps). ``raw_target``: the target logit in place of the
    log-prob, 0 for a target outside ``[0, V)`` (a vocabulary shard, ``vocab_parallel``)."""
    n, (V, H) = rows.numel(), weight.shape
    dev = hidden.device
    logp = torch.empty(n, dtype=torch.float32, device=dev)
    entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return logp, entropy, lse
    cfg = config or default_config(weight.dtype, dev)
    ops = _Operands(hidden, weight, rows, cfg, all_rows)
    n_vblocks = triton.cdiv(V, cfg.block_n)
    per_row = n_vblocks * 4 * (3 if with_entropy else 2)
    step = min(n, max(cfg.block_m, cfg.partials_budget // per_row // cfg.block_m * cfg.block_m))
    part_max = torch.empty(n_vblocks * step, dtype=torch.float32, device=dev)
    part_sum = torch.empty_like(part_max)
    part_zsum = torch.empty_like(part_max) if with_entropy else part_max
    tgt_logit = torch.empty(step, dtype=torch.float32, device=dev)
    for s in range(0, n, step):
        m = min(step, n - s)
        if raw_target:  # only the program holding a row's target writes its logit
            tgt_logit.zero_()
        h_src, w_src, rows_s = ops.args(s, m)
        _forward_tiles_kernel[(triton.cdiv(m, cfg.block_m) * n_vblocks,)](
            h_src, w_src, _bias_arg(bias, weight), rows_s, targets[s:],
            part_max, part_sum, part_zsum, tgt_logit, part_max,
            m, V, H, hidden.stride(0), weight.stride(0), 1.0 / temperature, n_vblocks,
            HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy, IEEE=_ieee(weight),
            EVEN_K=H % cfg.block_k == 0, TMA=ops.tma,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        _combine_kernel[(triton.cdiv(m, cfg.combine_block),)](
            part_max, part_sum, part_zsum, tgt_logit,
            logp[s:], entropy[s:] if with_entropy else entropy, lse[s:], m, n_vblocks,
            WITH_ENTROPY=with_entropy, BLOCK=cfg.combine_block, UNROLL=cfg.combine_unroll, RAW_TARGET=raw_target,
        )
    return logp, entropy, lse


def dz_chunk_columns(n: int, V: int, dtype: torch.dtype, cfg: LogprobConfig) -> int:
    """Vocabulary columns per backward chunk: as many as ``cfg.dz_budget`` allows, whole tiles."""
    block_n = cfg.block_n
    cols = cfg.dz_budget // max(n * torch.finfo(dtype).bits // 8, 1) // block_n * block_n
    return max(block_n, min(cols, triton.cdiv(V, block_n) * block_n))


def backward(
    grad_logp: Tensor, grad_entropy: Optional[Tensor], hidden: Tensor, weight: Tensor,
    rows: Tensor, targets: Tensor, bias: Optional[Tensor], lse: Tensor, entropy: Tensor, all_rows: bool,
    temperature: float, need_hidden: bool, need_weight: bool, need_bias: bool,
    config: Optional[LogprobConfig] = None,
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(d hidden[rows] fp32 [n, H], d weight [V, H], d bias fp32 [V])``, each None when
    not needed. ``hidden`` is the full ``[T, H]``; ``rows`` index it (``all_rows`` as in
    ``forward``); ``entropy`` (the forward's) is read only with ``grad_entropy``."""
    n, (V, H) = rows.numel(), weight.shape
    dev = hidden.device
    cfg = config or default_config(weight.dtype, dev)
    ops = _Operands(hidden, weight, rows, cfg, all_rows, need_sel=need_weight)
    h_src, w_src, _ = ops.args(0, n)
    d_sel = torch.zeros((n, H), dtype=torch.float32, device=dev) if need_hidden else None
    d_weight = torch.empty_like(weight) if need_weight else None
    d_bias = torch.empty(V, dtype=torch.float32, device=dev) if need_bias else None
    cols = dz_chunk_columns(n, V, weight.dtype, cfg)
    dz_buf = torch.empty(n * cols, dtype=weight.dtype, device=dev)
    has_ge = grad_entropy is not None
    for c0 in range(0, V, cols):
        c = min(cols, V - c0)
        dz = dz_buf[: n * c].view(n, c)
        programs = persistent_programs(triton.cdiv(n, cfg.block_m) * triton.cdiv(c, cfg.block_n), dev)
        _dlogits_kernel[(programs,)](
            h_src, w_src, _bias_arg(bias, weight), rows, targets, lse,
            entropy if has_ge else lse, grad_logp, grad_entropy if has_ge else grad_logp, dz,
            n, V, H, hidden.stride(0), weight.stride(0), 1.0 / temperature, c0, c, programs,
            HAS_BIAS=bias is not None, HAS_GE=has_ge, IEEE=_ieee(weight),
            EVEN_K=H % cfg.block_k == 0, TMA=ops.tma,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        w_c = weight[c0 : c0 + c]
        if need_hidden:
            _accumulate_mm(d_sel, dz, w_c)
        if need_weight:
            torch.mm(dz.T, ops.h_sel, out=d_weight[c0 : c0 + c])
        if need_bias:
            d_bias[c0 : c0 + c] = dz.sum(0, dtype=torch.float32)
    return d_sel, d_weight, d_bias


def _accumulate_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with fp32 ``acc`` and fp32 accumulation for 16-bit ``a``, ``b``."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif acc.is_cuda:  # cuBLAS: 16-bit operands, fp32 C updated in place (beta = 1)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # Triton's interpreter (tests)
        acc.addmm_(a.float(), b.float())
