"""Bad and unusual inputs to selected_logprob (both backends), and properties over generated inputs: padded
hidden states score the packed rows; a target outside the vocabulary is named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm.ops import (
    pack_padded,
    selected_logprob,
    unpack_to_padded,
)
from rlk_mm.schema import RLBatch
from rlk_mm.schema.spans import Span, SpanTable
from support.op_cases import (
    BATCH,
    BIAS,
    IDX,
    INF,
    LEFT,
    NAN,
    PACKED,
    RIGHT,
    TGT,
    Case,
    H,
    W,
    assert_well,
    bad,
    ok,
    table,
    with_value,
)


def _sl(**kw):
    args = dict(hidden=H, weight=W, index=IDX, targets=TGT)
    args.update(kw)
    return lambda: selected_logprob(**args)


def _same_as_packed(result) -> bool:
    return torch.equal(result, selected_logprob(PACKED, W, BATCH))


def _selected_logprob_cases() -> list[Case]:
    masked_target = with_value(BIAS, 2, -INF)
    nan_row = with_value(H, 3, NAN)
    return [
        bad("hidden list", _sl(hidden=H.tolist()), TypeError, r"hidden must be a torch.Tensor"),
        bad("hidden 1-D", _sl(hidden=H[0]), ValueError, r"hidden must be \[T, H\] .*or \[B, L, H\]"),
        bad("hidden 4-D", _sl(hidden=H[None, None]), ValueError, r"hidden must be \[T, H\] .*or \[B, L, H\]"),
        bad("hidden int", _sl(hidden=H.long(), weight=W.long()), TypeError,
            r"hidden and weight must share one of float32"),
        bad("hidden float64", _sl(hidden=H.double(), weight=W.double()), TypeError,
            r"hidden and weight must share one of float32"),
        bad("hidden bf16, weight fp32", _sl(hidden=H.bfloat16()), TypeError, r"share one of"),
        bad("hidden size 0", _sl(hidden=H[:, :0], weight=W[:, :0]), ValueError, r"hidden size H = 0"),
        bad("weight list", _sl(weight=W.tolist()), TypeError, r"weight must be a torch.Tensor"),
        bad("weight 3-D", _sl(weight=W[None]), ValueError, r"weight must be \[V, H\]"),
        bad("weight empty vocabulary", _sl(weight=W[:0]), ValueError, r"weight has an empty vocabulary"),
        bad("weight hidden size", _sl(weight=W[:, :8]), ValueError, r"hidden size mismatch"),
        bad("weight on meta", _sl(weight=W.to("meta")), ValueError, r"weight is on meta but hidden is on cpu"),
        bad("bias list", _sl(bias=BIAS.tolist()), TypeError, r"bias must be a torch.Tensor"),
        bad("bias shape", _sl(bias=BIAS[:5]), ValueError, r"bias must be \[V=30\]"),
        bad("bias dtype", _sl(bias=BIAS.bfloat16()), TypeError, r"bias dtype"),
        bad("bias nan", _sl(bias=with_value(BIAS, 4, NAN)), ValueError, r"bias\[4\] = nan"),
        bad("bias +inf", _sl(bias=with_value(BIAS, 4, INF)), ValueError, r"bias\[4\] = inf"),
        bad("bias all -inf", _sl(bias=torch.full((30,), -INF)), ValueError, r"bias is -inf at every vocabulary entry"),
        bad("target masked by bias", _sl(bias=masked_target), ValueError,
            r"targets\[1\] = 2 is masked: bias\[2\] = -inf"),
        bad("index missing", _sl(index=None), ValueError, r"both index .* and targets .* are required"),
        bad("targets missing", _sl(targets=None), ValueError, r"both index .* and targets .* are required"),
        bad("index list", _sl(index=[0, 3]), TypeError, r"index must be a torch.Tensor"),
        bad("index int", _sl(index=3, targets=torch.tensor([1])), TypeError, r"index must be a torch.Tensor"),
        bad("index 0-d", _sl(index=torch.tensor(3), targets=torch.tensor([1])), ValueError, r"index must be 1-D"),
        bad("index 2-D", _sl(index=IDX[None]), ValueError, r"index must be 1-D"),
        bad("index float", _sl(index=IDX.float()), TypeError, r"index must be an integer tensor"),
        bad("index bool", _sl(index=torch.tensor([True, False])), TypeError, r"index must be an integer tensor"),
        bad("index out of range", _sl(index=torch.tensor([0, 10])), ValueError,
            r"index\[1\] = 10 is out of range: there are 10 rows"),
        bad("index negative", _sl(index=torch.tensor([-1, 2])), ValueError, r"index\[0\] = -1 is out of range"),
        bad("targets float", _sl(targets=TGT.float()), TypeError, r"targets must be an integer tensor"),
        bad("targets ignore index", _sl(targets=torch.tensor([-100, 2])), ValueError,
            r"targets\[0\] = -100 .*ignore index"),
        bad("targets out of vocabulary", _sl(targets=torch.tensor([1, 30])), ValueError,
            r"targets\[1\] = 30 is out of range: there are 30 vocabulary"),
        bad("targets length", _sl(targets=TGT[:1]), ValueError, r"index has 2 rows but targets has 1"),
        bad("targets on meta", _sl(targets=TGT.to("meta")), ValueError, r"targets is on meta but hidden is on cpu"),
        bad("temperature 0", _sl(temperature=0.0), ValueError, r"temperature must be a finite number >= 1e-05"),
        bad("temperature negative", _sl(temperature=-2.0), ValueError, r"temperature must be a finite number >= 1e-05"),
        bad("temperature nan", _sl(temperature=NAN), ValueError, r"temperature must be a finite number >= 1e-05"),
        bad("temperature inf", _sl(temperature=INF), ValueError, r"temperature must be a finite number >= 1e-05"),
        bad("temperature tiny", _sl(temperature=1e-30), ValueError, r"temperature must be a finite number >= 1e-05"),
        bad("temperature str", _sl(temperature="0.7"), TypeError, r"temperature must be a number"),
        bad("temperature bool", _sl(temperature=True), TypeError, r"temperature must be a number"),
        bad("return_entropy str", _sl(return_entropy="no"), TypeError, r"return_entropy must be True or False"),
        bad("return_entropy int", _sl(return_entropy=1), TypeError, r"return_entropy must be True or False"),
        bad("batch and index", lambda: selected_logprob(PACKED, W, BATCH, index=IDX, targets=TGT), ValueError,
            r"give either batch or index/targets"),
        bad("batch of another type", lambda: selected_logprob(PACKED, W, BATCH.loss_spans), TypeError,
            r"batch must be an RLBatch, got SpanTable"),
        bad("batch, packed rows", lambda: selected_logprob(PACKED[:11], W, BATCH), ValueError, r"batch has 12 tokens"),
        bad("batch, padded without padding side", lambda: selected_logprob(LEFT, W, BATCH), ValueError,
            r"pass padding='right' .*or padding='left'"),
        bad("batch, padding middle", lambda: selected_logprob(LEFT, W, BATCH, padding="middle"), ValueError,
            r"padding='middle': expected one of left, right"),
        bad("batch, padded samples", lambda: selected_logprob(RIGHT[:1], W, BATCH, padding="right"), ValueError,
            r"batch has 2 samples"),
        bad("batch, padded too short", lambda: selected_logprob(RIGHT[:, :6], W, BATCH, padding="right"), ValueError,
            r"hidden is padded \[B=2, L=6, H\]: a padded length of 6 is shorter than the longest sample \(sample 0, 7 "
            r"tokens\)"),
        bad("batch, packed with padding", lambda: selected_logprob(PACKED, W, BATCH, padding="right"), ValueError,
            r"padding='right' applies only to \[B, L, H\] hidden states with a batch"),
        bad("index, padded with padding", _sl(hidden=H.view(2, 5, 16), padding="left"), ValueError,
            r"padding='left' applies only to \[B, L, H\] hidden states with a batch"),
        bad("batch token outside vocabulary", lambda: selected_logprob(PACKED, W[:20], BATCH), ValueError,
            r"batch input_ids: sample 1, position 3 holds token 25, which is out of range: there are 20 vocabulary "
            r"entries"),
        ok("batch, right padded", lambda: selected_logprob(RIGHT, W, BATCH, padding="right"), _same_as_packed),
        ok("batch, left padded", lambda: selected_logprob(LEFT, W, BATCH, padding="left"), _same_as_packed),
        ok("index into [B, L, H]", _sl(hidden=H.view(2, 5, 16), index=torch.tensor([7]), targets=TGT[:1]),
           lambda r: torch.equal(r, selected_logprob(H, W, index=torch.tensor([7]), targets=TGT[:1]))),
        ok("empty selection", _sl(index=IDX[:0], targets=TGT[:0]), lambda r: r.shape == (0,)),
        ok("empty hidden", _sl(hidden=H[:0], index=IDX[:0], targets=TGT[:0]), lambda r: r.shape == (0,)),
        ok("non-contiguous hidden", _sl(hidden=H.T.contiguous().T),
           lambda r: torch.equal(r, selected_logprob(H, W, index=IDX, targets=TGT))),
        ok("int32 index and targets", _sl(index=IDX.int(), targets=TGT.int()),
           lambda r: torch.equal(r, selected_logprob(H, W, index=IDX, targets=TGT))),
        ok("temperature as a 0-d tensor", _sl(temperature=torch.tensor(0.5)),
           lambda r: torch.equal(r, selected_logprob(H, W, index=IDX, targets=TGT, temperature=0.5))),
        # documented: a non-finite hidden row gives NaN for that row only
        ok("nan hidden row propagates to its row", _sl(hidden=nan_row, index=torch.tensor([3, 0]), targets=TGT),
           lambda r: bool(r[0].isnan()) and bool(r[1].isfinite())),
        # documented: a bias of -inf masks vocabulary entries that are not targets
        ok("-inf bias elsewhere", _sl(bias=with_value(BIAS, 7, -INF)), lambda r: bool(torch.isfinite(r).all())),
        bad("every input on meta", _sl(hidden=H.to("meta"), weight=W.to("meta"), index=IDX.to("meta"),
                                       targets=TGT.to("meta")), ValueError,
            r"hidden is on the meta device, which holds no values: selected_logprob computes with"),
        ok("hidden [1, T, H] with index: its flattened rows", _sl(hidden=H[None]),
           lambda r: torch.equal(r, selected_logprob(H, W, index=IDX, targets=TGT))),
    ]


def _padded_cases() -> list[Case]:
    x, mask = torch.zeros(2, 3, 1), torch.ones(2, 3, dtype=torch.bool)
    return [
        bad("pack_padded on meta", lambda: pack_padded(x.to("meta"), mask.to("meta")), ValueError,
            r"x is on the meta device.*pack_padded"),
        bad("unpack_to_padded cu_seqlens on meta",
            lambda: unpack_to_padded(x[0], torch.tensor([0, 3], dtype=torch.int32, device="meta"), 3), ValueError,
            r"cu_seqlens is on the meta device.*unpack_to_padded"),
    ]


CASES = {"selected_logprob": _selected_logprob_cases, "padded": _padded_cases}


@pytest.mark.parametrize("case", table(CASES))
def test_inputs(backend, case):
    assert_well(case)


@st.composite
def _padded_batches(draw):
    """An RLBatch of 1-4 text samples, its packed hidden states and the same padded left and right."""
    lengths = draw(st.lists(st.integers(2, 9), min_size=1, max_size=4))
    loss = []
    for n in lengths:
        start = draw(st.integers(1, n - 1))
        loss.append([Span(start, draw(st.integers(start + 1, n)))])
    T, L = sum(lengths), max(lengths) + draw(st.integers(0, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    batch = RLBatch(
        input_ids=torch.randint(0, 30, (T,), generator=g),
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        position_ids=torch.cat([torch.arange(n) for n in lengths]).expand(3, -1).clone(),
        modality_spans=SpanTable.from_lists([[Span(0, n)] for n in lengths]),
        loss_spans=SpanTable.from_lists(loss), processor_fingerprint="test",
    )
    packed = torch.randn(T, 16, generator=g)
    right, left = torch.zeros(len(lengths), L, 16), torch.zeros(len(lengths), L, 16)
    for b, (s, n) in enumerate(zip(batch.cu_seqlens[:-1].tolist(), lengths)):
        right[b, :n], left[b, L - n :] = packed[s : s + n], packed[s : s + n]
    return batch, packed, right, left


@settings(max_examples=25, deadline=None)
@given(case=_padded_batches())
def test_padded_hidden_scores_the_packed_rows(case):
    """Left or right padded, named: bitwise the packed result. Unnamed: refused, never guessed."""
    batch, packed, right, left = case
    expected = selected_logprob(packed, W, batch)
    assert torch.equal(selected_logprob(right, W, batch, padding="right"), expected)
    assert torch.equal(selected_logprob(left, W, batch, padding="left"), expected)
    with pytest.raises(ValueError, match="pass padding='right'"):
        selected_logprob(left, W, batch)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), V=st.integers(1, 40), data=st.data())
def test_a_target_outside_the_vocabulary_is_named(n, V, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    targets = torch.randint(0, V, (n,), generator=g)
    i = data.draw(st.integers(0, n - 1))
    token = data.draw(st.one_of(st.integers(V, V + 5), st.integers(-200, -1)))
    targets[i] = token
    with pytest.raises(ValueError,
                       match=rf"targets\[{i}\] = {token} is out of range: there are {V} vocabulary entries"):
        selected_logprob(torch.randn(n, 8), torch.randn(V, 8), index=torch.arange(n), targets=targets)

