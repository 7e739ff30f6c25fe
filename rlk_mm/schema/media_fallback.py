"""The fallback for media items of an unsupported modality (``support``): the text scored,
the media span masked. Apart from ``support`` because it builds an ``RLBatch``, and
``batch.py`` imports ``support``."""

from __future__ import annotations

import torch

from .batch import RLBatch
from .spans import Modality, SpanTable
from .support import SUPPORTED_MODALITIES, unsupported_item_count


def mask_unsupported_media(batch):
    """The fallback: a new batch of the same tokens, positions and loss spans in which every
    media item of an unsupported modality is gone and its span is plain text.

    What changes: those spans become text spans (no media index), and the items leave the
    media fields (``media_ids``, keys, modality, sample, grid, offsets; the others keep their
    order, offsets and pixels). Loss spans never cover media, so the masked spans stay
    unscored; a model fed the result sees the placeholder ids, not the content. Rollout
    log-probs taken with the content do not match log-probs of the masked batch: score both
    sides from the masked batch (see the RFC)."""
    if not isinstance(batch, RLBatch):
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
    return RLBatch(**fields)
