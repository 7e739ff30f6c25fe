"""The argument checks of a vocabulary-parallel call, agreed on every rank by one all-gather.

Each rank runs its own argument checks, then every rank gathers a few int64 per rank
(``FIELDS``: shard sizes, dtypes, row counts, value ranges, fingerprints of rows and
targets, and with ``RLK_MM_TP_DEBUG=1`` of the hidden rows) and checks the table alike: a
bad setup raises on *every* rank, naming the rank, instead of leaving the others waiting in
a collective. The table also gives each rank its ``VocabShard``.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ...schema.checks import KERNEL_FLOAT_DTYPES, first_true
from .._backend import use_triton
from .._head_inputs import TargetError, check_ranges
from .shard import VocabShard, all_gather, check_aligned

__all__ = ["agree", "debug_checks", "FIELDS", "float_bits"]

#: the per-rank fields ``agree`` gathers, in order
FIELDS = ("error", "vocab", "start", "hidden_size", "dtype", "rows", "T", "bias", "temperature", "fingerprint",
          "hidden_fingerprint", "needs_grad", "row_lo", "row_hi", "tgt_lo", "tgt_hi", "bias_bad", "bias_live")


def debug_checks() -> bool:
    """``RLK_MM_TP_DEBUG=1``: also check that every rank holds the same scored hidden rows."""
    return os.environ.get("RLK_MM_TP_DEBUG", "0") == "1"


def float_bits(value: float) -> int:
    """A float's float64 bits as an int64: compared exactly across ranks."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _fingerprint(t: Tensor) -> Tensor:
    """An int64 hash of ``t``'s bits and order (exact integer sums: the same on every device)."""
    flat = t.contiguous().flatten()
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    x = flat.view(ints).to(torch.int64)
    return (x * (torch.arange(x.numel(), device=x.device) % 1_000_003 + 1)).sum()


def agree(hidden: Tensor, weight: Tensor, rows: Tensor, targets: Optional[Tensor], bias: Optional[Tensor],
          temperature: float, group, vocab_start_index, needs_grad: bool, local_check,
          extra: Optional[Tensor] = None) -> tuple[VocabShard, bool]:
    """Check the call on every rank (one all-gather); the shard and whether the rows are
    every row of hidden in order. ``local_check()`` runs this rank's own argument checks;
    whatever fails on one rank raises on all of them. ``targets`` None: none are scored (the
    sampler); ``extra``: an int64 fingerprint of other inputs every rank must share."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    error: Optional[BaseException] = None
    try:
        local_check()
        if vocab_start_index is not None and (isinstance(vocab_start_index, bool)
                                              or not isinstance(vocab_start_index, int) or vocab_start_index < 0):
            raise TypeError(f"vocab_start_index must be an int >= 0, got {vocab_start_index!r}")
    except Exception as e:  # raised below, after the all-gather: the other ranks must not wait for this one
        error = e
    meta = torch.zeros(len(FIELDS), dtype=torch.int64, device=hidden.device)
    if error is None:
        meta = _local_meta(hidden, weight, rows, targets, bias, temperature, vocab_start_index, needs_grad, extra)
    elif vocab_start_index is not None and isinstance(vocab_start_index, int):
        meta[FIELDS.index("start")] = vocab_start_index
    meta[0] = int(error is not None)
    gathered = torch.empty(world * len(FIELDS), dtype=torch.int64, device=hidden.device)
    all_gather(gathered, meta, group=group)
    table = [dict(zip(FIELDS, r)) for r in gathered.view(world, -1).tolist()]
    if error is not None:
        raise error
    failed = [r for r, m in enumerate(table) if m["error"]]
    if failed:
        raise ValueError(f"tp rank {failed[0]} refused its inputs (its error says why); rank {rank} stops with it")
    return _check_table(table, rank, world, group, vocab_start_index, hidden, rows, targets, bias)


def _local_meta(hidden, weight, rows, targets, bias, temperature, vocab_start_index, needs_grad, extra) -> Tensor:
    n, V = rows.numel(), weight.shape[0]
    values = {
        "vocab": V, "start": -1 if vocab_start_index is None else vocab_start_index, "hidden_size": hidden.shape[1],
        "dtype": KERNEL_FLOAT_DTYPES.index(hidden.dtype), "rows": n, "T": hidden.shape[0],
        "bias": int(bias is not None),
        "temperature": float_bits(temperature), "needs_grad": int(needs_grad),
    }
    fingerprint = _fingerprint(rows) * 31
    for t in (targets, extra):
        if t is not None:
            fingerprint = fingerprint * 31 + _fingerprint(t)
    stats = {"fingerprint": fingerprint}
    if debug_checks():
        stats["hidden_fingerprint"] = _fingerprint(hidden.index_select(0, rows))
    if n:
        stats["row_lo"], stats["row_hi"] = torch.aminmax(rows)
        if targets is not None:
            stats["tgt_lo"], stats["tgt_hi"] = torch.aminmax(targets)
    if bias is not None and V:
        stats["bias_bad"] = (torch.isnan(bias) | (bias == math.inf)).any()
        stats["bias_live"] = (bias > -math.inf).any()
    meta = torch.zeros(len(FIELDS), dtype=torch.int64, device=hidden.device)
    for k, v in values.items():
        meta[FIELDS.index(k)] = v
    for k, v in stats.items():
        meta[FIELDS.index(k)] = v.to(torch.int64)
    return meta


def _check_table(table, rank, world, group, vocab_start_index, hidden, rows, targets, bias) -> tuple[VocabShard, bool]:
    """Cross-rank consistency, then the value checks of the whole vocabulary, identical on every rank."""
    mine = table[rank]
    for key, what in (("dtype", "dtype"), ("hidden_size", "hidden size H"), ("rows", "number of scored rows"),
                      ("T", "number of hidden rows T"), ("bias", "bias presence"), ("temperature", "temperature"),
                      ("needs_grad", "need for gradients (requires_grad of hidden/weight/bias)"),
                      ("fingerprint", "scored rows and targets (sampling: seeds, steps, filters)"),
                      ("hidden_fingerprint", "scored hidden rows")):
        other = next((r for r, m in enumerate(table) if m[key] != table[0][key]), None)
        if other is not None:
            show = (lambda v: KERNEL_FLOAT_DTYPES[v]) if key == "dtype" else (lambda v: v)
            detail = "" if key in ("fingerprint", "hidden_fingerprint", "temperature") else \
                f": rank 0 has {show(table[0][key])}, rank {other} has {show(table[other][key])}"
            raise ValueError(
                f"tp ranks disagree on the {what}{detail}. Every rank of tp_group must pass the same hidden rows, "
                "index/targets, dtype and knobs, and its own contiguous vocabulary shard of the head"
            )
    sizes = [m["vocab"] for m in table]
    starts = [sum(sizes[:r]) for r in range(world)]
    for r, m in enumerate(table):
        if m["start"] not in (-1, starts[r]):
            raise ValueError(
                f"tp rank {r} gives vocab_start_index={m['start']} but the shards of ranks 0..{r - 1} hold "
                f"{starts[r]} rows (sizes {sizes}): shards must be contiguous and in rank order"
            )
    total = sum(sizes)
    if total == 0:
        raise ValueError("every tp rank's weight shard is empty (V = 0)")
    check_aligned(sizes, starts)
    if 0 in sizes and use_triton(hidden):
        raise ValueError(f"tp rank {sizes.index(0)} holds no vocabulary rows (shard sizes {sizes}); the CUDA "
                         "kernels need at least one row per rank: shard the head over fewer ranks")
    shard = VocabShard(group, rank, world, starts[rank], sizes[rank], total, max(sizes), tuple(sizes))
    n, T = mine["rows"], mine["T"]
    if n:
        lo_t, hi_t = (0, 0) if targets is None else \
            (min(m["tgt_lo"] for m in table), max(m["tgt_hi"] for m in table))
        check_ranges(T, total, rows, rows[:0] if targets is None else targets, min(m["row_lo"] for m in table),
                     max(m["row_hi"] for m in table), lo_t, hi_t)
    if bias is not None:
        bad = [r for r, m in enumerate(table) if m["bias_bad"]]
        if bad:
            where = "shard"
            if rank == bad[0]:
                i = first_true(torch.isnan(bias) | (bias == math.inf))[0]
                where = f"shard: bias[{shard.start + i}] = {float(bias[i])}"
            raise ValueError(f"tp rank {bad[0]}'s bias {where} is NaN or +inf: a bias entry must be finite, or -inf "
                             "to mask its token")
        if not any(m["bias_live"] for m in table):
            raise ValueError("bias is -inf at every vocabulary entry of every shard: no token can be scored")
        if targets is not None:
            _masked_target(bias, targets, shard)
    all_rows = n == T and n > 0 and bool((rows == torch.arange(T, device=rows.device)).all())
    return shard, all_rows


def _masked_target(bias: Tensor, targets: Tensor, shard: VocabShard) -> None:
    """A target whose bias is -inf, found by its owner and raised on every rank (one all-gather)."""
    if targets.numel() == 0:  # the same on every rank (checked)
        return
    local = shard.local_targets(targets)
    owned = local >= 0
    masked = owned & (bias[local.clamp(min=0)] == -math.inf) if shard.size else torch.zeros_like(owned)
    first = torch.where(masked, torch.arange(targets.numel(), device=targets.device), targets.numel()).amin()
    firsts = torch.empty(shard.world, dtype=torch.int64, device=targets.device)
    all_gather(firsts, first.reshape(1), group=shard.group)
    at = int(firsts.amin())
    if at < targets.numel():
        token = int(targets[at])
        raise TargetError(at, token, f"is masked: bias[{token}] = -inf (probability 0); score only tokens it can give")
