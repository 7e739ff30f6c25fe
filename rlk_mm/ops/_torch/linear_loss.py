"""The fused LM-head policy loss in plain torch: the CPU backend of ``linear_policy_loss``.

The same results as the Triton path (``_triton/linear_loss.py``): log-probs and entropies
of ``selected_logprob``'s torch backend, the caller's per-token upstream gradients, then
that backend's gradient pass. It recomputes the logits for the gradients (four products, not
three: on a CPU no logits buffer is kept), which changes no value.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import logprob as _logprob

__all__ = ["loss_grads"]

Tensor = torch.Tensor


def loss_grads(
    hidden: Tensor, weight: Tensor, rows: Tensor, targets: Tensor, bias: Optional[Tensor], temperature: float,
    upstream: Callable[[int, int, Tensor, Tensor], tuple[Tensor, Optional[Tensor]]],
    need_hidden: bool, need_weight: bool, need_bias: bool, exchange: Optional[_logprob.Exchange] = None,
) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(log-prob [n], entropy [n], d hidden [T, H], d weight [V, H], d bias [V])`` in fp32,
    each gradient None when not needed; ``upstream`` as in ``_triton.linear_loss`` (its
    entropy gradient None when the loss has no entropy term). With ``exchange`` (a vocabulary
    shard, as in ``_triton.linear_loss``) d hidden is the shard's part per scored row, ``[n, H]``."""
    logp, entropy, lse = _logprob.selected_logprob_forward(
        hidden, weight, rows, targets, bias, temperature, with_entropy=True, exchange=exchange)
    if not (need_hidden or need_weight or need_bias):
        return logp, entropy, None, None, None
    g, ge = upstream(0, rows.numel(), logp, entropy)
    d_hidden, d_weight, d_bias = _logprob.selected_logprob_backward(
        g.float(), None if ge is None else ge.float(), hidden, weight, rows, targets, bias, lse,
        None if ge is None else entropy, temperature, need=(need_hidden, need_weight, need_bias),
        per_scored_row=exchange is not None,
    )
    return logp, entropy, d_hidden, d_weight, d_bias
