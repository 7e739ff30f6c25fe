"""Plain-torch batch-invariant kernels: the torch backend of ``batch_invariant()`` (CPU) and
the oracle of the Triton kernels' tests (which compare within tolerance: the two backends
sum in different orders), and the fast attention backward both backends share.

Batch-invariant by construction: a row's result is a function of that row (and, for
attention, its own sequence) alone.

* ``matmul``: every output row is its own ``[1, K] x [K, N]`` product, one entry of one
  batched BLAS call (``bmm``, the weight broadcast over the batch): the same call with the
  same shapes, strides and 64-byte alignment for every row (K and N zero-padded to
  multiples of 16 floats), whatever M is. So a row's result does not depend on M or on
  its neighbours, and it costs about what one ``mm`` costs (the entries run in C++, no
  Python loop over rows). Half-precision operands are multiplied in fp32.
* ``rms_norm`` and ``segment_attention``: sums run in an order spelled out here (a
  halving tree over a fixed width, ``tree_sum``); the attention runs all the segments of
  a bucket together, key tile by key tile from each segment's first key (a tile past a
  segment's keys is an exact no-op), so a query's output depends on its segment only.
* ``segment_attention_backward``: the gradient need not be batch-invariant (only the
  forward is pinned), so it runs torch's fused SDPA on the segments packed into a padded
  batch (a few size buckets), forward and backward; ``segment_attention_backward_reference``
  is the plain fp32 softmax per segment (double backward and tests).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "ALIGN", "ATTENTION_TILE", "matmul", "rms_norm", "segment_attention", "segment_attention_backward",
    "segment_attention_backward_reference", "tree_sum",
]

#: key-tile width of the reference attention (the online softmax runs tile by tile)
ATTENTION_TILE = 16
#: K and N of a float matmul are zero-padded to multiples of this (64-byte rows in fp32)
ALIGN = 16
#: products of one attention bucket step are chunked to about this many elements
_CHUNK_ELEMENTS = 1 << 23


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


def _aligned_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [M, K]`` as rows of ``width`` elements starting on 64-byte boundaries (a zero-padded
    copy unless it is already so)."""
    k = x.shape[-1]
    if (k == width and x.stride(-1) == 1 and (x.stride(0) * x.element_size()) % 64 == 0
            and x.data_ptr() % 64 == 0):
        return x
    out = x.new_zeros((x.shape[0], width))
    out[:, :k] = x
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           *, alpha: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """alpha * (a @ b) + beta * bias, a [..., M, K] and b [..., K, N] (same leading dims).

    Each output row is one entry of a batched ``[1, K] x [K, N]`` product (see the module
    docstring); products of 16-bit operands accumulate in fp32 and are rounded once. The
    BLAS calls are ``out=`` overloads, which ``batch_invariant()`` does not override.
    """
    acc_dtype = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype
    a3 = a.reshape(-1, *a.shape[-2:])
    b3 = b.reshape(-1, *b.shape[-2:])
    batch, m, k = a3.shape
    n = b3.shape[-1]
    floating = acc_dtype.is_floating_point
    kp = -(-k // ALIGN) * ALIGN if floating else k
    np_ = -(-n // ALIGN) * ALIGN if floating else n
    out = torch.empty((batch, m, 1, np_), dtype=acc_dtype, device=a.device)
    for i in range(batch):  # the leading dims of a bmm (one for every linear layer)
        rows = a3[i].to(acc_dtype)
        w = b3[i].to(acc_dtype)
        if floating:
            rows = _aligned_rows(rows, kp)
            if (kp, np_) != (k, n):
                w = torch.nn.functional.pad(w, (0, np_ - n, 0, kp - k))
        torch.bmm(rows[:, None, :], w.expand(m, kp, np_), out=out[i])
    out = out[:, :, 0, :n].reshape(*a.shape[:-1], n)
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


# --------------------------------------------------------------------------- attention: segments
def _host_rows(segments) -> list[np.ndarray]:
    if hasattr(segments, "rows"):
        return [np.asarray(r, dtype=np.int64) for r in segments.rows]
    return [np.asarray(t.tolist() if torch.is_tensor(t) else list(t), dtype=np.int64) for t in segments]


def _buckets(rows: list[np.ndarray]) -> list[np.ndarray]:
    """Live segments (queries > 0) grouped by the power of two above their key count (then
    their query count): padding within a bucket is under 2x, and there are few buckets."""
    _, _, ql, _, kl = rows
    live = np.nonzero(ql > 0)[0]
    if live.size == 0:
        return []
    key = (np.ceil(np.log2(np.maximum(kl[live], 1))).astype(np.int64) * 64
           + np.ceil(np.log2(np.maximum(ql[live], 1))).astype(np.int64))
    return [live[key == v] for v in np.unique(key)]


def _gather(x: torch.Tensor, b: np.ndarray, start: np.ndarray, length: np.ndarray, width: int):
    """Rows ``[start, start + length)`` of ``x [B, H, L, D]``'s batch rows ``b``, as
    ``[S, H, width, D]`` (zero past each length), and the validity mask ``[S, width]``."""
    dev = x.device
    pos = torch.arange(width, device=dev)
    length_t = torch.as_tensor(length, device=dev)
    valid = pos[None, :] < length_t[:, None]
    index = (torch.as_tensor(start, device=dev)[:, None] + pos[None, :]).clamp(max=x.shape[2] - 1)
    rows = x.permute(0, 2, 1, 3)[torch.as_tensor(b, device=dev)[:, None], index]  # [S, width, H, D]
    rows = rows.masked_fill(~valid[:, :, None, None], 0)
    return rows.permute(0, 2, 1, 3), valid


def segment_attention(q, k, v, segments, *, causal: bool, scale: float, out=None) -> torch.Tensor:
    """Same contract as ``_triton.attention.segment_attention`` (segments as host lists or tensors).

    Per segment, an online softmax over key tiles of ``ATTENTION_TILE`` keys starting at
    the segment's first key; dot products and tile sums by ``tree_sum``. The segments of a
    bucket run together (tiles past a segment's keys add exact zeros and leave its running
    max unchanged), in chunks of segments: neither changes a query's result.
    """
    bsz, hq, lq, d = q.shape
    if out is None:
        out = torch.zeros((bsz, lq, hq, d), dtype=q.dtype, device=q.device)
    group = hq // k.shape[1]
    rows = _host_rows(segments)
    for bucket in _buckets(rows):
        b, q0, ql, k0, kl = (r[bucket] for r in rows)
        width_q, tiles = int(ql.max()), -(-int(kl.max()) // ATTENTION_TILE)
        per_segment = hq * width_q * ATTENTION_TILE * d
        step = max(1, _CHUNK_ELEMENTS // max(per_segment, 1))
        for c in range(0, len(bucket), step):
            sl = slice(c, c + step)
            _attention_chunk(q, k, v, out, b[sl], q0[sl], ql[sl], k0[sl], kl[sl], width_q, tiles, group, causal, scale)
    return out


def _attention_chunk(q, k, v, out, b, q0, ql, k0, kl, width_q, tiles, group, causal, scale):
    dev = q.device
    width_k = tiles * ATTENTION_TILE
    qs, q_ok = _gather(q, b, q0, ql, width_q)
    ks, k_ok = _gather(k, b, k0, kl, width_k)
    vs, _ = _gather(v, b, k0, kl, width_k)
    qs = qs.float()
    ks, vs = (t.float().repeat_interleave(group, dim=1) for t in (ks, vs))  # [S, H, Lk, D]
    n_seg, hq = qs.shape[0], qs.shape[1]
    m = torch.full((n_seg, hq, width_q), float("-inf"), device=dev)
    l = torch.zeros((n_seg, hq, width_q), device=dev)
    acc = torch.zeros((n_seg, hq, width_q, qs.shape[-1]), device=dev)
    # causal: query i sees keys [0, kl - ql + i] (bottom-right aligned)
    limit = torch.arange(width_q, device=dev)[None, :] + torch.as_tensor(kl - ql, device=dev)[:, None]  # [S, Lq]
    for t in range(tiles):
        lo = t * ATTENTION_TILE
        kt = ks[:, :, lo : lo + ATTENTION_TILE]
        vt = vs[:, :, lo : lo + ATTENTION_TILE]
        s = tree_sum(qs[:, :, :, None, :] * kt[:, :, None, :, :]) * scale  # [S, H, q, n]
        pos = torch.arange(lo, lo + ATTENTION_TILE, device=dev)
        blocked = ~k_ok[:, None, lo : lo + ATTENTION_TILE]  # [S, 1, n]
        if causal:
            blocked = blocked | (pos[None, None, :] > limit[:, :, None])  # [S, q, n]
        s = s.masked_fill(blocked[:, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        l = l * alpha + tree_sum(p)
        p_r = p.to(q.dtype).float()  # the probabilities enter P @ V in the input dtype, as in the kernel
        pv = tree_sum(p_r[:, :, :, None, :] * vt.transpose(-1, -2)[:, :, None, :, :])  # [S, H, q, D]
        acc = acc * alpha[..., None] + pv
        m = m_new
    result = (acc / l[..., None]).to(q.dtype).permute(0, 2, 1, 3)  # [S, q, H, D]
    seg, row = torch.nonzero(q_ok, as_tuple=True)
    target_b = torch.as_tensor(b, device=dev)[seg]
    target_q = torch.as_tensor(q0, device=dev)[seg] + row
    out[target_b, target_q] = result[seg, row]


# --------------------------------------------------------------------------- attention backward
def segment_attention_backward(q, k, v, grad_out, segments, *, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of ``segment_attention``, by torch's fused SDPA (flash /
    memory-efficient on CUDA, its CPU kernel elsewhere) run forward and backward on the
    segments gathered into a right-padded ``[S, H, L, D]`` batch per size bucket. Causal
    segments with as many queries as keys take ``is_causal`` (right padding is invisible
    to a real query); the others an explicit mask (bottom-right causal for a KV-cache
    segment, key padding, and one key for each padding query, whose output gradient is 0).
    Within the numerical contract of an fp64 reference; not batch-invariant (it need not be)."""
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    rows = _host_rows(segments)
    gqa = q.shape[1] != k.shape[1]
    dev = q.device
    for bucket in _buckets(rows):
        b, q0, ql, k0, kl = (r[bucket] for r in rows)
        width_q, width_k = int(ql.max()), int(kl.max())
        qs, q_ok = _gather(q, b, q0, ql, width_q)
        ks, k_ok = _gather(k, b, k0, kl, width_k)
        vs, _ = _gather(v, b, k0, kl, width_k)
        g, _ = _gather(grad_out.permute(0, 2, 1, 3), b, q0, ql, width_q)
        mask, is_causal = None, False
        if causal and bool((ql == kl).all()):
            is_causal = True
        elif causal or not bool((kl == width_k).all()):
            allowed = k_ok[:, None, :].expand(len(bucket), width_q, width_k)
            if causal:
                limit = torch.arange(width_q, device=dev)[None, :] + torch.as_tensor(kl - ql, device=dev)[:, None]
                allowed = allowed & (torch.arange(width_k, device=dev)[None, None, :] <= limit[:, :, None])
            allowed = allowed | (~q_ok[:, :, None] & (torch.arange(width_k, device=dev) == 0)[None, None, :])
            mask = allowed[:, None]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (qs, ks, vs)]
            o = torch.nn.functional.scaled_dot_product_attention(
                *leaves, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
            gq, gk, gv = torch.autograd.grad(o, leaves, g.to(o.dtype))
        _scatter_add(dq, gq, b, q0, q_ok)
        _scatter_add(dk, gk, b, k0, k_ok)
        _scatter_add(dv, gv, b, k0, k_ok)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _scatter_add(dst: torch.Tensor, src: torch.Tensor, b: np.ndarray, start: np.ndarray, ok: torch.Tensor) -> None:
    """``dst [B, H, L, D]`` += the valid rows of ``src [S, H, width, D]`` at their positions."""
    dev = dst.device
    seg, row = torch.nonzero(ok, as_tuple=True)
    target_b = torch.as_tensor(b, device=dev)[seg]
    target = torch.as_tensor(start, device=dev)[seg] + row
    view = dst.permute(0, 2, 1, 3)  # [B, L, H, D], a view: index_put_ writes into dst
    view.index_put_((target_b, target), src.permute(0, 2, 1, 3)[seg, row].float(), accumulate=True)


def segment_attention_backward_reference(q, k, v, grad_out, segments, *, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of ``segment_attention`` by a plain fp32 softmax per segment
    (differentiable: the double-backward path, and an oracle for tests)."""
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    rows = _host_rows(segments)
    for b, q0, q_len, k0, k_len in zip(*(r.tolist() for r in rows)):
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
