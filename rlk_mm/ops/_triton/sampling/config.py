"""``SamplingConfig``: the blocks, caps and launch settings of the sampling kernels.

One frozen config for the family (``logits.sample_logits`` and ``hidden.sample_hidden``): a
function of the device only, never of the batch, so that a row's arithmetic never depends on
B (``bench/bench_sampling.py --warps`` re-times CUDA's launch settings). The interpreter's are
small, so that the CPU tests walk several blocks and chunks and take every path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["default_config", "SamplingConfig"]


@dataclass(frozen=True)
class SamplingConfig:
    """Blocks, caps and launch settings of the sampling kernels (``sample_logits`` and
    ``sample_hidden``); a function of the device only, never of the batch, so a row's
    arithmetic never depends on B. The interpreter's are small, so that the tests walk
    several blocks and chunks and take every path.

    ``split_block``: entries per vocabulary block of ``sample_logits`` (a multiple of
    NOISE_BLOCK; the number of blocks depends on V alone). ``row_block``: entries per chunk
    of a pass over a whole row (the bisection). ``candidate_lanes``: most candidate slots per
    row (the finish sorts them; a row takes twice k, a power of two: a larger k goes by
    bisection). Top-p without top-k (``top_p``): ``mass_buckets`` buckets per row, each
    ``1 / buckets_per_unit`` of a logit (a power of two) below the row's max, and
    ``bucket_lanes`` slots for the crossing bucket's entries (more: the bisection).
    ``block_warps``: warps of launch 1; ``row_warps``: of launch 2 (whose programs hold a
    plain draw's finish); ``finish_warps``: of a filtered draw's finish (launch 3).
    ``candidate_chunk``: entries per step of launch 2's candidate listing and histogram, and
    of launch 2b.
    ``logits_budget``: bytes of fp32 logits the filtered ``sample_hidden`` writes per row chunk;
    ``finish_rows`` / ``finish_tiles``: rows and tiles per step of its plain draw's finish;
    ``status_block``: rows per program of its status launch (each chunk's bad rows; the plain
    draw's status too)."""

    split_block: int
    row_block: int
    block_warps: int
    row_warps: int
    finish_warps: int
    candidate_lanes: int
    bucket_lanes: int
    mass_buckets: int
    buckets_per_unit: int
    candidate_chunk: int = 512
    logits_budget: int = 512 << 20
    finish_rows: int = 8
    finish_tiles: int = 256
    status_block: int = 1024


def default_config(device: torch.device) -> SamplingConfig:
    """The settings for ``device``: CUDA's, or the interpreter's small ones (tests)."""
    if device.type == "cuda":
        return SamplingConfig(split_block=4096, row_block=1024, candidate_lanes=2048, bucket_lanes=1024,
                              mass_buckets=1024, buckets_per_unit=64, block_warps=4, row_warps=4, finish_warps=4)
    return SamplingConfig(split_block=32, row_block=64, candidate_lanes=16, bucket_lanes=8, mass_buckets=64,
                          buckets_per_unit=2, block_warps=1, row_warps=1, finish_warps=1, candidate_chunk=8,
                          finish_tiles=4)
