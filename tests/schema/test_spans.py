"""Span algebra and span tables: properties checked against plain position sets."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm.schema import (
    SchemaError,
    Span,
    SpanTable,
    complement,
    intersect,
    mask_from_spans,
    normalize,
    spans_from_mask,
    subtract,
    union,
)

LENGTH = 40


@st.composite
def span_lists(draw, length=LENGTH):
    n = draw(st.integers(0, 6))
    out = []
    for _ in range(n):
        a = draw(st.integers(0, length))
        b = draw(st.integers(a, length))
        out.append(Span(a, b))
    return out


def positions(spans):
    return {p for s in spans for p in range(s.start, s.end)}


def is_normal(spans):
    return all(len(s) > 0 for s in spans) and all(a.end < b.start for a, b in zip(spans, spans[1:]))


@settings(max_examples=200, deadline=None)
@given(span_lists(), span_lists())
def test_algebra_matches_sets(a, b):
    assert positions(union(a, b)) == positions(a) | positions(b)
    assert positions(intersect(a, b)) == positions(a) & positions(b)
    assert positions(subtract(a, b)) == positions(a) - positions(b)
    assert positions(complement(a, LENGTH)) == set(range(LENGTH)) - positions(a)
    for result in (union(a, b), intersect(a, b), subtract(a, b), complement(a, LENGTH), normalize(a)):
        assert is_normal(result)


@settings(max_examples=100, deadline=None)
@given(span_lists())
def test_mask_round_trip(spans):
    mask = mask_from_spans(spans, LENGTH)
    assert set(torch.nonzero(mask).flatten().tolist()) == positions(spans)
    assert spans_from_mask(mask) == normalize(spans)


@st.composite
def tables(draw):
    samples = draw(st.lists(span_lists(), min_size=0, max_size=5))
    return [normalize(s) for s in samples]


@settings(max_examples=100, deadline=None)
@given(tables())
def test_table_views(per_sample):
    table = SpanTable.from_lists(per_sample)
    assert table.num_samples == len(per_sample)
    assert table.to_lists() == per_sample
    sample, pos, span_id = table.token_positions()
    expected = [(b, p) for b, spans in enumerate(per_sample) for s in spans for p in range(s.start, s.end)]
    assert list(zip(sample.tolist(), pos.tolist())) == expected
    assert table.token_counts().tolist() == [len(positions(s)) for s in per_sample]
    restored = SpanTable.from_tensors(table.tensors("x"), "x")
    assert restored == table
    if per_sample:
        picked = list(reversed(range(len(per_sample))))
        assert table.select(picked).to_lists() == [per_sample[i] for i in picked]


def test_span_rejects_bad_range():
    for args in ((-1, 2), (5, 3)):
        try:
            Span(*args)
        except SchemaError as e:
            assert "half-open" in str(e)
        else:
            raise AssertionError(f"Span{args} was accepted")


def test_table_rejects_bad_pointer():
    try:
        SpanTable([0], [1], [0, 2])
    except SchemaError as e:
        assert "sample_ptr" in str(e)
    else:
        raise AssertionError("inconsistent sample_ptr accepted")
