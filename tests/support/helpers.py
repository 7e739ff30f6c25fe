"""Small helpers the tests and conftest.py share (conftest's fixtures wrap them).

- ``use_backend(name)``: the one way to force ``RLK_MM_BACKEND``; the ``backend`` fixture
  wraps it, and hypothesis tests (which take no function-scoped fixtures) call it directly.
- ``verl_installed()`` / ``skip_module_without_verl()``: skip only where verl is not
  installed; an installed verl that fails to import is an error, never a skip.
- ``GPU_NEEDED``: the message of a ``gpu``-marked test run where CUDA is absent.
- ``count_syncs(fn)``: the host-device syncs of a call (GPU tests of the one-sync rule).
- ``close(actual, expected)``: equal within the loss contract's fp32 elementwise tolerance.
- ``raised_by_rlk_mm(error)``: whether a check of rlk_mm raised an error (the input tables
  sort an error that no check raised as a crash).
- ``scaled_pair`` / ``same_bits`` / ``GRAD_SCALES``: the fused loss's in-place gradient scale
  against torch's ``mul_`` (CPU and GPU tests).
"""

from __future__ import annotations

import contextlib
import importlib.util
import linecache
import math
import os
import warnings
from pathlib import Path

import pytest
import torch

import rlk_mm
from rlk_mm.ops._triton import linear_loss as _triton_linear_loss
from rlk_mm.parity.contract import ELEMENTWISE_LOSS_MAX_ABS
from rlk_mm.schema import SchemaError

__all__ = [
    "BACKENDS", "GPU_NEEDED", "PACKAGE_DIR", "VERL_MISSING", "close", "count_syncs", "raised_by_rlk_mm",
    "skip_module_without_verl", "use_backend", "verl_installed",
]

#: the backends ``RLK_MM_BACKEND`` can force
BACKENDS = ("torch", "triton")

#: the package's source folder: an error raised by a ``raise`` there is rlk_mm's own
PACKAGE_DIR = Path(rlk_mm.__file__).resolve().parent
GPU_NEEDED = "needs a CUDA GPU: run `pytest -m gpu` on the GPU machine"
VERL_MISSING = "verl is not installed (`make setup` installs verl==0.9.1 with --no-deps)"


@contextlib.contextmanager
def use_backend(name: str):
    """Force ``RLK_MM_BACKEND=name`` inside the block; the previous value (or none) after."""
    old = os.environ.get("RLK_MM_BACKEND")
    os.environ["RLK_MM_BACKEND"] = name
    try:
        yield name
    finally:
        if old is None:
            del os.environ["RLK_MM_BACKEND"]
        else:
            os.environ["RLK_MM_BACKEND"] = old


def verl_installed() -> bool:
    """Whether a package named verl is installed (found without importing it)."""
    return importlib.util.find_spec("verl") is not None


def skip_module_without_verl() -> None:
    """At the top of a test module that needs verl throughout, before importing it."""
    if not verl_installed():
        pytest.skip(VERL_MISSING, allow_module_level=True)


def count_syncs(fn) -> int:
    """Host-device syncs during ``fn()``, called on this thread (torch's sync debug mode warns at each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def close(actual, expected, tol: float = ELEMENTWISE_LOSS_MAX_ABS.fp32) -> None:
    """``actual`` equals ``expected`` within ``tol`` (absolute and relative)."""
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def raised_by_rlk_mm(error: BaseException) -> bool:
    """Whether rlk_mm raised ``error`` itself (a ``SchemaError``, or a ``raise`` statement of the
    package), rather than torch, Python or another library failing under it."""
    if isinstance(error, SchemaError):
        return True
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    filename = tb.tb_frame.f_code.co_filename
    under = Path(filename).resolve().is_relative_to(PACKAGE_DIR)
    return under and linecache.getline(filename, tb.tb_lineno).strip().startswith("raise")


#: incoming gradients the fused loss's backward scales by (``scaled_pair``)
GRAD_SCALES = [1.0, -2.5, 0.3, 0.0, -0.0, math.inf, math.nan, 1e-30]


def scaled_pair(dtype, scale, device="cpu"):
    """(``scale_``'s result, torch's ``mul_``) on more entries than one program takes, special
    values among them; asserts the scale happened in place."""
    g = torch.Generator(device=device).manual_seed(1)
    n = 3 * _triton_linear_loss.default_config(dtype, torch.device(device)).scale_block + 5  # three programs and more
    x = (torch.randn(n, generator=g, device=device) * 100).to(dtype)
    x[:6] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40]).to(dtype)
    s = torch.tensor(scale, device=device).to(dtype)
    expected = x.clone().mul_(s)
    out = _triton_linear_loss.scale_(x, s)
    assert out.data_ptr() == x.data_ptr()
    return out, expected


def same_bits(a, b) -> bool:
    """Equal bit for bit, NaN payloads aside (NaN where the other is NaN)."""
    nan = torch.isnan(a)
    ints = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(ints), b[~nan].view(ints))
