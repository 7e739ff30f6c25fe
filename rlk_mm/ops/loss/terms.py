"""Named constants of the fused policy loss, shared by the op, the Triton kernel and the
torch backend: KL estimator codes, the rows of the per-block partial sums, the block
size, and the clamps and epsilon of verl's and EasyR1's formulas."""

from __future__ import annotations

from enum import IntEnum

__all__: list[str] = []


class KLEstimator(IntEnum):
    """The KL estimator a kernel computes (several user-facing names share one)."""

    NONE = 0
    K1 = 1  # x = logp - ref
    ABS = 2  # |x|
    K2 = 3  # x² / 2
    K3 = 4  # exp(k) - k - 1, k = clamp(-x): verl's low_var_kl


class Partial(IntEnum):
    """Rows of the fused loss's per-block partial sums ``[len(Partial), num_blocks]``."""

    PG_LOSS = 0
    KL_LOSS = 1
    ENTROPY_LOSS = 2
    PG_CLIPFRAC = 3
    PG_CLIPFRAC_LOWER = 4
    PPO_KL = 5
    MASK_SUM = 6


#: tokens per block of partial sums, both backends (the Triton kernel's program size):
#: the blocks are summed in a fixed order, so results are deterministic
TOKENS_PER_BLOCK = 1024
#: k3: the exponent ``-x`` is clamped to ±this before ``exp`` (verl)
K3_EXPONENT_LIMIT = 20.0
#: k3: the estimate is clamped to ±this (verl)
K3_VALUE_LIMIT = 10.0
#: the PPO log-ratio is clamped to ±this before ``exp`` by default (verl, EasyR1)
LOG_RATIO_LIMIT = 20.0
#: masked means divide by ``count + MEAN_EPS`` (verl's and EasyR1's masked_mean)
MEAN_EPS = 1e-8


def num_blocks(n: int) -> int:
    return -(-n // TOKENS_PER_BLOCK)
