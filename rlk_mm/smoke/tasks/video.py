"""The video-direction task (`--task video-direction`): a short clip of one square moving
left, right, up or down; "Which way does the shape move?", reward 1 for the right word.
``video-direction-shuffled`` is its control: the same clips, but the rewarded word is drawn at
random, independent of the motion, so only a prior over the words can be learned."""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

from ...fixtures import Sample
from ...fixtures.palette import ANSWER_COLOURS
from ..task_settings import VIDEO_SETTINGS as VIDEO_SETTINGS
from .base import Task, numbered_draw

__all__: list[str] = []

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
    colour = ANSWER_COLOURS[rng.choice(list(ANSWER_COLOURS))]
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


def direction_sample(rng: random.Random, sample_id: str, shuffled: bool = False) -> Sample:
    """One prompt of the video-direction task: a clip and the question; the answer is the
    direction, ``meta["rewarded"]`` the rewarded word (a random one when ``shuffled``)."""
    direction = rng.choice(DIRECTIONS)
    content = [{"type": "video"}, {"type": "text", "text": VIDEO_PROMPT}]
    clip = direction_clip(rng, direction)
    rewarded = rng.choice(DIRECTIONS) if shuffled else direction
    return Sample(sample_id, [{"role": "user", "content": content}], videos=[clip], answer=direction,
                  meta={"rewarded": rewarded})


def direction_reward(text: str, sample: Sample) -> float:
    """1 when the answer, stripped of spaces, case and a final full stop, is the rewarded direction word."""
    return float(text.strip().rstrip(".").strip().lower() == sample.meta["rewarded"])


def video_direction_task(*, shuffled: bool = False) -> Task:
    """The video-direction task; ``shuffled``: its control (the rewarded word drawn at random)."""
    name = "video-direction-shuffled" if shuffled else "video-direction"
    draw = numbered_draw(name, lambda rng, sample_id: direction_sample(rng, sample_id, shuffled))
    return Task(name, draw, direction_reward, lambda label: label, max_new_tokens=2)


VIDEO_TASKS = {
    "video-direction": lambda data, tuning=None: video_direction_task(),
    "video-direction-shuffled": lambda data, tuning=None: video_direction_task(shuffled=True),
}
"""The `--task` entries of this module (in `tasks.TASKS`)."""
