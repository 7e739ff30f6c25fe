"""Builder from verl's tensors: a left-padded prompt followed by a right-padded response.

``fields_from_verl`` returns a batch's fields; ``RLBatch.from_verl`` builds (and validates) it,
after checking every tensor and per-sample dict against the others (shapes, masks, the
response tail, each sample's own media).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._build import LayoutInfo, build
from ._inputs import check_response_unpadded, check_unpadded, check_vocabulary, id_matrix, mask_matrix, padded_positions, unpad
from ._inputs import multi_modal_inputs as per_sample_inputs
from .spans import Modality, SchemaError

__all__: list[str] = []

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
    costs=None,
    media_ids: Optional[Sequence[str]] = None,
    tokens_per_second: Optional[float] = None,
    allow_position_drift: bool = False,
) -> dict:
    """The fields of an RLBatch (``RLBatch.from_verl``) from verl-style tensors.

    ``input_ids``/``attention_mask`` ``[B, L]`` are a left-padded prompt followed by a
    right-padded response of width ``R`` = ``responses.shape[1]`` (``input_ids[:, -R:]``
    equals ``responses``); ``response_mask`` ``[B, R]`` marks scored response tokens (never
    padding); ``position_ids`` ``(B, 4, L)`` (verl's text row + M-RoPE), ``(B, 3, L)`` or
    ``(B, L)`` are recorded as given, and must equal the positions the model computes (see
    ``from_qwen_vl`` for ``allow_position_drift``); ``multi_modal_inputs`` holds each sample's own
    ``pixel_values``/``image_grid_thw`` (verl's per-sample dicts). ``group_ids`` is verl's uid;
    ``rewards`` and ``costs`` are real numbers, one per sample, finite (as ``from_qwen_vl``
    takes them: kept apart, a cost is never added to a reward)."""
    info = LayoutInfo.of(processor, tokens_per_second)
    input_ids = id_matrix("input_ids", input_ids)
    B, L = input_ids.shape
    attention = mask_matrix("attention_mask", attention_mask, (B, L))
    R = 0
    if responses is not None:
        responses = id_matrix("responses", responses)
        R = responses.shape[1]
        if responses.shape[0] != B:
            raise SchemaError(f"responses has {responses.shape[0]} rows; input_ids has {B}")
        if R > L:
            raise SchemaError(f"responses has {R} columns; input_ids has only {L}")
        _check_response_tail(input_ids[:, L - R :], responses)
    if response_mask is not None:
        if responses is None:
            raise SchemaError("response_mask given without responses: pass the [B, R] responses it masks")
        response_mask = mask_matrix("response_mask", response_mask, (B, R))
        _check_mask_inside(response_mask, attention[:, L - R :])
    elif R:
        response_mask = attention[:, L - R :]
    check_vocabulary("input_ids", input_ids, info.vocab_size, real=attention)
    prompts, resp, masks = [], [], []
    for b in range(B):
        p = unpad(input_ids[b, : L - R], attention[b, : L - R], "attention_mask", b)
        check_unpadded(p, b, info.pad_token_id, "input_ids", "", mask_start=int(torch.nonzero(attention[b])[0]))
        real = attention[b, L - R :]
        r = unpad(input_ids[b, L - R :], real, "attention_mask (response part)", b, offset=L - R) if bool(real.any()) else input_ids.new_zeros(0)
        check_response_unpadded("attention_mask (response part)", r, b, info.pad_token_id)
        prompts.append(p)
        resp.append(r)
        if R:
            masks.append(torch.cat([torch.zeros(p.numel(), dtype=torch.bool), response_mask[b][real]]))
    positions = padded_positions(position_ids, attention, (B, L), batch_first=True).per_sample
    mm = per_sample_inputs(multi_modal_inputs, B)

    def _cat(key: str) -> Optional[Tensor]:
        items = [torch.as_tensor(d[key]) for d in mm if d.get(key) is not None]
        return torch.cat(items) if items else None

    held = [{mod: 0 if d.get(f"{mod.label}_grid_thw") is None else len(d[f"{mod.label}_grid_thw"]) for mod in (Modality.IMAGE, Modality.VIDEO)}
            for d in mm]
    return build(
        prompts, resp, info,
        image_grid_thw=_cat("image_grid_thw"), video_grid_thw=_cat("video_grid_thw"),
        pixel_values=_cat("pixel_values"), pixel_values_videos=_cat("pixel_values_videos"),
        second_per_grid_ts=_cat("second_per_grid_ts"),
        position_ids=positions, allow_position_drift=allow_position_drift, loss_masks=masks if R else None,
        group_ids=group_ids, rewards=rewards, costs=costs, media_ids=media_ids,
        media_per_sample=held, media_source="multi_modal_inputs",
    )


def _check_response_tail(tail: Tensor, responses: Tensor) -> None:
    differ = tail != responses
    if bool(differ.any()):
        b, r = (int(i) for i in torch.nonzero(differ)[0])
        raise SchemaError(f"responses: sample {b}, response position {r} is {int(responses[b, r])} but input_ids holds "
                          f"{int(tail[b, r])} there: verl's input_ids are the prompt followed by the response")


def _check_mask_inside(response_mask: Tensor, real: Tensor) -> None:
    outside = response_mask & ~real
    if bool(outside.any()):
        b, r = (int(i) for i in torch.nonzero(outside)[0])
        raise SchemaError(f"response_mask: sample {b}, response position {r} is set but attention_mask is 0 there (padding): "
                          "padding is never scored")
