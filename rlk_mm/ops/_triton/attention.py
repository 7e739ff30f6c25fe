"""Batch-invariant varlen attention (causal or not, GQA) over segments, in Triton.

A *segment* is one sequence's queries ``[q0, q0 + q_len)`` and keys ``[k0, k0 + k_len)``
inside batch row ``b`` of ``q [B, Hq, Lq, D]`` and ``k, v [B, Hkv, Lk, D]``. Packed
sequences (cu_seqlens), left/right padding and a KV-cached prefix are all segments.
Causal segments align bottom-right: query i sees keys ``[0, k_len - q_len + i]``.

Why it is batch-invariant: key tiles start at the segment's first key (never at an
absolute position of the pack), the tile sizes depend only on the head dim and dtype,
each query row keeps its own online-softmax state, and tiles past a row's causal limit
add exact zeros. So a query's output depends on its own sequence only, not on the
neighbours in the pack, the padding, or its position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import dot_precision, interpreted

__all__ = ["AttentionConfig", "SHARED_MEMORY_LIMIT", "default_config", "segment_attention", "shared_memory_bytes"]

#: shared memory one block may take on Hopper (H100 / H200): 227 KiB
SHARED_MEMORY_LIMIT = 232448

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionConfig:
    """Query/key tiles, head-dim block and launch settings of the segment attention."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int


def default_config(head_dim: int, dtype: torch.dtype) -> AttentionConfig:
    """Tiles: a function of the head dim and dtype only (16-bit: the fastest candidate at
    Qwen2.5-VL's text and vision shapes, ``bench_prefill.py --tiles``). In 16-bit, head dims above
    128 pipeline two key/value stages instead of three: 160 KiB of Hopper's 227 at head dim 256,
    where three take 224 KiB, too close to the limit (``shared_memory_bytes``). The stage count only
    schedules the loads: the dots and their order, hence the bits, are those of three stages."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        return AttentionConfig(block_m=32, block_n=32, block_d=block_d, num_warps=4, num_stages=2)
    return AttentionConfig(block_m=64, block_n=64, block_d=block_d, num_warps=4, num_stages=3 if block_d <= 128 else 2)


def shared_memory_bytes(config: AttentionConfig, dtype: torch.dtype) -> int:
    """Shared memory one block of the kernel takes, in bytes, with ``e`` = ``dtype``'s bytes::

        (num_stages * 2 * block_n + block_m) * block_d * e  +  (block_m * block_n * 4 if fp32)

    ``num_stages`` pipelined key and value tiles (``block_n x block_d`` each) and the query tile
    (``block_m x block_d``); fp32's dots run on FMA units (or TF32 tensor cores) and stage the
    probability tile ``p`` (``block_m x block_n`` fp32) through shared memory too, where 16-bit
    wgmma reads ``p`` from registers. An upper bound of what Triton (3.6, 3.9) allocates for sm_90
    at every head dim up to 512: exact for 16-bit inputs whose head dim is a multiple of 16 (the
    loads pipeline; 458,752 bytes is Triton's launch failure at head dim 512, bf16, 64 x 64 tiles,
    3 stages), less where the loads do not pipeline, and for fp32, where Triton keeps one
    key/value stage fewer (plus a few hundred bytes of reduction scratch)."""
    element = torch.finfo(dtype).bits // 8
    staged_p = config.block_m * config.block_n * 4 if dtype == torch.float32 else 0
    return (config.num_stages * 2 * config.block_n + config.block_m) * config.block_d * element + staged_p


@triton.jit(do_not_specialize=["max_q"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    seg_b_ptr, seg_q0_ptr, seg_ql_ptr, seg_k0_ptr, seg_kl_ptr,
    s_qb, s_qh, s_qm, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    s_vb, s_vh, s_vn, s_vd,
    s_ob, s_om, s_oh, s_od,
    qk_scale, group, D, max_q,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(seg_ql_ptr + seg)
    if pid_m * BLOCK_M < q_len:
        b = tl.load(seg_b_ptr + seg).to(tl.int64)
        q0 = tl.load(seg_q0_ptr + seg).to(tl.int64)
        k0 = tl.load(seg_k0_ptr + seg).to(tl.int64)
        k_len = tl.load(seg_kl_ptr + seg)
        kvh = (h // group).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q = tl.load(
            q_ptr + b * s_qb + h * s_qh + (q0 + offs_m)[:, None] * s_qm + offs_d[None, :] * s_qd,
            mask=(offs_m[:, None] < q_len) & d_ok[None, :], other=0.0,
        )
        if UPCAST:  # Triton's CPU interpreter mis-handles bf16 dot operands
            q = q.to(tl.float32)
        k_base = k_ptr + b * s_kb + kvh * s_kh + k0 * s_kn
        v_base = v_ptr + b * s_vb + kvh * s_vh + k0 * s_vn
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        diag = k_len - q_len  # causal: query i sees keys [0, diag + i]
        if CAUSAL:
            end = tl.minimum(k_len, diag + (pid_m + 1) * BLOCK_M)
        else:
            end = k_len
        for start_n in range(0, end, BLOCK_N):
            kn = start_n + offs_n
            k_ok = kn < k_len
            k = tl.load(k_base + kn[None, :] * s_kn + offs_d[:, None] * s_kd,
                        mask=k_ok[None, :] & d_ok[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
            ok = k_ok[None, :]
            if CAUSAL:
                ok = ok & (kn[None, :] <= diag + offs_m[:, None])
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + kn[:, None] * s_vn + offs_d[None, :] * s_vd,
                        mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                acc = acc * alpha[:, None] + tl.dot(p.to(v_ptr.dtype.element_ty).to(tl.float32), v.to(tl.float32),
                                                    input_precision=PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            o_ptr + b * s_ob + h * s_oh + (q0 + offs_m)[:, None] * s_om + offs_d[None, :] * s_od,
            out.to(o_ptr.dtype.element_ty),
            mask=(offs_m[:, None] < q_len) & d_ok[None, :],
        )


def segment_attention(q, k, v, segments, *, causal: bool, scale: float, max_q: int, out=None,
                      config: AttentionConfig | None = None) -> torch.Tensor:
    """Attention of q [B, Hq, Lq, D] over k, v [B, Hkv, Lk, D] within segments.

    ``segments`` is five int32 tensors (batch, q0, q_len, k0, k_len), on q's device.
    Returns ``out [B, Lq, Hq, D]`` (the layout transformers' attention functions return);
    query rows outside every segment are zero. Validation is the caller's
    (``ops/invariant/attention.py``). ``config`` replaces ``default_config`` (tile benchmarks).
    """
    bsz, hq, lq, d = q.shape
    if out is None:
        out = torch.zeros((bsz, lq, hq, d), dtype=q.dtype, device=q.device)
    seg_b, seg_q0, seg_ql, seg_k0, seg_kl = segments
    n_seg = seg_b.numel()
    if n_seg == 0 or max_q == 0 or out.numel() == 0:
        return out
    cfg = config or default_config(d, q.dtype)
    grid = (triton.cdiv(max_q, cfg.block_m), n_seg, hq)
    interp = interpreted(q)
    _attention_kernel[grid](
        q, k, v, out, seg_b, seg_q0, seg_ql, seg_k0, seg_kl,
        *q.stride(), *k.stride(), *v.stride(),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        float(scale) * _LOG2E, hq // k.shape[1], d, max_q,
        CAUSAL=causal, UPCAST=interp, PRECISION=dot_precision(q.dtype, interp),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
