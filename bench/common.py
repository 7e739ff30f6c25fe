"""What the benchmarks share: timing and memory measurement, the run's metadata, shared
shapes (``configs/``), writing a result in the one schema and path scheme of ``bench.schema``
(``write_result``), forcing an rlk_mm backend, and importing verl where ray is missing.

Times are medians of CUDA-event timings after warm-up (wall clock on CPU); memory is the
peak of one more call above what was allocated just before it. Peers compared with each
other are best timed round-robin (``measure_interleaved``). The scripts are modules of the
``bench`` package: run them from the repository root as ``python -m bench.<script>``.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch

from .schema import OPTIONAL, REQUIRED, SCHEMA_VERSION, UNKNOWN, VERSION_KEYS, check_result, dumps, result_path

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = Path(__file__).resolve().parent / "configs"
#: where results go unless ``--out`` says otherwise
DEFAULT_OUT = os.environ.get("OUT", ".")
#: distributions whose versions a run records (peers of some benchmarks included; triton and
#: transformers are written "not installed" where absent, the others left out)
PACKAGES = ("triton", "transformers", "verl", "liger-kernel")

GIB = float(1 << 30)
MIB = float(1 << 20)


def call_ms(fn, device: str = "cuda") -> float:
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
    return _summary([call_ms(fn, device) for _ in range(reps)])


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
        return call_ms(fn)

    for fn in fns.values():
        for _ in range(warmup):
            call(fn)
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(call(fn))
    return {name: {**_summary(times[name]), "extra_gib": round(peak_extra_bytes(fn, before) / GIB, 4)}
            for name, fn in fns.items()}


def command_line() -> str:
    """This run's command, as ``python -m bench.<script> <args>`` (or the script path it was run by)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    script = ["-m", spec.name] if spec is not None and spec.name else sys.argv[:1]
    return " ".join(["python", *script, *sys.argv[1:]])


def rlk_mm_commit() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes to tracked files), from
    ``$RLK_MM_COMMIT`` where set (a copy of the tree without ``.git``), else ``"unknown"``."""
    if os.environ.get("RLK_MM_COMMIT"):
        return os.environ["RLK_MM_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    return f"{head}+dirty" if dirty else head or UNKNOWN


def run_metadata() -> dict:
    """This run's schema fields (``bench.schema``): card (torch's device name, ``"cpu"`` without
    CUDA), date (UTC), command, versions (torch, transformers, triton, rlk_mm's commit, and the
    peers' packages where installed) and host (CPU, Python, CUDA)."""
    versions = {"torch": torch.__version__}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name in VERSION_KEYS:
                versions[name] = "not installed"
    versions["rlk_mm"] = rlk_mm_commit()
    return {
        "card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command_line(),
        "versions": versions,
        "host": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                 "cuda": torch.version.cuda, "threads": torch.get_num_threads()},
    }


def add_output_args(parser) -> None:
    """``--out`` (default ``$OUT`` or ``.``) and ``--label`` (default ``default``): where
    ``write_result`` files the result, and the run's name in its file name."""
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="results folder: the file goes to OUT/<op>/<card>/<day>-<label>.json (default $OUT or .)")
    parser.add_argument("--label", default="default",
                        help="this run's name in its file name (default: default, the script's default settings)")


def write_result(out_dir, op: str, data: dict, *, shapes, label: str = "default", dry_run: bool = False,
                 card: str | None = None, note: str | None = None) -> Path:
    """Write ``data`` (the payload) with this run's schema fields (``bench.schema``) to
    ``out_dir/<op>/<card slug>/<day>-<label>.json``; ``--out bench/results`` files it where the
    reports read it. ``card`` names what ran the measurement where that is not this machine's GPU
    (``"cpu"`` for a CPU run on a GPU machine). A dry run (tiny shapes, a check of the script's
    code paths, no figure to keep) goes to ``out_dir/<op>.json`` instead, outside the scheme.
    Returns the path."""
    clash = sorted(set(data) & {*REQUIRED, *OPTIONAL})
    if clash:
        raise ValueError(f"the payload of {op} uses the schema's keys {clash}: rename them")
    meta = run_metadata()
    result = {"schema": SCHEMA_VERSION, "op": op, "label": "dry-run" if dry_run else label, "card": card or meta["card"],
              "date": meta["date"], "command": meta["command"], "versions": meta["versions"],
              "shapes": shapes if shapes not in (None, "", {}, []) else UNKNOWN, "host": meta["host"]}
    if note:
        result["note"] = note
    result.update(data)
    problems = check_result(result)
    if problems:
        raise ValueError(f"result of {op} breaks the schema: {problems}")
    rel = Path(f"{op}.json") if dry_run else Path(result_path(op, result["card"], result["date"], result["label"]))
    path = Path(out_dir) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(result), encoding="utf-8")
    print(f"wrote {path}", flush=True)
    return path


def load_config(name: str):
    """The shared shapes or model config ``configs/<name>.json``."""
    return json.loads((CONFIGS / f"{name}.json").read_text())


@contextlib.contextmanager
def forced_backend(name: str):
    """Run the block with ``RLK_MM_BACKEND=name`` (``torch`` or ``triton``)."""
    old = os.environ.get("RLK_MM_BACKEND")
    os.environ["RLK_MM_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("RLK_MM_BACKEND")
        else:
            os.environ["RLK_MM_BACKEND"] = old


def install_ray_stand_in() -> None:
    """Let verl import where ray is missing (verl imports ray at import time; the benchmarks
    use only its stateless functions): installs ``tests/support/ray_stand_in.py``, loaded from its
    file (no ``sys.path`` change)."""
    spec = importlib.util.spec_from_file_location("ray_stand_in", ROOT / "tests" / "support" / "ray_stand_in.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()
