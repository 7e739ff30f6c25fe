"""Bad and unusual inputs to sample: an empty vocabulary is refused, one entry is the only draw."""

from __future__ import annotations

import pytest
import torch

from rlk_mm.ops import (
    sample,
)
from support.op_cases import (
    Case,
    assert_well,
    bad,
    ok,
    table,
)


def _sample_cases() -> list[Case]:
    seeds = torch.tensor([1, 2])
    return [
        bad("sample: empty vocabulary", lambda: sample(torch.zeros(2, 0), seeds=seeds), ValueError,
            r"the vocabulary is empty: logits \[B, V\] .* V = 0"),
        bad("sample: empty vocabulary, top_k", lambda: sample(torch.zeros(2, 0), seeds=seeds, top_k=1), ValueError,
            r"the vocabulary is empty"),
        ok("sample: one entry", lambda: sample(torch.zeros(2, 1), seeds=seeds), lambda r: r.tokens.tolist() == [0, 0]),
        # the filters' "off" values of other libraries are refused, saying which value turns a filter off
        bad("sample: top_k 0", lambda: sample(torch.zeros(2, 4), seeds=seeds, top_k=0), ValueError,
            r"top_k=0 is out of range: it must be >= 1.*None turns top-k off"),
        bad("sample: top_k -1", lambda: sample(torch.zeros(2, 4), seeds=seeds, top_k=-1), ValueError,
            r"top_k=-1 is out of range"),
        bad("sample: top_k bool", lambda: sample(torch.zeros(2, 4), seeds=seeds, top_k=True), TypeError,
            r"top_k must be an int"),
        bad("sample: top_p a percentage", lambda: sample(torch.zeros(2, 4), seeds=seeds, top_p=90), ValueError,
            r"top_p=90\.0 is out of range: it must be in \(0, 1\].*1 or None turns top-p off"),
        bad("sample: top_p 0", lambda: sample(torch.zeros(2, 4), seeds=seeds, top_p=0.0), ValueError,
            r"top_p=0\.0 is out of range"),
        bad("sample: min_p above 1", lambda: sample(torch.zeros(2, 4), seeds=seeds, min_p=1.5), ValueError,
            r"min_p=1\.5 is out of range: it must be in \[0, 1\].*0 or None turns min-p off"),
        bad("sample: min_p nan", lambda: sample(torch.zeros(2, 4), seeds=seeds, min_p=float("nan")), ValueError,
            r"min_p=nan must be a finite number"),
    ]


CASES = {"sample": _sample_cases}


@pytest.mark.parametrize("case", table(CASES))
def test_inputs(case):
    assert_well(case)

