"""Deprecated: ``rlk_mm.schema.grounding`` is now ``rlk_mm.schema.coordinates`` (the
``rlk_mm.grounding`` package is the one about grounding: parsing and rewards). Its names are
served here with a ``DeprecationWarning`` for one release."""

from __future__ import annotations

import warnings

from . import coordinates

__all__: list[str] = []


def __getattr__(name: str):
    if name in coordinates.__all__:
        warnings.warn(f"rlk_mm.schema.grounding is deprecated and will be removed in the next release: import {name} from "
                      "rlk_mm.schema.coordinates (or rlk_mm.schema)", DeprecationWarning, stacklevel=2)
        return getattr(coordinates, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
