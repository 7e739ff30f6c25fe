"""Batch-invariant prefill: ``with batch_invariant():`` routes a transformers forward
through kernels whose results do not depend on batch size, padding, packing or position.

Inside the block:

* ``aten::mm``, ``addmm``, ``bmm``, ``baddbmm`` and patch-embedding ``convolution`` on
  the CPU and CUDA dispatch keys run a matmul whose tiles depend on the weight shape only
  (``_triton/matmul.py``; ``_reference/prefill.matmul`` on the torch backend). Autograd is
  untouched: backward matmuls also go through it.
* transformers' attention registry entries ``sdpa`` and ``eager`` (and their mask
  functions) run a segment attention (``_triton/attention.py``): the 4-D mask is turned
  into per-sequence segments (padding, packing and KV-cache offsets become segments), and
  key tiles start at each sequence's first key.
* Qwen2.5-VL's ``Qwen2_5_VLRMSNorm`` runs a one-row-per-program RMSNorm, and its vision
  attention runs the segment attention over ``cu_seqlens`` in one launch (the values
  equal transformers' per-window loop through the registry; it is only faster).
* Its text attention's q/k/v projections and its MLPs' gate/up projections, which share
  one input, run as one launch in no-grad calls where that is bitwise the same as one
  launch each (``shared_input_linears``): fewer launches for a launch-bound forward.

Everything is restored exactly when the block exits. The LM head is not here: score
tokens with ``selected_logprob`` (its reduction order is fixed by H, V and dtype).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref

import numpy as np
import torch

from . import _backend
from ._reference import prefill as _ref

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class _State:
    """Process-wide, like the dispatcher overrides it mirrors."""

    active = False
    backend: str | None = None


_STATE = _State()
_SEGMENT_CACHE: dict[int, tuple] = {}


def _triton_for(*tensors: torch.Tensor) -> bool:
    """Backend choice of the ops below: inside ``batch_invariant()`` the one resolved when
    the block was entered (its ``backend``, else ``RLK_MM_BACKEND``: no environment lookup
    per op in a launch-bound forward), outside it the env/device."""
    backend = _STATE.backend
    if backend is None:
        return _backend.use_triton(*tensors)
    if backend == "torch":
        return False
    on_cuda = any(t.is_cuda for t in tensors)
    if backend == "triton":
        if not on_cuda and not _backend.triton_interpreting():
            raise RuntimeError("batch_invariant(backend='triton') on CPU tensors needs TRITON_INTERPRET=1")
        return True
    return on_cuda  # "auto"


# --------------------------------------------------------------------------- matmul


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           *, alpha: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """Batch-invariant ``alpha * (a @ b) + beta * bias`` for 2-D or 3-D (batched) a and b."""
    if a.dim() != b.dim() or a.dim() not in (2, 3):
        raise ValueError(f"matmul: expected two 2-D or two 3-D tensors, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-2] or (a.dim() == 3 and a.shape[0] != b.shape[0]):
        raise ValueError(f"matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul: expected both operands of one dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"matmul: operands on {a.device} and {b.device}")
    if a.dtype not in _FLOATS or not _triton_for(a, b):
        return _ref.matmul(a, b, bias, alpha=alpha, beta=beta)
    from ._triton import matmul as tm

    a3, b3 = (a, b) if a.dim() == 3 else (a[None], b[None])
    bias3 = None
    if bias is not None and beta != 0:
        bias3 = bias if bias.dim() == 3 else bias.reshape((1,) * (3 - bias.dim()) + tuple(bias.shape))
    out = tm.bmm(a3, b3, bias3, alpha=alpha, beta=beta)
    return out if a.dim() == 3 else out[0]


def _aten_mm(a, b):
    return matmul(a, b)


def _aten_addmm(bias, a, b, *, beta=1, alpha=1):
    return matmul(a, b, bias, alpha=alpha, beta=beta)


def _aten_bmm(a, b):
    return matmul(a, b)


def _aten_baddbmm(bias, a, b, *, beta=1, alpha=1):
    return matmul(a, b, bias, alpha=alpha, beta=beta)


def _aten_convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A convolution whose kernel covers its whole input (a patch embedding) as a matmul."""
    kernel = tuple(weight.shape[2:])
    if (transposed or groups != 1 or any(padding) or any(d != 1 for d in dilation)
            or tuple(x.shape[2:]) != kernel):
        raise NotImplementedError(
            "batch_invariant() supports convolution only as a patch embedding (input spatial size == "
            f"kernel size {kernel}, no padding, groups=1); got input {tuple(x.shape)}, stride {list(stride)}, "
            f"padding {list(padding)}, groups {groups}"
        )
    out = matmul(x.reshape(x.shape[0], -1), weight.reshape(weight.shape[0], -1).t(), bias)
    return out.reshape(x.shape[0], weight.shape[0], *([1] * len(kernel)))


_ATEN_OVERRIDES = {
    "mm": _aten_mm,
    "addmm": _aten_addmm,
    "bmm": _aten_bmm,
    "baddbmm": _aten_baddbmm,
    "convolution": _aten_convolution,
}


# --------------------------------------------------------------------------- RMSNorm


def _through_op(*tensors: torch.Tensor) -> bool:
    """Whether a call needs the registered custom op (autograd or torch.compile). A no-grad
    eager call runs the same function directly: the op's dispatch costs tens of
    microseconds a call, which a launch-bound forward (a short prompt, one image) feels."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)



def _rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, use_triton: bool) -> torch.Tensor:
    if use_triton:
        from ._triton.rmsnorm import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps)
    return _ref.rms_norm(x, weight, eps)


_rms_norm_op = torch.library.custom_op("rlk_mm::bi_rms_norm", _rms_norm_impl, mutates_args=())


@_rms_norm_op.register_fake
def _(x, weight, eps, use_triton):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_backward(ctx, grad):
    """Closed-form gradient in fp32 (the rounding to the input dtype is passed straight through)."""
    x, weight = ctx.saved_tensors
    xf, g = x.float(), grad.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
    y = xf * r
    gy = g * weight.float()
    dx = r * (gy - y * (gy * y).mean(-1, keepdim=True))
    dw = (g * y).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype), None, None


_rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Batch-invariant RMSNorm with transformers' Qwen semantics (weight [H] over x's last dim)."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")
    if x.dtype not in _FLOATS or weight.dtype not in _FLOATS:
        raise ValueError(f"rms_norm: unsupported dtypes {x.dtype}, {weight.dtype}")
    op = _rms_norm_op if _through_op(x, weight) else _rms_norm_impl
    return op(x, weight, float(eps), _triton_for(x))


# --------------------------------------------------------------------------- attention


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_b: torch.Tensor,
                    seg_q0: torch.Tensor, seg_ql: torch.Tensor, seg_k0: torch.Tensor, seg_kl: torch.Tensor,
                    causal: bool, scale: float, max_q: int, use_triton: bool) -> torch.Tensor:
    segments = (seg_b, seg_q0, seg_ql, seg_k0, seg_kl)
    if use_triton:
        from ._triton.attention import segment_attention

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


def segments_from_cu_seqlens(cu_q: torch.Tensor, cu_k: torch.Tensor | None = None):
    """Segments (batch row 0) of packed sequences; returns (segments, max_q_len)."""
    return _cached(_segments_from_cu_seqlens, cu_q, cu_k)


def _segments_from_cu_seqlens(cu_q, cu_k):
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


def _cached(fn, tensor: torch.Tensor, *args):
    """``fn(tensor, *args)``, computed once per tensor inside batch_invariant(): every layer
    of a forward gets the same mask / cu_seqlens object, and this spares a host sync each."""
    if not _STATE.active:
        return fn(tensor, *args)
    key = (id(tensor), *(id(a) if torch.is_tensor(a) else a for a in args))
    check = (tensor._version, *(a._version if torch.is_tensor(a) else a for a in args))
    hit = _SEGMENT_CACHE.get(key)
    if hit is not None and hit[0]() is tensor and hit[1] == check:
        return hit[2]
    value = fn(tensor, *args)
    _SEGMENT_CACHE[key] = (weakref.ref(tensor), check, value)
    return value


def segment_attention(q, k, v, segments, *, causal: bool, scale: float, max_q: int) -> torch.Tensor:
    """Batch-invariant attention of q [B, Hq, Lq, D] over k, v [B, Hkv, Lk, D]; out [B, Lq, Hq, D]."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads is not a multiple of {k.shape[1]} key/value heads")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _FLOATS:
        raise ValueError(f"attention: unsupported dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}")
    op = _attention_op if _through_op(q, k, v) else _attention_impl
    return op(q, k, v, *segments, causal, float(scale), int(max_q), _triton_for(q))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, causal: bool = True, scale=None):
    """Attention over packed sequences: q [T, Hq, D], k/v [Tk, Hkv, D], cu_seqlens [B+1] -> [T, Hq, D]."""
    segments, max_q = segments_from_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = segment_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                            segments, causal=causal, scale=scale, max_q=max_q)
    return out[0]


def _attention_interface(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
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
        segments, max_q, causal = _cached(segments_from_mask, attention_mask, batch, q_len, k_len)
    return segment_attention(query, key, value, segments, causal=causal, scale=scale, max_q=max_q), None


def _full_bool_mask(*args, **kwargs):
    """transformers' sdpa mask, never skipped: the attention above reads padding and packing from it."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


# --------------------------------------------------------------------------- Qwen2.5-VL modules


def _rms_norm_forward(self, hidden_states):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _vision_attention_forward(self, hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
    """Qwen2.5-VL vision attention with one segment attention over all windows / images."""
    seq = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(seq, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    if position_embeddings is None:
        raise ValueError("batch_invariant(): Qwen2.5-VL vision attention needs position_embeddings (cos, sin)")
    rotate = sys.modules[type(self).__module__].apply_rotary_pos_emb_vision
    q, k = rotate(q, k, *position_embeddings)
    out = varlen_attention(q, k, v, cu_seqlens, causal=False, scale=self.scaling)
    return self.proj(out.reshape(seq, -1))


def _plain_linears(layers) -> bool:
    return all(type(l) is torch.nn.Linear and "forward" not in l.__dict__ for l in layers)


def shared_input_linears(x: torch.Tensor, layers) -> list[torch.Tensor]:
    """``[F.linear(x, l.weight, l.bias) for l in layers]`` for 2-3 ``nn.Linear`` of one
    input, as one launch where that is bitwise the same as running them one by one: a
    no-grad call on the Triton path, contiguous x, weights whose tiles agree
    (``_triton/matmul.linears``). A launch-bound forward (group scoring) saves launches."""
    def one_by_one():
        return [torch.nn.functional.linear(x, l.weight, l.bias) for l in layers]

    needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(l.weight.requires_grad for l in layers))
    if (needs_grad or torch.compiler.is_compiling() or not x.is_contiguous() or x.dim() < 2
            or x.dtype not in _FLOATS or not _triton_for(x)):
        return one_by_one()
    from ._triton import matmul as tm

    out = tm.linears(x.reshape(-1, x.shape[-1]), [l.weight for l in layers], [l.bias for l in layers])
    if out is None:
        return one_by_one()
    parts = out.split([l.weight.shape[0] for l in layers], dim=1)
    return [part.view(*x.shape[:-1], part.shape[1]) for part in parts]


def _shared_input_patch(original, names: tuple[str, ...], input_name: str):
    """``original`` (a module's forward) with its sub-layers ``names``, all applied to the
    forward's input, computed together by ``shared_input_linears``. The sub-layers are
    still called (hooks see their outputs); on that input they return what was computed."""

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs[input_name]
        layers = [getattr(self, n) for n in names]
        if not isinstance(x, torch.Tensor) or not _plain_linears(layers):
            return original(self, *args, **kwargs)
        outputs = shared_input_linears(x, layers)
        for layer, out in zip(layers, outputs):
            layer.forward = lambda inp, _layer=layer, _out=out: _out if inp is x else type(_layer).forward(_layer, inp)
        try:
            return original(self, *args, **kwargs)
        finally:
            for layer in layers:
                del layer.forward

    return forward


def _module_patches() -> list[tuple[type, str, object]]:
    try:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m
    except ImportError:
        return []
    shared_inputs = [("Qwen2_5_VLAttention", ("q_proj", "k_proj", "v_proj"), "hidden_states"),
                     ("Qwen2MLP", ("gate_proj", "up_proj"), "x"), ("Qwen2_5_VLMLP", ("gate_proj", "up_proj"), "hidden_state")]
    return [(m.Qwen2_5_VLRMSNorm, "forward", _rms_norm_forward),
            (m.Qwen2_5_VLVisionAttention, "forward", _vision_attention_forward)] + [
        (getattr(m, cls), "forward", _shared_input_patch(getattr(m, cls).forward, names, arg))
        for cls, names, arg in shared_inputs if hasattr(m, cls)]


def _registries():
    try:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return []
    return [(AttentionInterface, _attention_interface), (AttentionMaskInterface, _full_bool_mask)]


_MISSING = object()


@contextlib.contextmanager
def batch_invariant(backend: str | None = None):
    """Route matmuls, attention and RMSNorm through batch-invariant kernels inside the block.

    ``backend``: None (Triton on CUDA, torch on CPU; ``RLK_MM_BACKEND`` forces one),
    ``"triton"`` or ``"torch"``. Not re-entrant; restores every override on exit.
    """
    if backend not in (None, "torch", "triton"):
        raise ValueError(f"batch_invariant: backend must be None, 'torch' or 'triton', got {backend!r}")
    if _STATE.active:
        raise RuntimeError("batch_invariant() is already active in this thread (it is not re-entrant)")
    lib = torch.library.Library("aten", "IMPL")
    saved: list[tuple[object, str, object]] = []
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
            warnings.filterwarnings("ignore", message=".*Warning only once for all operators.*")
            for op, fn in _ATEN_OVERRIDES.items():
                for key in ("CPU", "CUDA"):
                    lib.impl(op, fn, key)
        for registry, fn in _registries():
            mapping = registry._global_mapping
            for name in ("sdpa", "eager"):
                saved.append((mapping, name, mapping.get(name, _MISSING)))
                mapping[name] = fn
        for cls, attr, fn in _module_patches():
            saved.append((cls, attr, cls.__dict__.get(attr, _MISSING)))
            setattr(cls, attr, fn)
        _STATE.active, _STATE.backend = True, backend or _backend.backend_name()
        yield
    finally:
        _STATE.active, _STATE.backend = False, None
        _SEGMENT_CACHE.clear()
        for target, name, old in reversed(saved):
            if isinstance(target, dict):
                if old is _MISSING:
                    target.pop(name, None)
                else:
                    target[name] = old
            elif old is _MISSING:
                delattr(target, name)
            else:
                setattr(target, name, old)
        lib._destroy()


# --------------------------------------------------------------------------- running a model on an RLBatch

LAYOUTS = ("packed", "right", "left")


def layout_inputs(batch, layout: str, pad_token_id: int = 0) -> tuple[dict, torch.Tensor]:
    """A Qwen2.5-VL model's token inputs for ``batch`` in one layout, and each token's row.

    ``packed``: one row ``[1, T]`` with 4-row position ids (per-sample text positions first,
    which is how transformers recognises packed sequences); ``right`` / ``left``: ``[B, L]``
    padded with ``pad_token_id`` and an attention mask. ``rows`` (int64 [T]) is each packed
    token's row in the output flattened to ``[-1, H]``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    device = batch.input_ids.device
    lengths = batch.seq_lengths().to(device)
    starts = batch.cu_seqlens.long().to(device)[:-1]
    sample = torch.repeat_interleave(torch.arange(batch.num_samples, device=device), lengths)
    pos = torch.arange(batch.num_tokens, device=device) - starts[sample]
    if layout == "packed":
        position_ids = torch.cat([pos[None], batch.position_ids], 0)[:, None, :]
        inputs = dict(input_ids=batch.input_ids[None], position_ids=position_ids, attention_mask=None)
        return inputs, torch.arange(batch.num_tokens, device=device)
    width = int(lengths.max()) if batch.num_samples else 0
    shift = (width - lengths)[sample] if layout == "left" else 0
    rows = sample * width + pos + shift
    n = batch.num_samples * width
    ids = torch.full((n,), pad_token_id, dtype=torch.int64, device=device)
    ids[rows] = batch.input_ids
    mask = torch.zeros(n, dtype=torch.int64, device=device)
    mask[rows] = 1
    positions = torch.ones((3, n), dtype=torch.int64, device=device)
    positions[:, rows] = batch.position_ids
    shape = (batch.num_samples, width)
    return dict(input_ids=ids.view(shape), attention_mask=mask.view(shape), position_ids=positions.view(3, *shape)), rows


def media_inputs(batch) -> dict:
    """The vision-tower inputs a transformers Qwen-VL forward takes, from the batch."""
    names = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    return {name: getattr(batch, name) for name in names if getattr(batch, name) is not None}


def media_token_rows(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, item, index) int64 [n]: the packed row of every media placeholder token, its
    media item, and its index among that item's placeholders."""
    table = batch.modality_spans
    sample, pos, span = table.token_positions()
    item = table.media_index.long()[span]
    keep = item >= 0
    rows = batch.cu_seqlens.long()[sample[keep]] + pos[keep]
    return rows, item[keep], (pos - table.starts.long()[span])[keep]


def forward_hidden(model, batch, *, layout: str = "packed", media_embeds=None) -> torch.Tensor:
    """Last hidden states ``[T, H]`` (packed token order) of a transformers Qwen2.5-VL model.

    Without ``media_embeds`` the model's own forward runs the vision tower on the batch's
    pixels. With ``media_embeds`` (a ``VisionCache``'s output: every media item's vision
    rows, items in batch order, concatenated) the placeholders are filled from it and only
    the language model runs.
    """
    inputs, rows = layout_inputs(batch, layout, getattr(model.config.text_config, "pad_token_id", None) or 0)
    backbone = model.model
    if media_embeds is None:
        out = backbone(**inputs, **media_inputs(batch), use_cache=False)
    else:
        embeds = model.get_input_embeddings()(batch.input_ids)
        embeds = fill_media(embeds, batch, media_embeds)
        width = inputs["input_ids"].numel()
        padded = embeds.new_zeros((width, embeds.shape[-1])).index_put((rows,), embeds)
        out = backbone(inputs_embeds=padded.view(*inputs["input_ids"].shape, -1),
                       attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"], use_cache=False)
    hidden = out.last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])[rows]


def fill_media(embeds: torch.Tensor, batch, media_embeds: torch.Tensor) -> torch.Tensor:
    """Packed token embeddings with every media placeholder replaced by its vision row."""
    rows, item, index = media_token_rows(batch)
    counts = batch.media_token_counts().to(item.device)
    if media_embeds.shape[0] != int(counts.sum()):
        raise ValueError(f"media_embeds has {media_embeds.shape[0]} rows; the batch's media items need {int(counts.sum())}")
    src = (torch.cumsum(counts, 0) - counts)[item] + index
    return embeds.index_put((rows.to(embeds.device),), media_embeds[src.to(media_embeds.device)].to(embeds.dtype))


def batch_logprobs(model, batch, *, layout: str = "packed", media_embeds=None, temperature: float = 1.0) -> torch.Tensor:
    """Selected log-probs ``[n]`` of the batch's loss tokens: ``forward_hidden`` then the LM head
    through ``selected_logprob`` (never materialising logits)."""
    from .logprob import selected_logprob

    hidden = forward_hidden(model, batch, layout=layout, media_embeds=media_embeds)
    head = model.get_output_embeddings()
    return selected_logprob(hidden, head.weight, batch, temperature=temperature, bias=getattr(head, "bias", None))
