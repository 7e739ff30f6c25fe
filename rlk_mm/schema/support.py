"""Deprecated: ``rlk_mm.schema.support`` is now part of ``rlk_mm.schema.unsupported`` (unsupported
modalities: the check, the error and the fallback, in one module). Its names are served here
with a ``DeprecationWarning`` for one release."""

from __future__ import annotations

import warnings

from . import unsupported

__all__: list[str] = []


def __getattr__(name: str):
    if name in unsupported.__all__:
        warnings.warn(f"rlk_mm.schema.support is deprecated and will be removed in the next release: import {name} from "
                      "rlk_mm.schema.unsupported (or rlk_mm.schema)", DeprecationWarning, stacklevel=2)
        return getattr(unsupported, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
