"""Vocabulary-parallel selected log-prob, fused policy loss and sampling over ``torch.distributed``.

Layout (Megatron's ``VocabParallelEmbedding``, verl's tensor-parallel LM head, FSDP2's
``Shard(0)``): each rank holds a contiguous slice of the head's rows, ``weight[start_r :
start_r + V_r]`` (and of the bias), in rank order with no gap, and the *same* scored hidden
rows and targets (global token ids). Every non-empty shard starts on the ``VOCAB_ALIGN`` =
128-row segment grid: every shard but the last holds a multiple of 128 rows (the last may
end anywhere; shards may be uneven, and on the CPU backend empty). Megatron pads the
vocabulary to a multiple of 128 x the group size (Qwen2.5's 152,064 = 1,188 x 128 head rows),
so its shards qualify; a misaligned shard is refused on every rank, naming the alignment
and how to pad. Padding rows are scored like any row, as on one device: give them a bias
of -inf. ``vocab_start_index`` (Megatron's and verl's name), when given, must equal the sum
of the lower ranks' shard sizes.

The guarantee: forward results -- the log-probs, entropies and row log-sum-exps of
``selected_logprob`` and ``linear_policy_loss``, ``sample_from_hidden``'s tokens and
log-probs -- are bitwise the same for every group size and split (even or uneven), and
bitwise the single-device op's (same backend and dtype). The single-device op reduces each
128-column segment's logits to per-row partials and folds them in vocabulary order
(``_triton/lm_head.py``, ``_torch/logprob.py``); here each rank computes its own segments'
partials (the same numbers: its shard starts on the grid), they are all-gathered, and every
rank folds them in that order. The loss, d hidden (summed over the group) and each rank's
d weight / d bias shard are within the numerical contract of the single-device op, bitwise
run to run for a group size, and per row independent of the other rows.

Collectives per call (group size P > 1, ``n`` rows, hidden size ``H``, largest shard ``L``,
``G`` columns per partial: 128 for bf16/fp16 on CUDA and the torch backend; fp32 on CUDA 64
and Triton's interpreter 32, tiles narrower than a segment):

1. ``agree``: one ``all_gather`` of a few int64 per rank (shard sizes, dtypes, ``n``, value
   checks, fingerprints of rows and targets, and with ``RLK_MM_TP_DEBUG=1`` of the hidden
   rows): a bad setup raises on *every* rank, naming the rank, instead of hanging;
2. forward, ``Exchange``: per chunk of rows one ``all_gather`` of each rank's partials, ``k``
   fp32 per row and partial (max, Σ exp, and with entropy the entropy sum: k = 3, else 2),
   ``⌈L/G⌉`` partials per rank (smaller shards pad), plus the row's target logit;
3. backward, ``sum_rows``: the shards' fp32 d hidden ``[n, H]`` summed in rank order (an
   ``all_to_all`` of column blocks, rank r adds block r in rank order, an ``all_gather``:
   a sum order of ours, not NCCL's all-reduce, whose ring or tree follows the message
   size). Weight and bias gradients stay local.

Bytes each rank sends per scored token (``comm_bytes_per_token``): forward
``(P-1)·4·(k·⌈L/G⌉ + 1)``, backward ``2·(P-1)·4·⌈H/P⌉``. The 7B head (H = 3584, V = 152,064,
bf16, even shards), with entropy: P = 2, 7,132 B forward and 14,336 B backward; P = 4, 10,704
B and 21,504 B: about 12·V/128 B per row over the group, never a vocabulary-sized row
(``bench/bench_tp.py`` and ``tests/ops/test_vocab_parallel.py`` check it against the profiler).
``sample_from_hidden``: plain temperature gathers each rank's best noise block per row (144 B)
and the partials; top-k, top-p and min-p gather the fp32 logits. DTensor heads: a ``Shard(0)``
weight on a 1-D mesh runs on its local shard over the mesh's group (its gradient lands as the
``Shard(0)`` gradient); ``gather_weight=True`` all-gathers the head instead, for data-parallel
ranks scoring *different* rows, and reduce-scatters its gradient, averaged over the mesh as FSDP2
averages. Under ``torch.compile`` the call is a graph break; the compiled graph sees a DTensor
head's ``to_local()`` or its redistribution.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..schema.checks import KERNEL_FLOAT_DTYPES, first_true
from ._backend import use_triton
from ._head_inputs import VOCAB_ALIGN, TargetError, check_head, check_ranges, contiguous_rows, local_head
from ._torch import logprob as _ref
from ._torch import sampling as _sampling

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the latter deprecated in 2.13

__all__ = [
    "agree", "comm_bytes_per_token", "debug_checks", "Exchange", "local_head", "loss_grads", "partial_columns",
    "profiled_sent_bytes", "sample_from_hidden", "scatter_rows", "selected_logprob", "shard_forward", "sum_rows",
    "VOCAB_ALIGN", "VocabShard",
]

#: the per-rank fields ``agree`` gathers, in order
_FIELDS = ("error", "vocab", "start", "hidden_size", "dtype", "rows", "T", "bias", "temperature", "fingerprint",
           "hidden_fingerprint", "needs_grad", "row_lo", "row_hi", "tgt_lo", "tgt_hi", "bias_bad", "bias_live")


def debug_checks() -> bool:
    """``RLK_MM_TP_DEBUG=1``: also check that every rank holds the same scored hidden rows."""
    return os.environ.get("RLK_MM_TP_DEBUG", "0") == "1"


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
        from ._triton import lm_head

        return lm_head.partial_columns(lm_head.default_config(weight.dtype, weight.device))
    return VOCAB_ALIGN


@dataclass(frozen=True)
class VocabShard:
    """This rank's place in the group: vocabulary rows ``[start, start + size)`` of ``total``;
    ``sizes``: every rank's shard size, in rank order; ``largest`` is the largest shard (every
    rank cuts the same row chunks from it)."""

    group: object
    rank: int
    world: int
    start: int
    size: int
    total: int
    largest: int
    sizes: tuple = ()

    def local_targets(self, targets: Tensor) -> Tensor:
        """Targets as rows of this shard; -1 for a target on another shard."""
        local = targets - self.start
        return torch.where((local >= 0) & (local < self.size), local, -1)

    def owner(self, targets: Tensor) -> Tensor:
        """The rank holding each target (int64, on the targets' device)."""
        starts = torch.tensor([sum(self.sizes[:r]) for r in range(self.world)], device=targets.device)
        return torch.searchsorted(starts, targets, right=True) - 1


class Exchange:
    """The forward's collectives. Called (``_triton.lm_head.Exchange``): every shard's partials
    of a chunk of rows, in vocabulary order, and each row's target logit from the rank holding
    it (``targets``: the global targets; None: the caller's are the same on every rank). And
    the sampler's (``_triton.sample_hidden``): ``gather_best``, ``gather_logits``."""

    def __init__(self, shard: VocabShard, targets: Optional[Tensor] = None):
        self.shard, self.targets = shard, targets
        self.start, self.total, self.world = shard.start, shard.total, shard.world

    def __call__(self, parts: Tensor, tgt_logit: Tensor, start: int, cols: int) -> tuple[Tensor, Tensor]:
        k, own, m = parts.shape
        if self.world == 1:
            return parts.contiguous(), tgt_logit
        counts = [-(-size // cols) for size in self.shard.sizes]
        widest = max(counts)
        send = parts.new_empty(k * widest * m + m)
        send[: k * widest * m].view(k, widest, m)[:, :own] = parts
        send[k * widest * m :] = tgt_logit
        got = parts.new_empty(self.world * send.numel())  # flat: gloo chunks the output like the input
        _all_gather(got, send, group=self.shard.group)
        got = got.view(self.world, -1)
        blocks = got[:, : k * widest * m].view(self.world, k, widest, m)
        every = torch.cat([blocks[r, :, : counts[r]] for r in range(self.world)], dim=1)
        if self.targets is None:
            return every, tgt_logit
        return every, got[:, k * widest * m :].gather(0, self.shard.owner(self.targets[start : start + m])[None])[0]

    def gather_best(self, score: Tensor, block: Tensor, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Every rank's (score f64 [m], block int32 [m], logits fp32 [m, 32]), flat ``[P, m(, 32)]``."""
        pack = block.new_empty((score.numel(), 2 + z.shape[1] // 2), dtype=torch.int64)  # bits, as integers
        pack[:, 0], pack[:, 1] = score.contiguous().view(torch.int64), block
        pack[:, 2:] = z.contiguous().view(torch.int64)
        got = pack.new_empty(self.world * pack.numel())
        _all_gather(got, pack.flatten(), group=self.shard.group)
        got = got.view((self.world,) + tuple(pack.shape))
        return (got[:, :, 0].contiguous().view(torch.float64).flatten(), got[:, :, 1].to(torch.int32).contiguous(),
                got[:, :, 2:].contiguous().view(torch.float32).flatten())

    def gather_logits(self, z: Tensor, dim: int = 1) -> Tensor:
        """The whole vocabulary's logits from every shard's ``z`` (vocabulary along ``dim``)."""
        sizes, zt = self.shard.sizes, z.movedim(dim, 0)
        send = zt.new_empty((max(sizes),) + tuple(zt.shape[1:]))
        send[: zt.shape[0]] = zt
        got = send.new_empty(self.world * send.numel())
        _all_gather(got, send.flatten(), group=self.shard.group)
        got = got.view((self.world,) + tuple(send.shape))
        return torch.cat([got[r, : sizes[r]] for r in range(self.world)]).movedim(0, dim).contiguous()


# ------------------------------------------------------------------ arguments
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
    meta = torch.zeros(len(_FIELDS), dtype=torch.int64, device=hidden.device)
    if error is None:
        meta = _local_meta(hidden, weight, rows, targets, bias, temperature, vocab_start_index, needs_grad, extra)
    elif vocab_start_index is not None and isinstance(vocab_start_index, int):
        meta[_FIELDS.index("start")] = vocab_start_index
    meta[0] = int(error is not None)
    gathered = torch.empty(world * len(_FIELDS), dtype=torch.int64, device=hidden.device)
    _all_gather(gathered, meta, group=group)
    table = [dict(zip(_FIELDS, r)) for r in gathered.view(world, -1).tolist()]
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
        "temperature": struct.unpack("<q", struct.pack("<d", temperature))[0], "needs_grad": int(needs_grad),
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
    meta = torch.zeros(len(_FIELDS), dtype=torch.int64, device=hidden.device)
    for k, v in values.items():
        meta[_FIELDS.index(k)] = v
    for k, v in stats.items():
        meta[_FIELDS.index(k)] = v.to(torch.int64)
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
    _check_aligned(sizes, starts)
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


def _check_aligned(sizes: list[int], starts: list[int]) -> None:
    """Every non-empty shard starts on the ``VOCAB_ALIGN`` grid (else the partials of the
    segment it splits are not the single device's); refused with how to pad."""
    bad = next((r for r, (size, start) in enumerate(zip(sizes, starts)) if size and start % VOCAB_ALIGN), None)
    if bad is not None:
        a, P = VOCAB_ALIGN, len(sizes)
        raise ValueError(
            f"tp rank {bad}'s vocabulary shard starts at row {starts[bad]}, not a multiple of {a} (shard sizes "
            f"{sizes}): results equal the single device's bitwise only when every shard starts on the {a}-row "
            f"segment grid, so every shard but the last must hold a multiple of {a} rows. Pad the vocabulary to a "
            f"multiple of {a} x {P} = {a * P} (Megatron's make_vocab_size_divisible_by={a}, HF's "
            f"resize_token_embeddings(..., pad_to_multiple_of={a * P}); give the padding rows a bias of -inf) and "
            "shard it evenly; a DTensor head may instead be gathered (gather_weight=True)")


def _masked_target(bias: Tensor, targets: Tensor, shard: VocabShard) -> None:
    """A target whose bias is -inf, found by its owner and raised on every rank (one all-gather)."""
    if targets.numel() == 0:  # the same on every rank (checked)
        return
    local = shard.local_targets(targets)
    owned = local >= 0
    masked = owned & (bias[local.clamp(min=0)] == -math.inf) if shard.size else torch.zeros_like(owned)
    first = torch.where(masked, torch.arange(targets.numel(), device=targets.device), targets.numel()).amin()
    firsts = torch.empty(shard.world, dtype=torch.int64, device=targets.device)
    _all_gather(firsts, first.reshape(1), group=shard.group)
    at = int(firsts.amin())
    if at < targets.numel():
        token = int(targets[at])
        raise TargetError(at, token, f"is masked: bias[{token}] = -inf (probability 0); score only tokens it can give")


# ------------------------------------------------------------------ the collectives
def sum_rows(parts: Tensor, shard: VocabShard) -> Tensor:
    """``Σ_r parts_r`` over the group, fp32 ``[n, H]``, added in rank order on every rank:
    all-to-all of column blocks, ordered sum, all-gather."""
    if shard.world == 1:
        return parts
    P, (n, H) = shard.world, parts.shape
    block = math.ceil(H / P)
    cols = torch.zeros((P * block, n), dtype=torch.float32, device=parts.device)
    cols[:H] = parts.T
    received = torch.empty_like(cols)
    dist.all_to_all_single(received, cols, group=shard.group)
    received = received.view(P, block, n)
    acc = received[0].clone()
    for r in range(1, P):
        acc += received[r]
    out = torch.empty_like(cols)
    _all_gather(out, acc, group=shard.group)
    return out[:H].T.contiguous()


def scatter_rows(d_rows: Tensor, rows: Tensor, T: int, dtype: torch.dtype, all_rows: bool) -> Tensor:
    """d hidden ``[T, H]`` in ``dtype`` from fp32 per-scored-row gradients (repeats summed)."""
    if all_rows:
        return d_rows.to(dtype)
    full = torch.zeros((T, d_rows.shape[1]), dtype=d_rows.dtype, device=d_rows.device)
    return full.index_put_((rows,), d_rows, accumulate=True).to(dtype)


# ------------------------------------------------------------------ selected_logprob
def shard_forward(hidden: Tensor, weight: Tensor, rows: Tensor, targets: Tensor, bias: Optional[Tensor],
                  temperature: float, with_entropy: bool, all_rows: bool,
                  shard: VocabShard) -> tuple[Tensor, Tensor, Tensor]:
    """The group's ``(log-prob, entropy (empty without with_entropy), log-sum-exp)`` per row,
    fp32, from this rank's shard (``targets``: global ids; inputs checked by ``agree``):
    the backend's forward with ``Exchange``, bitwise the single-device op's forward."""
    exchange = Exchange(shard, targets)
    local = shard.local_targets(targets)
    if use_triton(hidden, weight):
        from ._triton import logprob as _tri

        return _tri.forward(hidden, weight, rows, local, bias, temperature, with_entropy, all_rows,
                            exchange=exchange, total_vocab=shard.total)
    return _ref.selected_logprob_forward(hidden, weight, rows, local, bias, temperature, with_entropy=with_entropy,
                                         exchange=exchange)


def _shard_backward(g, ge, hidden, weight, rows, local_targets, bias, lse, entropy, temperature, all_rows, need):
    """This shard's ``(d hidden per scored row fp32 [n, H], d weight, d bias)``; None where not needed."""
    need_hidden, need_weight, need_bias = need  # an empty shard adds zeros
    if weight.shape[0] == 0 or rows.numel() == 0:
        return (hidden.new_zeros((rows.numel(), hidden.shape[1]), dtype=torch.float32) if need_hidden else None,
                torch.zeros_like(weight) if need_weight else None,
                torch.zeros_like(bias) if need_bias and bias is not None else None)
    if use_triton(hidden, weight):
        from ._triton import logprob as _tri

        return _tri.backward(g, ge, hidden, weight, rows, local_targets, bias, lse, entropy, all_rows, temperature,
                             need_hidden, need_weight, need_bias and bias is not None)
    return _ref.selected_logprob_backward(g, ge, hidden, weight, rows, local_targets, bias, lse,
                                          entropy if ge is not None else None, temperature, need=need,
                                          per_scored_row=True)


class _VocabParallelLogprob(torch.autograd.Function):
    """log-prob and entropy over a vocabulary-sharded head; the backward's d hidden is summed over the group."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, targets, temperature, with_entropy, shard, all_rows):
        logp, ent, lse = shard_forward(hidden, weight, rows, targets, bias, temperature, with_entropy, all_rows, shard)
        ctx.save_for_backward(hidden, weight, bias, rows, shard.local_targets(targets), lse, ent)
        ctx.temperature, ctx.with_entropy, ctx.shard, ctx.all_rows = temperature, with_entropy, shard, all_rows
        ctx.mark_non_differentiable(lse)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, rows, local, lse, ent = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        g = (torch.zeros_like(lse) if grad_logp is None else grad_logp).float().contiguous()
        ge = grad_entropy.float().contiguous() if ctx.with_entropy and grad_entropy is not None else None
        d_rows, d_weight, d_bias = _shard_backward(g, ge, hidden, weight, rows, local, bias, lse, ent,
                                                   ctx.temperature, ctx.all_rows, need)
        d_hidden = None
        if need[0]:
            d_rows = sum_rows(d_rows.float(), ctx.shard)
            d_hidden = scatter_rows(d_rows, rows, hidden.shape[0], hidden.dtype, ctx.all_rows)
        return (d_hidden, None if d_weight is None else d_weight.to(weight.dtype),
                None if d_bias is None else d_bias.to(bias.dtype), None, None, None, None, None, None)


def _check_group(tp_group) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tp_group given but torch.distributed is not initialized: call init_process_group first")
    if tp_group is not dist.group.WORLD and not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(f"tp_group must be a torch.distributed ProcessGroup, got {type(tp_group).__name__}")
    if dist.get_rank(tp_group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of tp_group: pass the "
                         "group this rank's vocabulary shard belongs to")


@torch.compiler.disable
def selected_logprob(hidden: Tensor, weight: Tensor, rows: Tensor, targets: Tensor, bias: Optional[Tensor],
                     temperature: float, with_entropy: bool, tp_group, vocab_start_index) -> tuple[Tensor, Tensor]:
    """``logprob.selected_logprob`` on a vocabulary shard (arguments resolved there):
    ``(log-prob, entropy or empty)``, fp32 ``[n]``, the same on every rank."""
    _check_group(tp_group)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    shard, all_rows = agree(hidden, weight, rows, targets, bias, temperature, tp_group, vocab_start_index, needs_grad,
                            lambda: check_head(hidden, weight, rows, targets, bias, temperature, shard=True))
    hidden, weight = contiguous_rows(hidden), contiguous_rows(weight)
    return _VocabParallelLogprob.apply(hidden, weight, bias, rows, targets, temperature, with_entropy, shard, all_rows)


# ------------------------------------------------------------------ linear_policy_loss
def loss_grads(hidden, weight, rows, targets, bias, temperature, all_rows, upstream, need, shard: VocabShard):
    """The fused loss's backend call on a vocabulary shard: ``(log-prob, entropy, d hidden
    [T, H] summed over the group, this shard's d weight, d bias)``, gradients None when not
    needed. The backends call ``Exchange`` per chunk of rows, before the gradient."""
    local, exchange = shard.local_targets(targets), Exchange(shard, targets)
    if use_triton(hidden, weight):
        from ._triton import linear_loss as _backend

        logp, entropy, d_rows, d_weight, d_bias = _backend.loss_grads(
            hidden, weight, rows, local, bias, temperature, all_rows, upstream, *need,
            exchange=exchange, chunk_vocab=shard.largest)
    else:
        from ._torch import linear_loss as _backend

        logp, entropy, d_rows, d_weight, d_bias = _backend.loss_grads(
            hidden, weight, rows, local, bias, temperature, upstream, *need, exchange=exchange)
    d_hidden = None
    if d_rows is not None:
        d_hidden = scatter_rows(sum_rows(d_rows.float(), shard), rows, hidden.shape[0], hidden.dtype, all_rows)
    return logp, entropy, d_hidden, d_weight, d_bias


# ------------------------------------------------------------------ sample_from_hidden
@torch.compiler.disable
def sample_from_hidden(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], temperature: float, filters,
                       seeds: Tensor, steps: Tensor, triton: bool, tp_group,
                       max_vocab: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``sampling.sample_from_hidden`` on a vocabulary shard (arguments resolved there; top-k
    settled here against the group's vocabulary, of at most ``max_vocab`` entries):
    ``(tokens, log_probs, sampled_log_probs, status)``, the same on every rank and bitwise the
    single device's (``triton``: the Triton backend, else torch)."""
    _check_group(tp_group)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    settings = [-1 if v is None else struct.unpack("<q", struct.pack("<d", v))[0] for v in filters]  # exact bits
    extra = torch.cat([seeds, steps, torch.tensor(settings, device=seeds.device)])
    shard, _ = agree(hidden, weight, rows, None, bias, temperature, tp_group, None, False,
                     lambda: check_head(hidden, weight, rows, rows, bias, temperature, shard=True), extra=extra)
    if shard.total > max_vocab:
        raise ValueError(f"the vocabulary has {shard.total} entries over the group; sampling supports {max_vocab}")
    if filters.top_k is not None and filters.top_k >= shard.total:  # keeps every token (as one device settles it)
        filters = filters._replace(top_k=None)
    hidden, weight = contiguous_rows(hidden), contiguous_rows(weight)
    if triton:
        from ._triton import sample_hidden as _tri

        return _tri.sample_hidden(hidden, weight, bias, temperature, filters, seeds, steps, shard=Exchange(shard))
    tokens, sampled, status = _sampling.sample_gathered_rows(hidden, weight, bias, temperature, filters, seeds, steps,
                                                             Exchange(shard).gather_logits)
    # the log-probs of the rows drawn without error (row-invariant: a subset gives the same bits), NaN elsewhere
    ok = torch.nonzero(status == _sampling.OK).flatten()
    log_probs = torch.full(tokens.shape, math.nan, dtype=torch.float32, device=tokens.device)
    if ok.numel():
        log_probs[ok] = shard_forward(hidden, weight, ok, tokens[ok], bias, temperature, False, ok.numel() == rows.numel(),
                                      shard)[0]
    return tokens, log_probs, log_probs if filters.plain else sampled, status


# ------------------------------------------------------------------ measuring the traffic
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
