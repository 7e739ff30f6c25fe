"""Small helpers the tests and conftest.py share (conftest's fixtures wrap them).

- ``use_backend(name)``: the one way to force ``RLK_MM_BACKEND``; the ``backend`` fixture
  wraps it, and hypothesis tests (which take no function-scoped fixtures) call it directly.
- ``verl_installed()`` / ``skip_module_without_verl()``: skip only where verl is not
  installed; an installed verl that fails to import is an error, never a skip.
- ``GPU_NEEDED``: the message of a ``gpu``-marked test run where CUDA is absent.
- ``count_syncs(fn)``: the host-device syncs of a call (GPU tests of the one-sync rule).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings

import pytest
import torch

#: the backends ``RLK_MM_BACKEND`` can force
BACKENDS = ("torch", "triton")

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
