"""Deprecated home of the packing ops, split by what they pack (served here for one release).

Padded ``[B, L, *]`` tensors ↔ packed rows: ``rlk_mm.ops.padded`` (``pack_padded``,
``unpack_to_padded``); ``RLBatch`` ↔ ``PackedBatch``: ``rlk_mm.ops.packed_batch`` (``pack``,
``unpack``, ``PackedBatch``). All of them are also ``rlk_mm.ops.<name>``. A name taken from
this module still works, with a ``DeprecationWarning`` naming its new home.
"""

from __future__ import annotations

import importlib
import warnings

#: the names this module served, and the module of ``rlk_mm.ops`` that holds each now
MOVED = {
    "pack_padded": "padded", "unpack_to_padded": "padded", "pack": "packed_batch", "unpack": "packed_batch",
    "PackedBatch": "packed_batch", "PaddingSide": "options",
}

__all__: list[str] = []


def __getattr__(name: str):
    home = MOVED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"rlk_mm.ops.packing.{name} moved to rlk_mm.ops.{home}.{name} (also rlk_mm.ops.{name}); "
                  "import it from there", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(f"rlk_mm.ops.{home}"), name)
