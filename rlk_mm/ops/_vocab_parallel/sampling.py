"""``sample_from_hidden`` on a vocabulary shard: every rank draws the single device's tokens.

Noise is keyed by global vocabulary indices. The Triton backend gathers each rank's best
noise block per row for plain temperature, the rows' logits for filters
(``_triton.sampling.hidden``); the torch backend gathers the logits and scores the drawn
tokens with ``shard_forward``, as ``selected_logprob`` would.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .._head_inputs import check_head, contiguous_rows
from .._torch import sampling as _sampling
from .agree import agree, float_bits
from .logprob import shard_forward
from .shard import Exchange, check_group

__all__ = ["sample_from_hidden"]


@torch.compiler.disable
def sample_from_hidden(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], temperature: float, filters,
                       seeds: Tensor, steps: Tensor, triton: bool, tp_group,
                       max_vocab: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``sampling.sample_from_hidden`` on a vocabulary shard (arguments resolved there; top-k
    settled here against the group's vocabulary, of at most ``max_vocab`` entries):
    ``(tokens, log_probs, sampled_log_probs, status)``, the same on every rank and bitwise the
    single device's (``triton``: the Triton backend, else torch)."""
    check_group(tp_group)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    settings = [-1 if v is None else float_bits(v) for v in filters]  # exact bits
    extra = torch.cat([seeds, steps, torch.tensor(settings, device=seeds.device)])
    shard, _ = agree(hidden, weight, rows, None, bias, temperature, tp_group, None, False,
                     lambda: check_head(hidden, weight, rows, rows, bias, temperature, shard=True), extra=extra)
    if shard.total > max_vocab:
        raise ValueError(f"the vocabulary has {shard.total} entries over the group; sampling supports {max_vocab}")
    if filters.top_k is not None and filters.top_k >= shard.total:  # keeps every token (as one device settles it)
        filters = filters._replace(top_k=None)
    hidden, weight = contiguous_rows(hidden), contiguous_rows(weight)
    if triton:
        from .._triton.sampling import hidden as _tri

        return _tri.sample_hidden(hidden, weight, bias, temperature, filters, seeds, steps, shard=Exchange(shard))
    tokens, sampled, status = _sampling.sample_gathered_rows(hidden, weight, bias, temperature, filters, seeds, steps,
                                                             Exchange(shard).gather_logits)
    # the log-probs of the rows drawn without error (row-invariant: a subset gives the same bits), NaN elsewhere
    ok = torch.nonzero(status == _sampling.OK).flatten()
    log_probs = torch.full(tokens.shape, math.nan, dtype=torch.float32, device=tokens.device)
    if ok.numel():
        log_probs[ok] = shard_forward(hidden, weight, ok, tokens[ok], bias, temperature, False, ok.numel() == rows.numel(),
                                      shard)[0]
    return tokens, log_probs, log_probs if filters.plain else sampled, status
