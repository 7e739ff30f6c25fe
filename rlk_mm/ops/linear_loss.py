"""The policy loss fused with the LM head: ``policy_loss(selected_logprob(...))`` in three
logits-sized products instead of four.

A token's loss gradient with respect to its log-prob and entropy depends only on that
token's log-prob and entropy and on inputs known before the forward (old log-prob,
advantage, reference log-prob, IS weight, aggregation weight). So the forward, chunk by
chunk of scored rows, forms the logits once, reduces them to log-prob and entropy, turns
them into d loss / d logits in place, and accumulates d hidden and d weight; the backward
only multiplies the stored gradients by the incoming scalar. A chunk's logits are the only
vocabulary-sized buffer (``LogprobConfig.linear_budget`` bytes on CUDA).

Backends: Triton on CUDA (``_triton/linear_loss.py``), the plain-torch log-prob backend
elsewhere (``_torch/linear_loss.py``: the same values, the logits recomputed for the
gradient). The loss terms and their per-token gradients are ``policy_loss``'s own op.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..schema import RLBatch
from ..schema.checks import temperature_arg, tensor_arg
from ._backend import use_triton
from ._head_inputs import check_head, check_values, contiguous_rows, scored_rows, targets_named_by
from ._loss_terms import Partial, num_blocks
from ._policy_op import (
    OP_TENSORS, PER_TOKEN, checked_policy, mask_f32, policy_loss_partials, policy_loss_partials_backward,
)
from .logprob import selected_logprob, sharded_head
from .loss import policy_loss
from .loss_config import PolicyLossConfig, policy_loss_config
from .options import PaddingSide, RatioMode

__all__ = ["PolicyLossOutput", "linear_policy_loss"]


class PolicyLossOutput(NamedTuple):
    """``linear_policy_loss``'s result: ``policy_loss``'s ``PolicyLoss(loss, metrics)`` fields
    first, then the scored tokens' fp32 log-probs and entropies (detached, in scored-row
    order) for logging. ``loss, metrics, log_probs, entropy = linear_policy_loss(...)``."""

    loss: Tensor
    metrics: dict[str, Tensor]
    log_probs: Tensor
    entropy: Tensor


def linear_policy_loss(
    hidden: Tensor,
    weight: Tensor,
    batch: Optional[RLBatch] = None,
    *,
    old_log_probs: Optional[Tensor],
    advantages: Tensor,
    index: Optional[Tensor] = None,
    targets: Optional[Tensor] = None,
    padding: PaddingSide | str | None = None,
    temperature: float = 1.0,
    bias: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    sample_index: Optional[Tensor] = None,
    num_samples: Optional[int] = None,
    rollout_is_weights: Optional[Tensor] = None,
    ref_log_probs: Optional[Tensor] = None,
    tp_group=None,
    vocab_start_index: Optional[int] = None,
    gather_weight: bool = False,
    config: Optional[PolicyLossConfig] = None,
    **knobs,
) -> PolicyLossOutput:
    """``policy_loss(selected_logprob(hidden, weight, ...), old_log_probs, advantages, ...)``
    in one op: ``(loss, metrics, log_probs, entropy)``.

    The scored rows and their targets are ``selected_logprob``'s (``batch`` with
    ``padding`` for ``[B, L, H]`` hidden states, or ``index`` with ``targets``), as are
    ``temperature`` and ``bias``. The per-token inputs (``old_log_probs``, ``advantages``,
    ``mask``, ``rollout_is_weights``, ``ref_log_probs``) are compact ``[n]`` in the same
    scored-row order; their samples are ``batch.loss_token_sample()`` with a batch, else
    ``sample_index`` and ``num_samples`` (as ``policy_loss``'s compact layout). The loss knobs
    are ``policy_loss``'s: ``config=PolicyLossConfig(...)`` or its fields as keywords (see
    ``PolicyLossConfig``: clips, ``ratio``, ``log_ratio_clamp``, ``kl_type``, ``kl_coef``,
    ``entropy_coeff``, ``loss_agg_mode``, ``dp_size`` and the counts), with the same checks
    and errors. The entropy is always
    computed (it costs no extra product): ``metrics`` has ``entropy_loss``, and
    ``entropy_coeff > 0`` adds the bonus.

    ``old_log_probs=None`` is on-policy: the old log-probs are the ones this call computes,
    detached (every ratio is 1), as a trainer that updates once per rollout has them (TRL's
    ``num_iterations=1``); it must be passed explicitly.

    Gradients flow to ``hidden``, ``weight`` and ``bias`` (those that require them; a frozen
    head or frozen hidden states skip their product). They are formed in this call, so
    calling ``backward`` on the loss more than once (``retain_graph``) is refused.
    ``ratio="gspo_token"`` and ``"gspo"`` need a whole sequence's log-probs before any
    gradient: they run ``policy_loss(selected_logprob(...))`` (four products), with the same
    results.

    Two host syncs before any work: the rows, targets and bias values (as
    ``selected_logprob``), then the loss inputs (as ``policy_loss``).

    ``tp_group``, ``vocab_start_index`` and ``gather_weight`` are ``selected_logprob``'s: a
    vocabulary-sharded head (``vocab_parallel``), every rank passing the same rows and loss
    inputs and getting the same loss; d hidden is summed over the group in rank order, each
    rank gets its shard's d weight. One collective per chunk of rows in the forward. The
    log-probs and entropies are bitwise ``selected_logprob``'s (on one device or on any
    vocabulary split of the same head); the loss and gradients within the numerical contract.
    """
    config = policy_loss_config(config, knobs, "linear_policy_loss")
    rows, tgts = scored_rows(hidden, batch, index, targets, padding)
    temperature = temperature_arg(temperature)
    weight, bias, tp_group = sharded_head(weight, bias, tp_group, vocab_start_index, gather_weight)
    n = rows.numel()
    on_policy = old_log_probs is None
    if on_policy:  # filled with this call's log-probs (zeros pass the value checks until then)
        old_log_probs = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    tensor_arg("old_log_probs", old_log_probs)
    if old_log_probs.shape != (n,):
        raise ValueError(
            f"old_log_probs has shape {tuple(old_log_probs.shape)} but {n} tokens are scored: pass compact [n] "
            "per-token inputs, one value per scored token in scored-row (loss-span) order"
        )
    if batch is None and sample_index is None:
        raise ValueError(
            "without batch, pass sample_index (int64 [n], each scored token's sample, non-decreasing) and num_samples"
        )
    if batch is not None:
        if sample_index is not None or num_samples is not None:
            raise ValueError("with batch, each token's sample comes from the batch: leave sample_index and num_samples out")
        sample_index, num_samples = batch.loss_token_sample().to(hidden.device), batch.num_samples
    flat = hidden.flatten(0, -2)
    if tp_group is None:
        check_head(flat, weight, rows, tgts, bias, temperature)
    constants = dict(rollout_is_weights=rollout_is_weights, ref_log_probs=ref_log_probs)
    policy = checked_policy("old_log_probs", old_log_probs, old_log_probs, advantages, mask, sample_index=sample_index,
                            num_samples=num_samples, entropy=True, config=config, **constants)
    grad_on = torch.is_grad_enabled()
    need = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad)
    shard = None
    with targets_named_by(batch):
        if tp_group is None:
            all_rows = check_values(flat.shape[0], weight.shape[0], rows, tgts, bias)
        elif policy.ratio is RatioMode.TOKEN:  # (sequence ratios: selected_logprob checks)
            from . import vocab_parallel

            shard, all_rows = vocab_parallel.agree(
                flat, weight, rows, tgts, bias, temperature, tp_group, vocab_start_index, any(need),
                lambda: check_head(flat, weight, rows, tgts, bias, temperature, shard=True))
    if policy.ratio is not RatioMode.TOKEN:  # sequence ratios: every log-prob before any gradient
        logp, entropy = selected_logprob(
            flat, weight, index=rows, targets=tgts, bias=bias, temperature=temperature, return_entropy=True,
            tp_group=tp_group, vocab_start_index=vocab_start_index)
        loss, metrics = policy_loss(logp, logp.detach() if on_policy else old_log_probs, advantages, mask,
                                    sample_index=sample_index, num_samples=num_samples, entropy=entropy,
                                    config=config, **constants)
        return PolicyLossOutput(loss, metrics, logp.detach(), entropy.detach())

    grad_rows = policy.grad_rows(mask_f32(policy.mask, n, hidden.device).sum())
    per_token = [name in PER_TOKEN for name in OP_TENSORS]

    def upstream(start: int, end: int, logp: Tensor, entropy: Tensor):
        tensors = [t[start:end] if sliced and t is not None else t for t, sliced in zip(policy.tensors, per_token)]
        if on_policy:
            tensors[0].copy_(logp)  # a view of policy.tensors[0]
        grad_partials = grad_rows[:, None].expand(len(Partial), num_blocks(end - start))
        g, ge = policy_loss_partials_backward(grad_partials, logp, entropy, tensors, policy.floats, policy.ints)
        return g, (ge if policy.entropy_coeff else None)

    with torch.no_grad():  # the gradients are formed here, not traced
        flat_c, weight_c = contiguous_rows(flat), contiguous_rows(weight)
        if shard is not None:
            from . import vocab_parallel

            logp, entropy, d_hidden, d_weight, d_bias = vocab_parallel.loss_grads(
                flat_c, weight_c, rows, tgts, bias, temperature, all_rows, upstream, need, shard)
        elif use_triton(flat_c, weight_c):
            from ._triton import linear_loss as _backend

            logp, entropy, d_rows, d_weight, d_bias = _backend.loss_grads(
                flat_c, weight_c, rows, tgts, bias, temperature, all_rows, upstream, *need)
            d_hidden = None if d_rows is None else _scatter_rows(d_rows.to(hidden.dtype), rows, flat, all_rows)
        else:
            from ._torch import linear_loss as _backend

            logp, entropy, d_hidden, d_weight, d_bias = _backend.loss_grads(
                flat_c, weight_c, rows, tgts, bias, temperature, upstream, *need)
        if on_policy:  # (also without gradients, where upstream never ran)
            policy.tensors[0].copy_(logp)
        loss, metrics = policy.losses(policy_loss_partials(logp, entropy, policy.tensors, policy.floats, policy.ints))
    if any(need):
        grads = (
            None if d_hidden is None else d_hidden.to(hidden.dtype).view(hidden.shape),
            None if d_weight is None else d_weight.to(weight.dtype),
            None if d_bias is None else d_bias.to(bias.dtype),
        )
        loss = _StoredGradients.apply(loss, hidden, weight, bias, *grads)
    return PolicyLossOutput(loss, metrics, logp, entropy)


def _scatter_rows(d_rows: Tensor, rows: Tensor, flat: Tensor, all_rows: bool) -> Tensor:
    """d hidden ``[T, H]`` from the scored rows' gradients (repeated rows summed, deterministically)."""
    if all_rows:
        return d_rows
    return torch.zeros_like(flat).index_put_((rows,), d_rows, accumulate=True)


class _StoredGradients(torch.autograd.Function):
    """The loss, with gradients computed in the forward: the backward scales them (in
    place: they are this call's own buffers) by the incoming gradient."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, d_hidden, d_weight, d_bias):
        ctx.grads = (d_hidden, d_weight, d_bias)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError(
                "linear_policy_loss: backward ran twice on one loss; its gradients are formed in the forward and "
                "handed out once. Call linear_policy_loss again for another backward"
            )
        grads, ctx.grads = ctx.grads, None
        scaled = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads]
        return (None, *scaled, None, None, None)
