"""Why does the point task's reward fall? One `rlk-mm smoke --task point` run (CPU, small) with
every answer's outcome logged per GRPO step.

Per step: the share of parsable answers, the parse failures by kind (``OUTCOMES``), the reward
of parsable answers, the misses by where they land (other shape, background), the spread of
the GRPO advantages (groups with any reward spread, mean |advantage|), the KL to the warm-up
policy, the answer length (tokens, characters) and where the points lie (mean and spread of
x and y as fractions of the image). The run goes through `run_smoke` unchanged; the task's
reward is wrapped to record each answer.

    python -m bench.point_diagnosis --out /tmp/pd --steps 40 --prompts 8 [smoke options...]

Writes OUT/point_diagnosis.jsonl (one row per step, as the steps end), OUT/run/ (the smoke report)
and at the end a ``point_diagnosis`` result (``bench.common.write_result``) under OUT with the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from rlk_mm.smoke import parse_args, run_smoke
from rlk_mm.smoke.tasks import TASKS
from rlk_mm.smoke.tasks.point import OUTCOMES, answer_syntax, point_outcome

from .common import write_result

__all__ = ["advantage_spread", "main", "step_row"]

PARSABLE = ("hit", "other shape", "background")


def advantage_spread(groups: dict[str, list[float]], eps: float = 1e-6) -> dict:
    """GRPO advantages' spread: the share of groups whose rewards differ, and the mean |advantage| over answers."""
    advantages, spread = [], 0
    for rewards in groups.values():
        r = torch.tensor(rewards, dtype=torch.float64)
        if r.numel() > 1 and bool((r != r[0]).any()):
            spread += 1
            advantages += ((r - r.mean()) / (r.std() + eps)).abs().tolist()
        else:
            advantages += [0.0] * r.numel()
    return dict(groups_with_spread=spread / max(len(groups), 1),
                mean_abs_advantage=statistics.mean(advantages) if advantages else 0.0)


def step_row(records: list[tuple], metrics: dict) -> dict:
    """One step's row from its answers (sample, text, reward) and `run_smoke`'s step metrics."""
    outcomes = [point_outcome(text, sample) for sample, text, _ in records]
    rewards = [reward for _, _, reward in records]
    parsable = [r for o, r in zip(outcomes, rewards) if o in PARSABLE]
    groups: dict[str, list[float]] = {}
    for sample, _, reward in records:
        groups.setdefault(sample.id, []).append(reward)
    xs, ys = [], []
    for sample, text, _ in records:
        kind, values = answer_syntax(text, sample.meta["convention"])
        if kind == "point":
            xs.append(values[0] / sample.meta["resized"][0])
            ys.append(values[1] / sample.meta["resized"][1])
    return dict(
        step=metrics["step"], reward=metrics["reward_mean"], answers=len(records),
        parsable=len(parsable) / max(len(records), 1),
        parsable_reward=statistics.mean(parsable) if parsable else None,
        outcomes={o: outcomes.count(o) for o in OUTCOMES},
        **advantage_spread(groups),
        kl=metrics.get("kl"), ppo_kl=metrics.get("ppo_kl"), clip_frac=metrics.get("clip_frac"),
        response_tokens=metrics.get("response_tokens"),
        response_chars=statistics.mean(len(t) for _, t, _ in records) if records else 0.0,
        x_mean=statistics.mean(xs) if xs else None, x_std=statistics.pstdev(xs) if xs else None,
        y_mean=statistics.mean(ys) if ys else None, y_std=statistics.pstdev(ys) if ys else None,
        examples=[t for _, t, _ in records[:3]],
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--task", default="point", choices=("point", "point-shuffled"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--verbose", action="store_true", help="print the smoke test's own output too (warm-up, gates)")
    p.add_argument("--label", help="the result's name in its file name (default: the task)")
    a, smoke_argv = p.parse_known_args(argv)
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    records: list[tuple] = []
    factory = TASKS[a.task]

    def recording(data, tuning=None):
        task = factory(data, tuning)
        reward = task.reward

        def recorded(text, sample):
            value = reward(text, sample)
            records.append((sample, text, value))
            return value

        return dataclasses.replace(task, reward=recorded)

    rows_path = out / "point_diagnosis.jsonl"
    rows_path.unlink(missing_ok=True)
    start = time.perf_counter()

    def on_step(metrics):
        row = step_row(records, metrics)
        row["seconds"] = round(time.perf_counter() - start, 1)
        records.clear()
        with open(rows_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        o = row["outcomes"]
        pr = "  n/a" if row["parsable_reward"] is None else f"{row['parsable_reward']:.3f}"
        print(f"step {row['step']:>3} reward {row['reward']:.3f} parsable {row['parsable']:.2f} (reward {pr}) "
              f"hit/other/bg {o['hit']}/{o['other shape']}/{o['background']} fail oor/mal/box/none "
              f"{o['out of range']}/{o['malformed']}/{o['box']}/{o['no point']} spread {row['groups_with_spread']:.2f} "
              f"kl {row['kl'] or 0:.4f} tokens {row['response_tokens'] or 0:.1f} "
              f"x {row['x_mean'] or 0:.2f}+-{row['x_std'] or 0:.2f} "
              f"y {row['y_mean'] or 0:.2f}+-{row['y_std'] or 0:.2f}", flush=True)

    TASKS[a.task] = recording
    try:
        args = parse_args(["--task", a.task, "--out", str(out / "run"), *([] if a.verbose else ["--quiet"]),
                           *smoke_argv])
        run_smoke(args, on_step=on_step)
    finally:
        TASKS[a.task] = factory
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    write_result(out, "point_diagnosis", {"task": a.task, "smoke_args": smoke_argv, "steps": rows},
                 shapes={"task": a.task, "smoke_args": smoke_argv}, label=a.label or a.task,
                 card="cpu" if str(args.device).startswith("cpu") else None)


if __name__ == "__main__":
    main()
