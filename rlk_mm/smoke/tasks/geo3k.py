"""The Geo3K task (`--task geo3k`, `--data DIR` or the package's sample): Geometry3K problems with a `\\boxed{}`
instruction and a Geo3K-style reward (0.9 accuracy + 0.1 format)."""

from __future__ import annotations

import math
import re
from typing import Optional

from ...fixtures import Sample, load_geo3k
from .base import Task

__all__: list[str] = []

GEO3K_INSTRUCTION = " Give the final answer in \\boxed{}."
GEO3K_FORMAT_WEIGHT = 0.1


def _last_boxed(text: str) -> Optional[str]:
    """The content of the last `\\boxed{...}` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _normalize_answer(text: str) -> str:
    return re.sub(r"\s+|\$|\\[,;!]|\\left|\\right", "", text).lower()


def geo3k_reward(text: str, sample: Sample) -> float:
    """Geo3K-style: 0.9 x accuracy (the last `\\boxed{}` equals the answer as a number, or
    as a string up to spaces and case) + 0.1 x format (a `\\boxed{}` is present)."""
    boxed = _last_boxed(text)
    if boxed is None:
        return 0.0
    got, want = _normalize_answer(boxed), _normalize_answer(sample.answer)
    try:
        correct = math.isclose(float(got), float(want), rel_tol=1e-4, abs_tol=1e-6)
    except ValueError:
        correct = got == want
    return (1 - GEO3K_FORMAT_WEIGHT) * float(correct) + GEO3K_FORMAT_WEIGHT


def _geo3k_prompt(sample: Sample) -> Sample:
    content = list(sample.messages[0]["content"])
    content.append({"type": "text", "text": GEO3K_INSTRUCTION})
    return Sample(sample.id, [{"role": "user", "content": content}], images=sample.images, answer=sample.answer, meta=sample.meta)


def geo3k_task(path) -> Task:
    problems = [_geo3k_prompt(s) for s in load_geo3k(path)]
    return Task(
        "geo3k",
        lambda rng, n, stream: [rng.choice(problems) for _ in range(n)],
        geo3k_reward,
        lambda label: f"\\boxed{{{label}}}",
        max_new_tokens=24,
    )
