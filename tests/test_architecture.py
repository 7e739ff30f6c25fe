"""The package's architecture, read from the source with ``ast`` (nothing of rlk_mm is
imported): the layering (schema imports nothing else of rlk_mm; ops import only schema and
ops; models, parity and integrations never reach smoke or the CLI), no import cycles, no
private name (``_x``) imported across modules, small modules, and an ``__all__`` in every
public module of the packages that have them.

Every import statement of every module under rlk_mm/ counts: those inside functions and
``if TYPE_CHECKING:`` blocks too. Relative imports are resolved to absolute module names.
An edge goes from the importing module to the module the statement names: ``from .x import
y`` in package ``p`` is an edge to ``p.x`` (and to ``p.x.y`` when ``y`` is a submodule); an
import of a package is an edge to its ``__init__``. Importing a module runs its parent
packages' ``__init__`` as well; those are not edges here (every module would reach the root
package). ``importlib.import_module("...")`` strings are not import statements and do not
count (``rlk_mm.ops`` serves a few moved names that way, on purpose).
"""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from rlk_mm.deprecations import MOVED_MODULES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "rlk_mm"
MAX_LINES = 500  # a smell test: a module past it holds more than one concept


@dataclass(frozen=True)
class Import:
    target: str  # an absolute module name of rlk_mm
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of rlk_mm by its absolute name (a package by its own name, for its __init__)."""
    found = {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py")) if "__pycache__" not in p.parts}
    assert PACKAGE in found and len(found) > 10, f"rlk_mm's modules not found under {ROOT}"
    return found


def is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def resolve(name: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` import names, in module ``name``."""
    if not node.level:
        return node.module
    base = name.split(".") if is_package(name) else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def imports_of(name: str) -> tuple[Import, ...]:
    """The rlk_mm modules that module ``name`` imports, one entry a statement and target."""
    return imports_in(name, modules()[name].read_text())


def imports_in(name: str, source: str) -> tuple[Import, ...]:
    """The rlk_mm modules that ``source``, read as module ``name``, imports."""
    tree = ast.parse(source, filename=str(modules()[name]))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.module == "__future__":
                continue
            base = resolve(name, node)
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules()]
            # from p import x, y: the package p when a name is not a submodule, and each submodule
            targets = ([base] if len(submodules) < len(node.names) else []) + submodules
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                assert target in modules(), (f"{modules()[name]}:{node.lineno} imports {target}, "
                                             "which is not a module of rlk_mm")
                found.append(Import(target, node.lineno))
    return tuple(found)


@dataclass(frozen=True)
class PrivateImport:
    module: str  # the importing module
    target: str  # the module the name comes from
    name: str
    line: int


def private_imports_in(name: str, source: str) -> list[PrivateImport]:
    """``from x import _y`` statements of ``source`` (read as module ``name``) whose ``x`` is a
    module of rlk_mm: a private name (one leading underscore; dunders are not private) taken
    from another module, a private submodule included (``from .. import _backend``)."""
    found = []
    for node in ast.walk(ast.parse(source, filename=str(modules()[name]))):
        if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
            continue
        target = resolve(name, node)
        if target != PACKAGE and not target.startswith(PACKAGE + "."):
            continue
        found += [PrivateImport(name, target, alias.name, node.lineno) for alias in node.names
                  if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def graph() -> dict[str, set[str]]:
    return {name: {i.target for i in imports_of(name)} for name in modules()}


def under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def offending(sources: tuple[str, ...], allowed) -> list[str]:
    bad = []
    for name in modules():
        if under(name, *sources):
            bad += [f"{modules()[name].relative_to(ROOT)}:{i.line} imports {i.target}"
                    for i in imports_of(name) if not allowed(i.target)]
    return bad


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(edges):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(edges[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges[nxt])))
    return None


def path_between(edges: dict[str, set[str]], start: str, goal) -> list[str] | None:
    """The shortest import path from ``start`` to a module for which ``goal`` holds, or None."""
    came = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for target in sorted(edges[node]):
                if target in came:
                    continue
                came[target] = node
                if goal(target):
                    path = [target]
                    while came[path[-1]] is not None:
                        path.append(came[path[-1]])
                    return path[::-1]
                nxt.append(target)
        frontier = nxt
    return None


# ------------------------------------------------------------------------------ the helpers


def test_reader_resolves_relative_nested_and_type_checking_imports():
    """Relative imports in a package's __init__ and in a module, imports inside functions and
    under TYPE_CHECKING: all found and resolved; importlib strings are not imports."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "import importlib\n"
        "if TYPE_CHECKING:\n    from ..ops import loss\n"
        "def f():\n    from .spans import Span\n    import rlk_mm.models.qwen2_5_vl as m\n"
        "    return importlib.import_module('rlk_mm.cli')\n"
        "from . import spans, SchemaError\n"
        "from .. import viz\n"
    )
    got = sorted((i.target, i.line) for i in imports_in("rlk_mm.schema.coordinates", source))
    assert got == sorted([
        ("rlk_mm.ops.loss", 4), ("rlk_mm.schema.spans", 6), ("rlk_mm.models.qwen2_5_vl", 7),
        ("rlk_mm.schema", 9), ("rlk_mm.schema.spans", 9), ("rlk_mm.viz", 10),
    ])
    ops = {i.target for i in imports_of("rlk_mm.ops")}
    assert "rlk_mm.ops.loss" in ops and "rlk_mm.ops.invariant.mode" in ops  # both under TYPE_CHECKING
    assert "rlk_mm.models" not in ops  # importlib.import_module strings do not count
    assert "rlk_mm.schema" in {i.target for i in imports_of("rlk_mm.ops._backend")}  # from ..schema import Choice
    assert {"rlk_mm.models", "rlk_mm.ops",
            "rlk_mm.schema"} <= {i.target for i in imports_of("rlk_mm")}  # from . import models, ops
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"b"}}) is None
    assert path_between({"a": {"b"}, "b": {"c"}, "c": set()}, "a", lambda m: m == "c") == ["a", "b", "c"]


def test_private_import_reader():
    """``from x import _y`` of a module of rlk_mm is found (a private submodule too); public
    names, dunders, ``__future__`` and other packages' private names are not."""
    source = (
        "from __future__ import annotations\n"
        "from .spans import Span, _spans\n"
        "from .. import _backend, ops\n"
        "from . import __version__\n"
        "from torch._C import _get_tracing_state\n"
        "def f():\n    from ..ops.loss import _checked_policy as c\n"
    )
    got = sorted((p.target, p.name, p.line) for p in private_imports_in("rlk_mm.schema.coordinates", source))
    assert got == [("rlk_mm", "_backend", 3), ("rlk_mm.ops.loss", "_checked_policy", 7),
                   ("rlk_mm.schema.spans", "_spans", 2)]


# ------------------------------------------------------------------------------ the rules


def test_schema_imports_nothing_else_of_rlk_mm():
    bad = offending(("rlk_mm.schema",), lambda t: under(t, "rlk_mm.schema"))
    assert not bad, "rlk_mm.schema must import only rlk_mm.schema:\n" + "\n".join(bad)


def test_ops_import_only_schema_and_ops():
    bad = offending(("rlk_mm.ops",), lambda t: under(t, "rlk_mm.schema", "rlk_mm.ops", *BASE_MODULES))
    assert not bad, "rlk_mm.ops must import only rlk_mm.schema, rlk_mm.ops and the base modules:\n" + "\n".join(bad)


#: modules any layer may import, as they import nothing of rlk_mm: the deprecation table and the lazy names
BASE_MODULES = ("rlk_mm.deprecations", "rlk_mm.lazy")


@pytest.mark.parametrize("base", BASE_MODULES)
def test_the_base_modules_import_nothing_of_rlk_mm(base):
    bad = offending((base,), lambda t: False)
    assert not bad, f"{base} must import nothing of rlk_mm:\n" + "\n".join(bad)


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    "sources,forbidden",
    [
        (("rlk_mm.models", "rlk_mm.parity", "rlk_mm.integrations"), ("rlk_mm.smoke", "rlk_mm.cli")),
        (("rlk_mm.ops",), ("rlk_mm.models",)),
    ],
    ids=["library-not-apps", "ops-not-models"],
)
def test_lower_layers_never_reach_upper_ones(sources, forbidden):
    """Not directly, and not through another module."""
    edges = graph()
    bad = []
    for name in modules():
        if under(name, *sources):
            path = path_between(edges, name, lambda t: under(t, *forbidden))
            if path:
                bad.append(" -> ".join(path))
    assert not bad, "\n".join(bad)


RAY_STAND_IN_NAME = re.compile(r"ray.*(stand|stub|fake|shim|mock)|(stand|stub|fake|shim|mock).*ray", re.IGNORECASE)


def _is_sys_modules(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "modules"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def _names_ray(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(".")[0] == "ray"


def ray_stand_ins(path: Path) -> list[str]:
    """Where ``path`` puts a module named ray (or ray.*) into sys.modules."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign):
            targets = node.targets
        else:
            targets = [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Subscript) and _is_sys_modules(t.value) and _names_ray(t.slice):
                found.append(f"line {node.lineno}: sys.modules[...] = ...")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_modules(node.func.value):
            args = list(node.args) + [k for d in node.args if isinstance(d, ast.Dict) for k in d.keys]
            if any(_names_ray(a) for a in args) or any(k.arg and k.arg.split(".")[0] == "ray" for k in node.keywords):
                found.append(f"line {node.lineno}: sys.modules.{node.func.attr}(...)")
    return found


def test_ray_stand_in_reader_finds_the_tests_one():
    """The check below would see tests/support/ray_stand_in.py's own installer, were it under rlk_mm/."""
    assert RAY_STAND_IN_NAME.search("ray_stand_in") and not RAY_STAND_IN_NAME.search("array_ops")
    assert ray_stand_ins(ROOT / "tests" / "support" / "ray_stand_in.py")


def test_no_ray_stand_in_in_the_package():
    named = [str(p.relative_to(ROOT)) for p in modules().values() if RAY_STAND_IN_NAME.search(p.stem)]
    assert not named, f"a ray stand-in belongs to tests/, not the package: {named}"
    installs = {str(p.relative_to(ROOT)): where for p in modules().values() if (where := ray_stand_ins(p))}
    assert not installs, f"the package must not install a module named ray: {installs}"


def test_no_private_names_imported_across_modules():
    """A name with a leading underscore is its module's own: a helper two modules share gets a
    public name in a module named for its concept."""
    bad = [f"{modules()[p.module].relative_to(ROOT)}:{p.line} imports {p.name} from {p.target}"
           for name in modules() for p in private_imports_in(name, modules()[name].read_text())]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_moved_module_paths_are_gone_and_their_homes_exist(old):
    """No shim files: an old import fails at once, naming the new home, and the new home is a module."""
    assert old not in modules() and MOVED_MODULES[old] in modules()
    with pytest.raises(ModuleNotFoundError, match=f"{old} moved to {MOVED_MODULES[old]}"):
        importlib.import_module(old)


#: the packages whose every public module (no ``_`` in its path) declares ``__all__``
ALL_DECLARED = ("rlk_mm.schema", "rlk_mm.models", "rlk_mm.parity", "rlk_mm.grounding", "rlk_mm.smoke",
                "rlk_mm.fixtures",
                "rlk_mm.cli", "rlk_mm.command", "rlk_mm.viz")
#: modules run as scripts, or not yet converted
ALL_EXEMPT = ("rlk_mm.smoke.__main__", "rlk_mm.schema.checks")


def declares_all(path: Path) -> bool:
    return any(isinstance(node, (ast.Assign, ast.AnnAssign))
               and any(isinstance(t, ast.Name) and t.id == "__all__"
                       for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
               for node in ast.parse(path.read_text()).body)


def test_public_modules_declare_all():
    """``__all__`` keeps imports (sys, torch, bool_arg) out of star imports, help() and the API docs."""
    public = [name for name in modules() if under(name, *ALL_DECLARED) and name not in ALL_EXEMPT
              and not any(part.startswith("_") for part in name.split(".")[1:])]
    assert len(public) > 40
    missing = [str(modules()[name].relative_to(ROOT)) for name in public if not declares_all(modules()[name])]
    assert not missing, f"public modules without __all__: {missing}"


def test_modules_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in modules().values()}
    over = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them): {over}"


def test_every_module_is_on_the_architecture_map():
    """docs/design/architecture.md's map names every module of the package (its file stem), so the
    map cannot drift from the code again."""
    page = (ROOT / "docs" / "design" / "architecture.md").read_text()
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", page[page.index("## The map") : page.index("## Ops: one semantics")]))
    missing = sorted(str(path.relative_to(ROOT)) for path in modules().values()
                     if path.stem not in ("__init__", "__main__") and path.stem not in words)
    assert not missing, f"modules missing from the map in docs/design/architecture.md: {missing}"
