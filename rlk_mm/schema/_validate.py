"""The batch contract's invariants (docs/batch_contract.md), checked when a batch is built or loaded.

``check(batch)`` runs every clause vectorized over the whole batch in two steps: host
checks of types, dtypes, shapes, devices and batch-wide settings (no device read), then
every value check gathered in one ``DeviceChecks`` (one host sync, on CUDA too). The first
violation raises ``SchemaError`` naming the field, the sample, the span and the positions,
and saying what to change.
"""

from __future__ import annotations

from typing import Optional

import torch
from pydantic import ValidationError

from ._validate_media import check_media, check_offsets, field, ints_on
from .checks import DeviceChecks, first_true
from .coordinates import CoordinateSystem, extent
from .coordinates import outside as outside_image
from .layouts import layout_family_arg
from .media import token_counts
from .spans import Modality, SchemaError, Span, SpanTable, refuse

__all__ = ["check", "schema_error"]

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
    return str(Span(int(table.starts[i]), int(table.ends[i]), int(table.modality[i]), int(table.media_index[i])))


def check(batch) -> None:
    """Every clause of the batch contract; the first violation raises ``SchemaError``.
    One host sync for the value checks (none when the host checks fail first)."""
    device = batch.input_ids.device
    for name in type(batch).model_fields:
        value = getattr(batch, name)
        if isinstance(value, (Tensor, SpanTable)) and value.device != device:
            raise SchemaError(f"{name} is on {value.device}; input_ids is on {device}: a batch keeps every tensor on one device")
    checks = DeviceChecks()
    lengths = _check_tokens(batch, checks)
    _check_per_sample(batch, checks, lengths)
    check_media(batch, checks)
    _check_layout_family(batch, checks)
    token_modality, token_media = _check_modality_spans(batch, checks, lengths)
    _check_groups(batch, checks, token_media, lengths)
    _check_placeholders(batch, checks, token_modality)
    _check_loss_spans(batch, checks, lengths, token_modality)
    _check_grounding(batch, checks, lengths)
    check_offsets(batch, checks)
    checks.run()


# ----------------------------------------------------------------------------- host checks
def _table(batch, name: str, B: int) -> Optional[SpanTable]:
    table = getattr(batch, name)
    if table is None:
        return None
    if table.num_samples != B:
        raise SchemaError(f"{name} covers {table.num_samples} samples; the batch has {B}")
    return table


def _check_layout_family(batch, checks: DeviceChecks) -> None:
    """A known ``layout_family``; in a Qwen3-VL batch every video item is one temporal patch."""
    family = layout_family_arg(batch.layout_family, "layout_family", SchemaError)
    if family is None or not family.splits_video or batch.media_grid_thw is None:
        return
    long_video = (batch.media_modality == int(Modality.VIDEO)) & (batch.media_grid_thw[:, 0] != 1)
    checks.add(long_video.any(), lambda: refuse(
        f"media_grid_thw: video item {(g := first_true(long_video)[0])} has grid {batch.media_grid_thw[g].tolist()}, but in a "
        f"{family.label} batch each temporal patch of a video is its own item of grid (1, h, w) (its placeholders sit "
        "between their own timestamp text and vision markers): build the batch with RLBatch.from_qwen_vl or "
        "from_token_lists and the model's own processor"))


def _check_tokens(batch, checks: DeviceChecks) -> Tensor:
    """input_ids, cu_seqlens, position_ids and the batch-wide settings; returns the sample lengths."""
    ids, cu, pos = batch.input_ids, batch.cu_seqlens, batch.position_ids
    if ids.ndim != 1 or ids.dtype != torch.int64:
        raise SchemaError(f"input_ids must be a 1-D int64 tensor of all samples' tokens, got {ids.dtype} {tuple(ids.shape)}")
    if ids.device.type == "meta":
        raise SchemaError("input_ids is on the meta device, which holds no values to check: build the batch on a real device, then .to('meta')")
    if cu.ndim != 1 or cu.dtype != torch.int32 or cu.numel() < 1:
        raise SchemaError(f"cu_seqlens must be a 1-D int32 tensor of length num_samples + 1, got {cu.dtype} {tuple(cu.shape)}")
    T = ids.numel()
    if pos.shape != (3, T) or pos.dtype != torch.int64:
        raise SchemaError(f"position_ids must be int64 of shape (3, {T}) (t, h, w per token), got {pos.dtype} {tuple(pos.shape)}")
    if batch.spatial_merge_size < 1:
        raise SchemaError(f"spatial_merge_size={batch.spatial_merge_size} is out of range: it must be >= 1")
    for name in ("image_token_id", "video_token_id"):
        if getattr(batch, name) is not None and getattr(batch, name) < 0:
            raise SchemaError(f"{name}={getattr(batch, name)} is not a token id (>= 0)")
    if batch.image_token_id is not None and batch.image_token_id == batch.video_token_id:
        raise SchemaError(f"image_token_id and video_token_id are both {batch.image_token_id}: the placeholders of images and videos differ")
    if not batch.processor_fingerprint.strip():
        raise SchemaError("processor_fingerprint is empty: pass processor_fingerprint(processor) of the processor that built the batch")
    if batch.coordinate_system is not None:
        CoordinateSystem.parse(batch.coordinate_system, "coordinate_system", SchemaError)

    checks.add((cu[0] != 0) | (cu[-1] != T), lambda: refuse(
        f"cu_seqlens must run from 0 to the token count {T}, got {int(cu[0])}..{int(cu[-1])}"))
    lengths = torch.diff(cu).long()
    empty = lengths <= 0
    checks.add(empty.any(), lambda: refuse(
        f"cu_seqlens: sample {(b := first_true(empty)[0])} has {int(lengths[b])} tokens; every sample needs at least one"))
    cu_l = cu.long()

    def where(t: int) -> str:
        b = int(torch.searchsorted(cu_l, torch.tensor([t], device=cu_l.device), right=True)[0]) - 1
        return f"sample {b}, position {t - int(cu_l[b])}"

    negative = ids < 0
    checks.add(negative.any(), lambda: refuse(
        f"input_ids: {where(t := first_true(negative)[0])} is {int(ids[t])}; token ids are >= 0 (an ignore index such as "
        "-100 is not a token: leave unscored tokens out of loss_spans instead)"))
    behind = pos < 0
    checks.add(behind.any(), lambda: refuse(
        f"position_ids: {where((r := first_true(behind))[1])} is {int(pos[r])} (row {'thw'[r[0]]}); positions are >= 0"))
    return lengths


def _check_per_sample(batch, checks: DeviceChecks, lengths: Tensor) -> None:
    B = batch.num_samples
    if batch.group_ids is not None and len(batch.group_ids) != B:
        raise SchemaError(f"group_ids has {len(batch.group_ids)} entries; expected one per sample ({B})")
    prompt = field(batch, "prompt_lengths", (torch.int64,), (B,), "one value per sample")
    if prompt is not None:
        out = (prompt < 0) | (prompt > lengths)
        checks.add(out.any(), lambda: refuse(
            f"prompt_lengths[{(b := first_true(out)[0])}] is {int(prompt[b])} but sample {b} has {int(lengths[b])} tokens; "
            f"a prompt length is in [0, {int(lengths[b])}]"))
    for name in ("rewards", "costs"):
        value = field(batch, name, (torch.float32,), (B,), "one value per sample")
        if value is not None:
            bad = ~torch.isfinite(value)
            checks.add(bad.any(), lambda name=name, value=value, bad=bad: refuse(
                f"{name}[{(b := first_true(bad)[0])}] is {float(value[b])} (sample {b}); rewards and costs must be finite"))


# ----------------------------------------------------------------------------- spans
def _check_span_bounds(checks: DeviceChecks, name: str, table: SpanTable, lengths: Tensor) -> None:
    """Every span of ``table`` is non-empty and inside its sample."""
    if not table.num_spans:
        return
    sample = table.span_sample()
    bad = (table.ends.long() > lengths[sample]) | (table.ends <= table.starts)

    def fail():
        i = first_true(bad)[0]
        b = int(sample[i])
        raise SchemaError(f"{name}: sample {b}, span [{int(table.starts[i])}, {int(table.ends[i])}) is empty or out of range "
              f"(the sample has {int(lengths[b])} tokens)")

    checks.add(bad.any(), fail)


def _check_modality_spans(batch, checks: DeviceChecks, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """The modality spans partition each sample, and each media span is its item's placeholder
    run. Returns the modality and the media index (-1 for text) of every token (meaningful
    once the checks pass)."""
    B, T = batch.num_samples, batch.num_tokens
    ms = _table(batch, "modality_spans", B)
    if B and not ms.num_spans:
        raise SchemaError("modality_spans is empty; every token must lie in exactly one span")
    _check_span_bounds(checks, "modality_spans", ms, lengths)
    if not ms.num_spans:
        none = torch.full((T,), -1, dtype=torch.int64, device=batch.device)
        return torch.zeros(T, dtype=torch.int8, device=batch.device), none
    count = torch.diff(ms.sample_ptr)
    checks.add((count == 0).any(), lambda: refuse(
        f"modality_spans: sample {(b := first_true(count == 0)[0])} has no spans; they must partition its {int(lengths[b])} tokens"))
    first = ms.sample_ptr[:-1].long().clamp(max=ms.num_spans - 1)
    last = (ms.sample_ptr[1:].long() - 1).clamp(min=0)
    late = (count > 0) & (ms.starts.long()[first] != 0)
    checks.add(late.any(), lambda: refuse(
        f"modality_spans: sample {(b := first_true(late)[0])} starts at position {int(ms.starts[first[b]])}; its first span must start at 0"))
    short = (count > 0) & (ms.ends.long()[last] != lengths)
    checks.add(short.any(), lambda: refuse(
        f"modality_spans: sample {(b := first_true(short)[0])} ends at position {int(ms.ends[last[b]])} but has {int(lengths[b])} tokens; "
        "the spans must cover every token"))
    sample = ms.span_sample()
    gap = (sample[1:] == sample[:-1]) & (ms.starts[1:] != ms.ends[:-1])

    def not_adjacent():
        i = first_true(gap)[0] + 1
        kind = "overlaps" if int(ms.starts[i]) < int(ms.ends[i - 1]) else "leaves a gap after"
        raise SchemaError(f"modality_spans: sample {int(sample[i])}, span {_span_name(ms, i)} {kind} span {_span_name(ms, i - 1)}; "
              "modality spans must partition the sample")

    checks.add(gap.any(), not_adjacent)
    _check_media_spans(batch, checks, ms, sample, lengths)
    cu = batch.cu_seqlens.long()
    global_start = cu[sample] + ms.starts.long()
    span_of_token = (torch.searchsorted(global_start, torch.arange(T, device=cu.device), right=True) - 1).clamp(0, ms.num_spans - 1)
    return ms.modality[span_of_token], ms.media_index.long()[span_of_token]


def _check_groups(batch, checks: DeviceChecks, token_media: Tensor, lengths: Tensor) -> None:
    """Samples that share a group id answer one prompt: equal prompt lengths, and equal prompt
    tokens, positions and media (cache keys) at every prompt position. A batch of prompts only
    (no prompt_lengths, no loss spans) is all prompt. Group ids and keys are compared on the
    host; the tokens in the one sync. Episode batches (``action_spans``) are checked per episode
    by ``from_trajectories`` (a step's window is not its episode's prompt)."""
    if batch.group_ids is None or batch.action_spans is not None:
        return
    prompt = batch.prompt_lengths
    if prompt is None and batch.loss_spans.num_spans == 0:
        prompt = lengths
    if prompt is None:
        return
    first: dict[str, int] = {}
    leader = [first.setdefault(g, b) for b, g in enumerate(batch.group_ids)]
    if len(first) == len(leader):
        return
    device, B, T = batch.input_ids.device, batch.num_samples, batch.num_tokens
    cu = batch.cu_seqlens.long()
    lead = ints_on(leader, device)
    other_length = prompt != prompt[lead]
    key_first: dict[str, int] = {}
    key_index = ints_on([key_first.setdefault(k, len(key_first)) for k in batch.media_cache_keys], device)
    token_key = torch.where(token_media >= 0, key_index[token_media.clamp(min=0)] if key_index.numel() else token_media,
                            token_media)
    sample = (torch.searchsorted(cu, torch.arange(T, device=device), right=True) - 1).clamp(0, B - 1)
    position = torch.arange(T, device=device) - cu[sample]
    in_prompt = (position < prompt[sample]) & ~other_length[sample]
    source = (cu[lead][sample] + position).clamp(0, max(T - 1, 0))
    differ = in_prompt & ((batch.input_ids[source] != batch.input_ids) | (token_key[source] != token_key)
                          | (batch.position_ids[:, source] != batch.position_ids).any(0))
    mixed = other_length | (torch.zeros(B, dtype=torch.int64, device=device).index_add_(0, sample, differ.long()) > 0)

    def fail():
        b = first_true(mixed)[0]
        a = leader[b]
        if bool(other_length[b]):
            what = f"its prompt has {int(prompt[b])} tokens, sample {a}'s {int(prompt[a])}"
        else:
            p = first_true(differ[int(cu[b]) : int(cu[b + 1])])[0]
            what = f"their prompts differ at position {p} (token, position or media item)"
        raise SchemaError(f"group_ids: sample {b} is in group {batch.group_ids[b]!r} with sample {a} but {what}: "
                          "a GRPO group answers one prompt (images included); give samples of different prompts "
                          "different group ids")

    checks.add(mixed.any(), fail)


def _check_media_spans(batch, checks: DeviceChecks, ms: SpanTable, sample: Tensor, lengths: Tensor) -> None:
    M = len(batch.media_ids)
    is_media = ms.modality != int(Modality.TEXT)
    checks.add(is_media.sum() != M, lambda: refuse(
        f"modality_spans has {int(is_media.sum())} media spans but the batch lists {M} media items; each item has exactly one span"))
    text_with_index = ~is_media & (ms.media_index >= 0)
    checks.add(text_with_index.any(), lambda: refuse(
        f"modality_spans: text span {_span_name(ms, (i := first_true(text_with_index)[0]))} of sample {int(sample[i])} carries a media index"))
    if not M:
        return
    index = ms.media_index.long()
    safe = index.clamp(0, M - 1)
    uses = torch.zeros(M, dtype=torch.int64, device=index.device).index_add_(0, safe, is_media.long())
    unmatched = (is_media & ((index < 0) | (index >= M))).any() | (uses != 1).any()
    checks.add(unmatched, lambda: refuse(
        f"modality_spans: media spans must reference each of the {M} media items exactly once, got indices {index[is_media].tolist()[:16]}"))
    for what, owner, mine in (("media_sample", batch.media_sample, sample), ("media_modality", batch.media_modality, ms.modality)):
        bad = is_media & (owner[safe] != mine)
        checks.add(bad.any(), lambda what=what, bad=bad: refuse(
            f"modality_spans: sample {int(sample[(i := first_true(bad)[0])])}, span {_span_name(ms, i)} disagrees with {what}[{int(index[i])}]"))
    counts = token_counts(batch.media_grid_thw, batch.spatial_merge_size)
    span_length = ms.lengths().long()
    mismatch = is_media & (span_length != counts[safe])

    def wrong_length():
        i = first_true(mismatch)[0]
        g, b = int(index[i]), int(sample[i])
        cut = int(ms.ends[i]) == int(lengths[b]) and int(span_length[i]) < int(counts[g])
        hint = ("the media span was cut by truncation: raise the prompt length limit or lower max_pixels" if cut
                else "the placeholders and the grid come from different processing (another size or max_pixels?)")
        raise SchemaError(f"modality_spans: sample {b}, {_span_name(ms, i)} has {int(span_length[i])} placeholder tokens but grid_thw "
              f"{batch.media_grid_thw[g].tolist()} of media item {g} implies {int(counts[g])} (t*h*w/{batch.spatial_merge_size}²); {hint}")

    checks.add(mismatch.any(), wrong_length)


def _check_placeholders(batch, checks: DeviceChecks, token_modality: Tensor) -> None:
    """A placeholder token lies in a media span of its modality, and a media span holds only placeholders."""
    ids = batch.input_ids
    for mod, token, label in ((Modality.IMAGE, batch.image_token_id, "<|image_pad|>"), (Modality.VIDEO, batch.video_token_id, "<|video_pad|>")):
        if token is None:
            continue
        wrong = (ids == token) != (token_modality == int(mod))
        checks.add(wrong.any(), lambda wrong=wrong, token=token, label=label: _fail_placeholder(batch, first_true(wrong)[0], token, label))


def _fail_placeholder(batch, t: int, token: int, label: str):
    cu = batch.cu_seqlens.long().cpu()
    b = int(torch.searchsorted(cu, torch.tensor([t]), right=True)[0]) - 1
    p = t - int(cu[b])
    span = next(s for s in batch.modality_spans.spans_of(b) if p in s)
    if int(batch.input_ids[t]) != token:
        raise SchemaError(
            f"input_ids: sample {b}, position {p} is token {int(batch.input_ids[t])} inside media span {span}; "
            f"a media span covers only {label} tokens"
        )
    if batch.prompt_lengths is not None and p >= int(batch.prompt_lengths[b]):
        raise SchemaError(f"input_ids: sample {b}, position {p} holds the placeholder {label} in the response (span {span}); "
              "the policy generated a media placeholder token: mask or reject this response")
    raise SchemaError(f"input_ids: sample {b}, position {p} holds the placeholder {label} outside any media span (span {span}); "
          "every placeholder must lie in its media item's span")


def _check_loss_spans(batch, checks: DeviceChecks, lengths: Tensor, token_modality: Tensor) -> None:
    """Loss spans: text spans, sorted and disjoint, from position 1 on, never over media, inside the response."""
    ls = _table(batch, "loss_spans", batch.num_samples)
    _check_span_bounds(checks, "loss_spans", ls, lengths)
    if not ls.num_spans:
        return
    sample = ls.span_sample()
    not_text = (ls.modality != int(Modality.TEXT)) | (ls.media_index != -1)
    checks.add(not_text.any(), lambda: refuse(
        f"loss_spans: sample {int(sample[(i := first_true(not_text)[0])])}, span {_span_name(ls, i)} is not a text span; "
        "loss spans are text spans (modality text, media_index -1)"))
    at_zero = ls.starts == 0
    checks.add(at_zero.any(), lambda: refuse(
        f"loss_spans: sample {int(sample[(i := first_true(at_zero)[0])])}, span {_span_name(ls, i)} starts at position 0; "
        "target t is scored from position t-1, so a loss span starts at 1 or later"))
    _check_sorted_disjoint(checks, "loss_spans", ls, sample)
    T = batch.num_tokens
    cu = batch.cu_seqlens.long()
    media_before = torch.zeros(T + 1, dtype=torch.int64, device=cu.device)
    media_before[1:] = torch.cumsum((token_modality != int(Modality.TEXT)).long(), 0)
    start = (cu[sample] + ls.starts.long()).clamp(0, T)
    end = (cu[sample] + ls.ends.long()).clamp(0, T)
    over_media = media_before[end] > media_before[start]

    def scores_media():
        i = first_true(over_media)[0]
        b = int(sample[i])
        run = token_modality[start[i] : end[i]] != int(Modality.TEXT)
        q = int(ls.starts[i]) + first_true(run)[0]
        mspan = next(s for s in batch.modality_spans.spans_of(b) if q in s)
        raise SchemaError(f"loss_spans: sample {b}, span {_span_name(ls, i)} intersects media span {mspan} at position {q}; "
              "loss spans must not score media placeholder tokens")

    checks.add(over_media.any(), scores_media)
    if batch.prompt_lengths is not None:
        early = ls.starts.long() < batch.prompt_lengths[sample]
        checks.add(early.any(), lambda: refuse(
            f"loss_spans: sample {(b := int(sample[(i := first_true(early)[0])]))}, span {_span_name(ls, i)} covers prompt position "
            f"{int(ls.starts[i])} (the prompt has {int(batch.prompt_lengths[b])} tokens); loss spans lie inside the response"))


def _check_sorted_disjoint(checks: DeviceChecks, name: str, table: SpanTable, sample: Tensor) -> None:
    bad = (sample[1:] == sample[:-1]) & (table.starts[1:] < table.ends[:-1])
    checks.add(bad.any(), lambda: refuse(
        f"{name}: sample {int(sample[(i := first_true(bad)[0] + 1)])}, span {_span_name(table, i)} overlaps or precedes span "
        f"{_span_name(table, i - 1)}; spans must be sorted and disjoint"))


# ----------------------------------------------------------------------------- grounding
def _check_grounding(batch, checks: DeviceChecks, lengths: Tensor) -> None:
    B = batch.num_samples
    for spans_name, values_name in (("region_spans", "region_rewards"), ("action_spans", "turn_rewards")):
        table = _table(batch, spans_name, B)
        if table is not None:
            _check_span_bounds(checks, spans_name, table, lengths)
        n = 0 if table is None else table.num_spans
        values = field(batch, values_name, (torch.float32,), (n,), f"one value per span of {spans_name}")
        if values is not None:
            bad = ~torch.isfinite(values)
            checks.add(bad.any(), lambda name=values_name, values=values, bad=bad: refuse(
                f"{name}[{(i := first_true(bad)[0])}] is {float(values[i])}; rewards must be finite"))
    _check_targets(batch, checks, "bbox_targets", "bbox_sample", "(x0, y0, x1, y1)")
    _check_targets(batch, checks, "point_targets", "point_sample", "(x, y)")
    screen = field(batch, "screen_size", (torch.int64,), (B, 2), "(width, height) per sample")
    if screen is not None:
        small = (screen < 1).any(1)
        checks.add(small.any(), lambda: refuse(
            f"screen_size[{(b := first_true(small)[0])}] is {screen[b].tolist()}; a screen's width and height are >= 1"))


def _check_targets(batch, checks: DeviceChecks, name: str, owner_name: str, row: str) -> None:
    """Boxes or points: finite rows (boxes with x0 <= x1, y0 <= y1), each of a sample of the
    batch, in a named coordinate system."""
    width = row.count(",") + 1
    targets = field(batch, name, (torch.float32,), (None, width), f"one {row} row each")
    if targets is None:
        return
    if batch.coordinate_system is None:
        raise SchemaError(f"{name} given without coordinate_system; say which system the coordinates are in")
    if getattr(batch, owner_name) is None:
        raise SchemaError(f"{name} needs {owner_name}: the sample of each row")
    owner = field(batch, owner_name, (torch.int64,), (targets.shape[0],), f"the sample of each row of {name}")
    B = batch.num_samples
    outside = (owner < 0) | (owner >= B)
    checks.add(outside.any(), lambda: refuse(
        f"{owner_name}[{(k := first_true(outside)[0])}] is {int(owner[k])}; the batch has samples 0..{B - 1}"))
    rules = [(~torch.isfinite(targets).all(1), "coordinates must be finite")]
    system = CoordinateSystem.parse(batch.coordinate_system, "coordinate_system", SchemaError)
    size = extent(system)  # pixel systems: the image's size is not the batch's to know (a sample may show several)
    if size is not None:
        rules.append((outside_image(targets, *size), f"it lies outside the image (0..{size[0]:g} x 0..{size[1]:g} in "
                      f"{system.value} coordinates): fix or drop that row, or name the coordinate_system its values "
                      "are really in"))
    if width == 4:
        rules.append(((targets[:, 0] > targets[:, 2]) | (targets[:, 1] > targets[:, 3]), "a box has x0 <= x1 and y0 <= y1"))
    for bad, rule in rules:
        checks.add(bad.any(), lambda bad=bad, rule=rule: refuse(
            f"{name}[{(k := first_true(bad)[0])}] (sample {int(owner[k])}) is {[float(f'{v:.6g}') for v in targets[k].tolist()]}; {rule}"))
