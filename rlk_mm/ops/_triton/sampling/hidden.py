"""Triton kernels of sampling from hidden states, the LM head fused with sampling.

Its tiles are the selected log-prob's (``lm_head``: ``logits_tile``, the same config, the
same per-segment partials, and ``combine_kernel``), so ``log_probs`` equal
``selected_logprob``'s bitwise. Plain temperature is one pass: each tile also keeps, per
row, its best noise block (score and the block's 32 logits), and the draw finishes on those
``[tiles, B, 32]`` values; no ``[B, V]`` logits are written. Filters need the whole row: the
same launch also writes the rows' logits (a row chunk at a time, within
``SamplingConfig.logits_budget``) and ``sample_logits`` reads them back, a second pass.

A vocabulary shard (``_vocab_parallel``, ``shard=``) draws what the single device draws: noise
is keyed by global vocabulary indices; for plain temperature each rank's best noise block
(the first on a tie) is gathered and the draw finishes on the group's best (the first rank
on a tie: the first block of the whole vocabulary, as on one device); filters gather the
rows' logits (``[B, V]`` fp32 per chunk: a top-k/top-p/min-p threshold needs the whole row);
the log-probs fold the gathered partials of every shard, as ``selected_logprob`` does.

Roofline of the plain path (one row chunk): the tiles kernel reads the head once per
``block_m`` rows (2VH bytes in bf16, the same as the logits GEMM at B <= block_m) and never
writes logits; beyond the GEMM its epilogue computes one exp per logit (the log-sum-exp
partials ``selected_logprob`` computes anyway), one noise value per 32 logits (fp32; float64
only for the blocks near the best, ``noise.best_noise_block``) and writes a noise block per
row per tile. Then three small launches, each a few microseconds: the draw's
finish (``finish_tiles`` tiles' scores per row compared at once), the combine (lanes of
partials at once, ``lm_head.combine_kernel``) and the rows' status. So the plain path's cost
over the GEMM is the tile kernel's speed at small B against cuBLAS's: its tiles are
``lm_head.default_config``'s, the selected log-prob's, and must stay so (the log-probs are
``selected_logprob``'s bitwise); a decode batch of at most 64 rows takes 64 x 128 tiles
there, one read of W.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..._torch import sampling as _ref
from .._common import equal_chunks
from ..lm_head import (
    Operands,
    bias_arg,
    default_config,
    exchange_and_combine,
    ieee,
    partial_columns,
    store_partials,
    tile_logits,
)
from .config import SamplingConfig
from .config import default_config as sampling_config
from .logits import empty_results, sample_logits
from .noise import NOISE_BLOCK, SALT_BLOCK, SALT_TOKEN, best_noise_block, gumbel, no_nan, row_keys

Tensor = torch.Tensor

__all__ = ["sample_hidden"]


# ------------------------------------------------------------------ from hidden states
@triton.jit
def _hidden_tiles_kernel(
    h_src, w_src, b_ptr, rows_ptr, seeds_ptr, steps_ptr,
    part_max_ptr, part_sum_ptr, best_ptr, best_block_ptr, best_z_ptr, z_ptr,
    n_rows, V, H, stride_h, stride_w, inv_temp, n_vblocks, n_parts, first_block,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, DRAW: tl.constexpr,
    STORE_Z: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SEG: tl.constexpr,
):
    """Per tile: the selected log-prob's per-segment partials (max, Σ exp); with ``DRAW`` each
    row's best noise block of the tile (score, global index, its logits; ``first_block``: the
    shard's first noise block in the whole vocabulary); with ``STORE_Z`` the logits."""
    pid_n, offs_m, m_ok, offs_n, n_ok, z = tile_logits(
        h_src, w_src, b_ptr, rows_ptr, n_rows, V, H, stride_h, stride_w, inv_temp, n_vblocks,
        HAS_BIAS, IEEE, EVEN_K, TMA, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    store_partials(z, pid_n, offs_m, m_ok, n_rows, n_parts, part_max_ptr, part_sum_ptr, part_sum_ptr,
                   False, BLOCK_M, BLOCK_N, SEG)  # as forward_tiles_kernel of the selected log-prob
    if STORE_Z:
        tl.store(z_ptr + offs_m.to(tl.int64)[:, None] * V + offs_n[None, :], z, mask=m_ok[:, None] & n_ok[None, :])
    if DRAW:
        NB: tl.constexpr = BLOCK_N // NOISE_BLOCK
        zb = tl.reshape(z, (BLOCK_M, NB, NOISE_BLOCK))
        mb = tl.max(zb, 2)
        safe = tl.where(mb == -float("inf"), 0.0, mb)
        ell = tl.where(mb == -float("inf"), -float("inf"), safe + tl.log(tl.sum(tl.exp(zb - safe[:, :, None]), 2)))
        ka, kb = row_keys(tl.load(seeds_ptr + offs_m, mask=m_ok, other=0),
                           tl.load(steps_ptr + offs_m, mask=m_ok, other=0), SALT_BLOCK)
        blocks = first_block + pid_n * NB + tl.arange(0, NB)
        best, block = best_noise_block(ell, blocks[None, :], ka, kb)
        arg = block - (first_block + pid_n * NB)
        tile = pid_n * n_rows + offs_m
        tl.store(best_ptr + tile, best, mask=m_ok)
        tl.store(best_block_ptr + tile, block, mask=m_ok)
        mine = tl.arange(0, NB)[None, :, None] == arg[:, None, None]
        z_best = tl.max(tl.where(mine, zb, -float("inf")), 1)  # [BLOCK_M, NOISE_BLOCK], exact values
        out = best_z_ptr + tile[:, None].to(tl.int64) * NOISE_BLOCK + tl.arange(0, NOISE_BLOCK)[None, :]
        tl.store(out, z_best, mask=m_ok[:, None])


def sample_hidden(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], temperature: float,
                  filters: _ref.Filters, seeds: Tensor, steps: Tensor,
                  config: Optional[SamplingConfig] = None, shard=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``sample_logits`` of ``(hidden · Wᵀ + bias) / temperature`` (``hidden [B, H]``, rows
    contiguous), ``log_probs`` from the selected log-prob's partials and combine. The tiles
    are the selected log-prob's (``lm_head.default_config``); ``config`` replaces the
    sampling kernels' ``default_config``. ``shard`` (``_vocab_parallel.shard.Exchange``): this
    rank's place in a vocabulary-parallel group (``start``, ``total``) and its collectives
    (called: the exchange of partials; ``gather_best``, ``gather_logits``); every rank then returns
    the single device's result for the whole vocabulary."""
    B, (V, H) = hidden.shape[0], weight.shape
    dev = hidden.device
    cfg = default_config(weight.dtype, dev, rows=B)
    scfg = config or sampling_config(dev)
    assert cfg.block_n % _ref.NOISE_BLOCK == 0
    cols = partial_columns(cfg)
    total = V if shard is None else shard.total
    tokens, log_probs, sampled, status = empty_results(B, dev)
    if B == 0:
        return tokens, log_probs, sampled, status
    rows = torch.arange(B, device=dev)
    ops = Operands(hidden, weight, rows, cfg, all_rows=True)
    n_vblocks, n_parts = triton.cdiv(V, cfg.block_n), triton.cdiv(V, cols)
    draw = filters.plain
    copies = 1 if shard is None else 2  # a shard also holds the gathered partials (and logits)
    tiles = triton.cdiv(total, cfg.block_n)  # sizes from the whole vocabulary: every rank cuts the same chunks
    per_row = (triton.cdiv(total, cols) * 4 * 2 * copies
               + (tiles * (8 + 4 + 4 * _ref.NOISE_BLOCK) if draw else 4 * total * copies))
    budget = min(cfg.partials_budget, scfg.logits_budget)
    step = min(B, equal_chunks(B, budget // per_row, cfg.block_m))
    parts = torch.empty((2, n_parts * step), dtype=torch.float32, device=dev)
    best = torch.empty(n_vblocks * step if draw else 1, dtype=torch.float64, device=dev)
    best_block = torch.empty(best.numel(), dtype=torch.int32, device=dev)
    best_z = torch.empty(best.numel() * _ref.NOISE_BLOCK if draw else 1, dtype=torch.float32, device=dev)
    z_buf = torch.empty(1 if draw else step * V, dtype=torch.float32, device=dev)
    z_tok = torch.empty(step, dtype=torch.float32, device=dev)
    lse = torch.empty(step, dtype=torch.float32, device=dev)
    for s in range(0, B, step):
        m = min(step, B - s)
        h_src, w_src, rows_s = ops.args(s, m)
        seeds_s, steps_s = seeds[s : s + m], steps[s : s + m]
        _hidden_tiles_kernel[(triton.cdiv(m, cfg.block_m) * n_vblocks,)](
            h_src, w_src, bias_arg(bias, weight), rows_s, seeds_s, steps_s,
            parts[0], parts[1], best, best_block, best_z, z_buf,
            m, V, H, hidden.stride(0), weight.stride(0), 1.0 / temperature, n_vblocks, n_parts,
            0 if shard is None else shard.start // _ref.NOISE_BLOCK,
            HAS_BIAS=bias is not None, IEEE=ieee(weight), EVEN_K=H % cfg.block_k == 0, TMA=ops.tma,
            DRAW=draw, STORE_Z=not draw,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SEG=cols,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if draw:
            cand, n_cand = (best, best_block, best_z), n_vblocks
            if shard is not None:  # each rank's best tile, then the group's: every rank finishes alike
                cand = shard.gather_best(*_best_tile(best, best_block, best_z, n_vblocks, m))
                n_cand = shard.world
            _finish_draw_kernel[(triton.cdiv(m, scfg.finish_rows),)](
                *cand, seeds_s, steps_s, tokens[s:], z_tok, m, n_cand, BLOCK=scfg.finish_rows, TILES=scfg.finish_tiles)
        else:
            z = z_buf[: m * V].view(m, V)
            if shard is not None:
                z = shard.gather_logits(z)
            tok, _, slp, st = sample_logits(z, 1.0, filters, seeds_s, steps_s, config=scfg)
            tokens[s : s + m], z_tok[:m] = tok, z.gather(1, tok[:, None])[:, 0]
            sampled[s : s + m], status[s : s + m] = slp, st
        # a shard's exchange gathers the partials; the drawn token's logit is the same on every rank already
        exchange_and_combine(cfg, parts, z_tok, s, m, n_parts, False, log_probs[s:], log_probs, lse, shard)
        _row_status_kernel[(triton.cdiv(m, scfg.status_block),)](
            log_probs[s:], sampled[s:], tokens[s:], status[s:], lse, m, PLAIN=draw, OK=_ref.OK,
            NOT_FINITE=_ref.NOT_FINITE, ALL_MASKED=_ref.ALL_MASKED, BLOCK=scfg.status_block)
    return tokens, log_probs, sampled, status


@triton.jit
def _row_status_kernel(lp_ptr, slp_ptr, tok_ptr, status_ptr, lse_ptr, n_rows, PLAIN: tl.constexpr, OK: tl.constexpr,
                       NOT_FINITE: tl.constexpr, ALL_MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """A chunk's bad rows as the torch backend gives them: token 0, log-probs NaN. Plain
    temperature also finds the status (a log-prob that is not finite: ``ALL_MASKED`` where the
    log-sum-exp is -inf, every logit -inf; else ``NOT_FINITE``, a NaN or +inf logit from hidden,
    weight or bias) and writes the sampled log-prob, the log-prob; filters read the status
    ``sample_logits`` wrote. One launch for what would be several elementwise torch ops a step."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_rows
    lp = tl.load(lp_ptr + offs, mask=ok, other=0.0)
    if PLAIN:
        finite = (lp == lp) & (tl.abs(lp) != float("inf"))
        masked = tl.load(lse_ptr + offs, mask=ok, other=0.0) == -float("inf")
        status = tl.where(finite, OK, tl.where(masked, ALL_MASKED, NOT_FINITE)).to(tl.int8)
        tl.store(status_ptr + offs, status, mask=ok)
    else:
        status = tl.load(status_ptr + offs, mask=ok, other=OK)
    bad = status != OK
    lp = tl.where(bad, float("nan"), lp)
    tl.store(lp_ptr + offs, lp, mask=ok)
    if PLAIN:
        tl.store(slp_ptr + offs, lp, mask=ok)
        tl.store(tok_ptr + offs, 0, mask=ok & bad)


def _best_tile(best: Tensor, best_block: Tensor, best_z: Tensor, n_tiles: int, m: int):
    """Each row's best tile of this shard (the first on a tie, as ``_finish_draw_kernel``):
    its score (f64), noise block (int32) and that block's logits ``[m, NOISE_BLOCK]``."""
    scores = best[: n_tiles * m].view(n_tiles, m)
    j = torch.argmax(scores, 0)  # the first of equal maxima
    at = j * m + torch.arange(m, device=best.device)
    return scores.flatten()[at], best_block[at], best_z.view(-1, _ref.NOISE_BLOCK)[at]


@triton.jit
def _finish_draw_kernel(best_ptr, best_block_ptr, best_z_ptr, seeds_ptr, steps_ptr, tok_ptr, z_tok_ptr,
                        n_rows, n_vblocks, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """Per row: the tile with the best noise block (the first on a tie, as the block draw over
    the whole row), then the token by Gumbel-max inside that block, and its logit."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_rows
    best = tl.full([BLOCK], -float("inf"), tl.float64)
    tile = tl.zeros([BLOCK], tl.int32)
    tiles = tl.arange(0, TILES)
    for j0 in range(0, n_vblocks, TILES):  # TILES tiles' scores at once; a later chunk wins only if better
        j = j0 + tiles
        scores = tl.load(best_ptr + j[None, :] * n_rows + offs[:, None], mask=ok[:, None] & (j < n_vblocks)[None, :],
                         other=-float("inf"))
        chunk_best = tl.max(scores, 1)
        first = tl.min(tl.where(scores == chunk_best[:, None], j[None, :], 2**31 - 1), 1)  # the first on a tie
        better = chunk_best > best
        tile = tl.where(better, first, tile)
        best = tl.where(better, chunk_best, best)
    at = tile.to(tl.int64) * n_rows + offs
    block = tl.load(best_block_ptr + at, mask=ok, other=0)
    lanes = tl.arange(0, NOISE_BLOCK)
    z = tl.load(best_z_ptr + at[:, None] * NOISE_BLOCK + lanes[None, :], mask=ok[:, None], other=-float("inf"))
    ka, kb = row_keys(tl.load(seeds_ptr + offs, mask=ok, other=0), tl.load(steps_ptr + offs, mask=ok, other=0),
                       SALT_TOKEN)
    cols = block[:, None] * NOISE_BLOCK + lanes[None, :]
    j = tl.argmax(no_nan(z.to(tl.float64) + gumbel(cols, ka[:, None], kb[:, None])), 1)
    tl.store(tok_ptr + offs, (block * NOISE_BLOCK + j).to(tl.int64), mask=ok)
    tl.store(z_tok_ptr + offs, tl.max(tl.where(lanes[None, :] == j[:, None], z, -float("inf")), 1), mask=ok)
