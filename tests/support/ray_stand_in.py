"""A stand-in for ``ray`` so verl's pure functions import where ray is not installed.

verl imports ray at import time (``verl.protocol``), yet rlk_mm's verl tests, benchmarks
and examples use only verl's stateless functions (losses, advantages, ``FusedLinearForPPO``).
Where ray is missing, ``install()`` puts a module in ``sys.modules`` that absorbs the
decorators and annotations verl applies at import; a real verl deployment has ray and
never uses this. Nothing of ray works through it.
"""

from __future__ import annotations

import sys
import types


class _Absorb:
    """Absorbs ``@ray.remote``-style decorators, attribute chains and subscripts."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Absorb()

    def __getattr__(self, name):
        return _Absorb()

    def __getitem__(self, key):
        return _Absorb()


def install() -> bool:
    """Install the stand-in unless ray is importable; True when it was installed."""
    try:
        import ray  # noqa: F401

        return False
    except ImportError:
        pass
    module = types.ModuleType("ray")

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absorb()

    module.__getattr__ = __getattr__
    module.__path__ = []
    sys.modules["ray"] = module
    return True
