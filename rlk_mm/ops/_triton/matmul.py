"""Batch-invariant persistent matmul (+ bias) in Triton.

Why it is batch-invariant: the tile shape is chosen from N, K and the dtype alone (never
from M, the token count that changes with the batch), there is no split-K and no
atomics, and M is not a specialisation key of the kernel. So every output element is one
fixed sequence of K-tile dot products accumulated in fp32, whatever else is in the batch
and whichever row it sits in.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import TileConfig, dot_precision, grouped_tile_ids, interpreted, persistent_programs

__all__ = ["bmm", "default_config", "linears", "MatmulConfig"]


@dataclass(frozen=True)
class MatmulConfig(TileConfig):
    """Tiles and launch settings of the batch-invariant matmul (``TileConfig``'s fields)."""


@functools.lru_cache(maxsize=None)
def default_config(n: int, k: int, dtype: torch.dtype) -> MatmulConfig:
    """Tiles for a [*, K] x [K, N] product: a function of N, K and dtype only, never of M."""
    if dtype == torch.float32:
        bn = 64 if n > 32 else max(16, triton.next_power_of_2(n))
        return MatmulConfig(block_m=64, block_n=bn, block_k=32, group_m=8, num_warps=4, num_stages=3)
    bn = 256 if n >= 256 else max(16, triton.next_power_of_2(n))
    bk = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    return MatmulConfig(block_m=128, block_n=bn, block_k=bk, group_m=8, num_warps=8, num_stages=3)


@triton.jit
def _mm_tile(
    a_ptr, b_ptr, c_ptr, bias_ptr, pid_m, pid_n, M, N, K,
    s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_biasm, s_biasn, alpha, beta,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile: K tiles 0, 1, 2, ... accumulated in fp32, then alpha, bias."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * s_am
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_rows + kk[None, :] * s_ak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_cols + kk[:, None] * s_bk, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if UPCAST:  # Triton's CPU interpreter mis-handles bf16 dot operands
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    acc = acc * alpha
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rm.to(tl.int64)[:, None] * s_biasm + rn[None, :] * s_biasn, mask=out_mask, other=0.0)
        acc += beta * bias.to(tl.float32)
    c = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _mm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    s_ab, s_am, s_ak,
    s_bb, s_bk, s_bn,
    s_cb, s_cm, s_cn,
    s_biasb, s_biasm, s_biasn,
    alpha, beta, num_programs,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    start = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in range(start, num_m * num_n, num_programs):
        pid_m, pid_n = grouped_tile_ids(tile, num_m, num_n, GROUP_M)
        _mm_tile(a_ptr + batch * s_ab, b_ptr + batch * s_bb, c_ptr + batch * s_cb, bias_ptr + batch * s_biasb,
                 pid_m, pid_n, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_biasm, s_biasn, alpha, beta,
                 HAS_BIAS, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit(do_not_specialize=["M"])
def _linears_kernel(
    x_ptr, w0_ptr, w1_ptr, w2_ptr, bias0_ptr, bias1_ptr, bias2_ptr, c_ptr,
    M, N0, N1, N2, K, s_xm, s_cm, num_programs,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``x @ [W0; W1; W2]ᵀ (+ [b0; b1; b2])`` into one ``[M, N0 + N1 + N2]`` output, the
    weights read where they are (contiguous ``[Ni, K]``). Each weight has its own column
    tiles, computed exactly as ``_mm_kernel`` computes ``x @ Wiᵀ`` with the same tiles."""
    start = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    t0 = tl.cdiv(N0, BLOCK_N)
    t1 = tl.cdiv(N1, BLOCK_N)
    num_n = t0 + t1 + tl.cdiv(N2, BLOCK_N)
    for tile in range(start, num_m * num_n, num_programs):
        pid_m, pid_n = grouped_tile_ids(tile, num_m, num_n, GROUP_M)
        past0 = (pid_n >= t0).to(tl.int32)  # the tile is past weight 0's columns
        past1 = (pid_n >= t0 + t1).to(tl.int32)
        if pid_n < t0:
            w_ptr = w0_ptr
            bias_ptr = bias0_ptr
        elif pid_n < t0 + t1:
            w_ptr = w1_ptr
            bias_ptr = bias1_ptr
        else:
            w_ptr = w2_ptr
            bias_ptr = bias2_ptr
        n = N0 + past0 * (N1 - N0) + past1 * (N2 - N1)
        col0 = past0 * N0 + past1 * N1
        local_n = pid_n - past0 * t0 - past1 * t1
        _mm_tile(x_ptr, w_ptr, c_ptr + col0, bias_ptr, pid_m, local_n, M, n, K,
                 s_xm, 1, 1, K, s_cm, 1, 0, 1, 1.0, 1.0,
                 HAS_BIAS, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)


def _pad_k(a: torch.Tensor, b: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of a and b with K zero-padded to a multiple of the K tile.

    A row stride that is not a multiple of 16 bytes (Qwen2.5-VL's vision MLP has K = 3420)
    rules out wide loads (``bench/bench_prefill.py --tiles`` times the kernel). The padded tail holds the zeros
    the kernel's masked loads would have read, in the same K tiles, so the result is
    bitwise the same."""
    k = a.shape[2]
    pad = -(-k // bk) * bk - k
    a_pad = torch.nn.functional.pad(a, (0, pad))
    b_pad = torch.nn.functional.pad(b.transpose(1, 2), (0, pad))  # [Bt, N, Kp]: K contiguous, like a weight
    return a_pad, b_pad.transpose(1, 2)


def bmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
        *, alpha: float = 1.0, beta: float = 1.0, out: torch.Tensor | None = None,
        config: MatmulConfig | None = None) -> torch.Tensor:
    """alpha * (a @ b) + beta * bias for a [Bt, M, K], b [Bt, K, N], bias broadcastable to [Bt, M, N].

    Inputs are validated by the caller (``ops/invariant/matmul.py``); strides are used as
    given, no copies. ``config`` replaces ``default_config``'s tiles (tile benchmarks).
    """
    batch, m, k = a.shape
    n = b.shape[2]
    if out is None:
        out = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        out.zero_()
        if bias is not None and beta != 0:
            out += beta * bias.expand(batch, m, n).to(out.dtype)
        return out
    cfg = config or default_config(n, k, a.dtype)
    if (k * a.element_size()) % 16 and a.is_cuda:
        a, b = _pad_k(a, b, cfg.block_k)
    programs = persistent_programs(triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), a.device)
    has_bias = bias is not None and beta != 0
    bias_t = bias.expand(batch, m, n) if has_bias else out
    interp = interpreted(a)
    _mm_kernel[(programs, batch)](
        a, b, out, bias_t, m, n, k,
        *a.stride(), *b.stride(), *out.stride(), *bias_t.stride(),
        float(alpha), float(beta), programs,
        HAS_BIAS=has_bias, UPCAST=interp, PRECISION=dot_precision(a.dtype, interp),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def linears(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    """``x [M, K] @ [W0; W1; ...]ᵀ + [b0; b1; ...]`` as one launch, ``[M, ΣNi]``, bitwise
    the concatenation of ``bmm`` of x with each weight; None when that cannot hold (2 or 3
    contiguous weights of one dtype whose ``default_config`` agree, all or no biases,
    16-byte aligned rows), and the caller runs them one by one."""
    m, k = x.shape
    configs = {default_config(w.shape[0], k, x.dtype) for w in weights}
    has_bias = biases[0] is not None
    if (len(weights) not in (2, 3) or len(configs) != 1 or x.stride(1) != 1 or (k * x.element_size()) % 16
            or any(w.dtype != x.dtype or not w.is_contiguous() or w.shape[1] != k for w in weights)
            or any((b is not None) != has_bias or (b is not None and (b.dtype != x.dtype or not b.is_contiguous()))
                   for b in biases)):
        return None
    cfg = configs.pop()
    ns = [w.shape[0] for w in weights] + [0] * (3 - len(weights))
    ws = list(weights) + [weights[-1]] * (3 - len(weights))
    bs = (list(biases) + [biases[-1]] * (3 - len(biases))) if has_bias else [x] * 3
    out = torch.empty((m, sum(ns)), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    programs = persistent_programs(triton.cdiv(m, cfg.block_m) * sum(triton.cdiv(n, cfg.block_n) for n in ns), x.device)
    interp = interpreted(x)
    _linears_kernel[(programs,)](
        x, *ws, *bs, out, m, *ns, k, x.stride(0), out.stride(0), programs,
        HAS_BIAS=has_bias, UPCAST=interp, PRECISION=dot_precision(x.dtype, interp),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
