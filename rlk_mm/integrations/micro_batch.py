"""A verl-style padded micro-batch (a left-padded prompt followed by a right-padded response, as
EasyR1's ``update_policy`` holds it) checked as the builders (``RLBatch.from_verl``) check their
tensors, before the model sees it: shapes and dtypes, 0/1 masks, one run of real tokens per row,
the response tail, scored positions inside the attention mask, token ids in the vocabulary, the
media placeholders against ``multi_modal_inputs``' grids, and the caller's positions against the
M-RoPE positions the model computes (``mrope_positions``). Errors name the micro-batch key, the
sample and the position, and say what to change.

The values are read on the host once: the integer tensors travel to the CPU in one copy (one host
sync), where the schema's checks run on them. EasyR1's ``micro_batch_loss`` runs these checks.

Helpers, not API: ``__all__`` is empty.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from ..schema import Modality, SchemaError, mrope_positions
from ..schema._inputs import check_positions, check_vocabulary, id_matrix, mask_matrix, multi_modal_inputs, padded_positions, unpad
from ..schema.checks import INTEGER_DTYPES, tensor_arg

__all__: list[str] = []

Tensor = torch.Tensor


class MediaTokens:
    """What the model's config says about its media tokens: the placeholder ids, the merge size
    of its vision tower and its video tokens per second (None where the model has no such tokens)."""

    def __init__(self, model) -> None:
        config = getattr(model, "config", None)
        vision = getattr(config, "vision_config", None)
        self.image_token_id: Optional[int] = getattr(config, "image_token_id", None)
        self.video_token_id: Optional[int] = getattr(config, "video_token_id", None)
        self.merge_size: int = int(getattr(vision, "spatial_merge_size", 2) or 2)
        self.tokens_per_second: Optional[float] = getattr(vision, "tokens_per_second", None)
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.vocab_size: Optional[int] = getattr(embeddings, "num_embeddings", None)


def key(name: str) -> str:
    return f"micro_batch['{name}']"


def check_padded_micro_batch(micro_batch: Mapping, model_tokens: MediaTokens) -> None:
    """Checks ``micro_batch`` (``input_ids``, ``attention_mask``, ``position_ids`` ``(B, L)``,
    ``(B, 3, L)`` or ``(B, 4, L)``, ``responses``, ``response_mask``, optional
    ``multi_modal_inputs``) as ``RLBatch.from_verl`` checks its arguments; ``model_tokens``: the
    model's media tokens. One host sync."""
    ids, attention, positions, responses, response_mask = (
        micro_batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask"))
    B, L = tensor_arg(key("input_ids"), ids, ndim=2, dtypes=INTEGER_DTYPES).shape
    device = ids.device
    tensor_arg(key("attention_mask"), attention, shape=(B, L), dtypes=(torch.bool, *INTEGER_DTYPES), device=device)
    R = tensor_arg(key("responses"), responses, ndim=2, dtypes=INTEGER_DTYPES, device=device).shape[1]
    if responses.shape[0] != B:
        raise ValueError(f"{key('responses')} has {responses.shape[0]} rows; {key('input_ids')} has {B}")
    if R > L:
        raise ValueError(f"{key('responses')} has {R} columns but {key('input_ids')} only {L}: input_ids holds the "
                         "prompt followed by the response, so R <= L")
    tensor_arg(key("response_mask"), response_mask, shape=(B, R), device=device)
    tensor_arg(key("position_ids"), positions, dtypes=INTEGER_DTYPES, device=device)
    integral = response_mask.dtype in INTEGER_DTYPES
    # a float mask (weights) is checked by the loss; here only where it is set matters
    scored = response_mask if integral or response_mask.dtype == torch.bool else response_mask != 0
    # the one host read: every integer tensor in one copy
    parts = [ids, attention, responses, scored, positions]
    flat = torch.cat([p.reshape(-1).to(torch.int64) for p in parts]).cpu()
    ids, attention, responses, scored, positions = (
        t.reshape(p.shape) for t, p in zip(flat.split([p.numel() for p in parts]), parts))

    ids = id_matrix(key("input_ids"), ids)
    real = mask_matrix(key("attention_mask"), attention, (B, L))
    scored = mask_matrix(key("response_mask"), scored, (B, R)) if integral else scored.bool()
    tail = ids[:, L - R:]
    differ = torch.nonzero(tail != responses)
    if differ.numel():
        b, r = (int(i) for i in differ[0])
        raise ValueError(f"{key('responses')}: sample {b}, response position {r} is {int(responses[b, r])} but "
                         f"{key('input_ids')} holds {int(tail[b, r])} there (position {L - R + r}): input_ids is the "
                         "prompt followed by the response, whose last R tokens are the responses")
    outside = torch.nonzero(scored & ~real[:, L - R:])
    if outside.numel():
        b, r = (int(i) for i in outside[0])
        raise ValueError(f"{key('response_mask')}: sample {b}, response position {r} is set but "
                         f"{key('attention_mask')} is 0 there (position {L - R + r}, padding): padding is never scored; set response_mask to 0 "
                         "there")
    if model_tokens.vocab_size is not None:
        check_vocabulary(key("input_ids"), ids, model_tokens.vocab_size, real=real)
    try:
        read = padded_positions(positions, real, (B, L), batch_first=True)
    except SchemaError as error:
        raise SchemaError(f"{key('position_ids')}: {error}") from None
    media = multi_modal_inputs(micro_batch.get("multi_modal_inputs"), B)
    hint = (" (1-D positions (B, L) are for text-only rows: a row with media needs the M-RoPE positions, (B, 4, L) "
            "as EasyR1 stores them)" if positions.ndim == 2 else "")
    for b in range(B):
        row = unpad(ids[b], real[b], key("attention_mask"), b)
        start = int(torch.nonzero(real[b])[0])
        spans = _media_spans(row, b, media[b], model_tokens)
        expected = mrope_positions(row, spans, model_tokens.merge_size, model_tokens.tokens_per_second)
        check_positions(key("position_ids"), read.per_sample[b], expected, b, row, start=start, hint=hint)
        if positions.ndim == 3 and positions.shape[1] == 4:  # verl's text row: 0, 1, ... over the real tokens
            text = positions[b, 0][real[b]]
            wrong = torch.nonzero(text != torch.arange(text.numel()))
            if wrong.numel():
                t = int(wrong[0])
                raise ValueError(f"{key('position_ids')}: sample {b}, position {start + t}: the text row (row 0 of "
                                 f"(B, 4, L)) holds {int(text[t])}, expected {t} (the real tokens counted from 0)")


def _media_spans(row: Tensor, b: int, item: dict, tokens: MediaTokens) -> list:
    """(start, modality, grid_thw, second_per_grid) of each placeholder run of sample ``b``'s
    tokens ``row``, paired in order with its ``multi_modal_inputs`` grids; the counts must agree."""
    spans = []
    for modality, token, grid_key in ((Modality.IMAGE, tokens.image_token_id, "image_grid_thw"),
                                      (Modality.VIDEO, tokens.video_token_id, "video_grid_thw")):
        runs = _runs(row, token) if token is not None else []
        grids = item.get(grid_key)
        grids = [] if grids is None else torch.as_tensor(grids).reshape(-1, 3).tolist()
        seconds = item.get("second_per_grid_ts") if modality is Modality.VIDEO else None
        seconds = [None] * len(grids) if seconds is None else torch.as_tensor(seconds).reshape(-1).tolist()
        label = modality.label
        if len(runs) != len(grids):
            where = f"{key('multi_modal_inputs')}[{b}]['{grid_key}']"
            raise ValueError(
                f"sample {b}: {key('input_ids')} holds {len(runs)} {label} placeholder run(s) but {where} has "
                f"{len(grids)} grid(s): pass each sample's own multi_modal_inputs (pixel values and grids of its "
                f"{label}s), or a prompt without {label} placeholders")
        for k, ((start, n), grid, second) in enumerate(zip(runs, grids, seconds)):
            want = grid[0] * grid[1] * grid[2] // tokens.merge_size**2
            if n != want:
                raise ValueError(
                    f"sample {b}: {label} {k} has {n} placeholder tokens in {key('input_ids')} (from position {start} "
                    f"of its real tokens) but its grid {tuple(grid)} in {key('multi_modal_inputs')}[{b}] gives {want}")
            spans.append((start, modality, torch.tensor(grid), second))
    return sorted(spans, key=lambda s: s[0])


def _runs(row: Tensor, token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of ``token`` in ``row``."""
    hit = (row == token).to(torch.int8)
    if not bool(hit.any()):
        return []
    edges = torch.diff(torch.cat([hit.new_zeros(1), hit, hit.new_zeros(1)]))
    starts, ends = torch.nonzero(edges == 1).flatten(), torch.nonzero(edges == -1).flatten()
    return [(int(s), int(e - s)) for s, e in zip(starts, ends)]
