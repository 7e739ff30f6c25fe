"""Test set-up shared by the whole suite.

On a machine without CUDA, Triton kernels run under the interpreter: TRITON_INTERPRET
must be set before any kernel is defined, so it is set here, before rlk_mm is imported.
The interpreter runs ``tl.dot`` as ``numpy.matmul``, i.e. the CPU's BLAS, whose result for
one row can depend on where the row sits in the tile (OpenBLAS's sgemm on AMD EPYC: rows
6-11 of every 12 are summed in another order). A GPU's tensor cores compute every row of
a tile alike, and the batch-invariance tests check our tile schedules, not the host BLAS,
so ``_row_independent_dot`` replaces the interpreter's dot with ``numpy.einsum`` (no BLAS):
each product summed over K in one order that depends on K alone, the same for every row.

verl's package imports ray at import time; ray is a cluster runtime our tests never use,
so ``ray_stand_in`` (tests only) is installed when ray is absent.
"""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _install_row_independent_dot() -> None:
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    blas_dot = builder.create_dot

    def _row_independent_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.einsum("...mk,...kn->...mn", a.data, b.data, dtype=d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = _row_independent_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _install_row_independent_dot()

import ray_stand_in  # noqa: E402  (after TRITON_INTERPRET is set)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
GEO3K = SHARED / "geo3k"


ray_stand_in.install()


@pytest.fixture(scope="session")
def geo3k_dir() -> Path:
    assert GEO3K.is_dir(), f"the shared Geo3K sample is missing at {GEO3K}"
    return GEO3K
