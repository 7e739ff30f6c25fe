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
    ]


CASES = {"sample": _sample_cases}


@pytest.mark.parametrize("case", table(CASES))
def test_inputs(case):
    assert_well(case)

