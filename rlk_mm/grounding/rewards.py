"""Grounding rewards: IoU, GIoU and point-in-box, vectorized over a batch, and action-field match.

``box_iou`` / ``box_giou`` / ``point_in_box`` score row pairs (any float tensors, computed in
float64). ``grounding_rewards`` scores what ``parse_grounding`` read from every sample of a
batch against the batch's ``bbox_targets`` (each prediction against the best target of its
sample, in original-image pixels) and returns both placements: a ``SpanReward`` on each
coordinate span (region rewards, for ``scatter_rewards(spans=[...])``) and a per-sample
sequence reward (the mean over the sample's predictions and parse failures). A parse
failure, or a sample with nothing parsed, scores ``failure_reward`` (0 by default).
Before any reward, every prediction and target is checked (finite, x1 <= x2 and y1 <= y2,
inside the image); an error names the sample and the span.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..ops.rewards import SpanReward
from ..schema import Choice, CoordinateSystem, RLBatch, SchemaError, Span, SpanTable, convert_boxes
from ..schema.batch import batch_arg
from ..schema.checks import FLOAT_DTYPES, first_true, float_arg, readable, sequence_arg, tensor_arg
from ..schema.coordinates import extent, outside
from .parse import Grounding, Region

__all__ = [
    "action_match", "ACTIONS", "box_giou", "box_iou", "grounding_rewards", "GroundingMetric", "GroundingRewards",
    "parse_action", "point_in_box",
]


class GroundingMetric(Choice):
    IOU = "iou"  # predicted box vs target box
    GIOU = "giou"  # generalized IoU, in [-1, 1]
    POINT_IN_BOX = "point_in_box"  # predicted point inside the target box: 1, else 0


def _rows(name: str, value, width: int) -> Tensor:
    readable(name, tensor_arg(name, value, dtypes=FLOAT_DTYPES, shape=(None, width)))
    bad = ~torch.isfinite(value).all(1)
    if bool(bad.any()):
        k = first_true(bad)[0]
        raise SchemaError(f"{name}[{k}] is {value[k].tolist()}; coordinates must be finite")
    if width == 4:
        flipped = (value[:, 0] > value[:, 2]) | (value[:, 1] > value[:, 3])
        if bool(flipped.any()):
            k = first_true(flipped)[0]
            raise SchemaError(f"{name}[{k}] is {value[k].tolist()}; a box has x1 <= x2 and y1 <= y2")
    return value.double()


def _pair(a_name: str, a, a_width: int, b_name: str, b) -> tuple[Tensor, Tensor]:
    a, b = _rows(a_name, a, a_width), _rows(b_name, b, 4)
    if a.device != b.device:
        raise ValueError(f"{a_name} is on {a.device}, {b_name} on {b.device}: they are scored row by row on one device")
    if a.shape[0] != b.shape[0]:
        raise SchemaError(f"{a_name} has {a.shape[0]} rows, {b_name} {b.shape[0]}; they are scored row by row")
    return a, b


def _area(box: Tensor) -> Tensor:
    return (box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1])


def _iou_parts(pred: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    wh = (torch.minimum(pred[:, 2:], target[:, 2:]) - torch.maximum(pred[:, :2], target[:, :2])).clamp(min=0)
    inter = wh[:, 0] * wh[:, 1]
    union = _area(pred) + _area(target) - inter
    positive = union > 0
    iou = torch.where(positive, inter / torch.where(positive, union, 1.0), (pred == target).all(1).double())
    return iou, union


def box_iou(pred, target) -> Tensor:
    """float64 [N]: IoU of boxes ``pred[i]`` and ``target[i]`` ([N, 4] x1, y1, x2, y2, one
    coordinate system). Two equal degenerate boxes (zero area) score 1."""
    pred, target = _pair("pred", pred, 4, "target", target)
    return _iou_parts(pred, target)[0]


def box_giou(pred, target) -> Tensor:
    """float64 [N]: generalized IoU (IoU - (C - U) / C, C the smallest enclosing box), in [-1, 1]."""
    pred, target = _pair("pred", pred, 4, "target", target)
    iou, union = _iou_parts(pred, target)
    hull = _area(torch.cat([torch.minimum(pred[:, :2], target[:, :2]), torch.maximum(pred[:, 2:], target[:, 2:])], 1))
    positive = hull > 0
    return torch.where(positive, iou - (hull - union) / torch.where(positive, hull, 1.0), iou)


def point_in_box(points, boxes) -> Tensor:
    """float64 [N]: 1 where ``points[i]`` ([N, 2] x, y) lies in ``boxes[i]`` (edges included), else 0."""
    points, boxes = _pair("points", points, 2, "boxes", boxes)
    inside = (points[:, 0] >= boxes[:, 0]) & (points[:, 0] <= boxes[:, 2]) & (points[:, 1] >= boxes[:, 1]) & (points[:, 1] <= boxes[:, 3])
    return inside.double()


# ----------------------------------------------------------------------------- a batch
@dataclass(frozen=True)
class GroundingRewards:
    """``region``: one value per coordinate or failure span (``scatter_rewards(batch.loss_spans,
    spans=[region])``); ``sequence``: float32 [B], one per sample (``scatter_rewards(batch.loss_spans,
    sequence)``)."""

    region: SpanReward
    sequence: Tensor


def _groundings(batch: RLBatch, groundings) -> list[Grounding]:
    items = sequence_arg("groundings", groundings, "Grounding (one per sample, from parse_grounding)", ordered=True)
    if len(items) != batch.num_samples:
        raise SchemaError(f"groundings has {len(items)} entries; the batch has {batch.num_samples} samples (one each, in order)")
    for b, g in enumerate(items):
        if not isinstance(g, Grounding):
            raise TypeError(f"groundings[{b}] is {type(g).__name__}; expected a Grounding from parse_grounding")
        if g.sample != b:
            raise SchemaError(f"groundings[{b}] was parsed from sample {g.sample}; give one per sample, in batch order")
        losses = batch.loss_spans_of(b)
        for span in [r.span for r in g.regions] + [f.span for f in g.failures]:
            if not any(loss.start <= span.start and span.end <= loss.end for loss in losses):
                raise SchemaError(f"groundings[{b}]: span [{span.start}, {span.end}) is not inside a loss span of sample {b} "
                                  f"of this batch (its loss spans: {[(s.start, s.end) for s in losses]}): the groundings come "
                                  "from another batch; parse each sample of this batch with parse_grounding")
    return items


def _check_region(b: int, r: Region, size: tuple[int, int]) -> None:
    """A region's original-pixel values: finite, ordered, inside the image; else an error naming sample and span."""
    where = f"sample {b}, span [{r.span.start}, {r.span.end})"
    want = 4 if r.kind == "box" else 2
    if r.kind not in ("box", "point") or len(r.absolute) != want:
        raise SchemaError(f"{where}: a {r.kind!r} region with {len(r.absolute)} coordinates; expected a box (4) or a point (2)")
    if not all(math.isfinite(v) for v in r.absolute):
        raise SchemaError(f"{where}: {r.kind} {list(r.absolute)} is not finite")
    xs, ys = r.absolute[0::2], r.absolute[1::2]
    if any(not 0 <= x <= size[0] for x in xs) or any(not 0 <= y <= size[1] for y in ys):
        raise SchemaError(f"{where}: {r.kind} {list(r.absolute)} lies outside the {size[0]}x{size[1]} image #{r.image}; "
                          "parse_grounding records such output as a failure")
    if r.kind == "box" and (r.absolute[0] > r.absolute[2] or r.absolute[1] > r.absolute[3]):
        raise SchemaError(f"{where}: box {list(r.absolute)} has x1 > x2 or y1 > y2")


def _targets_absolute(batch: RLBatch, groundings: list[Grounding]) -> tuple[Tensor, Tensor]:
    """The batch's box targets in original pixels (float64 [K, 4]) and their samples [K]; checked
    to lie inside their image."""
    if batch.bbox_targets is None:
        raise SchemaError("grounding_rewards needs bbox_targets in the batch (the boxes to score against)")
    system = CoordinateSystem.parse(batch.coordinate_system, "coordinate_system", SchemaError)
    targets, owner = batch.bbox_targets.double().cpu(), batch.bbox_sample.cpu()
    out = torch.empty_like(targets)
    for b, g in enumerate(groundings):
        mine = owner == b
        if not bool(mine.any()):
            continue
        width, height = extent(system, g.original_size, g.resized_size)
        off = mine & outside(targets, width, height)  # checked in the targets' own system, before converting
        if bool(off.any()):
            k = first_true(off)[0]
            raise SchemaError(f"bbox_targets[{k}] (sample {b}) is {targets[k].tolist()} in {system.value} coordinates: it lies "
                              f"outside the {g.original_size[0]}x{g.original_size[1]} image (0..{width:g} x 0..{height:g} in "
                              f"{system.value} coordinates): fix or drop that target, or build the batch with the "
                              "coordinate_system its values are really in")
        out[mine] = convert_boxes(targets[mine], system, CoordinateSystem.ABSOLUTE, original_size=g.original_size,
                                  resized_size=g.resized_size)
    return out, owner


def grounding_rewards(batch, groundings: Sequence[Grounding], *, metric="iou", failure_reward: float = 0.0) -> GroundingRewards:
    """Scores of every sample's parsed boxes or points against its ``bbox_targets``.

    ``metric``: ``iou`` / ``giou`` (a predicted box vs the best target box of its sample) or
    ``point_in_box`` (a predicted point in any target box of its sample). A prediction of the
    other kind, a parse failure, and a sample with nothing parsed score ``failure_reward``. A
    sample with predictions but no target is refused (its score would be meaningless)."""
    batch = batch_arg("batch", batch)
    metric = GroundingMetric.parse(metric, "metric")
    failure_reward = float_arg("failure_reward", failure_reward)
    groundings = _groundings(batch, groundings)
    targets, owner = _targets_absolute(batch, groundings)
    want = "point" if metric is GroundingMetric.POINT_IN_BOX else "box"
    spans, scored, pending = [], [], []  # pending: (sample, region) to score, and its index in ``scored``
    for b, g in enumerate(groundings):
        mine: list[tuple[Span, float]] = [(f.span, failure_reward) for f in g.failures]
        for r in g.regions:
            _check_region(b, r, g.size_of(r.image).original)
            if r.kind == want:
                if not bool((owner == b).any()):
                    raise SchemaError(f"sample {b}, span [{r.span.start}, {r.span.end}): a predicted {r.kind} but the sample "
                                      "has no bbox_targets to score it against")
                pending.append((b, r, len(scored) + len(mine)))
            mine.append((r.span, failure_reward))
        spans.append([s for s, _ in mine])
        scored += [v for _, v in mine]
    values = torch.tensor(scored, dtype=torch.float64)
    if pending:
        values[[i for _, _, i in pending]] = _best_scores(metric, [b for b, _, _ in pending],
                                                          [r.absolute for _, r, _ in pending], targets, owner)
    return _placed(batch, spans, values, failure_reward)


def _best_scores(metric: GroundingMetric, samples: list[int], preds: list[tuple[float, ...]], targets: Tensor, owner: Tensor) -> Tensor:
    """float64 [N]: each prediction's score against the best target of its sample (all pairs at once)."""
    pred = torch.tensor(preds, dtype=torch.float64)
    sample = torch.tensor(samples)
    N, K = pred.shape[0], targets.shape[0]
    p = pred.repeat_interleave(K, 0)
    t = targets.repeat(N, 1)
    if metric is GroundingMetric.POINT_IN_BOX:
        score = point_in_box(p, t)
    else:
        score = (box_iou if metric is GroundingMetric.IOU else box_giou)(p, t)
    same = sample[:, None] == owner[None, :]
    return torch.where(same, score.reshape(N, K), torch.tensor(-math.inf, dtype=torch.float64)).amax(1)


def _placed(batch: RLBatch, spans: list[list[Span]], values: Tensor, failure_reward: float) -> GroundingRewards:
    """Region rewards on the spans (a span that shares a token with the one before starts after
    it) and the per-sample mean (``failure_reward`` for a sample with nothing parsed)."""
    kept_spans, kept_values, sequence, k = [], [], [], 0
    for row in spans:
        order = sorted(range(len(row)), key=lambda i: (row[i].start, row[i].end))
        mine, end = [], 0
        for i in order:
            start = max(row[i].start, end)
            if start < row[i].end:
                mine.append(Span(start, row[i].end))
                kept_values.append(float(values[k + i]))
                end = row[i].end
        kept_spans.append(mine)
        sequence.append(float(values[k : k + len(row)].mean()) if row else failure_reward)
        k += len(row)
    table = SpanTable.from_lists(kept_spans).to(batch.device)
    region = SpanReward(table, torch.tensor(kept_values, dtype=torch.float32, device=batch.device), "spread", "region rewards")
    return GroundingRewards(region, torch.tensor(sequence, dtype=torch.float32, device=batch.device))


# ----------------------------------------------------------------------------- GUI actions
ACTIONS = ("click", "type", "scroll", "done")


def parse_action(text: str) -> Optional[dict]:
    """The first JSON object of ``text`` with an ``"action"`` field (one of ``ACTIONS``), or None."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str (a decoded response), got {type(text).__name__}")
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start >= 0:
        try:
            value, _ = decoder.raw_decode(text, start)
        except (json.JSONDecodeError, RecursionError):  # malformed, or nested past Python's recursion limit: no action
            value = None
        if isinstance(value, dict) and value.get("action") in ACTIONS:
            return value
        start = text.find("{", start + 1)
    return None


def action_match(actions: Sequence[Optional[dict]], targets: Sequence[dict], *, failure_reward: float = 0.0) -> Tensor:
    """float32 [B]: the fraction of each target's fields the action gets right.

    A field matches when equal, except a target ``"bbox_2d"``: the action's ``"point_2d"``
    must lie in it (same coordinates as the target). Equality keeps bools apart from numbers
    (``True`` does not equal ``1``) and compares lists and tuples alike; a point is any two
    real numbers (a list, tuple, array or tensor). An action that is None (unparsed) scores
    ``failure_reward``; a wrong ``"action"`` scores 0 whatever its other fields.

    Raises
    ------
    ValueError
        A target without a known ``"action"``, or a target ``"bbox_2d"`` that is not four
        finite real numbers (the error names ``targets[b]['bbox_2d']``)."""
    actions = sequence_arg("actions", actions, "action dicts (or None where none was parsed)", ordered=True)
    targets = sequence_arg("targets", targets, "target action dicts", ordered=True)
    failure_reward = float_arg("failure_reward", failure_reward)
    if len(actions) != len(targets):
        raise ValueError(f"actions has {len(actions)} entries, targets {len(targets)}; one each per sample")
    for b, target in enumerate(targets):  # every target checked before any score
        if not isinstance(target, dict) or target.get("action") not in ACTIONS:
            raise ValueError(f"targets[{b}] is {target!r}; a target is a dict with an 'action' in {ACTIONS}")
        if "bbox_2d" in target:
            _target_box(b, target["bbox_2d"])
    scores = []
    for b, (action, target) in enumerate(zip(actions, targets)):
        if action is None:
            scores.append(failure_reward)
            continue
        if not isinstance(action, dict):
            raise TypeError(f"actions[{b}] is {type(action).__name__}; expected a dict (parse_action) or None")
        if action.get("action") != target["action"]:
            scores.append(0.0)
            continue
        hits = [_field_hit(b, key, action, value) for key, value in target.items()]
        scores.append(sum(hits) / len(hits))
    return torch.tensor(scores, dtype=torch.float32)


def _same(a, b) -> bool:
    """Equality of JSON-like values that keeps bools apart from numbers and lists like tuples."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, numbers.Real) or isinstance(b, numbers.Real):
        return isinstance(a, numbers.Real) and isinstance(b, numbers.Real) and a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _reals(value, n: int) -> Optional[list[float]]:
    """``value`` as ``n`` real numbers (a list, tuple, array or tensor; never bools or strings), else None."""
    if isinstance(value, Tensor) or hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or len(value) != n:
        return None
    if any(isinstance(v, bool) or not isinstance(v, numbers.Real) for v in value):
        return None
    return [float(v) for v in value]


def _target_box(b: int, value) -> Tensor:
    """A target's ``bbox_2d`` as a checked float64 ``[1, 4]`` row."""
    box = _reals(value, 4)
    if box is None:
        raise ValueError(f"targets[{b}]['bbox_2d'] is {value!r:.80}; a target box is four real numbers (x0, y0, x1, y1)")
    return _rows(f"targets[{b}]['bbox_2d']", torch.tensor([box], dtype=torch.float64), 4)


def _field_hit(b: int, key: str, action: dict, value) -> bool:
    if key != "bbox_2d":
        return _same(action.get(key), value)
    box = _target_box(b, value)
    point = _reals(action.get("point_2d"), 2)  # the model's output: malformed is a miss, not an error
    if point is None or not all(math.isfinite(v) for v in point):
        return False
    return bool(point_in_box(torch.tensor([point], dtype=torch.float64), box)[0])
