"""The Benchmarks pages' Markdown, one result file at a time (standard library only).

``render_result`` turns one result (``bench.schema``) into a section: its run header (card,
date, versions, shapes, command, file), its note, then its timings grouped as the file groups
them, a smoke report's gates, an invariance sweep's cases, or for a file without timings its
facts. ``OPS`` titles and describes each benchmark; ``bench.report`` assembles the pages.
"""

from __future__ import annotations

import math

from .schema import VERSION_KEYS, payload

__all__ = ["OPS", "card_title", "code", "num", "op_info", "render_result", "versions_text"]

#: op -> (page title, what its results measure), in the order of the Benchmarks pages
OPS = {
    "linear_loss": ("Fused LM head + policy loss", (
        "`linear_policy_loss` (the LM head fused with the policy loss, three logits-sized products) against "
        "`policy_loss(selected_logprob(...))` (four), Liger's fused linear cross-entropy and GRPO losses, and one "
        "cuBLAS logits GEMM. Forward + backward, peak memory above the inputs.")),
    "on_policy": ("On-policy rollout", (
        "Rollout and training under `batch_invariant()` against the default kernels: what exact on-policy costs "
        "(`bench/bench_on_policy.py`).")),
    "tp": ("Vocabulary-parallel scaling", (
        "`selected_logprob` and `linear_policy_loss` with a vocabulary-sharded head over tp ranks, against the "
        "single-GPU op and verl's vocabulary-parallel `linear_cross_entropy` (`bench/bench_tp.py`).")),
    "group_memory": ("Memory against the GRPO group size", (
        "Forward + backward peak memory above the inputs (and above the gradients) and time of the log-prob "
        "computation against the group size G: torch, Liger FLCE, `selected_logprob` and `linear_policy_loss` "
        "(`bench/bench_group_memory.py`).")),
    "logprob": ("Selected log-probs", (
        "`selected_logprob` against torch (logits, fp32 log-softmax, gather) and Liger's fused linear "
        "cross-entropy: forward, forward + backward, with 25% of the tokens scored, peak memory above the inputs "
        "(`bench/bench_logprob.py`); and the probes that tuned its kernels.")),
    "sampling": ("Sampling", (
        "`sample` (from logits) and `sample_from_hidden` (the LM head fused with the draw) against torch's "
        "top-k/top-p chain, a sort-based sampler, plain multinomial and one LM-head GEMM "
        "(`bench/bench_sampling.py`).")),
    "verl_fused": ("verl's FusedLinearForPPO", (
        "verl 0.9.1's `FusedLinearForPPO` against rlk_mm's drop-in, timed round-robin "
        "(`bench/bench_verl_fused.py`), and the GPU's power and clock beside one run.")),
    "loss": ("Policy loss", (
        "`policy_loss` against verl's eager loss, and hidden states to loss against eager torch "
        "(`bench/bench_loss.py`); host costs measured by hand.")),
    "advantages": ("GRPO advantages", (
        "`group_advantages` and the verl-signature adapter against verl's GRPO advantage "
        "(`bench/bench_advantages.py`).")),
    "prefill": ("Batch-invariant prefill", (
        "A Qwen2.5-VL forward under `batch_invariant()` against the default kernels and GRPO group scoring with "
        "the media-prefix cache (`bench/bench_prefill.py`).")),
    "invariance": ("Invariance sweep", (
        "Bitwise comparisons of a Qwen2.5-VL's log-probs across batch size, padding, packing, caching and more, "
        "under `batch_invariant()` and the default kernels (`bench/bench_prefill.py`).")),
    "pack": ("Packing", (
        "`pack_padded` / `unpack_to_padded` against device-to-device copies and torch's boolean indexing "
        "(`bench/bench_pack.py`).")),
    "parity": ("Layout parity", "`check_layout_parity` on large layouts, on the CPU (`bench/bench_parity.py`)."),
    "codec": ("Codec invariance", (
        "The code-flip rate of a speech codec between each clip alone and all clips in one batch "
        "(`bench/bench_codec.py`).")),
    "families": ("Model families on the GPU", (
        "Each supported family's GPU checks and `rlk-mm smoke --model qwen3-vl` on CUDA "
        "(`bench/gpu_check_families.py`).")),
    "gpu_tests": ("GPU-marked tests", "Runs of `pytest -m gpu` on a GPU machine."),
    "smoke": ("The smoke test", (
        "Reports of `rlk-mm smoke`: gates, the learning check, and per step the reward and the largest "
        "difference between rollout and training log-probs.")),
    "smoke_sweep": ("Smoke settings sweeps", (
        "Sweeps of `rlk-mm smoke` settings that chose its defaults (`bench/smoke_sweep.py`, "
        "`bench/cpu_colour_sweep.sh`).")),
    "smoke_tasks": ("Smoke tasks: point and video", (
        "Whether the point and video-direction tasks learn, against their shuffled controls "
        "(`bench/gpu_smoke_tasks.sh`, `bench/smoke_sweep.py`).")),
    "point_task": ("Point task", "The point task against its shuffled-target control (`bench/bench_point_task.py`)."),
    "point_diagnosis": ("Point task diagnosis", (
        "The point task's answers by outcome, step by step (`bench/point_diagnosis.py`).")),
    "supervised_probe": ("Supervised probes", (
        "Whether the smoke policy can learn a task at all, supervised on its right answers "
        "(`bench/supervised_probe.py`).")),
    "adversarial": ("Adversarial probe", "Issue 31's adversarial probe of every public entry point: counts by class."),
    "frameworks": ("Framework actor steps", "What was not measured, and why."),
}

_HOST_KEYS = ("cpu", "machine", "threads", "cpu_threads", "python", "cuda")


def op_info(op: str) -> tuple[str, str]:
    """(title, what it measures) of a benchmark; an op without an entry gets its own name."""
    return OPS.get(op, (op.replace("_", " ").capitalize(), f"Results of the `{op}` benchmark."))


def card_title(card: str) -> str:
    return "CPU" if card == "cpu" else ("Card not recorded" if card == "unknown" else card)


def code(text) -> str:
    text = str(text).replace("|", "\\|").replace("\n", " ").replace("`", "'")
    return f"`{text}`"


def num(value) -> str:
    """A number as the tables print it (3 significant figures or so), text escaped for a table cell."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        a = abs(value)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{value:,.0f}"
        if a >= 10:
            return f"{value:.1f}"
        if a >= 1:
            return f"{value:.2f}"
        if a >= 0.01:
            return f"{value:.3f}"
        return f"{value:.2e}"
    if value is None:
        return "—"
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 160 else text[:157] + "..."


def versions_text(versions: dict) -> str:
    keys = [*VERSION_KEYS, *sorted(k for k in versions if k not in VERSION_KEYS)]
    return ", ".join(f"{k} {versions[k]}" for k in keys if k in versions)


def _shape_text(shape) -> str:
    if isinstance(shape, dict):
        parts = []
        for k, v in shape.items():
            if isinstance(v, dict):
                parts.append(f"{k}: {_shape_text(v)}")
            elif isinstance(v, list):
                parts.append(f"{k} = {', '.join(num(x) for x in v)}")
            else:
                parts.append(f"{k} = {num(v)}")
        return "; ".join(parts)
    if isinstance(shape, list):
        return ", ".join(num(x) for x in shape)
    return num(shape)


def _ms(entry: dict) -> str:
    return f"{num(float(entry['ms']))} ms"


# --------------------------------------------------------------------------- payload shapes


def _timing_groups(data, path=(), shape=None, out=None):
    """(path of the group, shape in force, {case: timing}) for every dict holding timings
    (entries with an ``ms`` median), depth first, in the file's order."""
    if out is None:
        out = []
    if isinstance(data, dict):
        if isinstance(data.get("shape"), dict):
            shape = data["shape"]
        elif all(k in data for k in ("N", "H", "V")):
            shape = {k: data[k] for k in ("N", "H", "V", "B", "dtype") if k in data}
        cases = {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get("ms"), (int, float))}
        if cases:
            out.append((path, shape, cases))
        for key, value in data.items():
            if key in cases or key == "meta":
                continue
            _timing_groups(value, (*path, str(key)), shape, out)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            label = None
            if isinstance(value, dict):
                label = next((f"{k} = {value[k]}" for k in ("B", "G", "config", "case", "name") if k in value), None)
            _timing_groups(value, (*path, label or f"#{i}"), shape, out)
    return out


def _timing_table(cases: dict) -> list[str]:
    extra = any("extra_gib" in t for t in cases.values())
    ranged = any("min_ms" in t for t in cases.values())
    head = ["case", "median"] + (["min – max"] if ranged else []) + (["extra memory"] if extra else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, t in cases.items():
        row = [code(name), _ms(t)]
        if ranged:
            row.append(f"{num(t['min_ms'])} – {num(t['max_ms'])} ms" if "min_ms" in t else "—")
        if extra:
            row.append(f"{num(t['extra_gib'])} GiB" if "extra_gib" in t else "—")
        lines.append("| " + " | ".join(row) + " |")
    return lines


_SKIPPED = ("meta", "times_ms", "times_ms_rank0", "module_order", "per_sample_max_abs", "warmup_loss", "per_step",
            "log", "samples", "reward_per_10_steps", "curve_per_10_steps")


def _scalars(data, prefix="", depth=0, limit=3, out=None):
    """Flattened scalar facts of a JSON value (short lists included), for files without timings."""
    if out is None:
        out = []
    if isinstance(data, dict):
        for key, value in data.items():
            if key in _SKIPPED:
                continue
            name = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, (dict, list)) and depth + 1 < limit:
                _scalars(value, name, depth + 1, limit, out)
            elif not isinstance(value, (dict, list)):
                out.append((name, value))
            elif isinstance(value, list) and len(value) <= 8 and all(not isinstance(v, (dict, list)) for v in value):
                out.append((name, ", ".join(num(v) for v in value)))
    elif isinstance(data, list):
        if len(data) <= 8 and all(not isinstance(v, (dict, list)) for v in data):
            out.append((prefix, ", ".join(num(v) for v in data)))
        else:
            for i, value in enumerate(data[:12]):
                _scalars(value, f"{prefix}[{i}]", depth + 1, limit, out)
    return out


def _facts_table(pairs, max_rows: int = 40) -> list[str]:
    lines = ["| field | value |", "|---|---|"]
    for name, value in pairs[:max_rows]:
        lines.append(f"| {code(name)} | {num(value)} |")
    if len(pairs) > max_rows:
        lines.append(f"| … | {len(pairs) - max_rows} more fields in the file |")
    return lines


def _smoke_report(data: dict) -> list[str]:
    lines = ["| gate | result | detail |", "|---|---|---|"]
    for gate in data.get("gates", []):
        lines.append(f"| {gate.get('name')} | {'PASS' if gate.get('ok') else 'FAIL'} | {num(gate.get('detail'))} |")
    out = lines + [""]
    learning = data.get("learning") or {}
    if learning:
        out += [f"Learning check: **{'OK' if learning.get('ok') else 'FAILED'}**: {num(learning.get('detail'))}", ""]
    per_step = data.get("per_step") or {}
    drift = [v for v in per_step.get("max_abs_delta", []) if isinstance(v, (int, float))]
    if drift:
        differing = sum(v for v in per_step.get("tokens_differing", []) if isinstance(v, (int, float)))
        out += [f"Rollout against training log-probs over {len(drift)} steps: largest |Δ| {num(max(drift))}, "
                f"{num(differing)} differing tokens in all.", ""]
    facts = sorted({**(data.get("timings") or {}), **{f"median {k}": v for k, v in
                                                       (data.get("per_step_medians") or {}).items()}}.items())
    if facts:
        out += _facts_table(facts) + [""]
    return out


def _invariance_results(data: dict) -> list[str]:
    lines = ["| case | detail | mode | bitwise | max abs diff | first divergence |", "|---|---|---|---|---|---|"]
    for r in data.get("results", []):
        div = r.get("divergence")
        where = div.get("module") if isinstance(div, dict) else div
        lines.append(f"| {r.get('case')} | {num(r.get('detail'))} | {r.get('mode')} | {num(r.get('bitwise'))} | "
                     f"{num(r.get('max_abs_diff'))} | {num(where)} |")
    return lines


def _run_header(rel: str, data: dict) -> list[str]:
    rows = [("File", code(f"bench/results/{rel}")), ("Card", card_title(data["card"])), ("Date", data["date"]),
            ("Command", code(data["command"])), ("Versions", versions_text(data["versions"])),
            ("Shapes", _shape_text(data["shapes"]))]
    host = data.get("host") or {}
    host_text = ", ".join(f"{k} {num(host[k])}" for k in _HOST_KEYS if host.get(k) not in (None, ""))
    if host_text:
        rows.append(("Host", host_text))
    migrated = data.get("migrated")
    if isinstance(migrated, dict):
        rows.append(("Moved", f"from {code(migrated['from'].removeprefix('bench/results/'))}; "
                              f"date: {migrated.get('date', 'unknown')}"))
    return ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]


def render_result(rel: str, data: dict, plots: list[str] = (), level: int = 3) -> str:
    """One result as Markdown under a heading of ``level``: its run header, note and plots, then
    its payload (timings, a smoke report, an invariance sweep's cases, or its facts)."""
    body = payload(data)
    stem = rel.rsplit("/", 1)[-1].removesuffix(".json")
    title = f"{stem[:10]} · {stem[11:]}"
    lines = [f"{'#' * level} {title}", ""] + _run_header(rel, data) + [""]
    if data.get("note"):
        lines += [str(data["note"]).replace("\n", " "), ""]
    for plot in plots:
        lines += [f"![{title}]({plot})", ""]
    if "gates" in body and ("per_step" in body or "steps" in body):
        return "\n".join(lines + _smoke_report(body))
    if isinstance(body.get("results"), list) and body["results"] and "case" in body["results"][0]:
        return "\n".join(lines + _invariance_results(body) + [""])
    groups = _timing_groups(body)
    if not groups:
        return "\n".join(lines + _facts_table(_scalars(body)) + [""])
    for path, shape, cases in groups:
        name = " / ".join(p for p in path if p not in ("timings",)) or "timings"
        lines += [f"**{name}**" + (f" ({_shape_text(shape)})" if shape else ""), ""]
        lines += _timing_table(cases) + [""]
    return "\n".join(lines)
