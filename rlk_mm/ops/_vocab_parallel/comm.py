"""What a vocabulary-parallel call sends: the bytes per scored token, computed and profiled.

``comm_bytes_per_token`` is the package docstring's formula (forward: the all-gather of every
shard's partials; backward: the ordered d hidden sum), ``partial_columns`` the columns per
partial of the backend that runs, and ``profiled_sent_bytes`` counts what the c10d ops of a
``torch.profiler`` trace actually sent, so that ``bench/bench_tp.py`` and the tests check the
formula against what ran.
"""

from __future__ import annotations

import math
from typing import Optional

from torch import Tensor

from .._backend import use_triton
from .._head_inputs import VOCAB_ALIGN

__all__ = ["comm_bytes_per_token", "partial_columns", "profiled_sent_bytes"]


def comm_bytes_per_token(group_size: int, hidden_size: int, with_entropy: bool, vocab_size: int, *,
                         largest_shard: Optional[int] = None, partial_columns: int = VOCAB_ALIGN) -> dict[str, int]:
    """Bytes each rank sends per scored token: ``forward`` (the all-gather of every shard's
    partials: ``(P-1)·4·(k·⌈L/G⌉ + 1)``, k = 3 with entropy else 2, ``L = largest_shard``,
    by default Megatron's even split ``⌈V / (128·P)⌉·128``, ``G = partial_columns``) and
    ``backward`` (the ordered d hidden sum: all-to-all + all-gather of fp32 column blocks)."""
    P = group_size
    if largest_shard is None:
        largest_shard = math.ceil(vocab_size / (VOCAB_ALIGN * P)) * VOCAB_ALIGN
    k = 3 if with_entropy else 2
    return {"forward": (P - 1) * 4 * (k * math.ceil(largest_shard / partial_columns) + 1),
            "backward": 2 * (P - 1) * 4 * math.ceil(hidden_size / P)}


def partial_columns(weight: Tensor) -> int:
    """Columns per partial of the backend that runs on ``weight``: ``comm_bytes_per_token``'s ``partial_columns``."""
    if use_triton(weight):
        from .._triton import lm_head

        return lm_head.partial_columns(lm_head.default_config(weight.dtype, weight.device))
    return VOCAB_ALIGN


_SENDS = {"c10d::_allgather_base_": "all_gather", "c10d::alltoall_base_": "all_to_all"}
_DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "double": 8}


def profiled_sent_bytes(events, group_size: int) -> dict[str, int]:
    """Bytes this rank sent, per collective kind, in ``torch.profiler`` events recorded with
    ``record_shapes=True`` (the c10d ops, whatever the backend): a ring all-gather sends
    ``P - 1`` times its input, an all-to-all ``(P - 1) / P`` of it. Checks the docstring's
    ``comm_bytes_per_token`` against what actually ran. A torch whose events carry no
    ``input_dtypes`` is counted as fp32 (the dtype of every per-token collective here)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    sent = {kind: 0 for kind in _SENDS.values()}
    for ev in events:
        kind = _SENDS.get(ev.name)
        if kind is None:
            continue
        shape, dtype = ev.input_shapes[1], (getattr(ev, "input_dtypes", None) or [None, "float"])[1]
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"profiled {ev.name} has input dtype {dtype!r}, not one of {sorted(_DTYPE_BYTES)}")
        nbytes = math.prod(shape) * _DTYPE_BYTES[dtype]
        sent[kind] += nbytes * (group_size - 1) if kind == "all_gather" else nbytes * (group_size - 1) // group_size
    return sent
