"""Vocabulary-parallel selected log-prob and fused policy loss over ``torch.distributed``.

Layout (Megatron's ``VocabParallelEmbedding`` / verl's tensor-parallel LM head, and FSDP2's
``Shard(0)``): each rank of the group holds a contiguous slice of the head's rows,
``weight[start_r : start_r + V_r]`` (and of the bias), in rank order with no gap, and the
*same* scored hidden rows and targets (global token ids). Shards may be uneven, and on the
CPU backend even empty (torch's ``Shard(0)`` of V < group size). The global vocabulary is the
concatenation of the shards, so a padded vocabulary (Megatron pads to a multiple of 128 x the
group size; Qwen2.5's 152,064 head rows exceed its tokenizer's vocabulary) is scored like any
row, as the single-device op scores it; pass a bias of -inf at the padding rows to exclude them. ``vocab_start_index`` (Megatron's and verl's name)
is optional: when given it must equal the sum of the lower ranks' shard sizes.

Per call, collectives (group size P > 1, ``n`` scored rows, hidden size ``H``):

1. ``agree``: one ``all_gather`` of a few int64 per rank (shard sizes, dtypes, ``n``, value
   checks, a fingerprint of rows and targets, and with ``RLK_MM_TP_DEBUG=1`` of the scored
   hidden rows): a bad setup raises on *every* rank, naming the rank, instead of hanging;
2. forward, ``combine``: one ``all_gather`` of each rank's per-row (target logit, log-sum-exp
   [, entropy]) -- 2 or 3 fp32 -- combined on every rank in rank order 0, 1, ..., P-1;
3. backward, ``sum_rows``: the shards' fp32 d hidden ``[n, H]`` summed in rank order: an
   ``all_to_all`` hands rank r the column block r of every rank's part, rank r adds them in
   rank order, an ``all_gather`` returns the sums (a reduce-scatter + all-gather whose sum
   order is ours, not the library's: NCCL's all-reduce picks ring or tree by message size,
   which would tie a row's bits to the batch size). Weight and bias gradients stay local.

Bytes each rank sends per scored token (``comm_bytes_per_token``): forward ``(P-1)·4·k``
(k = 2, 3 with entropy), backward ``2·(P-1)·4·⌈H/P⌉``; e.g. H = 3584, P = 2: 8 or 12 B
forward, 14,336 B backward (``bench/bench_tp.py`` and ``tests/test_vocab_parallel.py``
check it against the profiler's collectives). Every reduction has a fixed order and works
row by row, so results are bitwise the same run to run for a group size, and a row's result
does not depend on the other rows; with P = 1 they are bitwise the single-device op's.

``DTensor`` heads: a ``Shard(0)`` weight on a 1-D mesh runs vocabulary-parallel on its
local shard over the mesh's group (``to_local``: its gradient lands as the ``Shard(0)``
gradient); nothing is gathered unless ``gather_weight=True``, which all-gathers the head
once for a data-parallel caller whose ranks score *different* rows, and reduce-scatters its
gradient, averaged over the mesh as FSDP2 averages. Under ``torch.compile`` the
vocabulary-parallel call is a graph break (``torch.compiler.disable``: collectives with
host-side checks); the compiled graph sees a DTensor head's ``to_local()`` (a view, no
communication) or, with ``gather_weight``, its redistribution (the all-gather), then the call.
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
from ._head_inputs import TargetError, check_head, check_ranges, contiguous_rows
from ._torch import logprob as _ref

__all__ = [
    "agree", "combine", "comm_bytes_per_token", "debug_checks", "local_head", "loss_grads", "merge_stats",
    "profiled_sent_bytes", "scatter_rows", "selected_logprob", "sum_rows", "VocabShard",
]

#: the per-rank fields ``agree`` gathers, in order
_FIELDS = ("error", "vocab", "start", "hidden_size", "dtype", "rows", "T", "bias", "temperature", "fingerprint",
           "hidden_fingerprint", "needs_grad", "row_lo", "row_hi", "tgt_lo", "tgt_hi", "bias_bad", "bias_live")


def debug_checks() -> bool:
    """``RLK_MM_TP_DEBUG=1``: also check that every rank holds the same scored hidden rows."""
    return os.environ.get("RLK_MM_TP_DEBUG", "0") == "1"


def comm_bytes_per_token(group_size: int, hidden_size: int, with_entropy: bool) -> dict[str, int]:
    """Bytes each rank sends per scored token: ``forward`` (the stats' all-gather) and
    ``backward`` (the ordered d hidden sum: all-to-all + all-gather of fp32 column blocks)."""
    P = group_size
    return {"forward": (P - 1) * 4 * (3 if with_entropy else 2),
            "backward": 2 * (P - 1) * 4 * math.ceil(hidden_size / P)}


@dataclass(frozen=True)
class VocabShard:
    """This rank's place in the group: vocabulary rows ``[start, start + size)`` of ``total``;
    ``largest`` is the largest shard (every rank cuts the same row chunks from it)."""

    group: object
    rank: int
    world: int
    start: int
    size: int
    total: int
    largest: int

    def local_targets(self, targets: Tensor) -> Tensor:
        """Targets as rows of this shard; -1 for a target on another shard."""
        local = targets - self.start
        return torch.where((local >= 0) & (local < self.size), local, -1)


# ------------------------------------------------------------------ arguments
def local_head(weight, bias, tp_group, vocab_start_index, gather_weight: bool):
    """``(weight, bias, group)`` to compute with: a ``DTensor`` head as its
    local shard and its mesh's group (or, with ``gather_weight``, the whole head and no
    group); a plain head as given. Refuses ambiguous combinations."""
    from torch.distributed.tensor import DTensor

    if not isinstance(gather_weight, bool):
        raise TypeError(f"gather_weight must be a bool, got {type(gather_weight).__name__}")
    if not isinstance(weight, DTensor):
        if isinstance(bias, DTensor):
            raise TypeError("bias is a DTensor but weight is not: pass both as DTensors on one mesh, or both local")
        if gather_weight:
            raise ValueError("gather_weight=True applies to a DTensor weight only; this weight is a plain tensor")
        if tp_group is None and vocab_start_index is not None:
            raise ValueError("vocab_start_index applies only with tp_group= (a vocabulary shard); leave it out")
        return weight, bias, tp_group
    from torch.distributed.tensor import Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(
            f"weight is a DTensor placed {tuple(weight.placements)} on a {mesh.ndim}-D mesh; the head must be Shard(0) "
            "on a 1-D mesh (FSDP2 fully_shard's layout): redistribute it, or pass the local shard with tp_group="
        )
    if bias is not None and (not isinstance(bias, DTensor) or bias.device_mesh != mesh
                             or tuple(bias.placements) != (Shard(0),)):
        raise TypeError("weight is a Shard(0) DTensor: bias must be a Shard(0) DTensor on the same mesh (or None)")
    if tp_group is not None:
        raise ValueError("weight is a DTensor: its mesh gives the group; leave tp_group out")
    if vocab_start_index is not None:
        raise ValueError("weight is a DTensor: its placement gives the shard's start; leave vocab_start_index out")
    if gather_weight:
        return _gathered(weight), None if bias is None else _gathered(bias), None
    return weight.to_local(), None if bias is None else bias.to_local(), mesh.get_group()


def _gathered(t):
    """The whole of a ``Shard(0)`` DTensor on every rank (an all-gather). Data-parallel ranks
    score different rows, so each rank's gradient is a partial one: reduce-scattered back to
    the shards and averaged over the mesh, as FSDP2 averages its gradients."""
    from torch.distributed.tensor import Partial, Replicate

    full = t.redistribute(t.device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    return _ScaleGrad.apply(full, 1.0 / t.device_mesh.size())


class _ScaleGrad(torch.autograd.Function):
    """Identity whose gradient is scaled (the mesh average of a gathered head's gradient)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _fingerprint(t: Tensor) -> Tensor:
    """An int64 hash of ``t``'s bits and order (exact integer sums: the same on every device)."""
    flat = t.contiguous().flatten()
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    x = flat.view(ints).to(torch.int64)
    return (x * (torch.arange(x.numel(), device=x.device) % 1_000_003 + 1)).sum()


def agree(hidden: Tensor, weight: Tensor, rows: Tensor, targets: Tensor, bias: Optional[Tensor], temperature: float,
          group, vocab_start_index, needs_grad: bool, local_check) -> tuple[VocabShard, bool]:
    """Check the call on every rank (one all-gather); the shard and whether the rows are
    every row of hidden in order. ``local_check()`` runs this rank's own argument checks;
    whatever fails on one rank raises on all of them."""
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
        meta = _local_meta(hidden, weight, rows, targets, bias, temperature, vocab_start_index, needs_grad)
    elif vocab_start_index is not None and isinstance(vocab_start_index, int):
        meta[_FIELDS.index("start")] = vocab_start_index
    meta[0] = int(error is not None)
    gathered = torch.empty(world * len(_FIELDS), dtype=torch.int64, device=hidden.device)
    dist.all_gather_into_tensor(gathered, meta, group=group)
    table = [dict(zip(_FIELDS, r)) for r in gathered.view(world, -1).tolist()]
    if error is not None:
        raise error
    failed = [r for r, m in enumerate(table) if m["error"]]
    if failed:
        raise ValueError(f"tp rank {failed[0]} refused its inputs (its error says why); rank {rank} stops with it")
    return _check_table(table, rank, world, group, vocab_start_index, hidden, rows, targets, bias)


def _local_meta(hidden, weight, rows, targets, bias, temperature, vocab_start_index, needs_grad) -> Tensor:
    n, V = rows.numel(), weight.shape[0]
    values = {
        "vocab": V, "start": -1 if vocab_start_index is None else vocab_start_index, "hidden_size": hidden.shape[1],
        "dtype": KERNEL_FLOAT_DTYPES.index(hidden.dtype), "rows": n, "T": hidden.shape[0],
        "bias": int(bias is not None),
        "temperature": struct.unpack("<q", struct.pack("<d", temperature))[0], "needs_grad": int(needs_grad),
    }
    stats = {"fingerprint": _fingerprint(rows) * 31 + _fingerprint(targets)}
    if debug_checks():
        stats["hidden_fingerprint"] = _fingerprint(hidden.index_select(0, rows))
    if n:
        stats["row_lo"], stats["row_hi"] = torch.aminmax(rows)
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
                      ("fingerprint", "scored rows and targets"), ("hidden_fingerprint", "scored hidden rows")):
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
    if 0 in sizes and use_triton(hidden):
        raise ValueError(f"tp rank {sizes.index(0)} holds no vocabulary rows (shard sizes {sizes}); the CUDA "
                         "kernels need at least one row per rank: shard the head over fewer ranks")
    shard = VocabShard(group, rank, world, starts[rank], sizes[rank], total, max(sizes))
    n, T = mine["rows"], mine["T"]
    if n:
        check_ranges(T, total, rows, targets, min(m["row_lo"] for m in table), max(m["row_hi"] for m in table),
                          min(m["tgt_lo"] for m in table), max(m["tgt_hi"] for m in table))
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
    dist.all_gather_into_tensor(firsts, first.reshape(1), group=shard.group)
    at = int(firsts.amin())
    if at < targets.numel():
        token = int(targets[at])
        raise TargetError(at, token, f"is masked: bias[{token}] = -inf (probability 0); score only tokens it can give")


# ------------------------------------------------------------------ the collectives
def combine(raw: Tensor, entropy: Tensor, lse: Tensor, shard: VocabShard,
            with_entropy: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """The group's ``(log-prob, entropy, log-sum-exp)`` per row from this rank's (target
    logit, entropy (empty without ``with_entropy``), log-sum-exp) over its shard: one
    all-gather, then ``merge_stats`` on every rank."""
    mine = torch.stack([lse, raw] + ([entropy] if with_entropy else [])).float().contiguous()
    if shard.world == 1:
        return merge_stats(mine[None], entropy)
    stats = torch.empty(shard.world * mine.numel(), dtype=mine.dtype, device=mine.device)
    dist.all_gather_into_tensor(stats, mine.flatten(), group=shard.group)
    return merge_stats(stats.view((shard.world,) + tuple(mine.shape)), entropy)


def merge_stats(stats: Tensor, no_entropy: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(log-prob, entropy, log-sum-exp)`` ``[n]`` from the shards' stats ``[P, k, n]``
    (log-sum-exp, target logit (0 off the owner), and with k = 3 entropy), per row in rank
    order: ``lse = M + log Σ_r exp(lse_r - M)``, ``H = Σ_r w_r (H_r + lse - lse_r)`` with
    ``w_r = exp(lse_r - lse)``, a shard's share of the probability (an empty or fully masked
    shard has ``lse_r = -inf`` and adds nothing). ``no_entropy`` is returned as the entropy
    when k = 2. With P = 1 the results are the shard's own, bitwise."""
    if stats.dim() != 3 or stats.shape[1] not in (2, 3) or stats.dtype != torch.float32:
        raise ValueError(f"stats must be fp32 [P, 2 or 3, n]; got {stats.dtype} {tuple(stats.shape)}")
    lse_r = stats[:, 0]
    top = lse_r.amax(0)  # exact and order-free; finite: some shard has a finite logit (checked)
    total, target = torch.zeros_like(top), torch.zeros_like(top)
    for r in range(stats.shape[0]):
        total = total + torch.exp(lse_r[r] - top)
        target = target + stats[r, 1]
    lse = top + torch.log(total)
    entropy = no_entropy
    if stats.shape[1] == 3:
        entropy = torch.zeros_like(top)
        for r in range(stats.shape[0]):
            w = torch.exp(lse_r[r] - lse)
            entropy = entropy + torch.where(w > 0, w * (stats[r, 2] + (lse - lse_r[r])), 0.0)
    return target - lse, entropy, lse


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
    dist.all_gather_into_tensor(out, acc, group=shard.group)
    return out[:H].T.contiguous()


def scatter_rows(d_rows: Tensor, rows: Tensor, T: int, dtype: torch.dtype, all_rows: bool) -> Tensor:
    """d hidden ``[T, H]`` in ``dtype`` from fp32 per-scored-row gradients (repeats summed)."""
    if all_rows:
        return d_rows.to(dtype)
    full = torch.zeros((T, d_rows.shape[1]), dtype=d_rows.dtype, device=d_rows.device)
    return full.index_put_((rows,), d_rows, accumulate=True).to(dtype)


# ------------------------------------------------------------------ selected_logprob
def _shard_forward(hidden, weight, rows, local_targets, bias, temperature, with_entropy, all_rows):
    """This shard's (target logit, entropy, log-sum-exp) per row, fp32; an empty shard gives -inf sums."""
    n = rows.numel()
    if weight.shape[0] == 0 or n == 0:
        z = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        return z, z.clone() if with_entropy else z[:0], torch.full_like(z, -math.inf)
    if use_triton(hidden, weight):
        from ._triton import logprob as _tri

        return _tri.forward(hidden, weight, rows, local_targets, bias, temperature, with_entropy, all_rows,
                            raw_target=True)
    return _ref.selected_logprob_forward(hidden, weight, rows, local_targets, bias, temperature,
                                         with_entropy=with_entropy, raw_target=True)


def _shard_backward(g, ge, hidden, weight, rows, local_targets, bias, lse, entropy, temperature, all_rows, need):
    """This shard's ``(d hidden per scored row fp32 [n, H], d weight, d bias)``; None where not needed."""
    need_hidden, need_weight, need_bias = need
    n, H = rows.numel(), hidden.shape[1]
    if weight.shape[0] == 0 or n == 0:
        return (hidden.new_zeros((n, H), dtype=torch.float32) if need_hidden else None,
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
        local = shard.local_targets(targets)
        raw, ent, lse = _shard_forward(hidden, weight, rows, local, bias, temperature, with_entropy, all_rows)
        logp, ent, lse = combine(raw, ent, lse, shard, with_entropy)
        ctx.save_for_backward(hidden, weight, bias, rows, local, lse, ent)
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
    needed. The backends call ``combine`` per chunk of rows, before the gradient."""
    local = shard.local_targets(targets)

    def combined(raw, ent, lse):
        return combine(raw, ent, lse, shard)

    if use_triton(hidden, weight):
        from ._triton import linear_loss as _backend

        logp, entropy, d_rows, d_weight, d_bias = _backend.loss_grads(
            hidden, weight, rows, local, bias, temperature, all_rows, upstream, *need,
            combine=combined, chunk_vocab=shard.largest)
    else:
        from ._torch import linear_loss as _backend

        logp, entropy, d_rows, d_weight, d_bias = _backend.loss_grads(
            hidden, weight, rows, local, bias, temperature, upstream, *need, combine=combined)
    d_hidden = None
    if d_rows is not None:
        d_hidden = scatter_rows(sum_rows(d_rows.float(), shard), rows, hidden.shape[0], hidden.dtype, all_rows)
    return logp, entropy, d_hidden, d_weight, d_bias


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
