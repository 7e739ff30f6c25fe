"""Bad and unusual inputs to draw_layout."""

from __future__ import annotations

import pytest
import torch

from rlk_mm.viz import draw_layout
from support.context_cases import (
    Case,
    Raises,
    Returns,
    assert_well,
    fail,
)

pytestmark = pytest.mark.usefixtures("one_thread")


BAD = [
    # ---------------------------------------------------------------- draw_layout
    Case("draw_layout.batch.list", lambda c: draw_layout([c.batch], c.tmp / "l.png"),
         Raises(TypeError, r"batch must be an RLBatch")),
    Case("draw_layout.samples.range", lambda c: draw_layout(c.batch, c.tmp / "l.png", samples=[5]),
         Raises(ValueError, r"samples\[0\]=5 is out of range")),
    Case("draw_layout.samples.negative", lambda c: draw_layout(c.batch, c.tmp / "l.png", samples=[0, -1]),
         Raises(ValueError, r"samples\[1\]=-1 is out of range")),
    Case("draw_layout.samples.bool", lambda c: draw_layout(c.batch, c.tmp / "l.png", samples=[True]),
         Raises(TypeError, r"samples\[0\] must be an int")),
    Case("draw_layout.samples.str", lambda c: draw_layout(c.batch, c.tmp / "l.png", samples="0"),
         Raises(TypeError, r"samples must be a list of sample indices")),
    Case("draw_layout.title.int", lambda c: draw_layout(c.batch, c.tmp / "l.png", title=5),
         Raises(TypeError, r"title must be a str")),
    Case("draw_layout.path.dir", lambda c: draw_layout(c.batch, c.tmp / "no_such_dir" / "l.png"),
         Raises(FileNotFoundError, r"no_such_dir")),
]


GOOD = [
    Case("draw_layout.empty_batch", lambda c: draw_layout(c.batch.select([]), c.tmp / "empty.png"),
         Returns(lambda r, c: r.exists() or fail(r))),
    Case("draw_layout.tensor_samples", lambda c: draw_layout(c.batch, c.tmp / "t.png", samples=torch.tensor([2, 0])),
         Returns(lambda r, c: r.exists() or fail(r))),
]


@pytest.mark.parametrize("case", BAD + GOOD, ids=lambda case: case.id)
def test_input(case, input_context):
    assert_well(case, input_context)

