"""Plain-torch selected log-prob: the CPU backend and the oracle of the tests.

Logits ``z = (h · Wᵀ + bias) / temperature`` are formed one tile at a time: ``ROW_CHUNK``
rows (the last chunk zero-padded to that size) by ``VOCAB_TILE`` vocabulary entries,
transposed (``[tile, rows]``: on a CPU that product is the faster way round, and the tile
stays in cache), with an online log-sum-exp over the tiles in vocabulary order. Memory
stays at one tile, never ``[n, V]``, and every matrix product has a shape fixed by H and V
alone: a row's result does not depend on the other rows (batch invariance) on BLAS
libraries whose per-element order is fixed for a fixed shape. ``compute_dtype=torch.float64``
gives the oracle the tests compare against.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

__all__ = [
    "logits_tile", "ROW_CHUNK", "row_chunks", "selected_logprob_backward", "selected_logprob_forward", "tempered",
    "VOCAB_TILE",
]

Tensor = torch.Tensor

#: rows per matrix product; a constant so that products have one shape whatever ``n`` is
ROW_CHUNK = 128
#: vocabulary entries per logits tile (``[VOCAB_TILE, ROW_CHUNK]`` fp32 is 2 MiB)
VOCAB_TILE = 4096


def _padded(x: Tensor, rows: int) -> Tensor:
    """``x`` with zero rows appended up to ``rows`` (the fixed product shape)."""
    if x.shape[0] == rows:
        return x
    pad = x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))
    return torch.cat([x, pad])


def row_chunks(hidden: Tensor, rows: Tensor, dtype: torch.dtype, temperature: float):
    """``(start, end, hᵀ / temperature)`` per chunk of selected rows, ``[H, ROW_CHUNK]``: the
    temperature divides the chunk's rows once instead of every logits tile."""
    for s in range(0, rows.numel(), ROW_CHUNK):
        e = min(s + ROW_CHUNK, rows.numel())
        h_t = _padded(hidden[rows[s:e]].to(dtype), ROW_CHUNK).T.contiguous()
        yield s, e, tempered(h_t, temperature)


def tempered(x: Optional[Tensor], temperature: float) -> Optional[Tensor]:
    # dividing by 1 is exact: skipping it changes no bit
    return x / temperature if x is not None and temperature != 1.0 else x


def logits_tile(h_t: Tensor, w: Tensor, bias_t: Optional[Tensor], c: int) -> Tensor:
    """Logits of vocabulary entries ``[c, c + VOCAB_TILE)``, ``[tile, ROW_CHUNK]`` (fresh), from
    tempered rows ``h_t`` and tempered bias ``bias_t``."""
    z = w[c : c + VOCAB_TILE] @ h_t
    if bias_t is not None:
        z += bias_t[c : c + VOCAB_TILE, None]
    return z


def _rows_by_tile(targets: Tensor) -> dict[int, Tensor]:
    """The chunk's rows grouped by the vocabulary tile (start column) their target lies in."""
    tiles = targets // VOCAB_TILE
    order = torch.argsort(tiles, stable=True)
    starts, counts = torch.unique_consecutive(tiles[order], return_counts=True)
    return {t * VOCAB_TILE: rows for t, rows in zip(starts.tolist(), order.split(counts.tolist()))}


def _without_autocast(fn):
    """Run ``fn`` with autocast off on its first argument's device: its products must be in
    ``compute_dtype`` even when called inside an autocast region (verl's actor runs one)."""

    @functools.wraps(fn)
    def run(first: Tensor, *args, **kwargs):
        with torch.autocast(first.device.type, enabled=False):
            return fn(first, *args, **kwargs)

    return run


@_without_autocast
def selected_logprob_forward(
    hidden: Tensor,
    weight: Tensor,
    rows: Tensor,
    targets: Tensor,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
    with_entropy: bool = True,
    raw_target: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log-prob, entropy, log-sum-exp) of ``hidden[rows]`` at ``targets``, each ``[n]``.

    ``hidden`` is ``[T, H]``, ``weight`` ``[V, H]``, ``rows``/``targets`` int64 ``[n]``.
    Results are in ``compute_dtype``; without ``with_entropy`` the entropy is left empty.
    ``raw_target`` (a vocabulary shard, ``vocab_parallel``): the first output is the target's
    logit instead of its log-prob, 0 where the target lies outside ``[0, V)`` (another shard).
    Per row, over the tiles: the running max ``top``, ``total = Σ exp(z - top)`` and
    ``zsum = Σ exp(z - top)(z - top)`` (the entropy ``log total - zsum / total`` is then
    free of the cancellation ``lse - Σ p z``), each rescaled when ``top`` grows.
    """
    w = weight.to(compute_dtype)
    b = tempered(None if bias is None else bias.to(compute_dtype), temperature)
    n, V = rows.numel(), w.shape[0]
    dev = hidden.device
    logp = torch.empty(n, dtype=compute_dtype, device=dev)
    entropy = torch.empty(n if with_entropy else 0, dtype=compute_dtype, device=dev)
    lse = torch.empty_like(logp)
    for s, e, h_t in row_chunks(hidden, rows, compute_dtype, temperature):
        tgt = _padded(targets[s:e], ROW_CHUNK)
        top = torch.full((ROW_CHUNK,), -float("inf"), dtype=compute_dtype, device=dev)
        total, zsum, tgt_logit = (torch.zeros(ROW_CHUNK, dtype=compute_dtype, device=dev) for _ in range(3))
        by_tile = _rows_by_tile(tgt)
        for c in range(0, V, VOCAB_TILE):
            z = logits_tile(h_t, w, b, c)
            hit = by_tile.get(c)
            if hit is not None:
                tgt_logit[hit] = z[tgt[hit] - c, hit]
            new_top = torch.maximum(top, z.amax(0))
            shift = torch.where(total > 0, top - new_top, 0.0)  # ≤ 0; 0 before the first finite logit
            scale = shift.exp()
            z -= torch.where(torch.isfinite(new_top), new_top, 0.0)
            u = torch.exp(z)
            if with_entropy:
                zsum = scale * (zsum + shift * total) + (u * z).nan_to_num_(0.0).sum(0)
            total = scale * total + u.sum(0)
            top = new_top
        log_total = total.log()[: e - s]
        lse[s:e] = top[: e - s] + log_total
        logp[s:e] = tgt_logit[: e - s] if raw_target else tgt_logit[: e - s] - lse[s:e]
        if with_entropy:
            entropy[s:e] = log_total - zsum[: e - s] / total[: e - s]
    return logp, entropy, lse


@_without_autocast
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
    per_scored_row: bool = False,
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients ``(d hidden [T, H], d weight [V, H], d bias [V])`` in ``compute_dtype``;
    each is None when ``need`` (hidden, weight, bias) does not ask for it (or without bias).
    ``per_scored_row``: d hidden is ``[n, H]``, one row per scored row, not scattered into
    ``[T, H]`` (a vocabulary shard's part, summed over the group before the scatter). A
    target outside ``[0, V)`` (on another shard) adds no one-hot term.

    With ``z`` the tempered logits and ``p = softmax(z)``: ``d z = g (onehot - p)`` from the
    log-prob and ``- g_H p (log p + entropy)`` from the entropy; the product rule through
    ``z = (h Wᵀ + b) / T`` gives the rest. Rows not selected get zero gradient; a row
    selected twice gets the sum. Padding rows of a chunk have zero upstream gradient.
    """
    need_hidden, need_weight, need_bias = need
    w = weight.to(compute_dtype)
    b = tempered(None if bias is None else bias.to(compute_dtype), temperature)
    V = w.shape[0]
    d_shape = (rows.numel(), hidden.shape[1]) if per_scored_row else hidden.shape
    d_hidden = torch.zeros(d_shape, dtype=compute_dtype, device=hidden.device) if need_hidden else None
    d_weight = torch.zeros(w.shape, dtype=compute_dtype, device=hidden.device) if need_weight else None
    d_bias = torch.zeros(V, dtype=compute_dtype, device=hidden.device) if need_bias and bias is not None else None

    def chunk(t: Tensor, s: int, e: int) -> Tensor:
        return _padded(t[s:e].to(compute_dtype), ROW_CHUNK)

    for s, e, h_t in row_chunks(hidden, rows, compute_dtype, temperature):
        g, lse_c, tgt = chunk(grad_logp, s, e), chunk(lse, s, e), _padded(targets[s:e], ROW_CHUNK)
        if grad_entropy is not None:
            g_ent, entropy_c = chunk(grad_entropy, s, e), chunk(entropy, s, e)
        d_h_t = torch.zeros_like(h_t) if d_hidden is not None else None
        by_tile = _rows_by_tile(tgt)
        for c in range(0, V, VOCAB_TILE):
            z = logits_tile(h_t, w, b, c)
            log_p = z.sub_(lse_c)
            p = torch.exp(log_p)
            if grad_entropy is not None:  # log_p becomes the entropy term - g_H p (log p + entropy)
                log_p.masked_fill_(p == 0, 0.0).add_(entropy_c).mul_(p).mul_(-g_ent)  # masked (-inf) entries: 0
            dz = p.mul_(-g)
            hit = by_tile.get(c)
            if hit is not None:
                dz[tgt[hit] - c, hit] += g[hit]
            if grad_entropy is not None:
                dz += log_p
            w_tile = w[c : c + VOCAB_TILE]
            if d_h_t is not None:
                d_h_t += w_tile.T @ dz
            if d_weight is not None:  # h_t is already h / temperature
                d_weight[c : c + VOCAB_TILE] += dz @ h_t.T
            if d_bias is not None:
                d_bias[c : c + VOCAB_TILE] += dz.sum(1)
        if d_hidden is not None and per_scored_row:
            d_hidden[s:e] = tempered(d_h_t, temperature).T[: e - s]
        elif d_hidden is not None:
            d_hidden.index_add_(0, rows[s:e], tempered(d_h_t, temperature).T[: e - s])
    return d_hidden, d_weight, tempered(d_bias, temperature)
