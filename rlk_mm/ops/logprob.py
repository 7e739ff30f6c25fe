"""Span-masked selected log-prob: ``log_softmax((h·Wᵀ + bias) / T)[target]`` for scored
tokens only, never writing ``[n, V]`` logits.

``selected_logprob`` checks its arguments, resolves which hidden rows are scored (from an
``RLBatch``'s loss spans, or from ``index``/``targets``) and calls the custom op
``rlk_mm::selected_logprob`` (Triton on CUDA, the chunked plain-torch backend elsewhere;
the op checks shapes and values before any work). Its autograd recomputes logits in the
backward instead of storing them. Eager calls run the op's own forward and backward through
a ``torch.autograd.Function``, skipping the custom-op dispatcher's per-call cost
(bench/results/README.md); ``torch.compile`` traces the registered ops.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from typing import Optional

import torch

from ..schema import RLBatch
from ..schema.checks import INTEGER_DTYPES, bool_arg, first_true, tensor_arg
from ._backend import use_triton
from ._torch import logprob as _ref

Tensor = torch.Tensor

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_IGNORE_INDEX = -100  # the ignore index of torch's and HF's losses: a common slip into token ids
#: below it samplers decode greedily (vLLM), and logits / temperature can overflow float32
MIN_TEMPERATURE = 1e-5


def selected_logprob(
    hidden: Tensor,
    weight: Tensor,
    batch: Optional[RLBatch] = None,
    *,
    index: Optional[Tensor] = None,
    targets: Optional[Tensor] = None,
    padding: Optional[str] = None,
    temperature: float = 1.0,
    bias: Optional[Tensor] = None,
    return_entropy: bool = False,
):
    """fp32 log-probs ``[n]`` of the scored tokens (and their entropies with ``return_entropy``).

    ``hidden`` is ``[T, H]`` (packed) or ``[B, L, H]`` (padded); ``weight`` is the LM head
    ``[V, H]``, ``bias`` an optional ``[V]`` (finite, or -inf to mask an entry that is never
    a target). The logits are ``(h·Wᵀ + bias) / temperature``, ``temperature >=
    MIN_TEMPERATURE``. Give either ``batch`` (an ``RLBatch``: rows and targets from its loss
    spans, target ``t`` scored from the hidden state at ``t - 1``, in loss-span order; with
    ``[B, L, H]`` hidden states also ``padding="right"`` or ``"left"``, where each sample's
    tokens sit in its row: never guessed) or ``index`` (rows of the flattened hidden states)
    with ``targets`` (token ids, in ``[0, V)``). Gradients flow to ``hidden`` (only the
    scored rows are non-zero), ``weight`` and ``bias``, from both outputs.

    Every argument is checked before any work. One host sync per call, in the forward: the
    index and target ranges, the bias values and whether every row is scored in order are
    read together; the backward never syncs. The batch path also reads the batch's span
    sizes (free for a batch on the CPU, one more sync for a batch on the GPU). ``hidden``
    and ``weight`` are not read for checks: a non-finite value there propagates (a NaN
    hidden row gives NaN for that row).
    """
    return_entropy = bool_arg("return_entropy", return_entropy)
    temperature = _temperature(temperature)
    rows, tgts = scored_rows(hidden, batch, index, targets, padding)
    op = torch.ops.rlk_mm.selected_logprob if torch.compiler.is_compiling() else _EagerSelectedLogprob.apply
    with targets_named_by(batch):
        logp, entropy, _, _ = op(hidden.flatten(0, -2), weight, rows, tgts, bias, temperature, return_entropy)
    return (logp, entropy) if return_entropy else logp


def scored_rows(hidden: Tensor, batch: Optional[RLBatch], index, targets, padding) -> tuple[Tensor, Tensor]:
    """(rows of the flattened hidden states, targets), int64 ``[n]``: from the batch's loss
    spans, or the given ``index`` and ``targets`` (checked: exactly one of the two ways)."""
    tensor_arg("hidden", hidden)
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [T, H] (packed) or [B, L, H] (padded); got shape {tuple(hidden.shape)}")
    if batch is not None:
        if index is not None or targets is not None:
            raise ValueError("give either batch or index/targets, not both")
        if not isinstance(batch, RLBatch):
            raise TypeError(f"batch must be an RLBatch, got {type(batch).__name__} (or pass index= and targets=)")
        return _rows_from_batch(batch, hidden, padding)
    if index is None or targets is None:
        raise ValueError("without batch, both index (rows of hidden) and targets (token ids) are required")
    if padding is not None:
        _refuse_padding(padding)
    return _as_index("index", index), _as_index("targets", targets)


@contextlib.contextmanager
def targets_named_by(batch: Optional[RLBatch]):
    """A ``TargetError`` raised inside, re-raised naming the batch's sample and position."""
    try:
        yield
    except TargetError as e:
        if batch is None:
            raise
        sample, pos, _ = batch.loss_spans.token_positions()
        where = f"sample {int(sample[e.at])}, position {int(pos[e.at])}"
        raise ValueError(f"batch input_ids: {where} holds token {e.token}, which {e.problem}") from None


class TargetError(ValueError):
    """A target outside the vocabulary or masked by the bias. ``at`` is its place in
    ``targets``: a caller that knows where the token came from re-raises naming that place."""

    def __init__(self, at: int, token: int, problem: str):
        super().__init__(f"targets[{at}] = {token} {problem}")
        self.at, self.token, self.problem = at, token, problem


def _temperature(value) -> float:
    """``value`` (a number or a 0-d float tensor; never a bool or a string) as a float > 0."""
    if isinstance(value, Tensor) and value.dim() == 0 and value.is_floating_point():
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"temperature must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    _check_temperature(value)
    return value


def _check_temperature(temperature: float) -> None:
    if not (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE):
        raise ValueError(
            f"temperature must be a finite number >= {MIN_TEMPERATURE}; got {temperature} (the rollout's sampling "
            "temperature: logits are divided by it; 1.0 leaves them as they are)"
        )


def _as_index(name: str, t) -> Tensor:
    tensor_arg(name, t)
    if t.dtype not in INTEGER_DTYPES:
        raise TypeError(f"{name} must be an integer tensor (int64 or int32); got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D [n]; got shape {tuple(t.shape)}")
    return t.to(torch.int64).contiguous()


def _refuse_padding(padding) -> None:
    raise ValueError(
        f"padding={padding!r} applies only to [B, L, H] hidden states with a batch; packed hidden states and "
        "index= rows (rows of the flattened hidden states) have no padding side: leave padding out"
    )


def _rows_from_batch(batch: RLBatch, hidden: Tensor, padding) -> tuple[Tensor, Tensor]:
    """(rows, targets) on hidden's device from the batch's loss spans, checked against hidden's layout."""
    if hidden.dim() == 2:
        if padding is not None:
            _refuse_padding(padding)
        if hidden.shape[0] != batch.num_tokens:
            raise ValueError(
                f"hidden is packed [T={hidden.shape[0]}, H] but the batch has {batch.num_tokens} tokens: "
                "pass one hidden state per packed token of the batch"
            )
        rows, targets = batch.loss_token_index()
        return rows.to(hidden.device), targets.to(hidden.device)
    B, L = hidden.shape[:2]
    if B != batch.num_samples:
        raise ValueError(f"hidden is padded [B={B}, L, H] but the batch has {batch.num_samples} samples")
    if padding is None:
        raise ValueError(
            f"hidden is padded [B={B}, L={L}, H] and its padding side is ambiguous: pass padding='right' "
            "(each sample's tokens start its row) or padding='left' (they end it)"
        )
    try:
        rows, targets = batch.loss_token_index(padded_length=L, padding=padding)
    except ValueError as error:  # name the argument the caller gave
        raise ValueError(f"hidden is padded [B={B}, L={L}, H]: {error}") from None
    return rows.to(hidden.device), targets.to(hidden.device)


# ------------------------------------------------------------------ checks (all backends)
def _check(hidden, weight, rows, targets, bias, temperature) -> None:
    """Types, shapes, dtypes, devices and temperature, read on the host; raised before any kernel runs."""
    tensor_arg("weight", weight)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H]; got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H] (the LM head); got shape {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden is [T, {hidden.shape[1]}] but weight is [V, {weight.shape[1]}]")
    if hidden.shape[1] == 0:
        raise ValueError("hidden and weight have hidden size H = 0: pass the model's hidden states and its LM head")
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocabulary (V = 0)")
    if hidden.dtype not in _FLOAT_DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(
            f"hidden and weight must share one of float32/bfloat16/float16; got {hidden.dtype} and {weight.dtype}"
        )
    if bias is not None:
        tensor_arg("bias", bias)
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
    _check_temperature(temperature)


def _check_values(T: int, V: int, rows: Tensor, targets: Tensor, bias: Optional[Tensor]) -> bool:
    """Every row in [0, T); every target in [0, V) and not masked by the bias; every bias
    entry finite or -inf, not all -inf. The error names the first offender. Returns whether
    the rows are exactly 0, 1, ..., T - 1. All of it is read in one host sync."""
    n = rows.numel()
    stats = [*torch.aminmax(rows), *torch.aminmax(targets)] if n else []
    if n and n == T:
        stats.append((rows == torch.arange(T, device=rows.device)).all().to(rows.dtype))
    if bias is not None:  # max: nan or +inf if any, -inf if all masked; min at the targets: -inf if one is masked
        at_targets = bias[targets.clamp(0, V - 1)].amin() if n else bias.new_zeros(())
        stats = [s.double() for s in (*stats, bias.amax(), at_targets)]
    values = torch.stack(stats).tolist() if stats else []  # the one sync
    if n:
        _check_ranges(T, V, rows, targets, *values[:4])
    if bias is not None:
        _check_bias(bias, targets, *values[-2:])
    return n == T and n > 0 and bool(values[4])


def _check_ranges(T: int, V: int, rows: Tensor, targets: Tensor, lo_r, hi_r, lo_t, hi_t) -> None:
    if lo_r < 0 or hi_r >= T:
        i = first_true((rows < 0) | (rows >= T))[0]
        raise ValueError(f"index[{i}] = {int(rows[i])} is out of range: there are {T} rows of hidden")
    if lo_t < 0 or hi_t >= V:
        i = first_true((targets < 0) | (targets >= V))[0]
        token = int(targets[i])
        hint = ""
        if token == _IGNORE_INDEX:
            hint = f"; {token} is an ignore index: leave such positions out of index and targets"
        raise TargetError(i, token, f"is out of range: there are {V} vocabulary entries (rows of weight){hint}")


def _check_bias(bias: Tensor, targets: Tensor, top, target_low) -> None:
    if not top < math.inf:
        i = first_true(torch.isnan(bias) | (bias == math.inf))[0]
        raise ValueError(f"bias[{i}] = {float(bias[i])}: a bias entry must be finite, or -inf to mask its token")
    if top == -math.inf:
        raise ValueError("bias is -inf at every vocabulary entry: no token can be scored; keep some entries finite")
    if target_low == -math.inf:
        i = first_true(bias[targets] == -math.inf)[0]
        token = int(targets[i])
        raise TargetError(i, token, f"is masked: bias[{token}] = -inf (probability 0); score only tokens it can give")


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
    all_rows = _check_values(hidden.shape[0], weight.shape[0], rows, targets, bias)
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
