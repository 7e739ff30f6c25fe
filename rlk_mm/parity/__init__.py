"""Parity checks: layout parity, log-prob comparison, the numerical contract, invariance sweeps."""

from .contract import CONTRACT, ELEMENTWISE_LOSS_MAX_ABS, LOGPROB_GRAD_REL, LOGPROB_MAX_ABS, Tolerance
from .layout import LayoutParityError, LayoutParityReport, Mismatch, check_layout_parity
from .logprobs import LogprobComparison, compare_logprobs


def __getattr__(name: str):
    # the invariance harness pulls in models and kernels: import it on first use
    if name == "invariance_sweep":
        from .invariance import invariance_sweep

        return invariance_sweep
    if name == "codec_invariance":
        from .codec import codec_invariance

        return codec_invariance
    raise AttributeError(f"module 'rlk_mm.parity' has no attribute {name!r}")


__all__ = [
    "CONTRACT", "ELEMENTWISE_LOSS_MAX_ABS", "LOGPROB_GRAD_REL", "LOGPROB_MAX_ABS", "LayoutParityError",
    "LayoutParityReport", "LogprobComparison", "Mismatch", "Tolerance", "check_layout_parity",
    "codec_invariance", "compare_logprobs", "invariance_sweep",  # noqa: F822 (the last two: served by __getattr__)
]
