"""Deprecated: ``rlk_mm.smoke.task`` is now ``rlk_mm.smoke.tasks.base`` (the smoke tasks are one package,
``rlk_mm.smoke.tasks``: the base, then one module per task). Its names (Task, numbered_draw, draw_shape, ...)
are served here with a ``DeprecationWarning`` for one release."""

from __future__ import annotations

import importlib
import warnings

__all__: list[str] = []


def __getattr__(name: str):
    module = importlib.import_module("rlk_mm.smoke.tasks.base")
    if name in module.__all__:
        warnings.warn(f"rlk_mm.smoke.task is deprecated and will be removed in the next release: import {name} from "
                      "rlk_mm.smoke.tasks.base", DeprecationWarning, stacklevel=2)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
