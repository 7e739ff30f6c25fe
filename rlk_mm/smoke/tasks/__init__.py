"""The smoke tasks, one module each, and `TASKS`, the registry `--task` chooses from.

``base``: `Task` (prompts, reward, warm-up answer and response length of a task) and the
helpers the drawn tasks share; ``colour`` (the default), ``geo3k`` (`--data DIR`, else the
package's 3-problem sample),
``video`` (video-direction and its shuffled control) and ``point`` (grounding: point and point-three, each
with its shuffled control).
A new task registers in `TASKS` and in `task_settings.TASK_NAMES` (the parser's
choices, which `task_settings` holds without importing the tasks), with its settings there if any.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from ...fixtures import GEO3K_SAMPLE_DIR as GEO3K_SAMPLE_DIR
from ..task_settings import DATA_TASKS as DATA_TASKS
from ..task_settings import POINT_SETTINGS as POINT_SETTINGS
from ..task_settings import TASK_NAMES
from ..task_settings import TASK_SETTINGS as TASK_SETTINGS
from ..task_settings import VIDEO_SETTINGS as VIDEO_SETTINGS
from .base import Task as Task
from .base import draw_shape as draw_shape
from .base import numbered_draw as numbered_draw
from .colour import COLOURS as COLOURS
from .colour import colour_pixels as colour_pixels
from .colour import colour_reward as colour_reward
from .colour import colour_sample as colour_sample
from .colour import colour_task as colour_task
from .geo3k import geo3k_reward as geo3k_reward
from .geo3k import geo3k_task as geo3k_task
from .point import POINT_TASKS as POINT_TASKS
from .point import point_reward as point_reward
from .point import point_task as point_task
from .video import DIRECTIONS as DIRECTIONS
from .video import VIDEO_FRAMES as VIDEO_FRAMES
from .video import VIDEO_TASKS as VIDEO_TASKS
from .video import direction_clip as direction_clip
from .video import direction_sample as direction_sample
from .video import video_direction_task as video_direction_task

__all__: list[str] = []


def _colour(data: Optional[Path], tuning: Any = None) -> Task:
    if tuning is None:
        return colour_task()
    return colour_task(background_rate=tuning.background_rate, two_image_rate=tuning.two_image_rate)


TASKS: dict[str, Callable[[Optional[Path], Any], Task]] = {
    "colour": _colour,
    "geo3k": lambda data, tuning=None: geo3k_task(GEO3K_SAMPLE_DIR if data is None else data),
    **VIDEO_TASKS,
    **POINT_TASKS,
}
"""`--task` name -> factory(the `--data` folder or None, the run's `SmokeTuning`; None: the
defaults) -> Task. A new task registers here and in `task_settings.TASK_NAMES`.
Geo3K without `--data` reads the 3-problem sample in the package (`fixtures.GEO3K_SAMPLE_DIR`)."""
if set(TASKS) != set(TASK_NAMES):  # the parser's choices are task_settings.TASK_NAMES: keep the two in step
    raise ImportError(f"smoke tasks {sorted(set(TASKS) ^ set(TASK_NAMES))} are in tasks.TASKS or "
                      "task_settings.TASK_NAMES but not both: a task goes in both")
