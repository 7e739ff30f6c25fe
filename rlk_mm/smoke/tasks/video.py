"""The video-direction task (`--task video-direction`): a short clip of one square moving
left, right, up or down; "Which way does the shape move?", reward 1 for the right word."""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

from ...fixtures import Sample
from ...fixtures.palette import ANSWER_COLOURS
from .base import Task, numbered_draw
from .colour import colour_reward

__all__ = [
    "DIRECTIONS", "VIDEO_FRAMES", "VIDEO_FRAME_SIZE", "VIDEO_PROMPT", "VIDEO_SHAPE_SIDE", "direction_clip", "direction_sample",
    "video_direction_task",
]

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


def direction_sample(rng: random.Random, sample_id: str) -> Sample:
    """One prompt of the video-direction task: a clip and the question; the answer is the direction."""
    direction = rng.choice(DIRECTIONS)
    content = [{"type": "video"}, {"type": "text", "text": VIDEO_PROMPT}]
    return Sample(sample_id, [{"role": "user", "content": content}], videos=[direction_clip(rng, direction)], answer=direction)


def video_direction_task() -> Task:
    draw = numbered_draw("video", direction_sample)
    # the colour reward compares the stripped, lower-cased word with the answer: the same rule fits a direction
    return Task("video-direction", draw, colour_reward, lambda label: label, max_new_tokens=2)
