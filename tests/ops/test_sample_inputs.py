"""Bad and unusual inputs to sample and sample_from_hidden: an empty vocabulary is refused, one entry is the
only draw, a filter's "off" value of other libraries is refused saying which value turns it off, and every kind
of bad row (a NaN or +inf logit, -inf everywhere, an overflow once tempered; from the logits, the hidden state,
the head or the bias) gives on every backend and under every filter what the docstrings say: token 0 and NaN
log-probs, the good rows untouched."""

from __future__ import annotations

import pytest
import torch

from rlk_mm.ops import (
    sample,
    sample_from_hidden,
)
from support.op_cases import (
    BAD_HIDDEN,
    BAD_HIDDEN_STATUS,
    BAD_LOGITS,
    BAD_LOGITS_STATUS,
    HEAD,
    INF,
    NAN,
    SAMPLING_FILTERS,
    Case,
    assert_well,
    bad,
    documented_rows,
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
        bad("sample: logits on meta", lambda: sample(torch.zeros(2, 4, device="meta"), seeds=seeds), ValueError,
            r"logits is on the meta device, which holds no values: sample computes with"),
        bad("sample: seeds on meta", lambda: sample(torch.zeros(2, 4), seeds=seeds.to("meta")), ValueError,
            r"seeds is on the meta device"),
        bad("sample: step on meta", lambda: sample(torch.zeros(2, 4), seeds=seeds, step=torch.tensor(1, device="meta")),
            ValueError, r"step is on the meta device"),
        bad("sample_from_hidden: on meta", lambda: sample_from_hidden(HEAD[:2].to("meta"), HEAD.to("meta"), seeds=seeds),
            ValueError, r"hidden is on the meta device.*sample_from_hidden"),
    ]


CASES = {"sample": _sample_cases}


@pytest.mark.parametrize("case", table(CASES))
def test_inputs(case):
    assert_well(case)


def _name(kw: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in kw.items()) or "plain"


def _bad_row_cases() -> list[Case]:
    seeds = torch.arange(8) + 11
    cases = [ok(f"sample: each kind of bad row, {_name(kw)}",
                lambda kw=kw: sample(BAD_LOGITS, seeds=seeds, temperature=0.5, **kw),
                documented_rows(BAD_LOGITS_STATUS, {7: 17}))
             for kw in SAMPLING_FILTERS[:4]]
    cases += [ok(f"sample_from_hidden: NaN, +inf and overflowing hidden rows, {_name(kw)}",
                 lambda kw=kw: sample_from_hidden(BAD_HIDDEN, HEAD, seeds=seeds[:4], temperature=0.9, **kw),
                 documented_rows(BAD_HIDDEN_STATUS))
              for kw in SAMPLING_FILTERS[:4]]
    good = BAD_HIDDEN[[0, 0]]
    w_nan = HEAD.clone()
    w_nan[6, 1] = NAN
    bias_inf, bias_nan, masked, one = torch.zeros(40), torch.zeros(40), torch.full((40,), -INF), torch.full((40,), -INF)
    bias_inf[3], bias_nan[30], one[12] = INF, NAN, 0.0
    for kw in SAMPLING_FILTERS[:2]:
        cases += [
            ok(f"sample_from_hidden: a NaN weight row, {_name(kw)}",
               lambda kw=kw: sample_from_hidden(good, w_nan, seeds=seeds[:2], **kw), documented_rows((1, 1))),
            ok(f"sample_from_hidden: a +inf bias entry, {_name(kw)}",
               lambda kw=kw: sample_from_hidden(good, HEAD, bias=bias_inf, seeds=seeds[:2], **kw),
               documented_rows((1, 1))),
            ok(f"sample_from_hidden: a NaN bias entry, {_name(kw)}",
               lambda kw=kw: sample_from_hidden(good, HEAD, bias=bias_nan, seeds=seeds[:2], **kw),
               documented_rows((1, 1))),
            ok(f"sample_from_hidden: bias -inf everywhere, {_name(kw)}",
               lambda kw=kw: sample_from_hidden(good, HEAD, bias=masked, seeds=seeds[:2], **kw),
               documented_rows((2, 2))),
            ok(f"sample_from_hidden: bias -inf but at one entry, {_name(kw)}",
               lambda kw=kw: sample_from_hidden(good, HEAD, bias=one, seeds=seeds[:2], **kw),
               documented_rows((0, 0), {0: 12, 1: 12})),
        ]
    return cases


def _graph_cases() -> list[Case]:
    seeds = torch.arange(2)
    logits, head = BAD_LOGITS[[0, 7]].clone().requires_grad_(), HEAD.clone().requires_grad_()
    return [
        ok("sample: logits that require grad give detached log-probs", lambda: sample(logits, seeds=seeds, top_k=3),
           lambda r: not (r.log_probs.requires_grad or r.sampled_log_probs.requires_grad)),
        ok("sample_from_hidden: a head that requires grad gives detached log-probs",
           lambda: sample_from_hidden(BAD_HIDDEN[:2], head, seeds=seeds),
           lambda r: not (r.log_probs.requires_grad or r.sampled_log_probs.requires_grad)),
    ]


@pytest.mark.parametrize("case", table({"bad rows": _bad_row_cases, "graphs": _graph_cases}))
def test_bad_rows(backend, case):
    assert_well(case)
