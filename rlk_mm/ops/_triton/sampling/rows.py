"""Per-row pieces of the sampling kernels (``logits``, ``top_p``): the logits' loads, the
log-ratio of a mass, the row's arrival count, the candidate listing, the results' stores and
the bisection, a row's filters found a pass over the row per step where no list holds them."""

from __future__ import annotations

import triton
import triton.language as tl

from .noise import gumbel, masses, order_key

__all__ = [
    "append_chunk", "append_listed", "bucket_of", "draw_by_bisection", "gumbel_max", "kept_by", "last_to_arrive", "load_z",
    "log_ratio", "row_mass", "sorted_top_p_threshold", "step_of", "store_row", "workspace",
]


@triton.jit
def load_z(x_row, offs, V, inv_t, SCALE_T: tl.constexpr):
    """fp32 ``z`` of a row's entries ``offs`` (times ``inv_t`` with ``SCALE_T``; -inf past V)."""
    z = tl.load(x_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    if SCALE_T:
        z = z * inv_t
    return z


@triton.jit
def log_ratio(z_tok, m, mass):
    """``z_tok - m - log(mass / 2^40)`` in float64, as fp32: a log-prob from an integer mass."""
    lse = tl.log(mass.to(tl.float64) * (1.0 / 1099511627776.0))
    return (z_tok.to(tl.float64) - m.to(tl.float64) - lse).to(tl.float32)


@triton.jit
def kept_by(z, m, t, min_p_log, MIN_P: tl.constexpr):
    """The entries the filters keep: finite, with key at or above ``t`` (top-k's and top-p's
    threshold; ``-2^31``: none) and with ``MIN_P`` at or above min-p's cut below the max ``m``."""
    kept = (z > -float("inf")) & (order_key(z) >= t)
    if MIN_P:
        kept = kept & ((z - m) >= min_p_log)
    return kept


@triton.jit
def gumbel_max(index, z, kept, tka, tkb):
    """(the best float64 score ``z + gumbel(index)`` over the kept entries, its index: the
    first on a tie, ``2^31 - 1`` where none is kept)."""
    score = tl.where(kept, z.to(tl.float64) + gumbel(index, tka, tkb), -float("inf"))
    top = tl.max(score, 0)
    return top, tl.min(tl.where(kept & (score == top), index, 2**31 - 1), 0)


@triton.jit
def sorted_top_p_threshold(zs, m, t, mass_above, top_p_bits, total, OF_LISTED: tl.constexpr):
    """Top-p's threshold key among listed values ``zs`` sorted largest first, of those with key
    at or above ``t``: the smallest key with less than ``top_p`` of the kept mass above it. The
    mass above a value is ``mass_above`` (of entries above every listed one) plus the running
    sum of the masses before it (at a run of equal values' first: the mass strictly above); the
    kept mass is the listed entries' (``OF_LISTED``: the list holds every kept entry) or ``total``."""
    ks = order_key(zs)
    eligible = (zs > -float("inf")) & (ks >= t)
    ms = tl.where(eligible, masses(zs, m), 0)
    above = mass_above + tl.cumsum(ms, 0) - ms
    kept_mass = total
    if OF_LISTED:
        kept_mass = tl.sum(ms, 0)
    need = top_p_bits.to(tl.float64, bitcast=True) * kept_mass.to(tl.float64)
    return tl.min(tl.where(eligible & (above.to(tl.float64) < need), ks, 2**31 - 1), 0)


@triton.jit
def _count_from(x_row, V, inv_t, t, SCALE_T: tl.constexpr, BLOCK: tl.constexpr):
    """How many finite entries of the row have key >= t."""
    n = tl.zeros([], tl.int64)
    for c in range(0, V, BLOCK):
        z = load_z(x_row, c + tl.arange(0, BLOCK), V, inv_t, SCALE_T)
        n += tl.sum(((z > -float("inf")) & (order_key(z) >= t)).to(tl.int64), 0)
    return n


@triton.jit
def _mass_above(x_row, V, inv_t, m, t_kept, t, SCALE_T: tl.constexpr, BLOCK: tl.constexpr):
    """Σ masses of the finite entries with key >= t_kept and key > t."""
    s = tl.zeros([], tl.int64)
    for c in range(0, V, BLOCK):
        z = load_z(x_row, c + tl.arange(0, BLOCK), V, inv_t, SCALE_T)
        key = order_key(z)
        s += tl.sum(tl.where((z > -float("inf")) & (key >= t_kept) & (key > t), masses(z, m), 0), 0)
    return s


@triton.jit
def draw_by_bisection(x_row, V, inv_t, m, total, n_finite, top_k, top_p_bits, min_p_log, given_ptr, tka, tkb,
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
        z = load_z(x_row, offs, V, inv_t, SCALE_T)
        kept = kept_by(z, m, t, min_p_log, MIN_P)
        kept_mass += tl.sum(tl.where(kept, masses(z, m), 0), 0)
        if not GIVEN:
            chunk_best, chunk_token = gumbel_max(offs, z, kept, tka, tkb)
            better = chunk_best > best  # an earlier chunk keeps a tie: the first index
            token = tl.where(better, chunk_token, token).to(tl.int64)
            best = tl.where(better, chunk_best, best)
    if GIVEN:
        token = tl.load(given_ptr)
    z_tok = load_z(x_row, token, V, inv_t, SCALE_T)
    lp = log_ratio(z_tok, m, total)
    slp = log_ratio(z_tok, m, kept_mass)
    if GIVEN:
        slp = tl.where(kept_by(z_tok, m, t, min_p_log, MIN_P), slp, -float("inf"))
    return token, lp, slp


@triton.jit
def last_to_arrive(count_ptr, row, n_blocks):
    """True in the program that completes its row's blocks (the last of them to count itself):
    a barrier orders every thread's stores before the acquire-release count, so the blocks'
    partials are visible to it. A launch that counts after another resets the count first
    (the previous launch's last block stores 0)."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu") == n_blocks - 1


@triton.jit
def step_of(steps_ptr, row, step_stride, step_value, STEPS: tl.constexpr):
    """A row's decoding step: from the steps tensor (stride 0: one for every row) or the int."""
    step = step_value
    if STEPS:
        step = tl.load(steps_ptr + row * step_stride)
    return step


@triton.jit
def row_mass(part_mass_ptr, row, n_blocks, NBP: tl.constexpr):
    """A row's integer mass: its blocks' partials summed."""
    b = tl.arange(0, NBP)
    return tl.sum(tl.load(part_mass_ptr + row * n_blocks + b, mask=b < n_blocks, other=0, cache_modifier=".cg"), 0)


@triton.jit
def store_row(row, token, lp, slp, status, tok_ptr, lp_ptr, slp_ptr, status_ptr):
    """A row's results; a bad row's as the torch backend gives them: token 0, log-probs NaN."""
    tl.store(tok_ptr + row, tl.where(status == 0, token, 0))
    tl.store(lp_ptr + row, tl.where(status == 0, lp, float("nan")))
    tl.store(slp_ptr + row, tl.where(status == 0, slp, float("nan")))
    tl.store(status_ptr + row, status.to(tl.int8))


@triton.jit
def bucket_of(z, m, PER_UNIT: tl.constexpr, BUCKETS: tl.constexpr):
    """A finite entry's mass bucket (``top_p``): ``floor((m - z) · PER_UNIT)`` in ``[0, BUCKETS)``,
    entries further below the row's max ``m`` in the last. A larger z never takes a later
    bucket and equal values share one: fp32's rounding of ``m - z`` is monotone, and the
    power-of-two scale exact."""
    return tl.minimum(tl.maximum(tl.floor((m - z) * PER_UNIT), 0.0), BUCKETS - 1.0).to(tl.int32)


@triton.jit
def append_chunk(zc, offs, listed, at, row, cand_index_ptr, cand_z_ptr, LANES: tl.constexpr):
    """Stores the ``listed`` entries of a chunk (values ``zc`` at ``offs``) in row ``row``'s
    candidate slots from ``at`` on (an atomic count gave the place); past ``LANES`` none."""
    slot = at + tl.cumsum(listed.to(tl.int32), 0) - 1
    keep = listed & (slot < LANES)
    tl.store(cand_index_ptr + row.to(tl.int64) * LANES + slot, offs, mask=keep)
    tl.store(cand_z_ptr + row.to(tl.int64) * LANES + slot, zc, mask=keep)


@triton.jit
def append_listed(x_row, z, row, blk, V, inv_t, bound, list_count_ptr, cand_index_ptr, cand_z_ptr,
                  SCALE_T: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Appends block ``blk``'s finite entries at or above ``bound`` (``z``: the block's values)
    to row ``row``'s candidates, index and value: an atomic count per row (``list_count_ptr``)
    gives the block its place, so their order varies from run to run; past ``LANES`` entries
    only the count grows (the row overflows). A chunk of ``CHUNK`` entries at a time, reread
    from the cache, only the chunks that hold some: offsets over the whole block take registers."""
    listed = (z > -float("inf")) & (z >= bound)
    per_chunk = tl.sum(tl.reshape(listed.to(tl.int32), (SPLIT // CHUNK, CHUNK)), 1)
    count = tl.sum(per_chunk, 0)
    if count > 0:
        at = tl.atomic_add(list_count_ptr + row, count, sem="relaxed")
        chunks = tl.arange(0, SPLIT // CHUNK)
        for c in range(0, SPLIT // CHUNK):
            n_c = tl.sum(tl.where(chunks == c, per_chunk, 0), 0)
            if n_c > 0:
                offs = blk * SPLIT + c * CHUNK + tl.arange(0, CHUNK)
                zc = load_z(x_row, offs, V, inv_t, SCALE_T)
                append_chunk(zc, offs, (zc > -float("inf")) & (zc >= bound), at, row, cand_index_ptr, cand_z_ptr,
                             LANES)
                at += n_c


@triton.jit
def workspace(f32_ws, i32_ws, i64_ws, n_rows, n_blocks, LANES: tl.constexpr):
    """The places of the partials in the three workspaces (``n = rows x blocks`` entries;
    ``LANES`` candidate slots per row; ``logits.sample_logits`` sizes them): part_max, row_max,
    cand_z, group_max (fp32); part_bad, part_fin, part_best_block, row_status, cand_index
    (int32); part_mass, row_fin, bound (int64)."""
    n = n_rows * n_blocks
    return (f32_ws, f32_ws + n, f32_ws + n + n_rows, f32_ws + n + n_rows * (1 + LANES),
            i32_ws, i32_ws + n, i32_ws + 2 * n, i32_ws + 3 * n, i32_ws + 3 * n + n_rows,
            i64_ws, i64_ws + n, i64_ws + n + n_rows)
