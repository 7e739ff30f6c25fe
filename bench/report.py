"""The Benchmarks pages, their pictures and the README's headline tables, generated from the
result files under ``bench/results/`` (``<op>/<card>/<day>-<label>.json``, ``bench.schema``).

Every number on ``docs/benchmarks/`` and in the README's headline tables comes from here, read
from the files the benchmark scripts wrote: nothing is copied by hand.

    python -m bench.report            # write docs/benchmarks/ (pages and pictures) and the README's block
    python -m bench.report --check    # exit 1 where any of them is stale (writes nothing)
    python -m bench.report --print    # print the headline tables

The headline has one table per card (rows of two cards never share a table), each from the
newest ``default`` run of each op on that card: the fused loss against Liger, the on-policy
rollout against the default kernels, vocabulary-parallel scaling against verl, memory against
the GRPO group size. A ratio is rlk_mm over the peer and says which is faster (or uses less
memory). A result file may also carry its own ``headline`` rows ``{"metric", "ours", "peer",
"unit", "note"?}``. The pages are committed (the README links them); ``make docs`` fails where
they are stale (``bench/mkdocs_hook.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .plots import draw, plot_names
from .report_pages import card_title, code, num, op_info, render_result, versions_text
from .schema import RESULTS, VERSION_KEYS, load_results, payload

__all__ = [
    "HEADLINE_END", "HEADLINE_START", "PAGES", "benchmark_pages", "headline_block", "headline_rows",
    "headline_tables", "main", "nav_pages", "pictures", "readme_block", "stale", "unlisted_guides", "write",
]

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: the generated pages, relative to docs/
PAGES = "benchmarks"
NOTES = DOCS / "notes"
HEADLINE_START = "<!-- bench:headline:start -->"
HEADLINE_END = "<!-- bench:headline:end -->"
_UNITS = {"ms": ("faster", "slower"), "s": ("faster", "slower"), "GiB": ("less memory", "more memory"),
          "MiB": ("less memory", "more memory")}


# --------------------------------------------------------------------------- headline


def _newest_default(results: dict[str, dict], op: str) -> dict[str, str]:
    """``{card: result path}``: each card's newest ``default`` run of ``op``."""
    best: dict[str, str] = {}
    for rel, data in results.items():
        if data["op"] == op and data["label"] == "default":
            card = data["card"]
            if card not in best or data["date"] > results[best[card]]["date"]:
                best[card] = rel
    return best


def ratio_text(ours, peer, unit: str = "") -> str:
    """``0.88× (12.3 % faster)``: rlk_mm over the peer, and what the ratio means for ``unit``."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (ours, peer)) or not peer:
        return "—"
    ratio = ours / peer
    if abs(ratio - 1) < 5e-4:
        return f"{ratio:.2f}× (the same)"
    less, more = _UNITS.get(unit, ("lower", "higher"))
    return f"{ratio:.2f}× ({abs(1 - ratio) * 100:.1f} % {less if ratio < 1 else more})"


def _row(metric, ours, peer, unit, rel, note=None) -> dict:
    return {"metric": metric, "ours": ours, "peer": peer, "unit": unit, "source": rel, "note": note}


def _linear_loss_rows(rel, data):
    for key, entry in payload(data).items():
        if isinstance(entry, dict) and "timings" in entry and "shape" in entry:
            t, s = entry["timings"], entry["shape"]
            if "ours_linear" in t and "liger_flce" in t:
                yield _row(f"fused LM head + policy loss vs Liger FLCE, fwd+bwd, N {s['N']:,}, H {s['H']}, "
                           f"V {s['V']:,}", t["ours_linear"]["ms"], t["liger_flce"]["ms"], "ms", rel)


def _tp_rows(rel, data):
    for entry in (payload(data).get("by_shape") or {}).values():
        sizes = sorted(entry.get("tp") or {}, key=int)
        if len(sizes) < 2:
            continue
        t = entry["tp"][sizes[-1]].get("timings") or {}
        ours, peer = t.get("rlk_mm_linear_policy_loss_tp"), t.get("verl_linear_cross_entropy_tp")
        if ours and peer:
            eff = ours.get("efficiency_vs_tp1")
            yield _row(f"vocab-parallel fused loss vs verl `linear_cross_entropy`, tp {sizes[-1]}"
                       + (f" (efficiency {eff:.2f} of tp 1)" if isinstance(eff, (int, float)) else "")
                       + f", N {entry['N']:,}, H {entry['H']}, V {entry['V']:,}", ours["ms"], peer["ms"], "ms", rel)


def _group_memory_rows(rel, data):
    body = payload(data)
    rows = [r for r in body.get("rows") or [] if "torch_native" in r.get("peers", {})
            and "ours_linear" in r["peers"] and "above_grads_gib" in r["peers"]["torch_native"]]
    if rows:
        r, s = rows[-1], body.get("shape") or {}
        yield _row(f"memory above the gradients vs torch, log-probs + GRPO loss fwd+bwd, V {s.get('V', 0):,}, "
                   f"H {s.get('H')}, G {r['G']} × {s.get('seq')} tokens", r["peers"]["ours_linear"]["above_grads_gib"],
                   r["peers"]["torch_native"]["above_grads_gib"], "GiB", rel)


def _given_rows(rel, data):
    for r in payload(data).get("headline") or []:
        if isinstance(r, dict) and "metric" in r:
            yield _row(r["metric"], r.get("ours"), r.get("peer"), r.get("unit", ""), rel, r.get("note"))


#: op -> the headline rows of one result
HEADLINE_OPS = {"linear_loss": _linear_loss_rows, "on_policy": _given_rows, "tp": _tp_rows,
                "group_memory": _group_memory_rows}


def headline_rows(results: dict[str, dict] | None = None) -> dict[str, list[dict]]:
    """``{card: rows}``, cards with the newest results first; each row ``{"metric", "ours", "peer",
    "unit", "source", "note"}``."""
    results = load_results() if results is None else results
    by_card: dict[str, list[dict]] = {}
    for op, rows_of in HEADLINE_OPS.items():
        for card, rel in _newest_default(results, op).items():
            by_card.setdefault(card, []).extend(rows_of(rel, results[rel]))
    for rel, data in results.items():  # any other default run that names its own headline rows
        if data["op"] not in HEADLINE_OPS and data["label"] == "default" and payload(data).get("headline"):
            by_card.setdefault(data["card"], []).extend(_given_rows(rel, data))
    newest = {card: max(results[r["source"]]["date"] for r in rows) for card, rows in by_card.items() if rows}
    return {card: by_card[card] for card in sorted(newest, key=newest.get, reverse=True)}


def _cell(value, unit) -> str:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return f"{num(value)} {unit}".strip() if number else num(value)


def headline_tables(results: dict[str, dict] | None = None, link: str | None = None, heading: str = "###",
                    cards: int | None = None) -> str:
    """One table per card (the first ``cards`` cards, newest results first), then its notes and,
    per source file, its versions and command. With ``link`` (a folder prefix, ``bench/results/``)
    the result column links the JSON; without, it links the op's Benchmarks page."""
    results = load_results() if results is None else results
    out = []
    for card, rows in list(headline_rows(results).items())[:cards]:
        out += [f"{heading} {card_title(card)}", "", "| | rlk_mm | peer | rlk_mm ÷ peer | result |", "|---|---|---|---|---|"]
        sources, notes = [], []
        for r in rows:
            target = f"{link}{r['source']}" if link else f"{results[r['source']]['op']}.md"
            out.append(f"| {num(r['metric'])} | {_cell(r['ours'], r['unit'])} | {_cell(r['peer'], r['unit'])} | "
                       f"{ratio_text(r['ours'], r['peer'], r['unit'])} | [{'json' if link else r['source'].split('/', 1)[0]}]({target}) |")
            if r["source"] not in sources:
                sources.append(r["source"])
            if r["note"] and r["note"] not in notes:
                notes.append(r["note"])
        out.append("")
        out += [f"Note: {n}." for n in notes] + ([""] if notes else [])
        for rel in sources:
            data = results[rel]
            shown = {k: v for k, v in data["versions"].items() if k in VERSION_KEYS}
            out.append(f"- {code(rel)}, {data['date'][:10]}: {versions_text(shown)}; {code(data['command'])}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def headline_block(results: dict[str, dict] | None = None) -> str:
    """The README's block, markers included: the headline table of the card with the newest
    results (the others are on the Benchmarks overview)."""
    results = load_results() if results is None else results
    others = [card_title(card) for card in list(headline_rows(results))[1:]]
    return "\n".join([
        HEADLINE_START,
        "<!-- generated by `python -m bench.report` from bench/results/: do not edit -->",
        headline_tables(results, link="bench/results/", heading="####", cards=1),
        ("Every result with its shapes, settings and pictures"
         + (f", and the headline on {', '.join(others)}" if others else "")
         + ": the [Benchmarks pages](docs/benchmarks/index.md); how results are written and filed: "
           "[bench/results/README.md](bench/results/README.md)."),
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


# --------------------------------------------------------------------------- pages


def _ops(results: dict[str, dict]) -> dict[str, list[str]]:
    """``{op: result paths}``, ops in the pages' order, each op's results by card then newest first."""
    from .report_pages import OPS

    ops: dict[str, list[str]] = {}
    for rel, data in results.items():
        ops.setdefault(data["op"], []).append(rel)
    order = [op for op in OPS if op in ops] + sorted(op for op in ops if op not in OPS)
    def key(rel):  # GPUs first, then the CPU, then unrecorded cards; newest first within a card
        card = results[rel]["card"]
        return card == "cpu", card == "unknown", card, _negated(results[rel]["date"]), rel

    return {op: sorted(ops[op], key=key) for op in order}


def _negated(date: str) -> tuple:
    return tuple(-ord(c) for c in date)


def pictures(results: dict[str, dict] | None = None) -> dict[str, str]:
    """``{"benchmarks/img/<name>.png": result path}``: the pictures the pages show."""
    results = load_results() if results is None else results
    return {f"{PAGES}/img/{name}": rel for rel, name in plot_names(results).items()}


def benchmark_pages(results: dict[str, dict] | None = None) -> dict[str, str]:
    """``{"benchmarks/<page>.md": Markdown}``, the overview first."""
    results = load_results() if results is None else results
    names = plot_names(results)
    ops = _ops(results)
    index = [
        "# Benchmarks", "",
        ("Generated by `python -m bench.report` from the result files under `bench/results/` "
         "(`<op>/<card>/<day>-<label>.json`, the schema of `bench/schema.py`): do not edit. Timings are medians "
         "of CUDA-event timings after warm-up (wall clock on CPU); memory is the peak above the inputs. A ratio is "
         "rlk_mm's figure over the peer's: under 1, rlk_mm is faster or holds less."), "",
        "## Headline", "",
        ("Per card, the newest `default` run of each headline benchmark; rows of different cards never share a "
         "table."), "",
        headline_tables(results), "",
        "## By benchmark", "", "| benchmark | what it measures | results |", "|---|---|---|",
    ]
    pages = {}
    for op, rels in ops.items():
        title, what = op_info(op)
        cards = sorted({card_title(results[r]["card"]) for r in rels})
        index.append(f"| [{title}]({op}.md) | {what} | {len(rels)} ({', '.join(cards)}) |")
        body = [f"# {title}", "", what, "",
                f"Generated by `python -m bench.report` from `bench/results/{op}/`: one section per card, newest first.",
                ""]
        card = None
        for rel in rels:
            if results[rel]["card"] != card:
                card = results[rel]["card"]
                body += [f"## {card_title(card)}", ""]
            plots = [f"img/{names[rel]}"] if rel in names else []
            body.append(render_result(rel, results[rel], plots))
        pages[f"{PAGES}/{op}.md"] = "\n".join(body).rstrip() + "\n"
    moved = sorted((d["migrated"]["from"], rel) for rel, d in results.items() if isinstance(d.get("migrated"), dict))
    if moved:
        index += ["", "## Files moved into the scheme", "",
                  "Where each result of the earlier hand-named files went (issue 49); each file's `migrated` says "
                  "where its schema fields came from.", "", "| earlier | now |", "|---|---|"]
        index += [f"| {code(old.removeprefix('bench/results/'))} | {code(new)} |" for old, new in moved]
    return {f"{PAGES}/index.md": "\n".join(index).rstrip() + "\n", **pages}


def stale(results: dict[str, dict] | None = None, docs: Path = DOCS, readme: Path = ROOT / "README.md") -> list[str]:
    """What differs from the generated output: pages, pictures present or missing (a picture's
    pixels are not compared), and the README's block. Empty when all is up to date."""
    results = load_results() if results is None else results
    problems = []
    wanted = benchmark_pages(results)
    for rel, text in wanted.items():
        path = docs / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            problems.append(f"docs/{rel} is stale")
    pics = pictures(results)
    for path in sorted((docs / PAGES).rglob("*")) if (docs / PAGES).is_dir() else []:
        rel = path.relative_to(docs).as_posix()
        if path.is_file() and rel not in wanted and rel not in pics:
            problems.append(f"docs/{rel} is generated by nothing")
    problems += [f"docs/{rel} is missing" for rel in pics if not (docs / rel).is_file()]
    if readme is not None:
        current = readme_block(readme.read_text(encoding="utf-8"))
        if current is not None and current != headline_block(results):
            problems.append(f"{readme.name}'s headline block is stale")
    return problems


def write(results: dict[str, dict] | None = None, docs: Path = DOCS, readme: Path | None = ROOT / "README.md",
          redraw: bool = False) -> list[str]:
    """Write the pages, draw the missing pictures (all with ``redraw``), delete what nothing
    generates any more, and rewrite the README's block. Returns what was written or removed."""
    results = load_results() if results is None else results
    done = []
    wanted = benchmark_pages(results)
    pics = pictures(results)
    folder = docs / PAGES
    for path in sorted(folder.rglob("*")) if folder.is_dir() else []:
        rel = path.relative_to(docs).as_posix()
        if path.is_file() and rel not in wanted and rel not in pics:
            path.unlink()
            done.append(f"removed docs/{rel}")
    for rel, text in wanted.items():
        path = docs / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            done.append(f"wrote docs/{rel}")
    for rel, source in pics.items():
        if redraw or not (docs / rel).is_file():
            draw(results[source], docs / rel)
            done.append(f"drew docs/{rel}")
    if readme is not None:
        text = readme.read_text(encoding="utf-8")
        current = readme_block(text)
        if current is not None and current != headline_block(results):
            readme.write_text(text.replace(current, headline_block(results)), encoding="utf-8")
            done.append(f"rewrote {readme.name}'s headline block")
    return done


# --------------------------------------------------------------------------- nav (bench/mkdocs_hook.py)


def _title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def nav_pages(results: dict[str, dict] | None = None, notes_dir: Path = NOTES) -> dict[str, list]:
    """The nav's expanded sections: ``{"Benchmarks": [...], "Notes": [...]}`` (notes newest first)."""
    results = load_results() if results is None else results
    bench = [{"Overview": f"{PAGES}/index.md"}] + [{op_info(op)[0]: f"{PAGES}/{op}.md"} for op in _ops(results)]
    notes = [{"About the notes": "notes/index.md"}]
    for path in sorted(Path(notes_dir).glob("*.md"), reverse=True):
        if path.name != "index.md":
            notes.append({_title(path): f"notes/{path.name}"})
    return {"Benchmarks": bench, "Notes": notes}


def unlisted_guides(listed: list, guides_dir: Path = DOCS / "guides") -> list[dict]:
    """``{title: "guides/<page>.md"}`` for each guide page that ``listed`` (the nav's Guides) lacks."""
    have = {v for entry in listed if isinstance(entry, dict) for v in entry.values()}
    return [{_title(p): f"guides/{p.name}"} for p in sorted(Path(guides_dir).glob("*.md"))
            if f"guides/{p.name}" not in have]


# --------------------------------------------------------------------------- command


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(RESULTS), help="results folder (default: bench/results)")
    parser.add_argument("--check", action="store_true", help="exit 1 where the pages or the README's block are stale")
    parser.add_argument("--print", action="store_true", help="print the headline tables; write nothing")
    parser.add_argument("--redraw", action="store_true", help="draw every picture again, not only the missing ones")
    args = parser.parse_args(argv)
    results = load_results(args.results)
    if args.print:
        print(headline_tables(results))
        return 0
    if args.check:
        problems = stale(results)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("run: python -m bench.report", file=sys.stderr)
            return 1
        print("docs/benchmarks and the README's headline block are up to date")
        return 0
    for line in write(results, redraw=args.redraw) or ["docs/benchmarks and the README's headline block are up to date"]:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
