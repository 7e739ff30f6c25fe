"""The shared forward of every supported family on an RLBatch: layouts, the language model's
inputs (media rows and DeepStack features), the training forward and GRPO group scoring.

- ``layout_inputs`` / ``forward_hidden`` / ``batch_logprobs``: the batch's tokens as a
  transformers Qwen-VL forward takes them (``padding=None``: packed in one row;
  ``"left"``/``"right"``: padded, ``rlk_mm.schema.PaddingSide``), its last hidden states
  back in packed token order, and the loss tokens' log-probs through ``selected_logprob``
  (no logits).
- ``language_inputs``: the language model's input when the vision rows come from elsewhere
  (``VisionCache``, a rollout's prefill): token embeddings with every placeholder replaced
  by its vision row and, for DeepStack families (Qwen3-VL), the features the model adds to
  the visual tokens after its first decoder layers.
- ``group_logprobs``: a GRPO group's shared prompt (images included) prefilled once.

Under ``batch_invariant()`` the cached paths are bitwise equal to the uncached forward: a
vision item's rows and a prompt's keys/values do not depend on what else was in the forward.

Every runner checks the model (``model_family``: supported families only), the batch and its
other arguments against each other before any forward (``check_inputs``: one host sync, for
the token-id range). Non-finite weights or ``media_embeds`` are not checked: they propagate
into the hidden states and log-probs.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..deprecations import renamed_keywords
from ..ops.logprob import selected_logprob
from ..schema.batch import PaddingSide, batch_arg
from ..schema.checks import DeviceChecks, first_true, pad_token_arg, temperature_arg, tensor_arg
from .family import ModelFamily, check_batch_family, model_family
from .vision_cache import VisionCache, check_pixels

__all__ = ["LanguageInputs", "batch_logprobs", "forward_hidden", "group_logprobs", "language_inputs", "layout_inputs"]

def padding_arg(padding, *, where: str) -> Optional[PaddingSide]:
    """The layout a runner was asked for: None (packed: one row ``[1, T]``, no padding) or the
    ``PaddingSide`` of a padded ``[B, L]`` layout. ``where`` names the caller in messages."""
    if padding is None:
        return None
    try:
        return PaddingSide(padding)
    except ValueError:
        raise ValueError(f"{where}: padding={padding!r}: expected None (packed: one row, no padding), 'left' or "
                         "'right'") from None


@renamed_keywords
def layout_inputs(batch, padding: PaddingSide | str | None = None, pad_token_id: int = 0) -> tuple[dict, torch.Tensor]:
    """A Qwen-VL model's token inputs for ``batch`` in one layout, and each token's row.

    ``padding=None``: packed, one row ``[1, T]`` with 4-row position ids (per-sample text
    positions first, which is how transformers recognises packed sequences); ``"right"`` /
    ``"left"``: ``[B, L]`` padded with ``pad_token_id`` and an attention mask. ``rows``
    (int64 [T]) is each packed token's row in the output flattened to ``[-1, H]``.
    """
    batch_arg("batch", batch)
    padding = padding_arg(padding, where="layout_inputs")
    pad_token_id = pad_token_arg("pad_token_id", pad_token_id, batch)
    device = batch.input_ids.device
    lengths = batch.seq_lengths().to(device)
    starts = batch.cu_seqlens.long().to(device)[:-1]
    sample = torch.repeat_interleave(torch.arange(batch.num_samples, device=device), lengths)
    pos = torch.arange(batch.num_tokens, device=device) - starts[sample]
    if padding is None:
        position_ids = torch.cat([pos[None], batch.position_ids], 0)[:, None, :]
        inputs = dict(input_ids=batch.input_ids[None], position_ids=position_ids, attention_mask=None)
        return inputs, torch.arange(batch.num_tokens, device=device)
    width = int(lengths.max()) if batch.num_samples else 0
    shift = (width - lengths)[sample] if padding is PaddingSide.LEFT else 0
    rows = sample * width + pos + shift
    n = batch.num_samples * width
    ids = torch.full((n,), pad_token_id, dtype=torch.int64, device=device)
    ids[rows] = batch.input_ids
    mask = torch.zeros(n, dtype=torch.int64, device=device)
    mask[rows] = 1
    positions = torch.ones((3, n), dtype=torch.int64, device=device)
    positions[:, rows] = batch.position_ids
    shape = (batch.num_samples, width)
    return dict(input_ids=ids.view(shape), attention_mask=mask.view(shape), position_ids=positions.view(3, *shape)), rows


def _media_inputs(batch) -> dict:
    """The vision-tower inputs a transformers Qwen-VL forward takes, from the batch."""
    names = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    return {name: getattr(batch, name) for name in names if getattr(batch, name) is not None}


@renamed_keywords
def forward_hidden(model, batch, *, padding: PaddingSide | str | None = None, media_embeds=None) -> torch.Tensor:
    """Last hidden states ``[T, H]`` (packed token order) of a supported transformers Qwen-VL
    model (``rlk_mm.models.family``).

    ``padding``: the layout the model runs on, None (packed in one row, the default) or
    ``"left"``/``"right"`` (padded ``[B, L]``).

    Without ``media_embeds`` the model's own forward runs the vision tower on the batch's
    pixels. With ``media_embeds`` (a ``VisionCache``'s output: every media item's vision
    rows, items in batch order, concatenated; ``[R, H]``, or ``[R, 1 + k, H]`` with the
    DeepStack levels of a Qwen3-VL model; cast to the embeddings' dtype and device, as the
    model's own forward casts its vision rows) the placeholders are filled from it and only
    the language model runs. A batch on another device than the model is moved to it.
    """
    family = model_family(model)
    padding = padding_arg(padding, where="forward_hidden")
    device = model.get_input_embeddings().weight.device
    if batch_arg("batch", batch).device != device:
        batch = batch.to(device)
    check_inputs(model, batch, media_embeds)
    inputs, rows = layout_inputs(batch, padding, getattr(model.config.text_config, "pad_token_id", None) or 0)
    if media_embeds is None:
        out = model.model(**inputs, **_media_inputs(batch), use_cache=False)
    else:
        lm_inputs = language_inputs(model, batch, media_embeds, family=family)
        shape = inputs["input_ids"].shape
        padded = lm_inputs.embeds.new_zeros((math.prod(shape), lm_inputs.embeds.shape[-1])).index_put((rows,), lm_inputs.embeds)
        out = model.model.language_model(
            inputs_embeds=padded.view(*shape, -1), attention_mask=inputs["attention_mask"],
            position_ids=inputs["position_ids"], use_cache=False,
            **lm_inputs.deepstack_kwargs(torch.arange(batch.num_tokens, device=device), rows, shape))
    hidden = out.last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])[rows]


def _media_source_rows(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, src) int64 [n]: the packed row of every media placeholder token (increasing) and
    the row of ``media_embeds`` (items in batch order, concatenated) that fills it."""
    table = batch.modality_spans
    sample, pos, span = table.token_positions()
    item = table.media_index.long()[span]
    keep = item >= 0
    rows = batch.cu_seqlens.long()[sample[keep]] + pos[keep]
    counts = batch.media_token_counts().to(item.device)
    src = (torch.cumsum(counts, 0) - counts)[item[keep]] + (pos - table.starts.long()[span])[keep]
    return rows, src


@dataclass
class LanguageInputs:
    """The language model's input for a batch: token embeddings ``[T, H]`` (packed) with every
    media placeholder replaced by its vision row, and for a DeepStack family the placeholder
    mask ``visual`` (bool ``[T]``) and the ``k`` feature levels ``deepstack`` (each
    ``[placeholders, H]``, packed order) the model adds after its first ``k`` decoder layers."""

    embeds: torch.Tensor
    visual: Optional[torch.Tensor] = None
    deepstack: tuple = ()

    def deepstack_kwargs(self, packed: torch.Tensor, rows: torch.Tensor, shape: tuple) -> dict:
        """The DeepStack keywords of a language-model call that feeds the packed tokens
        ``packed`` (increasing) at the flat positions ``rows`` (increasing) of a ``shape``
        (``[B, L]``) input: ``visual_pos_masks`` and each level's rows for the placeholders among
        them, in the row-major order the model reads them. Empty without DeepStack."""
        if self.visual is None:
            return {}
        chosen = self.visual[packed]
        mask = torch.zeros(math.prod(shape), dtype=torch.bool, device=rows.device)
        mask[rows[chosen]] = True
        ordinal = torch.cumsum(self.visual.long(), 0)[packed[chosen]] - 1
        return dict(visual_pos_masks=mask.view(shape), deepstack_visual_embeds=[level[ordinal] for level in self.deepstack])


def language_inputs(model, batch, media_embeds: torch.Tensor, *, family: Optional[ModelFamily] = None) -> LanguageInputs:
    """``LanguageInputs`` of ``batch`` for ``model`` from ``media_embeds`` (every media item's
    vision rows, items in batch order: ``[R, H]``, or ``[R, 1 + k, H]`` for a DeepStack family;
    ``check_inputs`` checks them against the batch). The training forward with a
    ``VisionCache``, ``decode_hidden`` and the rollout's prefill all build their input here."""
    family = model_family(model) if family is None else family
    batch_arg("batch", batch)
    embeds = fill_media(model.get_input_embeddings()(batch.input_ids), batch, media_embeds)
    if not family.deepstack:
        return LanguageInputs(embeds)
    rows, src = _media_source_rows(batch)
    visual = torch.zeros(batch.num_tokens, dtype=torch.bool, device=embeds.device)
    visual[rows.to(embeds.device)] = True
    levels = media_embeds[src.to(media_embeds.device), 1:].to(embeds.device, embeds.dtype)
    return LanguageInputs(embeds, visual, tuple(levels.unbind(1)))


def fill_media(embeds: torch.Tensor, batch, media_embeds: torch.Tensor) -> torch.Tensor:
    """Packed token embeddings with every media placeholder replaced by its vision row (for
    ``[R, 1 + k, H]`` DeepStack rows: level 0): the language model's token input for
    ``batch`` (training forward and rollout prefill alike; ``language_inputs`` adds the
    DeepStack features).

    Parameters
    ----------
    embeds : Tensor ``[T, H]``
        The token embeddings of ``batch.input_ids`` (packed, ``T`` tokens).
    batch : RLBatch
        The batch (its media placeholders and items).
    media_embeds : Tensor ``[R, H]`` or ``[R, 1 + k, H]``
        Every media item's vision rows, items in batch order (``VisionCache``'s output);
        ``R`` against the batch is ``check_inputs``' check (it costs a host sync).

    Returns
    -------
    Tensor ``[T, H]``, ``embeds``' dtype and device.

    Raises
    ------
    ValueError
        ``embeds`` is not ``[batch tokens, H]`` or ``media_embeds`` not ``[R, H]`` / ``[R, 1 + k, H]``.
    """
    batch_arg("batch", batch)
    tensor_arg("embeds", embeds, ndim=2)
    tensor_arg("media_embeds", media_embeds)
    if media_embeds.dim() not in (2, 3):
        raise ValueError(f"media_embeds must be [R, H] or [R, 1 + k, H] (DeepStack levels), got {tuple(media_embeds.shape)}")
    if embeds.shape[0] != batch.input_ids.numel():
        raise ValueError(f"embeds has {embeds.shape[0]} rows but the batch has {batch.input_ids.numel()} tokens: pass "
                         "the embeddings of batch.input_ids")
    if media_embeds.shape[-1] != embeds.shape[1]:
        raise ValueError(f"media_embeds rows are {media_embeds.shape[-1]} wide but embeds rows {embeds.shape[1]}: pass the "
                         "vision rows of this model (VisionCache(model)(batch))")
    rows, src = _media_source_rows(batch)
    merged = media_embeds if media_embeds.dim() == 2 else media_embeds[:, 0]
    return embeds.index_put((rows.to(embeds.device),), merged[src.to(merged.device)].to(embeds.device, embeds.dtype))


def check_inputs(model, batch, media_embeds=None) -> None:
    """The batch against the model (its family, placeholder ids and vocabulary), and
    ``media_embeds`` (None: the batch's pixels feed the vision tower) against both, before any
    forward. One host sync: token ids within the model's vocabulary, and ``media_embeds``'
    row count."""
    family = model_family(model)
    batch_arg("batch", batch)
    check_batch_family(family, batch)
    config = model.config
    for name in ("image_token_id", "video_token_id"):
        have, want = getattr(batch, name), getattr(config, name, None)
        if have is not None and want is not None and have != want:
            raise ValueError(f"batch.{name}={have} but the model's {name} is {want}: build the batch with this model's processor")
    checks = DeviceChecks()
    if media_embeds is None:
        check_pixels(batch)
    else:
        width = model.get_input_embeddings().embedding_dim
        media_embeds = tensor_arg("media_embeds", media_embeds)
        if not media_embeds.dtype.is_floating_point:
            raise TypeError(f"media_embeds must be float (the vision tower's output rows), got {media_embeds.dtype}")
        counts = batch.media_token_counts()
        levels = family.deepstack_levels(model)
        want = [int(counts.sum())] + ([1 + levels] if family.deepstack else []) + [width]
        if list(media_embeds.shape[1:]) != want[1:]:
            what = (f"[{want[0]}, 1 + {levels}, {width}] (every media item's vision rows and their {levels} DeepStack levels"
                    if family.deepstack else f"[{want[0]}, {width}] (every media item's vision rows")
            raise ValueError(f"media_embeds must be {what}, items in batch order: what VisionCache(model) returns for "
                             f"{family.label}), got {tuple(media_embeds.shape)}")
        checks.add(counts.sum() != media_embeds.shape[0], lambda: _raise(
            f"media_embeds has {media_embeds.shape[0]} rows; the batch's media items need {int(counts.sum())}"))
    vocab = model.get_input_embeddings().num_embeddings
    outside = (batch.input_ids < 0) | (batch.input_ids >= vocab)
    checks.add(outside.any(), lambda: _raise_token(batch, outside, vocab))
    checks.run()


def _raise(message: str):
    raise ValueError(message)


def _raise_token(batch, outside: torch.Tensor, vocab: int):
    (t,) = first_true(outside)
    b = int(torch.searchsorted(batch.cu_seqlens.long(), torch.tensor(t, device=batch.device), right=True)) - 1
    raise ValueError(f"input_ids: sample {b}, position {t - int(batch.cu_seqlens[b])} holds {int(batch.input_ids[t])}, outside "
                     f"the model's vocabulary of {vocab} tokens: build the batch with this model's processor")


@renamed_keywords
def batch_logprobs(model, batch, *, padding: PaddingSide | str | None = None, media_embeds=None,
                   temperature: float = 1.0) -> torch.Tensor:
    """Selected log-probs ``[n]`` of the batch's loss tokens: ``forward_hidden`` (``padding``:
    None packed, or ``"left"``/``"right"``) then the LM
    head through ``selected_logprob`` (never materialising logits). ``temperature``
    (>= ``rlk_mm.schema.checks.MIN_TEMPERATURE``) divides the logits."""
    temperature_arg(temperature)
    hidden = forward_hidden(model, batch, padding=padding_arg(padding, where="batch_logprobs"), media_embeds=media_embeds)
    head = model.get_output_embeddings()
    return selected_logprob(hidden, head.weight, batch, temperature=temperature, bias=getattr(head, "bias", None))


# --------------------------------------------------------------------------- group scoring
def group_logprobs(model, batch, *, vision_cache: VisionCache | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Selected log-probs ``[n]`` (loss-span order) scoring each GRPO group against one prompt prefill.

    The samples of a group (``batch.group_ids``) must share their prompt: the first
    ``prompt_lengths`` tokens (or, without them, the tokens before the first loss span),
    positions and media. Vision rows come from ``vision_cache`` (each unique item once);
    the prompt's keys/values are computed once per group and the group's responses are
    scored against them as one right-padded batch. Under ``batch_invariant()`` the result
    is bitwise that of ``batch_logprobs`` on the same batch. ``temperature`` (>=
    ``rlk_mm.schema.checks.MIN_TEMPERATURE``) divides the logits.
    """
    temperature_arg(temperature)
    hidden = group_hidden(model, batch, vision_cache=vision_cache)
    targets = batch.loss_token_index()[1].to(hidden.device)
    head = model.get_output_embeddings()
    return selected_logprob(hidden, head.weight, index=torch.arange(targets.numel(), device=hidden.device),
                            targets=targets, temperature=temperature, bias=getattr(head, "bias", None))


def cache_keyword(module) -> str:
    """The keyword a transformers language model takes its KV cache by (``cache`` since
    transformers 5.2x, ``past_key_values`` before: the old name warns where both exist)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def group_hidden(model, batch, *, vision_cache: VisionCache | None = None) -> torch.Tensor:
    """The hidden states ``[n, H]`` that score the batch's loss tokens (loss-span order),
    computed as ``group_logprobs`` does: one prompt prefill per group, responses against its KV.

    Language-model calls, in order: for each group (first-appearance order) the prompt,
    then (when any member has tokens after the prompt) the members' right-padded rest.
    ``vision_cache`` (default: a new one) must be a ``VisionCache`` of ``model``; a batch on
    another device than the model is moved to it."""
    family = model_family(model)
    if vision_cache is None:
        vision_cache = VisionCache(model)
    elif not isinstance(vision_cache, VisionCache):
        raise TypeError(f"vision_cache must be a VisionCache (or None), got {type(vision_cache).__name__}")
    elif vision_cache.model is not model:
        raise ValueError("vision_cache runs another model: give group scoring a VisionCache(model) of the model it scores")
    device = model.get_input_embeddings().weight.device
    if batch_arg("batch", batch).device != device:
        batch = batch.to(device)
    check_inputs(model, batch)
    lm = model.model.language_model
    lm_inputs = language_inputs(model, batch, vision_cache(batch), family=family)
    embeds = lm_inputs.embeds
    dev, width_h = embeds.device, embeds.shape[-1]
    # index arithmetic on the host, once: per-member device syncs would stall a launch-bound forward
    rows, _ = batch.loss_token_index()
    token_sample = batch.loss_token_sample().cpu()
    cu = batch.cu_seqlens.long().cpu()
    offset = rows.cpu() - cu[token_sample]  # position of each scoring hidden state within its sample
    cu = cu.tolist()
    prompt = prompt_lengths(batch)
    group = batch.group_index().cpu()
    pos = batch.position_ids
    hidden = embeds.new_zeros((rows.numel(), width_h))
    for g in range(int(group.max()) + 1 if group.numel() else 0):
        members = torch.nonzero(group == g).flatten().tolist()
        p = _shared_prompt(batch, members, prompt, cu)
        first = cu[members[0]]
        fed = torch.arange(first, first + p, device=dev)
        out = lm(inputs_embeds=embeds[None, first : first + p], position_ids=pos[:, None, first : first + p], use_cache=True,
                 **lm_inputs.deepstack_kwargs(fed, torch.arange(p, device=dev), (1, p)))
        prompt_hidden, kv = out.last_hidden_state[0], getattr(out, cache_keyword(lm))
        lengths = torch.tensor([cu[b + 1] - cu[b] - p for b in members])
        width = int(lengths.max())
        rank = torch.full((batch.num_samples,), -1, dtype=torch.long)
        rank[members] = torch.arange(len(members))
        sel = torch.nonzero(rank[token_sample] >= 0).flatten()
        t = offset[sel]
        in_prompt = t < p
        hidden[sel[in_prompt].to(dev)] = prompt_hidden[t[in_prompt].to(dev)]
        if width and not bool(in_prompt.all()):
            kv.batch_repeat_interleave(len(members))
            live = torch.arange(width)[None, :] < lengths[:, None]  # [G, width]: a member's response tokens
            slot = torch.nonzero(live.flatten()).flatten()
            src = (torch.tensor([cu[b] + p for b in members])[:, None] + torch.arange(width)[None, :])[live]
            resp = embeds.new_zeros((len(members) * width, width_h))
            resp[slot.to(dev)] = embeds[src.to(dev)]
            resp_pos = torch.ones((3, len(members) * width), dtype=pos.dtype, device=dev)
            resp_pos[:, slot.to(dev)] = pos[:, src.to(dev)]
            mask = torch.cat([torch.ones((len(members), p), dtype=torch.int64), live.long()], 1).to(dev)
            resp_hidden = lm(inputs_embeds=resp.view(len(members), width, width_h), attention_mask=mask,
                             position_ids=resp_pos.view(3, len(members), width), use_cache=True,
                             **{cache_keyword(lm): kv},
                             **lm_inputs.deepstack_kwargs(src.to(dev), slot.to(dev), (len(members), width))).last_hidden_state
            later = sel[~in_prompt]
            at = rank[token_sample[later]] * width + t[~in_prompt] - p
            hidden[later.to(dev)] = resp_hidden.reshape(-1, width_h)[at.to(dev)]
    return hidden


def prompt_lengths(batch) -> list[int]:
    """Per sample: ``prompt_lengths`` when the batch has them, else the tokens before the first loss span."""
    if batch.prompt_lengths is not None:
        return [int(x) for x in batch.prompt_lengths.tolist()]
    lengths = batch.seq_lengths().tolist()
    starts = batch.loss_spans.starts.long().tolist()
    ptr = batch.loss_spans.sample_ptr.long().tolist()
    return [starts[ptr[b]] if ptr[b + 1] > ptr[b] else lengths[b] for b in range(batch.num_samples)]


def _shared_prompt(batch, members: list[int], prompt: list[int], cu: list[int]) -> int:
    """The group's common prompt length, after checking tokens, positions and media agree."""
    b0 = members[0]
    p = prompt[b0]
    ids, pos = batch.input_ids, batch.position_ids
    media = [] if batch.media_sample is None else batch.media_sample.tolist()
    keys0 = [batch.media_cache_keys[i] for i, s in enumerate(media) if s == b0]
    for b in members[1:]:
        what = None
        if prompt[b] != p:
            what = f"prompt length {prompt[b]} != {p}"
        elif not torch.equal(ids[cu[b] : cu[b] + p], ids[cu[b0] : cu[b0] + p]):
            what = "prompt tokens differ"
        elif not torch.equal(pos[:, cu[b] : cu[b] + p], pos[:, cu[b0] : cu[b0] + p]):
            what = "prompt positions differ"
        elif [batch.media_cache_keys[i] for i, s in enumerate(media) if s == b] != keys0:
            what = "media_cache_keys differ"
        if what:
            gid = batch.group_ids[b] if batch.group_ids else str(b)
            raise ValueError(f"group_logprobs: group {gid!r}: sample {b} does not share sample {b0}'s prompt ({what})")
    return p

