"""Benchmark of ``group_advantages`` against verl 0.9.1's GRPO advantage, peers in one process.

8,192 sequences in groups of 16 (verl's ``uid`` strings, each group's samples adjacent as
verl repeats prompts), responses of 512 tokens. Timed, on each device given:

* ``verl_grpo``: ``verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage`` (the default
  ``grpo`` estimator: a Python loop over samples);
* ``verl_grpo_vectorized``: verl's ``grpo_vectorized`` estimator, for reference;
* ``ours_op``: ``rlk_mm.ops.group_advantages`` on the per-sample scores with int group ids;
* ``ours_verl_adapter``: the registered ``rlk_mm_grpo`` estimator, verl's signature end to
  end (sums token rewards, maps uid strings to ints on the host, multiplies by the mask).

Medians of wall-clock (CPU) or CUDA-event (GPU) timings after warm-up; results checked equal
to verl's. Writes one ``advantages`` result per device (``bench.common.write_result``: under
``--out``, default ``$OUT`` or ``.``).

    python -m bench.bench_advantages [--devices cpu,cuda] [--reps 5]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from .common import add_output_args, install_ray_stand_in, time_ms, write_result

install_ray_stand_in()
from verl.trainer.ppo import core_algos  # noqa: E402

from rlk_mm.integrations import verl as rlk_verl  # noqa: E402
from rlk_mm.ops import group_advantages  # noqa: E402

B, GROUP, R = 8192, 16, 512


def run(device: str, reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    mask = (torch.arange(R)[None] < lengths[:, None]).float()
    scores = (torch.rand(B, generator=g) < 0.5).float() + 0.1 * torch.randn(B, generator=g)
    rewards = torch.zeros(B, R)
    rewards[torch.arange(B), lengths - 1] = scores  # verl: the reward on the last response token
    index = np.array([f"uid-{i // GROUP}" for i in range(B)], dtype=object)
    rewards, mask = rewards.to(device), mask.to(device)
    group_ids = torch.arange(B, device=device) // GROUP
    seq_scores = rewards.sum(-1)

    expected, _ = core_algos.compute_grpo_outcome_advantage(rewards.clone(), mask, index)
    ours = group_advantages(seq_scores, group_ids)
    adapter, _ = rlk_verl.compute_grpo_outcome_advantage(rewards, mask, index)
    vectorized, _ = core_algos.compute_grpo_vectorized_outcome_advantage(rewards, mask, index)
    check = {
        "op_max_abs_vs_verl": (ours[:, None] * mask - expected).abs().max().item(),
        "adapter_max_abs_vs_verl": (adapter - expected).abs().max().item(),
        "verl_vectorized_max_abs_vs_verl": (vectorized - expected).abs().max().item(),
        "op_bitwise_run_to_run": bool(torch.equal(group_advantages(seq_scores, group_ids), ours)),
    }
    check["ok"] = (check["op_max_abs_vs_verl"] < 1e-5 and check["adapter_max_abs_vs_verl"] < 1e-5
                   and check["op_bitwise_run_to_run"])

    t = {
        "verl_grpo": time_ms(lambda: core_algos.compute_grpo_outcome_advantage(rewards.clone(), mask, index),
                             max(2, reps // 2), warmup=1, device=device),
        "verl_grpo_vectorized": time_ms(
            lambda: core_algos.compute_grpo_vectorized_outcome_advantage(rewards, mask, index), reps, warmup=1,
            device=device),
        "ours_op": time_ms(lambda: group_advantages(seq_scores, group_ids), reps * 20, warmup=3, device=device),
        "ours_verl_adapter": time_ms(lambda: rlk_verl.compute_grpo_outcome_advantage(rewards, mask, index), reps * 4,
                                     warmup=2, device=device),
    }
    ms = {k: v["ms"] for k, v in t.items()}
    return {
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "cpu_threads": torch.get_num_threads(),
        "shape": {"sequences": B, "group_size": GROUP, "response_length": R},
        "correctness": check,
        "timings": t,
        "speedup_vs_verl_grpo": {
            "ours_op": round(ms["verl_grpo"] / ms["ours_op"], 1),
            "ours_verl_adapter": round(ms["verl_grpo"] / ms["ours_verl_adapter"], 1),
            "verl_grpo_vectorized": round(ms["verl_grpo"] / ms["verl_grpo_vectorized"], 1),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(ap)
    ap.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (small ops: 1 avoids thread spin)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for device in args.devices.split(","):
        res = run(device, args.reps)
        print(json.dumps({"device": res["device"], "ms": {k: v["ms"] for k, v in res["timings"].items()},
                          "speedup": res["speedup_vs_verl_grpo"], "ok": res["correctness"]["ok"]}), flush=True)
        write_result(args.out, "advantages", res, shapes=res["shape"], label=args.label,
                     card="cpu" if device == "cpu" else None)


if __name__ == "__main__":
    main()
