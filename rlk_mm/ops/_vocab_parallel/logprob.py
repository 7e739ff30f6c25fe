"""``selected_logprob`` and the fused loss's gradients on a vocabulary shard.

``shard_forward``: the backend's forward on this rank's shard with an ``Exchange`` between
the tiles and the combine, so every rank folds the whole vocabulary's partials in the single
device's order (bitwise its log-probs, entropies and log-sum-exps). ``selected_logprob``: the
checked call and its autograd, whose backward sums d hidden over the group (``sum_rows``) and
keeps each rank's d weight and d bias local. ``loss_grads``: the same for
``linear_policy_loss``, whose gradients are formed during the forward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._backend import use_triton
from .._head_inputs import check_head, contiguous_rows
from .._torch import logprob as _ref
from .agree import agree
from .shard import Exchange, VocabShard, check_group, sum_rows

__all__ = ["loss_grads", "scatter_rows", "selected_logprob", "shard_forward"]


def scatter_rows(d_rows: Tensor, rows: Tensor, T: int, dtype: torch.dtype, all_rows: bool) -> Tensor:
    """d hidden ``[T, H]`` in ``dtype`` from fp32 per-scored-row gradients (repeats summed)."""
    if all_rows:
        return d_rows.to(dtype)
    full = torch.zeros((T, d_rows.shape[1]), dtype=d_rows.dtype, device=d_rows.device)
    return full.index_put_((rows,), d_rows, accumulate=True).to(dtype)


def shard_forward(hidden: Tensor, weight: Tensor, rows: Tensor, targets: Tensor, bias: Optional[Tensor],
                  temperature: float, with_entropy: bool, all_rows: bool,
                  shard: VocabShard) -> tuple[Tensor, Tensor, Tensor]:
    """The group's ``(log-prob, entropy (empty without with_entropy), log-sum-exp)`` per row,
    fp32, from this rank's shard (``targets``: global ids; inputs checked by ``agree``):
    the backend's forward with ``Exchange``, bitwise the single-device op's forward."""
    exchange = Exchange(shard, targets)
    local = shard.local_targets(targets)
    if use_triton(hidden, weight):
        from .._triton import logprob as _tri

        return _tri.forward(hidden, weight, rows, local, bias, temperature, with_entropy, all_rows,
                            exchange=exchange, total_vocab=shard.total)
    return _ref.selected_logprob_forward(hidden, weight, rows, local, bias, temperature, with_entropy=with_entropy,
                                         exchange=exchange)


def _shard_backward(g, ge, hidden, weight, rows, local_targets, bias, lse, entropy, temperature, all_rows, need):
    """This shard's ``(d hidden per scored row fp32 [n, H], d weight, d bias)``; None where not needed."""
    need_hidden, need_weight, need_bias = need  # an empty shard adds zeros
    if weight.shape[0] == 0 or rows.numel() == 0:
        return (hidden.new_zeros((rows.numel(), hidden.shape[1]), dtype=torch.float32) if need_hidden else None,
                torch.zeros_like(weight) if need_weight else None,
                torch.zeros_like(bias) if need_bias and bias is not None else None)
    if use_triton(hidden, weight):
        from .._triton import logprob as _tri

        return _tri.backward(g, ge, hidden, weight, rows, local_targets, bias, lse, entropy, all_rows, temperature,
                             need_hidden, need_weight, need_bias and bias is not None)
    return _ref.selected_logprob_backward(g, ge, hidden, weight, rows, local_targets, bias, lse,
                                          entropy if ge is not None else None, temperature, need=need,
                                          per_scored_row=True)


class _VocabParallelLogprob(torch.autograd.Function):
    """log-prob and entropy over a vocabulary-sharded head; the backward's d hidden is summed over the group."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, targets, temperature, with_entropy, shard, all_rows):
        logp, ent, lse = shard_forward(hidden, weight, rows, targets, bias, temperature, with_entropy, all_rows, shard)
        ctx.save_for_backward(hidden, weight, bias, rows, shard.local_targets(targets), lse, ent)
        ctx.temperature, ctx.with_entropy, ctx.shard, ctx.all_rows = temperature, with_entropy, shard, all_rows
        ctx.mark_non_differentiable(lse)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, rows, local, lse, ent = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        g = (torch.zeros_like(lse) if grad_logp is None else grad_logp).float().contiguous()
        ge = grad_entropy.float().contiguous() if ctx.with_entropy and grad_entropy is not None else None
        d_rows, d_weight, d_bias = _shard_backward(g, ge, hidden, weight, rows, local, bias, lse, ent,
                                                   ctx.temperature, ctx.all_rows, need)
        d_hidden = None
        if need[0]:
            d_rows = sum_rows(d_rows.float(), ctx.shard)
            d_hidden = scatter_rows(d_rows, rows, hidden.shape[0], hidden.dtype, ctx.all_rows)
        return (d_hidden, None if d_weight is None else d_weight.to(weight.dtype),
                None if d_bias is None else d_bias.to(bias.dtype), None, None, None, None, None, None)


@torch.compiler.disable
def selected_logprob(hidden: Tensor, weight: Tensor, rows: Tensor, targets: Tensor, bias: Optional[Tensor],
                     temperature: float, with_entropy: bool, tp_group, vocab_start_index) -> tuple[Tensor, Tensor]:
    """``logprob.selected_logprob`` on a vocabulary shard (arguments resolved there):
    ``(log-prob, entropy or empty)``, fp32 ``[n]``, the same on every rank."""
    check_group(tp_group)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    shard, all_rows = agree(hidden, weight, rows, targets, bias, temperature, tp_group, vocab_start_index, needs_grad,
                            lambda: check_head(hidden, weight, rows, targets, bias, temperature, shard=True))
    hidden, weight = contiguous_rows(hidden), contiguous_rows(weight)
    return _VocabParallelLogprob.apply(hidden, weight, bias, rows, targets, temperature, with_entropy, shard, all_rows)


def loss_grads(hidden, weight, rows, targets, bias, temperature, all_rows, upstream, need, shard: VocabShard):
    """The fused loss's backend call on a vocabulary shard: ``(log-prob, entropy, d hidden
    [T, H] summed over the group, this shard's d weight, d bias)``, gradients None when not
    needed. The backends call ``Exchange`` per chunk of rows, before the gradient."""
    local, exchange = shard.local_targets(targets), Exchange(shard, targets)
    if use_triton(hidden, weight):
        from .._triton import linear_loss as _backend

        logp, entropy, d_rows, d_weight, d_bias = _backend.loss_grads(
            hidden, weight, rows, local, bias, temperature, all_rows, upstream, *need,
            exchange=exchange, chunk_vocab=shard.largest)
    else:
        from .._torch import linear_loss as _backend

        logp, entropy, d_rows, d_weight, d_bias = _backend.loss_grads(
            hidden, weight, rows, local, bias, temperature, upstream, *need, exchange=exchange)
    d_hidden = None
    if d_rows is not None:
        d_hidden = scatter_rows(sum_rows(d_rows.float(), shard), rows, hidden.shape[0], hidden.dtype, all_rows)
    return logp, entropy, d_hidden, d_weight, d_bias
