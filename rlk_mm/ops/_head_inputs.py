"""The LM-head ops' inputs, checked: the scored rows and targets (from an ``RLBatch``'s loss
spans or given), the hidden states, the head and its bias, and the errors that name them.

``selected_logprob``, ``linear_policy_loss``, ``sample_from_hidden`` and ``_vocab_parallel``
(which checks each rank's shard with them) share these checks: one home, no import cycle; and
``local_head``: which head a call computes with (a plain head, or a ``Shard(0)`` DTensor's
local shard and group, or the gathered whole)."""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from ..schema import RLBatch
from ..schema.checks import INTEGER_DTYPES, KERNEL_FLOAT_DTYPES, first_true, temperature_arg, tensor_arg

Tensor = torch.Tensor

__all__ = [
    "IGNORE_INDEX", "TargetError", "VOCAB_ALIGN", "check_bias", "check_head", "check_ranges", "check_values",
    "contiguous_rows", "index_arg", "local_head", "refuse_padding", "rows_from_batch", "scored_rows",
    "targets_named_by",
]

IGNORE_INDEX = -100  # the ignore index of torch's and HF's losses: a common slip into token ids
#: columns of one vocabulary segment: the global grid every backend reduces logits on (a
#: segment's partial sums, then the segments folded in order), whatever the dtype, device or
#: tensor-parallel layout; a vocabulary shard must start on it (``_vocab_parallel``)
VOCAB_ALIGN = 128


class TargetError(ValueError):
    """A target outside the vocabulary or masked by the bias. ``at`` is its place in
    ``targets``: a caller that knows where the token came from re-raises naming that place."""

    def __init__(self, at: int, token: int, problem: str):
        super().__init__(f"targets[{at}] = {token} {problem}")
        self.at, self.token, self.problem = at, token, problem


def index_arg(name: str, t) -> Tensor:
    tensor_arg(name, t)
    if t.dtype not in INTEGER_DTYPES:
        raise TypeError(f"{name} must be an integer tensor (int64 or int32); got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D [n]; got shape {tuple(t.shape)}")
    return t.to(torch.int64).contiguous()


def refuse_padding(padding) -> None:
    raise ValueError(
        f"padding={padding!r} applies only to [B, L, H] hidden states with a batch; packed hidden states and "
        "index= rows (rows of the flattened hidden states) have no padding side: leave padding out"
    )


def rows_from_batch(batch: RLBatch, hidden: Tensor, padding) -> tuple[Tensor, Tensor]:
    """(rows, targets) on hidden's device from the batch's loss spans, checked against hidden's layout."""
    if hidden.dim() == 2:
        if padding is not None:
            refuse_padding(padding)
        if hidden.shape[0] != batch.num_tokens:
            raise ValueError(
                f"hidden is packed [T={hidden.shape[0]}, H] but the batch has {batch.num_tokens} tokens: "
                "pass one hidden state per packed token of the batch"
            )
        rows, targets = batch.loss_token_index()
        return rows.to(hidden.device), targets.to(hidden.device)
    B, L = hidden.shape[:2]
    if B != batch.num_samples:
        raise ValueError(f"hidden is padded [B={B}, L, H] but the batch has {batch.num_samples} samples")
    if padding is None:
        raise ValueError(
            f"hidden is padded [B={B}, L={L}, H] and its padding side is ambiguous: pass padding='right' "
            "(each sample's tokens start its row) or padding='left' (they end it)"
        )
    try:
        rows, targets = batch.loss_token_index(padded_length=L, padding=padding)
    except ValueError as error:  # name the argument the caller gave
        raise ValueError(f"hidden is padded [B={B}, L={L}, H]: {error}") from None
    return rows.to(hidden.device), targets.to(hidden.device)


# ------------------------------------------------------------------ checks (all backends)
def check_head(hidden, weight, rows, targets, bias, temperature, shard: bool = False) -> None:
    """Types, shapes, dtypes, devices and temperature, read on the host; raised before any kernel runs.
    A vocabulary ``shard`` may be empty (V = 0 rows on this rank)."""
    tensor_arg("weight", weight)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H]; got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H] (the LM head); got shape {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden is [T, {hidden.shape[1]}] but weight is [V, {weight.shape[1]}]")
    if hidden.shape[1] == 0:
        raise ValueError("hidden and weight have hidden size H = 0: pass the model's hidden states and its LM head")
    if weight.shape[0] == 0 and not shard:
        raise ValueError("weight has an empty vocabulary (V = 0)")
    if hidden.dtype not in KERNEL_FLOAT_DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(
            f"hidden and weight must share one of float32/bfloat16/float16; got {hidden.dtype} and {weight.dtype}"
        )
    if bias is not None:
        tensor_arg("bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [V={weight.shape[0]}]; got shape {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias dtype {bias.dtype} differs from weight dtype {weight.dtype}")
    for name, t in (("index", rows), ("targets", targets)):
        if t.dtype != torch.int64 or t.dim() != 1:
            raise TypeError(f"{name} must be int64 [n]; got {t.dtype} {tuple(t.shape)}")
    if rows.shape != targets.shape:
        raise ValueError(f"index has {rows.numel()} rows but targets has {targets.numel()} entries")
    named = [("weight", weight), ("index", rows), ("targets", targets)] + ([("bias", bias)] if bias is not None else [])
    for name, t in named:
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    temperature_arg(temperature)


def check_values(T: int, V: int, rows: Tensor, targets: Tensor, bias: Optional[Tensor]) -> bool:
    """Every row in [0, T); every target in [0, V) and not masked by the bias; every bias
    entry finite or -inf, not all -inf. The error names the first offender. Returns whether
    the rows are exactly 0, 1, ..., T - 1. All of it is read in one host sync."""
    n = rows.numel()
    stats = [*torch.aminmax(rows), *torch.aminmax(targets)] if n else []
    if n and n == T:
        stats.append((rows == torch.arange(T, device=rows.device)).all().to(rows.dtype))
    if bias is not None:  # max: nan or +inf if any, -inf if all masked; min at the targets: -inf if one is masked
        at_targets = bias[targets.clamp(0, V - 1)].amin() if n else bias.new_zeros(())
        stats = [s.double() for s in (*stats, bias.amax(), at_targets)]
    values = torch.stack(stats).tolist() if stats else []  # the one sync
    if n:
        check_ranges(T, V, rows, targets, *values[:4])
    if bias is not None:
        check_bias(bias, targets, *values[-2:])
    return n == T and n > 0 and bool(values[4])


def check_ranges(T: int, V: int, rows: Tensor, targets: Tensor, lo_r, hi_r, lo_t, hi_t) -> None:
    if lo_r < 0 or hi_r >= T:
        i = first_true((rows < 0) | (rows >= T))[0]
        raise ValueError(f"index[{i}] = {int(rows[i])} is out of range: there are {T} rows of hidden")
    if lo_t < 0 or hi_t >= V:
        i = first_true((targets < 0) | (targets >= V))[0]
        token = int(targets[i])
        hint = ""
        if token == IGNORE_INDEX:
            hint = f"; {token} is an ignore index: leave such positions out of index and targets"
        raise TargetError(i, token, f"is out of range: there are {V} vocabulary entries (rows of weight){hint}")


def check_bias(bias: Tensor, targets: Tensor, top, target_low) -> None:
    if not top < math.inf:
        i = first_true(torch.isnan(bias) | (bias == math.inf))[0]
        raise ValueError(f"bias[{i}] = {float(bias[i])}: a bias entry must be finite, or -inf to mask its token")
    if top == -math.inf:
        raise ValueError("bias is -inf at every vocabulary entry: no token can be scored; keep some entries finite")
    if target_low == -math.inf:
        i = first_true(bias[targets] == -math.inf)[0]
        token = int(targets[i])
        raise TargetError(i, token, f"is masked: bias[{token}] = -inf (probability 0); score only tokens it can give")


def contiguous_rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# ------------------------------------------------------------------ the head (vocabulary-parallel ops)
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


# ------------------------------------------------------------------ the scored rows


def scored_rows(hidden: Tensor, batch: Optional[RLBatch], index, targets, padding) -> tuple[Tensor, Tensor]:
    """(rows of the flattened hidden states, targets), int64 ``[n]``: from the batch's loss
    spans, or the given ``index`` and ``targets`` (checked: exactly one of the two ways)."""
    tensor_arg("hidden", hidden)
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [T, H] (packed) or [B, L, H] (padded); got shape {tuple(hidden.shape)}")
    if batch is not None:
        if index is not None or targets is not None:
            raise ValueError("give either batch or index/targets, not both")
        if not isinstance(batch, RLBatch):
            raise TypeError(f"batch must be an RLBatch, got {type(batch).__name__} (or pass index= and targets=)")
        return rows_from_batch(batch, hidden, padding)
    if index is None or targets is None:
        raise ValueError("without batch, both index (rows of hidden) and targets (token ids) are required")
    if padding is not None:
        refuse_padding(padding)
    return index_arg("index", index), index_arg("targets", targets)


@contextlib.contextmanager
def targets_named_by(batch: Optional[RLBatch]):
    """A ``TargetError`` raised inside, re-raised naming the batch's sample and position."""
    try:
        yield
    except TargetError as e:
        if batch is None:
            raise
        sample, pos, _ = batch.loss_spans.token_positions()
        where = f"sample {int(sample[e.at])}, position {int(pos[e.at])}"
        raise ValueError(f"batch input_ids: {where} holds token {e.token}, which {e.problem}") from None
