"""The drawn colour task (the default): "Which colour dominates the image?" over seeded
images in which one of four colours dominates (distractor shapes, varying sizes, sometimes
two images); reward 1 for the right colour word."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from ...fixtures import Sample
from ...fixtures.palette import ANSWER_COLOURS, SHAPE_COLOURS
from .base import Task, draw_shape, numbered_draw

__all__: list[str] = []

COLOURS = ANSWER_COLOURS
"""The answers: a colour word of the palette's four."""
DISTRACTOR_COLOURS = SHAPE_COLOURS
"""The smaller shapes' colours: the whole palette but the answer."""
PROMPT = "Which colour dominates the image? Answer with one word."
PROMPT_TWO = "Which colour dominates the images? Answer with one word."
IMAGE_SIZES = ((112, 112), (112, 84), (84, 112), (84, 84))
"""(width, height): 9 to 16 image tokens each at the processor's default pixel limits."""
SECOND_IMAGE_SIZES = ((56, 56), (84, 56), (56, 84))
TWO_IMAGE_RATE = 0.25
BACKGROUND_RATE = 0.7
"""How often the dominant colour is the background (else a large shape on a light one)."""


def _draw_colour_image(rng: random.Random, size, colour: str, background_rate: float) -> tuple[Image.Image, str]:
    """`colour` as the background or as one large shape on a light background, and 1-3
    smaller distractor shapes of other colours; the image and its case ("background" or
    "shape")."""
    width, height = size
    on_background = rng.random() < background_rate
    background = COLOURS[colour] if on_background else tuple(rng.randrange(200, 256) for _ in range(3))
    image = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(image)

    def shape(fill, frac_lo, frac_hi):
        w = max(4, int(width * rng.uniform(frac_lo, frac_hi)))
        h = max(4, int(height * rng.uniform(frac_lo, frac_hi)))
        x, y = rng.randrange(0, width - w + 1), rng.randrange(0, height - h + 1)
        draw_shape(draw, rng, (x, y, x + w - 1, y + h - 1), fill)

    if not on_background:
        shape(COLOURS[colour], 0.75, 0.95)
    others = [c for c in DISTRACTOR_COLOURS if c != colour]
    for _ in range(rng.randint(1, 3)):
        shape(DISTRACTOR_COLOURS[rng.choice(others)], 0.15, 0.4)
    return image, "background" if on_background else "shape"


def colour_pixels(images) -> dict[str, int]:
    """Pixels of exactly each of the four colours, over all images (RGB packed in one int)."""
    counts = dict.fromkeys(COLOURS, 0)
    for image in images:
        rgb = np.asarray(image, dtype=np.int32).reshape(-1, 3)
        values, freq = np.unique((rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2], return_counts=True)
        packed = dict(zip(values.tolist(), freq.tolist()))
        for name, (r, g, b) in COLOURS.items():
            counts[name] += packed.get((r << 16) | (g << 8) | b, 0)
    return counts


def colour_sample(rng: random.Random, sample_id: str, *, background_rate: float = BACKGROUND_RATE,
                  two_image_rate: float = TWO_IMAGE_RATE) -> Sample:
    """One prompt of the colour task; the dominant colour covers >= 1.5x the pixels of any
    other of the four colours (images are redrawn until it does). ``background_rate``: how
    often the colour is the background; ``two_image_rate``: how often a second image comes."""
    colour = rng.choice(list(COLOURS))
    while True:
        drawn = [_draw_colour_image(rng, rng.choice(IMAGE_SIZES), colour, background_rate)]
        if rng.random() < two_image_rate:
            drawn.append(_draw_colour_image(rng, rng.choice(SECOND_IMAGE_SIZES), colour, background_rate))
        images = [image for image, _ in drawn]
        counts = colour_pixels(images)
        runner_up = max(v for k, v in counts.items() if k != colour)
        if counts[colour] >= 1.5 * max(runner_up, 1):
            break
    content = [{"type": "image"} for _ in images]
    content.append({"type": "text", "text": PROMPT if len(images) == 1 else PROMPT_TWO})
    return Sample(sample_id, [{"role": "user", "content": content}], images=images, answer=colour,
                  meta={"pixels": counts, "cases": [case for _, case in drawn]})


def colour_reward(text: str, sample: Sample) -> float:
    """1 when the answer, stripped of spaces, case and a final full stop, is the colour word."""
    return float(text.strip().rstrip(".").strip().lower() == sample.answer)


def colour_diagnostics(rewards: list[float], samples: list[Sample]) -> dict:
    """A step's mean reward by answer colour (``reward_red``, ...) and by prompt kind
    (``reward_background``: one image, the colour its background; ``reward_shape``: one image,
    the colour a large shape; ``reward_two_images``); None where the step had none."""
    if len(rewards) != len(samples):
        raise ValueError(f"{len(rewards)} rewards for {len(samples)} samples: one reward per answer")

    def kind(s: Sample) -> str:
        cases = s.meta["cases"]
        return "two_images" if len(cases) > 1 else cases[0]

    groups = {f"reward_{c}": [r for r, s in zip(rewards, samples) if s.answer == c] for c in COLOURS}
    groups.update({f"reward_{k}": [r for r, s in zip(rewards, samples) if kind(s) == k]
                   for k in ("background", "shape", "two_images")})
    return {name: sum(rs) / len(rs) if rs else None for name, rs in groups.items()}


@dataclass
class ColourTask(Task):
    """The colour task, with its per-step reward by colour and by prompt kind."""

    def diagnostics(self, texts: list[str], rewards: list[float], samples: list[Sample]) -> dict:
        return colour_diagnostics(rewards, samples)


def colour_task(*, background_rate: float = BACKGROUND_RATE, two_image_rate: float = TWO_IMAGE_RATE) -> Task:
    draw = numbered_draw("colour", lambda rng, sample_id: colour_sample(
        rng, sample_id, background_rate=background_rate, two_image_rate=two_image_rate))
    # one word and <|im_end|>: two tokens, so a step's 64 answers fill one 128-row chunk of the CPU head
    return ColourTask("colour", draw, colour_reward, lambda label: label, max_new_tokens=2)
