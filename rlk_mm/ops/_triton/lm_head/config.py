"""``LMHeadConfig``: every tile, launch setting and budget of the LM-head kernels.

One frozen config for the family, a function of the dtype and the device (and, for a decode
batch, of the rows, with the same per-row arithmetic): the selected log-prob's, the fused
loss's and the sampler's tiles are one, so a token's log-prob is the same bits in each.
``partial_columns``: the vocabulary columns one partial covers; ``Exchange``: the type of a
vocabulary shard's exchange of partials.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..._head_inputs import VOCAB_ALIGN
from .._common import TileConfig

Tensor = torch.Tensor
#: a vocabulary shard's exchange (``_vocab_parallel``): (this shard's partials ``[k, n_parts, m]``
#: fp32, its target logits ``[m]`` (0 where the target is on another shard), the chunk's first
#: scored row, columns per partial) -> (every shard's partials ``[k, total parts, m]`` in
#: vocabulary order, each row's target logit ``[m]`` from the shard that holds it); collective
Exchange = Callable[[Tensor, Tensor, int, int], tuple[Tensor, Tensor]]

__all__ = ["default_config", "Exchange", "LMHeadConfig", "partial_columns", "VOCAB_ALIGN"]


@dataclass(frozen=True)
class LMHeadConfig(TileConfig):
    """Tiles (``TileConfig``), launch settings and workspace budgets of the LM-head kernels:
    the selected log-prob (``logprob``), the fused policy loss (``linear_loss``) and sampling
    from hidden states (``sampling.hidden``, whose tiles must be the selected log-prob's).

    Tiles depend on the dtype and device (``block_m`` also on the rows, which leaves every
    row's arithmetic as it is), so a row's reduction order is fixed. ``tma``: read tiles with
    the copy engine (tensor descriptors) where alignment allows. ``partials_budget``: bytes of
    per-(row, segment) partials one forward launch may hold. ``dz_budget``: bytes of the
    backward's ``dz`` chunk ``[rows, chunk]``; its size sets the vocabulary columns per chunk
    (184 MiB: 5888 columns at 16,384 rows, a width at which cuBLAS's chunk products ran faster
    than at wider ones; ``bench/bench_logprob.py --sweep`` re-times budgets).
    ``linear_budget``: bytes of the fused loss's chunk workspace (a chunk's ``[rows, V]``
    logits, fp32 d hidden rows and partials: its rows per chunk). ``hidden_budget``: bytes of
    the backward's fp32 d hidden rows held at once (its rows per pass over the vocabulary, for
    16-bit hidden states). ``combine_block`` / ``combine_lanes``: rows per program and lanes
    (partials folded at once, a power of two) of the combine kernel. ``dz_block_m`` /
    ``dz_warps``: rows per program and warps of the fused loss's in-place ``dz`` pass, a
    memory-bound pass, so a small tile (no register spills). ``scale_block`` /
    ``scale_warps``: entries per program and warps of the fused loss's gradient scale."""

    tma: bool = True
    partials_budget: int = 128 << 20
    dz_budget: int = 184 << 20
    linear_budget: int = 960 << 20
    hidden_budget: int = 256 << 20
    combine_block: int = 4
    combine_lanes: int = 128
    dz_block_m: int = 16
    dz_warps: int = 8
    scale_block: int = 8192
    scale_warps: int = 8


def default_config(dtype: torch.dtype, device: torch.device, rows: Optional[int] = None) -> LMHeadConfig:
    """The tuned settings (``bench_logprob.py --sweep``) for dtype and device. 16-bit tiles
    on CUDA take 64 rows instead of 128 when at most 64 are computed (``rows``: a decode
    batch): one read of W instead of half-empty tiles. Such a batch only streams W, so its
    tiles are 128 columns wide (twice the tiles: a partly filled last wave costs half as
    much), with one warpgroup and a deeper pipeline, and its combine takes a row per program
    (64 rows in blocks of 4 would leave most of the GPU idle). The arithmetic per row
    is the same in every case (each warpgroup's tensor-core product covers 64 rows and its
    columns one by one, a partial covers 128 columns in any tile, and the combine's order does
    not depend on its rows per program; ``test_logprob_gpu`` checks them bitwise), so the
    choice never changes a result."""
    if device.type != "cuda":  # Triton's interpreter (tests): small tiles, fast enough
        return LMHeadConfig(block_m=16, block_n=32, block_k=16, group_m=4, num_warps=1, num_stages=1,
                             combine_block=4, combine_lanes=4)
    if dtype == torch.float32:  # exact fp32 dot products (no TF32): FMA path
        return LMHeadConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=2)
    if rows is not None and rows <= 64:
        return LMHeadConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4,
                             combine_block=1)
    return LMHeadConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)


def partial_columns(cfg: LMHeadConfig) -> int:
    """Vocabulary columns per partial: a ``VOCAB_ALIGN`` segment, or a tile narrower than one
    (which divides it). Partial ``j`` covers columns ``[j·cols, (j + 1)·cols)`` of the shard."""
    cols = min(cfg.block_n, VOCAB_ALIGN)
    if cfg.block_n % cols or VOCAB_ALIGN % cols:
        raise ValueError(f"block_n={cfg.block_n} must be a multiple or a divisor of VOCAB_ALIGN={VOCAB_ALIGN}")
    return cols
