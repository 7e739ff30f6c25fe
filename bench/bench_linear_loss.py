"""GPU benchmark of ``linear_policy_loss`` (the LM head fused with the policy loss, three
logits-sized products) against its peers, in one process, timed round-robin.

Shapes: the Qwen2.5-VL-7B head (N=16384 scored tokens, H=3584, V=152064) and 3B (N=4096,
H=2048, V=151936; ``configs/lm_heads.json``), bf16. The loss: PPO token-mean, k3 KL to a
reference (coefficient 0.001) and an entropy bonus (0.001). Timed forward+backward, each
call freeing the gradients of the one before:

* ``ours_linear``: ``linear_policy_loss``;
* ``ours_composed``: ``policy_loss(selected_logprob(..., return_entropy=True))`` (four products);
* ``liger_flce``: Liger's ``LigerFusedLinearCrossEntropyLoss`` (reduction sum);
* ``liger_grpo``: Liger's ``LigerFusedLinearGRPOLoss`` with the same KL and clip (slow: timed
  on its own, fewer repetitions);
* ``gemm``: one cuBLAS logits product ``hidden @ weight.T`` into a preallocated buffer; the
  three-product floor is 3x its time.

"extra" is peak memory above what was allocated before the call, gradients included.
Correctness on a slice of rows: ours against the composition and against the fp32 torch
backend on the same bf16 inputs upcast. ``--budgets`` also times ours at other chunk sizes
(``LMHeadConfig.linear_budget``). Writes a ``linear_loss`` result under ``--out``.

``--dry-run``: no GPU and no peers: ours (``linear_policy_loss`` and the composition) at tiny
shapes on the CPU (the torch backend; the Triton interpreter with ``TRITON_INTERPRET=1
RLK_MM_BACKEND=triton``), fp32 and bf16; prints the medians and a sha256 of every loss,
metric, log-prob, entropy and gradient, so that two commits can be compared bitwise.

    python -m bench.bench_linear_loss [--shapes 7b,3b] [--reps 7] [--budgets 320,640,960]
    python -m bench.bench_linear_loss --dry-run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import traceback
from dataclasses import asdict, replace

import torch

from rlk_mm.ops import PolicyLossConfig, linear_policy_loss, policy_loss, selected_logprob
from rlk_mm.ops._backend import resolve_backend
from rlk_mm.ops._triton import linear_loss as tri_linear
from rlk_mm.ops._triton import logprob as tri
from rlk_mm.parity.contract import LOGPROB_GRAD_REL, LOGPROB_MAX_ABS, relative_error

from .common import (
    GIB,
    add_output_args,
    forced_backend,
    load_config,
    measure,
    measure_interleaved,
    time_ms,
    write_result,
)

HEADS = load_config("lm_heads")
TOKENS = {"7b": 16384, "3b": 4096}
KL_COEF, ENTROPY_COEFF, CLIP = 0.001, 0.001, 0.2
#: the loss: PPO token-mean, k3 KL to a reference, an entropy bonus
CONFIG = PolicyLossConfig(kl_type="low_var_kl", kl_coef=KL_COEF, entropy_coeff=ENTROPY_COEFF,
                          loss_agg_mode="token-mean", clip_ratio_low=CLIP, clip_ratio_high=CLIP)
#: ``--dry-run``'s shape: N scored rows in samples of ``per_sample``, hidden size H, vocabulary V
DRY = {"N": 96, "H": 32, "V": 300, "per_sample": 24}
TARGETS = {"7b": {"vs_liger_flce": 0.80, "vs_ours_composed": 0.75, "extra_above_grads_gib": 1.0},
           "3b": {"vs_liger_flce": 0.85}}


def inputs(N: int, H: int, V: int, seed: int = 0, device: str = "cuda", dtype=torch.bfloat16,
           per_sample: int = 1024) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    return dict(
        h=torch.randn(N, H, device=device, generator=g).to(dtype),
        w=(torch.randn(V, H, device=device, generator=g) * 0.02).to(dtype),
        tg=torch.randint(0, V, (N,), device=device, generator=g),
        old=-torch.rand(N, device=device, generator=g) * 12 - 1,
        ref=-torch.rand(N, device=device, generator=g) * 12 - 1,
        adv=torch.randn(N // per_sample if N % per_sample == 0 else 1, device=device, generator=g),
        sample=torch.arange(N, device=device) // per_sample,
    )


def loss_kwargs(x: dict, rows=None) -> dict:
    rows = slice(None) if rows is None else rows
    sample = x["sample"][rows]
    return dict(old_log_probs=x["old"][rows], advantages=x["adv"][sample], sample_index=sample - sample[:1],
                num_samples=int(sample[-1] - sample[0]) + 1, ref_log_probs=x["ref"][rows], config=CONFIG)


def composed(h, w, tg, index, kw):
    lp, ent = selected_logprob(h, w, index=index, targets=tg, return_entropy=True)
    kw = dict(kw)
    return policy_loss(lp, kw.pop("old_log_probs"), kw.pop("advantages"), entropy=ent, **kw).loss


def check_correctness(x: dict, rows: int = 1024) -> dict:
    """Ours vs the composition and vs the fp32 torch backend on the first ``rows`` tokens."""
    kw = loss_kwargs(x, slice(0, rows))
    idx, tg = torch.arange(rows, device="cuda"), x["tg"][:rows]

    def grads(fn, dtype=None):
        h = x["h"][:rows].to(dtype or x["h"].dtype).clone().requires_grad_()
        w = x["w"].to(dtype or x["w"].dtype).clone().requires_grad_()
        loss = fn(h, w)
        loss.backward()
        return loss.detach().float(), h.grad, w.grad

    ours = grads(lambda h, w: linear_policy_loss(h, w, index=idx, targets=tg, **kw).loss)
    comp = grads(lambda h, w: composed(h, w, tg, idx, kw))
    with forced_backend("torch"):
        ref = grads(lambda h, w: composed(h, w, tg, idx, kw), torch.float32)
    out = {"rows": rows}
    for name, other in (("composed", comp), ("fp32_torch", ref)):
        out[name] = {"loss_abs": abs(ours[0] - other[0]).item(), "grad_hidden_rel": relative_error(ours[1], other[1]),
                     "grad_weight_rel": relative_error(ours[2], other[2])}
    with torch.no_grad():
        lp = linear_policy_loss(x["h"][:rows], x["w"], index=idx, targets=tg, **kw).log_probs
        lp_ref = selected_logprob(x["h"][:rows], x["w"], index=idx, targets=tg)
    out["logprob_max_abs_vs_selected_logprob"] = (lp - lp_ref).abs().max().item()
    gtol = LOGPROB_GRAD_REL.low_precision
    out["ok"] = bool(out["logprob_max_abs_vs_selected_logprob"] <= LOGPROB_MAX_ABS.low_precision and all(
        out[k]["loss_abs"] <= LOGPROB_MAX_ABS.low_precision and out[k]["grad_hidden_rel"] <= gtol
        and out[k]["grad_weight_rel"] <= gtol for k in ("composed", "fp32_torch")))
    return out


def run_shape(name: str, reps: int, budgets: list[int]) -> dict:
    N, H, V = TOKENS[name], HEADS[name]["hidden"], HEADS[name]["vocab"]
    x = inputs(N, H, V)
    res: dict = {"shape": {"N": N, "H": H, "V": V, "dtype": "bfloat16"}, "targets": TARGETS.get(name, {})}
    res["grads_gib"] = round((x["h"].numel() + x["w"].numel()) * 2 / GIB, 4)
    try:
        res["correctness"] = check_correctness(x)
    except Exception:  # noqa: BLE001  (a failed check is recorded, the timings still run)
        res["correctness"] = {"ok": False, "error": traceback.format_exc()}
    hg, wg = x["h"].clone().requires_grad_(), x["w"].clone().requires_grad_()
    index, kw = torch.arange(N, device="cuda"), loss_kwargs(x)
    logits = torch.empty(N, V, device="cuda", dtype=torch.bfloat16)

    def free_grads():
        hg.grad = wg.grad = None

    fns = {
        "ours_linear": lambda: linear_policy_loss(hg, wg, index=index, targets=x["tg"], **kw).loss.backward(),
        "ours_composed": lambda: composed(hg, wg, x["tg"], index, kw).backward(),
        # logits is deleted below to free its memory: the lambda runs before
        "gemm": lambda: torch.matmul(x["h"], x["w"].T, out=logits),  # noqa: F821
    }
    alone = {}
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        flce = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        fns["liger_flce"] = lambda: flce(wg, hg, x["tg"]).backward()
        B = N // 1024
        grpo = LigerFusedLinearGRPOLoss(beta=KL_COEF, use_ref_model=True, epsilon_low=CLIP, epsilon_high=CLIP,
                                        loss_type="dapo", compiled=False)
        mask = torch.ones(B, 1024, device="cuda", dtype=torch.long)

        def liger_grpo():
            out = grpo(hg.view(B, 1024, H), wg, x["tg"].view(B, 1024), mask, x["adv"],
                       ref_per_token_logps=x["ref"].view(B, 1024), old_per_token_logps=x["old"].view(B, 1024))
            out[0].backward()

        alone["liger_grpo"] = liger_grpo
    except Exception:  # noqa: BLE001
        res["liger_missing"] = traceback.format_exc(limit=2)
    t = measure_interleaved(fns, reps, before=free_grads)
    for peer, fn in alone.items():
        try:
            t[peer] = measure(fn, max(2, reps // 3), warmup=1, before=free_grads)
        except Exception:  # noqa: BLE001
            t[peer] = {"error": traceback.format_exc(limit=3)}
    del logits
    res["timings"] = t
    ms = {k: v["ms"] for k, v in t.items() if "ms" in v}
    res["three_product_floor_ms"] = round(3 * ms["gemm"], 3)
    res["ratios"] = {
        "vs_ours_composed": round(ms["ours_linear"] / ms["ours_composed"], 3),
        "vs_three_product_floor": round(ms["ours_linear"] / res["three_product_floor_ms"], 3),
    }
    for peer in ("liger_flce", "liger_grpo"):
        if peer in ms:
            res["ratios"][f"vs_{peer}"] = round(ms["ours_linear"] / ms[peer], 3)
    res["extra_above_grads_gib"] = round(t["ours_linear"]["extra_gib"] - res["grads_gib"], 4)
    res["budget_sweep"] = sweep_budgets(hg, wg, x, index, kw, budgets, reps, free_grads) if budgets else {}
    return res


def sweep_budgets(hg, wg, x, index, kw, budgets, reps, free_grads) -> dict:
    """``ours_linear`` at other chunk sizes (MiB of chunk logits), round-robin."""
    base = tri.default_config(torch.bfloat16, torch.device("cuda"))
    fns = {}
    for mib in budgets:
        cfg = replace(base, linear_budget=mib << 20)

        def run(cfg=cfg):
            original = tri_linear.default_config
            tri_linear.default_config = lambda dtype, device: cfg
            try:
                linear_policy_loss(hg, wg, index=index, targets=x["tg"], **kw).loss.backward()
            finally:
                tri_linear.default_config = original

        fns[f"{mib}MiB"] = run
    return measure_interleaved(fns, reps, before=free_grads)


def _digest(*tensors) -> str:
    """sha256 of the tensors' bytes (bitwise: bf16 as its 16-bit patterns), in order."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())
    return h.hexdigest()


def dry_run(reps: int) -> dict:
    """Ours at ``DRY``'s shape on the CPU, fp32 and bf16: medians and the outputs' sha256s."""
    N, H, V, per = DRY["N"], DRY["H"], DRY["V"], DRY["per_sample"]
    out = {"shape": dict(DRY), "backend": str(resolve_backend(on_cuda=False)), "reps": reps, "medians_ms": {},
           "sha256": {}}
    for dtype in (torch.float32, torch.bfloat16):
        x = inputs(N, H, V, device="cpu", dtype=dtype, per_sample=per)
        index, kw = torch.arange(N), loss_kwargs(x)
        h, w = x["h"].clone().requires_grad_(), x["w"].clone().requires_grad_()

        def linear():
            return linear_policy_loss(h, w, index=index, targets=x["tg"], **kw)

        name = str(dtype).replace("torch.", "")
        for peer, fn in (("ours_linear", lambda: linear().loss.backward()),
                         ("ours_composed", lambda: composed(h, w, x["tg"], index, kw).backward())):
            out["medians_ms"][f"{peer}.{name}"] = time_ms(fn, reps, warmup=1, device="cpu")["ms"]
        h.grad = w.grad = None
        result = linear()
        result.loss.backward()
        metrics = [result.metrics[k] for k in sorted(result.metrics)]
        out["sha256"][f"ours_linear.{name}"] = _digest(result.loss, *metrics, result.log_probs, result.entropy,
                                                       h.grad, w.grad)
        h.grad = w.grad = None
        loss = composed(h, w, x["tg"], index, kw)
        loss.backward()
        out["sha256"][f"ours_composed.{name}"] = _digest(loss, h.grad, w.grad)
    out["sha256_total"] = hashlib.sha256("".join(out["sha256"][k] for k in sorted(out["sha256"])).encode()).hexdigest()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(ap)
    ap.add_argument("--shapes", default="7b,3b")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--budgets", default="", help="comma-separated chunk budgets in MiB to sweep (7b only)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, ours only: medians and output sha256s")
    args = ap.parse_args()
    if args.dry_run:
        result = dry_run(args.reps)
        print(json.dumps(result, indent=1))
        print("sha256", result["sha256_total"])
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    budgets = [int(b) for b in args.budgets.split(",") if b]
    result = {"config": asdict(tri.default_config(torch.bfloat16, torch.device("cuda"))),
              "loss": {"ppo": "token-mean", "clip": CLIP, "kl": "low_var_kl", "kl_coef": KL_COEF,
                       "entropy_coeff": ENTROPY_COEFF}}
    shapes = args.shapes.split(",")
    for s in shapes:
        result[s] = run_shape(s, args.reps, budgets if s == "7b" else [])
        # after each shape: a later failure keeps it
        write_result(args.out, "linear_loss", result, shapes={k: result[k]["shape"] for k in shapes if k in result},
                     label=args.label)
        torch.cuda.empty_cache()
    print_table(result, shapes)


def print_table(result: dict, shapes) -> None:
    for s in shapes:
        r = result[s]
        print(f"\n== {s} {r['shape']}  grads {r['grads_gib']} GiB  correctness ok={r['correctness'].get('ok')}")
        for k, v in r["timings"].items():
            if "ms" in v:
                print(f"{k:16s} {v['ms']:9.2f} ms {v['extra_gib']:8.3f} GiB")
        print("ratios", r["ratios"], "extra above grads", r["extra_above_grads_gib"])
        for k, v in r.get("budget_sweep", {}).items():
            print(f"  budget {k:8s} {v['ms']:9.2f} ms {v['extra_gib']:8.3f} GiB")


if __name__ == "__main__":
    main()
