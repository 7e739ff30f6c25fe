"""The test set-up itself (conftest.py, helpers.py): gpu-marked tests fail without CUDA,
requires_verl skips only a missing verl, the backend switch, and the shared tiny model's guard.

The conftest checks run inner pytest sessions (``pytester``, in this process) with this
directory's conftest.py as their plugin. pytester drops the modules first imported during a
test from sys.modules afterwards; torch extensions registered by such a module then fail to
register again on re-import, so whatever the inner sessions use is imported here first."""

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import rlk_mm.fixtures  # noqa: F401  (imported before any inner session: see the docstring)
from rlk_mm.ops._backend import backend_name
from support import helpers
from support.helpers import GPU_NEEDED, VERL_MISSING, use_backend

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


@pytest.fixture
def conftest_plugin(request):
    """This directory's conftest.py, as the plugin pytest loaded."""
    (plugin,
     ) = [p for p in request.config.pluginmanager.get_plugins() if Path(getattr(p, "__file__", "") or "/") == CONFTEST]
    return plugin


@pytest.fixture
def inner(pytester, conftest_plugin):
    """Runs an inner pytest session over ``source`` with our conftest's hooks and fixtures."""
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")

    def run(source: str, *args: str):
        pytester.makepyfile(test_inner=textwrap.dedent(source))
        return pytester.runpytest("-p", "no:cacheprovider", "-rs", *args, plugins=[conftest_plugin])

    return run


GPU_TESTS = """
    import pytest

    @pytest.mark.gpu
    def test_on_the_gpu():
        assert 1 + 1 == 2

    def test_on_the_cpu():
        assert 2 + 2 == 4
"""


def test_gpu_marked_tests_fail_without_cuda(inner, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = inner(GPU_TESTS, "-m", "gpu")
    result.assert_outcomes(errors=1, deselected=1)
    result.stdout.fnmatch_lines([f"*{GPU_NEEDED}*"])
    assert result.ret != 0
    inner(GPU_TESTS, "-m", "not gpu").assert_outcomes(passed=1, deselected=1)  # CPU tests unaffected


def test_gpu_marked_tests_run_with_cuda(inner, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    inner(GPU_TESTS, "-m", "gpu").assert_outcomes(passed=1, deselected=1)


def test_no_test_skips_itself_for_want_of_cuda():
    """One place decides what a gpu test does without CUDA (the hook): no skipif of its own."""
    offenders = [p.name for p in CONFTEST.parent.rglob("test_*.py")
                 if p.name != Path(__file__).name and "skipif(not torch.cuda.is_available()" in p.read_text()]
    assert offenders == []


VERL_TESTS = """
    import importlib

    import pytest

    @pytest.fixture
    def verl_module(requires_verl):
        return importlib.import_module("verl")

    def test_with_verl(verl_module):
        assert verl_module is not None
"""

VERL_MODULE = """
    from support.helpers import skip_module_without_verl

    skip_module_without_verl()
    import verl

    def test_module_with_verl():
        assert verl is not None
"""


def test_requires_verl_skips_only_a_missing_verl(inner, pytester, conftest_plugin, monkeypatch):
    pytester.makepyfile(test_module=textwrap.dedent(VERL_MODULE))
    monkeypatch.setattr(conftest_plugin, "verl_installed", lambda: False)
    monkeypatch.setattr(helpers, "verl_installed", lambda: False)
    result = inner(VERL_TESTS)
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines([f"*{VERL_MISSING}*"])


def test_installed_verl_that_fails_to_import_errors(inner, pytester, monkeypatch):
    """A verl that is installed but broken: the fixture and the module guard error, never skip."""
    for name in [m for m in list(sys.modules) if m == "verl" or m.startswith("verl.")]:
        monkeypatch.delitem(sys.modules, name)
    broken = pytester.mkpydir("verl")
    (broken / "__init__.py").write_text("raise ImportError('this verl is broken')\n")
    monkeypatch.syspath_prepend(str(pytester.path))
    pytester.makepyfile(test_module=textwrap.dedent(VERL_MODULE))
    assert helpers.verl_installed()
    result = inner(VERL_TESTS, "--continue-on-collection-errors")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*this verl is broken*"])


def test_use_backend_forces_and_restores(monkeypatch):
    monkeypatch.delenv("RLK_MM_BACKEND", raising=False)
    with use_backend("triton"):
        assert backend_name() == "triton"
        with use_backend("torch"):
            assert backend_name() == "torch"
        assert os.environ["RLK_MM_BACKEND"] == "triton"
    assert "RLK_MM_BACKEND" not in os.environ
    with pytest.raises(KeyError), use_backend("torch"):
        raise KeyError("an error inside restores too")
    assert "RLK_MM_BACKEND" not in os.environ


def test_backend_fixture_runs_each_backend(backend):
    assert backend in helpers.BACKENDS and backend_name() == backend == os.environ["RLK_MM_BACKEND"]


def test_changing_the_shared_tiny_model_is_an_error(inner):
    result = inner("""
        def test_changes_its_own(own_tiny_model, tiny_model):
            assert own_tiny_model is not tiny_model and not tiny_model.training
            own_tiny_model.train()

        def test_changes_the_shared_one(tiny_model):
            tiny_model.train()
            tiny_model.lm_head.weight.data.add_(1.0)

        def test_after_it(tiny_model, own_tiny_model):  # put back as built
            assert not tiny_model.training
            assert all(a.equal(b) for a, b in zip(tiny_model.parameters(), own_tiny_model.parameters()))
    """)
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines([
        "*test_inner.py::test_changes_the_shared_one changed the shared tiny_model (training, *lm_head.weight*): use "
        "own_tiny_model there*",
    ])
