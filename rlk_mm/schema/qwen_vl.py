"""Builders from Qwen2-VL / Qwen2.5-VL pipelines: a processor output, or a rollout engine's token lists.

``fields_from_qwen_vl`` and ``fields_from_token_lists`` return a batch's fields;
``RLBatch.from_qwen_vl`` / ``RLBatch.from_token_lists`` build (and validate) the batch.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._build import LayoutInfo, build, unpad, unpad_positions
from .spans import SchemaError

Tensor = torch.Tensor


def fields_from_qwen_vl(
    processor_output,
    *,
    processor,
    responses=None,
    response_mask: Optional[Tensor] = None,
    assistant_mask: Optional[Tensor] = None,
    position_ids: Optional[Tensor] = None,
    group_ids=None,
    rewards=None,
    costs=None,
    media_ids: Optional[Sequence[str]] = None,
    tokens_per_second: Optional[float] = None,
) -> dict:
    """The fields of an RLBatch (``RLBatch.from_qwen_vl``) from a Qwen2-VL / Qwen2.5-VL processor output.

    - Padding (left or right) is stripped with ``attention_mask``.
    - ``responses``: per-sample token sequences appended to the prompts (a list of 1-D
      sequences, or a ``[B, R]`` tensor with ``response_mask``); they become the loss
      spans, EOS included, padding excluded.
    - ``assistant_mask`` (``[B, L]`` like ``input_ids``): multi-turn; only the tokens it
      marks are scored (the appended responses are scored too).
    - ``position_ids``: the positions a framework actually used, to record instead of
      computing them (e.g. a rollout that fell back to 1-D positions): ``(3, B, L)`` as
      transformers' ``get_rope_index`` returns, or ``(B, L)``.
    """
    info = LayoutInfo.of(processor, tokens_per_second)
    input_ids = torch.as_tensor(processor_output["input_ids"])
    if input_ids.ndim != 2:
        raise SchemaError(f"input_ids has shape {tuple(input_ids.shape)}; expected (batch, length) as the processor returns")
    attention = processor_output.get("attention_mask")
    attention = torch.ones_like(input_ids) if attention is None else torch.as_tensor(attention)
    B = input_ids.shape[0]
    prompts = [unpad(input_ids[b], attention[b], "attention_mask", b) for b in range(B)]
    resp = _responses(responses, response_mask, B, info)
    mm_types = processor_output.get("mm_token_type_ids")
    if mm_types is not None:
        _check_mm_types(torch.as_tensor(mm_types), attention, prompts, info)
    loss_masks = None
    if assistant_mask is not None:
        loss_masks = []
        for b in range(B):
            m = unpad(torch.as_tensor(assistant_mask)[b], attention[b], "attention_mask", b).bool()
            r = resp[b]
            loss_masks.append(torch.cat([m, torch.ones(0 if r is None else r.numel(), dtype=torch.bool)]))
    positions = None
    if position_ids is not None:
        positions = [unpad_positions(torch.as_tensor(position_ids), b, attention[b], batch_first=False) for b in range(B)]
        positions = [_extend_positions(p, resp[b]) for b, p in enumerate(positions)]
    return build(
        prompts,
        resp,
        info,
        image_grid_thw=processor_output.get("image_grid_thw"),
        video_grid_thw=processor_output.get("video_grid_thw"),
        pixel_values=processor_output.get("pixel_values"),
        pixel_values_videos=processor_output.get("pixel_values_videos"),
        second_per_grid_ts=processor_output.get("second_per_grid_ts"),
        position_ids=positions,
        loss_masks=loss_masks,
        group_ids=group_ids,
        rewards=rewards,
        costs=costs,
        media_ids=media_ids,
    )


def _extend_positions(pos: Tensor, response: Optional[Tensor]) -> Tensor:
    """Text positions for an appended response, continuing from the prompt's last + 1."""
    if response is None or response.numel() == 0:
        return pos
    start = int(pos.max()) + 1 if pos.numel() else 0
    tail = (torch.arange(response.numel()) + start).unsqueeze(0).expand(3, -1)
    return torch.cat([pos.long(), tail], dim=1)


def _responses(responses, response_mask, B: int, info: LayoutInfo) -> list[Optional[Tensor]]:
    if responses is None:
        return [None] * B
    if isinstance(responses, Tensor):
        if responses.ndim != 2 or responses.shape[0] != B:
            raise SchemaError(f"responses has shape {tuple(responses.shape)}; expected ({B}, R)")
        if response_mask is None:
            raise SchemaError(
                "responses given as a padded [B, R] tensor need response_mask (1 for generated tokens, EOS included), "
                "since padding and EOS can share an id"
            )
        return [unpad(responses[b], response_mask[b], "response_mask", b) for b in range(B)]
    if len(responses) != B:
        raise SchemaError(f"responses has {len(responses)} entries; expected one per sample ({B})")
    return [torch.as_tensor(r, dtype=torch.int64).flatten() for r in responses]


def _check_mm_types(mm_types: Tensor, attention: Tensor, prompts: Sequence[Tensor], info: LayoutInfo) -> None:
    for b, ids in enumerate(prompts):
        types = mm_types[b][attention[b].bool()]
        expected = torch.zeros_like(ids)
        expected[ids == info.image_token_id] = 1
        expected[ids == info.video_token_id] = 2
        bad = torch.nonzero(types.long().cpu() != expected.cpu()).flatten()
        if bad.numel():
            p = int(bad[0])
            raise SchemaError(
                f"mm_token_type_ids: sample {b}, position {p} says {int(types[p])} but token {int(ids[p])} implies {int(expected[p])}"
            )


def fields_from_token_lists(
    prompt_token_ids: Sequence[Sequence[int]],
    response_token_ids: Optional[Sequence[Sequence[int]]] = None,
    *,
    processor,
    image_grid_thw: Optional[Tensor] = None,
    video_grid_thw: Optional[Tensor] = None,
    pixel_values: Optional[Tensor] = None,
    pixel_values_videos: Optional[Tensor] = None,
    second_per_grid_ts: Optional[Tensor] = None,
    position_ids: Optional[Sequence[Tensor]] = None,
    group_ids=None,
    rewards=None,
    costs=None,
    media_ids: Optional[Sequence[str]] = None,
    media_cache_keys: Optional[Sequence[str]] = None,
    tokens_per_second: Optional[float] = None,
) -> dict:
    """The fields of an RLBatch (``RLBatch.from_token_lists``) from raw token lists as a rollout
    engine returns them (prompt ids with placeholders already expanded, and generated ids). ``position_ids``: optional
    per-sample (3, L) positions the engine used."""
    info = LayoutInfo.of(processor, tokens_per_second)
    prompts = [torch.as_tensor(list(p), dtype=torch.int64) for p in prompt_token_ids]
    B = len(prompts)
    if response_token_ids is not None and len(response_token_ids) != B:
        raise SchemaError(f"response_token_ids has {len(response_token_ids)} entries; prompt_token_ids has {B}")
    resp = [None] * B if response_token_ids is None else [torch.as_tensor(list(r), dtype=torch.int64) for r in response_token_ids]
    return build(
        prompts, resp, info,
        image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
        pixel_values=pixel_values, pixel_values_videos=pixel_values_videos,
        second_per_grid_ts=second_per_grid_ts, position_ids=position_ids,
        group_ids=group_ids, rewards=rewards, costs=costs,
        media_ids=media_ids, media_cache_keys=media_cache_keys,
    )
