"""Bad and unusual inputs to the parity checks (check_layout_parity, compare_logprobs, invariance_sweep,
InvarianceReport), and a property: compare_logprobs reads only the response columns of padded log-probs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm import RLBatch
from rlk_mm.parity import LOGPROB_MAX_ABS, check_layout_parity, compare_logprobs
from rlk_mm.parity.invariance import invariance_sweep
from rlk_mm.parity.invariance_report import InvarianceReport
from support.context_cases import (
    Case,
    Raises,
    Returns,
    assert_well,
    fail,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _report(**changes):
    def make(c):
        data = {**c.report, "results": [dict(c.report["results"][0])]}
        for key, value in changes.items():
            if value is _DROP:
                del data["results"][0][key]
            else:
                data["results"][0][key] = value
        return InvarianceReport.from_dict(data)

    return make


_DROP = object()


def _padded_logprobs(batch: RLBatch, flat: torch.Tensor, R: int, pad=float("nan")) -> torch.Tensor:
    """The [B, R] right-padded response layout of flat loss-token log-probs."""
    sample, pos, _ = batch.loss_spans.token_positions()
    out = torch.full((batch.num_samples, R), pad, dtype=flat.dtype)
    out[sample, pos - batch.prompt_lengths[sample]] = flat
    return out


def _sweep(c, **kw):
    args = dict(cases=["packed"], control=False, probe=False, response_length=2, group_size=1, backend="torch")
    return invariance_sweep(c.model, c.processor, c.samples, **{**args, **kw})


def _nan_at_final_norm(c):
    model = c.other_model
    handle = model.model.language_model.norm.register_forward_hook(lambda m, a, out: out * float("nan"))
    try:
        return invariance_sweep(model, c.processor, c.samples, cases=["packed"], control=False, probe=False,
                                response_length=2, backend="torch")
    finally:
        handle.remove()


def _without_prompt_lengths(batch: RLBatch) -> RLBatch:
    return RLBatch(**{**dict(batch), "prompt_lengths": None})


def _check_compare(expect_ok: bool, expect_max: float):
    def check(result, c):
        assert result.ok is expect_ok and result.max_abs == expect_max, str(result)

    return check


def _check_padded_compare(result, c):
    flat = compare_logprobs(c.logp, c.logp + 1e-3, c.training, c.training)
    assert result.to_dict() == flat.to_dict(), f"{result} != {flat}"


BAD = [
    # ---------------------------------------------------------------- check_layout_parity / compare_logprobs
    Case("check_layout_parity.rollout.none", lambda c: check_layout_parity(None, c.training),
         Raises(TypeError, r"rollout must be an RLBatch")),
    Case("check_layout_parity.training.dict", lambda c: check_layout_parity(c.training, {}),
         Raises(TypeError, r"training must be an RLBatch")),
    Case("check_layout_parity.tokenizer.str", lambda c: check_layout_parity(c.drift, c.training, tokenizer="qwen"),
         Raises(TypeError, r"tokenizer must have a decode")),
    Case("compare_logprobs.padded.no_prompt_lengths",
         lambda c: compare_logprobs(*[_padded_logprobs(c.training, c.logp, 8)] * 2,
                                    *[_without_prompt_lengths(c.training)] * 2),
         Raises(ValueError, r"rollout_logprobs: a \[B, R\] tensor needs the batch's prompt_lengths")),
    Case("compare_logprobs.padded.columns",
         lambda c: compare_logprobs(_padded_logprobs(c.training, c.logp, 8)[:, :2], c.logp, c.training, c.training),
         Raises(ValueError, r"rollout_logprobs has 2 response columns; loss tokens reach column 5")),
    Case("compare_logprobs.padded.rows",
         lambda c: compare_logprobs(_padded_logprobs(c.training, c.logp, 8)[:1], c.logp, c.training, c.training),
         Raises(ValueError, r"rollout_logprobs has 1 rows; the batch has 2 samples")),
    Case("compare_logprobs.int", lambda c: compare_logprobs(c.logp.long(), c.logp, c.training, c.training),
         Raises(TypeError, r"rollout_logprobs must be float")),
    Case("compare_logprobs.list", lambda c: compare_logprobs(c.logp.tolist(), c.logp, c.training, c.training),
         Raises(TypeError, r"rollout_logprobs must be a torch\.Tensor")),
    Case("compare_logprobs.count", lambda c: compare_logprobs(c.logp, c.logp[:5], c.training, c.training),
         Raises(ValueError, r"training_logprobs has 5 values; the batch has 9 loss tokens")),
    Case("compare_logprobs.3d", lambda c: compare_logprobs(c.logp[None, None], c.logp, c.training, c.training),
         Raises(ValueError, r"expected \[n loss tokens\] or \[B, R\]")),
    Case("compare_logprobs.nan",
         lambda c: compare_logprobs(c.logp, torch.where(torch.arange(c.n) == 2, math.nan, c.logp), c.training,
                                    c.training),
         Raises(ValueError, r"training_logprobs: sample 0, position 50 is nan")),
    Case("compare_logprobs.probabilities", lambda c: compare_logprobs(c.logp.exp(), c.logp, c.training, c.training),
         Raises(ValueError, r"rollout_logprobs: sample 0, position 48 is 0\.\d+ > 0.*log-probabilities")),
    Case("compare_logprobs.dtype.str",
         lambda c: compare_logprobs(c.logp, c.logp, c.training, c.training,
                                    dtype="float32"), Raises(TypeError, r"dtype must be a torch floating dtype")),
    Case("compare_logprobs.dtype.int",
         lambda c: compare_logprobs(c.logp, c.logp, c.training, c.training,
                                    dtype=torch.int64), Raises(TypeError, r"dtype must be a torch floating dtype")),
    Case("compare_logprobs.tolerance.negative",
         lambda c: compare_logprobs(c.logp, c.logp, c.training, c.training,
                                    tolerance=-1.0), Raises(ValueError, r"tolerance=-1.0 is out of range")),
    Case("compare_logprobs.tolerance.nan",
         lambda c: compare_logprobs(c.logp, c.logp, c.training, c.training,
                                    tolerance=math.nan), Raises(ValueError, r"tolerance=nan must be a finite")),
    Case("compare_logprobs.tolerance.str",
         lambda c: compare_logprobs(c.logp, c.logp, c.training, c.training,
                                    tolerance="0.1"), Raises(TypeError, r"tolerance must be a number")),
    Case("compare_logprobs.meta", lambda c: compare_logprobs(c.logp.to("meta"), c.logp, c.training, c.training),
         Raises(ValueError, r"rollout_logprobs is on the meta device.*CPU or CUDA tensor")),
    Case("Tolerance.for_dtype.str", lambda c: LOGPROB_MAX_ABS.for_dtype("bf16"),
         Raises(TypeError, r"dtype must be a torch floating dtype.*got 'bf16'")),
    Case("Tolerance.for_dtype.int", lambda c: LOGPROB_MAX_ABS.for_dtype(torch.int32),
         Raises(TypeError, r"dtype must be a torch floating dtype.*torch\.int32")),
    Case("compare_logprobs.rollout.none", lambda c: compare_logprobs(c.logp, c.logp, None, c.training),
         Raises(TypeError, r"rollout must be an RLBatch")),
    # ---------------------------------------------------------------- invariance_sweep
    Case("invariance_sweep.cases.str", lambda c: _sweep(c, cases="packed"),
         Raises(TypeError, r"cases must be a list of case names")),
    Case("invariance_sweep.cases.empty", lambda c: _sweep(c, cases=[]), Raises(ValueError, r"cases is empty")),
    Case("invariance_sweep.response_length.zero", lambda c: _sweep(c, response_length=0),
         Raises(ValueError, r"response_length=0 is out of range")),
    Case("invariance_sweep.response_length.bool", lambda c: _sweep(c, response_length=True),
         Raises(TypeError, r"response_length must be an int")),
    Case("invariance_sweep.group_size.zero", lambda c: _sweep(c, cases=["group_cache"], group_size=0),
         Raises(ValueError, r"group_size=0 is out of range")),
    Case("invariance_sweep.samples.no_images",
         lambda c: invariance_sweep(c.model, c.processor, c.text_samples, cases=["neighbour_images"]),
         Raises(ValueError, r"neighbour_images needs samples with images")),
    Case("invariance_sweep.samples.str", lambda c: invariance_sweep(c.model, c.processor, "ab"),
         Raises(TypeError, r"samples must be a list")),
    Case("invariance_sweep.samples.dicts", lambda c: invariance_sweep(c.model, c.processor, [{}, {}]),
         Raises(TypeError, r"samples\[0\] .*messages")),
    Case("invariance_sweep.samples.one", lambda c: invariance_sweep(c.model, c.processor, c.samples[:1]),
         Raises(ValueError, r"at least 2 samples")),
    Case("invariance_sweep.backend", lambda c: _sweep(c, backend="cuda"),
         Raises(ValueError, r"backend must be None, 'torch' or 'triton'")),
    Case("invariance_sweep.control.str", lambda c: _sweep(c, control="no"),
         Raises(TypeError, r"control must be True or False")),
    Case("invariance_sweep.probe.int", lambda c: _sweep(c, probe=1), Raises(TypeError, r"probe must be True or False")),
    Case("invariance_sweep.seed.float", lambda c: _sweep(c, seed=1.5), Raises(TypeError, r"seed must be an int")),
    Case("invariance_sweep.score", lambda c: _sweep(c, score="logits"),
         Raises(ValueError, r"score must be 'logprob' or 'hidden', got 'logits'")),
    Case("invariance_sweep.model.none", lambda c: invariance_sweep(None, c.processor, c.samples),
         Raises(TypeError, r"model \w+ is not a supported model family")),
    Case("invariance_sweep.processor.none", lambda c: invariance_sweep(c.model, None, c.samples),
         Raises(TypeError, r"processor must be the model's Qwen2\.5-VL processor")),
    Case("invariance_sweep.non_finite_scores", _nan_at_final_norm,
         Raises(ValueError, r"run 'right'.* sample 0, .*not finite")),
    # ---------------------------------------------------------------- InvarianceReport
    Case("InvarianceReport.from_dict.list", lambda c: InvarianceReport.from_dict([]),
         Raises(TypeError, r"data must be a dict")),
    Case("InvarianceReport.from_dict.no_results", lambda c: InvarianceReport.from_dict({}),
         Raises(ValueError, r"data has no 'results' list")),
    Case("InvarianceReport.from_dict.empty", lambda c: InvarianceReport.from_dict({"results": []}),
         Raises(ValueError, r"data\['results'\] is empty")),
    Case("InvarianceReport.save_png.empty", lambda c: InvarianceReport([], {}).save_png(c.tmp / "empty_report.png"),
         Raises(ValueError, r"no results to draw")),
    Case("InvarianceReport.from_dict.missing", _report(mode=_DROP),
         Raises(ValueError, r"results\[0\] is missing 'mode'")),
    Case("InvarianceReport.from_dict.unknown", _report(colour="red"),
         Raises(ValueError, r"results\[0\] has unknown field 'colour'")),
    Case("InvarianceReport.from_dict.diff", _report(max_abs_diff="x"),
         Raises(TypeError, r"results\[0\]\.max_abs_diff must be a number")),
    Case("InvarianceReport.from_dict.diff_nan", _report(max_abs_diff=math.nan),
         Raises(ValueError, r"results\[0\]\.max_abs_diff=nan")),
    Case("InvarianceReport.from_dict.mode", _report(mode="fast"), Raises(ValueError, r"results\[0\]\.mode='fast'")),
    Case("InvarianceReport.from_dict.bitwise", _report(bitwise="yes"),
         Raises(TypeError, r"results\[0\]\.bitwise must be True or False")),
    Case("InvarianceReport.from_dict.tokens", _report(tokens=-1),
         Raises(ValueError, r"results\[0\]\.tokens=-1 is out of range")),
    Case("InvarianceReport.from_dict.divergence", _report(divergence={"module": "x"}),
         Raises(ValueError, r"results\[0\]\.divergence is missing 'sample'")),
    Case("InvarianceReport.save_json.dir",
         lambda c: InvarianceReport.from_dict(c.report).save_json(c.tmp / "no_such_dir" / "r.json"),
         Raises(FileNotFoundError, r"no_such_dir")),
]


GOOD = [
    Case("compare_logprobs.padded",
         lambda c: compare_logprobs(_padded_logprobs(c.training, c.logp, 8),
                                    _padded_logprobs(c.training, c.logp + 1e-3, 9),
                                                               c.training, c.training), Returns(_check_padded_compare)),
    Case("compare_logprobs.padded_vs_flat",
         lambda c: compare_logprobs(_padded_logprobs(c.training, c.logp, 6), c.logp, c.training, c.training),
         Returns(_check_compare(True, 0.0))),
    Case("compare_logprobs.both_minus_inf",
         lambda c: compare_logprobs(*[torch.where(torch.arange(c.n) == 3, -math.inf, c.logp)] * 2, c.training,
                                    c.training),
         Returns(_check_compare(True, 0.0))),
    Case("compare_logprobs.one_minus_inf",
         lambda c: compare_logprobs(torch.where(torch.arange(c.n) == 3, -math.inf, c.logp), c.logp, c.training,
                                    c.training),
         Returns(lambda r, c: (not r.ok and r.first_beyond["position"] == 51 and r.max_abs == math.inf) or fail(r))),
    Case("InvarianceReport.empty.invariant", lambda c: InvarianceReport([], {}).invariant,
         Returns(lambda r, c: r is False or fail(r))),
]


@pytest.mark.parametrize("case", BAD + GOOD, ids=lambda case: case.id)
def test_input(case, input_context):
    assert_well(case, input_context)


SETTINGS = dict(deadline=None, max_examples=40)


@settings(**SETTINGS)
@given(st.integers(6, 9), st.sampled_from([0.0, math.nan, math.inf, -math.inf, 7.0]), st.data())
def test_compare_logprobs_reads_only_the_response_columns(input_context, R, pad, data):
    """Padded [B, R] log-probs give the flat comparison whatever the padding holds."""
    drift = torch.tensor(data.draw(st.lists(st.floats(-0.1, 0.0), min_size=input_context.n, max_size=input_context.n)),
                         dtype=torch.float64)
    other = input_context.logp + drift
    padded = compare_logprobs(_padded_logprobs(input_context.training, input_context.logp, R, pad),
                              _padded_logprobs(input_context.training, other, 9, pad),
                              input_context.training, input_context.training)
    assert padded.to_dict() == compare_logprobs(input_context.logp, other, input_context.training,
                                                input_context.training).to_dict()
