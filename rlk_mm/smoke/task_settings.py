"""The smoke tasks' names and the options each runs with unless given: what the command line's
parser needs, without the tasks' code (torch, Pillow, the fixtures), so that ``rlk-mm smoke
--help`` answers at once. ``tasks.TASKS`` holds the tasks themselves, under these names."""

from __future__ import annotations

__all__: list[str] = []

TASK_NAMES = ("colour", "geo3k", "video-direction", "video-direction-shuffled", "point", "point-shuffled",
              "point-three", "point-three-shuffled")
"""The `--task` names, the keys of ``tasks.TASKS`` (a new task goes in both)."""

POINT_SETTINGS = {"lr": 5e-4, "lr_warmup_steps": 20, "warmup_steps": 100, "temperature": 0.7, "steps": 400}
"""The smoke options the point tasks run with unless given: at higher learning rates the JSON
answers lose their format, after which every group's reward spread is 0
(``bench/results/point_diagnosis/h200/2026-11-28-old-vs-new-settings.json``,
``bench/results/smoke_tasks/h200/2026-11-28-default.json``)."""

VIDEO_SETTINGS = {"lr": 5e-4, "steps": 450, "lr_floor": 0.5}
"""The smoke options the video tasks run with unless given: at higher learning rates the policy
never reads the motion, and it finds the motion late in a run (after a few hundred steps), so
the learning rate decays only to half its peak
(``bench/results/smoke_tasks/h200/2026-11-28-default.json``,
``bench/results/supervised_probe/cpu/2026-11-28-video.json``)."""

TASK_SETTINGS: dict[str, dict[str, float]] = {
    **{name: POINT_SETTINGS for name in TASK_NAMES if name.startswith("point")},
    **{name: VIDEO_SETTINGS for name in TASK_NAMES if name.startswith("video")},
}
"""`--task` name -> the smoke options (argparse dests) it runs with unless given on the command
line; the others take the options' own defaults."""

DATA_TASKS = ("geo3k",)
"""The tasks that read `--data` (the others refuse it)."""
