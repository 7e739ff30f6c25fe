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
the host; ``scatter_rewards`` reads once (the token count, which sizes its output, with its
value checks), none at all with ``num_tokens=`` and ``check=False``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..deprecations import renamed_keywords
from ..schema import RLBatch, SchemaError, SpanTable
from ..schema.checks import (
    FLOAT_DTYPES,
    INTEGER_DTYPES,
    DeviceChecks,
    bool_arg,
    first_true,
    float_arg,
    int_arg,
    tensor_arg,
)
from ._backend import readable_args
from .options import Estimator, RewardPlacement

__all__ = ["Estimator", "RewardPlacement", "SpanReward", "group_advantages", "overlong_penalty", "scatter_rewards"]

_KEY_SHIFT = 32  # token key = sample << 32 | position: sorts like (sample, position)


@dataclass(frozen=True)
class SpanReward:
    """One value per span of ``spans``, placed on the loss tokens inside that span.

    Parameters
    ----------
    spans : SpanTable
        The spans (a region's, or a turn's action span); they must not overlap within a sample.
    values : Tensor
        A float tensor, one value per span.
    mode : RewardPlacement or str
        ``"last"``: on the span's last loss token (a turn's reward at the end of its action);
        ``"spread"``: split evenly over the span's loss tokens (a region's reward on its tokens).
    name : str
        Names the table in errors.

    Raises
    ------
    ValueError, TypeError
        When built, for values that do not match the spans or a bad ``mode``.
    """

    spans: SpanTable
    values: Tensor
    mode: str = "spread"
    name: str = "span rewards"

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"SpanReward name must be a str, got {type(self.name).__name__}")
        if not isinstance(self.spans, SpanTable):
            raise TypeError(f"SpanReward spans must be a SpanTable, got {type(self.spans).__name__}")
        _values(f"{self.name}: values", self.values, self.spans.num_spans)
        RewardPlacement.parse(self.mode, f"{self.name}: mode")


# ----------------------------------------------------------------------------- scatter
def overlong_penalty(lengths: Tensor, max_length: int, buffer: int) -> Tensor:
    """DAPO's soft overlong penalty of token counts.

    Parameters
    ----------
    lengths : Tensor
        Token counts, an integer tensor, >= 0.
    max_length : int
        The length at which the penalty reaches -1.
    buffer : int
        The penalty grows linearly over the last ``buffer`` tokens before ``max_length``.

    Returns
    -------
    Tensor
        0 up to ``max_length - buffer`` tokens, then linear to -1 at ``max_length``, and -1 beyond.

    Raises
    ------
    ValueError, TypeError
        For bad arguments or a negative length (one host read).
    """
    tensor_arg("lengths", lengths, dtypes=INTEGER_DTYPES)
    readable_args("overlong_penalty", lengths=lengths)
    max_length, buffer = _penalty_args(max_length, buffer)
    checks = DeviceChecks()

    def fail():
        i = first_true(lengths.reshape(-1) < 0)[0]
        raise ValueError(f"lengths[{i}] = {int(lengths.reshape(-1)[i])} is negative: lengths are token counts")

    checks.add((lengths < 0).any(), fail)
    checks.run()
    return _overlong(lengths, max_length, buffer)


def _penalty_args(max_length, buffer) -> tuple[int, int]:
    max_length = int_arg("max_length", max_length, min=1, max=_MAX_LENGTH)
    buffer = int_arg("buffer", buffer)
    if not 0 < buffer <= max_length:
        raise ValueError(f"buffer={buffer} is out of range: it must be > 0 and <= max_length={max_length}")
    return max_length, buffer


#: the largest ``max_length``: the penalty's differences of token counts stay within int64
_MAX_LENGTH = 2**62


def _overlong(lengths: Tensor, max_length: int, buffer: int) -> Tensor:
    # the difference in int64 (exact), then float32: a count above 2^24 is not rounded before it
    return torch.clamp(((max_length - buffer) - lengths.long()).to(torch.float32) / buffer, min=-1.0, max=0.0)


@renamed_keywords
def scatter_rewards(
    batch: RLBatch | SpanTable,
    rewards: Optional[Tensor] = None,
    *,
    mode: RewardPlacement | str = RewardPlacement.LAST,
    spans: Sequence[SpanReward] = (),
    length_penalty: Optional[tuple[int, int]] = None,
    num_tokens: Optional[int] = None,
    check: bool = True,
) -> Tensor:
    """Per-loss-token rewards, float32 ``[n]`` in loss-token order.

    Parameters
    ----------
    batch : RLBatch or SpanTable
        An ``RLBatch`` (then ``rewards`` defaults to ``batch.rewards`` and ``spans`` to its region
        rewards, spread, and turn rewards, on each action's last token), or just its loss
        ``SpanTable`` (``batch.loss_spans``; ``loss_spans=`` is the deprecated old name).
    rewards : Tensor, optional
        ``[B]`` sequence rewards, placed by ``mode``.
    mode : RewardPlacement or str
        ``"last"``: verl's last-token convention; ``"spread"``: r / n_b on each of the sample's n_b
        loss tokens, so sums are kept.
    spans : sequence of SpanReward
        Region and turn rewards.
    length_penalty : tuple of int, optional
        ``(max_length, buffer)``: adds ``overlong_penalty`` of each sample's loss-token count to its
        sequence reward.
    num_tokens : int, optional
        The number of loss tokens, if known.
    check : bool
        Validate, in the one host read that also counts the loss tokens. With ``num_tokens=`` and
        ``check=False`` nothing is read, and ``num_tokens`` is trusted.

    Returns
    -------
    Tensor
        float32 ``[n]``.

    Raises
    ------
    ValueError, TypeError
        With ``check``: non-finite values, overlapping spans, a non-zero reward on a sample or span
        without loss tokens (it would be lost), or ``num_tokens`` unequal to the count.
    """
    table, rewards, spans = _resolve_target(batch, rewards, spans)
    readable_args("scatter_rewards", rewards=rewards, **{f"{sr.name}: values": sr.values for sr in spans})
    mode = RewardPlacement.parse(mode, "mode")
    check = bool_arg("check", check)
    if num_tokens is not None:
        num_tokens = int_arg("num_tokens", num_tokens, min=0)
    B, dev = table.num_samples, table.device
    if rewards is not None:
        rewards = _values("rewards", rewards, B).to(device=dev, dtype=torch.float32)
    if length_penalty is not None:
        if not isinstance(length_penalty, (tuple, list)) or len(length_penalty) != 2:
            raise TypeError(f"length_penalty must be a pair (max_length, buffer), got {length_penalty!r}")
        length_penalty = _penalty_args(*length_penalty)
    for sr in spans:
        if sr.spans.num_samples != B:
            raise SchemaError(f"{sr.name}: its span table covers {sr.spans.num_samples} samples; the loss spans {B}")

    lengths = table.lengths().long()
    cum = torch.cumsum(lengths, 0)
    seq = None
    if rewards is not None or length_penalty is not None:
        seq = torch.zeros(B, dtype=torch.float32, device=dev) if rewards is None else rewards
        if length_penalty is not None:
            seq = seq + _overlong(table.token_counts(), *length_penalty)
    span_rewards = [(sr, sr.spans.to(dev), sr.values.to(device=dev, dtype=torch.float32)) for sr in spans]
    if check or num_tokens is None:
        n = _read_count_and_check(table, lengths, cum, seq, span_rewards, num_tokens, check)
    else:
        n = num_tokens

    try:
        span_id = torch.repeat_interleave(torch.arange(table.num_spans, device=dev), lengths, output_size=n)
    except RuntimeError:  # a trusted num_tokens (check=False) that is not the count, where torch notices it
        raise ValueError(f"num_tokens={n} is not the loss spans' token count (check=False trusts it): pass the count "
                         "(batch.loss_spans.lengths().sum()), or leave it out") from None
    sample = table.span_sample()[span_id]
    position = torch.arange(n, device=dev) - (cum - lengths)[span_id] + table.starts.long()[span_id]
    keys = (sample << _KEY_SHIFT) | position
    out = torch.zeros(n, dtype=torch.float32, device=dev)
    if seq is not None:
        whole = torch.arange(B, device=dev)
        out = out + _place(keys, whole, torch.zeros(B, dtype=torch.long, device=dev),
                           torch.full((B,), (1 << _KEY_SHIFT) - 1, dtype=torch.long, device=dev), seq, mode)
    for sr, t, values in span_rewards:
        placement = RewardPlacement.parse(sr.mode, "mode")
        out = out + _place(keys, t.span_sample(), t.starts.long(), t.ends.long(), values, placement)
    return out


def _resolve_target(target, rewards, spans):
    if isinstance(target, RLBatch):
        if rewards is None:
            rewards = target.rewards
        if not spans:
            spans = []
            if target.region_spans is not None and target.region_rewards is not None:
                spans.append(SpanReward(target.region_spans, target.region_rewards, "spread", "region_rewards"))
            if target.action_spans is not None and target.turn_rewards is not None:
                spans.append(SpanReward(target.action_spans, target.turn_rewards, "last", "turn_rewards"))
        target = target.loss_spans
    if not isinstance(target, SpanTable):
        raise TypeError(f"batch must be an RLBatch or its loss_spans SpanTable, got {type(target).__name__}")
    if not isinstance(spans, (list, tuple)):
        raise TypeError(f"spans must be a list or tuple of SpanReward, got {type(spans).__name__}")
    for k, sr in enumerate(spans):
        if not isinstance(sr, SpanReward):
            raise TypeError(f"spans[{k}] must be a SpanReward, got {type(sr).__name__}")
    return target, rewards, list(spans)


def _values(name: str, values, count: int) -> Tensor:
    tensor_arg(name, values)
    if values.shape != (count,):
        raise SchemaError(f"{name} has shape {tuple(values.shape)}; expected ({count},), one value per entry")
    if values.dtype not in FLOAT_DTYPES:
        raise SchemaError(f"{name} must be floating point, got {values.dtype}")
    return values


def _loss_tokens_in(table: SpanTable, lengths: Tensor, cum: Tensor, sample: Tensor, start: Tensor, end: Tensor):
    """int64: the loss tokens of ``table`` inside each span (sample, [start, end)), counted from
    the loss spans' bounds (without listing the tokens)."""
    if table.num_spans == 0:
        return torch.zeros_like(sample)
    lo = (table.span_sample() << _KEY_SHIFT) | table.starts.long()

    def before(keys: Tensor) -> Tensor:  # loss tokens at keys below each key
        j = torch.searchsorted(lo, keys, right=True) - 1  # the last loss span starting at or before the key
        jc = j.clamp(min=0)
        inside = (keys - lo[jc]).clamp(min=0).minimum(lengths[jc])  # a span of an earlier sample counts whole
        return torch.where(j >= 0, cum[jc] - lengths[jc] + inside, 0)

    return before((sample << _KEY_SHIFT) | end) - before((sample << _KEY_SHIFT) | start)


def _read_count_and_check(table, lengths, cum, seq, span_rewards, num_tokens, check) -> int:
    """The loss-token count, read with the value checks in one host sync; raises on a problem."""
    problems = []  # (what, bad flags [k], owner sample [k], values [k])
    if check:
        if seq is not None:
            problems.append(("rewards", (table.token_counts() == 0) & (seq != 0) | ~torch.isfinite(seq), None, seq))
        for sr, t, values in span_rewards:
            s_sample = t.span_sample()
            empty = _loss_tokens_in(table, lengths, cum, s_sample, t.starts.long(), t.ends.long()) == 0
            overlap = torch.zeros(t.num_spans, dtype=torch.bool, device=values.device)
            if t.num_spans > 1:
                overlap[1:] = (s_sample[1:] == s_sample[:-1]) & (t.starts[1:] < t.ends[:-1])
            problems.append((sr, (empty & (values != 0)) | ~torch.isfinite(values) | overlap, s_sample, values))
    total = cum[-1] if cum.numel() else cum.new_zeros(())
    n, *hits = torch.stack([total, *(p[1].any().long() for p in problems)]).tolist()  # the one sync
    if num_tokens is not None and num_tokens != n:
        raise ValueError(f"num_tokens={num_tokens} but the loss spans hold {n} tokens: pass that, or leave it out")
    for (what, bad, owner, values), hit in zip(problems, hits):
        if hit:
            _raise_problem(what, bad, owner, table, values)
    return n


def _place(keys: Tensor, sample: Tensor, start: Tensor, end: Tensor, values: Tensor, mode: str) -> Tensor:
    """Contribution (float32 [n]) of ``values`` on spans (sample, [start, end)) to the tokens with sorted ``keys``.

    Token t lies in span j when j is the last span starting at or before it and t is before
    its end (spans of one sample are sorted and disjoint).
    """
    n = keys.numel()
    if values.numel() == 0 or n == 0:
        return torch.zeros(n, dtype=torch.float32, device=keys.device)
    lo_key = (sample << _KEY_SHIFT) | start
    hi_key = (sample << _KEY_SHIFT) | end
    first = torch.searchsorted(keys, lo_key)
    stop = torch.searchsorted(keys, hi_key)
    j = torch.searchsorted(lo_key, keys, right=True) - 1
    jc = j.clamp(min=0)
    inside = (j >= 0) & (keys < hi_key[jc])
    if mode is RewardPlacement.LAST:
        hit = inside & (torch.arange(n, device=keys.device) == stop[jc] - 1)
        share = values[jc]
    else:
        hit = inside
        share = values[jc] / (stop - first)[jc].clamp(min=1).to(torch.float32)
    return torch.where(hit, share, torch.zeros((), device=keys.device))


def _raise_problem(what, bad: Tensor, owner: Optional[Tensor], table: SpanTable, values: Tensor):
    i = first_true(bad)[0]
    value = float(values[i])
    if isinstance(what, str):  # "rewards"
        where = f"rewards: sample {i} (loss spans {table.spans_of(i)})"
    else:
        b, spans = int(owner[i]), what.spans
        where = f"{what.name}: sample {b}, span [{int(spans.starts[i])}, {int(spans.ends[i])})"
    if not math.isfinite(value):
        raise SchemaError(f"{where} has the value {value}; rewards must be finite")
    if not isinstance(what, str) and i > 0 and int(owner[i - 1]) == b and int(spans.starts[i]) < int(spans.ends[i - 1]):
        raise SchemaError(f"{where} overlaps the span before it; spans of one table must be sorted and disjoint")
    raise SchemaError(f"{where} has the value {value} but covers no loss token; the reward would be lost")


# ----------------------------------------------------------------------------- advantages
def group_advantages(
    scores: Tensor,
    group_ids: Optional[Tensor] = None,
    *,
    batch: Optional[RLBatch] = None,
    estimator: Estimator | str = Estimator.GRPO,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages of per-sample scores ``[B]`` or ``[B, K]`` (columns independent).

    Parameters
    ----------
    scores : Tensor
        ``[B]`` or ``[B, K]`` float scores.
    group_ids : Tensor, optional
        An integer tensor ``[B]``, any values in any order (equal id = same group).
    batch : RLBatch, optional
        Instead of ``group_ids``: its ``group_index()`` (verl's ``uid``s as dense numbers). One of
        the two.
    estimator : Estimator or str
        ``grpo``: (s - mean_g) / (std_g + eps), std unbiased; ``dr_grpo``: s - mean_g; ``rloo``:
        (s - mean_g) * n_g / (n_g - 1), the score minus the mean of the others. A group of one
        follows verl: mean 0 and std 1 (GRPO: s / (1 + eps); RLOO: s).
    eps : float
        > 0 in the scores' dtype (at least its smallest normal number).

    Returns
    -------
    Tensor
        The scores' shape and dtype (computed in at least float32). The mean is taken about the
        group's first score, so a group of equal scores gets exactly 0.

    Raises
    ------
    ValueError, TypeError
        For bad arguments (both or neither of ``group_ids`` and ``batch``, a bad ``eps``).

    Notes
    -----
    Never reads the device: scores are not checked for finiteness; a NaN or infinite score makes its
    own group's advantages NaN (other groups are unaffected).
    """
    tensor_arg("scores", scores, dtypes=FLOAT_DTYPES)
    group_ids = groups_of(group_ids, batch, scores.device)
    estimator = Estimator.parse(estimator, "estimator")
    if scores.ndim not in (1, 2):
        raise ValueError(f"scores must be [B] or [B, K], got shape {tuple(scores.shape)}")
    work_dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    eps = float_arg("eps", eps, min=torch.finfo(work_dtype).tiny)  # > 0 once rounded: equal scores give 0, not 0/0
    B = scores.shape[0]
    if group_ids.shape != (B,) or group_ids.dtype not in INTEGER_DTYPES:
        raise ValueError(
            f"group_ids must be an integer tensor of shape ({B},) (one group per sample), "
            f"got {group_ids.dtype} {tuple(group_ids.shape)}"
        )
    if group_ids.device != scores.device:
        raise ValueError(f"group_ids is on {group_ids.device}, scores on {scores.device}")
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
        # the squares overflow for deviations beyond ~1e19 (float32): there, the std of the deviations
        # scaled by their largest (finite) one, times it; elsewhere the bits above
        big = torch.segment_reduce(dev.abs(), "max", offsets=offsets, axis=0, unsafe=True)
        scaled = dev / big[seg]
        var_scaled = torch.segment_reduce(scaled * scaled, "sum", offsets=offsets, axis=0, unsafe=True)
        std = torch.where(torch.isinf(var) & torch.isfinite(big), big * (var_scaled / (n - 1).clamp(min=1)).sqrt(), std)
        adv_sorted = dev / (std[seg] + eps)
    elif estimator is Estimator.DR_GRPO:
        adv_sorted = dev
    else:
        scale = torch.where(singleton, torch.ones((), dtype=work_dtype, device=x.device), n / (n - 1).clamp(min=1))
        adv_sorted = dev * scale[seg]
    adv = torch.empty_like(adv_sorted)
    adv[order] = adv_sorted
    return adv.reshape(scores.shape).to(scores.dtype)


def groups_of(group_ids: Optional[Tensor], batch: Optional[RLBatch], device: torch.device) -> Tensor:
    """The group ids of an advantage call: ``group_ids`` (checked to be a tensor), or
    ``batch.group_index()`` on ``device``; exactly one of the two."""
    if batch is None:
        if group_ids is None:
            raise TypeError("give the groups: group_ids (an integer tensor [B]) or batch= (an RLBatch)")
        return tensor_arg("group_ids", group_ids)
    if group_ids is not None:
        raise TypeError("give either group_ids or batch=, not both (with batch=, the groups are batch.group_index())")
    if not isinstance(batch, RLBatch):
        raise TypeError(f"batch must be an RLBatch, got {type(batch).__name__}")
    return batch.group_index().to(device)
