"""GPU benchmark: extra memory and time of the log-prob computation against the GRPO group
size, the seed projects' headline table (RL-Kernel's: Llama-3-8B head, V 128,256, H 4096,
sequence length 512, G = 64 / 128 / 256 answers, scored tokens N = G x 512).

Peers, each forward + backward (gradients of hidden states and head), bf16, one process:

* ``torch_native``: ``h @ W.T`` -> fp32 ``log_softmax`` -> ``gather`` (the [N, V] logits and
  their fp32 copy are the memory RL-Kernel's table reports);
* ``trl_selective``: TRL's default per-token path, the bf16 logits and TRL's own
  ``selective_log_softmax`` (where ``trl`` imports);
* ``liger_flce``: Liger's ``LigerFusedLinearCrossEntropyLoss`` (reduction sum; cross-entropy,
  not a per-token log-prob, but the memory pattern of a fused head);
* ``ours_selected``: ``selected_logprob`` (per-token log-probs, never [N, V]);
* ``ours_linear``: ``linear_policy_loss`` (PPO token-mean + k3 KL, three products).

"extra" is the peak memory of one call above what was allocated before it (the inputs),
gradient buffers included; ``above_grads`` subtracts the gradients of hidden states and
head, the part every method must hold. A peer that runs out of memory is recorded as
``"oom"`` and left out at larger G. Times are medians of CUDA-event timings, the peers that
fit timed round-robin. Writes a ``group_memory`` result under ``--out``.

    python -m bench.bench_group_memory [--groups 64,128,256,512] [--seq 512] [--reps 3]
"""

from __future__ import annotations

import argparse
import traceback

import torch

from rlk_mm.ops import PolicyLossConfig, linear_policy_loss, selected_logprob

from .common import GIB, add_output_args, measure_interleaved, peak_extra_bytes, write_result

#: RL-Kernel's head (Llama-3-8B): vocabulary and hidden size
V, H = 128_256, 4096
#: RL-Kernel's published figures (A100, GB): torch native and theirs, by G
PUBLISHED = {"source": "RL-Kernel README (A100, Llama-3-8B head, seq 512)",
             "torch_native_gb": {"64": 15.7, "128": 31.3,
                                 "256": 62.6}, "rl_kernel_gb": {"64": 16.2, "128": 31.8, "256": 63.1}}
CONFIG = PolicyLossConfig(kl_type="low_var_kl", kl_coef=0.001, loss_agg_mode="token-mean")


def peers(h, w, tg, old, ref, adv, sample, num_samples) -> dict:
    """name -> a callable running one forward + backward (gradients land on h and w)."""
    index = torch.arange(h.shape[0], device=h.device)

    def torch_native():
        logits = h @ w.T
        lp = torch.log_softmax(logits.float(), -1).gather(-1, tg[:, None]).squeeze(-1)
        lp.sum().backward()

    def ours_selected():
        selected_logprob(h, w, index=index, targets=tg).sum().backward()

    def ours_linear():
        out = linear_policy_loss(h, w, index=index, targets=tg, old_log_probs=old, advantages=adv[sample],
                                 sample_index=sample, num_samples=num_samples, ref_log_probs=ref, config=CONFIG)
        out.loss.backward()

    fns = {"torch_native": torch_native, "ours_selected": ours_selected, "ours_linear": ours_linear}
    try:
        from trl.trainer.utils import selective_log_softmax

        def trl_selective():
            selective_log_softmax(h @ w.T, tg).sum().backward()

        fns["trl_selective"] = trl_selective
    except Exception:  # noqa: BLE001  (trl absent on the GPU machine: recorded as missing)
        pass
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        flce = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        fns["liger_flce"] = lambda: flce(w, h, tg).backward()
    except Exception:  # noqa: BLE001
        pass
    return fns


def run_group(G: int, seq: int, reps: int, skip: set) -> dict:
    N = G * seq
    g = torch.Generator(device="cuda").manual_seed(G)
    h = torch.randn(N, H, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    tg = torch.randint(0, V, (N,), device="cuda", generator=g)
    old = -torch.rand(N, device="cuda", generator=g) * 8
    ref = -torch.rand(N, device="cuda", generator=g) * 8
    sample = torch.arange(N, device="cuda") // seq
    adv = torch.randn(G, device="cuda", generator=g)
    grads_gib = (h.numel() + w.numel()) * 2 / GIB

    def free():
        h.grad = w.grad = None
        torch.cuda.empty_cache()

    res = {"G": G, "N": N, "grads_gib": round(grads_gib, 3), "peers": {}}
    fitting = {}
    for name, fn in peers(h, w, tg, old, ref, adv, sample, G).items():
        if name in skip:
            res["peers"][name] = {"skipped": "out of memory at a smaller G"}
            continue
        try:
            extra = peak_extra_bytes(fn, free) / GIB
        except torch.OutOfMemoryError:
            free()
            res["peers"][name] = {"oom": True}
            skip.add(name)
            continue
        except Exception:  # noqa: BLE001
            free()
            res["peers"][name] = {"error": traceback.format_exc(limit=3)}
            continue
        res["peers"][name] = {"extra_gib": round(extra, 3), "above_grads_gib": round(extra - grads_gib, 3)}
        fitting[name] = fn
    times = measure_interleaved(fitting, reps, warmup=1, before=free) if fitting else {}
    for name, t in times.items():
        res["peers"][name].update(ms=t["ms"], times_ms=t["times_ms"])
    print({k: (v.get("extra_gib"), v.get("ms")) if "extra_gib" in v else v for k, v in res["peers"].items()},
          flush=True)
    free()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(ap)
    ap.add_argument("--groups", default="64,128,256,512", help="GRPO group sizes G (comma-separated)")
    ap.add_argument("--seq", type=int, default=512, help="scored tokens per answer (RL-Kernel: 512)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_group_memory needs a CUDA GPU")
    skip: set = set()
    rows = []
    for G in (int(x) for x in args.groups.split(",")):
        print(f"G = {G} (N = {G * args.seq})", flush=True)
        rows.append(run_group(G, args.seq, args.reps, skip))
    shape = {"V": V, "H": H, "seq": args.seq, "dtype": "bfloat16"}
    write_result(args.out, "group_memory", {"shape": shape, "published": PUBLISHED, "rows": rows},
                 shapes={**shape, "G": [row["G"] for row in rows]}, label=args.label)


if __name__ == "__main__":
    main()
