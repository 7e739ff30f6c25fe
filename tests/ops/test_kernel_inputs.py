"""Bad and unusual inputs to the batch-invariant kernels (batch_invariant, matmul, rms_norm, segment and varlen
attention, the shared input linears), and a property: every broken attention segment is refused."""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm.ops import batch_invariant
from rlk_mm.ops.invariant import attention as A
from rlk_mm.ops.invariant import matmul as M
from rlk_mm.ops.invariant import rmsnorm as N
from support.context_cases import (
    Case,
    Raises,
    Returns,
    assert_well,
    fail,
    same,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _seg(*rows):
    return tuple(torch.tensor(r, dtype=torch.int32) for r in rows)


@contextlib.contextmanager
def _env(name: str, value: str):
    """``os.environ[name] = value`` inside the block, the old value (or none) after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _no_interpreter_matmul(c):
    with _env("TRITON_INTERPRET", "0"), batch_invariant(backend="triton"):
        return M.matmul(torch.ones(2, 3), torch.ones(3, 2))


def _env_backend(c):
    with _env("RLK_MM_BACKEND", "cuda"), batch_invariant():
        pass


BAD = [
    # ---------------------------------------------------------------- batch_invariant(backend)
    Case("batch_invariant.backend.word", lambda c: batch_invariant(backend="cuda").__enter__(),
         Raises(ValueError, r"backend must be None, 'torch' or 'triton'")),
    Case("batch_invariant.backend.int", lambda c: batch_invariant(backend=1).__enter__(),
         Raises(ValueError, r"backend must be None, 'torch' or 'triton'")),
    Case("batch_invariant.backend.env", _env_backend, Raises(ValueError, r"RLK_MM_BACKEND='cuda'")),
    Case("batch_invariant.triton.no_interpreter", _no_interpreter_matmul,
         Raises((ValueError, RuntimeError), r"TRITON_INTERPRET=1")),
    # ---------------------------------------------------------------- matmul / shared_input_linears
    Case("matmul.a.list", lambda c: M.matmul([[1.0]], torch.ones(1, 1)),
         Raises(TypeError, r"a must be a torch\.Tensor")),
    Case("matmul.b.none", lambda c: M.matmul(torch.ones(1, 1), None), Raises(TypeError, r"b must be a torch\.Tensor")),
    Case("matmul.a.1d", lambda c: M.matmul(torch.ones(3), torch.ones(3, 2)),
         Raises(ValueError, r"matmul: expected two 2-D or two 3-D")),
    Case("matmul.shapes", lambda c: M.matmul(torch.ones(3, 4), torch.ones(5, 2)),
         Raises(ValueError, r"cannot be multiplied")),
    Case("matmul.dtypes", lambda c: M.matmul(torch.ones(3, 4), torch.ones(4, 2).double()),
         Raises(ValueError, r"one dtype")),
    Case("matmul.bool", lambda c: M.matmul(torch.ones(3, 4, dtype=torch.bool), torch.ones(4, 2, dtype=torch.bool)),
         Raises(TypeError, r"matmul: .*bool")),
    Case("matmul.bias.shape", lambda c: M.matmul(torch.ones(3, 4), torch.ones(4, 5), torch.ones(6)),
         Raises(ValueError, r"bias of shape \(6,\) does not broadcast to the output \(3, 5\)")),
    Case("matmul.bias.list", lambda c: M.matmul(torch.ones(3, 4), torch.ones(4, 5), [0.0] * 5),
         Raises(TypeError, r"bias must be a torch\.Tensor")),
    Case("matmul.bias.dtype", lambda c: M.matmul(torch.ones(3, 4), torch.ones(4, 5), torch.ones(5).double()),
         Raises(ValueError, r"bias is torch.float64 but a and b are torch.float32")),
    Case("matmul.alpha.nan", lambda c: M.matmul(torch.ones(3, 4), torch.ones(4, 5), alpha=math.nan),
         Raises(ValueError, r"alpha=nan must be a finite")),
    Case("matmul.beta.str", lambda c: M.matmul(torch.ones(3, 4), torch.ones(4, 5), beta="1"),
         Raises(TypeError, r"beta must be a number")),
    Case("shared_input_linears.x.list", lambda c: M.shared_input_linears([1.0], [torch.nn.Linear(1, 1)]),
         Raises(TypeError, r"x must be a torch\.Tensor")),
    Case("shared_input_linears.layers.empty", lambda c: M.shared_input_linears(torch.ones(2, 4), []),
         Raises(ValueError, r"layers must hold 1 to 3")),
    Case("shared_input_linears.layers.one", lambda c: M.shared_input_linears(torch.ones(2, 4), torch.nn.Linear(4, 2)),
         Raises(TypeError, r"layers must be a list")),
    Case("shared_input_linears.layers.conv",
         lambda c: M.shared_input_linears(torch.ones(2, 4), [torch.nn.Linear(4, 2), torch.nn.Conv1d(4, 2, 1)]),
         Raises(TypeError, r"layers\[1\] must be a torch\.nn\.Linear")),
    Case("shared_input_linears.features", lambda c: M.shared_input_linears(torch.ones(2, 4), [torch.nn.Linear(3, 2)]),
         Raises(ValueError, r"layers\[0\] takes 3 input features but x has 4")),
    # ---------------------------------------------------------------- rms_norm(x, weight, eps)
    Case("rms_norm.x.list", lambda c: N.rms_norm([1.0], torch.ones(1), 1e-6),
         Raises(TypeError, r"x must be a torch\.Tensor")),
    Case("rms_norm.x.0d", lambda c: N.rms_norm(torch.tensor(1.0), torch.ones(1), 1e-6),
         Raises(ValueError, r"x must be .*\[\.\.\., H\]")),
    Case("rms_norm.x.int", lambda c: N.rms_norm(torch.ones(2, 3, dtype=torch.long), torch.ones(3), 1e-6),
         Raises(TypeError, r"x must be float")),
    Case("rms_norm.weight.shape", lambda c: N.rms_norm(torch.ones(2, 3), torch.ones(4), 1e-6),
         Raises(ValueError, r"rms_norm: weight shape \(4,\)")),
    Case("rms_norm.weight.none", lambda c: N.rms_norm(torch.ones(2, 3), None, 1e-6),
         Raises(TypeError, r"weight must be a torch\.Tensor")),
    Case("rms_norm.eps.negative", lambda c: N.rms_norm(torch.ones(2, 3), torch.ones(3), -1.0),
         Raises(ValueError, r"eps=-1.0 is out of range")),
    Case("rms_norm.eps.nan", lambda c: N.rms_norm(torch.ones(2, 3), torch.ones(3), math.nan),
         Raises(ValueError, r"eps=nan must be a finite")),
    Case("rms_norm.eps.str", lambda c: N.rms_norm(torch.ones(2, 3), torch.ones(3), "1e-6"),
         Raises(TypeError, r"eps must be a number")),
    # ---------------------------------------------------------------- segment_attention / varlen_attention
    Case("segment_attention.q.3d",
         lambda c: A.segment_attention(c.qkv[0][0], *c.qkv[1:], c.segments, causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"q must be \[B, Hq, Lq, D\]")),
    Case("segment_attention.kv.shapes",
         lambda c: A.segment_attention(c.qkv[0], c.qkv[1], c.qkv[2][..., :4], c.segments, causal=True, scale=1.0,
                                       max_q=9),
         Raises(ValueError, r"k and v must have one shape")),
    Case("segment_attention.heads",
         lambda c: A.segment_attention(c.qkv[0][:, :1], c.qkv[0], c.qkv[0], c.segments, causal=True, scale=1.0,
                                       max_q=9),
         Raises(ValueError, r"1 query heads is not a multiple of 2 key/value heads")),
    Case("segment_attention.dtypes",
         lambda c: A.segment_attention(c.qkv[0], c.qkv[1].double(), c.qkv[2], c.segments, causal=True, scale=1.0,
                                       max_q=9),
         Raises(ValueError, r"q, k and v must share one dtype")),
    Case("segment_attention.segments.four",
         lambda c: A.segment_attention(*c.qkv, c.segments[:4], causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"segments must be 5 tensors")),
    Case("segment_attention.segments.float",
         lambda c: A.segment_attention(*c.qkv, (c.segments[0], c.segments[1].float(), *c.segments[2:]), causal=True,
                                       scale=1.0, max_q=9),
         Raises(TypeError, r"segments\[1\] must be int32")),
    Case("segment_attention.segments.lengths",
         lambda c: A.segment_attention(*c.qkv, _seg([0, 0], [0], [9], [0], [9]), causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"segments\[1\] has 1 entries but segments\[0\] has 2")),
    Case("segment_attention.segments.q_range",
         lambda c: A.segment_attention(*c.qkv, _seg([0], [0], [12], [0], [12]), causal=True, scale=1.0, max_q=12),
         Raises(ValueError, r"segment 0: queries \[0, 12\) .* Lq = 9")),
    Case("segment_attention.segments.batch",
         lambda c: A.segment_attention(*c.qkv, _seg([1], [0], [9], [0], [9]), causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"segment 0: batch row 1 .* B = 1")),
    Case("segment_attention.segments.negative",
         lambda c: A.segment_attention(*c.qkv, _seg([0], [0], [-2], [0], [9]), causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"segment 0: .*negative")),
    Case("segment_attention.segments.overlap",
         lambda c: A.segment_attention(*c.qkv, _seg([0, 0], [0, 3], [5, 6], [0, 0], [5, 9]), causal=False, scale=1.0,
                                       max_q=6),
         Raises(ValueError, r"segments 0 and 1 overlap")),
    Case("segment_attention.segments.no_keys",
         lambda c: A.segment_attention(*c.qkv, _seg([0], [0], [9], [0], [4]), causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"segment 0: 9 causal queries over 4 keys")),
    Case("segment_attention.max_q", lambda c: A.segment_attention(*c.qkv, c.segments, causal=True, scale=1.0, max_q=4),
         Raises(ValueError, r"max_q=4 is less than segment 0's 9 queries")),
    Case("segment_attention.scale.nan",
         lambda c: A.segment_attention(*c.qkv, c.segments, causal=True, scale=math.nan,
                                       max_q=9), Raises(ValueError, r"scale=nan must be a finite")),
    Case("segment_attention.scale.zero",
         lambda c: A.segment_attention(*c.qkv, c.segments, causal=True, scale=0.0,
                                       max_q=9), Raises(ValueError, r"scale=0.0 is out of range")),
    Case("segment_attention.causal.str",
         lambda c: A.segment_attention(*c.qkv, c.segments, causal="yes", scale=1.0,
                                       max_q=9), Raises(TypeError, r"causal must be True or False")),
    Case("varlen_attention.q.4d",
         lambda c: A.varlen_attention(c.qkv[0], c.qkv[0], c.qkv[0], torch.tensor([0, 2], dtype=torch.int32)),
         Raises(ValueError, r"q must be \[T, Hq, D\]")),
    Case("varlen_attention.cu.float",
         lambda c: A.varlen_attention(*(t[0].transpose(0, 1) for t in c.qkv), torch.tensor([0.0, 4.5, 9.0])),
         Raises(TypeError, r"cu_seqlens_q must be .*int")),
    Case("varlen_attention.cu.list", lambda c: A.varlen_attention(*(t[0].transpose(0, 1) for t in c.qkv), [0, 9]),
         Raises(TypeError, r"cu_seqlens_q must be a torch\.Tensor")),
    Case("varlen_attention.cu.end",
         lambda c: A.varlen_attention(*(t[0].transpose(0, 1) for t in c.qkv),
                                      torch.tensor([0, 3, 7], dtype=torch.int32)),
         Raises(ValueError, r"cu_seqlens_q ends at 7 but q has 9 rows")),
    Case("varlen_attention.cu.beyond",
         lambda c: A.varlen_attention(*(t[0].transpose(0, 1) for t in c.qkv),
                                      torch.tensor([0, 3, 12], dtype=torch.int32)),
         Raises(ValueError, r"cu_seqlens_q ends at 12 but q has 9 rows")),
    Case("varlen_attention.cu_k.missing",
         lambda c: A.varlen_attention(c.qkv[0][0].transpose(0, 1), *(t[0, :, :5].transpose(0, 1) for t in c.qkv[1:]),
                                      torch.tensor([0, 9], dtype=torch.int32)),
         Raises(ValueError, r"cu_seqlens_k ends at 9 but k has 5 rows")),
    Case("varlen_attention.cu.start",
         lambda c: A.varlen_attention(*(t[0].transpose(0, 1) for t in c.qkv), torch.tensor([1, 9], dtype=torch.int32)),
         Raises(ValueError, r"cu_seqlens_q must start at 0")),
    Case("varlen_attention.causal.few_keys",
         lambda c: A.varlen_attention(c.qkv[0][0].transpose(0, 1), *(t[0, :, :5].transpose(0, 1) for t in c.qkv[1:]),
                                      torch.tensor([0, 9], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)),
         Raises(ValueError, r"segment 0: 9 causal queries over 5 keys")),
    Case("varlen_attention.scale.nan",
         lambda c: A.varlen_attention(*(t[0].transpose(0, 1) for t in c.qkv), torch.tensor([0, 9], dtype=torch.int32),
                                      scale=math.nan),
         Raises(ValueError, r"scale=nan must be a finite")),
]


GOOD = [
    Case("matmul.empty_k", lambda c: M.matmul(torch.ones(3, 0), torch.ones(0, 2), torch.ones(2)),
         Returns(same(torch.ones(3, 2)))),
    Case("matmul.nan_row", lambda c: M.matmul(torch.tensor([[math.nan, 1.0], [1.0, 2.0]]), torch.ones(2, 2)),
         Returns(lambda r, c: bool(r[0].isnan().all()) and r[1].tolist() == [3.0, 3.0] or fail(r))),
    Case("segment_attention.uncovered_rows_zero",
         lambda c: A.segment_attention(*c.qkv, _seg([0], [2], [3], [0], [5]), causal=True, scale=1.0, max_q=3),
         Returns(lambda r, c: bool((r[0, :2] == 0).all() and (r[0, 5:] == 0).all()) or fail(r))),
]


@pytest.mark.parametrize("case", BAD + GOOD, ids=lambda case: case.id)
def test_input(case, input_context):
    assert_well(case, input_context)


SETTINGS = dict(deadline=None, max_examples=40)


@settings(**SETTINGS)
@given(st.lists(st.tuples(st.integers(-1, 2), *[st.integers(-1, 9)] * 4), min_size=1, max_size=3), st.booleans(),
       st.integers(0, 10))
def test_segment_attention_refuses_every_broken_segment(rows, causal, max_q):
    """Random segments over q [2, 2, 8, 8], k/v [2, 1, 8, 8]: refused exactly when a segment
    leaves q or k, is negative, exceeds max_q, lacks keys or overlaps another."""
    q = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    k = q[:, :1]
    b, q0, ql, k0, kl = (list(c) for c in zip(*rows))
    n = len(rows)
    covered = [(b[i], r) for i in range(n) if ql[i] > 0 for r in range(q0[i], q0[i] + ql[i])]
    broken = (any(min(r) < 0 for r in rows)
              or any(b[i] >= 2 or q0[i] + ql[i] > 8 or k0[i] + kl[i] > 8 or ql[i] > max_q for i in range(n))
              or any((kl[i] < ql[i]) if causal else (ql[i] > 0 and kl[i] == 0) for i in range(n))
              or len(covered) != len(set(covered)))
    segments = _seg(b, q0, ql, k0, kl)
    if broken:
        with pytest.raises(ValueError, match="segment"):
            A.segment_attention(q, k, k, segments, causal=causal, scale=0.3, max_q=max_q)
    else:
        out = A.segment_attention(q, k, k, segments, causal=causal, scale=0.3, max_q=max_q)
        assert bool(torch.isfinite(out).all())
        written = torch.zeros(2, 8, dtype=torch.bool)
        for bb, r in covered:
            written[bb, r] = True
        assert bool((out[~written] == 0).all())  # rows of no segment stay zero

