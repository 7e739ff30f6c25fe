"""Test set-up shared by the whole suite.

On a machine without CUDA, Triton kernels run under the interpreter: TRITON_INTERPRET
must be set before any kernel is defined, so it is set here, before rlk_mm is imported.
verl's package imports ray at import time; ray is a cluster runtime our tests never use,
so ``rlk_mm.integrations.ray_stand_in`` is installed when ray is absent.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rlk_mm.integrations import ray_stand_in  # noqa: E402  (after TRITON_INTERPRET is set)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
GEO3K = SHARED / "geo3k"


ray_stand_in.install()


@pytest.fixture(scope="session")
def geo3k_dir() -> Path:
    assert GEO3K.is_dir(), f"the shared Geo3K sample is missing at {GEO3K}"
    return GEO3K
