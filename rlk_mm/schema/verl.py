"""Builder from verl's tensors: a left-padded prompt followed by a right-padded response.

``fields_from_verl`` returns a batch's fields; ``RLBatch.from_verl`` builds (and validates) it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._build import LayoutInfo, build, unpad, unpad_positions
from .spans import SchemaError

Tensor = torch.Tensor


def fields_from_verl(
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    *,
    processor,
    responses: Optional[Tensor] = None,
    response_mask: Optional[Tensor] = None,
    multi_modal_inputs: Optional[Sequence[dict]] = None,
    group_ids=None,
    rewards=None,
    media_ids: Optional[Sequence[str]] = None,
    tokens_per_second: Optional[float] = None,
) -> dict:
    """The fields of an RLBatch (``RLBatch.from_verl``) from verl-style tensors.

    ``input_ids``/``attention_mask`` ``[B, L]`` are a left-padded prompt followed by a
    right-padded response of width ``R`` =
    ``responses.shape[1]``; ``response_mask`` ``[B, R]`` marks scored response tokens;
    ``position_ids`` ``(B, 4, L)`` (verl's text row + M-RoPE), ``(B, 3, L)`` or ``(B, L)``
    are recorded as given; ``multi_modal_inputs`` holds each sample's
    ``pixel_values``/``image_grid_thw`` (verl's per-sample dicts). ``group_ids`` is verl's uid."""
    info = LayoutInfo.of(processor, tokens_per_second)
    B, L = input_ids.shape
    R = 0 if responses is None else responses.shape[1]
    if responses is not None and not torch.equal(input_ids[:, L - R :], responses):
        raise SchemaError("input_ids[:, -R:] differ from responses: verl's input_ids are the prompt followed by the response")
    if response_mask is None and R:
        response_mask = attention_mask[:, L - R :]
    prompts, resp, masks, positions = [], [], [], []
    for b in range(B):
        p = unpad(input_ids[b, : L - R], attention_mask[b, : L - R], "attention_mask (prompt part)", b)
        r = unpad(input_ids[b, L - R :], attention_mask[b, L - R :], "attention_mask (response part)", b)
        prompts.append(p)
        resp.append(r)
        if R:
            rm = response_mask[b][attention_mask[b, L - R :].bool()].bool()
            masks.append(torch.cat([torch.zeros(p.numel(), dtype=torch.bool), rm.cpu()]))
        positions.append(unpad_positions(position_ids, b, attention_mask[b], batch_first=True))
    mm = list(multi_modal_inputs or [])
    if mm and len(mm) != B:
        raise SchemaError(f"multi_modal_inputs has {len(mm)} entries; expected one per sample ({B})")

    def _cat(key: str) -> Optional[Tensor]:
        items = [torch.as_tensor(d[key]) for d in mm if d and key in d and d[key] is not None]
        return torch.cat(items) if items else None

    return build(
        prompts, resp, info,
        image_grid_thw=_cat("image_grid_thw"), video_grid_thw=_cat("video_grid_thw"),
        pixel_values=_cat("pixel_values"), pixel_values_videos=_cat("pixel_values_videos"),
        second_per_grid_ts=_cat("second_per_grid_ts"),
        position_ids=positions, loss_masks=masks if R else None,
        group_ids=group_ids, rewards=rewards, media_ids=media_ids,
    )
