"""Unsupported modalities: which modalities rlk_mm's operators support, the one check the
ops make, and the fallback for a batch that holds others.

An ``RLBatch`` may hold audio items (``Modality.AUDIO``): such a batch builds, saves,
loads, selects and packs like any other. No model runner handles them: scoring or
training on audio needs the design of ``docs/rfc/continuous_latent_rl.md``. So every
function whose result depends on what the model sees at a media span (the model runners,
``VisionCache``, the parity checks, ``draw_layout``) refuses such a batch through
``batch_arg`` -> ``require_supported``, with ``UnsupportedModalityError`` naming the item,
the RFC and the fallback, ``mask_unsupported_media`` (the text scored, the media span
masked). Ops that read the token layout alone (``selected_logprob``,
``linear_policy_loss``, ``scatter_rewards``, ``pack``/``unpack``) accept it: loss spans are
text, so their result is the fallback batch's. Chat prompts with an audio part
(``require_supported_messages``: the smoke test's prompts) and processor outputs with
audio features (``require_no_audio_inputs``: the builders) are refused the same way.
"""

from __future__ import annotations

import torch

from .checks import sequence_arg
from .spans import Modality, SpanTable

__all__ = ["SUPPORTED_MODALITIES", "UnsupportedModalityError", "mask_unsupported_media"]

#: the modalities every rlk_mm operator handles; an item of another one is refused
SUPPORTED_MODALITIES = frozenset({Modality.TEXT, Modality.IMAGE, Modality.VIDEO})
#: where the status of the other modalities, and the plan for them, is written down
RFC_PATH = "docs/rfc/continuous_latent_rl.md"
#: chat content-part types (transformers, OpenAI) that carry an item of each unsupported modality
_PART_TYPES = {"audio": Modality.AUDIO, "input_audio": Modality.AUDIO, "audio_url": Modality.AUDIO}


class UnsupportedModalityError(NotImplementedError):
    """An op got a media item of a modality it has no support for (``modality``).

    The message names the item (``where``), the RFC with the status and the plan, and the
    fallback: score the text only, with the media span masked."""

    def __init__(self, modality: Modality, where: str, fallback: str):
        self.modality, self.where = modality, where
        label = modality.label
        super().__init__(
            f"{where} is {label}, a modality rlk_mm's operators do not support (supported: "
            f"{', '.join(m.label for m in sorted(SUPPORTED_MODALITIES))}; status and plan: {RFC_PATH}). "
            f"Fallback: score the text only, with the {label} span masked: {fallback}"
        )


def _fallback_for_batch(label: str) -> str:
    return (f"rlk_mm.schema.mask_unsupported_media(batch) keeps every token in place and turns each {label} span into "
            "unscored text (the model then sees its placeholder ids, not the content)")


def unsupported_item_count(batch) -> int:
    """Media items of ``batch`` whose modality no op supports, counted on the host (no device
    read): a valid batch has one ``image_grid_thw`` row per image and one ``video_grid_thw``
    row per video, so every other media item is of an unsupported modality."""
    rows = sum(0 if grid is None else grid.shape[0] for grid in (batch.image_grid_thw, batch.video_grid_thw))
    return len(batch.media_ids) - rows


def require_supported(name: str, batch):
    """``batch`` itself when every media item is an image or a video; else
    ``UnsupportedModalityError`` naming the argument, the sample, the item and its tokens.

    No host-device sync on the way through (only the failure reads the device)."""
    if unsupported_item_count(batch) == 0:
        return batch
    kinds = [Modality(m) for m in batch.media_modality.tolist()]
    g = next(g for g, kind in enumerate(kinds) if kind not in SUPPORTED_MODALITIES)
    table = batch.modality_spans
    i = int(torch.nonzero(table.media_index.cpu() == g)[0])
    where = (f"{name}: sample {int(table.span_sample()[i])}, media item {g} (id {batch.media_ids[g]!r}, tokens "
             f"[{int(table.starts[i])}, {int(table.ends[i])}))")
    raise UnsupportedModalityError(kinds[g], where, _fallback_for_batch(kinds[g].label))


def require_supported_messages(messages, where: str):
    """``messages`` (chat messages: dicts whose ``content`` is a string or a list of typed
    parts) when no part is of an unsupported modality (``{"type": "audio"}``,
    ``"input_audio"``, ``"audio_url"``); else ``UnsupportedModalityError`` naming
    ``where``, the message and the part. Other part types are the chat template's business."""
    for m, message in enumerate(sequence_arg(f"{where} messages", messages, "chat messages (dicts)", ordered=True)):
        if not isinstance(message, dict):
            raise TypeError(f"{where}: messages[{m}] is {type(message).__name__}; a chat message is a dict with 'role' and 'content'")
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            modality = _PART_TYPES.get(kind) if isinstance(kind, str) else None
            if modality is not None:
                raise UnsupportedModalityError(
                    modality, f"{where}: messages[{m}].content[{p}] (type {part['type']!r})",
                    f"drop the {modality.label} part from the prompt (keep its text), or transcribe it to text first")
    return messages


#: processor-output keys of audio inputs (Whisper, Qwen2-Audio, Qwen2.5-Omni feature extractors)
AUDIO_INPUT_KEYS = ("input_features", "feature_attention_mask", "audio_feature_lengths", "input_values", "audio_values")


def require_no_audio_inputs(inputs, where: str):
    """``inputs`` (a processor output or one sample's media inputs) when it holds no audio
    inputs; else ``UnsupportedModalityError``. A builder that ignored them would build the
    audio placeholders as plain text without saying so."""
    found = [key for key in AUDIO_INPUT_KEYS if inputs.get(key) is not None]
    if found:
        raise UnsupportedModalityError(
            Modality.AUDIO, f"{where} holds audio inputs ({', '.join(found)}); their modality",
            f"build the batch from the output without {', '.join(found)}: the audio placeholder tokens are then unscored "
            "text, as rlk_mm.schema.mask_unsupported_media(batch) makes them")
    return inputs


# ----------------------------------------------------------------------------- the fallback
def _is_batch(value) -> bool:
    """``value`` is an ``RLBatch`` (the class is named, not imported: ``batch`` imports this module)."""
    return any(c.__name__ == "RLBatch" and c.__module__ == "rlk_mm.schema.batch" for c in type(value).__mro__)


def mask_unsupported_media(batch):
    """The fallback: a new batch of the same tokens, positions and loss spans in which every
    media item of an unsupported modality is gone and its span is plain text.

    What changes: those spans become text spans (no media index), and the items leave the
    media fields (``media_ids``, keys, modality, sample, grid, offsets; the others keep their
    order, offsets and pixels). Loss spans never cover media, so the masked spans stay
    unscored; a model fed the result sees the placeholder ids, not the content. Rollout
    log-probs taken with the content do not match log-probs of the masked batch: score both
    sides from the masked batch (see the RFC)."""
    if not _is_batch(batch):
        raise TypeError(f"batch must be an RLBatch, got {type(batch).__name__}")
    if unsupported_item_count(batch) == 0:
        return batch
    modality = batch.media_modality.cpu()
    keep = [g for g, m in enumerate(modality.tolist()) if Modality(m) in SUPPORTED_MODALITIES]
    new_index = torch.full((batch.num_media,), -1, dtype=torch.int32)
    new_index[keep] = torch.arange(len(keep), dtype=torch.int32)
    table = batch.modality_spans
    media_index = table.media_index.cpu()
    new_media_index = torch.where(media_index >= 0, new_index[media_index.long().clamp(min=0)], media_index)
    masked = (media_index >= 0) & (new_media_index < 0)
    spans = SpanTable(table.starts, table.ends, table.sample_ptr,
                      torch.where(masked, int(Modality.TEXT), table.modality.cpu()).to(table.device),
                      new_media_index.to(table.device))
    fields = {name: getattr(batch, name) for name in type(batch).model_fields}
    kept = torch.tensor(keep, dtype=torch.int64, device=batch.device)
    for name in ("media_modality", "media_sample", "media_grid_thw", "vision_token_offsets"):
        fields[name] = fields[name][kept]
    fields["media_ids"] = [batch.media_ids[g] for g in keep]
    fields["media_cache_keys"] = [batch.media_cache_keys[g] for g in keep]
    fields["modality_spans"] = spans
    return type(batch)(**fields)
