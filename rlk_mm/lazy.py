"""Names a package serves on first use, so that importing it stays light (no torch for
``import rlk_mm`` or ``rlk-mm --help``): ``lazy_exports`` builds the package's ``__getattr__``
and ``__dir__`` from a table of name -> the submodule that holds it. Imports nothing of rlk_mm.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Mapping, Optional

__all__: list[str] = []


def lazy_exports(package: str, exports: Mapping[str, Optional[str]], *, submodules: tuple[str, ...] = (),
                 missing: Optional[Callable[[str, str], object]] = None, listed: Optional[list[str]] = None):
    """``(__getattr__, __dir__)`` for ``package``. ``exports``: name -> its submodule (dotted,
    relative to the package), or None for a name that is a submodule itself; ``submodules``:
    more submodules served as attributes; ``missing(package, name)`` answers any other name
    (default: ``AttributeError``); ``listed``: what ``dir()`` shows (default: the loaded names,
    the exports and the submodules). A name is imported once, then cached in the package."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str):
        if name in submodules or (name in exports and exports[name] is None):
            return importlib.import_module(f"{package}.{name}")
        if name not in exports:
            if missing is not None:
                return missing(package, name)
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        namespace[name] = value
        return value

    def __dir__():
        return list(listed) if listed is not None else sorted({*namespace, *exports, *submodules})

    return __getattr__, __dir__
