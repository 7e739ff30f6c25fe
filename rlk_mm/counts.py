"""Counts in what the command line and the reports print: "1 sample", "4 samples", never "1 samples".

Standard library only, so that any layer may word its counts with it (the schema aside, which
imports nothing else of rlk_mm)."""

from __future__ import annotations

__all__: list[str] = []


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``n`` and ``noun``, the noun in the plural unless ``n`` is 1: ``plural(1, "step")`` is
    "1 step", ``plural(0, "mismatch")`` "0 mismatches"; ``many``: an irregular plural."""
    if n == 1:
        return f"{n} {noun}"
    if many is None:
        many = noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")
    return f"{n} {many}"
