"""rlk_mm: multimodal RL operators with schema-first batch objects.

The public API: the batch schema (``RLBatch``, spans), the ops (``rlk_mm.ops``: selected
log-prob, losses, rewards, pack, ``batch_invariant``), the model runners
(``rlk_mm.models``) and the parity checks (``rlk_mm.parity``).

``import rlk_mm`` imports no torch: the names below are served on first use, so that the
``rlk-mm`` command answers ``--help`` and usage errors at once. The model families'
batch-invariant patches are still always known: the module that holds ``batch_invariant()``
(``rlk_mm.ops.invariant.mode``) is loaded with one more patch provider, called first on entering
the mode, which imports ``rlk_mm.models`` (whose family modules register theirs), whatever was
imported before.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from typing import TYPE_CHECKING

from . import deprecations  # noqa: F401 (installs the moved-module finder; standard library only)
from .lazy import lazy_exports

if TYPE_CHECKING:  # what the lazy names below are, for IDEs, type checkers and the API reference
    from . import models, ops  # noqa: F401
    from .schema import (  # noqa: F401
        BatchFileError,
        CoordinateSystem,
        Modality,
        PaddingSide,
        RLBatch,
        SchemaError,
        Span,
        SpanTable,
        UnsupportedModalityError,
        processor_fingerprint,
    )

__version__ = "0.1.0"

#: name -> the module that holds it (a subpackage: the name itself)
_EXPORTS = {
    **dict.fromkeys(("BatchFileError", "CoordinateSystem", "Modality", "PaddingSide", "RLBatch", "SchemaError",
                     "Span", "SpanTable", "UnsupportedModalityError", "processor_fingerprint"), "schema"),
    "models": None, "ops": None,
}
#: the subpackages served as attributes even when nothing imported them yet (``rlk_mm.parity.X`` after ``import rlk_mm``)
_SUBPACKAGES = ("fixtures", "grounding", "integrations", "models", "ops", "parity", "schema", "smoke")

__all__ = [
    "BatchFileError", "CoordinateSystem", "Modality", "PaddingSide", "RLBatch", "SchemaError", "Span", "SpanTable",
    "UnsupportedModalityError",
    "models", "ops", "processor_fingerprint", "__version__",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, submodules=_SUBPACKAGES, listed=sorted({*__all__, *_SUBPACKAGES}))


# ---------------------------------------------------------------------- the models' patches
_MODE = "rlk_mm.ops.invariant.mode"


def _models_patches() -> list:
    """A patch provider of ``batch_invariant()``, the first it calls: imports ``rlk_mm.models``,
    whose family modules register their own providers, which the mode then applies. No patch of its own."""
    importlib.import_module("rlk_mm.models")
    return []


class _RegistersModels:
    """The loader of ``_MODE``: runs the module, then registers ``_models_patches`` with it.
    Everything else is the wrapped loader's."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        module.register_module_patches(_models_patches)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


class _ModelsPatchesFinder:
    """Finds ``_MODE`` as the path finder does, with ``_RegistersModels`` as its loader."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _MODE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegistersModels(spec.loader)
        return spec


if not any(type(finder).__name__ == "_ModelsPatchesFinder" for finder in sys.meta_path):  # once, even on reload
    sys.meta_path.insert(0, _ModelsPatchesFinder())
