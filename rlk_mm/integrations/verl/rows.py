"""Which rows verl's LM head scores on the fused path: only those verl's RL losses read.

verl's RL micro-batches hold the prompt (text and image tokens) and the response packed in its
no-padding layout; its losses read the log-probs of the response tokens under
``response_mask`` only. ``response_rows`` finds those packed positions in a micro-batch;
``scoring`` makes ``FusedLinearForPPO`` (``verl.lm_head``) score only them, in the packed or the
padded layout of ``input_ids``, with zeros elsewhere. ``response_slots`` and ``padded`` also
serve the loss computed in the LM head (``verl.fused_loss``), which gathers its per-token inputs
at the same positions.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Optional

import torch

from ...schema.checks import INTEGER_DTYPES, tensor_arg

__all__ = ["response_rows", "scoring"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class _Scoring:
    """Rows whose outputs are read, as packed positions (``log_probs[t]`` scores token
    ``t + 1``), and the packed sample offsets ``cu_seqlens`` [B+1]."""

    rows: Tensor
    cu_seqlens: Tensor

    def rows_for(self, shape: torch.Size, device: torch.device) -> Optional[Tensor]:
        """The rows in the layout of ``input_ids`` of ``shape``, or None when it is neither
        the packed ``[1, T (+ padding)]``/``[T]`` nor the padded ``[B, L]`` layout."""
        cu = self.cu_seqlens.to(device=device, dtype=torch.int64)
        rows = self.rows.to(device=device, dtype=torch.int64)
        total, samples = int(cu[-1]), cu.numel() - 1
        if len(shape) == 1 or (len(shape) == 2 and shape[0] == 1):
            return rows if shape[-1] >= total else None
        if len(shape) == 2 and shape[0] == samples and samples > 1:
            sample = torch.searchsorted(cu, rows, right=True) - 1
            if int((cu[1:] - cu[:-1]).max()) > shape[1]:
                return None
            return sample * shape[1] + (rows - cu[sample])
        return None


_SCORING: contextvars.ContextVar[Optional[_Scoring]] = contextvars.ContextVar("rlk_mm_verl_scoring", default=None)


@contextlib.contextmanager
def scoring(rows: Tensor, cu_seqlens: Tensor):
    """Within the block, ``FusedLinearForPPO`` scores only packed positions ``rows`` of the
    samples laid out by ``cu_seqlens`` (packed or padded inputs), and returns zeros elsewhere."""
    tensor_arg("rows", rows, ndim=1, dtypes=INTEGER_DTYPES)
    tensor_arg("cu_seqlens", cu_seqlens, ndim=1, dtypes=INTEGER_DTYPES)
    token = _SCORING.set(_Scoring(rows, cu_seqlens))
    try:
        yield
    finally:
        _SCORING.reset(token)


def scored_rows(shape: torch.Size, device: torch.device) -> Optional[Tensor]:
    """The rows ``scoring`` set for the running block, in the layout of ``input_ids`` of ``shape``;
    None outside ``scoring`` or for a layout the rows cannot be mapped to."""
    plan = _SCORING.get()
    return None if plan is None else plan.rows_for(shape, device)


def response_slots(micro_batch) -> Optional[tuple[Tensor, Tensor, Tensor]]:
    """(window [B, R]: the packed row whose log-prob verl reads for each response slot,
    ``response_mask`` [B, R] as bool, ``cu_seqlens`` [B+1]) of an RL micro-batch in verl's
    no-padding layout, or None for other batches."""
    from verl.workers.utils.padding import no_padding_2_padding

    if not all(k in micro_batch.keys() for k in ("input_ids", "prompts", "responses", "response_mask")):
        return None
    input_ids = micro_batch["input_ids"]
    if not input_ids.is_nested:
        return None
    cu = input_ids.offsets()
    packed = torch.nested.nested_tensor_from_jagged(torch.arange(int(cu[-1]), device=cu.device), cu)
    window = no_padding_2_padding(packed, micro_batch)  # [B, R]: packed row of each response slot
    mask = padded(micro_batch["response_mask"], window.shape)
    if mask is None:
        return None
    return window, mask.to(device=window.device).bool(), cu


def padded(t: Tensor, shape: torch.Size) -> Optional[Tensor]:
    """``t`` as a dense ``shape`` tensor (nested ones padded with 0), or None if it does not fit."""
    if t.is_nested:
        t = t.to_padded_tensor(0, output_size=tuple(shape))
    return t if tuple(t.shape) == tuple(shape) else None


def response_rows(micro_batch) -> Optional[tuple[Tensor, Tensor]]:
    """(rows, cu_seqlens) of an RL micro-batch in verl's no-padding layout: the packed
    positions whose log-probs verl's RL losses read (``no_padding_2_padding``: the response
    window shifted by one), kept where ``response_mask`` is set, in the mask's row-major
    order. None for other batches."""
    slots = response_slots(micro_batch)
    if slots is None:
        return None
    window, mask, cu = slots
    return window[mask], cu
