"""Plain-torch pack/unpad, one sample at a time: the oracle of the pack tests.

Deliberately a Python loop over samples (obviously right, slow); ``rlk_mm.ops.padded`` and
``rlk_mm.ops.packed_batch`` hold the vectorized torch backend and the Triton dispatch.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def pack_padded(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(``x``'s rows where ``mask`` is True, sample by sample; int32 ``cu_seqlens``)."""
    rows = [x[b][mask[b].bool()] for b in range(x.shape[0])]
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    for b, r in enumerate(rows):
        cu[b + 1] = cu[b] + r.shape[0]
    packed = torch.cat(rows) if rows else x.new_empty((0,) + tuple(x.shape[2:]))
    return packed, cu


def unpack_to_padded(packed: Tensor, cu_seqlens: Tensor, length: int, starts: list[int], fill=0) -> Tensor:
    """``[B, length, *]`` with sample ``b``'s rows at ``starts[b]:starts[b] + n_b``, ``fill`` elsewhere."""
    B = cu_seqlens.numel() - 1
    out = torch.full((B, length) + tuple(packed.shape[1:]), fill, dtype=packed.dtype, device=packed.device)
    for b in range(B):
        lo, hi = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        out[b, starts[b] : starts[b] + hi - lo] = packed[lo:hi]
    return out


def pack_batch(batch, align: int = 1, pad_token_id: int = 0) -> dict:
    """The packed token fields of a whole ``RLBatch`` (no split), built sample by sample.

    Each sample is followed by pad tokens up to a multiple of ``align``; pad positions
    continue (t = h = w) from one past the sample's largest position. Spans shift by the
    sample's offset in the pack.
    """
    ids, pos, valid, cu = [], [], [], [0]
    mod_starts, loss_starts = [], []
    for b in range(batch.num_samples):
        tokens, positions = batch.sample_tokens(b), batch.sample_positions(b)
        n = tokens.numel()
        slot = -(-n // align) * align
        offset = cu[-1]
        pads = slot - n
        ids += [tokens, torch.full((pads,), pad_token_id, dtype=torch.int64)]
        tail = torch.arange(pads, dtype=torch.int64) + int(positions.max()) + 1
        pos += [positions, tail.expand(3, pads)]
        valid += [torch.ones(n, dtype=torch.bool), torch.zeros(pads, dtype=torch.bool)]
        mod_starts += [s.start + offset for s in batch.modality_spans_of(b)]
        loss_starts += [s.start + offset for s in batch.loss_spans_of(b)]
        cu.append(offset + slot)
    return dict(
        input_ids=torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64),
        position_ids=torch.cat(pos, dim=1) if pos else torch.zeros(3, 0, dtype=torch.int64),
        valid=torch.cat(valid) if valid else torch.zeros(0, dtype=torch.bool),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        modality_starts=torch.tensor(mod_starts, dtype=torch.int32),
        loss_starts=torch.tensor(loss_starts, dtype=torch.int32),
    )
