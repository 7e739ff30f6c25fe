"""GPU benchmark of the fused policy loss against the same math in eager torch (verl 0.9.1).

Loss over 16,384 x 8 token slots (8 responses of up to 16,384 tokens, padded, ~75% valid),
float32 log-probs:

* ``pg``: PPO clip + dual clip, token-mean — ours (``policy_loss``, Triton) vs verl's
  ``compute_policy_loss_vanilla`` (eager torch autograd);
* ``pg_kl_entropy``: the same plus a low_var_kl term and an entropy bonus — ours in one pass vs
  verl's actor composition (vanilla + ``kl_penalty`` + two ``agg_loss``);
* ``compact``: ours on the valid tokens only (``sample_index`` layout);
* ``ours_torch_backend``: our torch backend on the GPU (``RLK_MM_BACKEND=torch``);
* ``combined``: ``selected_logprob -> policy_loss`` from hidden states and the LM head
  (16,384 tokens, Qwen2.5-VL-3B head H=2048, V=151,936 of ``configs/lm_heads.json``, bf16) vs eager torch
  (bf16 logits -> float32 log_softmax -> gather -> verl's loss); both checked against the
  float32 loss of the upcast inputs.

Forward+backward and forward-only times are medians of CUDA-event timings after warm-up;
"extra" is peak memory above what was allocated before the call (gradients included).
Writes a ``loss`` result under ``--out`` (default ``$OUT`` or ``.``).

    python -m bench.bench_loss [--reps 50]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from .common import MIB, add_output_args, forced_backend, install_ray_stand_in, load_config, measure, write_result

install_ray_stand_in()
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from rlk_mm.ops import PolicyLossConfig, policy_loss, selected_logprob  # noqa: E402
from rlk_mm.parity.contract import ELEMENTWISE_LOSS_MAX_ABS, LOGPROB_GRAD_REL, relative_error  # noqa: E402

B, R = 8, 16384


def loss_inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(R // 2, R + 1, (B,), device="cuda", generator=g)
    mask = torch.arange(R, device="cuda")[None] < lengths[:, None]
    logp = torch.randn(B, R, device="cuda", generator=g) * 0.5 - 1.0
    old = logp + torch.randn(B, R, device="cuda", generator=g) * 0.3
    ref = logp + torch.randn(B, R, device="cuda", generator=g) * 0.3
    adv = torch.randn(B, device="cuda", generator=g)[:, None].expand(B, R).contiguous()
    entropy = torch.rand(B, R, device="cuda", generator=g) * 3
    return logp, old, ref, adv, entropy, mask


def bench_losses(reps: int) -> dict:
    logp0, old, ref, adv, entropy0, mask = loss_inputs()
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_high=0.28)
    logp = logp0.clone().requires_grad_()
    entropy = entropy0.clone().requires_grad_()
    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    full = replace(config, kl_coef=0.01, entropy_coeff=0.001)

    def verl_pg():
        return core_algos.compute_policy_loss_vanilla(old, logp, adv, mask, "token-mean", cfg)[0]

    def verl_full():
        pg = core_algos.compute_policy_loss_vanilla(old, logp, adv, mask, "token-mean", cfg)[0]
        kl = core_algos.agg_loss(core_algos.kl_penalty(logp, ref, "low_var_kl"), mask, "token-mean")
        ent = core_algos.agg_loss(entropy, mask, "token-mean")
        return pg - 0.001 * ent + 0.01 * kl

    def ours_pg():
        return policy_loss(logp, old, adv, mask, config=config).loss

    def ours_full():
        return policy_loss(logp, old, adv, mask, ref_log_probs=ref, entropy=entropy, config=full).loss

    sample = torch.arange(B, device="cuda")[:, None].expand(B, R)[mask]
    flat = logp0[mask].clone().requires_grad_()
    old_f, adv_f = old[mask], adv[mask]

    def ours_compact():
        return policy_loss(flat, old_f, adv_f, sample_index=sample, num_samples=B, config=config).loss

    def fwd_bwd(fn, leaves):
        def run():
            for leaf in leaves:
                leaf.grad = None
            fn().backward()
        return run

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    # correctness on the GPU: ours vs verl
    checks = {}
    for name, ours, theirs, leaves in (("pg", ours_pg, verl_pg, [logp]),
                                       ("pg_kl_entropy", ours_full, verl_full, [logp, entropy])):
        a = ours()
        ga = torch.autograd.grad(a, leaves)
        e = theirs()
        ge = torch.autograd.grad(e, leaves)
        checks[name] = {"loss_abs_diff": abs(a.item() - e.item()),
                        "grad_rel": max(relative_error(x, y) for x, y in zip(ga, ge))}
    a, e = ours_compact(), ours_pg()
    checks["compact_vs_padded_abs_diff"] = abs(a.item() - e.item())
    checks["ok"] = all(v["loss_abs_diff"] <= ELEMENTWISE_LOSS_MAX_ABS.fp32 and v["grad_rel"] <= LOGPROB_GRAD_REL.fp32
                       for k, v in checks.items() if isinstance(v, dict))
    checks["ok"] = checks["ok"] and checks["compact_vs_padded_abs_diff"] <= 1e-6
    l1, g1 = ours_pg(), None
    (g1,) = torch.autograd.grad(l1, logp)
    l2 = ours_pg()
    (g2,) = torch.autograd.grad(l2, logp)
    checks["bitwise_run_to_run"] = bool(torch.equal(l1, l2) and torch.equal(g1, g2))

    t = {
        "pg": {
            "ours_fwd_bwd": measure(fwd_bwd(ours_pg, [logp]), reps),
            "verl_fwd_bwd": measure(fwd_bwd(verl_pg, [logp]), reps),
            "ours_fwd": measure(fwd(ours_pg), reps),
            "verl_fwd": measure(fwd(verl_pg), reps),
        },
        "pg_kl_entropy": {
            "ours_fwd_bwd": measure(fwd_bwd(ours_full, [logp, entropy]), reps),
            "verl_fwd_bwd": measure(fwd_bwd(verl_full, [logp, entropy]), reps),
        },
        "compact": {"ours_fwd_bwd": measure(fwd_bwd(ours_compact, [flat]), reps)},
    }
    with forced_backend("torch"):
        t["ours_torch_backend"] = {"pg_fwd_bwd": measure(fwd_bwd(ours_pg, [logp]), reps)}
    for name in ("pg", "pg_kl_entropy"):
        t[name]["speedup_fwd_bwd"] = round(t[name]["verl_fwd_bwd"]["ms"] / t[name]["ours_fwd_bwd"]["ms"], 2)
    t["pg"]["speedup_fwd"] = round(t["pg"]["verl_fwd"]["ms"] / t["pg"]["ours_fwd"]["ms"], 2)
    return {"shape": {"B": B, "R": R, "valid_tokens": int(mask.sum()), "dtype": "float32"}, "correctness": checks,
            "timings": t}


def bench_combined(reps: int) -> dict:
    """selected_logprob -> policy_loss vs eager torch, from hidden states and the LM head."""
    head = load_config("lm_heads")["3b"]
    N, H, V = 16384, head["hidden"], head["vocab"]
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(N, H, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    tg = torch.randint(0, V, (N,), device="cuda", generator=g)
    Bc = 16
    sample = torch.arange(N, device="cuda") // (N // Bc)
    rows = torch.arange(N, device="cuda")
    with torch.no_grad():
        old = selected_logprob(h, w, index=rows, targets=tg) + torch.randn(N, device="cuda", generator=g) * 0.1
    adv = torch.randn(Bc, device="cuda", generator=g)[sample]
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    ones = torch.ones(Bc, N // Bc, device="cuda", dtype=torch.bool)

    def ours():
        h.grad = w.grad = None
        logp = selected_logprob(h, w, index=rows, targets=tg)
        policy_loss(logp, old, adv, sample_index=sample, num_samples=Bc).loss.backward()

    def eager():
        h.grad = w.grad = None
        logp = (h @ w.T).float().log_softmax(-1).gather(1, tg[:, None]).squeeze(1)
        loss = core_algos.compute_policy_loss_vanilla(old.view(Bc, -1), logp.view(Bc, -1), adv.view(Bc, -1), ones,
                                                      "token-mean", cfg)[0]
        loss.backward()

    # reference: the same loss in float32 from the upcast bf16 inputs (TF32 off), autograd
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    logp32 = (h32 @ w32.T).log_softmax(-1).gather(1, tg[:, None]).squeeze(1)
    ref = core_algos.compute_policy_loss_vanilla(old.view(Bc, -1), logp32.view(Bc, -1), adv.view(Bc, -1), ones,
                                                 "token-mean", cfg)[0]
    ref_grads = torch.autograd.grad(ref, (h32, w32))
    del h32, w32, logp32
    check = {}
    for name, fn in (("ours", ours), ("eager", eager)):
        fn()
        check[f"{name}_grad_hidden_rel"] = relative_error(h.grad, ref_grads[0])
        check[f"{name}_grad_weight_rel"] = relative_error(w.grad, ref_grads[1])
    del ref_grads
    check["ok"] = max(check["ours_grad_hidden_rel"],
                      check["ours_grad_weight_rel"]) <= LOGPROB_GRAD_REL.for_dtype(torch.bfloat16)
    n_reps = max(3, reps // 10)
    t = {"ours_fwd_bwd": measure(ours, n_reps, warmup=1), "eager_fwd_bwd": measure(eager, n_reps, warmup=1)}
    return {
        "shape": {"N": N, "H": H, "V": V, "sequences": Bc, "dtype": "bfloat16"},
        "grads_of_w_and_h_mib": round((h.numel() + w.numel()) * 2 / MIB, 1),
        "correctness": check,
        "timings": t,
        "speedup": round(t["eager_fwd_bwd"]["ms"] / t["ours_fwd_bwd"]["ms"], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(ap)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--skip-combined", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"loss": bench_losses(args.reps)}
    print(json.dumps({k: {n: v["ms"] if isinstance(v, dict) else v for n, v in d.items()}
                      for k, d in res["loss"]["timings"].items()}), flush=True)
    print(json.dumps(res["loss"]["correctness"]), flush=True)
    if not args.skip_combined:
        res["combined"] = bench_combined(args.reps)
        print(json.dumps({k: v for k, v in res["combined"].items() if k != "shape"}), flush=True)
    write_result(args.out, "loss", res, shapes={k: v["shape"] for k, v in res.items() if "shape" in v}, label=args.label)


if __name__ == "__main__":
    main()
