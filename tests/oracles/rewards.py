"""Plain-Python references for reward scatter and group advantages: loops over samples,
spans and groups, float64, written from the definitions (oracle of the tests)."""

from __future__ import annotations

import math
from collections import defaultdict


def group_advantages(scores: list[float], groups: list[int], estimator: str, eps: float = 1e-6) -> list[float]:
    members = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    out = [0.0] * len(scores)
    for idx in members.values():
        vals = [scores[i] for i in idx]
        n = len(vals)
        if n == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(vals) / n
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
        for i in idx:
            if estimator == "grpo":
                out[i] = (scores[i] - mean) / (std + eps)
            elif estimator == "dr_grpo":
                out[i] = scores[i] - mean
            else:  # rloo: the score minus the mean of the group's other scores
                out[i] = scores[i] if n == 1 else scores[i] - (sum(vals) - scores[i]) / (n - 1)
    return out


def loss_tokens(loss_spans: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """(sample, position) of every loss token, in loss-span order."""
    return [(b, p) for b, spans in enumerate(loss_spans) for s, e in sorted(spans) for p in range(s, e)]


def place(tokens, spans_per_sample, values_per_sample, mode):
    """Values on spans -> per-token list: 'last' on the span's last loss token, 'spread' split evenly."""
    out = [0.0] * len(tokens)
    for b, spans in enumerate(spans_per_sample):
        for (s, e), v in zip(spans, values_per_sample[b]):
            hits = [i for i, (tb, p) in enumerate(tokens) if tb == b and s <= p < e]
            if not hits:
                continue
            if mode == "last":
                out[hits[-1]] += v
            else:
                for i in hits:
                    out[i] += v / len(hits)
    return out


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    if length <= max_length - buffer:
        return 0.0
    if length <= max_length:
        return ((max_length - buffer) - length) / buffer
    return -1.0
