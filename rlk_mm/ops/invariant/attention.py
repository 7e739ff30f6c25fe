"""Batch-invariant segment attention, and transformers' attention functions built on it.

A segment is one sequence's queries and keys (padding, packing and KV-cache offsets all
become segments); key tiles start at each sequence's first key, so a query's output does
not depend on its neighbours. ``attention_interface`` / ``full_bool_mask`` replace
transformers' ``sdpa``/``eager`` entries inside ``batch_invariant()``.
"""

from __future__ import annotations

import numpy as np
import torch

from ...schema.checks import INTEGER_DTYPES, KERNEL_FLOAT_DTYPES, bool_arg, float_arg, int_arg, tensor_arg
from .._torch import invariant as _ref
from ._dispatch import cached, through_op, triton_for

#: the largest head dim the invariant attention runs, on either backend (Qwen3.5's full-attention
#: layers use 256; the Triton kernel's tiles fit Hopper's shared memory up to it)
MAX_HEAD_DIM = 256

__all__: list[str] = []


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
    """The gradient need not be batch-invariant (only the forward is pinned): torch's fused
    SDPA on the segments packed into padded buckets (``_torch.invariant``). Under
    ``create_graph=True`` (grad mode on in the backward) the differentiable fp32 reference,
    so double backward works (slowly)."""
    q, k, v, *segments = ctx.saved_tensors
    grad_fn = _ref.segment_attention_backward_reference if torch.is_grad_enabled() else _ref.segment_attention_backward
    dq, dk, dv = grad_fn(q, k, v, grad, segments, causal=ctx.causal, scale=ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)


class _Segments(tuple):
    """The five int32 segment tensors (batch row, first query, queries, first key, keys), built
    here from host rows, which they keep (``rows``): their checks read nothing from the device,
    and run once per shape (``checked``)."""

    def __new__(cls, rows: list, device):
        host = [np.asarray(r, dtype=np.int64) for r in rows]
        self = super().__new__(cls, (torch.as_tensor(r.astype(np.int32), device=device) for r in host))
        self.rows, self.checked = host, set()
        return self


class DecodeSegments(tuple):
    """The segments of one decode step over a static KV cache: row ``b``'s one query attends
    keys ``[first_key[b], first_key[b] + keys[b])`` of the cache. ``keys`` is a device tensor
    the decode loop advances in place, so a captured CUDA graph reads each step's lengths
    without a host read. Built by the loop that sizes the cache (every range fits it), so the
    per-call host checks are skipped; given as the attention mask, ``attention_interface``
    runs the same segments, hence the same bits, as the mask of an eager decode would give.

    ``first_key`` and ``keys``: int32 ``[B]`` on one device; ``steps``: how many times the loop
    will advance ``keys`` by one; ``capacity``: the cache's length. Every row's last range is
    checked against it once, on the host, here."""

    def __new__(cls, first_key: torch.Tensor, keys: torch.Tensor, *, steps: int, capacity: int):
        for name, value in (("first_key", first_key), ("keys", keys)):
            tensor_arg(name, value, ndim=1, dtypes=(torch.int32,), device=first_key.device)
        if keys.shape != first_key.shape:
            raise ValueError(f"keys has {keys.numel()} entries but first_key has {first_key.numel()}: one per row")
        end = int((first_key.long() + keys.long()).max()) + steps if first_key.numel() else 0
        if end > capacity:
            raise ValueError(f"DecodeSegments: a row's keys reach column {end}, past the cache's {capacity} columns")
        rows = torch.arange(first_key.numel(), dtype=torch.int32, device=first_key.device)
        return super().__new__(cls, (rows, torch.zeros_like(rows), torch.ones_like(rows), first_key, keys))


def _segments_from_cu_seqlens(cu_q, cu_k, T: int, Tk: int):
    """Segments (batch row 0) of packed sequences of ``T`` queries and ``Tk`` keys; returns
    (segments, max_q_len). One host sync: the offsets are read to build the segments."""
    cq = cu_q.detach().to("cpu", torch.int64).numpy()
    ck = cq if cu_k is None else cu_k.detach().to("cpu", torch.int64).numpy()
    for name, c, rows, what in (("cu_seqlens_q", cq, T, "q"), ("cu_seqlens_k", ck, Tk, "k")):
        if c.shape != cq.shape:
            raise ValueError(f"{name} has {c.size} entries but cu_seqlens_q has {cq.size}: one offset per sequence boundary")
        if c.size == 0 or c[0] != 0:
            raise ValueError(f"{name} must start at 0, got {c[:1].tolist()}")
        lengths = np.diff(c)
        if (lengths < 0).any():
            raise ValueError(f"{name} decreases at sequence {int(np.argmax(lengths < 0))}; offsets are non-decreasing")
        if c[-1] != rows:
            hint = " (without cu_seqlens_k, k's sequences are q's: pass cu_seqlens_k)" if cu_k is None and what == "k" else ""
            raise ValueError(f"{name} ends at {int(c[-1])} but {what} has {rows} rows{hint}")
    ql, kl = np.diff(cq), np.diff(ck)
    rows = [np.zeros_like(ql), cq[:-1], ql, ck[:-1], kl]
    return _Segments(rows, cu_q.device), int(ql.max(initial=0))


def _segment_form(segments, device) -> None:
    """``segments`` as ``segment_attention`` takes them: five 1-D int32 tensors of one length on ``device``."""
    if isinstance(segments, torch.Tensor) or not isinstance(segments, (list, tuple)) or len(segments) != 5:
        got = f"{len(segments)} items" if isinstance(segments, (list, tuple)) else type(segments).__name__
        raise ValueError(f"segments must be 5 tensors (batch row, first query, queries, first key, keys; one entry per "
                         f"segment), got {got}")
    for i, t in enumerate(segments):
        tensor_arg(f"segments[{i}]", t, ndim=1, dtypes=(torch.int32,), device=device)
        if t.shape != segments[0].shape:
            raise ValueError(f"segments[{i}] has {t.numel()} entries but segments[0] has {segments[0].numel()}")


def _check_segments(rows: list[np.ndarray], B: int, Lq: int, Lk: int, causal: bool, max_q: int) -> None:
    """Every segment inside q and k, covered by ``max_q``, with keys for every query (at least
    as many as queries when causal), and no two segments writing one query row."""
    b, q0, ql, k0, kl = rows

    def first(bad: np.ndarray):
        return int(np.nonzero(bad)[0][0]) if bad.any() else None

    checks = [
        ((b < 0) | (q0 < 0) | (ql < 0) | (k0 < 0) | (kl < 0),
         lambda i: f"segment {i}: a negative entry {[int(r[i]) for r in rows]} (batch row, first query, queries, first key, keys)"),
        (b >= B, lambda i: f"segment {i}: batch row {b[i]} is outside q's batch of B = {B}"),
        (q0 + ql > Lq, lambda i: f"segment {i}: queries [{q0[i]}, {q0[i] + ql[i]}) reach past q's Lq = {Lq}"),
        (k0 + kl > Lk, lambda i: f"segment {i}: keys [{k0[i]}, {k0[i] + kl[i]}) reach past k's Lk = {Lk}"),
        (ql > max_q, lambda i: f"max_q={max_q} is less than segment {i}'s {ql[i]} queries (rows past max_q would stay unwritten)"),
        ((kl < ql) if causal else ((ql > 0) & (kl == 0)),
         lambda i: f"segment {i}: {ql[i]} {'causal ' if causal else ''}queries over {kl[i]} keys: "
                   + ("a causal segment's queries are its last keys (bottom-right aligned), so it needs at least as many keys"
                      if causal else "every query needs a key")),
    ]
    for bad, message in checks:
        i = first(bad)
        if i is not None:
            raise ValueError(f"segment_attention: {message(i)}")
    live = np.nonzero(ql > 0)[0]
    order = live[np.lexsort((q0[live], b[live]))]
    clash = first((b[order][1:] == b[order][:-1]) & (q0[order][1:] < (q0 + ql)[order][:-1]))
    if clash is not None:
        i, j = sorted((int(order[clash]), int(order[clash + 1])))
        raise ValueError(f"segment_attention: segments {i} and {j} overlap: both write queries of batch row {b[i]} "
                         f"([{q0[i]}, {q0[i] + ql[i]}) and [{q0[j]}, {q0[j] + ql[j]}))")


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
    return _Segments(seg_rows, mask.device), max_q, causal


def _check_head_dim(head_dim: int) -> None:
    """The head dims both backends run (one semantics): 1 to ``MAX_HEAD_DIM``; checked before any work."""
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"batch_invariant(): attention head_dim {head_dim} is above the largest the invariant attention "
                         f"runs, {MAX_HEAD_DIM} (head dims 1 to {MAX_HEAD_DIM} are supported): a model with wider heads (its "
                         "config's head_dim, else hidden_size / num_attention_heads) cannot run under batch_invariant(); "
                         "leave the mode off for it, or give it more, narrower heads")
    if head_dim < 1:
        raise ValueError(f"batch_invariant(): attention head_dim {head_dim}: q, k and v have no features (head dims 1 to "
                         f"{MAX_HEAD_DIM} are supported)")


def segment_attention(q, k, v, segments, *, causal: bool, scale: float, max_q: int) -> torch.Tensor:
    """Batch-invariant attention of q [B, Hq, Lq, D] over k, v [B, Hkv, Lk, D]; out [B, Lq, Hq, D].

    ``segments``: five 1-D int32 tensors on q's device, one entry per segment: batch row,
    first query, queries, first key, keys. A causal segment's queries are its last keys
    (bottom-right aligned); query rows in no segment are zero; ``max_q`` >= every segment's
    queries; ``scale`` > 0. Everything is checked before the kernel: the segments' values
    with one host sync, none for segments this module built (``varlen_attention``, the
    transformers attention); under ``torch.compile`` the values (data) are not checked.
    NaN and inf in q, k, v propagate within their segment.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        tensor_arg(name, t, device=q.device if name != "q" else None)
    if q.dim() != 4:
        raise ValueError(f"segment_attention: q must be [B, Hq, Lq, D], got shape {tuple(q.shape)}")
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"segment_attention: k and v must have one shape [B, Hkv, Lk, D], got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"segment_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must share B (dim 0) and D (dim 3)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"segment_attention: {q.shape[1]} query heads is not a multiple of {k.shape[1]} key/value heads")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"segment_attention: q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _check_head_dim(q.shape[3])
    tensor_arg("q", q, dtypes=KERNEL_FLOAT_DTYPES)
    causal, max_q = bool_arg("causal", causal), int_arg("max_q", max_q, min=0)
    scale = float_arg("scale", scale, min=0, min_open=True)
    ours = isinstance(segments, _Segments)
    trusted = isinstance(segments, DecodeSegments)  # checked where it was built (its lengths live on the device)
    if not (ours or trusted):
        _segment_form(segments, q.device)
    if not (trusted or torch.compiler.is_compiling()):
        shape = (q.shape[0], q.shape[2], k.shape[2], causal, max_q)
        if not (ours and shape in segments.checked):
            rows = segments.rows if ours else list(torch.stack(segments).cpu().numpy().astype(np.int64))  # the one host sync
            _check_segments(rows, *shape)
            if ours:
                segments.checked.add(shape)
    op = _attention_op if through_op(q, k, v) else _attention_impl
    return op(q, k, v, *segments, causal, scale, max_q, triton_for(q))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, causal: bool = True, scale=None):
    """Attention over packed sequences: q [T, Hq, D], k/v [Tk, Hkv, D] -> [T, Hq, D].

    ``cu_seqlens_q`` / ``cu_seqlens_k`` [B+1]: integer offsets from 0 to T / Tk, never
    decreasing (``cu_seqlens_k`` defaults to ``cu_seqlens_q``). They are read on the host to
    build the segments (one host sync; once per tensor inside ``batch_invariant()``)."""
    for name, t, layout in (("q", q, "[T, Hq, D]"), ("k", k, "[Tk, Hkv, D]"), ("v", v, "[Tk, Hkv, D]")):
        if tensor_arg(name, t).dim() != 3:
            raise ValueError(f"varlen_attention: {name} must be {layout}, got shape {tuple(t.shape)}")
    tensor_arg("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INTEGER_DTYPES)
    if cu_seqlens_k is not None:
        tensor_arg("cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=INTEGER_DTYPES)
    _check_head_dim(q.shape[-1])
    segments, max_q = cached(_segments_from_cu_seqlens, cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
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
    _check_head_dim(head_dim)
    k_len = key.shape[2]
    scale = head_dim ** -0.5 if scaling is None else scaling
    if isinstance(attention_mask, DecodeSegments):
        if q_len != 1:
            raise ValueError(f"batch_invariant(): DecodeSegments serve one query per row, got {q_len}")
        segments, max_q, causal = attention_mask, 1, True
    elif attention_mask is None:
        causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
        rows = [np.arange(batch), np.zeros(batch), np.full(batch, q_len), np.zeros(batch), np.full(batch, k_len)]
        segments, max_q = _Segments(rows, query.device), q_len
    else:
        segments, max_q, causal = cached(segments_from_mask, attention_mask, batch, q_len, k_len)
    return segment_attention(query, key, value, segments, causal=causal, scale=scale, max_q=max_q), None


def full_bool_mask(*args, **kwargs):
    """transformers' sdpa mask, never skipped: the attention above reads padding and packing from it."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)
