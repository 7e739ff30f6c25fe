"""Each row's log-prob, entropy and log-sum-exp, from its tiles' per-segment partials.

``combine_kernel`` folds a row's partials over the segments (lanes of interleaved partials in
vocabulary order, then the lanes in a fixed tree: elementwise steps only, no cross-thread
reduction whose tree would follow the launch). ``exchange_and_combine`` first gathers every
vocabulary shard's partials (a shard's ``Exchange``), then combines; ``forward_chunk`` runs a
chunk of scored rows through the forward tiles and then that, the one forward of the
selected log-prob and of the fused loss.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .config import Exchange, LMHeadConfig, partial_columns
from .operands import Operands, bias_arg, ieee
from .tiles import forward_tiles_kernel

Tensor = torch.Tensor

__all__ = ["combine_kernel", "exchange_and_combine", "forward_chunk"]


@triton.jit
def _fold(top, total, zsum, part_top, part_total, part_zsum, ok, WITH_ENTROPY: tl.constexpr):
    """The running (max, Σ exp(z - max), Σ exp(z - max)·(z - max)) with another such triple
    folded in: the max rescaling the sums as it grows (elementwise)."""
    new_top = tl.maximum(top, part_top)
    safe_top = tl.where(new_top == -float("inf"), 0.0, new_top)  # no row value seen yet
    old_shift = tl.where(total > 0, top - safe_top, 0.0)  # <= 0
    seen = ok & (part_top > -float("inf"))  # a segment masked whole adds nothing
    part_shift = tl.where(seen, part_top - safe_top, 0.0)  # <= 0
    old_scale = tl.exp(old_shift)
    part_scale = tl.where(seen, tl.exp(part_shift), 0.0)
    if WITH_ENTROPY:
        zsum = old_scale * (zsum + old_shift * total) + part_scale * (part_zsum + part_shift * part_total)
    total = old_scale * total + part_scale * part_total
    return new_top, total, zsum


@triton.jit
def combine_kernel(
    part_max_ptr, part_sum_ptr, part_zsum_ptr, tgt_logit_ptr,
    logp_ptr, entropy_ptr, lse_ptr, n_rows, n_parts,
    WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr, LANES: tl.constexpr,
):
    """Per row: log-sum-exp, log-prob and entropy from the partials ``[n_parts, n_rows]`` of
    the whole vocabulary (a shard's group passes the gathered partials of every shard).

    Partial ``j`` belongs to lane ``j % LANES``: each lane folds its partials in vocabulary
    order (``_fold``, all lanes and ``BLOCK`` rows at once, so ``LANES`` partials' loads are in
    flight per step), then the lanes fold pairwise in a fixed binary tree (lanes 2i and 2i + 1,
    then their pairs, ...). Every step is elementwise, so a row's arithmetic is this sequence
    whatever the launch's rows or the layout Triton picks: no cross-thread reduction tree.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_rows
    lanes = tl.arange(0, LANES)
    top = tl.full((BLOCK, LANES), -float("inf"), tl.float32)
    total = tl.zeros((BLOCK, LANES), tl.float32)
    zsum = tl.zeros((BLOCK, LANES), tl.float32)  # Σ exp(z - top) (z - top): entropy without cancellation
    for j0 in range(0, n_parts, LANES):
        j_ok = ok[:, None] & (j0 + lanes < n_parts)[None, :]
        at = (j0 + lanes)[None, :] * n_rows + offs[:, None]
        part_max = tl.load(part_max_ptr + at, mask=j_ok, other=-float("inf"))
        part_sum = tl.load(part_sum_ptr + at, mask=j_ok, other=0.0)
        part_zsum = part_sum
        if WITH_ENTROPY:
            part_zsum = tl.load(part_zsum_ptr + at, mask=j_ok, other=0.0)
        top, total, zsum = _fold(top, total, zsum, part_max, part_sum, part_zsum, j_ok, WITH_ENTROPY)
    for _ in tl.static_range(16):  # fold lane pairs until one lane is left (LANES <= 2^16)
        if top.shape[1] > 1:
            top_a, top_b = tl.split(tl.reshape(top, (BLOCK, top.shape[1] // 2, 2)))
            total_a, total_b = tl.split(tl.reshape(total, (BLOCK, total.shape[1] // 2, 2)))
            zsum_a, zsum_b = tl.split(tl.reshape(zsum, (BLOCK, zsum.shape[1] // 2, 2)))
            top, total, zsum = _fold(top_a, total_a, zsum_a, top_b, total_b, zsum_b, ok[:, None], WITH_ENTROPY)
    top = tl.where(ok, tl.reshape(top, (BLOCK,)), 0.0)
    total = tl.where(ok, tl.reshape(total, (BLOCK,)), 1.0)
    zsum = tl.reshape(zsum, (BLOCK,))
    log_total = tl.log(total)
    lse = top + log_total
    tl.store(lse_ptr + offs, lse, mask=ok)
    tgt_logit = tl.load(tgt_logit_ptr + offs, mask=ok, other=0.0)
    tl.store(logp_ptr + offs, tgt_logit - lse, mask=ok)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + offs, log_total - zsum / total, mask=ok)


def exchange_and_combine(cfg: LMHeadConfig, parts: Tensor, tgt_logit: Tensor, start: int, count: int, n_parts: int,
                         with_entropy: bool, logp: Tensor, entropy: Tensor, lse: Tensor,
                         exchange: Optional[Exchange] = None) -> None:
    """A chunk's rows from their tiles' partials ``parts [k, n_parts · count]`` (k = 3 with
    entropy, else 2) and target logits: a vocabulary shard's ``exchange`` first gathers every
    shard's (``start``: the chunk's first scored row), then ``combine_kernel`` writes the
    log-prob, entropy (``with_entropy``) and log-sum-exp of rows ``[0, count)`` of ``logp``,
    ``entropy`` and ``lse``."""
    k = 3 if with_entropy else 2
    every, tgt, total_parts = parts, tgt_logit, n_parts
    if exchange is not None:
        every, tgt = exchange(parts[:, : n_parts * count].view(k, n_parts, count), tgt_logit[:count], start,
                              partial_columns(cfg))
        total_parts = every.shape[1]
    combine_kernel[(triton.cdiv(count, cfg.combine_block),)](
        every[0], every[1], every[k - 1], tgt, logp, entropy, lse, count, total_parts,
        WITH_ENTROPY=with_entropy, BLOCK=cfg.combine_block, LANES=cfg.combine_lanes,
    )


def forward_chunk(ops: Operands, bias: Optional[Tensor], targets: Tensor, temperature: float, start: int,
                  count: int, parts: Tensor, tgt_logit: Tensor, logp: Tensor, entropy: Tensor, lse: Tensor,
                  with_entropy: bool, exchange: Optional[Exchange] = None, z: Optional[Tensor] = None) -> None:
    """Scored rows ``[start, start + count)`` through the forward: ``forward_tiles_kernel``'s
    partials (into ``parts``) and target logits (into ``tgt_logit``; with ``z``, a ``[count, V]``
    buffer in the weight's dtype, also the tiles' logits less their segment's max), then
    ``exchange_and_combine``: the rows' log-prob, entropy (``with_entropy``) and log-sum-exp,
    written to ``logp``, ``entropy`` and ``lse`` from ``start`` on (targets off a shard are -1)."""
    cfg, hidden, weight = ops.cfg, ops.hidden, ops.weight
    V, H = weight.shape
    cols = partial_columns(cfg)
    n_vblocks, n_parts = triton.cdiv(V, cfg.block_n), triton.cdiv(V, cols)
    k = 3 if with_entropy else 2
    if exchange is not None:  # only the program holding a row's target writes its logit
        tgt_logit.zero_()
    h_src, w_src, rows = ops.args(start, count)
    forward_tiles_kernel[(triton.cdiv(count, cfg.block_m) * n_vblocks,)](
        h_src, w_src, bias_arg(bias, weight), rows, targets[start:],
        parts[0], parts[1], parts[k - 1], tgt_logit, parts if z is None else z,
        count, V, H, hidden.stride(0), weight.stride(0), 1.0 / temperature, n_vblocks, n_parts,
        HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy, IEEE=ieee(weight),
        EVEN_K=H % cfg.block_k == 0, TMA=ops.tma,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SEG=cols,
        STORE_Z=z is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    exchange_and_combine(cfg, parts, tgt_logit, start, count, n_parts, with_entropy, logp[start:],
                         entropy[start:] if with_entropy else entropy, lse[start:], exchange)
