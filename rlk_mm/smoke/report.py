"""What a run reports besides its gates: versions and device, the live progress table (with
the estimate that opens it and an ETA per row), and the reward and KL curves."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np
import torch

from ..counts import plural
from ..progress import about, eta
from .learning import LEARNING_WINDOW

__all__: list[str] = []


def versions() -> dict:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    from .. import __version__

    out["rlk_mm"] = __version__
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({plural(os.cpu_count() or 0, 'core')}, {plural(torch.get_num_threads(), 'thread')})"


def _bar(done: int, total: int, width: int = 12) -> str:
    filled = int(round(width * done / max(total, 1)))
    return "█" * filled + "·" * (width - filled)


HEADER = (f"{'step':>9} {'progress':<12} {'reward':>11} {'loss':>8} {'KL':>8} {'clip':>5} {'|r-1|max':>8} {'tok/s':>6} "
          f"{'s':>5} {'ETA':>7}")


def progress_row(m: dict, steps: int, times: list[float]) -> str:
    """A row of the live table: step ``m``'s metrics, and the ETA of the steps left at the mean
    of the step ``times`` so far (the gates left out)."""
    return (
        f"{m['step']:>4}/{steps:<4} {_bar(m['step'], steps)} {m['reward_mean']:>5.2f}±{m['reward_std']:<4.2f} "
        f"{m['loss']:>8.4f} {m['kl']:>8.5f} {m['clip_frac']:>5.2f} {m['max_ratio_dev']:>8.1e} "
        f"{m['tokens_per_s']:>6.0f} {m['seconds']:>5.2f} {eta(times, steps - m['step']):>7}"
    )


def estimate(steps: int, first: float) -> str:
    """The line that opens the table: how long the ``steps`` take here, from the first step's ``first`` seconds."""
    return (f"{plural(steps, 'step')}, about {about(first * steps)} here ({first:.1f} s for step 1, the gates aside; "
            "the ETA column follows the mean step)")


def draw_curves(steps: list[dict], path: Path, task: str, args, control: list[dict] | None = None) -> None:
    """Reward, KL and the rollout-vs-training max |Δ| over the steps (next to ``control``'s,
    the steps of a ``--kernels default`` run, when given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["step"] for s in steps]
    mean = np.array([s["reward_mean"] for s in steps])
    std = np.array([s["reward_std"] for s in steps])
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 3.4))
    ax1.fill_between(x, mean - std, mean + std, alpha=0.2, color="#2c7fb8", linewidth=0)
    ax1.plot(x, mean, color="#2c7fb8", linewidth=1, label="mean reward")
    if len(x) >= LEARNING_WINDOW:
        smooth = np.convolve(mean, np.ones(LEARNING_WINDOW) / LEARNING_WINDOW, mode="valid")
        ax1.plot(x[LEARNING_WINDOW - 1 :], smooth, color="#08306b", linewidth=2, label=f"{LEARNING_WINDOW}-step mean")
    if task == "colour":
        ax1.axhline(0.25, color="grey", linestyle=":", linewidth=1, label="chance")
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_xlabel("GRPO step")
    ax1.set_ylabel("reward")
    ax1.legend(fontsize=8, loc="lower right")
    ax1.set_title(f"reward ({plural(args.prompts, 'prompt')} x {plural(args.samples, 'answer')} per step)", fontsize=10)
    ax2.plot(x, [s["kl"] for s in steps], color="#d95f0e", linewidth=1.5)
    ax2.set_xlabel("GRPO step")
    ax2.set_ylabel("k3 KL to the warm-up policy")
    ax2.set_title("KL", fontsize=10)
    series = [(steps, f"{getattr(args, 'kernels', 'invariant')} kernels", "#1b9e77")]
    if control:
        series.append((control, "default kernels (control)", "#d95f02"))
    for rows, label, colour in series:
        ax3.plot([s["step"] for s in rows], [s.get("max_abs_delta", float("nan")) for s in rows], color=colour,
                 linewidth=1.2, marker=".", markersize=3, label=label)
    ax3.set_yscale("symlog", linthresh=1e-8)
    ax3.set_xlabel("GRPO step")
    ax3.set_ylabel("max |rollout - training| log-prob")
    ax3.set_title("rollout vs training (0 = bitwise)", fontsize=10)
    ax3.legend(fontsize=8)
    fig.suptitle(f"rlk-mm smoke ({task}, seed {args.seed}" + (f", --break {args.break_mode}" if args.break_mode else "") + ")", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
