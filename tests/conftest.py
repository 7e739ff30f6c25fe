"""Test set-up shared by the whole suite.

On a machine without CUDA, Triton kernels run under the interpreter: TRITON_INTERPRET
must be set before any kernel is defined, so it is set here, before rlk_mm is imported.
verl's package imports ray at import time; ray is a multi-GB cluster runtime that our
tests never use, so a stand-in module is installed when ray is absent.
"""

import os
import sys
import types
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
GEO3K = SHARED / "geo3k"


class _RayStandIn:
    """Absorbs the decorators and type annotations verl applies at import time."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _RayStandIn()

    def __getattr__(self, name):
        return _RayStandIn()

    def __getitem__(self, key):
        return _RayStandIn()


def _install_ray_stand_in():
    try:
        import ray  # noqa: F401
    except ImportError:
        module = types.ModuleType("ray")

        def __getattr__(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _RayStandIn()

        module.__getattr__ = __getattr__
        module.__path__ = []
        sys.modules["ray"] = module


_install_ray_stand_in()


@pytest.fixture(scope="session")
def geo3k_dir() -> Path:
    assert GEO3K.is_dir(), f"the shared Geo3K sample is missing at {GEO3K}"
    return GEO3K
