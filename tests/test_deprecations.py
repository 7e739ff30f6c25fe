"""rlk_mm.deprecations, the one table of deprecated names: every entry does what the table says.

A moved module fails at import naming its home; a moved name is served from its home with a
warning; a renamed keyword is accepted with a warning, is not in the signature, and refuses
being given together with its new name; a renamed value is mapped with a warning. The ops'
own tests check that each renamed keyword gives bitwise the result of the new one.
"""

import importlib
import inspect
import warnings

import pytest

from rlk_mm import deprecations
from rlk_mm.deprecations import MOVED_MODULES, MOVED_NAMES, RENAMED_KEYWORDS, RENAMED_VALUES


def _function(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_moved_module_names_its_home(old):
    with pytest.raises(ModuleNotFoundError, match=rf"{old} moved to {MOVED_MODULES[old]}: import it from there"):
        importlib.import_module(old)
    importlib.import_module(MOVED_MODULES[old])


@pytest.mark.parametrize("path", sorted(MOVED_NAMES))
def test_a_moved_name_is_its_home_s_object_with_a_warning(path):
    package, name = path.rsplit(".", 1)
    home = importlib.import_module(MOVED_NAMES[path])
    with pytest.warns(DeprecationWarning, match=rf"{package}\.{name} moved to {MOVED_NAMES[path]}\.{name}"):
        served = getattr(importlib.import_module(package), name)
    assert served is getattr(home, name)
    assert name not in importlib.import_module(package).__all__


@pytest.mark.parametrize("path,old,new", [(p, o, n) for p, renames in sorted(RENAMED_KEYWORDS.items())
                                          for o, n in renames.items()])
def test_a_renamed_keyword_is_out_of_the_signature_and_never_with_its_new_name(path, old, new):
    fn = _function(path)
    parameters = inspect.signature(fn).parameters
    assert new in parameters and old not in parameters
    with pytest.raises(TypeError, match=rf"{old} is the old name of {new}; pass {new} only"):
        fn(**{old: None, new: None})


def test_every_renamed_value_belongs_to_a_renamed_keyword():
    assert set(RENAMED_VALUES) <= {new for renames in RENAMED_KEYWORDS.values() for new in renames.values()}


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'rlk_mm.ops' has no attribute 'batch_logprob'"):
        importlib.import_module("rlk_mm.ops").batch_logprob
    with pytest.raises(AttributeError):
        deprecations.moved_name("rlk_mm.models", "Layout")


def test_a_module_that_never_existed_is_the_usual_error():
    with pytest.raises(ModuleNotFoundError, match="No module named 'rlk_mm.ops.nothing_here'"):
        importlib.import_module("rlk_mm.ops.nothing_here")


def test_the_finder_is_installed_once():
    import sys

    importlib.reload(deprecations)
    assert sum(type(f).__name__ == "_MovedModuleFinder" for f in sys.meta_path) == 1


def test_the_new_names_never_warn():
    import torch

    from rlk_mm import ops

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.kl_penalty(torch.zeros(2), torch.zeros(2), kl_type="k2")
        ops.unpack_to_padded(torch.zeros(3), torch.tensor([0, 1, 3], dtype=torch.int32), 2, padding="left")
