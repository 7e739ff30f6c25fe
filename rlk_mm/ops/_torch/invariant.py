"""Plain-torch prefill references that are batch-invariant by construction.

They never hand a library a matmul or reduction whose blocking could change with the
number of rows: sums run in an order spelled out here (a halving tree over a fixed width),
and a matmul is one fixed-shape matrix-vector product per row. So a row's result is a
function of that row (and, for attention, its own sequence) alone. They are the torch
backend of ``batch_invariant()`` and the oracle of the Triton kernels' tests (which
compare within tolerance: the two backends sum in different orders).
"""

from __future__ import annotations

import torch

__all__ = ["ATTENTION_TILE", "matmul", "rms_norm", "segment_attention", "segment_attention_backward", "tree_sum"]

#: key-tile width of the reference attention (the online softmax runs tile by tile)
ATTENTION_TILE = 16


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by a halving tree over a power-of-two width (zeros padded).

    The order depends only on the width of the last dim, never on the other dims.
    """
    width = x.shape[-1]
    if width == 0:
        return x.new_zeros(x.shape[:-1])
    size = 1 << (width - 1).bit_length()
    if size != width:
        x = torch.nn.functional.pad(x, (0, size - width))
    while size > 1:
        size //= 2
        x = x[..., :size] + x[..., size:]
    return x[..., 0]


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           *, alpha: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """alpha * (a @ b) + beta * bias, a [..., M, K] and b [..., K, N] (same leading dims).

    Each output row is its own matrix-vector product ``b^T x`` in fp32 on a fresh copy of
    the row: the same call with the same shapes, strides and alignment for every row,
    whatever M is, so a row's result is a function of that row alone. (A library matmul
    over all rows picks kernels by M: on CPU, M = 1 takes a different path.)
    """
    acc_dtype = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype
    a3 = a.reshape(-1, *a.shape[-2:])
    b3 = b.reshape(-1, *b.shape[-2:])
    out = torch.empty((a3.shape[0], a3.shape[1], b3.shape[-1]), dtype=acc_dtype, device=a.device)
    for i in range(a3.shape[0]):
        bt = b3[i].to(acc_dtype).t().contiguous()  # [N, K]
        for r in range(a3.shape[1]):
            out[i, r] = torch.mv(bt, a3[i, r].to(acc_dtype).clone())
    out = out.reshape(*a.shape[:-1], b.shape[-1])
    if alpha != 1.0:
        out = out * alpha
    if bias is not None and beta != 0:
        out = out + beta * bias.to(acc_dtype)
    return out.to(a.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen RMSNorm with the mean of squares taken by ``tree_sum``."""
    xf = x.float()
    var = tree_sum(xf * xf) / x.shape[-1]
    y = (xf * torch.rsqrt(var + eps)[..., None]).to(x.dtype)
    return weight * y


def segment_attention(q, k, v, segments, *, causal: bool, scale: float, out=None) -> torch.Tensor:
    """Same contract as ``_triton.attention.segment_attention`` (segments as host lists or tensors).

    Per segment, an online softmax over key tiles of ``ATTENTION_TILE`` keys starting at
    the segment's first key; dot products and tile sums by ``tree_sum``.
    """
    bsz, hq, lq, d = q.shape
    if out is None:
        out = torch.zeros((bsz, lq, hq, d), dtype=q.dtype, device=q.device)
    group = hq // k.shape[1]
    rows = [t.tolist() if torch.is_tensor(t) else list(t) for t in segments]
    for b, q0, q_len, k0, k_len in zip(*rows):
        if q_len == 0:
            continue
        qs = q[b, :, q0 : q0 + q_len].float()  # [H, q, D]
        ks = k[b, :, k0 : k0 + k_len].float().repeat_interleave(group, dim=0)
        vs = v[b, :, k0 : k0 + k_len].float().repeat_interleave(group, dim=0)
        m = torch.full((hq, q_len), float("-inf"), device=q.device)
        l = torch.zeros((hq, q_len), device=q.device)
        acc = torch.zeros((hq, q_len, d), device=q.device)
        limit = torch.arange(q_len, device=q.device) + (k_len - q_len)  # causal: last visible key
        for start in range(0, k_len, ATTENTION_TILE):
            kt = ks[:, start : start + ATTENTION_TILE]
            vt = vs[:, start : start + ATTENTION_TILE]
            s = tree_sum(qs[:, :, None, :] * kt[:, None, :, :]) * scale  # [H, q, n]
            if causal:
                pos = torch.arange(start, start + kt.shape[1], device=q.device)
                s = s.masked_fill(pos[None, None, :] > limit[None, :, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + tree_sum(p)
            p_r = p.to(q.dtype).float()  # the probabilities enter P @ V in the input dtype, as in the kernel
            pv = tree_sum(p_r[:, :, None, :] * vt.transpose(-1, -2)[:, None, :, :])  # [H, q, D]
            acc = acc * alpha[..., None] + pv
            m = m_new
        out[b, q0 : q0 + q_len] = (acc / l[..., None]).to(q.dtype).transpose(0, 1)
    return out


def segment_attention_backward(q, k, v, grad_out, segments, *, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of ``segment_attention`` by a plain fp32 softmax per segment."""
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    rows = [t.tolist() if torch.is_tensor(t) else list(t) for t in segments]
    for b, q0, q_len, k0, k_len in zip(*rows):
        if q_len == 0:
            continue
        qs = q[b, :, q0 : q0 + q_len].float()
        ks = k[b, :, k0 : k0 + k_len].float().repeat_interleave(group, dim=0)
        vs = v[b, :, k0 : k0 + k_len].float().repeat_interleave(group, dim=0)
        g = grad_out[b, q0 : q0 + q_len].float().transpose(0, 1)  # [H, q, D]
        s = (qs @ ks.transpose(-1, -2)) * scale
        if causal:
            limit = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
            s = s.masked_fill(torch.arange(k_len, device=q.device)[None, :] > limit, float("-inf"))
        p = torch.softmax(s, dim=-1)
        dp = g @ vs.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        dq[b, :, q0 : q0 + q_len] += ds @ ks
        dk[b, :, k0 : k0 + k_len] += (ds.transpose(-1, -2) @ qs).unflatten(0, (-1, group)).sum(1)
        dv[b, :, k0 : k0 + k_len] += (p.transpose(-1, -2) @ g).unflatten(0, (-1, group)).sum(1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
