"""Benchmark results: one schema, one path scheme, and pages generated from them.

- Every file under ``bench/results/`` is a result in ``bench.schema``'s schema, filed at the
  path the scheme gives it (``<op>/<card>/<day>-<label>.json``), or a picture beside one.
- ``docs/benchmarks/`` (pages and pictures) and the README's headline block are exactly what
  ``python -m bench.report`` generates from them.
- The headline never mixes cards in one table, and its ratios say which side is faster.
- ``bench.common.write_result`` writes the schema at the scheme's path.
- Every ``bench/results/...`` path cited in the code and the docs names a file that exists, and
  no code cites the results README for a figure.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from bench import report
from bench.schema import RESULTS, UNKNOWN, card_slug, check_result, check_tree, load_results, result_path

ROOT = Path(__file__).resolve().parents[1]


def _result(op="linear_loss", card="NVIDIA H200", date="2026-12-01T10:00:00Z", label="default", **payload) -> dict:
    return {"schema": 1, "op": op, "label": label, "card": card, "date": date, "command": f"python -m bench.bench_{op}",
            "versions": {"torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0", "rlk_mm": "abc123"},
            "shapes": {"N": 16384}, **payload}


def _filed(*results) -> dict[str, dict]:
    return {str(result_path(r["op"], r["card"], r["date"], r["label"])): r for r in results}


# --------------------------------------------------------------------------- the files


def test_every_result_follows_the_schema_and_the_path_scheme():
    results = load_results()
    assert len(results) >= 50
    assert check_tree() == {}, "run bench.schema.check_tree() for each file's problems"
    assert not list(RESULTS.glob("*.json")), "a result at the top of bench/results/: file it under <op>/<card>/"


def test_moved_files_are_gone_and_named():
    for rel, data in load_results().items():
        moved = data.get("migrated")
        if moved:
            assert not (ROOT / moved["from"]).is_file() or moved["from"].endswith("README.md"), rel
            assert moved["from"].startswith("bench/results/"), rel


def test_the_scheme():
    assert card_slug("NVIDIA H200") == "h200" and card_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert card_slug("cpu") == "cpu" and card_slug(" ") == UNKNOWN
    assert str(result_path("tp", "NVIDIA H200", "2026-11-28T04:12:20Z", "default")) == "tp/h200/2026-11-28-default.json"
    good = _result()
    assert check_result(good, "linear_loss/h200/2026-12-01-default.json") == []
    assert check_result(good, "linear_loss/h100/2026-12-01-default.json") == [
        "filed as linear_loss/h100/2026-12-01-default.json, the scheme says linear_loss/h200/2026-12-01-default.json"]
    assert "no 'versions'" in check_result({k: v for k, v in good.items() if k != "versions"})
    assert check_result({**good, "versions": {"torch": "2.11"}}) == [
        "versions has no 'transformers'", "versions has no 'triton'", "versions has no 'rlk_mm'"]
    assert check_result({**good, "date": "Nov 28"}) == ["date 'Nov 28' is not YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ"]
    assert check_result({**good, "shapes": {}}) == ["shapes is empty (write 'unknown')"]
    assert check_result({**good, "label": "Before_X"}) == ["label 'Before_X' is not a lower-case slug"]


def test_a_stray_file_breaks_the_tree(tmp_path):
    data = _result()
    path = tmp_path / result_path(data["op"], data["card"], data["date"], data["label"])
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    path.with_suffix(".png").write_bytes(b"")
    assert check_tree(tmp_path) == {}
    (tmp_path / "linear_loss_h200.json").write_text(json.dumps(data))
    (tmp_path / "notes.txt").write_text("x")
    problems = check_tree(tmp_path)
    assert set(problems) == {"linear_loss_h200.json", "notes.txt"}
    assert "filed as" in problems["linear_loss_h200.json"][0]


# --------------------------------------------------------------------------- the writer


def test_write_result_files_the_schema_at_the_scheme_path(tmp_path):
    from bench.common import write_result

    path = write_result(tmp_path, "parity", {"median_s": 0.5}, shapes={"samples": 4}, label="check", card="cpu")
    data = json.loads(path.read_text())
    assert path.relative_to(tmp_path) == Path(result_path("parity", "cpu", data["date"], "check"))
    assert check_result(data, path.relative_to(tmp_path).as_posix()) == []
    assert data["card"] == "cpu" and data["median_s"] == 0.5 and data["command"].startswith("python")
    assert data["versions"]["torch"] and data["versions"]["rlk_mm"]
    dry = write_result(tmp_path, "parity", {"median_s": 0.1}, shapes=None, dry_run=True)
    assert dry == tmp_path / "parity.json" and json.loads(dry.read_text())["label"] == "dry-run"
    assert json.loads(dry.read_text())["shapes"] == UNKNOWN
    with pytest.raises(ValueError, match="schema's keys"):
        write_result(tmp_path, "parity", {"command": "x"}, shapes={"samples": 4})


def test_every_bench_script_writes_through_write_result():
    """Each script in bench/ that writes a result does so with ``write_result`` (the scheme), not
    by hand."""
    scripts = [p for p in sorted((ROOT / "bench").glob("*.py"))
               if p.stem.startswith(("bench_", "gpu_check_", "smoke_sweep", "supervised_probe", "point_diagnosis"))]
    assert len(scripts) >= 17
    missing = [p.name for p in scripts if "write_result(" not in p.read_text()]
    assert not missing, f"these bench scripts do not write their result with bench.common.write_result: {missing}"


# --------------------------------------------------------------------------- the pages


def test_the_pages_and_the_readme_table_are_generated():
    """docs/benchmarks/ and the README's block are what ``python -m bench.report`` writes."""
    assert report.stale() == [], "run: python -m bench.report"


def test_every_result_is_on_its_page():
    results = load_results()
    pages = report.benchmark_pages(results)
    for rel, data in results.items():
        page = pages[f"benchmarks/{data['op']}.md"]
        assert f"`bench/results/{rel}`" in page, rel
    for name, body in pages.items():
        if name != "benchmarks/index.md":
            assert "| Card |" in body and "| Versions |" in body and "| Command |" in body, name


def test_tables_come_from_the_json():
    """A number in a result file shows up on its page and in the headline; change it, and both change."""
    results = load_results()
    shown = report.headline_block(results)  # the README shows the newest card's table
    rel = max((r for r, d in results.items() if d["op"] == "linear_loss" and d["label"] == "default"
               and f"#### {d['card']}" in shown), key=lambda r: results[r]["date"])
    changed = copy.deepcopy(results)
    changed[rel]["7b"]["timings"]["ours_linear"]["ms"] = 12.3456
    changed[rel]["command"] = "python -m bench.bench_linear_loss --probe"
    page = report.benchmark_pages(changed)["benchmarks/linear_loss.md"]
    assert "12.3 ms" in page and "python -m bench.bench_linear_loss --probe" in page
    assert "| 12.3 ms |" in report.headline_tables(changed)
    assert report.headline_block(changed) != report.headline_block(results)


def test_each_card_has_its_own_table_and_the_newest_default_run():
    flce = {"ms": 100.0}
    older = _result(date="2026-11-01T00:00:00Z", **{"7b": {"shape": {"N": 1, "H": 2, "V": 3},
                                                           "timings": {"ours_linear": {"ms": 99.0}, "liger_flce": flce}}})
    newer = _result(**{"7b": {"shape": {"N": 1, "H": 2, "V": 3},
                              "timings": {"ours_linear": {"ms": 80.0}, "liger_flce": flce}}})
    probe = _result(label="probe", date="2026-12-05T00:00:00Z",
                    **{"7b": {"shape": {"N": 1, "H": 2, "V": 3},
                              "timings": {"ours_linear": {"ms": 1.0}, "liger_flce": flce}}})
    h100 = _result(card="NVIDIA H100 80GB HBM3", **{"7b": {"shape": {"N": 1, "H": 2, "V": 3},
                                                           "timings": {"ours_linear": {"ms": 90.0}, "liger_flce": flce}}})
    results = _filed(older, newer, probe, h100)
    rows = report.headline_rows(results)
    assert list(rows) == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    assert [r["ours"] for r in rows["NVIDIA H200"]] == [80.0] and [r["ours"] for r in rows["NVIDIA H100 80GB HBM3"]] == [90.0]
    tables = report.headline_tables(results)
    h200, h100_table = tables.split("### NVIDIA H100 80GB HBM3")
    assert "80.0 ms" in h200 and "90.0 ms" not in h200 and "90.0 ms" in h100_table and "80.0 ms" not in h100_table
    block = report.headline_block(results)  # the README: the newest card's table only
    assert "80.0 ms" in block and "90.0 ms" not in block and "NVIDIA H100 80GB HBM3" in block


def test_a_ratio_says_which_side_is_faster():
    assert report.ratio_text(1745.0, 1991.0, "ms") == "0.88× (12.4 % faster)"
    assert report.ratio_text(1619.0, 1420.0, "ms") == "1.14× (14.0 % slower)"
    assert report.ratio_text(0.92, 108.1, "GiB") == "0.01× (99.1 % less memory)"
    assert report.ratio_text(2.0, 2.0, "ms") == "1.00× (the same)"
    assert report.ratio_text("vLLM 22-31%", 2.0, "ms") == "—"
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert not re.search(r"\| -\d", report.readme_block(text)), "a signed change in the README's table"


def test_headline_rows_a_result_file_gives():
    """A default run's own ``headline`` rows land in its card's table, numbers with their unit,
    a ratio that reads as faster or slower, and the row's note once."""
    data = _result(op="on_policy", headline=[
        {"metric": "RL step, invariant vs default kernels", "ours": 1745.0, "peer": 1991.0, "unit": "ms",
         "note": "published peers"},
        {"metric": "decode step", "ours": 8.4, "peer": 7.3, "unit": "ms", "note": "published peers"},
        {"metric": "exact match", "ours": "200 / 200 steps", "peer": None, "unit": ""}])
    table = report.headline_tables(_filed(data))
    assert "| RL step, invariant vs default kernels | 1,745 ms | 1,991 ms | 0.88× (12.4 % faster) |" in table
    assert "| decode step | 8.40 ms | 7.30 ms | 1.15× (15.1 % slower) |" in table
    assert "| exact match | 200 / 200 steps | — | — |" in table
    assert table.count("Note: published peers.") == 1 and "`python -m bench.bench_on_policy`" in table


def test_readme_block_markers():
    assert report.readme_block("no markers") is None
    block = report.headline_block({})
    assert block.startswith(report.HEADLINE_START) and block.endswith(report.HEADLINE_END)
    assert report.readme_block(f"intro\n{block}\nrest") == block
    with pytest.raises(ValueError):
        report.readme_block(f"intro {report.HEADLINE_START} but no end")


def test_pictures_come_where_the_json_has_the_data(tmp_path):
    pictures = report.pictures()
    kinds = {rel.split("/")[-1].split("-")[0] for rel in pictures}
    assert {"group_memory", "tp", "smoke"} <= kinds
    assert all((ROOT / "docs" / rel).is_file() for rel in pictures)
    results = load_results()
    rel = next(r for r, d in results.items() if d["op"] == "tp" and d["label"] == "default" and d["card"] != "cpu")
    from bench.plots import draw

    path = draw(results[rel], tmp_path / "tp.png")
    assert path.read_bytes().startswith(b"\x89PNG")


# --------------------------------------------------------------------------- citations

#: modules being restructured in another change: their citations move with it (issue 49 lists them)
PENDING = ("rlk_mm/ops/_triton/", "rlk_mm/ops/vocab_parallel.py", "rlk_mm/ops/_vocab_parallel/")
CITED = re.compile(r"bench/results/[\w./{},*-]*[\w/}]")


def _sources():
    for folder, pattern in (("rlk_mm", "*.py"), ("bench", "*.py"), ("tests", "*.py"), ("docs", "*.md")):
        yield from (p for p in sorted((ROOT / folder).rglob(pattern)) if "__pycache__" not in p.parts)
    yield ROOT / "README.md"


def test_cited_result_paths_exist():
    missing = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(PENDING) or rel == "tests/test_bench_results.py":
            continue
        for cited in CITED.findall(path.read_text(encoding="utf-8")):
            if "{" in cited or "*" in cited or "<" in cited:
                continue
            if not (ROOT / cited).exists():
                missing.append(f"{rel}: {cited}")
    assert not missing, missing


def test_no_code_cites_the_results_readme_for_a_figure():
    """The results README says how results are filed; figures live in the result files, and code
    names the file (or the script) that measured what it cites. (bench/report.py links the README
    from the headline block, for how results are written.)"""
    citing = [rel for p in _sources() if p.suffix == ".py" and "results/README" in p.read_text(encoding="utf-8")
              and not (rel := p.relative_to(ROOT).as_posix()).startswith(PENDING)]
    assert set(citing) <= {"tests/test_bench_results.py", "bench/report.py"}, citing
