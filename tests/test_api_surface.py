"""``__all__`` lists API only: every name a public module exports is on an API reference page.

A helper two modules share has a public name (no leading underscore) but stays out of
``__all__``, so that ``help()``, star imports and the reference show what a user calls and
nothing else. A name counts as documented when a ``::: path`` entry of ``docs/api/`` names it in
its module or in a package above it that serves the same object.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import rlk_mm

ROOT = Path(__file__).resolve().parents[1]
DIRECTIVE = re.compile(r"^:::[ \t]+([\w.]+)", re.MULTILINE)
ANCHOR = re.compile(r"^#+ .*\{#([\w.]+)\}[ \t]*$", re.MULTILINE)  # a hand-written entry: a heading with an explicit id


def entries() -> set[str]:
    pages = [page.read_text() for page in (ROOT / "docs" / "api").glob("*.md")]
    return {e for text in pages for e in DIRECTIVE.findall(text) + ANCHOR.findall(text)}


def public_modules() -> list[str]:
    """Every module of the package without a leading underscore in its path (scripts aside)."""
    names = ["rlk_mm"] + [m.name for m in pkgutil.walk_packages(rlk_mm.__path__, "rlk_mm.")]
    return [n for n in names if not any(p.startswith("_") for p in n.split(".")[1:])]


def _same(a, b) -> bool:
    return a is b or (getattr(a, "__func__", a) is getattr(b, "__func__", b))


def _resolve(path: str):
    parts = path.split(".")
    for depth in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:depth]))
        except ImportError:
            continue
        for attribute in parts[depth:]:
            if not hasattr(obj, attribute):
                return None
            obj = getattr(obj, attribute)
        return obj
    return None


def documented(module: str, name: str, known: set[str]) -> bool:
    """``module.name``; ``package.name`` for a package above ``module`` serving the same object; or
    an entry below ``module`` ending in ``.name`` that is the same object (a lazily served name
    documented in its home module, as ``rlk_mm.parity.invariance.invariance_sweep``)."""
    if f"{module}.{name}" in known:
        return True
    value = getattr(importlib.import_module(module), name)
    parts = module.split(".")
    above = {f"{'.'.join(parts[:depth])}.{name}" for depth in range(1, len(parts))}
    below = {e for e in known if e.startswith(module + ".") and e.endswith("." + name)}
    return any(e in known and _same(_resolve(e), value) for e in above | below)


def undocumented() -> dict[str, list[str]]:
    known = entries()
    missing = {}
    for module in public_modules():
        exported = getattr(importlib.import_module(module), "__all__", ())
        names = [n for n in exported if not documented(module, n, known)]
        if names:
            missing[module] = names
    return missing


def test_every_exported_name_is_api():
    missing = undocumented()
    assert not missing, ("names in __all__ that no page of docs/api/ documents: document each, or take it out of "
                         "__all__ (a helper keeps its public name outside __all__):\n"
                         + "\n".join(f"  {module}: {names}" for module, names in sorted(missing.items())))


def test_every_entry_resolves():
    """The reverse direction: a ``:::`` entry names a real object (mkdocs --strict also fails on it)."""
    assert [e for e in sorted(entries()) if _resolve(e) is None] == []


@pytest.mark.parametrize("module,name,expected", [
    ("rlk_mm.ops.logprob", "selected_logprob", True),   # documented as rlk_mm.ops.selected_logprob
    ("rlk_mm.ops.padded", "data_arg", False),           # a helper: not on any page
    ("rlk_mm.models.forward", "padding_arg", False),    # another helper
])
def test_documented_reads_the_pages(module, name, expected):
    assert documented(module, name, entries()) is expected
