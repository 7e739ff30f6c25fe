"""Plain-torch selected log-prob: the CPU backend and the oracle of the tests.

Logits ``z = (h · Wᵀ + bias) / temperature`` are formed one tile at a time: ``ROW_CHUNK``
rows (the last chunk zero-padded to that size) by ``VOCAB_TILE`` vocabulary entries,
transposed (``[tile, rows]``: on a CPU that product is the faster way round, and the tile
stays in cache). A tile is a batch of matrix products, one per 128-column segment of the
global grid (``VOCAB_ALIGN``; ``logits_tile``), each of one fixed shape: a CPU BLAS may sum a
product's entries in an order that depends on the entry's row in the product, so a
segment's logits are always computed at the same rows of the same product, wherever the
segment sits in a tile or in a vocabulary shard. Each segment is reduced to per-row
partials (max, Σ exp(z - max), Σ exp(z - max)·(z - max)); a row's partials over the whole
vocabulary are then combined (``combine_partials``): the max over segments, then each
rescaled sum over the segments in vocabulary order, per row of a fixed-shape tensor. So a
row's result depends neither on the other rows (batch invariance) nor on how the
vocabulary is split over ranks (``_vocab_parallel`` gathers every shard's partials in
between, ``exchange``). Memory stays at one tile and one row chunk's partials (``[V / 128,
ROW_CHUNK]``), never ``[n, V]``. ``compute_dtype=torch.float64`` gives the oracle the tests
compare against.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from .._head_inputs import VOCAB_ALIGN
from ..invariant.mode import stock_kernels

__all__ = [
    "chunk_partials", "combine_partials", "Exchange", "head_kernels", "logits_tile", "ROW_CHUNK", "row_chunks", "selected_logprob_backward",
    "selected_logprob_forward", "tempered", "VOCAB_ALIGN", "VOCAB_TILE",
]

Tensor = torch.Tensor

#: rows per matrix product; a constant so that products have one shape whatever ``n`` is
ROW_CHUNK = 128
#: vocabulary entries per logits tile (``[VOCAB_TILE, ROW_CHUNK]`` fp32 is 2 MiB): 32 segments
VOCAB_TILE = 32 * VOCAB_ALIGN
#: a vocabulary shard's exchange (``_vocab_parallel``; as ``_triton.lm_head.Exchange``): (this
#: shard's partials ``[k, segments, m]``, its target logits ``[m]``, the first row, columns per
#: partial) -> (every shard's partials in vocabulary order, each row's target logit)
Exchange = Callable[[Tensor, Tensor, int, int], tuple[Tensor, Tensor]]


def head_kernels(fn):
    """Run ``fn`` with autocast off on its first argument's device and, inside
    ``batch_invariant()``, with the stock kernels: its products must be in ``compute_dtype``
    even inside an autocast region (verl's actor runs one), and they fix their own order
    (fixed-shape, zero-padded chunks), so the op gives the same bits inside and outside the
    mode whoever calls it (the mode's per-row product would be slower and round otherwise).
    Wraps each op's entry (once per call, not per tile)."""

    @functools.wraps(fn)
    def run(first: Tensor, *args, **kwargs):
        with torch.autocast(first.device.type, enabled=False), stock_kernels():
            return fn(first, *args, **kwargs)

    return run


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


def _segment_logits(h_t: Tensor, w: Tensor, bias_t: Optional[Tensor], c: int) -> tuple[Tensor, int]:
    """``([segments, VOCAB_ALIGN, ROW_CHUNK] logits, columns)`` of vocabulary entries ``[c, c +
    VOCAB_TILE)`` (fewer at the end; a last partial segment is padded with -inf): one product
    of one shape per segment (``torch.bmm``), so an entry's bits depend on its place in its
    segment only."""
    cols = min(VOCAB_TILE, w.shape[0] - c)
    segs = -(-cols // VOCAB_ALIGN)
    w_tile = w[c : c + cols]
    if cols < segs * VOCAB_ALIGN:
        w_tile = _padded(w_tile, segs * VOCAB_ALIGN)
    z = torch.bmm(w_tile.view(segs, VOCAB_ALIGN, w.shape[1]), h_t.expand(segs, *h_t.shape))
    flat = z.view(segs * VOCAB_ALIGN, h_t.shape[1])
    if bias_t is not None:
        flat[:cols] += bias_t[c : c + cols, None]
    if cols < segs * VOCAB_ALIGN:
        flat[cols:] = -float("inf")
    return z, cols


def logits_tile(h_t: Tensor, w: Tensor, bias_t: Optional[Tensor], c: int) -> Tensor:
    """Logits of vocabulary entries ``[c, c + VOCAB_TILE)``, ``[tile, ROW_CHUNK]`` (fresh), from
    tempered rows ``h_t`` and tempered bias ``bias_t``; an entry's bits are the same whatever
    ``c`` is, for a ``w`` that starts on the segment grid."""
    z, cols = _segment_logits(h_t, w, bias_t, c)
    return z.view(-1, h_t.shape[1])[:cols]


def _tile_partials(z: Tensor, with_entropy: bool) -> list[Tensor]:
    """Per (segment, row) of ``z [segments, VOCAB_ALIGN, rows]`` (changed in place): max,
    Σ exp(z - max) and with ``with_entropy`` Σ exp(z - max)·(z - max), each ``[segments, rows]``;
    a segment masked whole (-inf) has max -inf and sums 0."""
    top = z.amax(1)
    z -= torch.where(top == -float("inf"), 0.0, top)[:, None, :]
    u = torch.exp(z)
    out = [top, u.sum(1)]
    if with_entropy:
        out.append(u.mul_(z).nan_to_num_(0.0).sum(1))  # masked entries: 0 x -inf -> 0
    return out


def chunk_partials(h_t: Tensor, w: Tensor, bias_t: Optional[Tensor], with_entropy: bool,
                   on_tile: Optional[Callable[[int, Tensor], None]] = None) -> Tensor:
    """The partials ``[k, segments, ROW_CHUNK]`` (``_tile_partials``, k = 2 or 3) of one row
    chunk ``h_t`` over the vocabulary of ``w``, tile by tile; ``on_tile(c, logits)`` sees each
    tile's logits ``[cols, ROW_CHUNK]`` (entries ``[c, c + cols)``) before they are reduced."""
    tiles = []
    for c in range(0, w.shape[0], VOCAB_TILE):
        z, cols = _segment_logits(h_t, w, bias_t, c)
        if on_tile is not None:
            on_tile(c, z.view(-1, h_t.shape[1])[:cols])
        tiles.append(_tile_partials(z, with_entropy))
    k = 3 if with_entropy else 2
    if not tiles:
        return torch.empty((k, 0, h_t.shape[1]), dtype=h_t.dtype, device=h_t.device)
    return torch.stack([torch.cat([t[i] for t in tiles]) for i in range(k)])


def combine_partials(parts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(log-sum-exp, log Σ exp(z - max), Σ p·(z - max) · Σ exp(z - max))`` per row from the
    partials ``[k, segments, rows]`` of the whole vocabulary (k = 2, or 3 with the entropy
    sums; the third output is empty for k = 2): the max over segments, then the rescaled sums
    over segments in vocabulary order, per row of one ``[rows, segments]`` tensor."""
    seg_max = parts[0].T.contiguous()
    top = seg_max.amax(1)
    shift = seg_max - torch.where(top == -float("inf"), 0.0, top)[:, None]  # <= 0; -inf for a masked segment
    scale = torch.exp(shift)
    seg_sum = parts[1].T.contiguous()
    total = (seg_sum * scale).sum(1)
    zsum = parts[0][:0, 0]
    if parts.shape[0] == 3:
        seen = torch.where(scale > 0, shift, 0.0)
        zsum = (scale * (parts[2].T.contiguous() + seen * seg_sum)).sum(1)
    log_total = total.log()
    return top + log_total, log_total, zsum / total if zsum.numel() else zsum


def _rows_by_tile(targets: Tensor) -> dict[int, Tensor]:
    """The chunk's rows grouped by the vocabulary tile (start column) their target lies in."""
    tiles = targets // VOCAB_TILE
    order = torch.argsort(tiles, stable=True)
    starts, counts = torch.unique_consecutive(tiles[order], return_counts=True)
    return {t * VOCAB_TILE: rows for t, rows in zip(starts.tolist(), order.split(counts.tolist()))}


@head_kernels
def selected_logprob_forward(
    hidden: Tensor,
    weight: Tensor,
    rows: Tensor,
    targets: Tensor,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
    with_entropy: bool = True,
    exchange: Optional[Exchange] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log-prob, entropy, log-sum-exp) of ``hidden[rows]`` at ``targets``, each ``[n]``.

    ``hidden`` is ``[T, H]``, ``weight`` ``[V, H]``, ``rows``/``targets`` int64 ``[n]``.
    Results are in ``compute_dtype``; without ``with_entropy`` the entropy is left empty.
    ``exchange`` (a vocabulary shard, ``_vocab_parallel``; targets off the shard are -1): called
    once per row chunk with this shard's partials; the results are then the whole
    vocabulary's. Per row: each segment's max ``m_s``, ``Σ exp(z - m_s)`` and ``Σ exp(z -
    m_s)(z - m_s)``, combined into ``total = Σ exp(z - top)`` and ``zsum = Σ exp(z - top)(z -
    top)`` (the entropy ``log total - zsum / total`` is then free of the cancellation ``lse -
    Σ p z``).
    """
    w = weight.to(compute_dtype)
    b = tempered(None if bias is None else bias.to(compute_dtype), temperature)
    n = rows.numel()
    dev = hidden.device
    logp = torch.empty(n, dtype=compute_dtype, device=dev)
    entropy = torch.empty(n if with_entropy else 0, dtype=compute_dtype, device=dev)
    lse = torch.empty_like(logp)
    for s, e, h_t in row_chunks(hidden, rows, compute_dtype, temperature):
        tgt = _padded(targets[s:e], ROW_CHUNK)
        tgt_logit = torch.zeros(ROW_CHUNK, dtype=compute_dtype, device=dev)
        by_tile = _rows_by_tile(tgt)

        def take_targets(c: int, z: Tensor) -> None:
            hit = by_tile.get(c)
            if hit is not None:
                tgt_logit[hit] = z[tgt[hit] - c, hit]

        parts = chunk_partials(h_t, w, b, with_entropy, take_targets)
        k = parts.shape[0]
        if exchange is not None:  # every shard's partials, in vocabulary order; the owner's target logit
            got, tgt_got = exchange(parts[:, :, : e - s].contiguous(), tgt_logit[: e - s].contiguous(), s, VOCAB_ALIGN)
            parts = torch.zeros((k, got.shape[1], ROW_CHUNK), dtype=compute_dtype, device=dev)
            parts[:, :, : e - s] = got
            tgt_logit[: e - s] = tgt_got
        row_lse, log_total, mean_z = combine_partials(parts)
        lse[s:e] = row_lse[: e - s]
        logp[s:e] = tgt_logit[: e - s] - lse[s:e]
        if with_entropy:
            entropy[s:e] = log_total[: e - s] - mean_z[: e - s]
    return logp, entropy, lse


@head_kernels
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
