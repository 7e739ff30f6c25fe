"""A smoke task: what every task of ``tasks`` (and ``point_task``) hands the smoke test."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from ..fixtures import Sample
from ..schema.support import require_supported_messages


@dataclass
class Task:
    """Prompts, reward, warm-up answers and response length of one smoke task."""

    name: str
    draw: Callable[[random.Random, int, str], list[Sample]]  # (rng, n, stream) -> prompts
    reward: Callable[[str, Sample], float]
    answer_text: Callable[[str], str]  # a label -> the warm-up answer text
    max_new_tokens: int

    def batch(self, rng: random.Random, n: int, stream: str) -> list[Sample]:
        """``n`` prompts; a prompt with an audio part is refused (``UnsupportedModalityError``)."""
        prompts = self.draw(rng, n, stream)
        for s in prompts:
            require_supported_messages(s.messages, f"smoke task {self.name!r}, prompt {s.id!r}")
        return prompts
