"""The numerical contract (README, "Numerical contract"), in one place: tests and parity checks read it here.

Compare against a reference computed in fp32 (or fp64) from the *same* low-precision
inputs upcast, with TF32 off. Batch, layout and cache invariance are bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CONTRACT", "ELEMENTWISE_LOSS_MAX_ABS", "LOGPROB_GRAD_REL", "LOGPROB_MAX_ABS", "Tolerance"]


@dataclass(frozen=True)
class Tolerance:
    """Bounds for one check: fp32 inputs, and bf16/fp16 inputs with fp32 accumulation."""

    fp32: float
    low_precision: float

    def for_dtype(self, dtype: torch.dtype) -> float:
        """The bound for inputs of ``dtype``: fp32/fp64 get ``fp32``, bf16/fp16 ``low_precision``."""
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a torch floating dtype (the inputs' dtype, e.g. torch.bfloat16), got {dtype!r}")
        return self.fp32 if dtype in (torch.float32, torch.float64) else self.low_precision


#: selected log-prob, max abs difference
LOGPROB_MAX_ABS = Tolerance(fp32=1e-5, low_precision=2e-3)
#: log-prob gradients, relative norm ||delta|| / ||ref||
LOGPROB_GRAD_REL = Tolerance(fp32=1e-5, low_precision=1e-2)
#: elementwise losses (ratio, KL, clip), max abs
ELEMENTWISE_LOSS_MAX_ABS = Tolerance(fp32=1e-6, low_precision=1e-3)
#: batch / layout / cache invariance: bitwise, compare with torch.equal
INVARIANCE = "bitwise"

CONTRACT = {
    "selected_logprob_max_abs": LOGPROB_MAX_ABS,
    "logprob_grad_rel": LOGPROB_GRAD_REL,
    "elementwise_loss_max_abs": ELEMENTWISE_LOSS_MAX_ABS,
    "invariance": INVARIANCE,
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in fp64 (0 when both are zero)."""
    a, e = actual.detach().double(), expected.detach().double()
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff if denom == 0 else diff / denom
