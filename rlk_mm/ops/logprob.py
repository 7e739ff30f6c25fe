"""Span-masked selected log-prob: ``log_softmax((h·Wᵀ + bias) / T)[target]`` for scored
tokens only, never writing ``[n, V]`` logits (DESIGN.md, "Ops").

``selected_logprob`` resolves which hidden rows are scored (from an ``RLBatch``'s loss
spans, or from ``index``/``targets``) and calls the custom op ``rlk_mm::selected_logprob``
(Triton on CUDA, the chunked plain-torch backend elsewhere; both validate their inputs
before any work). Its autograd recomputes logits in the backward instead of storing them.
Eager calls run the op's own forward and backward through a ``torch.autograd.Function``,
skipping the custom-op dispatcher's per-call cost (bench/results/README.md);
``torch.compile`` traces the registered ops.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ._backend import use_triton
from ._torch import logprob as _ref

Tensor = torch.Tensor

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def selected_logprob(
    hidden: Tensor,
    weight: Tensor,
    batch=None,
    *,
    index: Optional[Tensor] = None,
    targets: Optional[Tensor] = None,
    temperature: float = 1.0,
    bias: Optional[Tensor] = None,
    return_entropy: bool = False,
):
    """fp32 log-probs ``[n]`` of the scored tokens (and their entropies with ``return_entropy``).

    ``hidden`` is ``[T, H]`` (packed) or ``[B, L, H]`` (right-padded); ``weight`` is the LM
    head ``[V, H]``, ``bias`` an optional ``[V]``. The logits are ``(h·Wᵀ + bias) / temperature``.
    Give either ``batch`` (an ``RLBatch``: rows and targets from its loss spans, target ``t``
    scored from the hidden state at ``t - 1``, in loss-span order) or ``index`` (rows of the
    flattened hidden states) with ``targets`` (token ids). Gradients flow to ``hidden`` (only
    the scored rows are non-zero), ``weight`` and ``bias``, from both outputs.
    """
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [T, H] or [B, L, H]; got shape {tuple(hidden.shape)}")
    if batch is not None:
        if index is not None or targets is not None:
            raise ValueError("give either batch or index/targets, not both")
        rows, tgts = _rows_from_batch(batch, hidden, weight)
    else:
        if index is None or targets is None:
            raise ValueError("without batch, both index (rows of hidden) and targets (token ids) are required")
        rows, tgts = _as_index("index", index), _as_index("targets", targets)
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    op = torch.ops.rlk_mm.selected_logprob if torch.compiler.is_compiling() else _EagerSelectedLogprob.apply
    logp, entropy, _, _ = op(hidden2d, weight, rows, tgts, bias, float(temperature), bool(return_entropy))
    return (logp, entropy) if return_entropy else logp


def _as_index(name: str, t: Tensor) -> Tensor:
    if not isinstance(t, Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must be an integer tensor; got {type(t).__name__} {getattr(t, 'dtype', '')}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D [n]; got shape {tuple(t.shape)}")
    return t.to(torch.int64).contiguous()


def _rows_from_batch(batch, hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(rows, targets) on hidden's device from the batch's loss spans, checked against shapes."""
    if hidden.dim() == 2:
        if hidden.shape[0] != batch.num_tokens:
            raise ValueError(
                f"hidden is packed [T={hidden.shape[0]}, H] but the batch has {batch.num_tokens} tokens"
            )
        rows, tgts = batch.loss_token_index()
    else:
        if hidden.shape[0] != batch.num_samples:
            raise ValueError(
                f"hidden is padded [B={hidden.shape[0]}, L, H] but the batch has {batch.num_samples} samples"
            )
        rows, tgts = batch.loss_token_index(padded_length=hidden.shape[1])
    bad = torch.nonzero((tgts < 0) | (tgts >= weight.shape[0])).flatten()
    if bad.numel():
        i = int(bad[0])
        sample, pos, _ = batch.loss_spans.token_positions()
        raise ValueError(
            f"batch input_ids: sample {int(sample[i])}, position {int(pos[i])} holds token "
            f"{int(tgts[i])}, outside the LM head's vocabulary of {weight.shape[0]}"
        )
    return rows.to(hidden.device), tgts.to(hidden.device)


# ------------------------------------------------------------------ checks (all backends)
def _check(hidden, weight, rows, targets, bias, temperature) -> None:
    """Shapes, dtypes, devices and temperature; raised before any kernel runs."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"hidden must be [T, H] and weight [V, H]; got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden is [T, {hidden.shape[1]}] but weight is [V, {weight.shape[1]}]")
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocabulary (V = 0)")
    if hidden.dtype not in _FLOAT_DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(
            f"hidden and weight must share one of float32/bfloat16/float16; got {hidden.dtype} and {weight.dtype}"
        )
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [V={weight.shape[0]}]; got shape {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias dtype {bias.dtype} differs from weight dtype {weight.dtype}")
    for name, t in (("index", rows), ("targets", targets)):
        if t.dtype != torch.int64 or t.dim() != 1:
            raise TypeError(f"{name} must be int64 [n]; got {t.dtype} {tuple(t.shape)}")
    if rows.shape != targets.shape:
        raise ValueError(f"index has {rows.numel()} rows but targets has {targets.numel()} entries")
    named = [("weight", weight), ("index", rows), ("targets", targets)] + ([("bias", bias)] if bias is not None else [])
    for name, t in named:
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if not (isinstance(temperature, float) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0; got {temperature}")


def _check_values(T: int, V: int, rows: Tensor, targets: Tensor) -> bool:
    """Every row in [0, T) and every target in [0, V) (the error names the first offender).
    Returns whether the rows are exactly 0, 1, ..., T - 1, read in the same host sync."""
    if rows.numel() == 0:
        return False
    stats = [*torch.aminmax(rows), *torch.aminmax(targets)]
    if rows.numel() == T:
        stats.append((rows == torch.arange(T, device=rows.device)).all().to(rows.dtype))
    lo_r, hi_r, lo_t, hi_t, *in_order = torch.stack(stats).tolist()  # the one sync
    for name, t, lo, hi, limit, what in (
        ("index", rows, lo_r, hi_r, T, "rows of hidden"),
        ("targets", targets, lo_t, hi_t, V, "vocabulary entries"),
    ):
        if lo < 0 or hi >= limit:
            i = int(torch.nonzero((t < 0) | (t >= limit))[0, 0])
            raise ValueError(f"{name}[{i}] = {int(t[i])} is out of range: there are {limit} {what}")
    return bool(in_order and in_order[0])


def _contiguous_rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# ------------------------------------------------------------------ the custom ops
def _forward(
    hidden: Tensor, weight: Tensor, rows: Tensor, targets: Tensor, bias: Optional[Tensor],
    temperature: float, with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(log-prob, entropy (empty unless with_entropy), log-sum-exp), fp32 ``[n]``, and
    ``all_rows``: a CPU bool, whether the rows are every row of hidden in order (read
    once here, so that the backward decides how to read hidden without a device sync)."""
    _check(hidden, weight, rows, targets, bias, temperature)
    all_rows = _check_values(hidden.shape[0], weight.shape[0], rows, targets)
    hidden, weight = _contiguous_rows(hidden), _contiguous_rows(weight)
    if use_triton(hidden, weight):
        from ._triton import logprob as _tri

        out = _tri.forward(hidden, weight, rows, targets, bias, temperature, with_entropy, all_rows)
    else:
        out = _ref.selected_logprob_forward(hidden, weight, rows, targets, bias, temperature, with_entropy=with_entropy)
    return *out, torch.tensor(all_rows)


_forward_op = torch.library.custom_op("rlk_mm::selected_logprob", _forward, mutates_args=())


@_forward_op.register_fake
def _(hidden, weight, rows, targets, bias, temperature, with_entropy):
    _check(hidden, weight, rows, targets, bias, temperature)
    n = rows.shape[0]
    out = hidden.new_empty(n, dtype=torch.float32)
    entropy = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)
    return out, entropy, out.new_empty(n), torch.empty((), dtype=torch.bool)


def _backward_grads(
    grad_logp: Tensor, grad_entropy: Optional[Tensor], hidden: Tensor, weight: Tensor,
    rows: Tensor, targets: Tensor, bias: Optional[Tensor], lse: Tensor, entropy: Tensor, all_rows: Tensor,
    temperature: float, need_hidden: bool, need_weight: bool, need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(d hidden [T, H], d weight [V, H], d bias [V]); an output not needed is empty."""
    V, n, all_rows = weight.shape[0], rows.numel(), bool(all_rows)
    hidden, weight = _contiguous_rows(hidden), _contiguous_rows(weight)
    grad_logp = grad_logp.float().contiguous()
    if grad_entropy is not None:
        grad_entropy = grad_entropy.float().contiguous()
    if n == 0:
        d_hidden, d_weight, d_bias = torch.zeros_like(hidden), torch.zeros_like(weight), weight.new_zeros(V)
    elif use_triton(hidden, weight):
        from ._triton import logprob as _tri

        d_sel, d_weight, d_bias = _tri.backward(
            grad_logp, grad_entropy, hidden, weight, rows, targets, bias, lse, entropy, all_rows,
            temperature, need_hidden, need_weight, need_bias and bias is not None,
        )
        d_hidden = None
        if need_hidden:
            d_sel = d_sel.to(hidden.dtype)
            if all_rows:
                d_hidden = d_sel
            else:  # sort-based accumulation on CUDA: deterministic, sums repeated rows
                d_hidden = torch.zeros_like(hidden).index_put_((rows,), d_sel, accumulate=True)
    else:
        d_hidden, d_weight, d_bias = _ref.selected_logprob_backward(
            grad_logp, grad_entropy, hidden, weight, rows, targets, bias, lse,
            entropy if grad_entropy is not None else None, temperature, need=(need_hidden, need_weight, need_bias),
        )
    # an output not needed is a fresh empty tensor: outputs of a custom op may not alias
    return (
        d_hidden.to(hidden.dtype) if need_hidden else hidden.new_empty(0),
        d_weight.to(weight.dtype) if need_weight else hidden.new_empty(0),
        d_bias.to(weight.dtype) if need_bias and d_bias is not None else hidden.new_empty(0),
    )


_backward_op = torch.library.custom_op("rlk_mm::selected_logprob_backward", _backward_grads, mutates_args=())


@_backward_op.register_fake
def _(grad_logp, grad_entropy, hidden, weight, rows, targets, bias, lse, entropy, all_rows,
      temperature, need_hidden, need_weight, need_bias):
    return (
        torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if need_weight else hidden.new_empty(0),
        weight.new_empty(weight.shape[0]) if need_bias and bias is not None else hidden.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    hidden, weight, rows, targets, bias, temperature, with_entropy = inputs
    _, entropy, lse, all_rows = output
    ctx.save_for_backward(hidden, weight, rows, targets, bias, lse, entropy, all_rows)
    ctx.temperature = temperature
    ctx.with_entropy = with_entropy


def _backward(ctx, grad_logp, grad_entropy, _grad_lse, _grad_all_rows,
              grads=torch.ops.rlk_mm.selected_logprob_backward):
    """Autograd of the forward: the registered backward op (traceable), or ``grads`` given."""
    hidden, weight, rows, targets, bias, lse, entropy, all_rows = ctx.saved_tensors
    need_hidden, need_weight, _, _, need_bias = ctx.needs_input_grad[:5]
    if grad_logp is None:
        grad_logp = lse.new_zeros(lse.shape)
    if not ctx.with_entropy:
        grad_entropy = None
    d_hidden, d_weight, d_bias = grads(
        grad_logp, grad_entropy, hidden, weight, rows, targets, bias, lse, entropy, all_rows,
        ctx.temperature, need_hidden, need_weight, need_bias and bias is not None,
    )
    return (
        d_hidden if need_hidden else None,
        d_weight if need_weight else None,
        None,
        None,
        d_bias if need_bias and bias is not None else None,
        None,
        None,
    )


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerSelectedLogprob(torch.autograd.Function):
    """The op's forward and autograd without the custom-op dispatcher (eager calls)."""

    forward = staticmethod(_forward)
    setup_context = staticmethod(_setup_context)
    backward = staticmethod(functools.partial(_backward, grads=_backward_grads))
