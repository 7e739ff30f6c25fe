"""The smoke tasks: the drawn colour task (default), Geo3K and the video-direction task,
each with its reward, and `TASKS`, the registry `--task` chooses from.

A `Task` hands out prompts, scores answers and names the warm-up answer of a label."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from PIL import Image, ImageDraw

from ..fixtures import Sample, load_geo3k
from .point_task import POINT_TASKS
from .task import Task, draw_shape, numbered_draw


# ----------------------------------------------------------------------------- the colour task
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
DISTRACTOR_COLOURS = {**COLOURS, "purple": (140, 60, 170), "orange": (240, 130, 30)}
PROMPT = "Which colour dominates the image? Answer with one word."
PROMPT_TWO = "Which colour dominates the images? Answer with one word."
IMAGE_SIZES = ((112, 112), (112, 84), (84, 112), (84, 84))
"""(width, height): 9 to 16 image tokens each at the processor's default pixel limits."""
SECOND_IMAGE_SIZES = ((56, 56), (84, 56), (56, 84))
TWO_IMAGE_RATE = 0.25
BACKGROUND_RATE = 0.7
"""How often the dominant colour is the background (else a large shape on a light one)."""


def _draw_colour_image(rng: random.Random, size, colour: str) -> Image.Image:
    """`colour` as the background or as one large shape on a light background, and 1-3
    smaller distractor shapes of other colours."""
    width, height = size
    on_background = rng.random() < BACKGROUND_RATE
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
    return image


def _colour_pixels(images) -> dict[str, int]:
    """Pixels of exactly each of the four colours, over all images (RGB packed in one int)."""
    counts = dict.fromkeys(COLOURS, 0)
    for image in images:
        rgb = np.asarray(image, dtype=np.int32).reshape(-1, 3)
        values, freq = np.unique((rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2], return_counts=True)
        packed = dict(zip(values.tolist(), freq.tolist()))
        for name, (r, g, b) in COLOURS.items():
            counts[name] += packed.get((r << 16) | (g << 8) | b, 0)
    return counts


def colour_sample(rng: random.Random, sample_id: str) -> Sample:
    """One prompt of the colour task; the dominant colour covers >= 1.5x the pixels of any
    other of the four colours (images are redrawn until it does)."""
    colour = rng.choice(list(COLOURS))
    while True:
        images = [_draw_colour_image(rng, rng.choice(IMAGE_SIZES), colour)]
        if rng.random() < TWO_IMAGE_RATE:
            images.append(_draw_colour_image(rng, rng.choice(SECOND_IMAGE_SIZES), colour))
        counts = _colour_pixels(images)
        runner_up = max(v for k, v in counts.items() if k != colour)
        if counts[colour] >= 1.5 * max(runner_up, 1):
            break
    content = [{"type": "image"} for _ in images]
    content.append({"type": "text", "text": PROMPT if len(images) == 1 else PROMPT_TWO})
    return Sample(sample_id, [{"role": "user", "content": content}], images=images, answer=colour, meta={"pixels": counts})


def colour_reward(text: str, sample: Sample) -> float:
    """1 when the answer, stripped of spaces, case and a final full stop, is the colour word."""
    return float(text.strip().rstrip(".").strip().lower() == sample.answer)


# ----------------------------------------------------------------------------- Geo3K
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


def colour_task() -> Task:
    draw = numbered_draw("colour", colour_sample)
    # one word and <|im_end|>: two tokens, so a step's 64 answers fill one 128-row chunk of the CPU head
    return Task("colour", draw, colour_reward, lambda label: label, max_new_tokens=2)


def geo3k_task(path) -> Task:
    problems = [_geo3k_prompt(s) for s in load_geo3k(path)]
    return Task(
        "geo3k",
        lambda rng, n, stream: [rng.choice(problems) for _ in range(n)],
        geo3k_reward,
        lambda label: f"\\boxed{{{label}}}",
        max_new_tokens=24,
    )


# ----------------------------------------------------------------------------- video direction
DIRECTIONS = ("left", "right", "up", "down")
VIDEO_PROMPT = "Which way does the shape move? Answer with one word."
VIDEO_FRAME_SIZE = (56, 56)
"""(width, height) of a frame: 2 x 2 merged tokens per temporal patch at the default pixel limits."""
VIDEO_FRAMES = 4
"""Frames per clip: 2 temporal patches (Qwen stacks frame pairs), 8 video tokens."""
VIDEO_SHAPE_SIDE = 14


def direction_clip(rng: random.Random, direction: str) -> list[Image.Image]:
    """`VIDEO_FRAMES` frames of one square moving `direction` across a plain background at
    a steady pace (random colours, random position across the motion)."""
    width, height = VIDEO_FRAME_SIZE
    side = VIDEO_SHAPE_SIDE
    background = tuple(rng.randrange(200, 256) for _ in range(3))
    colour = COLOURS[rng.choice(list(COLOURS))]
    across = rng.randrange(0, (height if direction in ("left", "right") else width) - side + 1)
    travel = (width if direction in ("left", "right") else height) - side
    frames = []
    for f in range(VIDEO_FRAMES):
        along = travel * f // (VIDEO_FRAMES - 1)
        if direction in ("left", "up"):
            along = travel - along
        x, y = (along, across) if direction in ("left", "right") else (across, along)
        frame = Image.new("RGB", VIDEO_FRAME_SIZE, background)
        ImageDraw.Draw(frame).rectangle((x, y, x + side - 1, y + side - 1), fill=colour)
        frames.append(frame)
    return frames


def direction_sample(rng: random.Random, sample_id: str) -> Sample:
    """One prompt of the video-direction task: a clip and the question; the answer is the direction."""
    direction = rng.choice(DIRECTIONS)
    content = [{"type": "video"}, {"type": "text", "text": VIDEO_PROMPT}]
    return Sample(sample_id, [{"role": "user", "content": content}], videos=[direction_clip(rng, direction)], answer=direction)


def video_direction_task() -> Task:
    draw = numbered_draw("video", direction_sample)
    # the colour reward compares the stripped, lower-cased word with the answer: the same rule fits a direction
    return Task("video-direction", draw, colour_reward, lambda label: label, max_new_tokens=2)


# ----------------------------------------------------------------------------- the registry
def _geo3k_from(data: Optional[Path]) -> Task:
    if data is None:
        raise ValueError("the geo3k task needs --data DIR (a Geo3K folder: problems.jsonl + images, e.g. ../shared/geo3k)")
    return geo3k_task(data)



TASKS: dict[str, Callable[[Optional[Path]], Task]] = {
    "colour": lambda data: colour_task(),
    "geo3k": _geo3k_from,
    "video-direction": lambda data: video_direction_task(),
    **POINT_TASKS,
}
"""`--task` name -> factory(the `--data` folder or None) -> Task. A new task registers here."""
DATA_TASKS = ("geo3k",)
"""The tasks that read `--data` (the others refuse it)."""
