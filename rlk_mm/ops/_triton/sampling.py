"""Triton kernels of rollout sampling: the semantics and the RNG of ``_torch/sampling.py``.

``sample_logits`` is two launches over a grid of (row, vocabulary block) programs, each row
cut into blocks of ``split_block`` entries (their number depends on V alone; ``SamplingConfig``
holds the block sizes and caps named here), and it reads nothing back to the host, so it can
be captured in a CUDA graph. In each launch the row's last block to finish (a count per row,
atomically incremented; it starts at zero and the last block resets it) combines the row's
partials in block order, so no third launch waits for them:

* launch 1 (``_maxima_kernel``): each block's max, NaN/+inf entries (the row's status) and
  finite entries; with top-k the largest maxima of its ``sub_block``-entry sub-blocks. The
  row's last block writes the row's max and status and, with top-k, the bound: the k-th
  largest of those sub-block maxima (a sort of a few hundred), at most the k-th largest entry.
* launch 2 (``_draw_kernel``), under the row's max: each block's integer mass; plain
  temperature: its best noise block (Gumbel-max over the blocks' log-masses, the float64 noise
  only for the blocks an fp32 screen leaves: ``noise.best_noise_block``); top-k: the indices of
  its entries at or above the bound (one scan; if more than k, its k largest and the largest it
  leaves out). The row's last block (``_finish_row``) sums the mass, finishes the plain draw
  inside the best noise block (the first on a tie, as over the whole row), or runs top-k, top-p,
  min-p and the draw on the blocks' candidates (a little over k, compared each with each, a
  chunk at a time), which hold every token top-k keeps unless a block left out an entry equal to
  the k-th largest (a tie at the boundary). On such a tie, with more than ``candidate_cap``
  slots, or for top-p or min-p without top-k, each threshold is found by bisection over an
  order-preserving integer key of ``z`` (top-k: counts; top-p: exact integer masses), a pass
  over the row per step.

Integer masses and first-on-tie choices make every way the torch backend's result, bit for
bit; a row's arithmetic never depends on the other rows or on B. Why two passes: the masses
are integers relative to the row's max (sums in any order agree), and the max, like the top-k
bound, is known only once the whole row has been read.

Roofline. A row of V fp32 logits is 4V bytes; the kernels read the logits twice (launch 2 also
computes one exp per entry for the masses) and write a few partials per block (B x V /
split_block of each: negligible). The masses' exp is some twenty fp32 adds and multiplies
(``_torch.sampling.masses``), not a float64 exp: a GPU's float64 rate is a fraction of its fp32
rate, and a float64 exp per entry made launch 2 compute-bound, several times slower than its
read. With the Qwen2.5-VL vocabulary a row is about 0.6 MB: at B = 64 the whole input (about 39
MB) fits in a 50 MB L2 cache, so launch 2 reads mostly from L2 and the GPU's work is a few tens
of microseconds; at B = 256 (about 156 MB) both passes stream from HBM. At small B a call is
bound by the host, not the GPU: checking the arguments, a dozen allocations and two Triton
launches take longer than the kernels run, and one CUDA-event timing around a call sees the
host's time. A CUDA graph of the call removes that time (the step may be a device tensor that
the caller advances between replays). Beyond the reads, the top-k path's candidate scan and
finish cost about as much again (``bench/results/sampling_profile_h200.json``: kernel by kernel).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .._torch import sampling as _ref
from .noise import NOISE_BLOCK, SALT_BLOCK, SALT_TOKEN, best_noise_block, gumbel, key_value, masses, no_nan, order_key, row_keys

__all__ = [
    "default_config", "sample_logits", "SamplingConfig",
]

Tensor = torch.Tensor


@dataclass(frozen=True)
class SamplingConfig:
    """Blocks, caps and launch settings of the sampling kernels (``sample_logits`` and
    ``sample_hidden``); a function of the device only, never of the batch, so a row's
    arithmetic never depends on B. The interpreter's are small, so that the tests walk
    several blocks and chunks and take every path.

    ``split_block``: entries per vocabulary block of ``sample_logits`` (a multiple of
    NOISE_BLOCK; the number of blocks depends on V alone). ``sub_block``: entries per
    sub-block of a vocabulary block (the k-th largest sub-block max bounds the k-th largest
    entry from below, so top-k candidates are looked for only above it). ``row_block``:
    entries per chunk of a pass over a whole row (the bisection). ``candidate_cap``: most
    top-k candidate slots (blocks x k) a row's finish takes (more: the bisection).
    ``block_warps``: warps of launch 1; ``row_warps``: of launch 2, whose programs hold the
    row's finish. ``candidate_lanes``: top-k candidates the finish compares at once (its
    threshold searches compare this many with as many).
    ``logits_budget``: bytes of fp32 logits the filtered ``sample_hidden`` writes per row chunk;
    ``finish_rows`` / ``finish_tiles``: rows and tiles per step of its plain draw's finish."""

    split_block: int
    sub_block: int
    row_block: int
    candidate_cap: int
    block_warps: int
    row_warps: int
    candidate_lanes: int = 64
    logits_budget: int = 512 << 20
    finish_rows: int = 8
    finish_tiles: int = 256


def default_config(device: torch.device) -> SamplingConfig:
    """The settings for ``device``: CUDA's, or the interpreter's small ones (tests)."""
    if device.type == "cuda":
        return SamplingConfig(split_block=4096, sub_block=64, row_block=1024, candidate_cap=4096, block_warps=4,
                              row_warps=4, candidate_lanes=32)
    return SamplingConfig(split_block=32, sub_block=8, row_block=64, candidate_cap=32, block_warps=1, row_warps=1,
                          candidate_lanes=4, finish_tiles=4)


# ------------------------------------------------------------------ from logits
@triton.jit
def _load_z(x_row, offs, V, inv_t, SCALE_T: tl.constexpr):
    z = tl.load(x_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    if SCALE_T:
        z = z * inv_t
    return z


@triton.jit
def _log_ratio(z_tok, m, mass):
    lse = tl.log(mass.to(tl.float64) * (1.0 / 1099511627776.0))
    return (z_tok.to(tl.float64) - m.to(tl.float64) - lse).to(tl.float32)


@triton.jit
def _count_from(x_row, V, inv_t, t, SCALE_T: tl.constexpr, BLOCK: tl.constexpr):
    """How many finite entries of the row have key >= t."""
    n = tl.zeros([], tl.int64)
    for c in range(0, V, BLOCK):
        z = _load_z(x_row, c + tl.arange(0, BLOCK), V, inv_t, SCALE_T)
        n += tl.sum(((z > -float("inf")) & (order_key(z) >= t)).to(tl.int64), 0)
    return n


@triton.jit
def _mass_above(x_row, V, inv_t, m, t_kept, t, SCALE_T: tl.constexpr, BLOCK: tl.constexpr):
    """Σ masses of the finite entries with key >= t_kept and key > t."""
    s = tl.zeros([], tl.int64)
    for c in range(0, V, BLOCK):
        z = _load_z(x_row, c + tl.arange(0, BLOCK), V, inv_t, SCALE_T)
        key = order_key(z)
        s += tl.sum(tl.where((z > -float("inf")) & (key >= t_kept) & (key > t), masses(z, m), 0), 0)
    return s


@triton.jit
def _draw_by_bisection(x_row, V, inv_t, m, total, n_finite, top_k, top_p_bits, min_p_log, given_ptr, tka, tkb,
                       SCALE_T: tl.constexpr, TOP_K: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr,
                       GIVEN: tl.constexpr, BLOCK: tl.constexpr):
    """The filters' thresholds by bisection over the whole row (a pass per step), then a last
    pass: the kept mass and the Gumbel-max over the kept tokens (or the given token's score)."""
    t = tl.full([], -(2**31), tl.int64)  # keys of finite values are above it
    if TOP_K:
        if top_k < n_finite:  # largest t with count(key >= t) >= top_k
            lo = t
            hi = order_key(m) + 1
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                ok = _count_from(x_row, V, inv_t, mid, SCALE_T, BLOCK) >= top_k
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
            t = lo
    if TOP_P:  # smallest t with mass(key > t) < top_p · kept mass
        kept_mass = _mass_above(x_row, V, inv_t, m, t, t - 1, SCALE_T, BLOCK).to(tl.float64)
        need = top_p_bits.to(tl.float64, bitcast=True) * kept_mass
        lo = t - 1
        hi = order_key(m)
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            ok = _mass_above(x_row, V, inv_t, m, t, mid, SCALE_T, BLOCK).to(tl.float64) < need
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid)
        t = hi
    # last pass: the kept mass and the Gumbel-max over the kept tokens
    kept_mass = tl.zeros([], tl.int64)
    best = tl.full([], -float("inf"), tl.float64)
    token = tl.zeros([], tl.int64)
    for c in range(0, V, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        z = _load_z(x_row, offs, V, inv_t, SCALE_T)
        kept = (z > -float("inf")) & (order_key(z) >= t)
        if MIN_P:
            kept = kept & ((z - m) >= min_p_log)
        kept_mass += tl.sum(tl.where(kept, masses(z, m), 0), 0)
        if not GIVEN:
            score = tl.where(kept, z.to(tl.float64) + gumbel(offs, tka, tkb), -float("inf"))
            chunk_best = tl.max(score, 0)
            better = chunk_best > best
            token = tl.where(better, c + tl.argmax(score, 0), token).to(tl.int64)
            best = tl.where(better, chunk_best, best)
    if GIVEN:
        token = tl.load(given_ptr)
    z_tok = _load_z(x_row, token, V, inv_t, SCALE_T)
    lp = _log_ratio(z_tok, m, total)
    slp = _log_ratio(z_tok, m, kept_mass)
    if GIVEN:
        kept_tok = (z_tok > -float("inf")) & (order_key(z_tok) >= t)
        if MIN_P:
            kept_tok = kept_tok & ((z_tok - m) >= min_p_log)
        slp = tl.where(kept_tok, slp, -float("inf"))
    return token, lp, slp


# ------------------------------------------------------------------ one row's blocks, one launch
@triton.jit
def _last_to_arrive(count_ptr, row, n_blocks):
    """True in the program that completes its row's blocks (the last of them to count itself):
    a barrier orders every thread's stores before the acquire-release count, so the blocks'
    partials are visible to it. It resets the counter, so the next launch counts from zero."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu") == n_blocks - 1


@triton.jit
def _step_of(steps_ptr, row, step_stride, step_value, STEPS: tl.constexpr):
    """A row's decoding step: from the steps tensor (stride 0: one for every row) or the int."""
    step = step_value
    if STEPS:
        step = tl.load(steps_ptr + row * step_stride)
    return step


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
def _workspace(f32_ws, i32_ws, i64_ws, n_rows, n_blocks):
    """The places of the partials in the three workspaces (``n = rows x blocks`` entries each;
    ``sample_logits`` sizes them): part_max, part_drop, row_max, sub_max (fp32); part_bad,
    part_fin, part_cnt, part_best_block, row_status, cand (int32); part_mass, row_fin, bound (int64)."""
    n = n_rows * n_blocks
    return (f32_ws, f32_ws + n, f32_ws + 2 * n, f32_ws + 2 * n + n_rows,
            i32_ws, i32_ws + n, i32_ws + 2 * n, i32_ws + 3 * n, i32_ws + 4 * n, i32_ws + 4 * n + n_rows,
            i64_ws, i64_ws + n, i64_ws + n + n_rows)


@triton.jit
def _maxima_kernel(x_ptr, stride, V, inv_t, top_k, f32_ws, i32_ws, i64_ws, count_ptr, n_rows, n_blocks,
                   SCALE_T: tl.constexpr, CANDIDATES: tl.constexpr, SPLIT: tl.constexpr, SUB: tl.constexpr,
                   TOPS: tl.constexpr, NBP: tl.constexpr, BOUND_LANES: tl.constexpr):
    """Launch 1, per (row, vocabulary block): the max (NaN skipped), the NaN/+inf entries, the
    finite ones; with ``CANDIDATES`` the ``TOPS`` largest of its ``SUB``-entry sub-block maxima.
    The row's last block combines them in block order: the row's max, status and finite
    entries, and with ``CANDIDATES`` the bound: the key of the k-th largest of the blocks' top
    sub-block maxima (distinct entries, so at most the k-th largest entry's key; the smallest
    key when fewer than k of them are finite)."""
    (part_max_ptr, _, row_max_ptr, sub_max_ptr, part_bad_ptr, part_fin_ptr, _, _, row_status_ptr, _, _, row_fin_ptr,
     bound_ptr) = _workspace(f32_ws, i32_ws, i64_ws, n_rows, n_blocks)
    pid = tl.program_id(0)
    row, blk = pid // n_blocks, pid % n_blocks
    z = _load_z(x_ptr + row.to(tl.int64) * stride, blk * SPLIT + tl.arange(0, SPLIT), V, inv_t, SCALE_T)
    part = row * n_blocks + blk
    z_num = tl.where(z == z, z, -float("inf"))
    tl.store(part_max_ptr + part, tl.max(z_num, 0))
    if CANDIDATES:  # the block's TOPS largest sub-block maxima, largest first
        subs = tl.max(tl.reshape(z_num, (SPLIT // SUB, SUB)), 1)
        at = tl.arange(0, SPLIT // SUB)
        for i in tl.static_range(TOPS):
            j = tl.argmax(subs, 0)
            tl.store(sub_max_ptr + part.to(tl.int64) * TOPS + i, tl.max(subs, 0))
            subs = tl.where(at == j, -float("inf"), subs)
    tl.store(part_bad_ptr + part, tl.sum(((z != z) | (z == float("inf"))).to(tl.int32), 0))
    tl.store(part_fin_ptr + part, tl.sum((z > -float("inf")).to(tl.int32), 0))
    if _last_to_arrive(count_ptr, row, n_blocks):
        m, status, n_finite = _row_stats(part_max_ptr, part_bad_ptr, part_fin_ptr, row, n_blocks, NBP)
        tl.store(row_max_ptr + row, m)
        tl.store(row_status_ptr + row, status)
        tl.store(row_fin_ptr + row, n_finite)
        if CANDIDATES:  # the k-th largest of the blocks' tops, by a sort (largest first)
            n_tops = n_blocks * TOPS
            lanes = tl.arange(0, BOUND_LANES)
            v = tl.load(sub_max_ptr + row.to(tl.int64) * n_tops + lanes, mask=lanes < n_tops, other=-float("inf"),
                        cache_modifier=".cg")
            kth = tl.max(tl.where(lanes == top_k - 1, tl.sort(v, 0, descending=True), -float("inf")), 0)
            tl.store(bound_ptr + row, tl.where(kth > -float("inf"), order_key(kth), -(2**31)))
        tl.store(count_ptr + row, 0)


@triton.jit
def _candidate_chunk(x_row, V, inv_t, cand_row, cnt, ends, top_k, first, SCALE_T: tl.constexpr, CL: tl.constexpr):
    """Candidates ``first .. first + CL`` of a row, the blocks' candidates one after another in
    block order (``cnt``: each block's number, ``ends`` their running sums): (index, z), z -inf
    past the last."""
    lanes = first + tl.arange(0, CL)
    before = ends[None, :] <= lanes[:, None]  # the blocks wholly before each lane
    slot = tl.sum(before.to(tl.int32), 1) * top_k + lanes - tl.sum(tl.where(before, cnt[None, :], 0), 1)
    valid = lanes < tl.max(ends, 0)
    ci = tl.load(cand_row + slot, mask=valid, other=0, cache_modifier=".cg")
    return ci, tl.where(valid, _load_z(x_row, ci, V, inv_t, SCALE_T), -float("inf"))


@triton.jit
def _draw_from_candidates(x_row, V, inv_t, m, total, top_k, top_p_bits, min_p_log, tka, tkb,
                          cand_row, cnt_row, drop_row, n_blocks,
                          SCALE_T: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr,
                          NBP: tl.constexpr, CL: tl.constexpr):
    """Top-k (then top-p, min-p) and the draw over the blocks' candidates (each block's k
    largest entries above the row's bound). They hold every token top-k keeps unless a block
    left out an entry equal to the k-th largest (a tie at the boundary): ``inexact`` says when.

    The candidates (usually a little over k) are read ``CL`` at a time, and each threshold is
    found by comparing every candidate with every other (``CL x CL`` at once): the k-th largest
    key is the largest with k keys at or above it; the top-p threshold the smallest kept key
    whose kept mass above it is below ``top_p`` of the kept mass."""
    b = tl.arange(0, NBP)
    cnt = tl.load(cnt_row + b, mask=b < n_blocks, other=0, cache_modifier=".cg")
    ends = tl.cumsum(cnt, 0)
    n = tl.sum(cnt, 0)
    t = tl.full([], -(2**31), tl.int64)  # the k-th largest key (the smallest when fewer are finite)
    for i0 in range(0, n, CL):
        _, zi = _candidate_chunk(x_row, V, inv_t, cand_row, cnt, ends, top_k, i0, SCALE_T, CL)
        ki = order_key(zi)
        at_or_above = tl.zeros([CL], tl.int32)
        for j0 in range(0, n, CL):
            _, zj = _candidate_chunk(x_row, V, inv_t, cand_row, cnt, ends, top_k, j0, SCALE_T, CL)
            at_or_above += tl.sum(((zj[None, :] > -float("inf")) & (order_key(zj)[None, :] >= ki[:, None])).to(tl.int32), 1)
        t = tl.maximum(t, tl.max(tl.where((zi > -float("inf")) & (at_or_above >= top_k), ki, -(2**31)), 0))
    drop = tl.load(drop_row + b, mask=b < n_blocks, other=-float("inf"), cache_modifier=".cg")
    inexact = tl.sum(((drop > -float("inf")) & (order_key(drop) >= t)).to(tl.int32), 0) > 0
    if TOP_P:
        kept_mass = tl.zeros([], tl.int64)
        for i0 in range(0, n, CL):
            _, zi = _candidate_chunk(x_row, V, inv_t, cand_row, cnt, ends, top_k, i0, SCALE_T, CL)
            kept_mass += tl.sum(tl.where((zi > -float("inf")) & (order_key(zi) >= t), masses(zi, m), 0), 0)
        need = top_p_bits.to(tl.float64, bitcast=True) * kept_mass.to(tl.float64)
        t_p = tl.full([], 2**31 - 1, tl.int64)
        for i0 in range(0, n, CL):
            _, zi = _candidate_chunk(x_row, V, inv_t, cand_row, cnt, ends, top_k, i0, SCALE_T, CL)
            ki = order_key(zi)
            above = tl.zeros([CL], tl.int64)  # the kept mass strictly above each candidate
            for j0 in range(0, n, CL):
                _, zj = _candidate_chunk(x_row, V, inv_t, cand_row, cnt, ends, top_k, j0, SCALE_T, CL)
                kj = order_key(zj)
                heavier = (zj[None, :] > -float("inf")) & (kj[None, :] >= t) & (kj[None, :] > ki[:, None])
                above += tl.sum(tl.where(heavier, masses(zj, m)[None, :], 0), 1)
            ok = (zi > -float("inf")) & (ki >= t) & (above.to(tl.float64) < need)
            t_p = tl.minimum(t_p, tl.min(tl.where(ok, ki, 2**31 - 1), 0))
        t = t_p
    best = tl.full([], -float("inf"), tl.float64)
    token = tl.full([], 2**31 - 1, tl.int32)
    mass = tl.zeros([], tl.int64)
    for i0 in range(0, n, CL):
        ci, zi = _candidate_chunk(x_row, V, inv_t, cand_row, cnt, ends, top_k, i0, SCALE_T, CL)
        kept = (zi > -float("inf")) & (order_key(zi) >= t)
        if MIN_P:
            kept = kept & ((zi - m) >= min_p_log)
        mass += tl.sum(tl.where(kept, masses(zi, m), 0), 0)
        score = tl.where(kept, zi.to(tl.float64) + gumbel(ci, tka, tkb), -float("inf"))
        top = tl.max(score, 0)
        first = tl.min(tl.where((score == top) & kept, ci, 2**31 - 1), 0)  # the first by index on a tie
        token = tl.where(top > best, first, tl.where(top == best, tl.minimum(token, first), token))
        best = tl.maximum(best, top)
    token = tl.where(token == 2**31 - 1, 0, token).to(tl.int64)  # none kept (a bad row): token 0
    z_tok = _load_z(x_row, token, V, inv_t, SCALE_T)
    return token, _log_ratio(z_tok, m, total), _log_ratio(z_tok, m, mass), inexact


@triton.jit
def _finish_row(x_row, row, V, inv_t, m, status, n_finite, tka, tkb, top_k, top_p_bits, min_p_log, given_ptr,
                part_mass_ptr, part_best_ptr, part_best_block_ptr, part_drop_ptr, cand_ptr, part_cnt_ptr,
                tok_ptr, lp_ptr, slp_ptr, status_ptr, n_blocks,
                SCALE_T: tl.constexpr, PLAIN: tl.constexpr, TOP_K: tl.constexpr, TOP_P: tl.constexpr,
                MIN_P: tl.constexpr, GIVEN: tl.constexpr, CANDIDATES: tl.constexpr, BLOCK: tl.constexpr,
                NBP: tl.constexpr, CL: tl.constexpr):
    """A row's blocks combined in block order: the mass, the draw (plain: the first best noise
    block, then Gumbel-max inside it; top-k: over the candidates; otherwise, or on a tie at the
    top-k boundary, by bisection over the row) and the log-probs (NaN for a bad row)."""
    b = tl.arange(0, NBP)
    at = row * n_blocks + b
    total = tl.sum(tl.load(part_mass_ptr + at, mask=b < n_blocks, other=0, cache_modifier=".cg"), 0)
    if PLAIN:
        if GIVEN:
            token = tl.load(given_ptr + row)
        else:
            scores = tl.load(part_best_ptr + at, mask=b < n_blocks, other=-float("inf"), cache_modifier=".cg")
            w = tl.argmax(scores, 0)  # the first on a tie
            best_block = tl.load(part_best_block_ptr + row * n_blocks + w, cache_modifier=".cg")
            cols = best_block * NOISE_BLOCK + tl.arange(0, NOISE_BLOCK)
            zc = _load_z(x_row, cols, V, inv_t, SCALE_T)
            token = (best_block * NOISE_BLOCK + tl.argmax(no_nan(zc.to(tl.float64) + gumbel(cols, tka, tkb)), 0))
            token = token.to(tl.int64)
        z_tok = _load_z(x_row, token, V, inv_t, SCALE_T)
        lp = _log_ratio(z_tok, m, total)
        slp = lp
    elif CANDIDATES:
        part = row * n_blocks
        token, lp, slp, inexact = _draw_from_candidates(
            x_row, V, inv_t, m, total, top_k, top_p_bits, min_p_log, tka, tkb,
            cand_ptr + part.to(tl.int64) * top_k, part_cnt_ptr + part, part_drop_ptr + part, n_blocks,
            SCALE_T, TOP_P, MIN_P, NBP, CL)
        if inexact:
            token, lp, slp = _draw_by_bisection(
                x_row, V, inv_t, m, total, n_finite, top_k, top_p_bits, min_p_log, given_ptr + row, tka, tkb,
                SCALE_T, TOP_K, TOP_P, MIN_P, GIVEN, BLOCK)
    else:
        token, lp, slp = _draw_by_bisection(
            x_row, V, inv_t, m, total, n_finite, top_k, top_p_bits, min_p_log, given_ptr + row, tka, tkb,
            SCALE_T, TOP_K, TOP_P, MIN_P, GIVEN, BLOCK)
    tl.store(tok_ptr + row, token)
    tl.store(lp_ptr + row, tl.where(status == 0, lp, float("nan")))
    tl.store(slp_ptr + row, tl.where(status == 0, slp, float("nan")))
    tl.store(status_ptr + row, status.to(tl.int8))


@triton.jit(do_not_specialize=["step_value"])
def _draw_kernel(
    x_ptr, stride, V, inv_t, seeds_ptr, steps_ptr, step_stride, step_value, top_k, top_p_bits, min_p_log, given_ptr,
    f32_ws, i32_ws, i64_ws, part_best_ptr, count_ptr, tok_ptr, lp_ptr, slp_ptr, status_ptr, n_rows, n_blocks,
    SCALE_T: tl.constexpr, STEPS: tl.constexpr, PLAIN: tl.constexpr, TOP_K: tl.constexpr, TOP_P: tl.constexpr,
    MIN_P: tl.constexpr, GIVEN: tl.constexpr, DRAW: tl.constexpr, CANDIDATES: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK: tl.constexpr, NBP: tl.constexpr, CL: tl.constexpr,
):
    """Launch 2, per (row, vocabulary block), under the row's max: the block's integer mass;
    with ``DRAW`` its best noise block (score, index; the first on a tie); with ``CANDIDATES``
    the indices of its (at most ``top_k``) largest entries at or above the row's bound, their
    number, and the largest such entry it leaves out. The row's last block finishes the row
    (``_finish_row``)."""
    (_, part_drop_ptr, row_max_ptr, _, _, _, part_cnt_ptr, part_best_block_ptr, row_status_ptr, cand_ptr, part_mass_ptr,
     row_fin_ptr, bound_ptr) = _workspace(f32_ws, i32_ws, i64_ws, n_rows, n_blocks)
    pid = tl.program_id(0)
    row, blk = pid // n_blocks, pid % n_blocks
    x_row = x_ptr + row.to(tl.int64) * stride
    m = tl.load(row_max_ptr + row)
    seed = tl.load(seeds_ptr + row)
    step = _step_of(steps_ptr, row, step_stride, step_value, STEPS)
    lanes = tl.arange(0, SPLIT)
    z = _load_z(x_row, blk * SPLIT + lanes, V, inv_t, SCALE_T)
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
    if CANDIDATES:  # the entries at or above the bound: all, by one scan, or the k largest
        above = (z > -float("inf")) & (z >= key_value(tl.load(bound_ptr + row)))
        count = tl.sum(above.to(tl.int32), 0)
        slots = cand_ptr + part.to(tl.int64) * top_k
        if count <= top_k:  # usually
            tl.store(slots + tl.cumsum(above.to(tl.int32), 0) - 1, blk * SPLIT + lanes, mask=above)
            tl.store(part_cnt_ptr + part, count)
            tl.store(part_drop_ptr + part, -float("inf"))
        else:
            work = tl.where(above, z, -float("inf"))
            for i in range(0, top_k):
                j = tl.argmax(work, 0)
                tl.store(slots + i, blk * SPLIT + j)
                work = tl.where(lanes == j, -float("inf"), work)
            tl.store(part_cnt_ptr + part, top_k)
            tl.store(part_drop_ptr + part, tl.max(work, 0))
    if _last_to_arrive(count_ptr, row, n_blocks):
        tka, tkb = row_keys(seed, step, SALT_TOKEN)
        _finish_row(x_row, row, V, inv_t, m, tl.load(row_status_ptr + row), tl.load(row_fin_ptr + row), tka, tkb,
                    top_k, top_p_bits, min_p_log, given_ptr, part_mass_ptr, part_best_ptr, part_best_block_ptr,
                    part_drop_ptr, cand_ptr, part_cnt_ptr, tok_ptr, lp_ptr, slp_ptr, status_ptr, n_blocks,
                    SCALE_T, PLAIN, TOP_K, TOP_P, MIN_P, GIVEN, CANDIDATES, BLOCK, NBP, CL)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (``triton.next_power_of_2``, without its host-call overhead)."""
    return 1 << max(n - 1, 0).bit_length()


def _step_args(steps, placeholder: Tensor) -> tuple:
    """(steps tensor, its stride, the int step, STEPS) for the kernels: ``steps`` an int or an
    int64 tensor ``[]``/``[B]`` on the logits' device (a tensor: a CUDA graph replays the new value)."""
    if isinstance(steps, Tensor):
        return steps, (steps.stride(0) if steps.dim() else 0), 0, True
    return placeholder, 0, int(steps), False


def sample_logits(logits: Tensor, inv_t: float, filters: _ref.Filters, seeds: Tensor, steps,
                  given: Optional[Tensor] = None,
                  config: Optional[SamplingConfig] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(tokens int64, log_probs fp32, sampled_log_probs fp32, status int8), each ``[B]``;
    ``logits [B, V]`` with unit stride along V, ``seeds`` int64 ``[B]``, ``steps`` an int or an
    int64 tensor (``[]`` or ``[B]``) on the logits' device. Two launches, no host read:
    capturable in a CUDA graph. ``config`` replaces ``default_config``."""
    B, V = logits.shape
    dev = logits.device
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    log_probs = torch.empty(B, dtype=torch.float32, device=dev)
    sampled = torch.empty(B, dtype=torch.float32, device=dev)
    status = torch.empty(B, dtype=torch.int8, device=dev)
    if B == 0:
        return tokens, log_probs, sampled, status
    cfg = config or default_config(dev)
    split = cfg.split_block
    n_blocks = -(-V // split)  # V alone sets the blocks: a row's arithmetic never depends on B
    top_k = filters.top_k or 0
    draw = filters.plain and given is None
    candidates = filters.top_k is not None and given is None and n_blocks * top_k <= cfg.candidate_cap

    n = B * n_blocks
    sub = cfg.sub_block
    # each block's largest sub-block maxima for the bound: twice its share of k (at least 4), so
    # that the k-th largest of them is close to the row's k-th largest sub-block max
    tops = min(split // sub, _pow2(max(4, -(-2 * top_k // n_blocks))))
    # three workspaces hold the partials (``_workspace``: their places), a fourth the plain draw's scores
    f32_ws = torch.empty(2 * n + B + (n * tops if candidates else 0), dtype=torch.float32, device=dev)
    i32_ws = torch.empty(4 * n + B + (n * top_k if candidates else 0), dtype=torch.int32, device=dev)
    i64_ws = torch.empty(n + 2 * B, dtype=torch.int64, device=dev)
    part_best = torch.empty(n, dtype=torch.float64, device=dev) if draw else tokens  # unused: any tensor
    count = torch.zeros(B, dtype=torch.int32, device=dev)  # each launch's last block per row resets it
    top_p_bits = struct.unpack("<q", struct.pack("<d", filters.top_p or 1.0))[0]  # float64, exactly
    scale_t = inv_t != 1.0
    nbp = max(2, _pow2(n_blocks))
    grid = (B * n_blocks,)
    # enable_fp_fusion=False: no fused multiply-adds, the torch backend's arithmetic, rounding for rounding
    _maxima_kernel[grid](
        logits, logits.stride(0), V, inv_t, top_k, f32_ws, i32_ws, i64_ws, count, B, n_blocks,
        SCALE_T=scale_t, CANDIDATES=candidates, SPLIT=split, SUB=sub, TOPS=tops, NBP=nbp,
        BOUND_LANES=_pow2(n_blocks * tops) if candidates else 16,
        num_warps=cfg.block_warps, enable_fp_fusion=False)
    steps_t, step_stride, step_value, has_steps = _step_args(steps, tokens)
    _draw_kernel[grid](
        logits, logits.stride(0), V, inv_t, seeds, steps_t, step_stride, step_value, top_k, top_p_bits,
        filters.min_p_log or 0.0, tokens if given is None else given,
        f32_ws, i32_ws, i64_ws, part_best, count, tokens, log_probs, sampled, status, B, n_blocks,
        SCALE_T=scale_t, STEPS=has_steps, PLAIN=filters.plain, TOP_K=filters.top_k is not None,
        TOP_P=filters.top_p is not None, MIN_P=filters.min_p_log is not None, GIVEN=given is not None, DRAW=draw,
        CANDIDATES=candidates, SPLIT=split, BLOCK=cfg.row_block, NBP=nbp,
        CL=cfg.candidate_lanes, num_warps=cfg.row_warps, enable_fp_fusion=False,
    )
    return tokens, log_probs, sampled, status
