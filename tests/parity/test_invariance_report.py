"""The invariance report as a person reads it: ``print(report)`` is the table ``rlk-mm invariance``
prints, and the picture's legend sits outside the bars, never over one."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from rlk_mm.parity.invariance_report import CaseResult, Divergence, InvarianceReport

CASE_NAMES = ("batch_size", "position", "padding_side", "packed", "prefix_cache", "decode")


def _report(n: int) -> InvarianceReport:
    """``n`` cases, bitwise under batch_invariant(), the control's drift growing to 1 in the last case (the
    longest bar, at the bottom right, where a legend inside the axes would go)."""
    results = []
    for i, case in enumerate(CASE_NAMES[:n]):
        results.append(CaseResult(case, "", "batch_invariant", True, 0.0, 12))
        results.append(CaseResult(case, "", "default", False, 10.0 ** (i - n + 1), 12,
                                  Divergence(0, "model.language_model.layers.0.mlp", "Linear", 1e-7, 3, 40)))
    return InvarianceReport(results, {"model": "tiny", "device": "cpu", "dtype": "float32", "score": "logprob"})


def test_print_shows_the_table_not_the_fields():
    report = _report(2)
    assert str(report) == report.table()
    assert str(report).splitlines()[0].startswith("case ") and "CaseResult(" not in str(report)
    assert repr(report).startswith("InvarianceReport(results=[CaseResult(")


@pytest.mark.parametrize("n", [1, 6])
def test_the_legend_covers_no_bar(n, tmp_path, monkeypatch):
    boxes = []
    save = Figure.savefig

    def savefig(fig, *args, **kwargs):
        save(fig, *args, **kwargs)  # lays the figure out: the extents below are the saved picture's
        renderer = fig.canvas.get_renderer()
        bars = fig.axes[0]
        boxes.append((bars.get_legend().get_window_extent(renderer), [p.get_window_extent(renderer) for p in bars.patches],
                      fig.bbox, [t.get_window_extent(renderer) for t in fig.texts]))

    monkeypatch.setattr(Figure, "savefig", savefig)
    _report(n).save_png(tmp_path / "invariance.png")
    legend, bars, figure, titles = boxes[0]
    assert len(bars) == 2 * n
    assert not [b for b in bars if legend.overlaps(b)], "the legend covers a bar"
    assert not [t for t in titles if legend.overlaps(t)], "the legend covers the title"
    assert figure.x0 <= legend.x0 and legend.x1 <= figure.x1 and figure.y0 <= legend.y0 and legend.y1 <= figure.y1
