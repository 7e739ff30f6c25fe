"""GPU benchmark of ``selected_logprob`` against torch and Liger, peers in one process.

Shapes: Qwen2.5-VL-7B head (N=16384, H=3584, V=152064) and 3B (N=4096, H=2048, V=151936),
bf16. Measured: forward only (no grad), forward+backward (per-token upstream weights),
and ours with 25% of the tokens scored, each group round-robin (peers share the GPU's
power and clock history). Times are medians of CUDA-event timings after warm-up;
"extra" is peak memory above what was allocated before the call (gradients included for
forward+backward). Correctness: ours against the fp32 plain-torch reference
on a slice of rows. Writes ``logprob.json`` to ``--out`` (default ``$OUT`` or ``.``).

    python bench/bench_logprob.py [--shapes 7b,3b] [--reps 7] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import GIB, measure, measure_interleaved  # noqa: E402
from rlk_mm.ops import selected_logprob  # noqa: E402
from rlk_mm.ops._reference import logprob as ref  # noqa: E402
from rlk_mm.ops._triton import logprob as tri  # noqa: E402
from rlk_mm.parity.contract import LOGPROB_GRAD_REL, LOGPROB_MAX_ABS, relative_error  # noqa: E402

SHAPES = {"7b": (16384, 3584, 152064), "3b": (4096, 2048, 151936)}


def inputs(N: int, H: int, V: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(N, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16()
    tg = torch.randint(0, V, (N,), device="cuda", generator=g)
    up = torch.randn(N, device="cuda", generator=g)  # per-token upstream weights
    return h, w, tg, up


def check_correctness(h, w, tg, up, rows: int = 512) -> dict:
    """Ours vs the fp32 reference on the first ``rows`` tokens: log-prob, entropy, grads."""
    hs = h[:rows].clone().requires_grad_()
    ws = w.clone().requires_grad_()
    idx = torch.arange(rows, device="cuda")
    lp, ent = selected_logprob(hs, ws, index=idx, targets=tg[:rows], temperature=0.7, return_entropy=True)
    ge = torch.randn(rows, device="cuda")
    torch.autograd.backward([lp, ent], [up[:rows], ge])
    r_lp, r_ent, r_lse = ref.selected_logprob_forward(hs.detach(), w, idx, tg[:rows], None, 0.7)
    d_h, d_w, _ = ref.selected_logprob_backward(up[:rows], ge, hs.detach(), w, idx, tg[:rows], None, r_lse, r_ent, 0.7)
    out = {
        "rows": rows,
        "logprob_max_abs": (lp - r_lp).abs().max().item(),
        "entropy_max_abs": (ent - r_ent).abs().max().item(),
        "grad_hidden_rel": relative_error(hs.grad, d_h),
        "grad_weight_rel": relative_error(ws.grad, d_w),
    }
    tol, gtol = LOGPROB_MAX_ABS.for_dtype(h.dtype), LOGPROB_GRAD_REL.for_dtype(h.dtype)
    out["ok"] = bool(out["logprob_max_abs"] <= tol and out["entropy_max_abs"] <= tol
                     and out["grad_hidden_rel"] <= gtol and out["grad_weight_rel"] <= gtol)
    return out


def run_shape(name: str, reps: int) -> dict:
    N, H, V = SHAPES[name]
    h, w, tg, up = inputs(N, H, V)
    res: dict = {"shape": {"N": N, "H": H, "V": V, "dtype": "bfloat16"}}
    res["grads_gib"] = round((h.numel() + w.numel()) * 2 / GIB, 4)
    res["correctness"] = check_correctness(h, w, tg, up)
    all_rows = torch.arange(N, device="cuda")
    quarter = torch.randperm(N, device="cuda")[: N // 4].sort().values
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()

    def torch_fwd():
        with torch.no_grad():
            return (hg @ wg.T).float().log_softmax(-1).gather(1, tg[:, None])

    def torch_fb():
        hg.grad = wg.grad = None
        lp = (hg @ wg.T).float().log_softmax(-1).gather(1, tg[:, None]).squeeze(1)
        lp.backward(up)

    def ours_fwd(rows=all_rows):
        with torch.no_grad():
            return selected_logprob(hg, wg, index=rows, targets=tg[rows])

    def ours_fb(rows=all_rows, entropy=False):
        hg.grad = wg.grad = None
        if entropy:
            lp, ent = selected_logprob(hg, wg, index=rows, targets=tg[rows], return_entropy=True)
            torch.autograd.backward([lp, ent], [up[rows], up[rows]])
        else:
            selected_logprob(hg, wg, index=rows, targets=tg[rows]).backward(up[rows])

    def free_grads():
        hg.grad = wg.grad = None

    fwd = {"ours_fwd": ours_fwd, "ours_fwd_25pct": lambda: ours_fwd(quarter), "torch_fwd": torch_fwd}
    fwd_bwd = {"ours_fwd_bwd": ours_fb, "ours_fwd_bwd_entropy": lambda: ours_fb(entropy=True),
               "ours_fwd_bwd_25pct": lambda: ours_fb(quarter), "torch_fwd_bwd": torch_fb}
    alone = {}  # slow peers, timed on their own
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        flce = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def liger_fwd():
            with torch.no_grad():
                return flce(w, h, tg)

        def liger_fb():
            hg.grad = wg.grad = None
            flce(wg, hg, tg).backward()

        fwd["liger_flce_fwd"], fwd_bwd["liger_flce_fwd_bwd"] = liger_fwd, liger_fb
        if N % 1024 == 0:
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

            grpo = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=False)
            B = N // 1024
            mask = torch.ones(B, 1024, device="cuda", dtype=torch.long)
            adv = torch.randn(B, device="cuda")

            def grpo_fb():
                hg.grad = wg.grad = None
                out = grpo(hg.view(B, 1024, H), wg, tg.view(B, 1024), mask, adv)
                out[0].backward()

            alone[f"liger_grpo_fwd_bwd_{B}x1024"] = grpo_fb
    except ImportError as exc:
        res["liger_missing"] = str(exc)
    # round-robin within forward and forward+backward: peers share the power/clock history
    t = {**measure_interleaved(fwd, reps), **measure_interleaved(fwd_bwd, reps, before=free_grads)}
    for name, fn in alone.items():
        t[name] = measure(fn, max(2, reps // 3), warmup=1, before=free_grads)
    res["timings"] = t
    ms = {k: v["ms"] for k, v in t.items()}
    res["ratios"] = {
        "fwd_vs_torch": round(ms["ours_fwd"] / ms["torch_fwd"], 3),
        "fwd_bwd_vs_torch": round(ms["ours_fwd_bwd"] / ms["torch_fwd_bwd"], 3),
        "fwd_bwd_25pct_vs_all": round(ms["ours_fwd_bwd_25pct"] / ms["ours_fwd_bwd"], 3),
        "fwd_25pct_vs_all": round(ms["ours_fwd_25pct"] / ms["ours_fwd"], 3),
    }
    res["fwd_bwd_extra_above_grads_gib"] = round(t["ours_fwd_bwd"]["extra_gib"] - res["grads_gib"], 4)
    if "liger_flce_fwd_bwd" in ms:
        res["ratios"]["fwd_bwd_vs_liger_flce"] = round(ms["ours_fwd_bwd"] / ms["liger_flce_fwd_bwd"], 3)
    res["matmul_floor_ms_at_790tflops"] = {
        "fwd": round(2 * N * H * V / 790e12 * 1e3, 2), "fwd_bwd": round(6 * N * H * V / 790e12 * 1e3, 2)}
    return res


def host_overhead_us(calls: int = 300) -> dict:
    """Host microseconds per no-grad call at a tiny shape (the GPU's share is negligible):
    the public call against the bare Triton forward (no checks, no dispatch)."""
    h = torch.randn(64, 128, device="cuda").bfloat16()
    w = torch.randn(1024, 128, device="cuda").bfloat16()
    rows = torch.arange(0, 64, 2, device="cuda")
    tg = torch.randint(0, 1024, (32,), device="cuda")

    def per_call(fn):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return round((time.perf_counter() - start) / calls * 1e6, 1)

    with torch.no_grad():
        return {
            "selected_logprob": per_call(lambda: selected_logprob(h, w, index=rows, targets=tg)),
            "registered_op": per_call(lambda: torch.ops.rlk_mm.selected_logprob(h, w, rows, tg, None, 1.0, False)),
            "triton_forward_only": per_call(lambda: tri.forward(h, w, rows, tg, None, 1.0, False, False)),
        }


def sweep(reps: int) -> list:
    """Forward/backward times of candidate tile configs and dz budgets at the 7B shape."""
    N, H, V = SHAPES["7b"]
    h, w, tg, up = inputs(N, H, V)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    rows = torch.arange(N, device="cuda")
    base_cfg, base_budget = tri.config, tri.DZ_BUDGET
    out = []
    cands = [  # (tiles, read through tensor descriptors)
        (tri.TileConfig(128, 256, 64, 8, 8, 3), False),
        (tri.TileConfig(128, 256, 64, 8, 8, 3), True),
        (tri.TileConfig(128, 256, 64, 8, 8, 4), True),
        (tri.TileConfig(256, 128, 64, 8, 8, 3), True),
        (tri.TileConfig(128, 128, 64, 8, 4, 4), True),
    ]

    def fb():
        hg.grad = wg.grad = None
        selected_logprob(hg, wg, index=rows, targets=tg).backward(up)

    def fwd():
        with torch.no_grad():
            selected_logprob(hg, wg, index=rows, targets=tg)

    with torch.no_grad():
        base = selected_logprob(hg, wg, index=rows, targets=tg)
    for cfg, tma in cands:
        tri.config = lambda dtype, device, cfg=cfg: cfg
        tri.USE_TMA = tma
        row = {"cfg": cfg.__dict__, "tma": tma}
        try:
            t0 = time.time()
            with torch.no_grad():
                row["max_abs_vs_default"] = (selected_logprob(hg, wg, index=rows, targets=tg) - base).abs().max().item()
            torch.cuda.synchronize()
            row["compile_s"] = round(time.time() - t0, 1)
            row["fwd"] = measure(fwd, reps)["ms"]
            row["fwd_bwd"] = measure(fb, max(3, reps // 2))["ms"]
        except Exception as exc:  # a config that does not fit (shared memory, registers)
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(row, flush=True)
        out.append(row)
    tri.config, tri.USE_TMA = base_cfg, True
    for budget in (64 << 20, 128 << 20, 192 << 20):
        tri.DZ_BUDGET = budget
        r = measure(fb, 3, before=lambda: (setattr(hg, "grad", None), setattr(wg, "grad", None)))
        out.append({"dz_budget_mib": budget >> 20, "fwd_bwd": r["ms"], "extra_gib": r["extra_gib"]})
        print(out[-1], flush=True)
    tri.DZ_BUDGET = base_budget
    # where the time goes, default config: cuBLAS logits product, then backward pieces
    out.append({"cublas_logits_mm_ms": measure(lambda: h @ w.T, 3)["ms"]})
    with torch.no_grad():
        _, ent, lse, all_rows = torch.ops.rlk_mm.selected_logprob(h, w, rows, tg, None, 1.0, True)
    for need in ((False, False, False), (True, False, False), (False, True, False), (True, True, False)):
        r = measure(lambda: tri.backward(up, None, h, w, rows, tg, None, lse, None, bool(all_rows), 1.0, *need), 3)
        out.append({"backward_parts(dz,+dH,+dW)": need, "ms": r["ms"]})
    for row in out[-5:]:
        print(row, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="7b,3b")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sweep", action="store_true", help="tune tile configs instead of the benchmark")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": " ".join(["python"] + sys.argv),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
        import liger_kernel  # noqa: F401
        from importlib.metadata import version

        meta["liger_kernel"] = version("liger-kernel")
    except Exception:
        pass
    if args.sweep:
        result = {"meta": meta, "sweep": sweep(args.reps)}
        name = "logprob_sweep.json"
    else:
        result = {"meta": meta, "config": {k: v for k, v in tri.config(torch.bfloat16, torch.device("cuda")).__dict__.items()},
                  "dz_budget_mib": tri.DZ_BUDGET >> 20, "host_us_per_call": host_overhead_us()}
        for s in args.shapes.split(","):
            result[s] = run_shape(s, args.reps)
            torch.cuda.empty_cache()
        name = "logprob.json"
        print_table(result, args.shapes.split(","))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / name).write_text(json.dumps(result, indent=1))


def print_table(result: dict, shapes) -> None:
    for s in shapes:
        r = result[s]
        print(f"\n== {s} {r['shape']}  grads {r['grads_gib']} GiB  correctness {r['correctness']}")
        print(f"{'what':34s} {'ms':>9s} {'extra GiB':>10s}")
        for k, v in r["timings"].items():
            print(f"{k:34s} {v['ms']:9.2f} {v['extra_gib']:10.3f}")
        print("ratios", r["ratios"])


if __name__ == "__main__":
    main()
