"""Top-p and min-p without top-k: each row's kept set from a histogram of its masses.

Without top-k nothing bounds how many entries top-p or min-p keep (a flat row keeps
thousands), so no short list of a row's largest entries holds them. Instead:

* launch 2 (``logits._draw_kernel``) adds each entry's integer mass to its row's histogram,
  ``BUCKETS`` buckets by distance below the row's max (``rows.bucket_of``: a 64th of a
  logit each on CUDA; integer sums, so their order does not matter), and the row's last block
  finds the bucket where the masses summed from the top reach top-p's share of the row's
  (``choose_bucket``): top-p keeps every entry of an earlier bucket and none of a later one;
* ``kept_kernel`` (launch 2b), per (row, vocabulary block): the mass and the best Gumbel score
  of the block's sure entries (earlier buckets, at or above min-p's cut), and the entries of
  the crossing bucket appended to the row's list;
* the finish (``finish_from_bucket``, in ``logits._finish_kernel``) sorts the list, finds
  top-p's threshold in it from the mass above the bucket, and draws among the list's kept
  entries and the blocks' best (the first index on a tie).

Masses are the torch backend's integers and the comparisons its own (``_torch.sampling``:
``kept_by_filters``), so tokens and log-probs are its bit for bit. A crossing bucket with more
entries than the list's slots (a nearly uniform row) sends the row to the bisection. Min-p
alone needs no bucket: every entry at or above its cut is sure.

Roofline: three reads of each row (launches 1, 2 and 2b; the finish reads a few entries)
where top-k's path reads it twice; the cost over those reads is launch 2's atomic adds, one per entry
within ``BUCKETS / PER_UNIT`` logits of the max (the block sums the rest first), and launch
2b's Gumbel noise, fp32 for every sure entry of a chunk that holds one and float64 only where
the fp32 screen leaves it (``noise.best_noise_block``). So a flat row, with many entries near
its max and many sure ones, costs a few times a peaked one; the finish sorts ``LANES`` values
whatever the row. ``bench/results/sampling/h200/2026-11-29-profile.json`` has the kernel times.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .noise import SALT_TOKEN, best_noise_block, masses, row_keys
from .rows import append_chunk, bucket_of, gumbel_max, kept_by, load_z, sorted_top_p_threshold, step_of, workspace

__all__ = ["add_to_histogram", "choose_bucket", "finish_from_bucket", "kept_kernel", "mass_workspace"]


@triton.jit
def mass_workspace(ws, n_rows, n_blocks, BUCKETS: tl.constexpr):
    """The places in the int64 workspace (zeroed by the caller): the rows' histograms
    ``[rows, BUCKETS]``, each row's crossing bucket and the mass above it, each block's sure mass."""
    hist = ws
    row_bucket = hist + n_rows * BUCKETS
    mass_above = row_bucket + n_rows
    return hist, row_bucket, mass_above, mass_above + n_rows


@triton.jit
def add_to_histogram(x_row, blk, V, inv_t, m, hist_row, SCALE_T: tl.constexpr, SPLIT: tl.constexpr,
                     CHUNK: tl.constexpr, PER_UNIT: tl.constexpr, BUCKETS: tl.constexpr):
    """Adds the masses of block ``blk``'s entries to their row's histogram, a chunk at a time
    (reread from the cache): an atomic add per entry, except in the last bucket (everything
    further below the max; many entries in a flat row), whose masses the block sums first."""
    tail = tl.zeros([], tl.int64)
    for c in range(0, SPLIT // CHUNK):
        z = load_z(x_row, blk * SPLIT + c * CHUNK + tl.arange(0, CHUNK), V, inv_t, SCALE_T)
        e = masses(z, m)
        b = bucket_of(z, m, PER_UNIT, BUCKETS)
        ok = (z > -float("inf")) & (e > 0)
        tl.atomic_add(hist_row + b, e, mask=ok & (b < BUCKETS - 1), sem="relaxed")
        tail += tl.sum(tl.where(ok & (b == BUCKETS - 1), e, 0), 0)
    if tail > 0:
        tl.atomic_add(hist_row + BUCKETS - 1, tail, sem="relaxed")


@triton.jit
def choose_bucket(hist_row, total, top_p_bits, BUCKETS: tl.constexpr):
    """(the first bucket at which the masses summed from the top reach ``top_p`` of the row's
    ``total``, the mass of the buckets before it). Every entry of an earlier bucket has less
    than that share above it, every entry of a later one at least that share: as the torch
    backend compares them, the integer sums in float64."""
    j = tl.arange(0, BUCKETS)
    h = tl.load(hist_row + j, cache_modifier=".cg")
    reached = tl.cumsum(h, 0).to(tl.float64) >= top_p_bits.to(tl.float64, bitcast=True) * total.to(tl.float64)
    star = tl.min(tl.where(reached, j, BUCKETS - 1), 0)
    return star, tl.sum(tl.where(j < star, h, 0), 0)


@triton.jit(do_not_specialize=["step_value"])
def kept_kernel(
    x_ptr, stride, V, inv_t, seeds_ptr, steps_ptr, step_stride, step_value, min_p_log,
    f32_ws, i32_ws, i64_ws, mass_ws, part_best_ptr, count_ptr, n_rows, n_blocks,
    SCALE_T: tl.constexpr, STEPS: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr, DRAW: tl.constexpr,
    SPLIT: tl.constexpr, CHUNK: tl.constexpr, LANES: tl.constexpr, PER_UNIT: tl.constexpr, BUCKETS: tl.constexpr,
):
    """Launch 2b, per (row, vocabulary block): the block's sure entries (finite, before the
    row's crossing bucket, at or above min-p's cut), their mass and with ``DRAW`` their best
    Gumbel score (float64, the first index on a tie); with ``TOP_P`` the crossing bucket's
    entries appended to the row's list."""
    (_, row_max_ptr, cand_z_ptr, _, _, _, part_best_index_ptr, _, cand_index_ptr, _, _, _) = workspace(
        f32_ws, i32_ws, i64_ws, n_rows, n_blocks, LANES)
    _, row_bucket, _, part_kept = mass_workspace(mass_ws, n_rows, n_blocks, BUCKETS)
    pid = tl.program_id(0)
    row, blk = pid // n_blocks, pid % n_blocks
    x_row = x_ptr + row.to(tl.int64) * stride
    m = tl.load(row_max_ptr + row)
    star = BUCKETS
    if TOP_P:
        star = tl.load(row_bucket + row).to(tl.int32)
    tka, tkb = row_keys(tl.load(seeds_ptr + row), step_of(steps_ptr, row, step_stride, step_value, STEPS), SALT_TOKEN)
    one = tl.zeros([1], tl.uint32)
    kept_mass = tl.zeros([], tl.int64)
    best = tl.full([1], -float("inf"), tl.float64)
    index = tl.zeros([1], tl.int32) + blk * SPLIT
    for c in range(0, SPLIT // CHUNK):  # a chunk at a time: whole-block values take registers
        offs = blk * SPLIT + c * CHUNK + tl.arange(0, CHUNK)
        z = load_z(x_row, offs, V, inv_t, SCALE_T)
        b = bucket_of(z, m, PER_UNIT, BUCKETS)
        sure = (z > -float("inf")) & (b < star)
        if MIN_P:
            sure = sure & ((z - m) >= min_p_log)
        if tl.sum(sure.to(tl.int32), 0) > 0:
            kept_mass += tl.sum(tl.where(sure, masses(z, m), 0), 0)
            if DRAW:
                chunk_best, chunk_index = best_noise_block(tl.where(sure, z, -float("inf"))[None, :], offs[None, :],
                                                           one + tka, one + tkb)
                better = chunk_best > best  # an earlier chunk keeps a tie: the first index
                index = tl.where(better, chunk_index, index)
                best = tl.where(better, chunk_best, best)
        if TOP_P:
            listed = (z > -float("inf")) & (b == star)
            n_listed = tl.sum(listed.to(tl.int32), 0)
            if n_listed > 0:
                at = tl.atomic_add(count_ptr + n_rows + row, n_listed, sem="relaxed")
                append_chunk(z, offs, listed, at, row, cand_index_ptr, cand_z_ptr, LANES)
    part = row * n_blocks + blk
    tl.store(part_kept + part, kept_mass)
    if DRAW:
        tl.store(part_best_ptr + part + tl.arange(0, 1), best)
        tl.store(part_best_index_ptr + part + tl.arange(0, 1), index)


@triton.jit
def finish_from_bucket(row, m, total, n, top_p_bits, min_p_log, tka, tkb, given, mass_ws, part_best_ptr,
                       part_best_index_ptr, cand_index, cand_z, x_row, V, inv_t, n_rows, n_blocks,
                       SCALE_T: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr, GIVEN: tl.constexpr,
                       NBP: tl.constexpr, LANES: tl.constexpr, BUCKETS: tl.constexpr):
    """A row's token (``given``, or drawn), its logit and the kept mass, from the blocks' sure
    entries and the ``n <= LANES`` listed entries of the crossing bucket. Listed values sorted,
    largest first: ``mass above the bucket + running sums`` is the mass above each (at a run of
    equal values' first), and top-p's threshold the smallest value with less than ``top_p`` of
    the row's mass above it. Returns (token, its logit, kept mass, whether a given token is kept)."""
    _, _, mass_above, part_kept = mass_workspace(mass_ws, n_rows, n_blocks, BUCKETS)
    lanes = tl.arange(0, LANES)
    valid = lanes < n
    ci = tl.load(cand_index + lanes, mask=valid, other=0, cache_modifier=".cg")
    zi = tl.load(cand_z + lanes, mask=valid, other=-float("inf"), cache_modifier=".cg")
    t = tl.full([], -(2**31), tl.int64)  # min-p alone: every finite listed entry (none are listed)
    if TOP_P:
        t = sorted_top_p_threshold(tl.sort(zi, 0, descending=True), m, t, tl.load(mass_above + row), top_p_bits, total,
                                   False)
    kept = kept_by(zi, m, t, min_p_log, MIN_P)
    b = tl.arange(0, NBP)
    b_ok = b < n_blocks
    mass = (tl.sum(tl.load(part_kept + row * n_blocks + b, mask=b_ok, other=0, cache_modifier=".cg"), 0)
            + tl.sum(tl.where(kept, masses(zi, m), 0), 0))
    if GIVEN:
        token = given
        z_tok = load_z(x_row, token, V, inv_t, SCALE_T)
        kept_tok = kept_by(z_tok, m, t, min_p_log, MIN_P)  # an earlier bucket's entry is above the threshold
    else:
        top, listed_token = gumbel_max(ci, zi, kept, tka, tkb)
        block_best = tl.load(part_best_ptr + row * n_blocks + b, mask=b_ok, other=-float("inf"), cache_modifier=".cg")
        block_top = tl.max(block_best, 0)
        block_token = tl.min(tl.where(b_ok & (block_best == block_top),
                                      tl.load(part_best_index_ptr + row * n_blocks + b, mask=b_ok, other=0,
                                              cache_modifier=".cg"), 2**31 - 1), 0)
        token = tl.where(top > block_top, listed_token,
                         tl.where(block_top > top, block_token, tl.minimum(listed_token, block_token)))
        token = tl.where(token == 2**31 - 1, 0, token).to(tl.int64)
        z_tok = load_z(x_row, token, V, inv_t, SCALE_T)
        kept_tok = False  # only a given token's is asked for
    return token, z_tok, mass, kept_tok
