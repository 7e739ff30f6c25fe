"""Benchmark of rollout sampling (``rlk_mm.ops.sample`` / ``sample_from_hidden``) against its
peers, in one process, timed round-robin. Writes a ``sampling`` result under ``--out``.

From logits (V = 152,064, fp32, B in {64, 128, 256}), top-k 50 + top-p 0.9 at T = 0.8:

* ``ours``: ``sample(..., backend="triton")`` (counter-based seeds, both log-probs, the
  default path: three launches, no host read), timed around one call from an idle GPU (so the
  host's launch time counts); ``ours_graph``: the same call captured in a CUDA graph and
  replayed (the GPU's time alone); ``ours_stream``: 20 calls back to back, per call (the host
  enqueues ahead of the GPU); ``ours_plain``: plain temperature; ``ours_top_p``: top-p 0.9
  alone (on these rows it keeps about a thousand tokens: the mass-bucket path, ``_triton/sampling/top_p.py``);
* ``torch_topk_topp``: softmax -> topk(50) -> top-p on the 50 -> multinomial;
* ``torch_sort_topp``: a full sort, top-k and top-p masks, softmax, multinomial (vLLM-style);
* ``torch_multinomial``: softmax -> multinomial, no filters (the floor of the torch way);
* FlashInfer (``flashinfer.sampling``), where its JIT build finishes inside ``--fi-budget``
  seconds: ``fi_sampling_from_logits`` (no filters), ``fi_topk_topp_probs_joint``
  (``top_k_top_p_sampling_from_probs``, ``filter_apply_order="joint"``, after a softmax) and
  ``fi_topk_topp_logits`` (``top_k_top_p_sampling_from_logits``); the build starts first, in a
  child process per entry point (sampling-only ones first), so a build that hangs costs the
  time box and nothing else; what happened is recorded.

Host syncs: the synchronizing CUDA calls one default-path call makes, counted with torch's
sync debug mode (``host_syncs``), for ours and each torch peer.

From hidden states (H = 3584, bf16 LM head): ``sample_from_hidden`` (plain T = 0.8: one
pass; top-k + top-p: logits written and read back) against the LM-head GEMM alone.

Also measured: bitwise batch invariance of ours and of FlashInfer (a row alone and in the
batch, the same generator state), and CPU/GPU agreement: the same logits and seeds through
the Triton kernel and the torch backend on this machine's CPU (tokens equal, log-probs
bitwise equal). ``--dry-run``: tiny shapes on the CPU (torch backend for ours), every code
path, the same JSON.

    python -m bench.bench_sampling --out $OUT            # GPU, < 2 minutes on an H100
    python -m bench.bench_sampling --dry-run --out /tmp  # CPU check of the script
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import traceback
import warnings

import torch

from rlk_mm.ops import group_seeds, sample, sample_from_hidden

from .common import ROOT, add_output_args, measure_interleaved, time_ms, write_result

TOP_K, TOP_P, TEMPERATURE = 50, 0.9, 0.8
FI_ENTRIES = ("fi_sampling_from_logits", "fi_topk_topp_probs_joint", "fi_topk_topp_logits")  # build order
GOALS = {"ours_ms_at_b64": 0.10, "ours_ms_at_b256": 0.20, "host_syncs_default_path": 0, "from_hidden_vs_gemm": 1.15}
STREAM_CALLS = 20


def shapes(dry: bool) -> dict:
    if dry:
        return dict(V=1000, H=64, batches=(4, 8), reps=3, device="cpu")
    return dict(V=152064, H=3584, batches=(64, 128, 256), reps=30, device="cuda")


# ------------------------------------------------------------------ peers
def torch_topk_topp(logits, gen):
    probs = torch.softmax(logits / TEMPERATURE, -1)
    vals, idx = torch.topk(probs, TOP_K, -1)
    before = vals.cumsum(-1) - vals
    vals = vals.masked_fill(before >= TOP_P * vals.sum(-1, keepdim=True), 0.0)
    pick = torch.multinomial(vals, 1, generator=gen)
    return idx.gather(-1, pick)[:, 0]


def torch_sort_topp(logits, gen):
    z, idx = torch.sort(logits / TEMPERATURE, -1, descending=True)
    z[:, TOP_K:] = -float("inf")
    probs = torch.softmax(z, -1)
    before = probs.cumsum(-1) - probs
    probs = probs.masked_fill(before >= TOP_P, 0.0)
    pick = torch.multinomial(probs, 1, generator=gen)
    return idx.gather(-1, pick)[:, 0]


def torch_multinomial(logits, gen):
    return torch.multinomial(torch.softmax(logits / TEMPERATURE, -1), 1, generator=gen)[:, 0]


def fi_call(name: str, fs, logits, gen):
    z = logits / TEMPERATURE
    if name == "fi_sampling_from_logits":
        return fs.sampling_from_logits(z, generator=gen)
    if name == "fi_topk_topp_probs_joint":
        return fs.top_k_top_p_sampling_from_probs(torch.softmax(z, -1), TOP_K, TOP_P, filter_apply_order="joint",
                                                  generator=gen)
    return fs.top_k_top_p_sampling_from_logits(z, TOP_K, TOP_P, generator=gen)


# ------------------------------------------------------------------ FlashInfer's JIT, time-boxed
def fi_child(entry: str) -> None:
    """Child process: import flashinfer, call one entry point once (its JIT build), report."""
    t0 = time.perf_counter()
    import flashinfer.sampling as fs

    t1 = time.perf_counter()
    logits = torch.randn(4, 152064, device="cuda")
    fi_call(entry, fs, logits, torch.Generator(device="cuda").manual_seed(0))
    torch.cuda.synchronize()
    print(f"import_s={t1 - t0:.1f} first_call_s={time.perf_counter() - t1:.1f}", flush=True)


class FlashInferBuild:
    """Builds FlashInfer's entry points one after the other in child processes, within a budget."""

    def __init__(self, budget_s: float, dry: bool):
        self.budget_s, self.log, self.ok = budget_s, {}, []
        self.entries = list(FI_ENTRIES)
        self.proc, self.current, self.started = None, None, time.perf_counter()
        try:
            import flashinfer  # noqa: F401
        except Exception as error:  # not installed (or broken): recorded, the torch peers still run
            self.log["import"] = f"failed: {type(error).__name__}: {error}"
            self.entries = []
        if dry or not torch.cuda.is_available():
            self.entries = []
        self._next()

    def _next(self) -> None:
        if self.entries:
            self.current = self.entries.pop(0)
            self.t0 = time.perf_counter()
            self.proc = subprocess.Popen([sys.executable, "-m", "bench.bench_sampling", "--fi-child", self.current],
                                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        else:
            self.proc = None

    def wait(self) -> None:
        """Wait for the builds until the budget is spent; a build still running is killed."""
        while self.proc is not None:
            left = self.budget_s - (time.perf_counter() - self.started)
            try:
                out, _ = self.proc.communicate(timeout=max(left, 0.1))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
                self.log[self.current] = f"build not finished after {time.perf_counter() - self.t0:.0f} s: killed"
                self.log.update({e: "not tried (budget spent)" for e in self.entries})
                return
            tail = out.strip().splitlines()[-1:] if out.strip() else [""]
            if self.proc.returncode == 0:
                self.ok.append(self.current)
                self.log[self.current] = f"built: {tail[0]} ({time.perf_counter() - self.t0:.0f} s)"
            else:
                self.log[self.current] = f"failed (exit {self.proc.returncode}): {out.strip()[-600:]}"
            self._next()


# ------------------------------------------------------------------ measurements
def warps_sweep(cfg: dict, choices: str) -> list:
    """GPU time (graph replays) of the from-logits kernels, top-k + top-p, with other warps per
    launch (``choices``: "launch1xlaunch2,..."; the default config is timed alongside)."""
    from rlk_mm.ops._torch.sampling import Filters
    from rlk_mm.ops._triton import sampling as tri

    configs = {"default": tri.default_config(torch.device("cuda"))}
    for choice in filter(None, choices.split(",")):
        a, b = (int(x) for x in choice.split("x"))
        configs[choice] = tri.SamplingConfig(**{**configs["default"].__dict__, "block_warps": a, "row_warps": b})
    filters, inv_t = Filters(TOP_K, TOP_P, None), float(torch.tensor(1 / TEMPERATURE, dtype=torch.float32))
    rows = []
    for B in cfg["batches"]:
        logits = logits_rows(B, cfg["V"], "cuda")
        seeds = torch.arange(B, device="cuda")
        fns = {name: graph_of(lambda c=c: tri.sample_logits(logits, inv_t, filters, seeds, 0, config=c))
               for name, c in configs.items()}
        rows.append({"B": B, **{k: v["ms"] for k, v in timed(fns, cfg["reps"], "cuda").items()}})
        print(f"warps B={B}: {rows[-1]}", flush=True)
    return rows


def host_syncs(fn) -> int | None:
    """Synchronizing CUDA calls that one call of ``fn`` makes (torch's sync debug mode warns
    once per such call; the warnings are counted). None without CUDA."""
    if not torch.cuda.is_available():
        return None
    for _ in range(2):  # first calls may sync once (lazy set-up), a step of a rollout does not
        fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")  # outside the catch: setting the mode may warn once itself
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def graph_of(fn):
    """``fn`` captured in a CUDA graph (after two warm-up calls on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def streamed(fn):
    """``STREAM_CALLS`` calls of ``fn`` back to back (time it and divide: the per-call time when
    the host enqueues ahead of the GPU)."""
    def run():
        for _ in range(STREAM_CALLS):
            fn()
    return run


def timed(fns: dict, reps: int, device: str) -> dict:
    if device == "cuda":
        return measure_interleaved(fns, reps, warmup=3)
    return {name: time_ms(fn, reps, warmup=1, device="cpu") for name, fn in fns.items()}


def logits_rows(B: int, V: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(B, V, device=device, generator=g) * 3  # a peaked, LM-like spread


def bench_logits(cfg: dict, fi, backend: str) -> list:
    rows = []
    gen = torch.Generator(device=cfg["device"]).manual_seed(0)
    for B in cfg["batches"]:
        logits = logits_rows(B, cfg["V"], cfg["device"])
        seeds = group_seeds(0, [i // 8 for i in range(B)], 0).to(cfg["device"])
        step = torch.zeros((), dtype=torch.int64, device=cfg["device"])

        def ours():
            return sample(logits, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, seeds=seeds, step=step,
                          backend=backend)

        fns = {
            "ours": ours,
            "ours_plain": lambda: sample(logits, temperature=TEMPERATURE, seeds=seeds, step=step, backend=backend),
            "ours_top_p": lambda: sample(logits, temperature=TEMPERATURE, top_p=TOP_P, seeds=seeds, step=step,
                                         backend=backend),
            "torch_topk_topp": lambda: torch_topk_topp(logits, gen),
            "torch_sort_topp": lambda: torch_sort_topp(logits, gen),
            "torch_multinomial": lambda: torch_multinomial(logits, gen),
        }
        if fi.ok:
            import flashinfer.sampling as fs

            for name in fi.ok:
                fns[name] = lambda name=name: fi_call(name, fs, logits, gen)
        if cfg["device"] == "cuda":
            fns["ours_graph"] = graph_of(ours)
            fns["ours_stream_x20"] = streamed(ours)
        row = {"B": B, "V": cfg["V"], "dtype": "float32", **timed(fns, cfg["reps"], cfg["device"])}
        if "ours_stream_x20" in row:
            row["ours_stream_per_call_ms"] = round(row["ours_stream_x20"]["ms"] / STREAM_CALLS, 4)
        row["host_syncs"] = {name: host_syncs(fns[name]) for name in
                             ("ours", "ours_plain", "torch_topk_topp", "torch_sort_topp", "torch_multinomial")}
        rows.append(row)
        timings = (f"{k} {v['ms']:.3f} ms" for k, v in row.items() if isinstance(v, dict) and "ms" in v)
        print(f"logits B={B}: " + ", ".join(timings) + f"; host syncs {row['host_syncs']}", flush=True)
    return rows


def bench_hidden(cfg: dict, backend: str) -> list:
    rows = []
    dev, dtype = cfg["device"], torch.bfloat16 if cfg["device"] == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(1)
    w = (torch.randn(cfg["V"], cfg["H"], device=dev, generator=g) * 0.02).to(dtype)
    for B in cfg["batches"]:
        h = torch.randn(B, cfg["H"], device=dev, generator=g).to(dtype)
        seeds = torch.arange(B, device=dev)
        out = torch.empty(B, cfg["V"], device=dev, dtype=dtype)
        fns = {
            "gemm": lambda: torch.mm(h, w.T, out=out),
            "from_hidden_plain": lambda: sample_from_hidden(h, w, temperature=TEMPERATURE, seeds=seeds,
                                                            backend=backend),
            "from_hidden_topk_topp": lambda: sample_from_hidden(h, w, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P,
                                                                seeds=seeds, backend=backend),
        }
        if dev == "cuda":  # device time: each captured in a CUDA graph (a decode step's host work overlaps it)
            step = torch.zeros((), dtype=torch.int64, device=dev)
            fns["gemm_graph"] = graph_of(fns["gemm"])
            fns["from_hidden_plain_graph"] = graph_of(
                lambda: sample_from_hidden(h, w, temperature=TEMPERATURE, seeds=seeds, step=step, backend=backend))
        res = timed(fns, max(cfg["reps"] // 3, 3), dev)
        res["plain_vs_gemm"] = round(res["from_hidden_plain"]["ms"] / res["gemm"]["ms"], 3)
        if dev == "cuda":
            res["plain_vs_gemm_graphs"] = round(res["from_hidden_plain_graph"]["ms"] / res["gemm_graph"]["ms"], 3)
        rows.append({"B": B, "H": cfg["H"], "V": cfg["V"], "dtype": str(dtype).replace("torch.", ""), **res})
        print(f"hidden B={B}: plain/gemm {res['plain_vs_gemm']}, in graphs {res.get('plain_vs_gemm_graphs')}", flush=True)
    return rows


def invariance(cfg: dict, fi, backend: str) -> dict:
    """Bitwise: row r alone, in the batch, at another position and batch size."""
    dev, V = cfg["device"], cfg["V"]
    B = cfg["batches"][-1]
    logits = logits_rows(B, V, dev, seed=2)
    seeds = torch.arange(B, device=dev) * 3 + 1
    r = B // 2 + 1
    kw = dict(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, backend=backend)
    full = sample(logits, seeds=seeds, **kw)
    alone = sample(logits[r : r + 1], seeds=seeds[r : r + 1], **kw)
    order = torch.roll(torch.arange(B, device=dev), 7)[: B // 2 + 9]  # ends with row r, at another position
    moved = sample(logits[order], seeds=seeds[order], **kw)
    at = int((order == r).nonzero()[0])
    same = [torch.equal(x[r], y[0]) and torch.equal(x[r], z[at]) for x, y, z in zip(full, alone, moved)]
    out = {"ours_bitwise": all(same)}
    if "fi_topk_topp_logits" in fi.ok:
        import flashinfer.sampling as fs

        def fi_tokens(x):
            return fi_call("fi_topk_topp_logits", fs, x, torch.Generator(device=dev).manual_seed(5))

        a, b = fi_tokens(logits), fi_tokens(logits[: B // 2])
        out["flashinfer_rows_same_in_B_and_B/2"] = float((a[: B // 2] == b).double().mean())
        out["flashinfer_row_alone_same"] = bool(fi_tokens(logits[r : r + 1])[0] == a[r])
    return out


def agreement(cfg: dict, steps: int) -> dict:
    """Triton on the GPU vs the torch backend on this machine's CPU: same logits, same seeds."""
    if cfg["device"] != "cuda":
        return {"skipped": "dry run: no GPU to compare with (the code path: sample(backend='torch') on CPU)",
                "cpu_tokens": sample(logits_rows(2, cfg["V"], "cpu"), seeds=torch.arange(2),
                                     backend="torch").tokens.tolist()}
    B, V = 64, cfg["V"]
    res = {}
    for name, kw in (("plain", {}), ("topk_topp", dict(top_k=TOP_K, top_p=TOP_P))):
        draws = tokens_equal = lp_equal = slp_equal = 0
        max_lp = 0.0
        for step in range(steps):
            logits = logits_rows(B, V, "cuda", seed=100 + step)
            seeds = group_seeds(step, [i // 8 for i in range(B)], 0)
            gpu = sample(logits, temperature=TEMPERATURE, seeds=seeds.cuda(), step=step, backend="triton", **kw)
            cpu = sample(logits.cpu(), temperature=TEMPERATURE, seeds=seeds, step=step, backend="torch", **kw)
            g = [t.cpu() for t in gpu]
            draws += B
            tokens_equal += int((g[0] == cpu.tokens).sum())
            lp_equal += int((g[1] == cpu.log_probs).sum())
            slp_equal += int((g[2] == cpu.sampled_log_probs).sum())
            max_lp = max(max_lp, float((g[1] - cpu.log_probs).abs().max()))
        res[name] = {"draws": draws, "tokens_equal": tokens_equal, "log_probs_bitwise_equal": lp_equal,
                     "sampled_log_probs_bitwise_equal": slp_equal, "log_probs_max_abs_diff": max_lp}
        print(f"agreement {name}: {res[name]}", flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(p)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: check the script")
    p.add_argument("--fi-budget", type=float, default=40.0, help="seconds for FlashInfer's JIT builds (default 40)")
    p.add_argument("--agreement-steps", type=int, default=3,
                   help="batches of 64 rows in the CPU/GPU agreement (default 3)")
    p.add_argument("--warps", default="", help="also time these warps per launch, e.g. 4x4,8x8 (GPU only)")
    p.add_argument("--fi-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fi_child:
        fi_child(args.fi_child)
        return
    cfg = shapes(args.dry_run)
    backend = "torch" if args.dry_run else "triton"
    t0 = time.perf_counter()
    fi = FlashInferBuild(args.fi_budget, args.dry_run)  # starts the first build now
    result: dict = {"settings": {"top_k": TOP_K, "top_p": TOP_P, "temperature": TEMPERATURE, **cfg,
                                 "backend_ours": backend, "dry_run": args.dry_run}, "goals": GOALS}
    sections = (
        # CPU-heavy: while FlashInfer builds
        ("agreement_cpu_gpu", lambda: agreement(cfg, args.agreement_steps if not args.dry_run else 1)),
        ("from_hidden", lambda: (fi.wait(), bench_hidden(cfg, backend))[1]),
        ("from_logits", lambda: bench_logits(cfg, fi, backend)),
        ("invariance", lambda: invariance(cfg, fi, backend)),
    )
    if args.warps and not args.dry_run:
        sections += (("warps", lambda: warps_sweep(cfg, args.warps)),)
    for name, run in sections:
        try:
            result[name] = run()
        except Exception:  # recorded; the other sections still run
            result[name] = {"error": traceback.format_exc()[-2000:]}
            print(result[name]["error"], flush=True)
    fi.wait()
    result["flashinfer_build"] = {"budget_s": args.fi_budget, "built": fi.ok, "log": fi.log}
    logits = result.get("from_logits")
    if isinstance(logits, list) and logits:
        result["verdict"] = {
            f"B={r['B']}": {"ours_ms": r["ours"]["ms"], "ours_graph_ms": r.get("ours_graph", {}).get("ms"),
                            "ours_stream_per_call_ms": r.get("ours_stream_per_call_ms"),
                            "host_syncs_default_path": r["host_syncs"]["ours"],
                            "ours_vs_fi_topk_topp_logits": round(r["ours"]["ms"] / r["fi_topk_topp_logits"]["ms"], 3)
                            if "fi_topk_topp_logits" in r else None}
            for r in logits
        }
    hidden = result.get("from_hidden")
    if isinstance(hidden, list) and hidden and "plain_vs_gemm_graphs" in hidden[0]:
        result.setdefault("verdict", {})["from_hidden_plain_vs_gemm_graphs"] = {
            f"B={r['B']}": r["plain_vs_gemm_graphs"] for r in hidden}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    write_result(args.out, "sampling", result, shapes=result["settings"], label=args.label, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
