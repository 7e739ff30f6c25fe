"""Plain-torch selected log-prob: the CPU backend and the oracle of the tests.

Logits ``z = (h · Wᵀ + bias) / temperature`` are formed for a fixed number of rows at a
time (``ROW_CHUNK``; the last chunk is zero-padded to that size), so memory stays at
``ROW_CHUNK × V`` and every matrix product has the same shape whatever the batch: a row's
result does not depend on the other rows (batch invariance) on BLAS libraries whose
per-element order is fixed for a fixed shape. ``compute_dtype=torch.float64`` gives the
oracle the tests compare against.
"""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor

#: rows per matrix product; a constant so that products have one shape whatever ``n`` is
ROW_CHUNK = 64


def _chunks(n: int):
    for start in range(0, n, ROW_CHUNK):
        yield start, min(start + ROW_CHUNK, n)


def _padded(x: Tensor, rows: int) -> Tensor:
    """``x`` with zero rows appended up to ``rows`` (the fixed product shape)."""
    if x.shape[0] == rows:
        return x
    pad = x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))
    return torch.cat([x, pad])


def _logits(h: Tensor, w: Tensor, bias: Optional[Tensor], temperature: float) -> Tensor:
    """A fresh ``[rows, V]`` logits buffer (the caller may overwrite it)."""
    z = _padded(h, ROW_CHUNK) @ w.T
    if bias is not None:
        z += bias
    if temperature != 1.0:  # dividing by 1 is exact: skipping it changes no bit
        z /= temperature
    return z[: h.shape[0]]


def selected_logprob_forward(
    hidden: Tensor,
    weight: Tensor,
    rows: Tensor,
    targets: Tensor,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log-prob, entropy, log-sum-exp) of ``hidden[rows]`` at ``targets``, each ``[n]``.

    ``hidden`` is ``[T, H]``, ``weight`` ``[V, H]``, ``rows``/``targets`` int64 ``[n]``.
    Results are in ``compute_dtype``; without ``with_entropy`` the entropy is left empty.
    Each chunk makes few passes over its logits (in place where it can): on a CPU they,
    not the matrix product, are the cost.
    """
    w = weight.to(compute_dtype)
    b = None if bias is None else bias.to(compute_dtype)
    n = rows.numel()
    logp = torch.empty(n, dtype=compute_dtype, device=hidden.device)
    entropy = torch.empty(n if with_entropy else 0, dtype=compute_dtype, device=hidden.device)
    lse = torch.empty_like(logp)
    for s, e in _chunks(n):
        zc = _logits(hidden[rows[s:e]].to(compute_dtype), w, b, temperature)
        top = zc.amax(dim=-1, keepdim=True)
        zc -= top  # centered: the entropy is then free of the cancellation lse - Σ p z
        unnormalized = torch.exp(zc)
        total = unnormalized.sum(-1)
        log_total = total.log()
        lse[s:e] = top.squeeze(1) + log_total
        logp[s:e] = zc.gather(1, targets[s:e, None]).squeeze(1) - log_total
        if with_entropy:
            entropy[s:e] = log_total - (unnormalized.mul_(zc)).sum(-1) / total
    return logp, entropy, lse


def selected_logprob_backward(
    grad_logp: Tensor,
    grad_entropy: Optional[Tensor],
    hidden: Tensor,
    weight: Tensor,
    rows: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    lse: Tensor,
    entropy: Optional[Tensor],
    temperature: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
    need: tuple[bool, bool, bool] = (True, True, True),
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients ``(d hidden [T, H], d weight [V, H], d bias [V])`` in ``compute_dtype``;
    each is None when ``need`` (hidden, weight, bias) does not ask for it (or without bias).

    With ``z`` the tempered logits and ``p = softmax(z)``: ``d z = g (onehot - p)`` from the
    log-prob and ``- g_H p (z - Σ p z)`` from the entropy; the product rule through
    ``z = (h Wᵀ + b) / T`` gives the rest. Rows not selected get zero gradient; a row
    selected twice gets the sum.
    """
    need_hidden, need_weight, need_bias = need
    w = weight.to(compute_dtype)
    b = None if bias is None else bias.to(compute_dtype)
    d_hidden = torch.zeros(hidden.shape, dtype=compute_dtype, device=hidden.device) if need_hidden else None
    d_weight = torch.zeros(w.shape, dtype=compute_dtype, device=hidden.device) if need_weight else None
    d_bias = torch.zeros(w.shape[0], dtype=compute_dtype, device=hidden.device) if need_bias and bias is not None else None
    for s, e in _chunks(rows.numel()):
        h = hidden[rows[s:e]].to(compute_dtype)
        z = _logits(h, w, b, temperature)
        p = torch.exp(z - lse[s:e, None].to(compute_dtype))
        if grad_entropy is not None:  # z becomes the entropy term - g_H p (z - Σ p z)
            mean_z = (lse[s:e] - entropy[s:e]).to(compute_dtype)
            z.sub_(mean_z[:, None]).mul_(p).mul_(-grad_entropy[s:e, None].to(compute_dtype))
        g = grad_logp[s:e].to(compute_dtype)
        dz = p.mul_(-g[:, None])
        dz.scatter_add_(1, targets[s:e, None], g[:, None])
        if grad_entropy is not None:
            dz += z
        if temperature != 1.0:
            dz /= temperature
        if d_hidden is not None:
            d_hidden.index_add_(0, rows[s:e], (_padded(dz, ROW_CHUNK) @ w)[: e - s])
        if d_weight is not None:
            d_weight += dz.T @ h
        if d_bias is not None:
            d_bias += dz.sum(0)
    return d_hidden, d_weight, d_bias
