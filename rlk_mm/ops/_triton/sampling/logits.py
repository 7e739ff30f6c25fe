"""Sampling from logits (``sample_logits``): the semantics and the RNG of ``_torch/sampling.py``.

``sample_logits`` is two launches over a grid of (row, vocabulary block) programs, each row
cut into blocks of ``split_block`` entries (their number depends on V alone; ``SamplingConfig``
holds the block sizes and caps named here), and for a filtered draw one or two more; it reads
nothing back to the host, so it can be captured in a CUDA graph. In launches 1 and 2 the
row's last block to finish (a count per row, atomically incremented; it starts at zero and
the last block of launch 1 resets it) combines the row's partials in block order:

* launch 1 (``_maxima_kernel``): each block's max, NaN/+inf entries (the row's status) and
  finite entries; with top-k the maxima of its groups (a few equal slices of the block).
  The row's last block writes the row's max and status and, with top-k, the bound: the k-th
  largest of those group maxima (a sort of a few hundred), at most the k-th largest entry.
* launch 2 (``_draw_kernel``), under the row's max: each block's integer mass; plain
  temperature: its best noise block (Gumbel-max over the blocks' log-masses, the float64 noise
  only for the blocks an fp32 screen leaves: ``noise.best_noise_block``), and the row's last
  block sums the mass and finishes the draw inside the best noise block (the first on a tie,
  as over the whole row); top-k: the block's entries at or above the bound, appended to the
  row's candidates (index and value; an atomic count gives each block its place, so their
  order varies from run to run, and nothing computed from them depends on it); top-p without
  top-k: the block's masses added to the row's histogram (``top_p``).
* launch 2b (``top_p.kept_kernel``), top-p or min-p without top-k: each block's sure entries
  (their mass and best Gumbel score) and the entries of the bucket where top-p's threshold lies.
* launch 3 (``_finish_kernel``), filters only, one program per row: the mass, then the filters
  and the draw from the row's list. Top-k's candidates (a little over k: every entry top-k can
  keep), their values sorted once: the k-th largest is the top-k threshold, running sums of
  the sorted masses give the top-p threshold; without top-k, ``top_p.finish_from_bucket``.
  When a list overflows its slots (top-k: entries equal at the bound, or a row's largest
  entries crowded into a few blocks, which lowers the bound; top-p: a crossing bucket with
  more entries than its slots, as in a nearly uniform row), each threshold is found by bisection over an order-preserving integer key
  of ``z`` (top-k: counts; top-p: exact integer masses), a pass over the row per step. Its
  own launch, because the finish is a chain of dependent steps in one program per row:
  inside launch 2 its registers cut the occupancy of the pass over the logits.

Integer masses and first-on-tie choices make every way the torch backend's result, bit for
bit; a row's arithmetic never depends on the other rows or on B. Why two passes: the masses
are integers relative to the row's max (sums in any order agree), and the max, like the top-k
bound, is known only once the whole row has been read.

Roofline. A row of V fp32 logits is 4V bytes (0.6 MB at Qwen2.5-VL's V); the kernels read it
twice and write a few partials per block. The masses' exp is some twenty fp32 adds and
multiplies (``_torch.sampling.masses``): a float64 exp per entry made launch 2 compute-bound,
several times slower than its read. At B = 64 the input (39 MB) stays in a 50 MB L2 cache; at
B = 256 (156 MB) both passes stream from HBM. At small B a call is bound by the host (checks,
allocations and launches take longer than the kernels run): a CUDA graph of the call removes
that time (the step may be a device tensor advanced between replays). The filtered draw's
finish is a few microseconds of dependent steps per row, in parallel over the rows
(``bench/results/sampling/h200/2026-11-29-profile.json``: kernel by kernel).
"""

from __future__ import annotations

import struct
from typing import Optional

import torch
import triton
import triton.language as tl

from ..._torch import sampling as _ref
from .config import SamplingConfig, default_config
from .noise import NOISE_BLOCK, SALT_BLOCK, SALT_TOKEN, best_noise_block, gumbel, key_value, masses, no_nan, order_key, row_keys
from .rows import (
    append_listed,
    draw_by_bisection,
    gumbel_max,
    kept_by,
    last_to_arrive,
    load_z,
    log_ratio,
    row_mass,
    sorted_top_p_threshold,
    step_of,
    store_row,
    workspace,
)
from .top_p import add_to_histogram, choose_bucket, finish_from_bucket, kept_kernel, mass_workspace

__all__ = ["empty_results", "sample_logits"]

Tensor = torch.Tensor


# ------------------------------------------------------------------ launches 1, 2 and 3
@triton.jit
def _row_stats(part_max_ptr, part_bad_ptr, part_fin_ptr, row, n_blocks, NBP: tl.constexpr):
    """A row's max (0 for a bad row), status and finite entries, from its blocks' partials."""
    b = tl.arange(0, NBP)
    ok = b < n_blocks
    at = row * n_blocks + b
    m = tl.max(tl.load(part_max_ptr + at, mask=ok, other=-float("inf"), cache_modifier=".cg"), 0)
    bad = tl.sum(tl.load(part_bad_ptr + at, mask=ok, other=0, cache_modifier=".cg"), 0)
    n_finite = tl.sum(tl.load(part_fin_ptr + at, mask=ok, other=0, cache_modifier=".cg").to(tl.int64), 0)
    status = tl.where(bad > 0, 1, tl.where(n_finite == 0, 2, 0))
    return tl.where(status == 0, m, 0.0), status, n_finite


@triton.jit
def _maxima_kernel(x_ptr, stride, V, inv_t, listed, f32_ws, i32_ws, i64_ws, count_ptr, n_rows, n_blocks,
                   SCALE_T: tl.constexpr, CANDIDATES: tl.constexpr, SPLIT: tl.constexpr,
                   TOPS: tl.constexpr, NBP: tl.constexpr, BOUND_LANES: tl.constexpr, LANES: tl.constexpr):
    """Launch 1, per (row, vocabulary block): the max (NaN skipped), the NaN/+inf entries, the
    finite ones; with ``CANDIDATES`` the maxima of its ``TOPS`` groups (equal slices).
    The row's last block combines them in block order: the row's max, status and finite
    entries, and with ``CANDIDATES`` the bound: the key of the ``listed``-th largest of the
    blocks' group maxima (distinct entries, so at most the ``listed``-th largest entry's key;
    the smallest key when fewer are finite)."""
    (part_max_ptr, row_max_ptr, _, group_max_ptr, part_bad_ptr, part_fin_ptr, _, row_status_ptr, _, _, row_fin_ptr,
     bound_ptr) = workspace(f32_ws, i32_ws, i64_ws, n_rows, n_blocks, LANES)
    pid = tl.program_id(0)
    row, blk = pid // n_blocks, pid % n_blocks
    z = load_z(x_ptr + row.to(tl.int64) * stride, blk * SPLIT + tl.arange(0, SPLIT), V, inv_t, SCALE_T)
    part = row * n_blocks + blk
    z_num = tl.where(z == z, z, -float("inf"))
    tl.store(part_max_ptr + part, tl.max(z_num, 0))
    if CANDIDATES:  # the maxima of the block's TOPS groups (distinct entries)
        tops = tl.max(tl.reshape(z_num, (TOPS, SPLIT // TOPS)), 1)
        tl.store(group_max_ptr + part.to(tl.int64) * TOPS + tl.arange(0, TOPS), tops)
    tl.store(part_bad_ptr + part, tl.sum(((z != z) | (z == float("inf"))).to(tl.int32), 0))
    tl.store(part_fin_ptr + part, tl.sum((z > -float("inf")).to(tl.int32), 0))
    if last_to_arrive(count_ptr, row, n_blocks):
        m, status, n_finite = _row_stats(part_max_ptr, part_bad_ptr, part_fin_ptr, row, n_blocks, NBP)
        tl.store(row_max_ptr + row, m)
        tl.store(row_status_ptr + row, status)
        tl.store(row_fin_ptr + row, n_finite)
        if CANDIDATES:  # the k-th largest of the blocks' tops, by a sort (largest first)
            n_tops = n_blocks * TOPS
            lanes = tl.arange(0, BOUND_LANES)
            v = tl.load(group_max_ptr + row.to(tl.int64) * n_tops + lanes, mask=lanes < n_tops, other=-float("inf"),
                        cache_modifier=".cg")
            kth = tl.max(tl.where(lanes == listed - 1, tl.sort(v, 0, descending=True), -float("inf")), 0)
            tl.store(bound_ptr + row, tl.where(kth > -float("inf"), order_key(kth), -(2**31)))
        tl.store(count_ptr + row, 0)


@triton.jit
def _draw_from_candidates(m, n, top_k, top_p_bits, min_p_log, tka, tkb, cand_index, cand_z,
                          TOP_P: tl.constexpr, MIN_P: tl.constexpr, LANES: tl.constexpr):
    """Top-k, then top-p and min-p, and the draw over a row's ``n <= LANES`` candidates: every
    entry at or above the row's bound (at most its k-th largest), in any order (none of the
    results depends on it). Their values sorted, largest first: the k-th largest is the top-k
    threshold (ties with it kept); the top-p threshold is the smallest kept value whose kept
    mass above it (running sums of the sorted masses) is below ``top_p`` of the kept mass.
    Then Gumbel-max over the kept candidates, the first index on a tie. Returns (token, z of
    the token, kept mass)."""
    lanes = tl.arange(0, LANES)
    valid = lanes < n
    ci = tl.load(cand_index + lanes, mask=valid, other=0, cache_modifier=".cg")
    zi = tl.load(cand_z + lanes, mask=valid, other=-float("inf"), cache_modifier=".cg")
    zs = tl.sort(zi, 0, descending=True)  # -inf last
    kth = tl.max(tl.where(lanes == top_k - 1, zs, -float("inf")), 0)
    t = tl.where(kth > -float("inf"), order_key(kth), -(2**31))  # fewer than k finite: keep them all
    if TOP_P:
        t = sorted_top_p_threshold(zs, m, t, 0, top_p_bits, 0, True)
    kept = kept_by(zi, m, t, min_p_log, MIN_P)
    mass = tl.sum(tl.where(kept, masses(zi, m), 0), 0)
    _, token = gumbel_max(ci, zi, kept, tka, tkb)
    z_tok = tl.max(tl.where(kept & (ci == token), zi, -float("inf")), 0)
    return tl.where(token == 2**31 - 1, 0, token).to(tl.int64), z_tok, mass


@triton.jit
def _finish_plain(x_row, row, V, inv_t, m, status, tka, tkb, given_ptr, part_mass_ptr, part_best_ptr,
                  part_best_block_ptr, tok_ptr, lp_ptr, slp_ptr, status_ptr, n_blocks,
                  SCALE_T: tl.constexpr, GIVEN: tl.constexpr, NBP: tl.constexpr):
    """A plain-temperature row, its blocks combined in block order: the mass, the draw (the
    first best noise block, then Gumbel-max inside it) and the log-prob."""
    total = row_mass(part_mass_ptr, row, n_blocks, NBP)
    if GIVEN:
        token = tl.load(given_ptr + row)
    else:
        b = tl.arange(0, NBP)
        scores = tl.load(part_best_ptr + row * n_blocks + b, mask=b < n_blocks, other=-float("inf"),
                         cache_modifier=".cg")
        w = tl.argmax(scores, 0)  # the first on a tie
        best_block = tl.load(part_best_block_ptr + row * n_blocks + w, cache_modifier=".cg")
        cols = best_block * NOISE_BLOCK + tl.arange(0, NOISE_BLOCK)
        zc = load_z(x_row, cols, V, inv_t, SCALE_T)
        token = (best_block * NOISE_BLOCK + tl.argmax(no_nan(zc.to(tl.float64) + gumbel(cols, tka, tkb)), 0))
        token = token.to(tl.int64)
    lp = log_ratio(load_z(x_row, token, V, inv_t, SCALE_T), m, total)
    store_row(row, token, lp, lp, status, tok_ptr, lp_ptr, slp_ptr, status_ptr)


@triton.jit(do_not_specialize=["step_value"])
def _draw_kernel(
    x_ptr, stride, V, inv_t, seeds_ptr, steps_ptr, step_stride, step_value, given_ptr, top_p_bits,
    f32_ws, i32_ws, i64_ws, mass_ws, part_best_ptr, count_ptr, tok_ptr, lp_ptr, slp_ptr, status_ptr, n_rows, n_blocks,
    SCALE_T: tl.constexpr, STEPS: tl.constexpr, PLAIN: tl.constexpr, GIVEN: tl.constexpr, DRAW: tl.constexpr,
    CANDIDATES: tl.constexpr, HIST: tl.constexpr, SPLIT: tl.constexpr, NBP: tl.constexpr, LANES: tl.constexpr,
    CHUNK: tl.constexpr, PER_UNIT: tl.constexpr, BUCKETS: tl.constexpr,
):
    """Launch 2, per (row, vocabulary block), under the row's max: the block's integer mass;
    with ``DRAW`` its best noise block (score, index; the first on a tie); with ``CANDIDATES``
    its entries at or above the row's bound, appended to the row's list
    (``rows.append_listed``); with ``HIST`` (top-p without top-k) its masses added to
    the row's histogram, and the row's last block finds the crossing bucket (``top_p``). With
    ``PLAIN`` (plain temperature) the row's last block finishes the row (``_finish_plain``);
    filters finish in ``_finish_kernel``."""
    (_, row_max_ptr, cand_z_ptr, _, _, _, part_best_block_ptr, row_status_ptr, cand_index_ptr, part_mass_ptr,
     _, bound_ptr) = workspace(f32_ws, i32_ws, i64_ws, n_rows, n_blocks, LANES)
    pid = tl.program_id(0)
    row, blk = pid // n_blocks, pid % n_blocks
    x_row = x_ptr + row.to(tl.int64) * stride
    m = tl.load(row_max_ptr + row)
    seed = tl.load(seeds_ptr + row)
    step = step_of(steps_ptr, row, step_stride, step_value, STEPS)
    lanes = tl.arange(0, SPLIT)
    z = load_z(x_row, blk * SPLIT + lanes, V, inv_t, SCALE_T)
    part = row * n_blocks + blk
    tl.store(part_mass_ptr + part, tl.sum(masses(z, m), 0))
    if DRAW:
        zb = tl.reshape(z, (SPLIT // NOISE_BLOCK, NOISE_BLOCK))
        mb = tl.max(zb, 1)
        safe = tl.where(mb == -float("inf"), 0.0, mb)
        ell = tl.where(mb == -float("inf"), -float("inf"), safe + tl.log(tl.sum(tl.exp(zb - safe[:, None]), 1)))
        blocks = blk * (SPLIT // NOISE_BLOCK) + tl.arange(0, SPLIT // NOISE_BLOCK)
        bka, bkb = row_keys(seed, step, SALT_BLOCK)
        one = tl.zeros([1], tl.uint32)
        best, best_block = best_noise_block(ell[None, :], blocks[None, :], one + bka, one + bkb)
        tl.store(part_best_ptr + part + tl.arange(0, 1), best)
        tl.store(part_best_block_ptr + part + tl.arange(0, 1), best_block)
    if CANDIDATES:  # the entries at or above the bound, appended to the row's list
        append_listed(x_row, z, row, blk, V, inv_t, key_value(tl.load(bound_ptr + row)), count_ptr + n_rows,
                      cand_index_ptr, cand_z_ptr, SCALE_T, SPLIT, CHUNK, LANES)
    if HIST:  # top-p without top-k: the masses by bucket; the row's last block finds the crossing one
        hist, row_bucket, mass_above, _ = mass_workspace(mass_ws, n_rows, n_blocks, BUCKETS)
        add_to_histogram(x_row, blk, V, inv_t, m, hist + row * BUCKETS, SCALE_T, SPLIT, CHUNK, PER_UNIT, BUCKETS)
        if last_to_arrive(count_ptr, row, n_blocks):
            star, above = choose_bucket(hist + row * BUCKETS, row_mass(part_mass_ptr, row, n_blocks, NBP), top_p_bits,
                                        BUCKETS)
            tl.store(row_bucket + row, star.to(tl.int64))
            tl.store(mass_above + row, above)
    if PLAIN:
        if last_to_arrive(count_ptr, row, n_blocks):
            tka, tkb = row_keys(seed, step, SALT_TOKEN)
            _finish_plain(x_row, row, V, inv_t, m, tl.load(row_status_ptr + row), tka, tkb, given_ptr, part_mass_ptr,
                          part_best_ptr, part_best_block_ptr, tok_ptr, lp_ptr, slp_ptr, status_ptr, n_blocks,
                          SCALE_T, GIVEN, NBP)


@triton.jit(do_not_specialize=["step_value"])
def _finish_kernel(
    x_ptr, stride, V, inv_t, seeds_ptr, steps_ptr, step_stride, step_value, top_k, top_p_bits, min_p_log, given_ptr,
    f32_ws, i32_ws, i64_ws, mass_ws, part_best_ptr, count_ptr, tok_ptr, lp_ptr, slp_ptr, status_ptr, n_rows, n_blocks,
    SCALE_T: tl.constexpr, STEPS: tl.constexpr, TOP_K: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr,
    GIVEN: tl.constexpr, CANDIDATES: tl.constexpr, BY_MASS: tl.constexpr, BLOCK: tl.constexpr, NBP: tl.constexpr,
    LANES: tl.constexpr, BUCKETS: tl.constexpr,
):
    """Launch 3 of a filtered draw, per row: the mass, then the filters and the draw from the
    row's list where it fits in ``LANES``: top-k's candidates (``CANDIDATES``) or, without
    top-k (``BY_MASS``), the crossing bucket and the blocks' sure entries
    (``top_p.finish_from_bucket``); else by bisection over the row; and the log-probs. A launch
    of its own, so that the sort's registers do not cut the occupancy of launch 2's pass over
    the logits, and it takes its own warps (``SamplingConfig.finish_warps``)."""
    (_, row_max_ptr, cand_z_ptr, _, _, _, part_best_index_ptr, row_status_ptr, cand_index_ptr, part_mass_ptr,
     row_fin_ptr, _) = workspace(f32_ws, i32_ws, i64_ws, n_rows, n_blocks, LANES)
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride
    m = tl.load(row_max_ptr + row)
    total = row_mass(part_mass_ptr, row, n_blocks, NBP)
    tka, tkb = row_keys(tl.load(seeds_ptr + row), step_of(steps_ptr, row, step_stride, step_value, STEPS), SALT_TOKEN)
    n = tl.load(count_ptr + n_rows + row)
    token, lp, slp, done = tl.zeros([], tl.int64), tl.zeros([], tl.float32), tl.zeros([], tl.float32), n * 0
    cand_index, cand_z = cand_index_ptr + row.to(tl.int64) * LANES, cand_z_ptr + row.to(tl.int64) * LANES
    if CANDIDATES:
        if n <= LANES:
            token, z_tok, kept_mass = _draw_from_candidates(m, n, top_k, top_p_bits, min_p_log, tka, tkb, cand_index,
                                                            cand_z, TOP_P, MIN_P, LANES)
            lp, slp, done = log_ratio(z_tok, m, total), log_ratio(z_tok, m, kept_mass), n * 0 + 1
    if BY_MASS:
        if n <= LANES:
            given = tl.zeros([], tl.int64)
            if GIVEN:
                given = tl.load(given_ptr + row)
            token, z_tok, kept_mass, kept_tok = finish_from_bucket(
                row, m, total, n, top_p_bits, min_p_log, tka, tkb, given, mass_ws, part_best_ptr, part_best_index_ptr,
                cand_index, cand_z, x_row, V, inv_t, n_rows, n_blocks, SCALE_T, TOP_P, MIN_P, GIVEN, NBP, LANES,
                BUCKETS)
            lp, slp, done = log_ratio(z_tok, m, total), log_ratio(z_tok, m, kept_mass), n * 0 + 1
            if GIVEN:  # a token the filters drop: sampled log-prob -inf
                slp = tl.where(kept_tok, slp, -float("inf"))
    if done == 0:
        token, lp, slp = draw_by_bisection(
            x_row, V, inv_t, m, total, tl.load(row_fin_ptr + row), top_k, top_p_bits, min_p_log, given_ptr + row,
            tka, tkb, SCALE_T, TOP_K, TOP_P, MIN_P, GIVEN, BLOCK)
    store_row(row, token, lp, slp, tl.load(row_status_ptr + row), tok_ptr, lp_ptr, slp_ptr, status_ptr)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (``triton.next_power_of_2``, without its host-call overhead)."""
    return 1 << max(n - 1, 0).bit_length()


def _step_args(steps, placeholder: Tensor) -> tuple:
    """(steps tensor, its stride, the int step, STEPS) for the kernels: ``steps`` an int or an
    int64 tensor ``[]``/``[B]`` on the logits' device (a tensor: a CUDA graph replays the new value)."""
    if isinstance(steps, Tensor):
        return steps, (steps.stride(0) if steps.dim() else 0), 0, True
    return placeholder, 0, int(steps), False


def empty_results(B: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A draw's outputs for ``B`` rows, unwritten: tokens int64, log-probs and sampled log-probs
    fp32, status int8 (``sample_logits`` and ``hidden.sample_hidden``)."""
    return (torch.empty(B, dtype=torch.int64, device=device), torch.empty(B, dtype=torch.float32, device=device),
            torch.empty(B, dtype=torch.float32, device=device), torch.empty(B, dtype=torch.int8, device=device))


def sample_logits(logits: Tensor, inv_t: float, filters: _ref.Filters, seeds: Tensor, steps,
                  given: Optional[Tensor] = None,
                  config: Optional[SamplingConfig] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(tokens int64, log_probs fp32, sampled_log_probs fp32, status int8), each ``[B]``;
    ``logits [B, V]`` with unit stride along V, ``seeds`` int64 ``[B]``, ``steps`` an int or an
    int64 tensor (``[]`` or ``[B]``) on the logits' device. Two launches (three or four with
    filters), no host read: capturable in a CUDA graph. ``config`` replaces ``default_config``."""
    B, V = logits.shape
    dev = logits.device
    tokens, log_probs, sampled, status = empty_results(B, dev)
    if B == 0:
        return tokens, log_probs, sampled, status
    cfg = config or default_config(dev)
    split = cfg.split_block
    n_blocks = -(-V // split)  # V alone sets the blocks: a row's arithmetic never depends on B
    top_k = filters.top_k or 0
    draw = given is None
    # top-k's candidates: every entry at or above a bound below the k-th largest, in slots per
    # row: twice k (a power of two, at least 16), at most the config's (else the bisection)
    lanes = max(16, _pow2(2 * top_k))
    candidates = top_k > 0 and draw and lanes <= cfg.candidate_lanes
    by_mass = not filters.plain and top_k == 0  # top-p, min-p: the crossing bucket's entries (``top_p``)
    lanes = lanes if candidates else cfg.bucket_lanes if by_mass else 1

    n = B * n_blocks
    # each block's groups for the bound: twice its share of k (at least 4), so that the k-th
    # largest group max is close to the row's k-th largest entry
    tops = min(split, _pow2(max(4, -(-2 * top_k // n_blocks))))
    # three workspaces hold the partials (``rows.workspace``: their places), a fourth the draw's
    # scores, a fifth (zeroed) top-p's histograms and the sure masses (``top_p.mass_workspace``)
    f32_ws = torch.empty(n + B * (1 + lanes) + (n * tops if candidates else 0), dtype=torch.float32, device=dev)
    i32_ws = torch.empty(3 * n + B * (1 + lanes), dtype=torch.int32, device=dev)
    i64_ws = torch.empty(n + 2 * B, dtype=torch.int64, device=dev)
    buckets = cfg.mass_buckets
    mass_ws = (torch.zeros(B * (buckets + 2) + n, dtype=torch.int64, device=dev) if by_mass else i64_ws)
    part_best = torch.empty(n, dtype=torch.float64, device=dev) if draw and (filters.plain or by_mass) else tokens
    # per row: the blocks arrived (launches 1 and 2; the last block resets it), the entries listed
    count = torch.zeros(2 * B, dtype=torch.int32, device=dev)
    top_p_bits = struct.unpack("<q", struct.pack("<d", filters.top_p or 1.0))[0]  # float64, exactly
    scale_t = inv_t != 1.0
    nbp = max(2, _pow2(n_blocks))
    grid = (B * n_blocks,)
    chunk = min(split, cfg.candidate_chunk)
    # enable_fp_fusion=False: no fused multiply-adds, the torch backend's arithmetic, rounding for rounding
    _maxima_kernel[grid](
        logits, logits.stride(0), V, inv_t, top_k, f32_ws, i32_ws, i64_ws, count, B, n_blocks,
        SCALE_T=scale_t, CANDIDATES=candidates, SPLIT=split, TOPS=tops, NBP=nbp,
        BOUND_LANES=_pow2(n_blocks * tops) if candidates else 16, LANES=lanes,
        num_warps=cfg.block_warps, enable_fp_fusion=False)
    steps_t, step_stride, step_value, has_steps = _step_args(steps, tokens)
    given_t = tokens if given is None else given
    top_p = filters.top_p is not None
    _draw_kernel[grid](
        logits, logits.stride(0), V, inv_t, seeds, steps_t, step_stride, step_value, given_t, top_p_bits,
        f32_ws, i32_ws, i64_ws, mass_ws, part_best, count, tokens, log_probs, sampled, status, B, n_blocks,
        SCALE_T=scale_t, STEPS=has_steps, PLAIN=filters.plain, GIVEN=given is not None, DRAW=draw and filters.plain,
        CANDIDATES=candidates, HIST=by_mass and top_p, SPLIT=split, NBP=nbp, LANES=lanes, CHUNK=chunk,
        PER_UNIT=cfg.buckets_per_unit, BUCKETS=buckets, num_warps=cfg.row_warps, enable_fp_fusion=False,
    )
    if by_mass:
        kept_kernel[grid](
            logits, logits.stride(0), V, inv_t, seeds, steps_t, step_stride, step_value, filters.min_p_log or 0.0,
            f32_ws, i32_ws, i64_ws, mass_ws, part_best, count, B, n_blocks,
            SCALE_T=scale_t, STEPS=has_steps, TOP_P=top_p, MIN_P=filters.min_p_log is not None, DRAW=draw,
            SPLIT=split, CHUNK=chunk, LANES=lanes, PER_UNIT=cfg.buckets_per_unit, BUCKETS=buckets,
            num_warps=cfg.row_warps, enable_fp_fusion=False,
        )
    if not filters.plain:
        _finish_kernel[(B,)](
            logits, logits.stride(0), V, inv_t, seeds, steps_t, step_stride, step_value, top_k, top_p_bits,
            filters.min_p_log or 0.0, given_t, f32_ws, i32_ws, i64_ws, mass_ws, part_best, count, tokens, log_probs,
            sampled, status, B, n_blocks, SCALE_T=scale_t, STEPS=has_steps, TOP_K=filters.top_k is not None,
            TOP_P=top_p, MIN_P=filters.min_p_log is not None, GIVEN=given is not None,
            CANDIDATES=candidates, BY_MASS=by_mass, BLOCK=cfg.row_block, NBP=nbp, LANES=lanes, BUCKETS=buckets,
            num_warps=cfg.finish_warps, enable_fp_fusion=False,
        )
    return tokens, log_probs, sampled, status
