"""GPU benchmark of ``selected_logprob`` against torch and Liger, peers in one process.

Shapes: the Qwen2.5-VL-7B head (N=16384, H=3584, V=152064) and 3B (N=4096, H=2048, V=151936;
``configs/lm_heads.json``), bf16. Measured: forward only (no grad), forward+backward
(per-token upstream weights), and ours with 25% of the tokens scored, each group round-robin
(peers share the GPU's power and clock history). Times are medians of CUDA-event timings
after warm-up; "extra" is peak memory above what was allocated before the call (gradients
included for forward+backward). Correctness: ours against the fp32 plain-torch reference on
a slice of rows. Writes a ``logprob`` result under ``--out`` (default ``$OUT`` or ``.``).
``--sweep`` instead times the bare Triton kernels at the 7B shape with candidate
``LMHeadConfig``s (tiles, dz budgets) and writes ``logprob_sweep.json``.

    python -m bench.bench_logprob [--shapes 7b,3b] [--reps 7] [--sweep]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, replace

import torch

from rlk_mm.ops import selected_logprob
from rlk_mm.ops._torch import logprob as ref
from rlk_mm.ops._triton import logprob as tri
from rlk_mm.parity.contract import LOGPROB_GRAD_REL, LOGPROB_MAX_ABS, relative_error

from .common import GIB, add_output_args, load_config, measure, measure_interleaved, write_result

HEADS = load_config("lm_heads")
TOKENS = {"7b": 16384, "3b": 4096}  # scored tokens at each head shape


def shape(name: str) -> tuple[int, int, int]:
    """(N scored tokens, H, V) of a head shape."""
    return TOKENS[name], HEADS[name]["hidden"], HEADS[name]["vocab"]


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
    N, H, V = shape(name)
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


#: tiles (block_m, block_n, block_k, group_m, num_warps, num_stages), read through tensor descriptors or not
CANDIDATES = [
    tri.LMHeadConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, tma=False),
    tri.LMHeadConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
    tri.LMHeadConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4),
    tri.LMHeadConfig(block_m=256, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
    tri.LMHeadConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4),
]


def sweep(reps: int) -> dict:
    """The bare Triton kernels at the 7B shape, configs passed as ``config=``: forward and
    forward+backward times of candidate tiles, backward time and memory per dz budget, and
    where the default config's time goes (cuBLAS's logits product, backward parts)."""
    N, H, V = shape("7b")
    h, w, tg, up = inputs(N, H, V)
    rows = torch.arange(N, device="cuda")
    base = tri.default_config(h.dtype, h.device)

    def fwd(cfg):
        return tri.forward(h, w, rows, tg, None, 1.0, False, True, config=cfg)

    def bwd(cfg, lse, need=(True, True, False)):  # d hidden, d weight, d bias
        return tri.backward(up, None, h, w, rows, tg, None, lse, None, True, 1.0, *need, config=cfg)

    def fwd_bwd(cfg):
        bwd(cfg, fwd(cfg)[2])

    expect = fwd(base)[0]
    tiles = []
    for cfg in CANDIDATES:
        row = {"config": asdict(cfg)}
        try:
            t0 = time.time()
            row["max_abs_vs_default"] = (fwd(cfg)[0] - expect).abs().max().item()
            fwd_bwd(cfg)
            torch.cuda.synchronize()
            row["compile_s"] = round(time.time() - t0, 1)
            row["fwd"] = measure(lambda: fwd(cfg), reps)["ms"]
            row["fwd_bwd"] = measure(lambda: fwd_bwd(cfg), max(3, reps // 2))["ms"]
        except Exception as exc:  # a config that does not fit (shared memory, registers)
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(row, flush=True)
        tiles.append(row)
    lse = fwd(base)[2]
    budgets = []
    for mib in sorted({64, 128, base.dz_budget >> 20, 192}):
        cfg = replace(base, dz_budget=mib << 20)
        r = measure(lambda: bwd(cfg, lse), 3)
        budgets.append({"dz_budget_mib": mib, "dz_columns": tri.dz_chunk_columns(N, V, h.dtype, cfg),
                        "bwd": r["ms"], "extra_gib": r["extra_gib"]})
        print(budgets[-1], flush=True)
    parts = {"cublas_logits_mm": measure(lambda: h @ w.T, 3)["ms"]}
    for label, need in (("dz", (False, False, False)), ("dz+d_hidden", (True, False, False)),
                        ("dz+d_weight", (False, True, False)), ("dz+d_hidden+d_weight", (True, True, False))):
        parts[f"backward_{label}"] = measure(lambda: bwd(base, lse, need), 3)["ms"]
    print(parts, flush=True)
    return {"unit": "ms", "default": asdict(base), "tiles": tiles, "dz_budgets": budgets, "parts": parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(ap)
    ap.add_argument("--shapes", default="7b,3b")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sweep", action="store_true", help="time candidate kernel configs instead of the benchmark")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.sweep:
        N, H, V = shape("7b")
        write_result(args.out, "logprob", {"sweep": sweep(args.reps)}, shapes={"7b": {"N": N, "H": H, "V": V}},
                     label="sweep" if args.label == "default" else args.label)
        return
    result = {"config": asdict(tri.default_config(torch.bfloat16, torch.device("cuda"))),
              "host_us_per_call": host_overhead_us()}
    shapes = args.shapes.split(",")
    for s in shapes:
        result[s] = run_shape(s, args.reps)
        torch.cuda.empty_cache()
    print_table(result, shapes)
    write_result(args.out, "logprob", result, shapes={s: result[s]["shape"] for s in shapes}, label=args.label)


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
