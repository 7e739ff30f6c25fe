"""Timing and memory measurement shared by the benchmarks (DESIGN.md's rules).

Median of CUDA-event timings after warm-up (wall-clock on CPU), and peak memory of one
more call above what was allocated just before it. Peers compared with each other are
best timed round-robin (``measure_interleaved``).
"""

from __future__ import annotations

import statistics
import time

import torch

GIB = float(1 << 30)
MIB = float(1 << 20)


def _call_ms(fn, device: str = "cuda") -> float:
    """Milliseconds of one call: CUDA events around it on a GPU, wall clock on CPU."""
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _summary(times: list) -> dict:
    return {
        "ms": round(statistics.median(times), 4),
        "min_ms": round(min(times), 4),
        "max_ms": round(max(times), 4),
        "times_ms": [round(t, 4) for t in times],
    }


def time_ms(fn, reps: int, warmup: int = 2, device: str = "cuda") -> dict:
    """``fn``'s median / min / max milliseconds over ``reps`` timed calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    return _summary([_call_ms(fn, device) for _ in range(reps)])


def peak_extra_bytes(fn, before=None) -> int:
    """Peak CUDA memory of one call of ``fn`` above what is allocated just before it
    (``before()`` runs first, e.g. to free the gradients of earlier calls)."""
    if before is not None:
        before()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - held


def measure(fn, reps: int, warmup: int = 2, before=None) -> dict:
    """``time_ms`` on CUDA plus ``extra_gib``: the peak memory of one more call;
    ``before()`` (e.g. freeing the gradients of earlier calls) runs before every call."""
    return measure_interleaved({"fn": fn}, reps, warmup, before)["fn"]


def measure_interleaved(fns: dict, reps: int, warmup: int = 2, before=None) -> dict:
    """``measure`` for several callables timed in turn, one call of each per round, so that
    they share the GPU's power and clock history (an H100 running these products sits at
    its power cap, and its clock moves by ~30% with what ran just before). Returns
    ``{name: measure-style dict}``."""
    def call(fn):
        if before is not None:
            before()
        return _call_ms(fn)

    for fn in fns.values():
        for _ in range(warmup):
            call(fn)
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(call(fn))
    return {name: {**_summary(times[name]), "extra_gib": round(peak_extra_bytes(fn, before) / GIB, 4)}
            for name, fn in fns.items()}
