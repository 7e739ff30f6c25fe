"""Span-masked selected log-prob: ``log_softmax((h·Wᵀ + bias) / T)[target]`` for scored
tokens only, never writing ``[n, V]`` logits.

``selected_logprob`` checks its arguments, resolves which hidden rows are scored (from an
``RLBatch``'s loss spans, or from ``index``/``targets``) and calls the custom op
``rlk_mm::selected_logprob`` (Triton on CUDA, the chunked plain-torch backend elsewhere;
the op checks shapes and values before any work). Its autograd recomputes logits in the
backward instead of storing them. Eager calls run the op's own forward and backward through
a ``torch.autograd.Function``, skipping the custom-op dispatcher's per-call cost (its
``dispatcher`` entry in ``bench/results/logprob/h100-80gb-hbm3/2026-11-23-probes.json``);
``torch.compile`` traces the registered ops.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch

from ..schema import RLBatch
from ..schema.checks import bool_arg, temperature_arg
from ._backend import readable_args, use_triton
from ._head_inputs import TargetError, check_head, check_values, contiguous_rows, scored_rows, targets_named_by
from ._torch import logprob as _ref
from .options import PaddingSide

Tensor = torch.Tensor

if TYPE_CHECKING:  # annotations only: torch.distributed is not imported at run time here
    from torch.distributed import ProcessGroup

__all__ = ["TargetError", "selected_logprob"]


def selected_logprob(
    hidden: Tensor,
    weight: Tensor,
    batch: Optional[RLBatch] = None,
    *,
    index: Optional[Tensor] = None,
    targets: Optional[Tensor] = None,
    padding: PaddingSide | str | None = None,
    temperature: float = 1.0,
    bias: Optional[Tensor] = None,
    return_entropy: bool = False,
    tp_group: Optional[ProcessGroup] = None,
    vocab_start_index: Optional[int] = None,
    gather_weight: bool = False,
):
    """fp32 log-probs ``[n]`` of the scored tokens (and their entropies with ``return_entropy``).

    The logits are ``(h·Wᵀ + bias) / temperature``; no ``[n, V]`` logits are written, forward or
    backward, and rows outside the loss spans cost nothing.

    Parameters
    ----------
    hidden : Tensor
        ``[T, H]`` (packed) or ``[B, L, H]`` (padded) hidden states.
    weight : Tensor
        The LM head ``[V, H]`` (with ``tp_group``: this rank's contiguous shard of its rows; a
        ``DTensor`` ``Shard(0)`` head, FSDP2, runs over its mesh's group).
    batch : RLBatch, optional
        Rows and targets from its loss spans: target ``t`` scored from the hidden state at ``t - 1``,
        in loss-span order. Else give ``index`` with ``targets``.
    index : Tensor, optional
        Rows of the flattened hidden states.
    targets : Tensor, optional
        Their token ids, in ``[0, V)``.
    padding : PaddingSide or str, optional
        With ``[B, L, H]`` hidden states and a batch: ``"right"`` or ``"left"``, where each sample's
        tokens sit in its row (never guessed).
    temperature : float
        >= ``MIN_TEMPERATURE``.
    bias : Tensor, optional
        ``[V]``, finite, or -inf to mask an entry that is never a target.
    return_entropy : bool
        Also return the entropies.
    tp_group : ProcessGroup, optional
        Vocabulary-parallel (see ``_vocab_parallel``): every rank passes the same hidden rows and
        targets (global token ids). Every shard but the last holds a multiple of 128 rows.
    vocab_start_index : int, optional
        This rank's first vocabulary row, checked when given.
    gather_weight : bool
        A ``DTensor`` head: gather it instead, for ranks that score different rows.

    Returns
    -------
    Tensor or tuple of Tensor
        ``logp [n]`` fp32, or ``(logp, entropy)`` with ``return_entropy``. Gradients flow to
        ``hidden`` (only the scored rows are non-zero), ``weight`` and ``bias``, from both outputs.

    Raises
    ------
    ValueError, TypeError
        For a bad argument, naming the argument, the sample and the position, before any work (one
        host sync in the forward reads the index and target ranges, the bias values and whether
        every row is scored in order; the backward never syncs). A misaligned shard is refused,
        saying how to pad.

    Notes
    -----
    ``hidden`` and ``weight`` are not read for checks: a non-finite value there propagates (a NaN
    hidden row gives NaN for that row). Reduction order: the logits of each 128-column vocabulary
    segment (a global grid from column 0) are reduced to per-row partials, which are folded in
    vocabulary order; so a row's log-prob and entropy do not depend on the other rows, on where the
    row stands, or on how the vocabulary is sharded over ranks (bitwise run to run, on one backend
    and dtype). Vocabulary-parallel log-probs and entropies are bitwise the single-device op's; the
    gradients are within the numerical contract (``parity/contract.py``).
    """
    return_entropy = bool_arg("return_entropy", return_entropy)
    temperature = temperature_arg(temperature)
    readable_args("selected_logprob", hidden=hidden)  # (the others must be on its device)
    rows, tgts = scored_rows(hidden, batch, index, targets, padding)
    weight, bias, tp_group = sharded_head(weight, bias, tp_group, vocab_start_index, gather_weight)
    if tp_group is not None:
        from ._vocab_parallel import logprob as vocab_parallel

        with targets_named_by(batch):
            logp, entropy = vocab_parallel.selected_logprob(
                hidden.flatten(0, -2), weight, rows, tgts, bias, temperature, return_entropy, tp_group, vocab_start_index)
        return (logp, entropy) if return_entropy else logp
    op = torch.ops.rlk_mm.selected_logprob if torch.compiler.is_compiling() else _EagerSelectedLogprob.apply
    with targets_named_by(batch):
        logp, entropy, _, _ = op(hidden.flatten(0, -2), weight, rows, tgts, bias, temperature, return_entropy)
    return (logp, entropy) if return_entropy else logp


def sharded_head(weight, bias, tp_group, vocab_start_index, gather_weight):
    """The head to compute with: unchanged for a plain head without ``tp_group`` (no import, no cost).

    Parameters
    ----------
    weight, bias : Tensor
        The LM head (a ``DTensor`` for FSDP2) and its optional bias.
    tp_group : ProcessGroup, optional
        The vocabulary-parallel group.
    vocab_start_index : int, optional
        This rank's first vocabulary row, checked when given.
    gather_weight : bool
        Gather a ``DTensor`` head instead of running vocabulary-parallel.

    Returns
    -------
    tuple
        ``(weight, bias, tp_group)``: else ``_head_inputs.local_head``'s resolution.
    """
    plain = (torch.Tensor, torch.nn.Parameter)
    if (tp_group is None and vocab_start_index is None and gather_weight is False
            and type(weight) in plain and (bias is None or type(bias) in plain)):
        return weight, bias, None
    from ._head_inputs import local_head

    return local_head(weight, bias, tp_group, vocab_start_index, gather_weight)


def _forward(
    hidden: Tensor, weight: Tensor, rows: Tensor, targets: Tensor, bias: Optional[Tensor],
    temperature: float, with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(log-prob, entropy (empty unless with_entropy), log-sum-exp), fp32 ``[n]``, and
    ``all_rows``: a CPU bool, whether the rows are every row of hidden in order (read
    once here, so that the backward decides how to read hidden without a device sync)."""
    check_head(hidden, weight, rows, targets, bias, temperature)
    all_rows = check_values(hidden.shape[0], weight.shape[0], rows, targets, bias)
    hidden, weight = contiguous_rows(hidden), contiguous_rows(weight)
    if use_triton(hidden, weight):
        from ._triton import logprob as _tri

        out = _tri.forward(hidden, weight, rows, targets, bias, temperature, with_entropy, all_rows)
    else:
        out = _ref.selected_logprob_forward(hidden, weight, rows, targets, bias, temperature, with_entropy=with_entropy)
    return *out, torch.tensor(all_rows)


_forward_op = torch.library.custom_op("rlk_mm::selected_logprob", _forward, mutates_args=())


@_forward_op.register_fake
def _(hidden, weight, rows, targets, bias, temperature, with_entropy):
    check_head(hidden, weight, rows, targets, bias, temperature)
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
    hidden, weight = contiguous_rows(hidden), contiguous_rows(weight)
    grad_logp = grad_logp.float().contiguous()
    if grad_entropy is not None:
        grad_entropy = grad_entropy.float().contiguous()
    if n == 0:
        d_hidden, d_weight, d_bias = torch.zeros_like(hidden), torch.zeros_like(weight), weight.new_zeros(V)
    elif use_triton(hidden, weight):
        from ._triton import logprob as _tri

        d_sel, d_weight, d_bias = _tri.backward(
            grad_logp, grad_entropy, hidden, weight, rows, targets, bias, lse, entropy, all_rows,
            temperature, need_hidden, need_weight, need_bias and bias is not None, rows_dtype=hidden.dtype,
        )
        d_hidden = None
        if need_hidden:
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
