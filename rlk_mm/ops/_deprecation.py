"""Renamed keyword arguments: the old name keeps working for one release, with a warning."""

from __future__ import annotations

import functools
import warnings

__all__ = ["renamed_keywords"]


def renamed_keywords(**renames: str):
    """Decorator: each keyword ``old=...`` passed to the function is passed as ``renames[old]``
    instead, with a ``DeprecationWarning`` naming the new name; both at once is a ``TypeError``.
    The signature shown (``help``, ``inspect.signature``) is the function's own, new names only."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}() got {old}= and {new}=: {old} is the old name of {new}; "
                                        f"pass {new} only")
                    warnings.warn(f"{fn.__name__}({old}=...) is deprecated: use {new}= (the old name goes in the "
                                  "next release)", DeprecationWarning, stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call

    return wrap
