"""The one schema and path scheme of every benchmark result (standard library only).

A result is one JSON object. Its schema keys say what ran, where, when and how; every other
top-level key is the script's payload (timings, checks, per-step series)::

    {
      "schema": 1,
      "op": "linear_loss",                  # the benchmark: a lower-case slug, the folder
      "label": "default",                   # which run of it: "default" for the script's defaults
      "card": "NVIDIA H200",                # torch's device name, or "cpu"
      "date": "2026-12-06T04:21:18Z",       # UTC; a day ("2026-12-06") where only that is known
      "command": "python -m bench.bench_linear_loss --out $OUT",
      "versions": {"torch": ..., "transformers": ..., "triton": ..., "rlk_mm": "<commit>", ...},
      "shapes": {...},                      # the shapes or config measured
      ...payload...
    }

Optional schema keys: ``host`` (CPU, threads, CUDA, topology), ``note`` (what the run was for,
in a sentence or two) and ``migrated`` (for files written before this schema: the old name and
where each schema field came from). A value nobody recorded is ``"unknown"``, never a guess.

The path of a result under ``bench/results/`` is ``<op>/<card slug>/<day>-<label>.json``
(``result_path``): ``linear_loss/h200/2026-11-29-default.json``. A file the script drew
beside its JSON (a picture) takes the JSON's name with its own extension.
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath

__all__ = [
    "COMPANION_SUFFIXES", "OPTIONAL", "REQUIRED", "RESULTS", "SCHEMA_VERSION", "UNKNOWN", "VERSION_KEYS", "card_slug",
    "check_result", "check_tree", "dumps", "load_results", "payload", "result_path",
]

ROOT = Path(__file__).resolve().parents[1]
#: where results are filed
RESULTS = ROOT / "bench" / "results"
SCHEMA_VERSION = 1
#: a field nobody recorded
UNKNOWN = "unknown"
#: the schema keys every result carries
REQUIRED = ("schema", "op", "label", "card", "date", "command", "versions", "shapes")
#: the schema keys a result may carry
OPTIONAL = ("host", "note", "migrated")
#: the versions every result names (others, such as verl or liger-kernel, where they took part)
VERSION_KEYS = ("torch", "transformers", "triton", "rlk_mm")
#: files a script may write beside its JSON, under the JSON's name
COMPANION_SUFFIXES = (".png",)

_SLUG = re.compile(r"^[a-z0-9][a-z0-9_]*$")
_LABEL = re.compile(r"^[a-z0-9][a-z0-9.-]*$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}:\d{2}Z)?$")


def card_slug(card: str) -> str:
    """The folder of a card: ``"NVIDIA H200"`` -> ``"h200"``, ``"NVIDIA H100 80GB HBM3"`` ->
    ``"h100-80gb-hbm3"``, ``"cpu"`` -> ``"cpu"``."""
    text = str(card).strip().lower()
    text = text.removeprefix("nvidia ")
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-") or UNKNOWN


def result_path(op: str, card: str, date: str, label: str) -> PurePosixPath:
    """``<op>/<card slug>/<day>-<label>.json``, relative to the results folder."""
    return PurePosixPath(op, card_slug(card), f"{str(date)[:10]}-{label}.json")


def dumps(data) -> str:
    """A result as its file holds it: objects one key a line (indent 1), lists of numbers or
    strings on one line (a per-step series stays a line, not a screenful)."""
    def scalar(value) -> bool:
        return value is None or isinstance(value, (bool, int, float, str))

    def write(value, depth: int) -> str:
        pad = " " * depth
        if isinstance(value, dict) and value:
            items = [f'{pad} {json.dumps(str(k), ensure_ascii=False)}: {write(v, depth + 1)}' for k, v in value.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        if isinstance(value, list) and value and not all(scalar(v) for v in value):
            items = [f"{pad} {write(v, depth + 1)}" for v in value]
            return "[\n" + ",\n".join(items) + f"\n{pad}]"
        return json.dumps(value, ensure_ascii=False)

    return write(data, 0) + "\n"


def payload(data: dict) -> dict:
    """A result's payload: every key but the schema's."""
    return {k: v for k, v in data.items() if k not in REQUIRED and k not in OPTIONAL}


def check_result(data, rel: str | PurePosixPath | None = None) -> list[str]:
    """What is wrong with one result (an empty list where nothing is); with ``rel`` (its path
    relative to the results folder) the path is checked against the scheme too."""
    if not isinstance(data, dict):
        return [f"a JSON {type(data).__name__}, not an object"]
    problems = [f"no {key!r}" for key in REQUIRED if key not in data]
    if problems:
        return problems
    if data["schema"] != SCHEMA_VERSION:
        problems.append(f"schema {data['schema']!r}, not {SCHEMA_VERSION}")
    if not (isinstance(data["op"], str) and _SLUG.match(data["op"])):
        problems.append(f"op {data['op']!r} is not a lower-case slug")
    if not (isinstance(data["label"], str) and _LABEL.match(data["label"])):
        problems.append(f"label {data['label']!r} is not a lower-case slug")
    if not (isinstance(data["card"], str) and data["card"].strip()):
        problems.append("card is empty")
    if not (isinstance(data["date"], str) and _DATE.match(data["date"])):
        problems.append(f"date {data['date']!r} is not YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ")
    if not (isinstance(data["command"], str) and data["command"].strip()):
        problems.append("command is empty (write 'unknown')")
    versions = data["versions"]
    if not isinstance(versions, dict):
        problems.append("versions is not an object")
    else:
        problems += [f"versions has no {key!r}" for key in VERSION_KEYS if key not in versions]
        problems += [f"versions[{k!r}] is not a string" for k, v in versions.items() if not isinstance(v, str)]
    if data["shapes"] in (None, "", {}, []):
        problems.append("shapes is empty (write 'unknown')")
    if "migrated" in data and not (isinstance(data["migrated"], dict) and data["migrated"].get("from")):
        problems.append("migrated names no old file ('from')")
    if rel is not None and not problems:
        wanted = result_path(data["op"], data["card"], data["date"], data["label"])
        if PurePosixPath(rel) != wanted:
            problems.append(f"filed as {rel}, the scheme says {wanted}")
    return problems


def load_results(results_dir: Path | str = RESULTS) -> dict[str, dict]:
    """Every result JSON under ``results_dir``, by its path relative to it (``op/card/day-label.json``),
    in path order."""
    root = Path(results_dir)
    out = {}
    for path in sorted(root.rglob("*.json")):
        with open(path, encoding="utf-8") as f:
            out[path.relative_to(root).as_posix()] = json.load(f)
    return out


def check_tree(results_dir: Path | str = RESULTS) -> dict[str, list[str]]:
    """``{relative path: problems}`` for every file under ``results_dir`` that breaks the scheme:
    a JSON off the schema or its path, or another file that is not a companion of a JSON."""
    root = Path(results_dir)
    problems: dict[str, list[str]] = {}
    for rel, data in load_results(root).items():
        found = check_result(data, rel)
        if found:
            problems[rel] = found
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix != ".json"):
        rel = path.relative_to(root).as_posix()
        if rel == "README.md":
            continue
        if path.suffix not in COMPANION_SUFFIXES or not path.with_suffix(".json").is_file():
            problems[rel] = [f"not a result: only JSON results, README.md and a result's own "
                             f"{'/'.join(COMPANION_SUFFIXES)} beside it belong here"]
    return problems
