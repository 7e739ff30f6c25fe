"""The policy loss fused with the LM head: ``policy_loss(selected_logprob(...))`` in three
logits-sized products instead of four.

A token's loss gradient with respect to its log-prob and entropy depends only on that
token's log-prob and entropy and on inputs known before the forward (old log-prob,
advantage, reference log-prob, IS weight, aggregation weight). So the forward, chunk by
chunk of scored rows, forms the logits once, reduces them to log-prob and entropy, turns
them into d loss / d logits in place, and accumulates d hidden and d weight; the backward
only multiplies the stored gradients by the incoming scalar. A chunk's logits are the only
vocabulary-sized buffer (with its fp32 d hidden rows, within ``LMHeadConfig.linear_budget``
bytes on CUDA).

Backends: Triton on CUDA (``_triton/linear_loss.py``), the plain-torch log-prob backend
elsewhere (``_torch/linear_loss.py``: the same values, the logits recomputed for the
gradient). The loss terms and their per-token gradients are ``policy_loss``'s own op.
"""

from __future__ import annotations

from operator import itemgetter
from typing import TYPE_CHECKING, Optional, Unpack

import torch
from torch import Tensor

from ...schema import RLBatch
from ...schema.checks import temperature_arg, tensor_arg
from .._backend import readable_args, use_triton
from .._head_inputs import check_head, check_values, contiguous_rows, scored_rows, targets_named_by
from ..invariant.mode import stock_kernels
from ..logprob import selected_logprob, sharded_head
from ..options import PaddingSide, RatioMode
from .config import PolicyLoss, PolicyLossConfig, PolicyLossKnobs, policy_loss_config
from .custom_op import (
    OP_TENSORS,
    PER_TOKEN,
    checked_policy,
    mask_f32,
    policy_loss_partials,
    policy_loss_partials_backward,
)
from .op import policy_loss
from .terms import Partial, num_blocks

if TYPE_CHECKING:  # annotations only: torch.distributed is not imported at run time here
    from torch.distributed import ProcessGroup

__all__ = ["PolicyLossOutput", "linear_policy_loss"]


class PolicyLossOutput(PolicyLoss):
    """``linear_policy_loss``'s result, a ``PolicyLoss`` with two more fields:
    ``loss, metrics, log_probs, entropy = linear_policy_loss(...)``; code written for
    ``policy_loss``'s result reads ``.loss`` and ``.metrics`` of it alike.

    Attributes
    ----------
    loss : Tensor
        The float32 scalar loss (as ``policy_loss``'s).
    metrics : dict of str to Tensor
        ``policy_loss``'s metrics, 0-d float32 tensors named as verl names them.
    log_probs, entropy : Tensor
        The scored tokens' fp32 log-probs and entropies, detached, in scored-row order, for logging.
    """

    __slots__ = ()
    _fields = ("loss", "metrics", "log_probs", "entropy")
    __match_args__ = _fields

    def __new__(cls, loss: Tensor, metrics: dict, log_probs: Tensor, entropy: Tensor):
        return tuple.__new__(cls, (loss, metrics, log_probs, entropy))

    log_probs = property(itemgetter(2), doc="The scored tokens' fp32 log-probs, detached.")
    entropy = property(itemgetter(3), doc="The scored tokens' fp32 entropies, detached.")

    @classmethod
    def _make(cls, iterable) -> "PolicyLossOutput":
        return cls(*iterable)

    def _replace(self, **fields) -> "PolicyLossOutput":
        return type(self)(*(fields.pop(name, value) for name, value in zip(self._fields, self)))

    def __repr__(self) -> str:
        return f"PolicyLossOutput({', '.join(f'{n}={v!r}' for n, v in zip(self._fields, self))})"


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
    tp_group: Optional[ProcessGroup] = None,
    vocab_start_index: Optional[int] = None,
    gather_weight: bool = False,
    config: Optional[PolicyLossConfig] = None,
    **knobs: Unpack[PolicyLossKnobs],
) -> PolicyLossOutput:
    """``policy_loss(selected_logprob(hidden, weight, ...), old_log_probs, advantages, ...)`` in one op.

    The LM head fused with the policy loss: the gradient is formed during the forward, so three
    logits-sized products instead of four, and no ``[n, V]`` logits are kept.

    Parameters
    ----------
    hidden : Tensor
        ``[T, H]`` packed or ``[B, L, H]`` padded hidden states.
    weight : Tensor
        The LM head ``[V, H]`` (or this rank's shard of its rows, with ``tp_group``).
    batch : RLBatch, optional
        The scored rows and targets from its loss spans (as ``selected_logprob``); else ``index``
        with ``targets``.
    old_log_probs : Tensor or None
        Compact ``[n]``, in scored-row order. ``None`` is on-policy: the log-probs this call computes,
        detached (every ratio is 1), as a trainer that updates once per rollout has them; it must be
        passed explicitly.
    advantages : Tensor
        Compact ``[n]``, in scored-row order.
    index, targets : Tensor, optional
        Rows of the flattened hidden states and their token ids (instead of ``batch``).
    padding : PaddingSide or str, optional
        With ``[B, L, H]`` hidden states and a batch: where each sample sits in its row.
    temperature : float
        Logits are divided by it; >= ``MIN_TEMPERATURE``.
    bias : Tensor, optional
        ``[V]``, finite, or -inf to mask an entry that is never a target.
    mask, rollout_is_weights, ref_log_probs : Tensor, optional
        Compact ``[n]`` per-token inputs, as ``policy_loss``'s.
    sample_index : Tensor, optional
        Each token's sample, without a batch (``batch.loss_token_sample()`` with one).
    num_samples : int, optional
        The number of samples, without a batch.
    tp_group : ProcessGroup, optional
        Vocabulary-parallel: every rank passes the same rows and loss inputs and gets the same loss;
        d hidden is summed over the group in rank order, each rank gets its shard's d weight.
    vocab_start_index : int, optional
        This rank's first vocabulary row, checked when given.
    gather_weight : bool
        A ``DTensor`` head: gather it instead of running vocabulary-parallel.
    config : PolicyLossConfig, optional
        The loss knobs (see ``PolicyLossConfig``).
    **knobs
        ``PolicyLossConfig``'s fields as keywords instead of ``config`` (not both).

    Returns
    -------
    PolicyLossOutput
        ``(loss, metrics, log_probs, entropy)``. The entropy is always computed (it costs no extra
        product): ``metrics`` has ``entropy_loss``, and ``entropy_coeff > 0`` adds the bonus.

    Raises
    ------
    ValueError, TypeError
        For a bad argument, with ``selected_logprob``'s and ``policy_loss``'s checks and errors, in
        two host syncs before any work.
    RuntimeError
        When ``backward`` runs through the loss a second time (the gradients are formed in the call).

    Notes
    -----
    Gradients flow to ``hidden``, ``weight`` and ``bias`` (those that require them; a frozen head or
    frozen hidden states skip their product). ``ratio="gspo_token"`` and ``"gspo"`` need a whole
    sequence's log-probs before any gradient: they run ``policy_loss(selected_logprob(...))`` (four
    products), with the same results. The log-probs and entropies are bitwise ``selected_logprob``'s
    (on one device or on any vocabulary split of the same head); the loss and gradients are within
    the numerical contract.
    """
    config = policy_loss_config(config, knobs, "linear_policy_loss")
    readable_args("linear_policy_loss", hidden=hidden, old_log_probs=old_log_probs)  # (the others: on their devices)
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
            from .._vocab_parallel.agree import agree

            shard, all_rows = agree(
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

    # the gradients are formed here, not traced; their products fix their own order (stock kernels inside
    # batch_invariant(), as the backward's)
    with torch.no_grad(), stock_kernels():
        flat_c, weight_c = contiguous_rows(flat), contiguous_rows(weight)
        if shard is not None:
            from .._vocab_parallel.logprob import loss_grads

            logp, entropy, d_hidden, d_weight, d_bias = loss_grads(
                flat_c, weight_c, rows, tgts, bias, temperature, all_rows, upstream, need, shard)
        elif use_triton(flat_c, weight_c):
            from .._triton import linear_loss as _backend

            logp, entropy, d_rows, d_weight, d_bias = _backend.loss_grads(
                flat_c, weight_c, rows, tgts, bias, temperature, all_rows, upstream, *need, rows_dtype=hidden.dtype)
            d_hidden = None if d_rows is None else _scatter_rows(d_rows, rows, flat, all_rows)
        else:
            from .._torch import linear_loss as _backend

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
        return (None, *(None if g is None else _scaled(g, grad_loss.to(g.dtype)) for g in grads), None, None, None)


def _scaled(grad: Tensor, scale: Tensor) -> Tensor:
    """``grad`` times ``scale`` in place: on the Triton backend a kernel that does nothing when
    the scale is 1 (without reading it on the host), else torch's ``mul_``."""
    if use_triton(grad) and grad.is_contiguous():
        from .._triton.linear_loss import scale_

        return scale_(grad, scale)
    return grad.mul_(scale)
