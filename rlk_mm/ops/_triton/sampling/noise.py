"""The arithmetic the sampling kernels share with ``_torch.sampling``, operation for operation:
the counter-based RNG (``row_keys``; float64 Gumbel noise, ``gumbel``), the noise-block draw's
fp32 screen (``gumbel32``, ``best_noise_block``), the integer masses (``masses``) and an
order-preserving integer key of fp32 values (``order_key``, ``key_value``). The kernels that use
them compile with ``enable_fp_fusion=False``, so every rounding is the torch backend's."""

from __future__ import annotations

import triton
import triton.language as tl

from ..._torch import sampling as _ref

__all__ = [
    "best_noise_block", "gumbel", "gumbel32", "key_value", "masses", "no_nan", "NOISE_BLOCK", "order_key", "row_keys",
    "SALT_BLOCK", "SALT_TOKEN",
]

NOISE_BLOCK: tl.constexpr = tl.constexpr(_ref.NOISE_BLOCK)
SALT_TOKEN: tl.constexpr = tl.constexpr(_ref.SALT_TOKEN)
SALT_BLOCK: tl.constexpr = tl.constexpr(_ref.SALT_BLOCK)
MASS_FLOOR: tl.constexpr = tl.constexpr(_ref.MASS_FLOOR)
#: the fp32 screen's margin below the best fp32 score (absolute + relative to it): ten times
#: the screen's worst error (the fp32 noise's 1e-5 and the sum's rounding), so no block that
#: can have the best float64 score is screened out
SCREEN_ABS: tl.constexpr = tl.constexpr(1e-4)
SCREEN_REL: tl.constexpr = tl.constexpr(2.0**-18)
LOG2E: tl.constexpr = tl.constexpr(_ref.LOG2E)
LN2_HI: tl.constexpr = tl.constexpr(_ref.LN2_HI)
LN2_LO: tl.constexpr = tl.constexpr(_ref.LN2_LO)
EXP_POLY_6, EXP_POLY_5, EXP_POLY_4, EXP_POLY_3, EXP_POLY_2, EXP_POLY_1, EXP_POLY_0 = (
    tl.constexpr(c) for c in _ref.EXP_POLY)
MASS_EXPONENT_BIAS: tl.constexpr = tl.constexpr(127 + _ref.FIXED_BITS)  # 2^(n + FIXED_BITS) as fp32 bits


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def row_keys(seed, step, SALT: tl.constexpr):
    """A row's two uint32 keys from its int64 seed and step (``_torch.sampling.row_keys``)."""
    a = _mix32(seed.to(tl.uint32) ^ tl.full([], 0x9E3779B9, tl.uint32))
    a = _mix32(a ^ (seed >> 32).to(tl.uint32))
    a = _mix32(a ^ step.to(tl.uint32))
    ka = _mix32(a ^ tl.full([], SALT, tl.uint32))
    return ka, _mix32(ka ^ tl.full([], 0x27D4EB2F, tl.uint32))


@triton.jit
def _noise_bits(index, ka, kb):
    """The 24 random bits of ``index`` under keys ``ka``, ``kb``, odd: ``u = bits / 2^24`` in (0, 1)."""
    return (_mix32(_mix32(index.to(tl.uint32) ^ ka) + kb) >> 8) | 1


@triton.jit
def gumbel(index, ka, kb):
    """float64 Gumbel noise of non-negative int ``index`` under uint32 keys ``ka``, ``kb``."""
    u = _noise_bits(index, ka, kb).to(tl.float64) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(u))


@triton.jit
def gumbel32(index, ka, kb):
    """fp32 Gumbel noise of ``index`` under keys ``ka``, ``kb``: ``gumbel``'s to within about
    1e-5, whatever the fp32 log's accuracy (``-log u`` of a ``u`` near 1 by its series in the
    exact ``1 - u``), to screen which float64 scores can be the best."""
    bits = _noise_bits(index, ka, kb)
    t = (16777216 - bits).to(tl.float32) * (1.0 / 16777216.0)  # 1 - u, exact
    u = bits.to(tl.float32) * (1.0 / 16777216.0)
    series = t * (1.0 + t * (1.0 / 2 + t * (1.0 / 3 + t * (1.0 / 4 + t * (1.0 / 5 + t * (1.0 / 6))))))  # -log(1 - t)
    return -tl.log(tl.where(t < 0.0625, series, -tl.log(u)))


@triton.jit
def best_noise_block(ell, blocks, ka, kb):
    """Per row of ``ell [M, NB]`` (fp32 log-masses of noise blocks ``blocks [1, NB]``; keys
    ``ka``, ``kb`` ``[M]``): the float64 max of ``ell + gumbel`` (NaN as -inf) and its block, the
    first on a tie, as an argmax over all of them gives. Float64 noise is computed only for the
    blocks whose fp32 screen (``gumbel32``) is within ``SCREEN`` of the row's best, one block per
    row at a time (usually one in all): the others cannot win. Returns ``(best, block)``, ``[M]``."""
    idx = tl.broadcast_to(blocks, ell.shape)
    s32 = no_nan(ell + gumbel32(idx, ka[:, None], kb[:, None]))
    top = tl.max(s32, 1)
    near = (s32 >= (top - (SCREEN_ABS + SCREEN_REL * tl.abs(top)))[:, None]) & (s32 > -float("inf"))
    best = tl.full(top.shape, -float("inf"), tl.float64)
    best_block = tl.min(idx, 1)
    while tl.max(near.to(tl.int32)) > 0:
        i = tl.min(tl.where(near, idx, 2**31 - 1), 1)  # each row's first near block (none: 2^31 - 1)
        pick = idx == i[:, None]
        s = no_nan(tl.max(tl.where(pick, ell, -float("inf")), 1).to(tl.float64) + gumbel(i, ka, kb))
        better = (i != 2**31 - 1) & (s > best)
        best = tl.where(better, s, best)
        best_block = tl.where(better, i, best_block)
        near = near & (idx != i[:, None])
    return best, best_block


@triton.jit
def masses(z, m):
    """int64 ``trunc(exp(z - m) · 2^40)`` (0 for z = -inf): ``_torch.sampling.masses``, operation
    for operation (the kernels compile without fused multiply-adds)."""
    d = tl.maximum(z - m, MASS_FLOOR)
    n = tl.floor(d * LOG2E + 0.5)
    r = (d - n * LN2_HI) - n * LN2_LO
    p = r * EXP_POLY_6 + EXP_POLY_5
    p = p * r + EXP_POLY_4
    p = p * r + EXP_POLY_3
    p = p * r + EXP_POLY_2
    p = p * r + EXP_POLY_1
    p = p * r + EXP_POLY_0
    scale = ((n.to(tl.int32) + MASS_EXPONENT_BIAS) << 23).to(tl.float32, bitcast=True)
    return (p * scale).to(tl.int64)


@triton.jit
def no_nan(score):
    """NaN scores (a bad row, reported by its status) as -inf, so that argmax is defined."""
    return tl.where(score == score, score, -float("inf"))


@triton.jit
def order_key(z):
    """An int64 key ordered as the fp32 values ``z`` are (-0.0 and 0.0 equal)."""
    bits = z.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(z == 0.0, 0, key).to(tl.int64)


@triton.jit
def key_value(key):
    """The fp32 value of a ``order_key`` (its inverse; -inf for -2^31, below every finite value's key)."""
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.int32)
    return tl.where(key == -(2**31), -float("inf"), bits.to(tl.float32, bitcast=True))
