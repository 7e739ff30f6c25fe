"""Plain-torch rollout sampling: the CPU backend, the counter-based RNG every backend shares,
and the oracle the Triton kernels are tested against.

Randomness is a pure function of (seed, step, index): a bijective 32-bit integer mix
(``mix32``: two multiplies, three xor-shifts) keyed per row by its seed and step, applied to
a vocabulary index (or a noise-block index), gives 24 random bits, ``u = (bits | 1) / 2^24``
in (0, 1) and the Gumbel variate ``g = -log(-log u)`` in float64. The Triton kernels run the
same integer arithmetic, so a row's noise is the same on every device.

What is drawn (``z = fp32(logits) · fp32(1 / temperature)``):

* plain temperature: the vocabulary is cut into blocks of ``NOISE_BLOCK`` entries; block
  ``b`` is drawn by Gumbel-max over its log-mass ``ℓ_b = max_b + log Σ_b exp(z - max_b)``
  (fp32) with block noise, then a token inside it by Gumbel-max over ``z`` with token noise
  (scores compared in float64). Both draws are exact, so the token follows ``softmax(z)``;
  only the chosen block's tokens need noise.
* filters (``top_k``, then ``top_p`` on the survivors, then ``min_p``: the order of HF's
  warpers), each a threshold on ``z``: top-k keeps ``z >= the k-th largest`` (ties at the
  boundary kept, as HF and vLLM do); top-p keeps token ``i`` when the kept mass strictly
  above ``z_i`` is below ``top_p`` times the kept mass (so the top token always stays, and
  ties are kept or dropped together); min-p keeps ``z - max >= fp32(log min_p)``. Masses are
  integers ``e_i = trunc(exp(z_i - max) · 2^40)`` (``masses``: an exp made of fp32 adds and
  multiplies in a fixed order, so every backend gets its bits; relative error under 1e-6),
  summed exactly, so no summation order enters a decision. The token is the Gumbel-max over
  the kept tokens.

``log_probs = z[token] - max - log(Σ e · 2^-40)`` (float64, rounded to fp32);
``sampled_log_probs`` the same over the kept tokens (equal to ``log_probs`` without filters).

Every row is processed on its own, with shapes that depend on V alone: CPU kernels take
vectorized or scalar code paths by an element's position in a tensor, so batching rows
would let a row's bits depend on the batch.
"""

from __future__ import annotations

import contextlib
import math
import struct
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import logprob as _lp

__all__ = [
    "block_log_mass", "draw_in_block", "EXP_POLY", "Filters", "FIXED_BITS", "GOLDEN", "gumbel", "kept_by_filters",
    "fp32", "keys_of", "LN2_HI", "LN2_LO", "LOG2E", "MASK32", "MASS_FLOOR", "masses", "mix32", "NOISE_BLOCK", "one_thread",
    "row_keys", "RowKeys", "RowResult", "sample_hidden_rows", "sample_row", "sample_rows",
]

Tensor = torch.Tensor

#: vocabulary entries per noise block (part of what is drawn: every backend uses it)
NOISE_BLOCK = 32
#: masses are integers in units of 2^-FIXED_BITS of the row's largest probability
FIXED_BITS = 40


def fp32(x: float) -> float:
    """``x`` rounded to float32 (to nearest, as a tensor conversion rounds), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


#: ``masses``' fp32 constants: log2(e); ln 2 in a high part of 12 significant bits (so that
#: ``n · LN2_HI`` is exact) and the rest; the Taylor coefficients of exp, highest degree first
LOG2E = fp32(1 / math.log(2))
LN2_HI = 0.693145751953125
LN2_LO = fp32(math.log(2) - LN2_HI)
EXP_POLY = tuple(fp32(1 / math.factorial(i)) for i in range(6, -1, -1))
#: ``z - max`` below this has mass 0 (exp(-32) · 2^40 < 1)
MASS_FLOOR = -32.0

MASK32 = 0xFFFFFFFF
MIX1, MIX2 = 0x7FEB352D, 0x846CA68B
GOLDEN = 0x9E3779B9
SALT_TOKEN, SALT_BLOCK, SALT_SECOND = 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F

#: row status codes the backends report (the public op raises on anything but OK)
OK, NOT_FINITE, ALL_MASKED = 0, 1, 2


class Filters(NamedTuple):
    """Checked filter settings; None where a filter is off (or would keep every token)."""

    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p_log: Optional[float] = None  # fp32(log(min_p))

    @property
    def plain(self) -> bool:
        return self.top_k is None and self.top_p is None and self.min_p_log is None


# ------------------------------------------------------------------ the RNG
def mix32(x: Tensor) -> Tensor:
    """A bijective 32-bit mix of int64 tensors holding [0, 2^32) values (the int64 products
    wrap modulo 2^64; their low 32 bits are the uint32 products)."""
    x = x ^ (x >> 16)
    x = (x * MIX1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX2) & MASK32
    return x ^ (x >> 16)


def row_keys(seeds: Tensor, steps: Tensor, salt: int) -> tuple[Tensor, Tensor]:
    """Two 32-bit keys per row (int64 tensors) from its int64 seed and step; ``salt`` keeps
    the token and block noise apart."""
    lo, hi, st = seeds & MASK32, (seeds >> 32) & MASK32, steps & MASK32
    a = mix32(lo ^ GOLDEN)
    a = mix32(a ^ hi)
    a = mix32(a ^ st)
    ka = mix32(a ^ salt)
    return ka, mix32(ka ^ SALT_SECOND)


def gumbel(index: Tensor, ka: Tensor, kb: Tensor) -> Tensor:
    """float64 Gumbel noise of int64 ``index`` under keys ``ka``, ``kb``."""
    bits = mix32((mix32(index ^ ka) + kb) & MASK32) >> 8
    u = (bits | 1).double() * 2.0**-24
    return -torch.log(-torch.log(u))


class RowKeys(NamedTuple):
    """A row's token and block noise keys (0-d int64 tensors)."""

    token: tuple[Tensor, Tensor]
    block: tuple[Tensor, Tensor]


def keys_of(seeds: Tensor, steps: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(token ka, token kb, block ka, block kb), int64 ``[B]``, of every row."""
    return (*row_keys(seeds, steps, SALT_TOKEN), *row_keys(seeds, steps, SALT_BLOCK))


# ------------------------------------------------------------------ one row
class RowResult(NamedTuple):
    token: Tensor  # int64 0-d
    log_prob: Tensor  # fp32 0-d
    sampled_log_prob: Tensor  # fp32 0-d
    status: int


def _log_ratio(z_tok: Tensor, m: Tensor, mass: Tensor) -> Tensor:
    """fp32 ``z_tok - m - log(mass · 2^-40)`` computed in float64 (``mass`` an int64 sum)."""
    return (z_tok.double() - m.double() - torch.log(mass.double() * 2.0**-FIXED_BITS)).float()


def masses(d: Tensor) -> Tensor:
    """int64 ``trunc(exp(d) · 2^FIXED_BITS)`` of fp32 ``d = z - max <= 0`` (0 for -inf).

    The exp is made of fp32 operations that round the same on every device (a Triton kernel
    with ``enable_fp_fusion=False`` computes the same bits): ``n = floor(d · log2 e + 1/2)``,
    ``r = d - n · ln 2`` in two parts (Cody-Waite), a degree-6 Taylor polynomial of ``exp(r)``
    (|r| <= 0.35; with the fp32 roundings, relative error under 1e-6) and an exact scaling by
    ``2^(n + FIXED_BITS)``. Several times cheaper than a float64 exp, which bounded a GPU pass
    over the logits."""
    d = torch.clamp(d, min=MASS_FLOOR)
    n = torch.floor(d * LOG2E + 0.5)
    r = (d - n * LN2_HI) - n * LN2_LO
    p = r * EXP_POLY[0] + EXP_POLY[1]
    for c in EXP_POLY[2:]:
        p = p * r + c
    scale = ((n.to(torch.int32) + (127 + FIXED_BITS)) << 23).view(torch.float32)  # 2^(n + FIXED_BITS)
    return (p * scale).to(torch.int64)


def block_log_mass(z: Tensor) -> Tensor:
    """fp32 ``ℓ_b = max_b + log Σ_b exp(z - max_b)`` of each ``NOISE_BLOCK`` block of ``z [V]``
    (-inf for a block masked whole or past V)."""
    nb = -(-z.numel() // NOISE_BLOCK)
    zb = (F.pad(z, (0, nb * NOISE_BLOCK - z.numel()), value=-math.inf) if z.numel() % NOISE_BLOCK else z).view(nb, NOISE_BLOCK)
    mb = zb.amax(1)
    safe = torch.where(mb == -math.inf, 0.0, mb)
    return torch.where(mb == -math.inf, -math.inf, safe + torch.log(torch.exp(zb - safe[:, None]).sum(1)))


def draw_in_block(z_block: Tensor, block, keys: tuple[Tensor, Tensor]) -> Tensor:
    """The token (int64 0-d) Gumbel-max draws among block ``block``'s logits ``z_block [NOISE_BLOCK]``
    (entries past V are -inf)."""
    cols = block * NOISE_BLOCK + torch.arange(NOISE_BLOCK, device=z_block.device)
    return cols[torch.argmax(z_block.double() + gumbel(cols, *keys))]


def sample_row(x: Tensor, inv_t: float, filters: Filters, keys: RowKeys, given: Optional[Tensor] = None,
               log_prob: bool = True) -> RowResult:
    """Draw from one row ``x [V]`` (any float dtype); ``inv_t`` is fp32-representable.
    ``given``: score this token instead of drawing one (its sampled log-prob is -inf when
    the filters drop it). ``log_prob=False``: a plain draw skips the mass pass (the
    row's largest cost) and returns NaN log-probs, for callers that score the token
    themselves. A row with NaN or +inf (after the temperature), or -inf everywhere, returns
    its status and NaN placeholders."""
    z = x.float()
    if inv_t != 1.0:  # multiplying by 1 is exact: skip the pass
        z = z * torch.tensor(inv_t, dtype=torch.float32, device=z.device)
    m = z.amax()  # NaN if any entry is NaN
    if bool(torch.isnan(m)) or bool(m == math.inf) or bool(m == -math.inf):
        nan = torch.full((), math.nan, device=z.device)
        return RowResult(torch.zeros((), dtype=torch.int64, device=z.device), nan, nan,
                         ALL_MASKED if bool(m == -math.inf) else NOT_FINITE)
    if filters.plain and given is None and not log_prob:
        nan = torch.full((), math.nan, device=z.device)
        return RowResult(_plain_draw(z, keys), nan, nan, OK)
    e = masses(z - m)
    total = e.sum()
    if filters.plain:
        token = _plain_draw(z, keys) if given is None else given
        lp = _log_ratio(z[token], m, total)
        return RowResult(token, lp, lp, OK)
    kept = kept_by_filters(z, m, e, filters)
    if given is None:
        idx = torch.nonzero(kept).flatten()
        token = idx[torch.argmax(z[idx].double() + gumbel(idx, *keys.token))]
    else:
        token = given
    sampled = _log_ratio(z[token], m, torch.where(kept, e, 0).sum())
    if given is not None and not bool(kept[token]):
        sampled = torch.full_like(sampled, -math.inf)
    return RowResult(token, _log_ratio(z[token], m, total), sampled, OK)


def _plain_draw(z: Tensor, keys: RowKeys) -> Tensor:
    """The plain-temperature draw from ``z [V]`` (fp32, finite max): a block by Gumbel-max
    over the blocks' log-masses, then a token inside it."""
    blocks = torch.arange(-(-z.numel() // NOISE_BLOCK), device=z.device)
    b = int(torch.argmax(block_log_mass(z).double() + gumbel(blocks, *keys.block)))
    zb = z[b * NOISE_BLOCK : (b + 1) * NOISE_BLOCK]
    return draw_in_block(F.pad(zb, (0, NOISE_BLOCK - zb.numel()), value=-math.inf), b, keys.token)


def kept_by_filters(z: Tensor, m: Tensor, e: Tensor, filters: Filters) -> Tensor:
    """The bool mask ``[V]`` of the tokens the filters keep (masses ``e`` as above)."""
    kept = z > -math.inf
    if filters.top_k is not None and filters.top_k < int(kept.sum()):
        kept &= z >= torch.topk(z, filters.top_k).values[-1]
    if filters.top_p is not None:
        values, order = torch.topk(torch.where(kept, z, -math.inf), int(kept.sum()))  # largest first
        e_sorted = e[order]
        before = torch.cumsum(e_sorted, 0) - e_sorted  # mass ranked above each (ties: any order)
        n_star = (before.double() < filters.top_p * e_sorted.sum().double()).sum()
        kept &= z >= values[n_star - 1]  # a tie's first member decides for all of them
    if filters.min_p_log is not None:
        kept &= (z - m) >= filters.min_p_log
    return kept


# ------------------------------------------------------------------ batches
def sample_rows(logits: Tensor, inv_t: float, filters: Filters, seeds: Tensor, steps: Tensor,
                given: Optional[Tensor] = None, log_prob: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(tokens int64, log_probs fp32, sampled_log_probs fp32, status int8), each ``[B]``, of
    ``logits [B, V]``; ``seeds``/``steps`` int64 ``[B]`` on the logits' device
    (``log_prob``: as ``sample_row``'s)."""
    B, dev = logits.shape[0], logits.device
    tokens = torch.zeros(B, dtype=torch.int64, device=dev)
    log_probs = torch.zeros(B, dtype=torch.float32, device=dev)
    sampled = torch.zeros(B, dtype=torch.float32, device=dev)
    status = torch.zeros(B, dtype=torch.int8, device=dev)
    tka, tkb, bka, bkb = keys_of(seeds, steps)
    with one_thread():
        for r in range(B):
            keys = RowKeys((tka[r], tkb[r]), (bka[r], bkb[r]))
            res = sample_row(logits[r], inv_t, filters, keys, None if given is None else given[r], log_prob)
            tokens[r], log_probs[r], sampled[r], status[r] = res.token, res.log_prob, res.sampled_log_prob, res.status
    return tokens, log_probs, sampled, status


@contextlib.contextmanager
def one_thread():
    """One intra-op thread inside: a row's ops then split the same way on every machine (the
    vectorized or scalar path of an element depends on where the thread chunks end), and
    small per-row ops skip the thread pool (which, on a busy machine, costs far more than it gives)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


#: vocabulary entries per block of the logits tile transposes in ``sample_hidden_rows``
_TRANSPOSE_BLOCK = 512
#: the integer dtype of each float width, to compare hidden rows bit for bit
_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@_lp.head_kernels
def sample_hidden_rows(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], temperature: float, filters: Filters,
                       seeds: Tensor, steps: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``sample_rows`` of the tempered logits of ``hidden [B, H]``, formed exactly as the torch
    ``selected_logprob`` forms them (its tiles, products and partials, ``ROW_CHUNK`` rows at a
    time), so ``log_probs`` are that op's bits: the drawn token's logit minus the row's
    log-sum-exp from the same partials (NaN on a row whose status is not OK).

    Equal hidden rows (a GRPO group's G answers at their first token) share one logits row;
    each row still draws with its own seed."""
    B, dev = hidden.shape[0], hidden.device
    w = weight.float()
    b = _lp.tempered(None if bias is None else bias.float(), temperature)
    # rows equal bit for bit (compared as integers: -0.0 and 0.0 stay apart)
    bits, owner = torch.unique(hidden.contiguous().view(_SAME_WIDTH_INT[hidden.element_size()]), dim=0,
                               return_inverse=True)
    distinct = bits.view(hidden.dtype)
    out = [torch.zeros(B, dtype=t, device=dev) for t in (torch.int64, torch.float32, torch.float32, torch.int8)]
    for s, e, h_t in _lp.row_chunks(distinct, torch.arange(distinct.shape[0], device=dev), torch.float32, temperature):
        z = h_t.new_empty((e - s, w.shape[0]))  # the chunk's real rows (not its zero padding), row-major

        def keep(c: int, tile: Tensor) -> None:
            for j in range(0, tile.shape[0], _TRANSPOSE_BLOCK):  # blocks that stay in cache: 2-4x faster than one copy
                z[:, c + j : c + j + _TRANSPOSE_BLOCK] = tile[j : j + _TRANSPOSE_BLOCK, : e - s].T

        lse = _lp.combine_partials(_lp.chunk_partials(h_t, w, b, False, keep))[0]
        mine = torch.nonzero((owner >= s) & (owner < e)).flatten()
        local = owner[mine] - s
        tokens, _, sampled, status = sample_rows(z[local], 1.0, filters, seeds[mine], steps[mine],
                                                 log_prob=not filters.plain)
        log_probs = z[local, tokens] - lse[local]
        log_probs[status != OK] = math.nan
        for o, part in zip(out, (tokens, log_probs, log_probs if filters.plain else sampled, status)):
            o[mine] = part
    return tuple(out)


@_lp.head_kernels
def sample_gathered_rows(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], temperature: float, filters: Filters,
                         seeds: Tensor, steps: Tensor, gather_logits) -> tuple[Tensor, Tensor, Tensor]:
    """``sample_rows`` of the tempered logits of ``hidden [B, H]`` against a vocabulary shard
    ``weight``: each chunk's local logits, formed as ``sample_hidden_rows`` forms them, are
    completed by ``gather_logits(z [V_local, rows], dim=0)`` (the group's vocabulary, in
    order). Returns ``(tokens, sampled_log_probs, status)``; the caller scores the tokens."""
    w = weight.float()
    b = _lp.tempered(None if bias is None else bias.float(), temperature)
    B, dev = hidden.shape[0], hidden.device
    out = [torch.zeros(B, dtype=t, device=dev) for t in (torch.int64, torch.float32, torch.int8)]
    for s, e, h_t in _lp.row_chunks(hidden, torch.arange(B, device=dev), torch.float32, temperature):
        tiles = [_lp.logits_tile(h_t, w, b, c) for c in range(0, w.shape[0], _lp.VOCAB_TILE)]
        z = gather_logits(torch.cat(tiles) if tiles else h_t.new_empty((0, h_t.shape[1])), dim=0)
        # row-major rows: the per-row draw on strided columns is several times slower
        tokens, _, sampled, status = sample_rows(z.T[: e - s].contiguous(), 1.0, filters, seeds[s:e], steps[s:e],
                                                 log_prob=not filters.plain)
        for o, part in zip(out, (tokens, sampled, status)):
            o[s:e] = part
    return tuple(out)
