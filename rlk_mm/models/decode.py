"""The KV-cache decode of a batch: ``prefill`` (the prompts left-padded into a new cache, the
rollout's first step too) and ``decode_hidden``, the decode twin of ``forward_hidden``: under
``batch_invariant()`` the two give bitwise the same hidden states, which is what makes a
rollout's log-probs the training's.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..schema import RLBatch
from ..schema.batch import batch_arg
from .family import ModelFamily, model_family
from .forward import LanguageInputs, cache_keyword, check_inputs, language_inputs, prompt_lengths
from .vision_cache import VisionCache

__all__ = ["decode_hidden"]


def media_rows(model, family: ModelFamily, batch: RLBatch, vision_cache: Optional[VisionCache]) -> torch.Tensor:
    """Every media item's vision-tower rows, items in batch order (images, then videos):
    ``[R, H]``, or ``[R, 1 + k, H]`` with a DeepStack family's levels."""
    if vision_cache is not None:
        return vision_cache(batch)
    parts = [family.vision_rows(model, pixels, grids)
             for pixels, grids in ((batch.pixel_values, batch.image_grid_thw),
                                   (batch.pixel_values_videos, batch.video_grid_thw))
             if grids is not None and grids.shape[0]]
    levels = [1 + family.deepstack_levels(model)] if family.deepstack else []
    width = model.config.text_config.hidden_size
    return torch.cat(parts) if parts else torch.zeros((0, *levels, width), device=batch.device)


def prefill(lm, batch: RLBatch, lm_inputs: LanguageInputs, prompt: list[int]):
    """The first ``prompt[b]`` tokens of every sample, left-padded, through the language model
    (with its DeepStack features, if any) into a new KV cache. Returns the output
    ``[B, width, H]``, the cache, the attention mask ``[B, width]``, each prompt token's row in
    the padded layout and its packed index."""
    from transformers import DynamicCache

    embeds = lm_inputs.embeds
    device, n, width = embeds.device, batch.num_samples, max(prompt)
    count = torch.tensor(prompt, dtype=torch.int64, device=device)
    sample = torch.repeat_interleave(torch.arange(n, device=device), count)
    offset = torch.arange(int(count.sum()), device=device) - (torch.cumsum(count, 0) - count)[sample]
    src = batch.cu_seqlens.long().to(device)[:-1][sample] + offset
    rows = sample * width + (width - count)[sample] + offset
    padded = embeds.new_zeros((n * width, embeds.shape[-1])).index_put((rows,), embeds[src])
    mask = torch.zeros(n * width, dtype=torch.int64, device=device).index_fill(0, rows, 1)
    positions = torch.ones((3, n * width), dtype=torch.int64, device=device)
    positions[:, rows] = batch.position_ids[:, src]
    cache = DynamicCache()
    out = lm(inputs_embeds=padded.view(n, width, -1), attention_mask=mask.view(n, width),
             position_ids=positions.view(3, n, width), use_cache=True, **{cache_keyword(lm): cache},
             **lm_inputs.deepstack_kwargs(src, rows, (n, width)))
    return out.last_hidden_state, cache, mask.view(n, width), rows, src


def decode_hidden(model, batch: RLBatch, *, media_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every token's final hidden state as a KV-cache decode computes it: the prompts prefilled
    together (left-padded), then the tokens after each prompt fed one step at a time, batched
    over the rows still going (a row leaves the batch and the cache after its last token).

    The decode twin of ``forward_hidden(model, batch)``: under ``batch_invariant()`` the two
    are bitwise equal, which is what makes a rollout's log-probs the training's.

    Parameters
    ----------
    model : a supported Qwen-VL model (``rlk_mm.models.family``)
    batch : RLBatch
        Prompts and responses (the prompt of a sample: ``prompt_lengths``, the tokens before
        its first loss span); every sample needs at least one prompt token.
    media_embeds : Tensor, optional
        Every media item's vision rows (``VisionCache``'s output); default: the vision tower.

    Returns
    -------
    Tensor ``[T, H]``: one row per packed token of ``batch``, as ``forward_hidden``'s.

    Raises
    ------
    ValueError, TypeError
        A bad batch, model or ``media_embeds`` (``check_inputs``), or a sample without prompt.
    """
    family = model_family(model)
    batch_arg("batch", batch)
    device = model.get_input_embeddings().weight.device
    if batch.device != device:
        batch = batch.to(device)
    check_inputs(model, batch, media_embeds)
    prompt = prompt_lengths(batch)
    for b, p in enumerate(prompt):
        if p == 0:
            raise ValueError(f"batch: sample {b} has no prompt tokens (its loss span starts at token 0); a decode "
                             "needs a prompt to prefill")
    lm = model.model.language_model
    if media_embeds is None:
        media_embeds = media_rows(model, family, batch, None)
    lm_inputs = language_inputs(model, batch, media_embeds, family=family)
    embeds = lm_inputs.embeds
    out, cache, mask, rows, src = prefill(lm, batch, lm_inputs, prompt)
    hidden = out.new_empty((batch.num_tokens, out.shape[-1]))
    hidden[src] = out.reshape(-1, out.shape[-1])[rows]
    starts = batch.cu_seqlens.long().tolist()
    tail = [starts[b + 1] - starts[b] - p for b, p in enumerate(prompt)]
    going = list(range(batch.num_samples))
    key = cache_keyword(lm)
    for j in range(max(tail)):
        live = [b for b in going if tail[b] > j]
        if len(live) < len(going):
            keep = torch.tensor([going.index(b) for b in live], device=device)
            cache.batch_select_indices(keep)
            mask = mask[keep]
            going = live
        index = torch.tensor([starts[b] + prompt[b] + j for b in going], device=device)
        mask = torch.cat([mask, mask.new_ones((len(going), 1))], dim=1)
        step = lm(inputs_embeds=embeds[index][:, None], attention_mask=mask,
                  position_ids=batch.position_ids[:, index, None], use_cache=True, **{key: cache},
                  **lm_inputs.deepstack_kwargs(index, torch.arange(len(going), device=device), (len(going), 1)))
        hidden[index] = step.last_hidden_state[:, -1]
    return hidden
