"""Benchmark pages and the README's headline table, rendered from ``bench/results/*.json``.

Every number on the site's Benchmarks pages and in the README's headline table comes from
here, read from the result files the benchmark scripts wrote: nothing is copied by hand.
Each table names the card, the versions, the shapes and the command, from the file's
``meta`` block (or, for files written before ``bench/common.py`` had one, from the
top-level keys those scripts recorded).

Two uses:

- ``python -m bench.report`` prints the headline table; ``--readme README.md`` rewrites the
  block between the README's markers (``<!-- bench:headline:start -->`` and
  ``<!-- bench:headline:end -->``), ``--check`` only says whether it is stale (exit 1);
  ``--pages DIR`` writes the Benchmarks pages as Markdown files, to read them without mkdocs.
- The mkdocs hook (``mkdocs.yml``: ``hooks: [bench/report.py]``): the pages are generated
  at build time (never committed), and the nav's ``Benchmarks`` and ``Notes`` entries are
  expanded into their pages.

Standard library only: mkdocs loads this file by path, outside the ``bench`` package.

Any result file may carry a top-level ``"headline"`` list of rows for the README's headline
table, each ``{"metric", "ours", "peer", "unit"}`` (numbers, or text; the ratio is computed
where both are numbers) or, as earlier files have them, ``{"what", "ours", "peer", "ratio"}``;
``linear_loss.json`` and ``tp.json`` get their rows computed here from their timings.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

__all__ = [
    "FAMILIES", "HEADLINE_END", "HEADLINE_START", "RESULTS", "benchmark_pages", "headline_block", "headline_table",
    "load_results", "meta_of", "nav_pages", "readme_block", "render_file", "unlisted_guides",
]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
NOTES = ROOT / "docs" / "notes"

HEADLINE_START = "<!-- bench:headline:start -->"
HEADLINE_END = "<!-- bench:headline:end -->"

#: (page slug, title, file-name pattern, what the page measures); a file goes to the first family it matches
FAMILIES = (
    ("linear_loss", "Fused LM head + policy loss", r"linear_loss",
     ("`linear_policy_loss` (the LM head fused with the policy loss, three logits-sized products) against "
      "`policy_loss(selected_logprob(...))` (four), Liger's fused linear cross-entropy and GRPO losses, and "
      "one cuBLAS logits GEMM. Forward + backward, peak memory above the inputs.")),
    ("logprob", "Selected log-probs", r"logprob",
     ("`selected_logprob` against torch (logits, fp32 log-softmax, gather) and Liger's fused linear "
      "cross-entropy: forward, forward + backward, with 25% of the tokens scored, peak memory above the inputs.")),
    ("loss", "Policy loss and advantages", r"(loss|advantages)",
     ("`policy_loss` against verl's eager loss, hidden states to loss against eager torch, and "
      "`group_advantages` against verl's GRPO advantage.")),
    ("sampling", "Sampling", r"sampling",
     ("`sample` (from logits) and `sample_from_hidden` (the LM head fused with the draw) against torch's "
      "top-k/top-p chain, a sort-based sampler, plain multinomial and one LM-head GEMM.")),
    ("tp", "Vocabulary-parallel scaling", r"tp",
     ("`selected_logprob` and `linear_policy_loss` with a vocabulary-sharded head over tp ranks, against the "
      "single-GPU op and verl's vocabulary-parallel `linear_cross_entropy`.")),
    ("verl_fused", "verl's FusedLinearForPPO", r"verl_fused",
      "verl 0.9.1's `FusedLinearForPPO` against rlk_mm's drop-in, verl's class and ours timed round-robin."),
    ("on_policy", "On-policy rollout", r"on_policy",
      "Rollout and training under `batch_invariant()` against the default kernels: what exact on-policy costs."),
    ("prefill", "Batch-invariant prefill", r"(prefill|invariance)",
     ("A Qwen2.5-VL forward under `batch_invariant()` against the default kernels, GRPO group scoring with the "
      "media-prefix cache, and the invariance sweep.")),
    ("pack", "Packing", r"pack",
      "`pack_padded` / `unpack_to_padded` against device-to-device copies and torch's boolean indexing."),
    ("codec", "Codec invariance", r"codec",
      "The code-flip rate of a speech codec between each clip alone and all clips in one batch."),
    ("parity", "Layout parity", r"parity", "`check_layout_parity` on large layouts, on the CPU."),
    ("families", "Model families on the GPU", r"families",
     ("Each supported family's GPU checks: Qwen3-VL at its 2B and 8B widths (decode, vision cache, layouts and "
      "rollout bitwise the training forward, bf16 and fp32) and `rlk-mm smoke --model qwen3-vl` on CUDA.")),
    ("smoke", "The smoke test", r"(smoke|point_task|gpu_tests)",
     ("Reports of `rlk-mm smoke`, the settings sweeps that chose its defaults, the point task, and the "
      "GPU-marked tests.")),
    ("other", "Other results", r".*", "Result files of no other family."),
)

_VERSION_KEYS = ("python", "torch", "cuda", "triton", "transformers", "verl", "liger-kernel", "liger_kernel", "numpy",
                 "rlk_mm")
_CARD_KEYS = ("gpu", "device", "machine")


# --------------------------------------------------------------------------- loading


def load_results(results_dir: Path | str = RESULTS) -> dict[str, dict]:
    """Every ``*.json`` of ``results_dir``, by file name, in name order."""
    out = {}
    for path in sorted(Path(results_dir).glob("*.json")):
        with open(path, encoding="utf-8") as f:
            out[path.name] = json.load(f)
    return out


def meta_of(data: dict) -> dict:
    """The run's metadata: card, CPU, versions, command, date.

    From the ``meta`` block where the file has one; for files written before it existed,
    from the top-level keys their scripts recorded (``gpu``/``device``, ``torch``, ...,
    ``command``), and a smoke report's ``versions``."""
    meta = dict(data.get("meta") or {}) if isinstance(data, dict) else {}
    if not isinstance(data, dict):
        return meta
    for key in (*_CARD_KEYS, "cpu", "threads", "cpu_threads", *_VERSION_KEYS, "command", "date"):
        value = data.get(key)
        if key not in meta and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            meta[key] = value
    if isinstance(data.get("versions"), dict):
        for key, value in data["versions"].items():
            meta.setdefault(key, value)
    if "command" not in meta and isinstance(data.get("how"), str):
        meta["command"] = data["how"]
    return meta


def _card(meta: dict) -> str:
    for key in _CARD_KEYS:
        if meta.get(key):
            return str(meta[key])
    return f"CPU ({meta['cpu']})" if meta.get("cpu") else "not recorded"


def _versions(meta: dict) -> str:
    parts = [f"{key.replace('_', '-')} {meta[key]}" for key in _VERSION_KEYS if meta.get(key)]
    return ", ".join(parts) or "not recorded"


def _code(text) -> str:
    text = str(text).replace("|", "\\|").replace("\n", " ")
    return f"`{text}`"


# --------------------------------------------------------------------------- numbers


def _num(value) -> str:
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


def _ms(entry: dict) -> str:
    return f"{_num(float(entry['ms']))} ms"


def _shape_text(shape) -> str:
    if isinstance(shape, dict):
        return ", ".join(f"{k} = {_num(v)}" for k, v in shape.items() if not isinstance(v, (dict, list)))
    return _num(shape)


# --------------------------------------------------------------------------- one file


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
                label = next((f"{k} = {value[k]}" for k in ("B", "config", "case", "name") if k in value), None)
            _timing_groups(value, (*path, label or f"#{i}"), shape, out)
    return out


def _timing_table(cases: dict) -> list[str]:
    extra = any("extra_gib" in t for t in cases.values())
    ranged = any("min_ms" in t for t in cases.values())
    head = ["case", "median"] + (["min – max"] if ranged else []) + (["extra memory"] if extra else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, t in cases.items():
        row = [_code(name), _ms(t)]
        if ranged:
            row.append(f"{_num(t['min_ms'])} – {_num(t['max_ms'])} ms" if "min_ms" in t else "—")
        if extra:
            row.append(f"{_num(t['extra_gib'])} GiB" if "extra_gib" in t else "—")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _scalars(data, prefix="", depth=0, limit=3, out=None):
    """Flattened scalar facts of a JSON value (short lists included), for files without timings."""
    if out is None:
        out = []
    if isinstance(data, dict):
        for key, value in data.items():
            if key in ("meta", "what", "times_ms", "module_order", "per_sample_max_abs", "warmup_loss", "steps"):
                continue
            name = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, (dict, list)) and depth + 1 < limit:
                _scalars(value, name, depth + 1, limit, out)
            elif not isinstance(value, (dict, list)):
                out.append((name, value))
            elif isinstance(value, list) and len(value) <= 8 and all(not isinstance(v, (dict, list)) for v in value):
                out.append((name, ", ".join(_num(v) for v in value)))
    elif isinstance(data, list):
        if len(data) <= 8 and all(not isinstance(v, (dict, list)) for v in data):
            out.append((prefix, ", ".join(_num(v) for v in data)))
        else:
            for i, value in enumerate(data[:12]):
                _scalars(value, f"{prefix}[{i}]", depth + 1, limit, out)
    return out


def _facts_table(pairs, max_rows: int = 40) -> list[str]:
    lines = ["| field | value |", "|---|---|"]
    for name, value in pairs[:max_rows]:
        lines.append(f"| {_code(name)} | {_num(value)} |")
    if len(pairs) > max_rows:
        lines.append(f"| … | {len(pairs) - max_rows} more fields in the file |")
    return lines


def _smoke_report(data: dict) -> list[str]:
    lines = ["| gate | result | detail |", "|---|---|---|"]
    for gate in data.get("gates", []):
        lines.append(f"| {gate.get('name')} | {'PASS' if gate.get('ok') else 'FAIL'} | {_num(gate.get('detail'))} |")
    learning = data.get("learning") or {}
    out = lines + [""]
    if learning:
        out.append(f"Learning check: **{'OK' if learning.get('ok') else 'FAILED'}**: {_num(learning.get('detail'))}")
        out.append("")
    timings = data.get("timings") or {}
    if timings:
        out += _facts_table(sorted(timings.items()))
        out.append("")
    return out


def _invariance_results(data: dict) -> list[str]:
    lines = ["| case | detail | mode | bitwise | max abs diff | first divergence |", "|---|---|---|---|---|---|"]
    for r in data.get("results", []):
        div = r.get("divergence")
        where = div.get("module") if isinstance(div, dict) else div
        lines.append(f"| {r.get('case')} | {_num(r.get('detail'))} | {r.get('mode')} | {_num(r.get('bitwise'))} | "
                     f"{_num(r.get('max_abs_diff'))} | {_num(where)} |")
    return lines


def _run_header(name: str, data: dict, shapes: list[str]) -> list[str]:
    meta = meta_of(data)
    cpu = meta.get("cpu")
    threads = meta.get("threads", meta.get("cpu_threads"))
    cpu_text = f"{cpu}" + (f", {threads} threads" if threads else "") if cpu else None
    rows = [("Card", _card(meta))]
    if cpu_text and _card(meta) != f"CPU ({cpu})":
        rows.append(("CPU", cpu_text))
    rows += [("Versions", _versions(meta))]
    if shapes:
        rows.append(("Shapes", "; ".join(shapes)))
    rows += [("Command", _code(meta["command"]) if meta.get("command") else "not recorded")]
    if meta.get("date"):
        rows.append(("Date", str(meta["date"])))
    rows.append(("File", _code(f"bench/results/{name}")))
    return ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]


def render_file(name: str, data) -> str:
    """One result file as Markdown: its run header (card, versions, shapes, command,
    file), then its timings grouped as the file groups them (or, for a file without
    timings, its facts). A file holding several runs (``runs``) renders each run."""
    if isinstance(data, dict) and isinstance(data.get("runs"), list) and all(
            isinstance(r, dict) and "meta" in r for r in data["runs"]):
        parts = [f"## `{name}`", ""]
        if data.get("how"):
            parts += [_num(data["how"]), ""]
        for i, run in enumerate(data["runs"]):
            parts.append(render_file(f"{name}", run).replace(f"## `{name}`", f"### `{name}`, run {i + 1}", 1))
        return "\n".join(parts)
    if not isinstance(data, dict):
        return "\n".join([f"## `{name}`", "", f"A JSON {type(data).__name__}, not a result object.", ""])
    groups = _timing_groups(data)
    shapes = []
    for _, shape, _ in groups:
        text = _shape_text(shape) if shape else ""
        if text and text not in shapes:
            shapes.append(text)
    if not shapes and isinstance(data.get("shape"), dict):
        shapes.append(_shape_text(data["shape"]))
    if not shapes and isinstance(data.get("settings"), dict):
        shapes.append(_shape_text(data["settings"]))
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    if not shapes and isinstance(meta.get("config"), dict):  # a model's dimensions (the invariance sweep's meta)
        extra = {k: meta[k] for k in ("dtype", "samples", "response_length", "group_size") if k in meta}
        shapes.append(_shape_text({**meta["config"], **extra}))
    lines = [f"## `{name}`", ""] + _run_header(name, data, shapes) + [""]
    if isinstance(data.get("what"), str):
        lines += [data["what"].replace("\n", " "), ""]
    if "gates" in data and "steps" in data:
        return "\n".join(lines + _smoke_report(data))
    if isinstance(data.get("results"), list) and data["results"] and "case" in data["results"][0]:
        return "\n".join(lines + _invariance_results(data) + [""])
    if not groups:
        return "\n".join(lines + _facts_table(_scalars(data)) + [""])
    for path, shape, cases in groups:
        title = " / ".join(p for p in path if p not in ("timings",)) or "timings"
        lines += [f"**{title}**" + (f" ({_shape_text(shape)})" if shape else ""), ""]
        lines += _timing_table(cases) + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- pages


def _family(name: str) -> str:
    stem = name.removesuffix(".json")
    for slug, _, pattern, _ in FAMILIES:
        if re.match(rf"^{pattern}$|^{pattern}_", stem):
            return slug
    return "other"


def benchmark_pages(results: dict[str, dict] | None = None) -> dict[str, str]:
    """The Benchmarks pages, ``{"benchmarks/<slug>.md": markdown}``, the overview first."""
    results = load_results() if results is None else results
    by_family: dict[str, list[str]] = {}
    for name in results:
        by_family.setdefault(_family(name), []).append(name)
    pages = {}
    index = [
        "# Benchmarks", "",
        ("Generated at build time by `bench/report.py` from `bench/results/*.json`, the files the benchmark "
        "scripts in `bench/` wrote; no number here is copied by hand. Each table names the card, the versions, "
        "the shapes and the command of its run. Timings are medians of CUDA-event timings after warm-up (wall "
        "clock on CPU); memory is the peak above the inputs. `bench/results/README.md` says which script and "
        "command wrote each file."), "",
        "## Headline", "", headline_table(results), "",
        "## Pages", "",
    ]
    for slug, title, _, what in FAMILIES:
        names = by_family.get(slug)
        if not names:
            continue
        index.append(f"- [{title}]({slug}.md): {len(names)} result file{'s' if len(names) > 1 else ''}")
        body = [f"# {title}", "", what, "",
                "Generated by `bench/report.py` from the result files below; each section names its run.", ""]
        for name in names:
            body.append(render_file(name, results[name]))
        pages[f"benchmarks/{slug}.md"] = "\n".join(body)
    return {"benchmarks/index.md": "\n".join(index) + "\n", **pages}


# --------------------------------------------------------------------------- headline


def _ratio(ours: float, peer: float) -> str:
    return f"{ours / peer:.2f}×" if peer else "—"


def _given_row(row: dict, data: dict, name: str) -> list[str]:
    """One row of a file's own ``"headline"`` list, in the table's columns."""
    if "metric" not in row:
        return [str(row.get("what")), str(row.get("ours")), str(row.get("peer")), str(row.get("ratio")),
                _card(meta_of(data)), name]
    unit = f" {row['unit']}" if row.get("unit") else ""
    ours, peer = row.get("ours"), row.get("peer")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (ours, peer))

    def cell(value) -> str:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return f"{_num(value)}{unit}" if number else _num(value)

    return [_num(row["metric"]), cell(ours), cell(peer), _ratio(ours, peer) if numbers else "—",
            _card(meta_of(data)), name]


def _headline_rows(results: dict[str, dict]) -> tuple[list[list[str]], list[str]]:
    rows, sources = [], []
    fused = results.get("linear_loss.json")
    if fused:
        for key, data in fused.items():
            if not (isinstance(data, dict) and "timings" in data and "shape" in data):
                continue
            t, s = data["timings"], data["shape"]
            if "ours_linear" in t and "liger_flce" in t:
                rows.append([
                    f"fused LM head + policy loss, fwd+bwd, N {s['N']:,}, H {s['H']}, V {s['V']:,} ({key})",
                    _ms(t["ours_linear"]), f"Liger FLCE {_ms(t['liger_flce'])}",
                    _ratio(t["ours_linear"]["ms"], t["liger_flce"]["ms"]), _card(meta_of(fused)), "linear_loss.json",
                ])
        sources.append("linear_loss.json")
    on_policy = results.get("on_policy.json")
    if on_policy and isinstance(on_policy.get("headline"), list):
        rows += [_given_row(r, on_policy, "on_policy.json") for r in on_policy["headline"]]
        sources.append("on_policy.json")
    elif not on_policy:
        rows.append(["on-policy rollout: RL step under `batch_invariant()` vs default kernels",
                     "not measured yet", "—", "—", "—", "`on_policy.json` (to come)"])
    tp = results.get("tp.json")
    if tp:
        for shape in (tp.get("shapes") or {}).values():
            for size, entry in sorted((shape.get("tp") or {}).items(), key=lambda kv: int(kv[0])):
                t = entry.get("timings") or {}
                ours = t.get("rlk_mm_linear_policy_loss_tp") or t.get("rlk_mm_selected_logprob_tp")
                peer = t.get("verl_linear_cross_entropy_tp")
                if not ours:
                    continue
                eff = ours.get("efficiency_vs_tp1")
                what = (f"vocab-parallel fused loss, tp {size}, N {shape['N']:,}, H {shape['H']}, V {shape['V']:,}"
                        + (f" (efficiency vs tp 1: {eff:.2f})" if isinstance(eff, (int, float)) else ""))
                rows.append([what, _ms(ours), f"verl `linear_cross_entropy` {_ms(peer)}" if peer else "—",
                             _ratio(ours["ms"], peer["ms"]) if peer else "—", _card(meta_of(tp)), "tp.json"])
        sources.append("tp.json")
    for name, data in results.items():
        if name in ("on_policy.json",) or not isinstance(data, dict) or not isinstance(data.get("headline"), list):
            continue
        rows += [_given_row(r, data, name) for r in data["headline"]]
        sources.append(name)
    return rows, sources


def headline_table(results: dict[str, dict] | None = None, link: str | None = None) -> str:
    """The headline table: the fused loss against Liger, the on-policy rollout's cost, TP
    scaling against verl; then, per source file, its versions and command. With ``link``
    (a folder path relative to the page, such as ``bench/results/``), each result file links there."""
    results = load_results() if results is None else results
    rows, sources = _headline_rows(results)
    lines = ["| | rlk_mm | peer | ratio | card | result file |", "|---|---|---|---|---|---|"]
    for r in rows:
        source = r[5] if r[5].startswith("`") else _code(r[5])
        if link and r[5] in results:
            source = f"[{source}]({link}{r[5]})"
        lines.append("| " + " | ".join(r[:5]) + f" | {source} |")
    lines.append("")
    for name in sources:
        meta = meta_of(results[name])
        lines.append(f"- `{name}`: {_versions(meta)}; "
                     f"{_code(meta['command']) if meta.get('command') else 'command not recorded'}")
    return "\n".join(lines)


def headline_block(results: dict[str, dict] | None = None) -> str:
    """The README's block, markers included; result files link into ``bench/results/``, and a
    closing line points to the Benchmarks pages."""
    return "\n".join([
        HEADLINE_START,
        "<!-- generated by `python -m bench.report --readme README.md` from bench/results/*.json: do not edit -->",
        headline_table(results, link="bench/results/"),
        "",
        ("Every result file, with its shapes and settings: the Benchmarks pages of the docs site (`make docs`, "
         "then `build/site/benchmarks/`, or `python -m bench.report --pages DIR` for Markdown), and "
         "[bench/results/README.md](bench/results/README.md) for the command that wrote each file."),
        HEADLINE_END,
    ])


def readme_block(text: str) -> str | None:
    """The README's current block, markers included, or None where it has no markers."""
    start, end = text.find(HEADLINE_START), text.find(HEADLINE_END)
    if start < 0 and end < 0:
        return None
    if start < 0 or end < start:
        raise ValueError(f"the README has one headline marker without the other: {HEADLINE_START} ... {HEADLINE_END}")
    return text[start:end + len(HEADLINE_END)]


# --------------------------------------------------------------------------- nav


def _title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def nav_pages(results: dict[str, dict] | None = None, notes_dir: Path = NOTES) -> dict[str, list]:
    """The nav's expanded sections: ``{"Benchmarks": [...], "Notes": [...]}`` (notes newest first)."""
    pages = benchmark_pages(results)
    bench = [{"Overview": "benchmarks/index.md"}]
    titles = {f"benchmarks/{slug}.md": title for slug, title, _, _ in FAMILIES}
    bench += [{titles[p]: p} for p in pages if p != "benchmarks/index.md"]
    notes = [{"About the notes": "notes/index.md"}]
    for path in sorted(Path(notes_dir).glob("*.md"), reverse=True):
        if path.name != "index.md":
            notes.append({_title(path): f"notes/{path.name}"})
    return {"Benchmarks": bench, "Notes": notes}


# --------------------------------------------------------------------------- mkdocs hook


def unlisted_guides(listed: list, guides_dir: Path = NOTES.parent / "guides") -> list[dict]:
    """``{title: "guides/<page>.md"}`` for each guide page that ``listed`` (the nav's Guides) lacks."""
    have = {v for entry in listed if isinstance(entry, dict) for v in entry.values()}
    return [{_title(p): f"guides/{p.name}"} for p in sorted(Path(guides_dir).glob("*.md"))
            if f"guides/{p.name}" not in have]


def on_config(config, **kwargs):
    """Expand the nav's ``Benchmarks`` and ``Notes`` entries into their pages, and append to
    ``Guides`` any guide page the nav does not list yet (a new guide is never left out)."""
    expanded = nav_pages()
    nav = config.get("nav") or []
    for i, item in enumerate(nav):
        if isinstance(item, dict) and len(item) == 1:
            (key, value), = item.items()
            if key in expanded and isinstance(value, str):
                nav[i] = {key: expanded[key]}
            elif key == "Guides" and isinstance(value, list):
                value.extend(unlisted_guides(value))
    return config


def on_files(files, config, **kwargs):
    """Add the generated Benchmarks pages to the site's files."""
    from mkdocs.structure.files import File

    for src_uri, content in benchmark_pages().items():
        existing = files.get_file_from_path(src_uri)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, src_uri, content=content))
    return files


# --------------------------------------------------------------------------- command


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(RESULTS), help="folder of result JSON files (default: bench/results)")
    parser.add_argument("--readme", metavar="FILE", help="rewrite the headline block between FILE's markers")
    parser.add_argument("--check", action="store_true", help="with --readme: exit 1 if the block is stale; no write")
    parser.add_argument("--pages", metavar="DIR", help="write the Benchmarks pages as Markdown files into DIR")
    args = parser.parse_args(argv)
    results = load_results(args.results)
    if args.pages:
        for rel, content in benchmark_pages(results).items():
            path = Path(args.pages) / Path(rel).name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content, encoding="utf-8")
        print(f"wrote {len(benchmark_pages(results))} pages to {args.pages}")
    if args.readme:
        path = Path(args.readme)
        text = path.read_text(encoding="utf-8")
        current = readme_block(text)
        if current is None:
            print(f"{path} has no headline markers ({HEADLINE_START} ... {HEADLINE_END}): nothing to do",
                  file=sys.stderr)
            return 0
        wanted = headline_block(results)
        if current == wanted:
            print(f"{path}: the headline table is up to date")
            return 0
        if args.check:
            print(f"{path}: the headline table is stale: run python -m bench.report --readme {path}", file=sys.stderr)
            return 1
        path.write_text(text.replace(current, wanted), encoding="utf-8")
        print(f"{path}: headline table rewritten")
    if not args.pages and not args.readme:
        print(headline_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
