"""Rewards to tokens, and group-relative advantages.

``scatter_rewards`` places rewards on loss tokens (compact ``[n]``, loss-token order, the
order of ``selected_logprob``'s output): sequence rewards on the last loss token (verl's
convention) or spread evenly over the sample's loss tokens; region- or turn-level rewards
(``SpanReward``) on the loss tokens inside their spans; an optional overlong length
penalty. ``group_advantages`` turns per-sample scores into GRPO / Dr.GRPO / RLOO
advantages. Rewards and costs never mix: call ``scatter_rewards`` once for each, and give
``group_advantages`` a ``[B, K]`` tensor whose columns (e.g. reward, cost) are normalized
each on its own.

Both ops are vectorized and deterministic: sorting, searchsorted and segmented sums
(``torch.segment_reduce``), no atomics. ``group_advantages`` never reads the device from
the host; ``scatter_rewards`` reads once (the token count, which sizes its output, and its
input checks), none at all with ``num_tokens=`` and ``check=False``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..schema import Choice, RLBatch, SchemaError, SpanTable

_KEY_SHIFT = 32  # token key = sample << 32 | position: sorts like (sample, position)


class Estimator(Choice):
    """Group-relative advantage estimators of ``group_advantages``."""

    GRPO = "grpo"  # (s - mean_g) / (std_g + eps)
    DR_GRPO = "dr_grpo"  # s - mean_g
    RLOO = "rloo"  # s - mean of the group's other scores


class RewardPlacement(Choice):
    """Where ``scatter_rewards`` puts a value over its span's loss tokens."""

    LAST = "last"  # on the last loss token (verl's convention)
    SPREAD = "spread"  # split evenly over the loss tokens (sums are kept)


@dataclass(frozen=True)
class SpanReward:
    """One value per span of ``spans``, placed on the loss tokens inside that span.

    ``mode="last"``: on the span's last loss token (a turn's reward at the end of its action);
    ``"spread"``: split evenly over the span's loss tokens (a region's reward on its tokens).
    Spans of one table must not overlap within a sample.
    """

    spans: SpanTable
    values: Tensor
    mode: str = "spread"
    name: str = "span rewards"


# ----------------------------------------------------------------------------- scatter
def overlong_penalty(lengths: Tensor, max_length: int, buffer: int) -> Tensor:
    """DAPO's soft overlong penalty: 0 up to ``max_length - buffer`` tokens, then linear to -1
    at ``max_length``, and -1 beyond."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"length_penalty=(max_length={max_length}, buffer={buffer}): need 0 < buffer <= max_length")
    return torch.clamp(((max_length - buffer) - lengths.to(torch.float32)) / buffer, min=-1.0, max=0.0)


def scatter_rewards(
    loss_spans,
    rewards: Optional[Tensor] = None,
    *,
    mode: str = "last",
    spans: Sequence[SpanReward] = (),
    length_penalty: Optional[tuple[int, int]] = None,
    num_tokens: Optional[int] = None,
    check: bool = True,
) -> Tensor:
    """Per-loss-token rewards, float32 ``[n]`` in loss-token order.

    ``loss_spans``: the batch's loss ``SpanTable`` (or an ``RLBatch``: then ``rewards``
    defaults to ``batch.rewards`` and ``spans`` to its region rewards, spread, and turn
    rewards, on each action's last token). ``rewards``: ``[B]`` sequence rewards, placed by
    ``mode`` (``"last"``: verl's last-token convention; ``"spread"``: r / n_b on each of the
    sample's n_b loss tokens, so sums are kept). ``length_penalty=(max_length, buffer)``
    adds ``overlong_penalty`` of each sample's loss-token count to its sequence reward.

    ``check=True`` validates in one host read: finite values, spans that do not overlap,
    and no non-zero reward on a sample or span without loss tokens (it would be lost).
    """
    table, rewards, spans = _resolve_target(loss_spans, rewards, spans)
    mode = RewardPlacement.parse(mode, "mode")
    B, dev = table.num_samples, table.device
    lengths = table.lengths().long()
    cum = torch.cumsum(lengths, 0)
    if num_tokens is None:
        num_tokens = int(cum[-1]) if lengths.numel() else 0
    n = num_tokens
    span_first = cum - lengths
    span_id = torch.repeat_interleave(torch.arange(table.num_spans, device=dev), lengths, output_size=n)
    sample = table.span_sample()[span_id]
    position = torch.arange(n, device=dev) - span_first[span_id] + table.starts.long()[span_id]
    keys = (sample << _KEY_SHIFT) | position

    out = torch.zeros(n, dtype=torch.float32, device=dev)
    problems = []  # (what, bad flags [k], sample [k], values [k]) for the check
    if rewards is not None or length_penalty is not None:
        seq = torch.zeros(B, dtype=torch.float32, device=dev) if rewards is None else _values("rewards", rewards, B, dev)
        if length_penalty is not None:
            counts = torch.searchsorted(keys, torch.arange(1, B + 1, device=dev) << _KEY_SHIFT) - torch.searchsorted(
                keys, torch.arange(B, device=dev) << _KEY_SHIFT
            )
            seq = seq + overlong_penalty(counts, *length_penalty)
        whole = torch.arange(B, device=dev)
        contrib, empty = _place(keys, whole, torch.zeros(B, dtype=torch.long, device=dev),
                                torch.full((B,), (1 << _KEY_SHIFT) - 1, dtype=torch.long, device=dev), seq, mode)
        out = out + contrib
        if check:
            problems.append(("rewards", (empty & (seq != 0)) | ~torch.isfinite(seq), whole, seq))
    for sr in spans:
        placement = RewardPlacement.parse(sr.mode, f"{sr.name}: mode")
        t = sr.spans.to(dev)
        if t.num_samples != B:
            raise SchemaError(f"{sr.name}: its span table covers {t.num_samples} samples; the loss spans cover {B}")
        values = _values(sr.name, sr.values, t.num_spans, dev)
        s_sample = t.span_sample()
        contrib, empty = _place(keys, s_sample, t.starts.long(), t.ends.long(), values, placement)
        out = out + contrib
        if check:
            overlap = torch.zeros(t.num_spans, dtype=torch.bool, device=dev)
            if t.num_spans > 1:
                overlap[1:] = (s_sample[1:] == s_sample[:-1]) & (t.starts[1:] < t.ends[:-1])
            problems.append((sr.name, (empty & (values != 0)) | ~torch.isfinite(values) | overlap, s_sample, values))
    if check and problems:
        flags = torch.stack([p[1].any() for p in problems]).tolist()
        for (what, bad, owner, values), hit in zip(problems, flags):
            if hit:
                _raise_problem(what, bad, owner, table, spans, values)
    return out


def _resolve_target(target, rewards, spans):
    if isinstance(target, SpanTable):
        return target, rewards, list(spans)
    if not isinstance(target, RLBatch):
        raise TypeError(f"scatter_rewards takes a loss SpanTable or an RLBatch, got {type(target).__name__}")
    batch = target
    if rewards is None:
        rewards = batch.rewards
    spans = list(spans)
    if not spans:
        if batch.region_spans is not None and batch.region_rewards is not None:
            spans.append(SpanReward(batch.region_spans, batch.region_rewards, "spread", "region_rewards"))
        if batch.action_spans is not None and batch.turn_rewards is not None:
            spans.append(SpanReward(batch.action_spans, batch.turn_rewards, "last", "turn_rewards"))
    return batch.loss_spans, rewards, spans


def _values(name: str, values: Tensor, count: int, device) -> Tensor:
    values = torch.as_tensor(values)
    if values.shape != (count,):
        raise SchemaError(f"{name} has shape {tuple(values.shape)}; expected ({count},), one value per entry")
    if not values.is_floating_point():
        raise SchemaError(f"{name} must be floating point, got {values.dtype}")
    return values.to(device=device, dtype=torch.float32)


def _place(keys: Tensor, sample: Tensor, start: Tensor, end: Tensor, values: Tensor, mode: str):
    """Contribution of ``values`` on spans (sample, [start, end)) to the tokens with sorted ``keys``.

    Token t lies in span j when j is the last span starting at or before it and t is before
    its end (spans of one sample are sorted and disjoint). Returns (per-token float32 [n],
    bool per span: the span holds no loss token).
    """
    n = keys.numel()
    lo_key = (sample << _KEY_SHIFT) | start
    hi_key = (sample << _KEY_SHIFT) | end
    first = torch.searchsorted(keys, lo_key)
    stop = torch.searchsorted(keys, hi_key)
    count = stop - first
    empty = count <= 0
    if values.numel() == 0 or n == 0:
        return torch.zeros(n, dtype=torch.float32, device=keys.device), empty
    j = torch.searchsorted(lo_key, keys, right=True) - 1
    jc = j.clamp(min=0)
    inside = (j >= 0) & (keys < hi_key[jc])
    if mode is RewardPlacement.LAST:
        hit = inside & (torch.arange(n, device=keys.device) == stop[jc] - 1)
        share = values[jc]
    else:
        hit = inside
        share = values[jc] / count[jc].clamp(min=1).to(torch.float32)
    return torch.where(hit, share, torch.zeros((), device=keys.device)), empty


def _raise_problem(what: str, bad: Tensor, owner: Tensor, table: SpanTable, spans: Sequence[SpanReward], values: Tensor):
    i = int(torch.nonzero(bad)[0])
    b = int(owner[i])
    value = float(values[i])
    if what == "rewards":
        where = f"rewards: sample {b} (loss spans {table.spans_of(b)})"
    else:
        sr = next(s for s in spans if s.name == what)
        where = f"{what}: sample {b}, span [{int(sr.spans.starts[i])}, {int(sr.spans.ends[i])})"
    if not math.isfinite(value):
        raise SchemaError(f"{where} has the value {value}; rewards must be finite")
    if what != "rewards" and i > 0 and int(owner[i - 1]) == b and int(sr.spans.starts[i]) < int(sr.spans.ends[i - 1]):
        raise SchemaError(f"{where} overlaps the span before it; spans of one table must be sorted and disjoint")
    raise SchemaError(f"{where} has the value {value} but covers no loss token; the reward would be lost")


# ----------------------------------------------------------------------------- advantages
def group_advantages(
    scores: Tensor,
    group_ids: Tensor,
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages of per-sample scores ``[B]`` or ``[B, K]`` (columns independent).

    ``grpo``: (s - mean_g) / (std_g + eps), std unbiased; ``dr_grpo``: s - mean_g;
    ``rloo``: (s - mean_g) * n_g / (n_g - 1), the score minus the mean of the others.
    A group of one follows verl: mean 0 and std 1 (GRPO: s / (1 + eps); RLOO: s).
    ``group_ids``: integer tensor ``[B]``, any values in any order (equal id = same group).
    The mean is taken about the group's first score, so a group of equal scores gets
    exactly 0. Same dtype as ``scores`` (computed in at least float32).
    """
    estimator = Estimator.parse(estimator, "estimator")
    if scores.ndim not in (1, 2):
        raise ValueError(f"scores must be [B] or [B, K], got shape {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be floating point, got {scores.dtype}")
    B = scores.shape[0]
    if group_ids.shape != (B,) or group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(
            f"group_ids must be an integer tensor of shape ({B},) (one group per sample), "
            f"got {group_ids.dtype} {tuple(group_ids.shape)}"
        )
    if group_ids.device != scores.device:
        raise ValueError(f"group_ids is on {group_ids.device}, scores on {scores.device}")
    work_dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    x = scores.to(work_dtype)
    if B == 0:
        return scores.clone()
    column = x if x.ndim == 2 else x[:, None]

    order = torch.argsort(group_ids, stable=True)
    g = group_ids[order]
    starts = torch.ones(B, dtype=torch.bool, device=x.device)
    starts[1:] = g[1:] != g[:-1]
    seg = torch.cumsum(starts, 0) - 1  # dense group of each sorted sample
    offsets = torch.searchsorted(seg, torch.arange(B + 1, device=x.device))
    n = torch.diff(offsets).to(work_dtype)[:, None]  # [B] segments, zero-size past the last group

    xs = column[order]
    first = xs[offsets[:-1].clamp(max=B - 1)]
    centred_sum = torch.segment_reduce(xs - first[seg], "sum", offsets=offsets, axis=0, unsafe=True)
    mean = first + centred_sum / n.clamp(min=1)
    singleton = n == 1
    mean = torch.where(singleton, torch.zeros((), dtype=work_dtype, device=x.device), mean)
    dev = xs - mean[seg]
    if estimator is Estimator.GRPO:
        var = torch.segment_reduce(dev * dev, "sum", offsets=offsets, axis=0, unsafe=True) / (n - 1).clamp(min=1)
        std = torch.where(singleton, torch.ones((), dtype=work_dtype, device=x.device), var.sqrt())
        adv_sorted = dev / (std[seg] + eps)
    elif estimator is Estimator.DR_GRPO:
        adv_sorted = dev
    else:
        scale = torch.where(singleton, torch.ones((), dtype=work_dtype, device=x.device), n / (n - 1).clamp(min=1))
        adv_sorted = dev * scale[seg]
    adv = torch.empty_like(adv_sorted)
    adv[order] = adv_sorted
    return adv.reshape(scores.shape).to(scores.dtype)
