"""The grounding smoke tasks (`--task point`, `--task point-three`): click a shape on a synthetic screen.

A screen is three vertical strips, each on its own grey (``STRIP_SHADES``: the tiny policy's
only cue to where a shape lies). ``point`` draws one coloured shape (square, circle or
triangle) in a random strip; ``point-three`` one in every strip, of distinct colours. The
prompt names the colour and asks for a point in the model's convention (Qwen2.5-VL:
``{"point_2d": [x, y]}`` in pixels of the smart-resized image). The reward reads the point
with ``rlk_mm.grounding`` (the parser of ``parse_grounding``), converts it to the original
image's pixels, and is 1 when that pixel belongs to the rewarded shape (its drawn pixels, not
its box); malformed or out-of-range answers score 0, never clamped. Each has a ``-shuffled``
control whose reward ignores what is drawn, so only a position prior can be learned:
``point-shuffled`` rewards the shape moved to a random strip, ``point-three-shuffled`` a random
one of the three shapes. The tiny policy learns ``point``; ``point-three`` (binding the
colour word to a place) it does not learn even when supervised on the right points.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from ...fixtures import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, Sample
from ...fixtures.palette import ANSWER_COLOURS
from ...grounding import CONVENTION_SYSTEM, Convention, check_values, find_regions
from ...schema import CoordinateSystem, convert_points
from ..task_settings import POINT_SETTINGS as POINT_SETTINGS
from .base import Task, draw_shape, numbered_draw

__all__: list[str] = []

SCREEN_SIZES = ((90, 80), (96, 72), (80, 96), (72, 90))
"""(width, height): none a multiple of 28, so the processor resizes each (the answer's pixels are
not the screen's), all to 84 x 84: 3 x 3 image tokens, one token column per strip, so a strip's
x range in the answer's pixels is the same on every screen."""
PATCH_FACTOR = 28  # Qwen2(.5)-VL: patch 14 x merge 2
PROMPT = 'Click the {colour} shape. Answer with {{"point_2d": [x, y]}}.'
PROMPT_1000 = 'Click the {colour} shape. Answer with {{"point_2d": [x, y]}}, x and y from 0 to 1000.'
JSON_CONVENTIONS = (Convention.QWEN2_5_VL, Convention.UI_TARS_1_5, Convention.QWEN3_VL)


def resized_size(size: tuple[int, int]) -> tuple[int, int]:
    """(width, height) of a screen as the Qwen-VL image processor resizes it (default pixel limits)."""
    height, width = smart_resize(size[1], size[0], PATCH_FACTOR, DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    return width, height


def third_edges(width: int) -> list[int]:
    """The x edges of a screen's vertical thirds (4 values): one image-token column each once resized."""
    return [round(i * width / 3) for i in range(4)]


STRIP_SHADES = (250, 160, 70)
"""The grey of each vertical third's background, left to right: the tiny policy's only cue to
where a token lies, since its M-RoPE gives the width and height axes the lowest rotary
frequencies (``tests/smoke/test_point_task.py`` measures how little an image column turns a query).
Without the shades it does not learn the points even when supervised on them
(``bench/results/smoke_tasks/h200/2026-11-28-default.json``)."""


def draw_screen(rng: random.Random, size: tuple[int, int], strips: Sequence[int] = (0, 1, 2),
                ) -> tuple[Image.Image, dict[str, np.ndarray]]:
    """A screen of three vertical thirds shaded ``STRIP_SHADES``, with large shapes of distinct
    colours, one in each of the thirds ``strips`` (all three by default); each colour's pixel
    mask ([height, width] bool)."""
    width, height = size
    image = Image.new("RGB", size)
    draw = ImageDraw.Draw(image)
    edges = third_edges(width)
    for i, grey in enumerate(STRIP_SHADES):
        draw.rectangle((edges[i], 0, edges[i + 1] - 1, height - 1), fill=(grey,) * 3)
    colours = rng.sample(list(ANSWER_COLOURS), len(strips))
    for i, colour in zip(strips, colours):
        strip = edges[i + 1] - edges[i]
        w = rng.randrange(int(0.75 * strip), strip - 1)  # large shapes: a point in the right strip mostly hits
        h = rng.randrange(int(0.55 * height), int(0.85 * height))
        x = edges[i] + rng.randrange(1, strip - w)
        y = rng.randrange(1, height - h - 1)
        draw_shape(draw, rng, (x, y, x + w - 1, y + h - 1), ANSWER_COLOURS[colour])
    pixels = np.asarray(image, dtype=np.int16)
    masks = {c: (pixels == np.array(ANSWER_COLOURS[c])).all(-1) for c in colours}
    return image, masks


def answer_point(point: tuple[float, float], size: tuple[int, int], convention: Convention) -> str:
    """A point in a screen's original pixels as the answer writes it: "x, y" in the convention's
    coordinates of the screen as the processor resizes it, rounded to integers."""
    p = convert_points(torch.tensor(point, dtype=torch.float64), CoordinateSystem.ABSOLUTE, CONVENTION_SYSTEM[convention],
                       original_size=size, resized_size=resized_size(size))
    return ", ".join(str(int(round(v))) for v in p.tolist())


def mask_centre(mask: np.ndarray) -> tuple[float, float]:
    """(x, y) in pixels of a [height, width] bool mask's centre of mass (pixel centres at +0.5)."""
    ys, xs = np.nonzero(mask)
    return float(xs.mean()) + 0.5, float(ys.mean()) + 0.5


def moved_mask(mask: np.ndarray, shift: int) -> np.ndarray:
    """``mask`` moved ``shift`` pixels to the right (left when negative); what leaves the image is dropped."""
    out = np.zeros_like(mask)
    width = mask.shape[1]
    if shift >= 0:
        out[:, shift:] = mask[:, : width - shift]
    else:
        out[:, :shift] = mask[:, -shift:]
    return out


def _check_shapes(shapes) -> None:
    if isinstance(shapes, bool) or shapes not in (1, 3):
        raise ValueError(f"shapes={shapes!r}: a point screen holds 1 shape (point) or 3 (point-three)")


def point_sample(rng: random.Random, sample_id: str, convention: Convention, shuffled: bool, shapes: int = 1) -> Sample:
    """One prompt; ``answer`` is the target's centre in the convention's coordinates ("x, y"),
    ``meta`` the rewarded mask and the sizes the reward needs. ``shapes``: 1 (in a random third;
    the control rewards that shape moved to a random third: a place, not what is drawn) or 3
    (one per third; the control rewards a random one of them)."""
    _check_shapes(shapes)
    size = rng.choice(SCREEN_SIZES)
    strips = [rng.randrange(3)] if shapes == 1 else (0, 1, 2)
    image, masks = draw_screen(rng, size, strips)
    colour = rng.choice(sorted(masks))
    rewarded, mask = colour, masks[colour]
    if shuffled and shapes == 1:
        edges = third_edges(size[0])
        mask = moved_mask(mask, edges[rng.randrange(3)] - edges[strips[0]])
    elif shuffled:
        rewarded = rng.choice(sorted(masks))
        mask = masks[rewarded]
    text = (PROMPT_1000 if CONVENTION_SYSTEM[convention] is CoordinateSystem.NORMALIZED_1000 else PROMPT).format(colour=colour)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    answer = answer_point(mask_centre(masks[colour]), size, convention)
    meta = dict(convention=convention.value, colour=colour, rewarded=rewarded, mask=mask, masks=masks,
                size=size, resized=resized_size(size))
    return Sample(sample_id, messages, images=[image], answer=answer, meta=meta)


OUTCOMES = ("hit", "other shape", "background", "out of range", "malformed", "box", "no point")
"""What an answer's first box-or-point is: a point in the rewarded shape, in another shape, on
the background or outside the image; a malformed ``point_2d``; a box; nothing (the first
three are parsable answers, the rest parse failures)."""


def answer_syntax(text: str, convention="qwen2_5_vl") -> tuple[str, tuple]:
    """The answer's first box-or-point by syntax alone: ("point", values), ("malformed", ()),
    ("box", ()) or ("no point", ())."""
    found = find_regions(text.encode(), convention)
    if not found:
        return "no point", ()
    if found[0].reason:
        return "malformed", ()
    return ("point", found[0].values) if found[0].kind == "point" else ("box", ())


def point_outcome(text: str, sample: Sample) -> str:
    """Which of ``OUTCOMES`` the answer is (its first box-or-point, in the sample's convention)."""
    meta = sample.meta
    convention = Convention(meta["convention"])
    system = CONVENTION_SYSTEM[convention]
    kind, values = answer_syntax(text, convention)
    if kind != "point":
        return kind
    if check_values("point", values, system, meta["resized"]):
        return "out of range"
    x, y = convert_points(torch.tensor(values, dtype=torch.float64), system, CoordinateSystem.ABSOLUTE,
                          original_size=meta["size"], resized_size=meta["resized"]).tolist()
    width, height = meta["size"]
    col, row = min(int(x), width - 1), min(int(y), height - 1)  # x = width is the image's right edge: its last pixel
    if meta["mask"][row, col]:
        return "hit"
    return "other shape" if any(m[row, col] for m in meta["masks"].values()) else "background"


def point_reward(text: str, sample: Sample) -> float:
    """1 when the answer's first box-or-point is a point inside the rewarded shape, else 0."""
    return float(point_outcome(text, sample) == "hit")


def point_diagnostics(texts: list[str], rewards: list[float], convention="qwen2_5_vl") -> dict:
    """A step's answers by syntax: the share with a point (``parsable``), the parse failures by
    kind, and the mean reward of the answers with a point (None when none has one)."""
    if len(texts) != len(rewards):
        raise ValueError(f"{len(texts)} texts for {len(rewards)} rewards: one reward per answer")
    kinds = [answer_syntax(t, convention)[0] for t in texts]
    scored = [r for k, r in zip(kinds, rewards) if k == "point"]
    return dict(parsable=len(scored) / len(texts) if texts else None,
                failures={k: kinds.count(k) for k in ("malformed", "box", "no point")},
                parsable_reward=sum(scored) / len(scored) if scored else None)


@dataclass
class PointTask(Task):
    """The point task: a ``Task`` in a named convention, with per-step diagnostics of its answers."""

    convention: Convention = Convention.QWEN2_5_VL

    def diagnostics(self, texts: list[str], rewards: list[float], samples: list[Sample]) -> dict:
        return point_diagnostics(texts, rewards, self.convention)


def point_task(convention="qwen2_5_vl", *, shuffled: bool = False, shapes: int = 1) -> Task:
    """The point task in a JSON convention (``qwen2_5_vl`` by default, ``ui_tars_1_5``,
    ``qwen3_vl``): ``shapes`` 1 (``point``: click the one shape) or 3 (``point-three``: click
    the named one of three); ``shuffled``: the shuffled-target control."""
    _check_shapes(shapes)
    convention = Convention.parse(convention, "convention")
    if convention not in JSON_CONVENTIONS:
        raise ValueError(f"convention={convention.value}: the point task answers in JSON "
                         "(qwen2_5_vl, ui_tars_1_5, qwen3_vl); "
                         "the rollout decodes with skip_special_tokens, which would drop Qwen2-VL's <|box_start|> tags")
    name = "point" + ("-three" if shapes == 3 else "") + ("-shuffled" if shuffled else "")
    draw = numbered_draw(name, lambda rng, sample_id: point_sample(rng, sample_id, convention, shuffled, shapes))
    # '{"point_2d": [x, y]}' is 13-15 tokens, and EOS
    return PointTask(name, draw, point_reward, lambda label: '{"point_2d": [%s]}' % label, max_new_tokens=18,
                     convention=convention)


POINT_TASKS = {
    "point": lambda data, tuning=None: point_task(),
    "point-shuffled": lambda data, tuning=None: point_task(shuffled=True),
    "point-three": lambda data, tuning=None: point_task(shapes=3),
    "point-three-shuffled": lambda data, tuning=None: point_task(shuffled=True, shapes=3),
}
"""The `--task` entries of this module (in `tasks.TASKS`)."""

