"""The input tables of the ops and integrations tests (tests/*/test_*_inputs.py): a case, the
classes its outcome falls in, and the shared inputs.

Each table row is one input a user can give: a wrong type, shape or dtype, an empty or
non-finite value, a value out of range, fields that disagree, an ambiguous layout. A bad
input must raise the expected error with a message that names the argument (for values:
the sample and the position) and says what to change; an unusual but valid input must give
its documented result. ``outcome`` sorts what happened into the issue's classes: ``well``,
``silent`` (a result where an error was due, or a wrong result), ``crash`` (an error raised
outside rlk_mm's own checks: torch's or Python's) and ``unclear`` (rlk_mm's own error, but
not the expected one).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
import torch

from rlk_mm.schema import RLBatch
from rlk_mm.schema.spans import Span, SpanTable
from support.helpers import raised_by_rlk_mm

__all__ = [
    "ADV", "BAD_HIDDEN", "BAD_HIDDEN_STATUS", "BAD_LOGITS", "BAD_LOGITS_STATUS", "BATCH", "BIAS", "F32_MAX", "F32_TINY",
    "GROUPS", "H", "HEAD", "IDX", "INF", "LEFT", "LOGP", "MASK", "NAN", "OLD", "PACKED", "RIGHT", "SAMPLE",
    "SAMPLING_FILTERS", "SCORES", "TGT", "TOKEN_REWARDS", "UIDS", "W", "Case", "assert_well", "bad",
    "documented_rows", "finite_scalar", "ok", "outcome", "table", "with_value",
]

NAN, INF = math.nan, math.inf
F32_MAX, F32_TINY = torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[], Any]
    error: Optional[type] = None  # the error a bad input must raise; None: a valid input
    match: str = ""  # what its message must say (regex)
    check: Callable[[Any], bool] = lambda result: True  # a valid input's result is the documented one


def bad(name, call, error, match) -> Case:
    return Case(name, call, error, match)


def ok(name, call, check=lambda result: True) -> Case:
    return Case(name, call, None, "", check)


def outcome(case: Case) -> tuple[str, str]:
    """(class, detail): ``well``, ``silent``, ``crash`` or ``unclear``."""
    try:
        result = case.call()
    except Exception as e:  # noqa: BLE001 - sorting every failure is the point
        text = f"{type(e).__name__}: {e}"
        if case.error is not None and isinstance(e, case.error) and re.search(case.match, str(e)):
            return "well", text
        return ("unclear" if raised_by_rlk_mm(e) else "crash"), text
    if case.error is None and case.check(result):
        return "well", ""
    return "silent", "no error" if case.error is not None else "wrong result"


def with_value(t: torch.Tensor, index, value) -> torch.Tensor:
    out = t.clone()
    out[index] = value
    return out


def finite_scalar(result) -> bool:
    loss = result[0] if isinstance(result, tuple) else result
    return bool(torch.isfinite(loss).all())


# ============================================================================ selected_logprob
#: one generator draws every random input of the tables, in this order
_g = torch.Generator().manual_seed(0)
H = torch.randn(10, 16, generator=_g)
W = torch.randn(30, 16, generator=_g) * 0.3
BIAS = torch.randn(30, generator=_g)
IDX, TGT = torch.tensor([0, 3]), torch.tensor([1, 2])

#: two samples of 7 and 5 tokens; loss spans [3, 5) + [6, 7) and [2, 5); sample 1, position 3 holds token 25
BATCH = RLBatch(
    input_ids=torch.tensor([5, 1, 2, 3, 4, 6, 7, 8, 9, 10, 25, 11]),
    cu_seqlens=torch.tensor([0, 7, 12], dtype=torch.int32),
    position_ids=torch.cat([torch.arange(7), torch.arange(5)]).expand(3, -1).clone(),
    modality_spans=SpanTable.from_lists([[Span(0, 7)], [Span(0, 5)]]),
    loss_spans=SpanTable.from_lists([[Span(3, 5), Span(6, 7)], [Span(2, 5)]]),
    processor_fingerprint="test",
)
PACKED = torch.randn(12, 16, generator=_g)
RIGHT, LEFT = torch.zeros(2, 8, 16), torch.zeros(2, 8, 16)
RIGHT[0, :7], RIGHT[1, :5] = PACKED[:7], PACKED[7:]
LEFT[0, 1:], LEFT[1, 3:] = PACKED[:7], PACKED[7:]


# ============================================================================ policy_loss, agg_loss, kl_penalty, verl
LOGP = torch.randn(3, 4, generator=_g) * 0.3 - 1.0
OLD = LOGP + torch.randn(3, 4, generator=_g) * 0.1
ADV = torch.randn(3, 4, generator=_g)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
SAMPLE = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])


# ============================================================================ advantages and rewards
SCORES = torch.tensor([1.0, 0.0, 2.0, 2.0, 3.0, 5.0])
GROUPS = torch.tensor([0, 0, 1, 1, 2, 2])


# ============================================================================ the verl adapter
TOKEN_REWARDS = torch.randn(6, 4, generator=_g)
UIDS = ["a", "a", "b", "b", "c", "c"]


# ============================================================================ sampling: every kind of bad row
#: logits [8, 40] drawn at temperature 0.5, one row per kind, and each row's status (the
#: torch backend's codes: 0 OK, 1 a NaN or +inf logit, 2 every logit -inf): a good row; a NaN;
#: a +inf; -inf everywhere; a NaN among -inf; 3e38 (+inf once tempered); -3e38 everywhere (-inf
#: everywhere once tempered); and one finite entry (good: its token is 17)
BAD_LOGITS = torch.randn(8, 40, generator=_g)
BAD_LOGITS[1, 5], BAD_LOGITS[2, 33] = NAN, INF
BAD_LOGITS[3] = -INF
BAD_LOGITS[4], BAD_LOGITS[4, 9] = -INF, NAN
BAD_LOGITS[5, 21] = 3e38
BAD_LOGITS[6] = -3e38
BAD_LOGITS[7], BAD_LOGITS[7, 17] = -INF, 0.5
BAD_LOGITS_STATUS = (0, 1, 1, 2, 1, 1, 2, 0)
#: hidden states [4, 8] and a head [40, 8]: a good row, a NaN, a +inf, and a row whose logits overflow
BAD_HIDDEN = torch.randn(4, 8, generator=_g)
BAD_HIDDEN[1, 2], BAD_HIDDEN[2, 6], BAD_HIDDEN[3] = NAN, INF, 1e38
BAD_HIDDEN_STATUS = (0, 1, 1, 1)
HEAD = torch.randn(40, 8, generator=_g)
#: the filters a bad row must meet on every path (plain, top-k's list, top-p's histogram, min-p, all three)
SAMPLING_FILTERS = ({}, {"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.2}, {"top_k": 3, "top_p": 0.9, "min_p": 0.1})


def documented_rows(status, token_of_ok=None):
    """A ``SampleResult``'s check: each row as its ``status`` documents it. A bad row (status not 0)
    has token 0 and NaN log-probs; a good one finite log-probs (``token_of_ok``: {row: its token})."""
    def check(result) -> bool:
        for r, st in enumerate(status):
            token, lp, slp = int(result.tokens[r]), float(result.log_probs[r]), float(result.sampled_log_probs[r])
            if st != 0 and not (token == 0 and math.isnan(lp) and math.isnan(slp)):
                return False
            if st == 0 and not (math.isfinite(lp) and math.isfinite(slp)
                                and token == (token_of_ok or {}).get(r, token)):
                return False
        return True

    return check


# ============================================================================ the tables as tests
def table(groups: dict) -> list:
    return [pytest.param(case, id=f"{group}: {case.name}") for group, make in groups.items() for case in make()]


def assert_well(case: Case) -> None:
    kind, detail = outcome(case)
    assert kind == "well", f"{kind}: {detail}"

