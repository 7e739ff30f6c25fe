"""This rank's place in a vocabulary-parallel group and the group's collectives.

``VocabShard``: which rows of the head this rank holds (every rank's sizes, in rank order);
``check_aligned``: every non-empty shard starts on the ``VOCAB_ALIGN`` segment grid, the
condition for results bitwise the single device's; ``Exchange``: the forward's collectives
(every shard's partials in vocabulary order, each row's target logit from its owner, and the
sampler's gathers); ``sum_rows``: the backward's d hidden summed in rank order, an order of
ours rather than NCCL's. ``all_gather`` is the one all-gather every module here calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .._head_inputs import VOCAB_ALIGN

#: gathers into one flat tensor (``all_gather_into_tensor`` is deprecated from torch 2.13)
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["all_gather", "check_aligned", "check_group", "Exchange", "sum_rows", "VocabShard"]


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
    the sampler's (``_triton.sampling.hidden``): ``gather_best``, ``gather_logits``."""

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
        all_gather(got, send, group=self.shard.group)
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
        all_gather(got, pack.flatten(), group=self.shard.group)
        got = got.view((self.world,) + tuple(pack.shape))
        return (got[:, :, 0].contiguous().view(torch.float64).flatten(), got[:, :, 1].to(torch.int32).contiguous(),
                got[:, :, 2:].contiguous().view(torch.float32).flatten())

    def gather_logits(self, z: Tensor, dim: int = 1) -> Tensor:
        """The whole vocabulary's logits from every shard's ``z`` (vocabulary along ``dim``)."""
        sizes, zt = self.shard.sizes, z.movedim(dim, 0)
        send = zt.new_empty((max(sizes),) + tuple(zt.shape[1:]))
        send[: zt.shape[0]] = zt
        got = send.new_empty(self.world * send.numel())
        all_gather(got, send.flatten(), group=self.shard.group)
        got = got.view((self.world,) + tuple(send.shape))
        return torch.cat([got[r, : sizes[r]] for r in range(self.world)]).movedim(0, dim).contiguous()


def check_aligned(sizes: list[int], starts: list[int]) -> None:
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


def check_group(tp_group) -> None:
    """``tp_group`` is a process group this rank belongs to, in an initialized ``torch.distributed``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tp_group given but torch.distributed is not initialized: call init_process_group first")
    if tp_group is not dist.group.WORLD and not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(f"tp_group must be a torch.distributed ProcessGroup, got {type(tp_group).__name__}")
    if dist.get_rank(tp_group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of tp_group: pass the "
                         "group this rank's vocabulary shard belongs to")


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
    all_gather(out, acc, group=shard.group)
    return out[:H].T.contiguous()
