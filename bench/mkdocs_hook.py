"""The mkdocs hook (``mkdocs.yml``: ``hooks: [bench/mkdocs_hook.py]``): expands the nav's
``Benchmarks`` and ``Notes`` entries into their pages, appends to ``Guides`` any guide page the
nav does not list, and fails a strict build where ``docs/benchmarks/`` or the README's headline
block is stale (``python -m bench.report`` regenerates them).

mkdocs loads this file by its path, outside the ``bench`` package: it puts the repository
root on ``sys.path`` to import ``bench.report`` (standard library only; no torch).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402

log = logging.getLogger("mkdocs.hooks.bench")


def on_config(config, **kwargs):
    """Expand the nav's ``Benchmarks`` and ``Notes`` entries; append unlisted guides; warn (an
    error under ``--strict``) where the generated pages are stale."""
    for problem in report.stale():
        log.warning("%s: run python -m bench.report", problem)
    expanded = report.nav_pages()
    nav = config.get("nav") or []
    for i, item in enumerate(nav):
        if isinstance(item, dict) and len(item) == 1:
            (key, value), = item.items()
            if key in expanded and isinstance(value, str):
                nav[i] = {key: expanded[key]}
            elif key == "Guides" and isinstance(value, list):
                value.extend(report.unlisted_guides(value))
    return config
