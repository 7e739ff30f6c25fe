"""The documentation: its code runs as written, its API reference is complete, its numbers are generated.

- Every ```` ```python ```` block of ``docs/**/*.md`` runs as written, each in its own process
  (a fork of one process that imported torch, transformers and rlk_mm once, so that the
  blocks share the import time but nothing else: each starts from an empty namespace in an
  empty working directory). A block marked ``no-run`` (```` ```python {.no-run} ````, the form
  Markdown renders as a highlighted block; for framework code that needs a cluster) is skipped,
  and sits in a note titled "Fragment: not runnable as is" that says what it needs, so that the
  site does not show it as a block to paste and run; keep those rare.
  ``RLK_MM_DOCS_FRESH=1`` runs each block in a fresh interpreter instead (slower, the
  same verdicts).
- Every API reference page lists every public name of its package (its ``__all__``;
  ``rlk_mm.integrations`` exports nothing itself, so its page covers each adapter module's
  ``__all__``).
- The README stays under 12 KB and its links resolve (its headline block, and the Benchmarks
  pages, are checked against ``bench/report.py``'s output by ``tests/test_bench_results.py``).

The site itself is built by ``make docs`` (``mkdocs build --strict``), not here.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import itertools
import json
import os
import pkgutil
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# --------------------------------------------------------------------------- code blocks

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=indent)(?P=ticks)[ \t]*$",
                   re.MULTILINE | re.DOTALL)


def code_blocks(root: Path = DOCS) -> list[tuple[str, str]]:
    """``(id, code)`` of every runnable python block under ``root`` (a folder, or one file); id is ``path:line``."""
    blocks = []
    for path in sorted(root.rglob("*.md")) if root.is_dir() else [root]:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            words = m.group("info").replace("{", " ").replace("}", " ").replace(".", " ").split()
            if not words or words[0] != "python" or "no-run" in words[1:]:
                continue
            body = "\n".join(line[len(m.group("indent")):] for line in m.group("body").splitlines())
            line = text.count("\n", 0, m.start()) + 1
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            blocks.append((f"{where}:{line}", body))
    return blocks


#: the runner: imports the heavy modules once, then forks one child per block. Each child
#: runs its block in a fresh namespace, in a fresh temporary directory, its output to a file.
RUNNER = r'''
import json, os, shutil, signal, sys, tempfile, time, traceback
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
blocks = json.load(sys.stdin)
limit = float(sys.argv[1])
import torch, transformers, PIL.Image  # noqa: E401  the shared imports: nothing is computed before the forks
import rlk_mm, rlk_mm.ops, rlk_mm.schema, rlk_mm.parity, rlk_mm.models, rlk_mm.grounding, rlk_mm.fixtures  # noqa: E401
import rlk_mm.integrations.verl, rlk_mm.integrations.easyr1, rlk_mm.integrations.trl  # noqa: E401
rlk_mm.fixtures.qwen_vl_processor()  # imports transformers' lazy Qwen2.5-VL modules; no torch op runs
results = {}
for block_id, code in blocks:
    work = tempfile.mkdtemp(prefix="rlk_mm_doc_")
    out_path = os.path.join(work, ".output")
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1); os.dup2(fd, 2)
            sys.stdout = os.fdopen(1, "w", buffering=1); sys.stderr = os.fdopen(2, "w", buffering=1)
            os.chdir(work)
            exec(compile(code, block_id, "exec"), {"__name__": "__main__"})
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(status)
    deadline = start + limit
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code_ = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0); code_ = "timeout"
            break
        time.sleep(0.02)
    with open(out_path, errors="replace") as f:
        output = f.read()
    shutil.rmtree(work, ignore_errors=True)
    results[block_id] = {"exit": code_, "seconds": round(time.monotonic() - start, 2), "output": output[-4000:]}
json.dump(results, sys.stdout)
'''

#: seconds one block may take before it is killed
BLOCK_LIMIT = 120.0


def _env() -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore::DeprecationWarning")
    env.pop("RLK_MM_BACKEND", None)
    return env


def run_blocks(blocks: list[tuple[str, str]]) -> dict:
    """Each block's exit status, seconds and output, by id."""
    if os.environ.get("RLK_MM_DOCS_FRESH") == "1":
        import tempfile
        import time

        results = {}
        for block_id, code in blocks:
            with tempfile.TemporaryDirectory(prefix="rlk_mm_doc_") as work:
                start = time.monotonic()
                try:
                    p = subprocess.run([sys.executable, "-c", code], cwd=work, env=_env(), capture_output=True,
                                       text=True, timeout=BLOCK_LIMIT, check=False)
                    status, output = p.returncode, p.stdout + p.stderr
                except subprocess.TimeoutExpired as e:
                    status, output = "timeout", str(e)
                seconds = round(time.monotonic() - start, 2)
                results[block_id] = {"exit": status, "seconds": seconds, "output": output[-4000:]}
        return results
    p = subprocess.run([sys.executable, "-c", RUNNER, str(BLOCK_LIMIT)], input=json.dumps(blocks), cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=BLOCK_LIMIT * max(len(blocks), 1) + 120, check=False)
    assert p.returncode == 0, f"the block runner failed:\n{p.stderr[-4000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


BLOCKS = code_blocks() + code_blocks(ROOT / "README.md")


@pytest.fixture(scope="module")
def block_results():
    return run_blocks(BLOCKS)


def test_the_docs_have_runnable_blocks():
    assert len(BLOCKS) >= 10, [b for b, _ in BLOCKS]


@pytest.mark.parametrize("block_id, code", BLOCKS, ids=[b for b, _ in BLOCKS])
def test_doc_block_runs_as_written(block_id, code, block_results):
    result = block_results[block_id]
    assert result["exit"] == 0, f"{block_id} failed (exit {result['exit']}, {result['seconds']} s):\n{result['output']}"


def test_the_readme_has_its_tour_and_stays_short():
    readme = ROOT / "README.md"
    assert readme.stat().st_size <= 12 * 1024, "README.md is over 12 KB: move the detail into a docs page"
    assert any("linear_policy_loss" in code for _, code in code_blocks(readme))


def test_the_readme_links_resolve():
    """Every relative link of the README names a file of the repository."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_python_blocks_are_plain_or_no_run():
    """Any other info string (``python no-run`` without braces, say) is not a code block to Markdown:
    it renders as a paragraph."""
    for path in [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            info = m.group("info").strip()
            if info.startswith("python"):
                assert info in ("python", "python {.no-run}"), f"{path.relative_to(ROOT)}: ```{info}"


#: the title of the admonition that holds a no-run block, so that the site shows it is a fragment
NO_RUN_TITLE = "Fragment: not runnable as is"
ADMONITION = re.compile(r'^(?P<indent>[ \t]*)(?:!!!|\?\?\?\+?) \w+ "(?P<title>[^"]*)"')


def no_run_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line, the title of the admonition holding it or "")`` of every no-run python block of ``path``."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    found = []
    for m in FENCE.finditer(text):
        if not m.group("info").strip().startswith("python") or "no-run" not in m.group("info"):
            continue
        line = text.count("\n", 0, m.start())  # 0-based: the fence's own line
        indent, title = len(m.group("indent").expandtabs()), ""
        for above in reversed(lines[:line]):  # the nearest line less indented than the fence
            if above.strip() and len(above) - len(above.lstrip()) < indent:
                head = ADMONITION.match(above)
                title = head.group("title") if head else ""
                break
        found.append((line + 1, title))
    return found


def test_every_no_run_block_is_marked_as_a_fragment():
    """A no-run block sits in a note titled "Fragment: not runnable as is", which says what it
    needs: on the site it must not read as a block one can paste and run."""
    found = {f"{path.relative_to(ROOT)}:{line}": title for path in [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
             for line, title in no_run_blocks(path)}
    assert found, "no no-run block found: the check reads nothing"
    unmarked = [where for where, title in found.items() if not title.startswith(NO_RUN_TITLE)]
    assert not unmarked, f"no-run blocks outside a '!!! note \"{NO_RUN_TITLE}\"' admonition: {unmarked}"


def test_no_run_blocks_reader(tmp_path):
    page = tmp_path / "a.md"
    page.write_text('```python {.no-run}\nx\n```\n\n!!! note "Fragment: not runnable as is"\n    Needs a cluster.\n\n'
                    '    ```python {.no-run}\n    y\n    ```\n\n```python\nz\n```\n', encoding="utf-8")
    assert no_run_blocks(page) == [(1, ""), (8, NO_RUN_TITLE)]


def test_code_blocks_finds_blocks_and_skips_no_run(tmp_path):
    (tmp_path / "a.md").write_text(
        "# t\n\n```python\nprint(1)\n```\n\n```python {.no-run}\nraise SystemExit(1)\n```\n\n"
        "```bash\nfalse\n```\n\n- item\n\n    ```python\n    x = 2\n    ```\n", encoding="utf-8")
    found = code_blocks(tmp_path)
    assert [code for _, code in found] == ["print(1)", "x = 2"]


def test_a_failing_block_is_reported():
    results = run_blocks([("ok", "print('hi')"), ("bad", "import torch\nraise ValueError('boom')")])
    assert results["ok"]["exit"] == 0 and "hi" in results["ok"]["output"]
    assert results["bad"]["exit"] != 0 and "ValueError: boom" in results["bad"]["output"]


# --------------------------------------------------------------------------- verl's switch

#: a verl command and the lines its trailing backslashes continue it over
VERL_COMMAND = re.compile(r"python -m verl\.trainer\.main_ppo((?:[^\n]*\\\n)*[^\n]*)")
VERL_GUIDE, VERL_EXAMPLE = "docs/guides/verl.md", "examples/verl_fused_kernels.py"


def verl_switches() -> dict[str, list[str]]:
    """Every verl command of the docs, the README and the examples' docstrings that sets
    ``RLK_MM_VERL_FUSED``: its overrides as the shell passes them to Hydra, by file."""
    texts = {path: path.read_text(encoding="utf-8") for path in [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]}
    texts.update({path: ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
                  for path in sorted((ROOT / "examples").glob("*.py"))})
    found = {}
    for path, text in texts.items():
        for m in VERL_COMMAND.finditer(text):
            words = shlex.split(m.group(1).replace("\\\n", " "), comments=True)
            if any("RLK_MM_VERL_FUSED" in w for w in words):
                assert str(path.relative_to(ROOT)) not in found, f"{path}: two verl commands that set RLK_MM_VERL_FUSED"
                found[str(path.relative_to(ROOT))] = [w for w in words if "=" in w]
    return found


def hydra_value(text: str):
    """An override's value as Hydra's grammar reads it (the primitives the switch uses)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def test_the_verl_switch_is_one_set_everywhere():
    """The verl guide, the fused-kernels example and any other page list the same overrides; Hydra
    reads each as verl and Ray need it (the environment variable a string); the example's YAML
    form says the same; and only the override that adds a key to verl's config has a ``+``."""
    switches = verl_switches()
    assert {VERL_GUIDE, VERL_EXAMPLE} <= set(switches), f"the verl switch was not found in {set(switches)}"
    overrides = switches[VERL_GUIDE]
    assert all(found == overrides for found in switches.values()), switches
    values = {key: hydra_value(value) for key, value in (o.split("=", 1) for o in overrides)}
    assert values == {
        "actor_rollout_ref.actor.policy_loss.loss_mode": "rlk_mm",
        "actor_rollout_ref.model.use_fused_kernels": True,
        "actor_rollout_ref.model.fused_kernel_options.impl_backend": "torch",
        "+ray_kwargs.ray_init.runtime_env.env_vars.RLK_MM_VERL_FUSED": "1",
    }

    from omegaconf import OmegaConf

    docstring = ast.get_docstring(ast.parse((ROOT / VERL_EXAMPLE).read_text(encoding="utf-8")))
    after = docstring.split("in a YAML config::\n", 1)[1].splitlines()
    yaml = textwrap.dedent("\n".join(itertools.takewhile(lambda line: not line or line[0] == " ", after)))
    flat = {}

    def walk(node, prefix):
        for key, value in node.items():
            walk(value, f"{prefix}{key}.") if isinstance(value, dict) else flat.setdefault(f"{prefix}{key}", value)

    walk(OmegaConf.to_container(OmegaConf.create(yaml)), "")
    assert flat == {key.lstrip("+"): value for key, value in values.items()}

    spec = importlib.util.find_spec("verl")
    if spec is not None:  # verl's own defaults: the keys set exist, the one added does not
        config = OmegaConf.load(Path(spec.origin).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
        for key in values:
            assert (OmegaConf.select(config, key.lstrip("+"), default=None) is None) == key.startswith("+"), key


# --------------------------------------------------------------------------- API reference

#: package -> its API reference page
API_PAGES = {
    "rlk_mm": "api/rlk_mm.md",
    "rlk_mm.ops": "api/ops.md",
    "rlk_mm.schema": "api/schema.md",
    "rlk_mm.parity": "api/parity.md",
    "rlk_mm.models": "api/models.md",
    "rlk_mm.integrations": "api/integrations.md",
    "rlk_mm.grounding": "api/grounding.md",
}


def integration_modules() -> list[str]:
    """rlk_mm.integrations exports nothing itself: its page covers each public module below it
    (one package per framework, and their modules)."""
    package = importlib.import_module("rlk_mm.integrations")
    names = [m.name for m in pkgutil.walk_packages(package.__path__, "rlk_mm.integrations.")]
    return [n for n in names if not any(part.startswith("_") for part in n.split("."))]


DIRECTIVE = re.compile(r"^:::[ \t]+([\w.]+)", re.MULTILINE)
#: a directive with its indented options: without ``members: false`` it renders the whole object
DIRECTIVE_BLOCK = re.compile(r"^:::[ \t]+([\w.]+)[ \t]*\n((?:[ \t]+\S.*\n)*)", re.MULTILINE)
ANCHOR = re.compile(r"^#+ .*\{#([\w.]+)\}[ \t]*$", re.MULTILINE)  # a hand-written entry: a heading with an explicit id


def public_names(package: str) -> dict[str, str]:
    """``{qualified name: package it must be documented under}`` for every public name."""
    module = importlib.import_module(package)
    if package == "rlk_mm.integrations":
        assert list(module.__all__) == [], "rlk_mm.integrations now exports names: document them on its page"
        names = {}
        for sub in integration_modules():
            names.update({f"{sub}.{n}": package for n in importlib.import_module(sub).__all__})
        return names
    return {f"{package}.{n}": package for n in module.__all__}


def documented(page: str) -> set[str]:
    text = (DOCS / page).read_text(encoding="utf-8")
    return set(DIRECTIVE.findall(text)) | set(ANCHOR.findall(text))


def whole_modules(page: str) -> set[str]:
    """The modules ``page`` renders whole (a ``:::`` entry of a module without ``members: false``):
    every name of their ``__all__`` is on the page, so a name added there is listed automatically."""
    text = (DOCS / page).read_text(encoding="utf-8")
    found = set()
    for path, options in DIRECTIVE_BLOCK.findall(text + "\n"):
        if "members: false" not in options and _is_module(path):
            found.add(path)
    return found


def _is_module(path: str) -> bool:
    try:
        importlib.import_module(path)
    except ImportError:  # a class or function of a module, not a module
        return False
    return True


def home_module(qualified: str) -> str | None:
    """The module that defines the object a public name serves (None for a module or a constant)."""
    package, name = qualified.rsplit(".", 1)
    obj = getattr(importlib.import_module(package), name)
    return getattr(obj, "__module__", None) if callable(obj) else None


def covers(identifier: str, qualified: str, package: str) -> bool:
    """An entry documents a name when it is the name's path, or (below the top-level
    package) a path under the package that ends with the name: its home module's path, as
    for a name served lazily (``rlk_mm.parity.invariance.invariance_sweep``)."""
    if identifier == qualified:
        return True
    return package != "rlk_mm" and identifier.startswith(package + ".") and (
        identifier.rsplit(".", 1)[1] == qualified.rsplit(".", 1)[1])


@pytest.mark.parametrize("package, page", API_PAGES.items(), ids=list(API_PAGES))
def test_api_page_lists_every_public_name(package, page):
    entries, whole = documented(page), whole_modules(page)
    missing = [q for q, pkg in public_names(package).items()
               if not any(covers(e, q, pkg) for e in entries) and home_module(q) not in whole]
    assert not missing, (f"docs/{page} does not document {missing}: add a '::: <path>' line for each "
                         f"(mkdocstrings renders it from the docstring)")


@pytest.mark.parametrize("package, page", API_PAGES.items(), ids=list(API_PAGES))
def test_api_page_documents_only_names_under_its_package(package, page):
    stray = [e for e in documented(page) if e != package and not e.startswith(package + ".")]
    assert not stray, f"docs/{page} documents {stray}, which are not under {package}"


def test_every_api_page_is_in_the_nav():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "docstring_style: numpy" in config
    for page in API_PAGES.values():
        assert f": {page}" in config, f"mkdocs.yml's nav does not list {page}"


def test_covers():
    assert covers("rlk_mm.ops.selected_logprob", "rlk_mm.ops.selected_logprob", "rlk_mm.ops")
    assert covers("rlk_mm.parity.invariance.invariance_sweep", "rlk_mm.parity.invariance_sweep", "rlk_mm.parity")
    assert not covers("rlk_mm.ops.selected_logprob", "rlk_mm.ops.sample", "rlk_mm.ops")
    assert not covers("rlk_mm.schema.RLBatch", "rlk_mm.RLBatch", "rlk_mm")
    assert covers("rlk_mm.integrations.verl.fused.enable", "rlk_mm.integrations.verl.enable", "rlk_mm.integrations")


# --------------------------------------------------------------------------- the nav (bench/report.py)


def _report():
    from bench import report

    return report


# --------------------------------------------------------------------------- packaging


def test_py_typed_and_the_package_data_are_shipped():
    """``py.typed`` (PEP 561) and the Geo3K sample are declared as package data, so wheels carry them."""
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["rlk_mm"] and (ROOT / "rlk_mm" / "py.typed").is_file()
    assert "geo3k_sample/*" in data["rlk_mm.fixtures"]
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").lstrip().startswith("Apache License")


def test_a_guide_missing_from_the_nav_is_appended(tmp_path):
    report = _report()
    for name in ("a.md", "b.md"):
        (tmp_path / name).write_text(f"# Guide {name}\n", encoding="utf-8")
    assert report.unlisted_guides([{"A": "guides/a.md"}], tmp_path) == [{"Guide b.md": "guides/b.md"}]


def test_no_page_renders_a_whole_module():
    """A whole module on a page would list whatever its ``__all__`` holds: each name is its own
    entry, so that the page, not ``__all__``, says what the API is (tests/test_api_surface.py)."""
    assert {page: whole_modules(page) for page in API_PAGES.values() if whole_modules(page)} == {}
    assert home_module("rlk_mm.models.generate_on_policy") == "rlk_mm.models.rollout"
