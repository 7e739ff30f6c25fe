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

Shared fixtures: ``processor`` (the real Qwen-VL processor) and ``tiny_model`` (the tiny
Qwen2.5-VL, seed 0, eval mode; read it, never change it: ``own_tiny_model`` is a module's own
for tests that do), ``backend`` (each test once per forced ``RLK_MM_BACKEND``; it wraps
``helpers.use_backend``, which hypothesis tests call directly), ``requires_verl`` (skips
only where verl is not installed), ``one_thread`` and ``input_context`` (the shared inputs of
the input tables in ``context_cases``). A test marked ``gpu`` fails at setup
with a clear message where CUDA is absent (``pytest_runtest_setup``): never a silent skip.
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

from support import ray_stand_in  # noqa: E402  (after TRITON_INTERPRET is set)
from support.helpers import BACKENDS, GPU_NEEDED, VERL_MISSING, use_backend, verl_installed  # noqa: E402

pytest_plugins = ["pytester"]

ray_stand_in.install()


@pytest.fixture(scope="session")
def geo3k_dir() -> Path:
    """The 3-problem Geo3K sample inside the package (rlk_mm/fixtures/geo3k_sample)."""
    from rlk_mm.fixtures import GEO3K_SAMPLE_DIR

    assert (GEO3K_SAMPLE_DIR / "problems.jsonl").is_file(), f"the Geo3K sample is missing at {GEO3K_SAMPLE_DIR}"
    return GEO3K_SAMPLE_DIR


@pytest.fixture(scope="session")
def processor():
    """The real Qwen2.5-VL processor (offline tokenizer, PIL image processor)."""
    from rlk_mm.fixtures import qwen_vl_processor

    return qwen_vl_processor()


def _model_state(model) -> dict:
    """What a test could change on a model: mode, devices, dtypes, grad flags, grads, hooks."""
    return {
        "training": model.training,
        "tensors": {k: (v.device, v.dtype) for k, v in model.state_dict().items()},
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grads": [n for n, p in model.named_parameters() if p.grad is not None],
        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
                     for m in model.modules()),
    }


#: the shared tiny model as built: its state and weights, for the check after each test that uses it
_TINY: dict = {}


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny random-weight Qwen2.5-VL (seed 0), eval mode, shared by the whole session.

    Read it only: a test that trains it, fills its ``.grad``, hooks it or moves it takes
    ``own_tiny_model``. After each test that uses it, ``pytest_runtest_teardown`` checks
    that its state and weights are as built."""
    from rlk_mm.fixtures import tiny_qwen2_5_vl

    model = tiny_qwen2_5_vl(seed=0).eval()
    _TINY.update(model=model, state=_model_state(model), weights={k: v.clone() for k, v in model.state_dict().items()})
    yield model
    _TINY.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    """A test that changed the shared tiny model errors at teardown, naming what changed; the
    weights, mode and gradients are put back so that the tests after it are not affected."""
    changed = []
    if _TINY and "tiny_model" in getattr(item, "fixturenames", ()):
        model, state, weights = _TINY["model"], _TINY["state"], _TINY["weights"]
        now = _model_state(model)
        changed = [k for k in state if now[k] != state[k]]
        if now["tensors"] == state["tensors"]:
            changed += [k for k, v in model.state_dict().items() if not torch.equal(v, weights[k])]
        if changed:
            model.load_state_dict(weights)
            model.eval().zero_grad(set_to_none=True)
    result = yield  # the fixtures' own teardown
    if changed:
        pytest.fail(f"{item.nodeid} changed the shared tiny_model ({', '.join(changed)}): use own_tiny_model there",
                    pytrace=False)
    return result


@pytest.fixture(scope="module")
def own_tiny_model():
    """A tiny Qwen2.5-VL (seed 0, eval mode) of the test module's own, for tests that change it."""
    from rlk_mm.fixtures import tiny_qwen2_5_vl

    return tiny_qwen2_5_vl(seed=0).eval()


@pytest.fixture(scope="module")
def input_context(processor, tiny_model, own_tiny_model, tmp_path_factory):
    """The real inputs of the input tables that take a context (``context_cases.make_context``)."""
    from support.context_cases import make_context

    return make_context(processor, tiny_model, own_tiny_model, tmp_path_factory.mktemp("inputs"))


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Runs the test once per backend, with ``RLK_MM_BACKEND`` forced to it; yields the name."""
    with use_backend(request.param):
        yield request.param


@pytest.fixture
def requires_verl():
    """Skips the test where verl is not installed. An installed verl that fails to import is
    not skipped: the test's own import of it errors."""
    if not verl_installed():
        pytest.skip(VERL_MISSING)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module (many small fixed-shape matmuls: one thread is fastest)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def pytest_runtest_setup(item):
    """A test marked ``gpu`` fails (at setup, before its fixtures) where CUDA is absent."""
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.fail(f"{GPU_NEEDED} (torch.cuda.is_available() is False here)", pytrace=False)
