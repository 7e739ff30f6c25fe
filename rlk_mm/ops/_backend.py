"""Backend choice for every op: Triton on CUDA tensors, torch elsewhere.

``RLK_MM_BACKEND=torch`` or ``=triton`` forces one. Forcing Triton on CPU tensors works
only under ``TRITON_INTERPRET=1`` (Triton's interpreter; slow, for tests).
"""

from __future__ import annotations

import os

import torch

from ..schema import Choice  # noqa: F401  (the base of Backend; tests/test_layout.py reads this edge)
from .options import Backend


def backend_name() -> Backend:
    """The backend ``RLK_MM_BACKEND`` asks for (``auto`` when unset)."""
    name = Backend.parse(os.environ.get("RLK_MM_BACKEND", "auto").strip().lower() or "auto", "RLK_MM_BACKEND")
    if name is Backend.FLASHINFER:
        raise ValueError("RLK_MM_BACKEND='flashinfer': expected one of auto, torch, triton (flashinfer: sample(backend=...))")
    return name


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the op should run its Triton kernel for these tensors."""
    name = backend_name()
    on_cuda = any(t is not None and t.is_cuda for t in tensors)
    if name is Backend.TORCH:
        return False
    if name is Backend.TRITON:
        if not on_cuda and not triton_interpreting():
            raise RuntimeError(
                "RLK_MM_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 "
                "(set it before rlk_mm is imported), or move the tensors to CUDA"
            )
        return True
    return on_cuda
