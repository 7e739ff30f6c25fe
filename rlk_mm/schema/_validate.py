"""The batch contract's invariants, checked when a batch is built or loaded.

``check(batch)`` runs every clause (DESIGN.md, "The batch contract") vectorized over the
whole batch; the first violation raises ``SchemaError`` naming the field, the sample, the
span and the positions, and saying what to change.
"""

from __future__ import annotations

import torch
from pydantic import ValidationError

from .grounding import CoordinateSystem
from .media import media_token_counts, vision_token_offsets
from .spans import Modality, SchemaError, Span, SpanTable

Tensor = torch.Tensor


def schema_error(error: ValidationError) -> SchemaError:
    """pydantic wraps our SchemaError; unwrap it, or name the fields pydantic rejected."""
    problems = []
    for item in error.errors():
        inner = (item.get("ctx") or {}).get("error")
        if isinstance(inner, SchemaError):
            return inner
        field_name = ".".join(str(x) for x in item.get("loc", ())) or "batch"
        problems.append(f"{field_name}: {item.get('msg')}")
    return SchemaError("invalid RLBatch: " + "; ".join(problems))


def _span_name(table: SpanTable, i: int) -> str:
    s = Span(int(table.starts[i]), int(table.ends[i]), int(table.modality[i]), int(table.media_index[i]))
    return str(s)


def check(batch) -> None:  # noqa: C901 - one list of contract clauses
    """Every clause of the batch contract, vectorized; the first violation raises ``SchemaError``."""
    ids, cu, pos = batch.input_ids, batch.cu_seqlens, batch.position_ids
    if not isinstance(ids, Tensor) or ids.ndim != 1 or ids.dtype != torch.int64:
        raise SchemaError(f"input_ids must be a 1-D int64 tensor of all samples' tokens, got {getattr(ids, 'dtype', type(ids))} {tuple(getattr(ids, 'shape', ()))}")
    if cu.ndim != 1 or cu.dtype != torch.int32 or cu.numel() < 1:
        raise SchemaError(f"cu_seqlens must be a 1-D int32 tensor of length num_samples + 1, got {cu.dtype} {tuple(cu.shape)}")
    B, T = cu.numel() - 1, ids.numel()
    if int(cu[0]) != 0 or int(cu[-1]) != T:
        raise SchemaError(f"cu_seqlens must run from 0 to the token count {T}, got {int(cu[0])}..{int(cu[-1])}")
    lengths = torch.diff(cu).long()
    if B and bool((lengths <= 0).any()):
        b = int(torch.nonzero(lengths <= 0)[0])
        raise SchemaError(f"cu_seqlens: sample {b} has {int(lengths[b])} tokens; every sample needs at least one")
    if pos.shape != (3, T) or pos.dtype != torch.int64:
        raise SchemaError(f"position_ids must be int64 of shape (3, {T}) (t, h, w per token), got {pos.dtype} {tuple(pos.shape)}")
    dev = ids.device
    cu_l = cu.long()

    # ---- per-sample field lengths
    for name in ("rewards", "costs", "prompt_lengths"):
        v = getattr(batch, name)
        if v is not None and (v.ndim != 1 or v.numel() != B):
            raise SchemaError(f"{name} has shape {tuple(v.shape)}; expected one value per sample ({B})")
    if batch.group_ids is not None and len(batch.group_ids) != B:
        raise SchemaError(f"group_ids has {len(batch.group_ids)} entries; expected one per sample ({B})")
    for name in ("rewards", "costs"):
        v = getattr(batch, name)
        if v is not None:
            if v.dtype != torch.float32:
                raise SchemaError(f"{name} must be float32, got {v.dtype}")
            bad = ~torch.isfinite(v)
            if bool(bad.any()):
                b = int(torch.nonzero(bad)[0])
                raise SchemaError(f"{name}[{b}] is {float(v[b])} (sample {b}); rewards and costs must be finite")
    if batch.coordinate_system is not None:
        CoordinateSystem.parse(batch.coordinate_system, "coordinate_system", SchemaError)

    # ---- modality spans: a partition of each sample
    ms = batch.modality_spans
    if ms.num_samples != B:
        raise SchemaError(f"modality_spans covers {ms.num_samples} samples; the batch has {B}")
    _check_span_bounds("modality_spans", ms, lengths, allow_empty=False)
    if ms.num_spans:
        first = ms.sample_ptr[:-1].long()
        last = ms.sample_ptr[1:].long() - 1
        has = ms.sample_ptr[1:] > ms.sample_ptr[:-1]
        if not bool(has.all()):
            b = int(torch.nonzero(~has)[0])
            raise SchemaError(f"modality_spans: sample {b} has no spans; they must partition its {int(lengths[b])} tokens")
        bad_first = ms.starts.long()[first] != 0
        if bool(bad_first.any()):
            b = int(torch.nonzero(bad_first)[0])
            raise SchemaError(f"modality_spans: sample {b} starts at position {int(ms.starts[first[b]])}; its first span must start at 0")
        bad_last = ms.ends.long()[last] != lengths
        if bool(bad_last.any()):
            b = int(torch.nonzero(bad_last)[0])
            raise SchemaError(
                f"modality_spans: sample {b} ends at position {int(ms.ends[last[b]])} but has {int(lengths[b])} tokens; "
                "the spans must cover every token"
            )
        same = ms.span_sample()[1:] == ms.span_sample()[:-1]
        gap = same & (ms.starts[1:] != ms.ends[:-1])
        if bool(gap.any()):
            i = int(torch.nonzero(gap)[0]) + 1
            b = int(ms.span_sample()[i])
            kind = "overlaps" if int(ms.starts[i]) < int(ms.ends[i - 1]) else "leaves a gap after"
            raise SchemaError(
                f"modality_spans: sample {b}, span {_span_name(ms, i)} {kind} span {_span_name(ms, i - 1)}; "
                "modality spans must partition the sample"
            )
    elif B:
        raise SchemaError("modality_spans is empty; every token must lie in exactly one span")
    _check_media(batch, lengths)

    # ---- placeholder tokens agree with the media spans
    modality = batch.token_modality() if T else torch.zeros(0, dtype=torch.int8, device=dev)
    for mod, tok, label in ((Modality.IMAGE, batch.image_token_id, "<|image_pad|>"), (Modality.VIDEO, batch.video_token_id, "<|video_pad|>")):
        if tok is None:
            continue
        is_tok = ids == tok
        in_span = modality == int(mod)
        wrong = is_tok != in_span
        if bool(wrong.any()):
            t = int(torch.nonzero(wrong)[0])
            b = int(torch.searchsorted(cu_l, torch.tensor([t], device=dev), right=True)[0]) - 1
            p = t - int(cu_l[b])
            span = next(s for s in ms.spans_of(b) if p in s)
            if bool(is_tok[t]):
                where = "in the response" if batch.prompt_lengths is not None and p >= int(batch.prompt_lengths[b]) else "outside any media span"
                raise SchemaError(
                    f"input_ids: sample {b}, position {p} holds the placeholder {label} {where} (span {span}); "
                    + ("the policy generated a media placeholder token: mask or reject this response" if "response" in where else "every placeholder must lie in its media item's span")
                )
            raise SchemaError(f"input_ids: sample {b}, position {p} is token {int(ids[t])} inside media span {span}; a media span covers only {label} tokens")

    # ---- loss spans
    ls = batch.loss_spans
    if ls.num_samples != B:
        raise SchemaError(f"loss_spans covers {ls.num_samples} samples; the batch has {B}")
    _check_span_bounds("loss_spans", ls, lengths, allow_empty=False)
    if ls.num_spans:
        at_zero = ls.starts == 0
        if bool(at_zero.any()):
            i = int(torch.nonzero(at_zero)[0])
            raise SchemaError(
                f"loss_spans: sample {int(ls.span_sample()[i])}, span {_span_name(ls, i)} starts at position 0; "
                "target t is scored from position t-1, so a loss span starts at 1 or later"
            )
        _check_sorted_disjoint("loss_spans", ls)
        sample, p, span_id = ls.token_positions()
        media_hit = modality[cu_l[sample] + p] != int(Modality.TEXT)
        if bool(media_hit.any()):
            k = int(torch.nonzero(media_hit)[0])
            b, q = int(sample[k]), int(p[k])
            mspan = next(s for s in ms.spans_of(b) if q in s)
            raise SchemaError(
                f"loss_spans: sample {b}, span {_span_name(ls, int(span_id[k]))} intersects media span {mspan} at position {q}; "
                "loss spans must not score media placeholder tokens"
            )
        if batch.prompt_lengths is not None:
            early = p < batch.prompt_lengths.to(dev)[sample]
            if bool(early.any()):
                k = int(torch.nonzero(early)[0])
                b = int(sample[k])
                raise SchemaError(
                    f"loss_spans: sample {b}, span {_span_name(ls, int(span_id[k]))} covers prompt position {int(p[k])} "
                    f"(the prompt has {int(batch.prompt_lengths[b])} tokens); loss spans lie inside the response"
                )
    for name in ("region_spans", "action_spans"):
        table = getattr(batch, name)
        if table is not None:
            if table.num_samples != B:
                raise SchemaError(f"{name} covers {table.num_samples} samples; the batch has {B}")
            _check_span_bounds(name, table, lengths, allow_empty=False)
    for values, table, name in ((batch.region_rewards, batch.region_spans, "region_rewards"), (batch.turn_rewards, batch.action_spans, "turn_rewards")):
        if values is not None:
            n = 0 if table is None else table.num_spans
            if values.shape != (n,):
                raise SchemaError(f"{name} has shape {tuple(values.shape)}; expected one value per span ({n})")
            if not bool(torch.isfinite(values).all()):
                i = int(torch.nonzero(~torch.isfinite(values))[0])
                raise SchemaError(f"{name}[{i}] is {float(values[i])}; rewards must be finite")
    for targets, owner, width, name in ((batch.bbox_targets, batch.bbox_sample, 4, "bbox_targets"), (batch.point_targets, batch.point_sample, 2, "point_targets")):
        if targets is None:
            continue
        if targets.ndim != 2 or targets.shape[1] != width:
            raise SchemaError(f"{name} must have shape [K, {width}], got {tuple(targets.shape)}")
        if owner is None or owner.shape != (targets.shape[0],):
            raise SchemaError(f"{name} needs its owner tensor ({name.split('_')[0]}_sample) with one sample per row")
        if targets.shape[0] and (int(owner.min()) < 0 or int(owner.max()) >= B):
            raise SchemaError(f"{name}: owner sample out of range [0, {B})")
        if batch.coordinate_system is None:
            raise SchemaError(f"{name} given without coordinate_system; say which system the coordinates are in")
    if batch.screen_size is not None and batch.screen_size.shape != (B, 2):
        raise SchemaError(f"screen_size has shape {tuple(batch.screen_size.shape)}; expected ({B}, 2) (width, height)")


def _check_span_bounds(name: str, table: SpanTable, lengths: Tensor, *, allow_empty: bool) -> None:
    if not table.num_spans:
        return
    sample = table.span_sample()
    bad = (table.starts < 0) | (table.ends.long() > lengths.to(table.device)[sample]) | (table.ends < table.starts)
    if not allow_empty:
        bad |= table.ends == table.starts
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        b = int(sample[i])
        raise SchemaError(
            f"{name}: sample {b}, span [{int(table.starts[i])}, {int(table.ends[i])}) is empty or out of range "
            f"(the sample has {int(lengths[b])} tokens)"
        )


def _check_sorted_disjoint(name: str, table: SpanTable) -> None:
    sample = table.span_sample()
    same = sample[1:] == sample[:-1]
    bad = same & (table.starts[1:] < table.ends[:-1])
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0]) + 1
        raise SchemaError(
            f"{name}: sample {int(sample[i])}, span {_span_name(table, i)} overlaps or precedes span {_span_name(table, i - 1)}; "
            "spans must be sorted and disjoint"
        )


def _check_media(batch, lengths: Tensor) -> None:
    ms = batch.modality_spans
    M = len(batch.media_ids)
    per_item = {
        "media_cache_keys": len(batch.media_cache_keys),
        "media_modality": None if batch.media_modality is None else batch.media_modality.numel(),
        "media_sample": None if batch.media_sample is None else batch.media_sample.numel(),
        "media_grid_thw": None if batch.media_grid_thw is None else batch.media_grid_thw.shape[0],
        "vision_token_offsets": None if batch.vision_token_offsets is None else batch.vision_token_offsets.numel(),
    }
    for name, n in per_item.items():
        if (n or 0) != M:
            raise SchemaError(f"{name} has {n or 0} entries; media_ids has {M} (one per media item)")
    media_spans = ms.modality != int(Modality.TEXT)
    n_media_spans = int(media_spans.sum())
    if n_media_spans != M:
        raise SchemaError(f"modality_spans has {n_media_spans} media spans but the batch lists {M} media items; each item has exactly one span")
    text_with_index = (~media_spans) & (ms.media_index >= 0)
    if bool(text_with_index.any()):
        i = int(torch.nonzero(text_with_index)[0])
        raise SchemaError(f"modality_spans: text span {_span_name(ms, i)} of sample {int(ms.span_sample()[i])} carries a media index")
    if M == 0:
        return
    idx = ms.media_index[media_spans].long()
    if int(idx.min()) < 0 or int(idx.max()) >= M or torch.unique(idx).numel() != M:
        raise SchemaError(f"modality_spans: media spans must reference each of the {M} media items exactly once, got indices {idx.tolist()[:16]}")
    span_ids = torch.nonzero(media_spans).flatten()
    sample = ms.span_sample()[span_ids]
    wrong_sample = batch.media_sample.to(ms.device)[idx] != sample
    wrong_mod = batch.media_modality.to(ms.device)[idx] != ms.modality[span_ids]
    for bad, what in ((wrong_sample, "media_sample"), (wrong_mod, "media_modality")):
        if bool(bad.any()):
            k = int(torch.nonzero(bad)[0])
            raise SchemaError(f"modality_spans: sample {int(sample[k])}, span {_span_name(ms, int(span_ids[k]))} disagrees with {what}[{int(idx[k])}]")
    counts = media_token_counts(batch.media_grid_thw, batch.spatial_merge_size).to(ms.device)
    span_len = ms.lengths()[span_ids].long()
    mismatch = span_len != counts[idx]
    if bool(mismatch.any()):
        k = int(torch.nonzero(mismatch)[0])
        g = int(idx[k])
        grid = batch.media_grid_thw[g].tolist()
        b = int(sample[k])
        at_end = int(ms.ends[span_ids[k]]) == int(lengths[b])
        hint = (
            "; the media span was cut by truncation: raise the prompt length limit or lower max_pixels"
            if at_end and int(span_len[k]) < int(counts[g])
            else "; the placeholders and the grid come from different processing (another size or max_pixels?)"
        )
        raise SchemaError(
            f"modality_spans: sample {b}, {_span_name(ms, int(span_ids[k]))} has {int(span_len[k])} placeholder tokens "
            f"but grid_thw {grid} of media item {g} implies {int(counts[g])} (t*h*w/{batch.spatial_merge_size}²){hint}"
        )
    expected = vision_token_offsets(batch.media_grid_thw, batch.media_modality, batch.spatial_merge_size)
    if not torch.equal(expected.cpu(), batch.vision_token_offsets.long().cpu()):
        g = int(torch.nonzero(expected.cpu() != batch.vision_token_offsets.long().cpu())[0])
        raise SchemaError(
            f"vision_token_offsets[{g}] is {int(batch.vision_token_offsets[g])}, expected {int(expected[g])}: "
            "the row offset of the item in its modality's vision-tower output (order of the grids)"
        )
