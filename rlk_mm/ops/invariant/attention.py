"""Batch-invariant segment attention, and transformers' attention functions built on it.

A segment is one sequence's queries and keys (padding, packing and KV-cache offsets all
become segments); key tiles start at each sequence's first key, so a query's output does
not depend on its neighbours. ``attention_interface`` / ``full_bool_mask`` replace
transformers' ``sdpa``/``eager`` entries inside ``batch_invariant()``.
"""

from __future__ import annotations

import numpy as np
import torch

from .._torch import invariant as _ref
from ._dispatch import FLOATS, cached, through_op, triton_for


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_b: torch.Tensor,
                    seg_q0: torch.Tensor, seg_ql: torch.Tensor, seg_k0: torch.Tensor, seg_kl: torch.Tensor,
                    causal: bool, scale: float, max_q: int, use_triton: bool) -> torch.Tensor:
    segments = (seg_b, seg_q0, seg_ql, seg_k0, seg_kl)
    if use_triton:
        from .._triton.attention import segment_attention

        return segment_attention(q, k, v, segments, causal=causal, scale=scale, max_q=max_q)
    return _ref.segment_attention(q, k, v, segments, causal=causal, scale=scale)


_attention_op = torch.library.custom_op("rlk_mm::bi_attention", _attention_impl, mutates_args=())


@_attention_op.register_fake
def _(q, k, v, seg_b, seg_q0, seg_ql, seg_k0, seg_kl, causal, scale, max_q, use_triton):
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], q.shape[3]))


def _attention_setup(ctx, inputs, output):
    q, k, v, *segments = inputs[:8]
    ctx.save_for_backward(q, k, v, *segments)
    ctx.causal, ctx.scale = inputs[8], inputs[9]


def _attention_backward(ctx, grad):
    """Gradient by recomputing each segment's softmax in fp32 (correct, not batch-invariant)."""
    q, k, v, *segments = ctx.saved_tensors
    dq, dk, dv = _ref.segment_attention_backward(q, k, v, grad, segments, causal=ctx.causal, scale=ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)


def _segments_tensors(rows: list[np.ndarray], device) -> tuple[torch.Tensor, ...]:
    return tuple(torch.as_tensor(np.asarray(r, dtype=np.int32), device=device) for r in rows)


def _segments_from_cu_seqlens(cu_q, cu_k):
    """Segments (batch row 0) of packed sequences; returns (segments, max_q_len)."""
    cq = cu_q.detach().to("cpu", torch.int64).numpy()
    ck = cq if cu_k is None else cu_k.detach().to("cpu", torch.int64).numpy()
    if cq.ndim != 1 or ck.shape != cq.shape or cq[0] != 0 or ck[0] != 0:
        raise ValueError("cu_seqlens: expected two 1-D tensors [B+1] of equal length starting at 0")
    ql, kl = np.diff(cq), np.diff(ck)
    if (ql < 0).any() or (kl < 0).any():
        raise ValueError(f"cu_seqlens: not non-decreasing (sequence {int(np.argmax((ql < 0) | (kl < 0)))})")
    rows = [np.zeros_like(ql), cq[:-1], ql, ck[:-1], kl]
    return _segments_tensors(rows, cu_q.device), int(ql.max(initial=0))


def segments_from_mask(mask: torch.Tensor, batch: int, q_len: int, k_len: int):
    """Segments from a 4-D attention mask [B or 1, 1, Lq, Lk] (bool: True attends; float: 0 attends).

    Every query row must attend one contiguous key range; a query is a real token when it
    attends its own key (column Lk - Lq + i); rows that do not (padding) get zero output.
    Consecutive real rows with one first key form a segment: causal when each row's last
    key is its own, non-causal when all rows end at one key. Returns (segments, max_q, causal).
    """
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != q_len or mask.shape[3] != k_len:
        raise ValueError(f"attention mask: expected [B, 1, {q_len}, {k_len}], got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        allowed = mask[:, 0]
    else:
        allowed = mask[:, 0] == 0
        if not bool((allowed | (mask[:, 0] <= torch.finfo(mask.dtype).min / 2)).all()):
            raise NotImplementedError("batch_invariant(): additive attention biases (other than 0 / -inf masks) are not supported")
    allowed = allowed.expand(batch, q_len, k_len)
    off = k_len - q_len
    if off < 0:
        raise ValueError(f"attention: more queries ({q_len}) than keys ({k_len})")
    rows = torch.arange(q_len, device=mask.device)
    own = allowed[:, rows, rows + off]
    count = allowed.sum(-1)
    lo = allowed.to(torch.int32).argmax(-1)
    hi = k_len - allowed.flip(-1).to(torch.int32).argmax(-1)
    own, count, lo, hi = (t.cpu().numpy().astype(np.int64) for t in (own, count, lo, hi))
    b_idx, q_idx = np.nonzero(own)
    lo, hi, count = lo[b_idx, q_idx], hi[b_idx, q_idx], count[b_idx, q_idx]
    bad = np.nonzero(count != hi - lo)[0]
    if bad.size:
        b, i = int(b_idx[bad[0]]), int(q_idx[bad[0]])
        raise NotImplementedError(f"batch_invariant(): attention mask row (batch {b}, query {i}) attends a non-contiguous key set")
    causal = bool((hi == q_idx + off + 1).all())
    start = np.ones(len(b_idx), dtype=bool)
    start[1:] = ((b_idx[1:] != b_idx[:-1]) | (q_idx[1:] != q_idx[:-1] + 1) | (lo[1:] != lo[:-1])
                 | (False if causal else (hi[1:] != hi[:-1])))
    first = np.nonzero(start)[0]
    last = np.append(first[1:], len(b_idx)) - 1
    if not causal:
        seg_of_row = np.cumsum(start) - 1
        if (hi != hi[first][seg_of_row]).any():
            raise NotImplementedError("batch_invariant(): attention mask is neither causal nor full within a sequence")
    seg_rows = [b_idx[first], q_idx[first], last - first + 1, lo[first], hi[last] - lo[first]]
    max_q = int(seg_rows[2].max(initial=0))
    return _segments_tensors(seg_rows, mask.device), max_q, causal


def segment_attention(q, k, v, segments, *, causal: bool, scale: float, max_q: int) -> torch.Tensor:
    """Batch-invariant attention of q [B, Hq, Lq, D] over k, v [B, Hkv, Lk, D]; out [B, Lq, Hq, D]."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads is not a multiple of {k.shape[1]} key/value heads")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in FLOATS:
        raise ValueError(f"attention: unsupported dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}")
    op = _attention_op if through_op(q, k, v) else _attention_impl
    return op(q, k, v, *segments, causal, float(scale), int(max_q), triton_for(q))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, causal: bool = True, scale=None):
    """Attention over packed sequences: q [T, Hq, D], k/v [Tk, Hkv, D], cu_seqlens [B+1] -> [T, Hq, D]."""
    segments, max_q = cached(_segments_from_cu_seqlens, cu_seqlens_q, cu_seqlens_k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = segment_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                            segments, causal=causal, scale=scale, max_q=max_q)
    return out[0]


def attention_interface(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         is_causal=None, **kwargs):
    """transformers attention-function signature: q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] -> ([B, Lq, Hq, D], None)."""
    if dropout:
        raise NotImplementedError("batch_invariant(): attention dropout is not supported (set attention_dropout=0)")
    for name in ("sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"batch_invariant(): attention with {name}={kwargs[name]} is not supported")
    batch, _, q_len, head_dim = query.shape
    k_len = key.shape[2]
    scale = head_dim ** -0.5 if scaling is None else scaling
    if attention_mask is None:
        causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
        rows = [np.arange(batch), np.zeros(batch), np.full(batch, q_len), np.zeros(batch), np.full(batch, k_len)]
        segments, max_q = _segments_tensors(rows, query.device), q_len
    else:
        segments, max_q, causal = cached(segments_from_mask, attention_mask, batch, q_len, k_len)
    return segment_attention(query, key, value, segments, causal=causal, scale=scale, max_q=max_q), None


def full_bool_mask(*args, **kwargs):
    """transformers' sdpa mask, never skipped: the attention above reads padding and packing from it."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)
