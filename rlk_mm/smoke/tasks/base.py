"""The base of the smoke tasks: ``Task`` (what every task hands the smoke test) and the
helpers the drawn tasks share: ``numbered_draw`` and ``draw_shape``."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from PIL import ImageDraw

from ...fixtures import Sample
from ...schema.unsupported import require_supported_messages

__all__: list[str] = []


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

    def diagnostics(self, texts: list[str], rewards: list[float], samples: list[Sample]) -> dict:
        """Task-specific numbers for one step's answers (``texts``, ``rewards``, the prompt
        ``samples`` they answer), recorded per step in the smoke report; none by default."""
        return {}


def numbered_draw(prefix: str, make: Callable[[random.Random, str], Sample]):
    """A task's ``draw``: ``n`` prompts from ``make(rng, id)``, ids ``{prefix}-{stream}-{k}``
    numbered across calls."""
    counter = {"n": 0}

    def draw(rng: random.Random, n: int, stream: str) -> list[Sample]:
        out = []
        for _ in range(n):
            out.append(make(rng, f"{prefix}-{stream}-{counter['n']}"))
            counter["n"] += 1
        return out

    return draw


def draw_shape(draw: ImageDraw.ImageDraw, rng: random.Random, box: tuple[int, int, int, int], fill) -> None:
    """A rectangle, an ellipse or a triangle (``rng``'s choice) filling ``box`` (inclusive corners)."""
    x0, y0, x1, y1 = box
    kind = rng.choice(("rectangle", "ellipse", "triangle"))
    if kind == "rectangle":
        draw.rectangle(box, fill=fill)
    elif kind == "ellipse":
        draw.ellipse(box, fill=fill)
    else:
        draw.polygon([((x0 + x1 + 1) // 2, y0), (x0, y1), (x1, y1)], fill=fill)
