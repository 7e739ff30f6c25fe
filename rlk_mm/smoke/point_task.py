"""Deprecated: ``rlk_mm.smoke.point_task`` is now ``rlk_mm.smoke.tasks.point`` (the smoke tasks are one package,
``rlk_mm.smoke.tasks``: the base, then one module per task). Its names (point_task, point_reward, POINT_TASKS, ...)
are served here with a ``DeprecationWarning`` for one release."""

from __future__ import annotations

import importlib
import warnings

__all__: list[str] = []


def __getattr__(name: str):
    module = importlib.import_module("rlk_mm.smoke.tasks.point")
    if name in module.__all__:
        warnings.warn(f"rlk_mm.smoke.point_task is deprecated and will be removed in the next release: import {name} from "
                      "rlk_mm.smoke.tasks.point", DeprecationWarning, stacklevel=2)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
