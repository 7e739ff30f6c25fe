"""Multi-GPU benchmark: vocabulary-parallel ``selected_logprob`` and ``linear_policy_loss``
(``tp_group=``) over NCCL at tp = 1/2/4/8, against verl's vocabulary-parallel
``linear_cross_entropy`` and against the single-GPU ops, bf16, N = 16,384 scored rows, at
the Qwen2.5-VL-7B head (H = 3584, V = 152,064) and a 72B-like head (H = 8192).

Run under torchrun, one process per GPU; a tp size uses the first tp ranks (the others
wait), the head split on the 128-row grid (evenly for the 7B head: Megatron's padding),
every peer timed round-robin in one process (CUDA events, medians; every rank times its own
calls after a barrier, the slowest rank's median is reported), peak memory above inputs per
GPU (gradients included; the largest rank), strong-scaling efficiency ``t(tp=1) / (tp ·
t(tp))``, the max |Δ| of the log-probs, entropies and row log-sum-exps (of
``selected_logprob``, and the fused loss's log-probs and entropies) against the single-GPU
op (the goal, and the guarantee: 0), and the bytes each rank sent per scored token,
measured (``torch.profiler``'s c10d ops, the slope between N/2 and N rows) against
``_vocab_parallel.comm.comm_bytes_per_token``. verl's kernel all-reduces (its bytes are counted by
wrapping ``torch.distributed.all_reduce``); verl is imported lazily and its absence
recorded. Writes a ``tp`` result under ``--out`` (its ``world``: the GPUs of the run). ``--quick``: the 7B head only,
3 timed repetitions (about a minute on 4 H100s at tp 1/2/4).

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 8 -m bench.bench_tp --out $OUT
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 -m bench.bench_tp --out $OUT --tp 1 2 4 --quick
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 1 -m bench.bench_tp --out $OUT --tp 1   # one GPU
    torchrun --nproc-per-node 2 -m bench.bench_tp --dry-run --out /tmp/tp   # CPU, gloo, tiny shapes
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from typing import Optional

import torch
import torch.distributed as dist

from .common import GIB, add_output_args, call_ms, install_ray_stand_in, load_config, write_result

SHAPES = {"7b": None, "72b_like": 8192}  # H of the 72B-like head; V as the 7B head's
DRY = {"n": 48, "hidden": 24, "vocab": 250}


def _parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(ap)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="group sizes (those above the world are left out)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", type=int, default=16384, help="scored rows N")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the 7B head only, 3 timed repetitions")
    ap.add_argument("--profile", action="store_true",
                    help="at tp > 1, record where one call of the fused loss spends its GPU time (rank 0's kernels)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes: every code path, the JSON written")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.reps = ["7b"], min(args.reps, 3)
    return args


def _gather_max(value: float, group) -> float:
    """The largest value over the group (every rank's own measurement)."""
    t = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _peak_extra(fn, before) -> float:
    """Peak memory of one call above what is allocated before it (GiB; None on CPU)."""
    if not torch.cuda.is_available():
        return None
    before()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - held) / GIB


def _interleaved(fns: dict, reps: int, before, group) -> dict:
    """Round-robin medians (ms, slowest rank) and peak extra memory (GiB, largest rank) of each peer."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for fn in fns.values():  # warm-up
        before()
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            before()
            times[name].append(call_ms(fn, device))
    out = {}
    for name, fn in fns.items():
        peak = _peak_extra(fn, before)
        out[name] = {"ms": round(_gather_max(statistics.median(times[name]), group), 4),
                     "times_ms_rank0": [round(t, 4) for t in times[name]],
                     "extra_gib": None if peak is None else round(_gather_max(peak, group), 4)}
    return out


@contextlib.contextmanager
def _counting_all_reduce(P: int, counter: dict):
    """Counts the bytes a ring all-reduce sends, 2 (P - 1) / P of each tensor, while the block runs."""
    original = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        counter["bytes"] += 2 * (P - 1) * tensor.numel() * tensor.element_size() // P
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = original


def _verl():
    """verl's ``linear_cross_entropy``, or the reason it cannot run here."""
    if not torch.cuda.is_available():
        return None, "not run: verl's kernel is CUDA-only (dry run)"
    try:
        install_ray_stand_in()
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    except Exception as e:  # recorded, not hidden: verl is optional
        return None, f"not importable: {type(e).__name__}: {e}"
    return linear_cross_entropy, None


def _case(n, H, V, P, rank, device, dtype):
    """Inputs of one shape on this rank: every row scored, this rank's contiguous shard of the head."""
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, H, device=device, generator=g).to(dtype)
    weight = (torch.randn(V, H, device=device, generator=g) * 0.02).to(dtype)
    targets = torch.randint(0, V, (n,), device=device, generator=g)
    lo, hi = _bounds(V, P, rank)
    return {
        "hidden": hidden, "weight": weight, "shard": weight[lo:hi].contiguous(), "lo": lo, "targets": targets,
        "index": torch.arange(n, device=device), "up": torch.randn(n, device=device, generator=g),
        "up_entropy": torch.randn(n, device=device, generator=g) * 0.01,
        "old": -torch.rand(n, device=device, generator=g) * 4, "adv": torch.randn(n, device=device, generator=g),
        "sample": torch.arange(n, device=device) // 1024,
    }


def _sizes(V, P):
    """Shard sizes on the 128-row grid (``_head_inputs.VOCAB_ALIGN``): whole segments split
    evenly, the first shards one segment larger where they do not divide; the last ends at V."""
    from rlk_mm.ops._head_inputs import VOCAB_ALIGN

    segments = -(-V // VOCAB_ALIGN)
    sizes = [(segments // P + (r < segments % P)) * VOCAB_ALIGN for r in range(P)]
    sizes[-1] = V - sum(sizes[:-1])
    return sizes


def _bounds(V, P, rank):
    """This rank's vocabulary rows ``[lo, hi)``."""
    sizes = _sizes(V, P)
    return sum(sizes[:rank]), sum(sizes[: rank + 1])


def _peers(c, group, verl_lce):
    """Callables (forward + backward) of every peer for this rank's inputs."""
    from rlk_mm.ops import PolicyLossConfig, linear_policy_loss, selected_logprob

    config = PolicyLossConfig(entropy_coeff=0.01)
    h = c["hidden"].clone().requires_grad_()
    w = c["shard"].clone().requires_grad_()
    leaves = (h, w)

    def logprob(tp_group):
        def run():
            logp, ent = selected_logprob(h, w, index=c["index"], targets=c["targets"], temperature=0.9,
                                         return_entropy=True, tp_group=tp_group)
            torch.autograd.backward([logp, ent], [c["up"], c["up_entropy"]])
        return run

    def fused(tp_group):
        def run():
            out = linear_policy_loss(h, w, index=c["index"], targets=c["targets"], temperature=0.9,
                                     old_log_probs=c["old"], advantages=c["adv"], sample_index=c["sample"],
                                     num_samples=int(c["sample"][-1]) + 1, config=config, tp_group=tp_group)
            out.loss.backward()
        return run

    peers = {"rlk_mm_selected_logprob_tp": logprob(group), "rlk_mm_linear_policy_loss_tp": fused(group)}
    if dist.get_world_size(group) == 1:  # the single-GPU ops: no group, no collective
        peers["rlk_mm_selected_logprob_single"] = logprob(None)
        peers["rlk_mm_linear_policy_loss_single"] = fused(None)
    if verl_lce is not None:
        def verl_run():
            logp, ent = verl_lce(h, w, c["targets"], 0.9, "none", group)
            torch.autograd.backward([logp, ent], [c["up"], c["up_entropy"]])
        peers["verl_linear_cross_entropy_tp"] = verl_run
    return peers, leaves


def _verl_runs(peers: dict, group) -> Optional[str]:
    """None when verl's peer ran once on every rank; else drops it and returns why (every rank drops it)."""
    if "verl_linear_cross_entropy_tp" not in peers:
        return None
    error = None
    try:
        peers["verl_linear_cross_entropy_tp"]()
        torch.cuda.synchronize()
    except Exception as e:  # recorded in the JSON: verl's kernel is a peer, not ours
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if _gather_max(float(error is not None), group):
        del peers["verl_linear_cross_entropy_tp"]
        return error or "failed on another rank"
    return None


def _sent_per_token(run, c, group, P) -> dict:
    """Bytes this rank sent per scored token: profiler counts at N/2 and N rows, the slope."""
    from rlk_mm.ops._vocab_parallel import comm

    n = c["index"].numel()
    sent = []
    for rows in (n // 2, n):
        half = dict(c, index=c["index"][:rows], targets=c["targets"][:rows], up=c["up"][:rows],
                    up_entropy=c["up_entropy"][:rows], old=c["old"][:rows], adv=c["adv"][:rows],
                    sample=c["sample"][:rows])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            run(half)
        sent.append(sum(comm.profiled_sent_bytes(prof.events(), P).values()))
    V = c["weight"].shape[0]
    documented = comm.comm_bytes_per_token(P, c["hidden"].shape[1], True, V, largest_shard=max(_sizes(V, P)),
                                           partial_columns=comm.partial_columns(c["shard"]))
    return {"measured": (sent[1] - sent[0]) / (n - n // 2), "documented": sum(documented.values()),
            "documented_split": documented}


def main() -> None:
    args = _parse()
    backend = "gloo" if args.dry_run else "nccl"
    if not args.dry_run:
        if os.environ.get("NCCL_NVLS_ENABLE") != "0":
            raise SystemExit("set NCCL_NVLS_ENABLE=0 (NVLink multicast stays off on these machines)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    device, dtype = _device(), (torch.float32 if args.dry_run else torch.bfloat16)
    sizes = [tp for tp in args.tp if tp <= world]
    groups = {tp: dist.new_group(list(range(tp))) for tp in sizes}  # every rank creates every group
    verl_lce, verl_note = _verl()
    head = load_config("lm_heads")["7b"]
    results = {"world": world, "backend": backend, "dtype": str(dtype), "verl": verl_note or "run",
               "reps": args.reps, "by_shape": {}}
    for shape in args.shapes:
        n, H, V = (DRY["n"], DRY["hidden"], DRY["vocab"]) if args.dry_run else \
            (args.rows, SHAPES[shape] or head["hidden"], head["vocab"])
        entry = results["by_shape"][shape] = {"N": n, "H": H, "V": V, "tp": {}}
        for tp in sizes:
            dist.barrier()
            if rank >= tp:
                continue
            group = groups[tp]
            entry["tp"][tp] = _run_tp(n, H, V, tp, rank, device, dtype, group, verl_lce, args.reps,
                                       profile=args.profile and tp > 1)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        _efficiency(entry["tp"])
    dist.barrier()
    if rank == 0:
        shapes = {name: {k: s[k] for k in ("N", "H", "V")} for name, s in results["by_shape"].items()}
        write_result(args.out, "tp", results, shapes={**shapes, "tp": sizes, "world": world}, label=args.label,
                     dry_run=args.dry_run)
    dist.destroy_process_group()


def _efficiency(by_tp: dict) -> None:
    """Strong-scaling efficiency of each peer, ``t(tp=1) / (tp · t(tp))``: against the same peer
    at tp = 1 and, for ours, against the single-GPU op (no group) as well."""
    base = by_tp.get(1, {}).get("timings", {})
    for tp, res in by_tp.items():
        for peer, t in res.get("timings", {}).items():
            if not peer.endswith("_tp"):
                continue
            for key, ref_peer in (("efficiency_vs_tp1", peer), ("efficiency_vs_single_gpu_op", peer[:-3] + "_single")):
                ref = base.get(ref_peer, {}).get("ms")
                if ref:
                    t[key] = round(ref / (tp * t["ms"]), 4)


def _errors(c, group) -> dict:
    """Max |Δ| of this rank's results against the single-GPU op on the whole head: the forward's
    log-probs, entropies and row log-sum-exps, and ``linear_policy_loss``'s log-probs and entropies."""
    from rlk_mm.ops import linear_policy_loss
    from rlk_mm.ops._vocab_parallel.agree import agree
    from rlk_mm.ops._vocab_parallel.logprob import shard_forward

    def stats(weight, tp_group):
        if tp_group is None and weight.is_cuda:
            from rlk_mm.ops._triton import logprob as triton_logprob

            return triton_logprob.forward(c["hidden"], weight, c["index"], c["targets"], None, 0.9, True, True)
        if tp_group is None:  # the dry run: the torch backend
            from rlk_mm.ops._torch import logprob as torch_logprob

            return torch_logprob.selected_logprob_forward(c["hidden"], weight, c["index"], c["targets"], None, 0.9)
        shard, all_rows = agree(c["hidden"], weight, c["index"], c["targets"], None, 0.9, tp_group, None, False,
                                lambda: None)
        return shard_forward(c["hidden"], weight, c["index"], c["targets"], None, 0.9, True, all_rows, shard)

    def fused(weight, tp_group):
        out = linear_policy_loss(c["hidden"], weight, index=c["index"], targets=c["targets"], temperature=0.9,
                                 old_log_probs=c["old"], advantages=c["adv"], sample_index=c["sample"],
                                 num_samples=int(c["sample"][-1]) + 1, tp_group=tp_group)
        return out.log_probs, out.entropy

    with torch.no_grad():
        single = stats(c["weight"], None)
        ours = stats(c["shard"], group)
        loss_ours = fused(c["shard"], group)
    errors = {k: (a - b).abs().max().item() for k, a, b in zip(("logp", "entropy", "lse"), ours, single)}
    errors.update({f"linear_policy_loss_{k}": (a - b).abs().max().item()
                   for k, a, b in zip(("logp", "entropy"), loss_ours, single)})
    return errors


def _profile(run, free, group) -> list[dict]:
    """The GPU kernels of one call of ``run`` on this rank, the 25 longest (total ms, calls)."""
    free()
    run()  # warm
    free()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    dist.barrier(group)
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:25]
    return [{"kernel": e.key[:120], "ms": round(e.device_time_total / 1000, 3), "calls": e.count} for e in events]


def _run_tp(n, H, V, tp, rank, device, dtype, group, verl_lce, reps, *, profile=False) -> dict:
    """One group size at one shape: timings, memory, error against the single-GPU op, bytes per token."""
    from rlk_mm.ops import selected_logprob

    c = _case(n, H, V, tp, rank, device, dtype)
    out = {}
    peers, leaves = _peers(c, group, verl_lce)
    out["verl_error"] = _verl_runs(peers, group)

    def free():
        for t in leaves:
            t.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group)

    out["timings"] = _interleaved(peers, reps, free, group)
    out["max_abs_vs_single_gpu_op"] = {k: _gather_max(v, group) for k, v in _errors(c, group).items()}
    if profile:
        out["profile_linear_policy_loss_rank0"] = _profile(peers["rlk_mm_linear_policy_loss_tp"], free, group)

    def logprob_run(case):
        h = case["hidden"].clone().requires_grad_()
        logp, ent = selected_logprob(h, case["shard"], index=case["index"], targets=case["targets"],
                                     temperature=0.9, return_entropy=True, tp_group=group)
        torch.autograd.backward([logp, ent], [case["up"], case["up_entropy"]])

    out["sent_bytes_per_token"] = _sent_per_token(logprob_run, c, group, tp)
    if "verl_linear_cross_entropy_tp" in peers:
        counter = {"bytes": 0}
        with _counting_all_reduce(tp, counter):
            free()
            peers["verl_linear_cross_entropy_tp"]()
        out["verl_sent_bytes_per_token"] = counter["bytes"] / n
    return out


if __name__ == "__main__":
    main()
