"""Builders from Qwen2-VL / Qwen2.5-VL pipelines: a processor output, or a rollout engine's token lists.

``fields_from_qwen_vl`` and ``fields_from_token_lists`` return a batch's fields;
``RLBatch.from_qwen_vl`` / ``RLBatch.from_token_lists`` build (and validate) the batch.
Every argument is checked before any work (``_inputs``); an error names the argument, the
sample and the position.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._build import LayoutInfo, build
from ._inputs import (
    check_response_unpadded,
    check_unpadded,
    check_vocabulary,
    id_matrix,
    mask_matrix,
    padded_positions,
    processor_outputs,
    token_rows,
    unpad,
)
from .checks import INTEGER_DTYPES, bool_arg, tensor_arg
from .spans import SchemaError, spans_from_mask
from .turns import ChatMarkers, assistant_turn_mask

__all__: list[str] = []

Tensor = torch.Tensor


def fields_from_qwen_vl(
    processor_output,
    *,
    processor,
    responses=None,
    response_mask: Optional[Tensor] = None,
    assistant_mask: Optional[Tensor] = None,
    assistant_turns: bool = False,
    position_ids: Optional[Tensor] = None,
    allow_position_drift: bool = False,
    group_ids=None,
    rewards=None,
    costs=None,
    media_ids: Optional[Sequence[str]] = None,
    tokens_per_second: Optional[float] = None,
    bbox_targets=None,
    point_targets=None,
    screen_size=None,
    coordinate_system=None,
) -> dict:
    """The fields of an RLBatch (``RLBatch.from_qwen_vl``) from a Qwen2-VL / Qwen2.5-VL processor output.

    - Padding (left or right) is stripped with ``attention_mask``. Without one, a row that
      starts or ends with the pad token is refused (it is padded, and where is ambiguous);
      so is a mask that marks a pad token at either end of a row as real.
    - ``responses``: per-sample token sequences appended to the prompts (a list of lists of
      int ids, or a ``[B, R]`` int tensor with ``response_mask``); they become the loss
      spans, EOS included, padding excluded.
    - ``assistant_mask`` (``[B, L]`` like ``input_ids``): multi-turn; the tokens it marks
      are scored too (with ``responses`` the appended responses as well), and
      ``prompt_lengths`` then end at the first scored token.
    - ``assistant_turns=True``: multi-turn without a mask; every assistant turn of the
      chat is scored as a response is, its content tokens and its ``<|im_end|>``
      (``schema.turns``), and the appended ``responses`` as well. Not with ``assistant_mask``.
    - ``position_ids``: the positions a framework actually used, to record instead of
      computing them: ``(3, B, L)`` as transformers' ``get_rope_index`` returns, or
      ``(B, L)``. They must equal the positions the model computes; positions a rollout
      really used that differ (e.g. it fell back to 1-D positions) are recorded with
      ``allow_position_drift=True``, so that ``check_layout_parity`` reports the drift.
    - ``group_ids`` (str or int, one per sample: samples of one prompt share one),
      ``rewards``/``costs`` (finite numbers, one per sample), ``media_ids`` (str, one per
      media item, images first).
    - Grounding targets: ``bbox_targets`` / ``point_targets``, one entry
      per sample (a list of ``(x0, y0, x1, y1)`` boxes / ``(x, y)`` points, a ``[k, 4]`` /
      ``[k, 2]`` tensor, or None), in ``coordinate_system`` (``CoordinateSystem`` or its name:
      needed with targets); ``screen_size``, one ``(width, height)`` per sample (the
      original image's pixels, which ``absolute`` coordinates refer to).
    """
    info = LayoutInfo.of(processor, tokens_per_second)
    processor_output = processor_outputs(processor_output)
    input_ids = id_matrix("input_ids", processor_output["input_ids"])
    B, L = input_ids.shape
    attention = processor_output.get("attention_mask")
    attention = None if attention is None else mask_matrix("attention_mask", attention, (B, L))
    check_vocabulary("input_ids", input_ids, info.vocab_size, real=attention)
    prompts = []
    for b in range(B):
        if attention is None:
            prompt = input_ids[b]
            check_unpadded(prompt, b, info.pad_token_id, "input_ids",
                           " but no attention_mask was given: pass the processor's attention_mask so that the padding is stripped")
        else:
            prompt = unpad(input_ids[b], attention[b], "attention_mask", b)
            check_unpadded(prompt, b, info.pad_token_id, "input_ids", "", mask_start=int(torch.nonzero(attention[b])[0]))
        prompts.append(prompt)
    resp = _responses(responses, response_mask, B, info)
    mm_types = processor_output.get("mm_token_type_ids")
    if mm_types is not None:
        _check_mm_types(tensor_arg("mm_token_type_ids", mm_types, shape=(B, L), error=SchemaError), attention, prompts, info)
    loss_masks = None
    if bool_arg("assistant_turns", assistant_turns):
        if assistant_mask is not None:
            raise SchemaError("assistant_mask and assistant_turns=True both say what to score: give one of them")
        loss_masks = turn_loss_masks("input_ids", prompts, resp, processor, info)
    elif assistant_mask is not None:
        marks = mask_matrix("assistant_mask", assistant_mask, (B, L))
        loss_masks = [_assistant_loss_mask(marks, attention, prompts, resp, b, info) for b in range(B)]
    positions = None
    if position_ids is not None:
        positions = padded_positions(position_ids, attention, (B, L), batch_first=False)
        if B == 3 and positions.layout == (3, B, L):
            _check_not_transposed(positions.per_sample, prompts, info)
        positions = [_extend_positions(p, resp[b]) for b, p in enumerate(positions.per_sample)]
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
        allow_position_drift=allow_position_drift,
        loss_masks=loss_masks,
        group_ids=group_ids,
        rewards=rewards,
        costs=costs,
        media_ids=media_ids,
        bbox_targets=bbox_targets,
        point_targets=point_targets,
        screen_size=screen_size,
        coordinate_system=coordinate_system,
    )


def _start(mask: Optional[Tensor], b: int) -> int:
    """Where sample ``b``'s real tokens start in its padded row."""
    return 0 if mask is None else int(torch.nonzero(mask[b])[0])


def _assistant_loss_mask(marks: Tensor, attention: Optional[Tensor], prompts, resp, b: int, info: LayoutInfo) -> Tensor:
    """The prompt tokens ``assistant_mask`` marks, then every appended response token."""
    start = _start(attention, b)
    m = marks[b, start : start + prompts[b].numel()]
    media = m & ((prompts[b] == info.image_token_id) | (prompts[b] == info.video_token_id))
    if bool(media.any()):
        p = int(torch.nonzero(media)[0])
        raise SchemaError(f"assistant_mask: sample {b} marks position {p}, a media placeholder: only text tokens are scored")
    if bool(m[0]):
        raise SchemaError(f"assistant_mask: sample {b} marks position 0: target t is scored from position t-1, so the first "
                          "token cannot be scored")
    r = resp[b]
    return torch.cat([m, torch.ones(0 if r is None else r.numel(), dtype=torch.bool)])


def turn_loss_masks(name: str, prompts: Sequence[Tensor], resp: Sequence[Optional[Tensor]], processor, info: LayoutInfo) -> list[Tensor]:
    """Per sample: the tokens of the prompt's assistant turns (``schema.turns``), then every
    appended response token; a turn holding a media placeholder is refused."""
    markers = ChatMarkers.of(processor)
    masks = []
    for b, (prompt, r) in enumerate(zip(prompts, resp)):
        m = assistant_turn_mask(prompt, markers, name=name, sample=b)
        media = m & ((prompt == info.image_token_id) | (prompt == info.video_token_id))
        if bool(media.any()):
            raise SchemaError(f"{name}: sample {b}, position {int(torch.nonzero(media)[0])} is a media placeholder inside an "
                              "assistant turn: only text is scored; mark the scored tokens with a mask instead")
        masks.append(torch.cat([m, torch.ones(0 if r is None else r.numel(), dtype=torch.bool)]))
    return masks


def _check_not_transposed(positions: list[Tensor], prompts: list[Tensor], info: LayoutInfo) -> None:
    """With 3 samples, (3, B, L) and (B, 3, L) have one shape: read as the documented
    (3, B, L), text tokens must have equal t, h and w, as in every real position layout, and
    media tokens must not all have them equal (M-RoPE gives a media item of several tokens
    several h or w values; a transposed group of identical samples gives t = h = w)."""
    for b, (pos, prompt) in enumerate(zip(positions, prompts)):
        text = (prompt != info.image_token_id) & (prompt != info.video_token_id)
        unequal = text & ((pos[0] != pos[1]) | (pos[1] != pos[2]))
        if bool(unequal.any()):
            p = int(torch.nonzero(unequal)[0])
            raise SchemaError(
                f"position_ids: shape (3, 3, L) with 3 samples is read as (3, B, L), but then sample {b}, position {p} (a text "
                f"token) has (t, h, w) = {tuple(pos[:, p].tolist())}, not all equal: if you passed (B, 3, L), pass "
                "position_ids.transpose(0, 1)"
            )
    for b, (pos, prompt) in enumerate(zip(positions, prompts)):
        media = (prompt == info.image_token_id) | (prompt == info.video_token_id)
        flat = (pos[0] == pos[1]) & (pos[1] == pos[2])
        several = any(run.end - run.start > 1 for run in spans_from_mask(media))  # an item of more than one token
        if several and bool(flat[media].all()):
            raise SchemaError(
                f"position_ids: shape (3, 3, L) with 3 samples is read as (3, B, L), but then sample {b}'s "
                f"{int(media.sum())} media tokens all have t = h = w, which M-RoPE never gives: if you passed (B, 3, L), "
                "pass position_ids.transpose(0, 1); 1-D positions go as a (B, L) tensor"
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
        if response_mask is not None:
            raise SchemaError("response_mask given without responses: pass the padded [B, R] responses it masks")
        return [None] * B
    if isinstance(responses, Tensor):
        if responses.dtype not in INTEGER_DTYPES:
            raise TypeError(f"responses must be int (a [B, R] tensor of token ids), got {responses.dtype}")
        tensor_arg("responses", responses, shape=(B, None), error=SchemaError)
        if response_mask is None:
            raise SchemaError(
                "responses given as a padded [B, R] tensor need response_mask (1 for generated tokens, EOS included), "
                "since padding and EOS can share an id"
            )
        mask = mask_matrix("response_mask", response_mask, tuple(responses.shape))
        rows = []
        for b in range(B):
            row = unpad(responses[b].long().cpu(), mask[b], "response_mask", b) if bool(mask[b].any()) else responses.new_zeros(0).long().cpu()
            check_vocabulary("responses", row, info.vocab_size, sample=b)
            check_response_unpadded("responses", row, b, info.pad_token_id)
            rows.append(row)
        return rows
    if response_mask is not None:
        raise SchemaError("response_mask is for a padded [B, R] responses tensor; responses given as lists hold only "
                          "generated tokens: drop response_mask")
    if isinstance(responses, (str, bytes)) or not hasattr(responses, "__len__"):
        raise TypeError(f"responses must be a list of token-id sequences or a [B, R] tensor, got {type(responses).__name__}")
    if len(responses) != B:
        raise SchemaError(f"responses has {len(responses)} entries; expected one per sample ({B})")
    rows = token_rows("responses", responses, info.vocab_size)
    for b, row in enumerate(rows):
        check_response_unpadded("responses", row, b, info.pad_token_id)
    return rows


def _check_mm_types(mm_types: Tensor, attention: Optional[Tensor], prompts: Sequence[Tensor], info: LayoutInfo) -> None:
    """Image tokens 1, text 0, video tokens 2 (transformers 5) or, in the whole batch, all 0
    (transformers 4.5x processors mark only image tokens)."""
    rows = [mm_types[b, _start(attention, b) :][: ids.numel()].long().cpu() for b, ids in enumerate(prompts)]
    video_marked = any(bool((types[ids == info.video_token_id] == 2).any()) for ids, types in zip(prompts, rows))
    video_type = 2 if video_marked else 0
    for b, (ids, types) in enumerate(zip(prompts, rows)):
        expected = torch.zeros_like(ids)
        expected[ids == info.image_token_id] = 1
        expected[ids == info.video_token_id] = video_type
        bad = torch.nonzero(types != expected).flatten()
        if bad.numel():
            p = int(bad[0])
            hint = (": video tokens are all 2 (transformers 5) or all 0 (4.5x marks only image tokens), never a mix"
                    if int(ids[p]) == info.video_token_id else "")
            raise SchemaError(
                f"mm_token_type_ids: sample {b}, position {p} says {int(types[p])} but token {int(ids[p])} implies "
                f"{int(expected[p])}{hint}"
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
    allow_position_drift: bool = False,
    group_ids=None,
    rewards=None,
    costs=None,
    media_ids: Optional[Sequence[str]] = None,
    media_cache_keys: Optional[Sequence[str]] = None,
    tokens_per_second: Optional[float] = None,
    assistant_turns: bool = False,
    bbox_targets=None,
    point_targets=None,
    screen_size=None,
    coordinate_system=None,
) -> dict:
    """The fields of an RLBatch (``RLBatch.from_token_lists``) from raw token lists as a rollout
    engine returns them: unpadded prompt ids (placeholders expanded; at least one token each)
    and generated ids (lists of int ids or 1-D int tensors). ``position_ids``: optional
    per-sample (3, L) int positions the engine used (checked against the model's; see
    ``from_qwen_vl`` for ``allow_position_drift``). ``media_cache_keys``: keys to use instead
    of hashing the pixels (one per media item; equal keys must name equal content).
    ``assistant_turns=True``: the assistant turns inside the prompts are scored too, as
    ``from_qwen_vl`` scores them.
    ``bbox_targets``, ``point_targets``, ``screen_size``, ``coordinate_system``: the
    grounding targets, as ``from_qwen_vl`` takes them."""
    info = LayoutInfo.of(processor, tokens_per_second)
    prompts = token_rows("prompt_token_ids", prompt_token_ids, info.vocab_size)
    for b, prompt in enumerate(prompts):
        if not prompt.numel():
            raise SchemaError(f"prompt_token_ids: sample {b} is empty; a prompt has at least one token")
        check_unpadded(prompt, b, info.pad_token_id, "prompt_token_ids", ": prompts are unpadded token lists (strip the padding)")
    B = len(prompts)
    resp = [None] * B
    if response_token_ids is not None:
        resp = token_rows("response_token_ids", response_token_ids, info.vocab_size)
        if len(resp) != B:
            raise SchemaError(f"response_token_ids has {len(resp)} entries; prompt_token_ids has {B}")
        for b, row in enumerate(resp):
            check_response_unpadded("response_token_ids", row, b, info.pad_token_id)
    loss_masks = turn_loss_masks("prompt_token_ids", prompts, resp, processor, info) if bool_arg("assistant_turns", assistant_turns) else None
    return build(
        prompts, resp, info, loss_masks=loss_masks,
        image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
        pixel_values=pixel_values, pixel_values_videos=pixel_values_videos,
        second_per_grid_ts=second_per_grid_ts, position_ids=position_ids, allow_position_drift=allow_position_drift,
        group_ids=group_ids, rewards=rewards, costs=costs,
        media_ids=media_ids, media_cache_keys=media_cache_keys,
        bbox_targets=bbox_targets, point_targets=point_targets, screen_size=screen_size, coordinate_system=coordinate_system,
    )
