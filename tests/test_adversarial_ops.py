"""Adversarial inputs to every public function of the ops and the integrations (issue 17).

Each table row is one input a user can give: a wrong type, shape or dtype, an empty or
non-finite value, a value out of range, fields that disagree, an ambiguous layout. A bad
input must raise the expected error with a message that names the argument (for values:
the sample and the position) and says what to change; an unusual but valid input must give
its documented result. ``outcome`` sorts what happened into the issue's classes: ``well``,
``silent`` (a result where an error was due, or a wrong result), ``crash`` (an error raised
outside rlk_mm's own checks: torch's or Python's) and ``unclear`` (rlk_mm's own error, but
not the expected one). ``python tests/test_adversarial_ops.py`` prints the tally. The
hypothesis tests check the same classes over generated inputs.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import use_backend
from rlk_mm.integrations import easyr1
from rlk_mm.integrations.verl_fused import FusedLinearForPPO, enable, scoring
from rlk_mm.ops.logprob import MIN_TEMPERATURE
from rlk_mm.ops import (
    SpanReward, agg_loss, group_advantages, kl_penalty, overlong_penalty, policy_loss, scatter_rewards, selected_logprob,
)
from rlk_mm.schema import RLBatch, SchemaError
from rlk_mm.schema.spans import Span, SpanTable

RLK_MM = str(Path(__file__).resolve().parents[1] / "rlk_mm")
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


def _raised_by_rlk_mm(e: BaseException) -> bool:
    """Whether ``e`` comes from a ``raise`` in rlk_mm's own code (not from torch or Python)."""
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(RLK_MM) and "raise" in (frames[-1].line or "")


def outcome(case: Case) -> tuple[str, str]:
    """(class, detail): ``well``, ``silent``, ``crash`` or ``unclear``."""
    try:
        result = case.call()
    except Exception as e:  # noqa: BLE001 - sorting every failure is the point
        text = f"{type(e).__name__}: {e}"
        if case.error is not None and isinstance(e, case.error) and re.search(case.match, str(e)):
            return "well", text
        return ("unclear" if _raised_by_rlk_mm(e) else "crash"), text
    if case.error is None and case.check(result):
        return "well", ""
    return "silent", "no error" if case.error is not None else "wrong result"


def _with(t: torch.Tensor, index, value) -> torch.Tensor:
    out = t.clone()
    out[index] = value
    return out


def _finite_scalar(result) -> bool:
    loss = result[0] if isinstance(result, tuple) else result
    return bool(torch.isfinite(loss).all())


# ============================================================================ selected_logprob
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


def _sl(**kw):
    args = dict(hidden=H, weight=W, index=IDX, targets=TGT)
    args.update(kw)
    return lambda: selected_logprob(**args)


def _same_as_packed(result) -> bool:
    return torch.equal(result, selected_logprob(PACKED, W, BATCH))


def _selected_logprob_cases() -> list[Case]:
    masked_target = _with(BIAS, 2, -INF)
    nan_row = _with(H, 3, NAN)
    return [
        bad("hidden list", _sl(hidden=H.tolist()), TypeError, r"hidden must be a torch.Tensor"),
        bad("hidden 1-D", _sl(hidden=H[0]), ValueError, r"hidden must be \[T, H\] .*or \[B, L, H\]"),
        bad("hidden 4-D", _sl(hidden=H[None, None]), ValueError, r"hidden must be \[T, H\] .*or \[B, L, H\]"),
        bad("hidden int", _sl(hidden=H.long(), weight=W.long()), TypeError, r"hidden and weight must share one of float32"),
        bad("hidden float64", _sl(hidden=H.double(), weight=W.double()), TypeError, r"hidden and weight must share one of float32"),
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
        bad("bias nan", _sl(bias=_with(BIAS, 4, NAN)), ValueError, r"bias\[4\] = nan"),
        bad("bias +inf", _sl(bias=_with(BIAS, 4, INF)), ValueError, r"bias\[4\] = inf"),
        bad("bias all -inf", _sl(bias=torch.full((30,), -INF)), ValueError, r"bias is -inf at every vocabulary entry"),
        bad("target masked by bias", _sl(bias=masked_target), ValueError, r"targets\[1\] = 2 is masked: bias\[2\] = -inf"),
        bad("index missing", _sl(index=None), ValueError, r"both index .* and targets .* are required"),
        bad("targets missing", _sl(targets=None), ValueError, r"both index .* and targets .* are required"),
        bad("index list", _sl(index=[0, 3]), TypeError, r"index must be a torch.Tensor"),
        bad("index int", _sl(index=3, targets=torch.tensor([1])), TypeError, r"index must be a torch.Tensor"),
        bad("index 0-d", _sl(index=torch.tensor(3), targets=torch.tensor([1])), ValueError, r"index must be 1-D"),
        bad("index 2-D", _sl(index=IDX[None]), ValueError, r"index must be 1-D"),
        bad("index float", _sl(index=IDX.float()), TypeError, r"index must be an integer tensor"),
        bad("index bool", _sl(index=torch.tensor([True, False])), TypeError, r"index must be an integer tensor"),
        bad("index out of range", _sl(index=torch.tensor([0, 10])), ValueError, r"index\[1\] = 10 is out of range: there are 10 rows"),
        bad("index negative", _sl(index=torch.tensor([-1, 2])), ValueError, r"index\[0\] = -1 is out of range"),
        bad("targets float", _sl(targets=TGT.float()), TypeError, r"targets must be an integer tensor"),
        bad("targets ignore index", _sl(targets=torch.tensor([-100, 2])), ValueError, r"targets\[0\] = -100 .*ignore index"),
        bad("targets out of vocabulary", _sl(targets=torch.tensor([1, 30])), ValueError, r"targets\[1\] = 30 is out of range: there are 30 vocabulary"),
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
            r"hidden is padded \[B=2, L=6, H\]: a padded length of 6 is shorter than the longest sample \(sample 0, 7 tokens\)"),
        bad("batch, packed with padding", lambda: selected_logprob(PACKED, W, BATCH, padding="right"), ValueError,
            r"padding='right' applies only to \[B, L, H\] hidden states with a batch"),
        bad("index, padded with padding", _sl(hidden=H.view(2, 5, 16), padding="left"), ValueError,
            r"padding='left' applies only to \[B, L, H\] hidden states with a batch"),
        bad("batch token outside vocabulary", lambda: selected_logprob(PACKED, W[:20], BATCH), ValueError,
            r"batch input_ids: sample 1, position 3 holds token 25, which is out of range: there are 20 vocabulary entries"),
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
        ok("-inf bias elsewhere", _sl(bias=_with(BIAS, 7, -INF)), lambda r: bool(torch.isfinite(r).all())),
    ]


# ============================================================================ policy_loss, agg_loss, kl_penalty
LOGP = torch.randn(3, 4, generator=_g) * 0.3 - 1.0
OLD = LOGP + torch.randn(3, 4, generator=_g) * 0.1
ADV = torch.randn(3, 4, generator=_g)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
SAMPLE = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])


def _pl(**kw):
    args = dict(log_probs=LOGP, old_log_probs=OLD, advantages=ADV, mask=MASK)
    args.update(kw)
    return lambda: policy_loss(**args)


def _compact(**kw):
    args = dict(log_probs=LOGP[MASK], old_log_probs=OLD[MASK], advantages=ADV[MASK], sample_index=SAMPLE, num_samples=3)
    args.update(kw)
    return lambda: policy_loss(**args)


def _same_loss(**kw):
    """The result's loss equals ``policy_loss`` on the base inputs with ``kw``."""
    return lambda r: torch.equal(r[0], _pl(**kw)()[0])


def _policy_loss_cases() -> list[Case]:
    return [
        bad("log_probs list", _pl(log_probs=LOGP.tolist()), TypeError, r"log_probs must be a torch.Tensor"),
        bad("log_probs int", _pl(log_probs=LOGP.long()), TypeError, r"log_probs must be float64/float32/float16/bfloat16"),
        bad("log_probs 3-D", _pl(log_probs=LOGP[..., None]), ValueError, r"log_probs has shape \(3, 4, 1\): padded inputs are \[B, R\]"),
        bad("log_probs 1-D without sample_index", _pl(log_probs=LOGP[0]), ValueError, r"padded inputs are \[B, R\]"),
        bad("old_log_probs shape", _pl(old_log_probs=OLD[:, :3]), ValueError, r"old_log_probs has shape \(3, 3\)"),
        bad("old_log_probs list", _pl(old_log_probs=OLD.tolist()), TypeError, r"old_log_probs must be a torch.Tensor"),
        bad("old_log_probs on meta", _pl(old_log_probs=OLD.to("meta")), ValueError, r"old_log_probs is on meta"),
        bad("old_log_probs -inf scored", _pl(old_log_probs=_with(OLD, (0, 1), -INF)), ValueError,
            r"old_log_probs: sample 0, position 1 is -inf"),
        bad("advantages broadcast shape", _pl(advantages=ADV[:, :1]), ValueError, r"advantages has shape \(3, 1\)"),
        bad("advantages int", _pl(advantages=ADV.long()), TypeError, r"advantages must be float"),
        bad("advantages nan scored", _pl(advantages=_with(ADV, (1, 2), NAN)), ValueError, r"advantages: sample 1, position 2 is nan"),
        bad("advantages inf scored", _pl(advantages=_with(ADV, (2, 0), INF)), ValueError, r"advantages: sample 2, position 0 is inf"),
        ok("advantages nan masked", _pl(advantages=_with(ADV, (2, 3), NAN)), _same_loss(advantages=_with(ADV, (2, 3), 0.0))),
        bad("mask shape", _pl(mask=MASK[:2]), ValueError, r"mask has shape \(2, 4\)"),
        bad("mask list", _pl(mask=MASK.tolist()), TypeError, r"mask must be a torch.Tensor"),
        bad("mask on meta", _pl(mask=MASK.to("meta")), ValueError, r"mask is on meta"),
        bad("mask negative weight", _pl(mask=_with(MASK.float(), (2, 0), -1.0)), ValueError,
            r"mask: sample 2, position 0 is -1\.0.*>= 0"),
        bad("mask int 2", _pl(mask=_with(MASK.long(), (0, 3), 2)), ValueError, r"mask: sample 0, position 3 is 2.*0 or 1"),
        bad("mask nan", _pl(mask=_with(MASK.float(), (1, 1), NAN)), ValueError, r"mask: sample 1, position 1 is nan"),
        bad("mask complex", _pl(mask=MASK.to(torch.complex64)), TypeError, r"mask must be bool"),
        ok("mask 0/1 int", _pl(mask=MASK.long()), _same_loss()),
        ok("mask float weights", _pl(mask=MASK.float() * 0.5), _finite_scalar),
        bad("clip_ratio_low negative", _pl(clip_ratio_low=-0.1), ValueError, r"clip_ratio_low=-0\.1 is out of range"),
        bad("clip_ratio_low above 1", _pl(clip_ratio_low=1.5), ValueError, r"clip_ratio_low=1\.5 is out of range"),
        bad("clip_ratio_low nan", _pl(clip_ratio_low=NAN), ValueError, r"clip_ratio_low=nan must be a finite number"),
        bad("clip_ratio_low str", _pl(clip_ratio_low="0.2"), TypeError, r"clip_ratio_low must be a number"),
        bad("clip_ratio_high negative", _pl(clip_ratio_high=-0.2), ValueError, r"clip_ratio_high=-0\.2 is out of range"),
        bad("clip_ratio_high nan", _pl(clip_ratio_high=NAN), ValueError, r"clip_ratio_high=nan"),
        bad("clip_ratio_high beyond float32", _pl(clip_ratio_high=1e39), ValueError, r"clip_ratio_high=1e\+39 is out of range: float32"),
        bad("clip_ratio_c below 1", _pl(clip_ratio_c=0.5), ValueError, r"clip_ratio_c=0\.5: the dual-clip bound must be > 1"),
        bad("clip_ratio_c nan", _pl(clip_ratio_c=NAN), ValueError, r"clip_ratio_c=nan"),
        bad("clip_ratio_c str", _pl(clip_ratio_c="3"), TypeError, r"clip_ratio_c must be a number"),
        bad("ratio", _pl(ratio="seq"), ValueError, r"ratio='seq': expected one of"),
        bad("log_ratio_clamp reversed", _pl(log_ratio_clamp=(5.0, -5.0)), ValueError,
            r"log_ratio_clamp=\(5\.0, -5\.0\): the lower bound must be <= the upper"),
        bad("log_ratio_clamp scalar", _pl(log_ratio_clamp=20.0), TypeError, r"log_ratio_clamp must be a pair"),
        bad("log_ratio_clamp nan", _pl(log_ratio_clamp=(NAN, 1.0)), ValueError, r"log_ratio_clamp\[0\]=nan"),
        bad("rollout_is_weights negative", _pl(rollout_is_weights=_with(torch.ones(3, 4), (0, 0), -0.5)), ValueError,
            r"rollout_is_weights: sample 0, position 0 is -0\.5.*>= 0"),
        bad("rollout_is_weights nan", _pl(rollout_is_weights=_with(torch.ones(3, 4), (1, 3), NAN)), ValueError,
            r"rollout_is_weights: sample 1, position 3 is nan"),
        bad("rollout_is_weights shape", _pl(rollout_is_weights=torch.ones(4)), ValueError, r"rollout_is_weights has shape \(4,\)"),
        bad("rollout_is_weights int", _pl(rollout_is_weights=torch.ones(3, 4, dtype=torch.long)), TypeError,
            r"rollout_is_weights must be float"),
        bad("ref_log_probs nan scored", _pl(ref_log_probs=_with(LOGP, (1, 0), NAN), kl_coef=0.1), ValueError,
            r"ref_log_probs: sample 1, position 0 is nan"),
        bad("ref_log_probs shape", _pl(ref_log_probs=LOGP[0], kl_coef=0.1), ValueError, r"ref_log_probs has shape \(4,\)"),
        bad("kl_coef negative", _pl(ref_log_probs=LOGP, kl_coef=-0.1), ValueError, r"kl_coef=-0\.1 is out of range"),
        bad("kl_coef nan", _pl(ref_log_probs=LOGP, kl_coef=NAN), ValueError, r"kl_coef=nan"),
        bad("kl_coef without ref", _pl(kl_coef=0.1), ValueError, r"kl_coef is set but ref_log_probs is None"),
        bad("kl_type", _pl(ref_log_probs=LOGP, kl_coef=0.1, kl_type="k4"), ValueError, r"kl_type: kl type 'k4' is unknown"),
        bad("kl_type None", _pl(ref_log_probs=LOGP, kl_coef=0.1, kl_type=None), ValueError, r"kl_type: kl type None is unknown"),
        bad("entropy int", _pl(entropy=torch.ones(3, 4, dtype=torch.long), entropy_coeff=0.01), TypeError, r"entropy must be float"),
        bad("entropy_coeff negative", _pl(entropy=torch.ones(3, 4), entropy_coeff=-0.01), ValueError,
            r"entropy_coeff=-0\.01 is out of range"),
        bad("entropy_coeff without entropy", _pl(entropy_coeff=0.01), ValueError, r"entropy_coeff is set but entropy is None"),
        bad("loss_agg_mode", _pl(loss_agg_mode="mean"), ValueError, r"loss_agg_mode='mean'"),
        bad("dp_size 0", _pl(dp_size=0), ValueError, r"dp_size=0 is out of range: it must be >= 1"),
        bad("dp_size negative", _pl(dp_size=-1, loss_agg_mode="token-sum"), ValueError, r"dp_size=-1 is out of range"),
        bad("dp_size float", _pl(dp_size=2.5), TypeError, r"dp_size must be an int"),
        bad("dp_size bool", _pl(dp_size=True), TypeError, r"dp_size must be an int"),
        bad("dp_size > 1 without counts", _pl(dp_size=2), ValueError, r"batch_num_tokens .* is required when dp_size > 1"),
        bad("batch_num_tokens negative", _pl(dp_size=2, batch_num_tokens=-5), ValueError, r"batch_num_tokens=-5\.0 is out of range"),
        bad("batch_num_tokens str", _pl(batch_num_tokens="100"), TypeError, r"batch_num_tokens must be a number"),
        bad("batch_num_tokens tensor negative", _pl(batch_num_tokens=torch.tensor(-5)), ValueError,
            r"batch_num_tokens is -5.*>= 0"),
        bad("batch_num_tokens tensor 1-D", _pl(batch_num_tokens=torch.tensor([5, 6])), ValueError,
            r"batch_num_tokens must be a number or a 0-d tensor"),
        bad("global_batch_size negative", _pl(loss_agg_mode="seq-mean-token-mean", global_batch_size=-2), ValueError,
            r"global_batch_size=-2\.0 is out of range"),
        bad("loss_scale_factor 0", _pl(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=0), ValueError,
            r"loss_scale_factor=0\.0 is out of range: it must be > 0"),
        bad("num_samples without sample_index", _pl(num_samples=3), ValueError, r"num_samples is only for compact inputs"),
        ok("batch_num_tokens as a 0-d tensor", _pl(dp_size=2, batch_num_tokens=torch.tensor(9)),
           _same_loss(dp_size=2, batch_num_tokens=9)),
        bad("compact: num_samples missing", _compact(num_samples=None), ValueError, r"num_samples is required with sample_index"),
        bad("compact: num_samples negative", _compact(num_samples=-1), ValueError, r"num_samples=-1 is out of range"),
        bad("compact: num_samples float", _compact(num_samples=3.0), TypeError, r"num_samples must be an int"),
        bad("compact: sample_index float", _compact(sample_index=SAMPLE.float()), TypeError, r"sample_index must be int64/int32"),
        bad("compact: sample_index shape", _compact(sample_index=SAMPLE[:5]), ValueError, r"sample_index must have shape \[8\]"),
        bad("compact: sample_index list", _compact(sample_index=SAMPLE.tolist()), TypeError, r"sample_index must be a torch.Tensor"),
        bad("compact: sample_index unsorted", _compact(sample_index=SAMPLE.flip(0)), ValueError, r"sample_index\[1\] = 1 follows 2"),
        bad("compact: sample_index out of range", _compact(num_samples=2), ValueError,
            r"sample_index\[7\] = 2 is outside \[0, num_samples=2\)"),
        bad("compact: mask 2-D", _compact(mask=MASK), ValueError, r"mask has shape \(3, 4\)"),
        bad("compact: advantages nan", _compact(advantages=_with(ADV[MASK], 2, NAN)), ValueError,
            r"advantages\[2\] \(sample 0\) is nan"),
        bad("compact: 2-D with sample_index", _compact(log_probs=LOGP), ValueError, r"with sample_index, inputs are compact \[n\]"),
        ok("compact equals padded", _compact(), lambda r: torch.allclose(r[0], _pl()()[0])),
        ok("no samples", _pl(log_probs=LOGP[:0], old_log_probs=OLD[:0], advantages=ADV[:0], mask=MASK[:0]),
           lambda r: r[0].item() == 0),
        ok("fully masked", _pl(mask=torch.zeros_like(MASK)), lambda r: r[0].item() == 0),
        ok("no tokens per sample", _pl(log_probs=LOGP[:, :0], old_log_probs=OLD[:, :0], advantages=ADV[:, :0],
                                       mask=MASK[:, :0], loss_agg_mode="seq-mean-token-sum-norm", ratio="gspo"),
           lambda r: r[0].item() == 0),
        ok("no samples, EasyR1 seq mode", _pl(log_probs=LOGP[:0], old_log_probs=OLD[:0], advantages=ADV[:0], mask=MASK[:0],
                                              loss_agg_mode="seq"), lambda r: r[0].item() == 0),
        ok("log_probs nan masked", _pl(log_probs=_with(LOGP, (2, 2), NAN)), _finite_scalar),
        # documented: non-finite log_probs and entropy (model outputs) at scored positions propagate
        ok("log_probs nan scored propagates", _pl(log_probs=_with(LOGP, (1, 1), NAN)), lambda r: bool(r[0].isnan())),
        ok("entropy nan scored propagates", _pl(entropy=_with(torch.ones(3, 4), (0, 0), NAN), entropy_coeff=0.01),
           lambda r: bool(r[0].isnan())),
        ok("infinite clip_ratio_high", _pl(clip_ratio_high=INF), _finite_scalar),
        # issue 31, D-01: a global count below what this batch shows (8 scored tokens in 3 sequences)
        bad("batch_num_tokens 0 with scored tokens", _pl(batch_num_tokens=0), ValueError,
            r"batch_num_tokens is 0\.0 but this batch alone scores 8 tokens"),
        bad("batch_num_tokens 1 (8x the mean)", _pl(batch_num_tokens=1), ValueError, r"batch_num_tokens is 1\.0 but"),
        bad("batch_num_tokens tensor 0 (was 1/tiny)", _pl(batch_num_tokens=torch.tensor(0)), ValueError,
            r"batch_num_tokens is 0\.0 but"),
        bad("global_batch_size 0", _pl(loss_agg_mode="seq-mean-token-sum", global_batch_size=0), ValueError,
            r"global_batch_size is 0\.0 but this batch alone has 3 sequences"),
        bad("global_batch_size tensor 2", _pl(loss_agg_mode="seq-mean-token-mean", global_batch_size=torch.tensor(2.0)),
            ValueError, r"global_batch_size is 2\.0 but"),
        bad("global_batch_size fractional", _pl(loss_agg_mode="seq-mean-token-mean", global_batch_size=3.5), ValueError,
            r"global_batch_size=3\.5: a count of sequences is a whole number"),
        ok("batch_num_tokens 0 with nothing scored", _pl(mask=torch.zeros_like(MASK), batch_num_tokens=0),
           lambda r: r[0].item() == 0),
        # issue 31, D-02: GSPO with every constant slot filled (compact, mask, KL, IS weights, a seq mode) runs backward
        ok("compact gspo + mask + KL + IS + seq mode: backward", lambda: _backward_runs(
            ratio="gspo_token", loss_agg_mode="seq-mean-token-sum", ref_log_probs=OLD[MASK], kl_coef=0.1,
            rollout_is_weights=torch.ones(8), mask=torch.ones(8, dtype=torch.bool))),
    ]


def _backward_runs(**kw):
    x = LOGP[MASK].clone().requires_grad_()
    loss, _ = policy_loss(x, OLD[MASK], ADV[MASK], sample_index=SAMPLE, num_samples=3, **kw)
    loss.backward()
    return bool(torch.isfinite(x.grad).all())


def _agg_cases() -> list[Case]:
    def agg(**kw):
        args = dict(loss_mat=LOGP, mask=MASK)
        args.update(kw)
        return lambda: agg_loss(**args)

    return [
        bad("loss_mat list", agg(loss_mat=LOGP.tolist()), TypeError, r"loss_mat must be a torch.Tensor"),
        bad("loss_mat int", agg(loss_mat=LOGP.long()), TypeError, r"loss_mat must be float"),
        bad("loss_mat 3-D", agg(loss_mat=LOGP[None]), ValueError, r"loss_mat has shape \(1, 3, 4\): padded inputs are \[B, R\]"),
        bad("mask shape", agg(mask=MASK.T), ValueError, r"mask has shape \(4, 3\)"),
        bad("mask negative", agg(mask=_with(MASK.float(), (1, 2), -2.0)), ValueError, r"mask: sample 1, position 2 is -2\.0"),
        bad("mask int 3", agg(mask=_with(MASK.int(), (0, 0), 3)), ValueError, r"mask: sample 0, position 0 is 3"),
        bad("loss_agg_mode", agg(loss_agg_mode="sum"), ValueError, r"loss_agg_mode='sum'"),
        bad("dp_size 0", agg(dp_size=0), ValueError, r"dp_size=0 is out of range"),
        bad("loss_scale_factor negative", agg(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=-1), ValueError,
            r"loss_scale_factor=-1\.0 is out of range"),
        bad("num_samples without sample_index", agg(num_samples=3), ValueError, r"num_samples is only for compact inputs"),
        bad("compact norm without loss_scale_factor",
            lambda: agg_loss(LOGP[MASK], loss_agg_mode="seq-mean-token-sum-norm", sample_index=SAMPLE, num_samples=3),
            ValueError, r"loss_scale_factor is required"),
        ok("nan masked", agg(loss_mat=_with(LOGP, (0, 3), NAN)), _finite_scalar),
        ok("no mask", agg(mask=None), _finite_scalar),
        # issue 31, D-01: refused in the host read the call makes anyway; NaN where it makes none (bool mask)
        bad("batch_num_tokens 0, int mask", agg(mask=MASK.long(), batch_num_tokens=0), ValueError,
            r"batch_num_tokens is 0\.0 but this batch alone scores 8"),
        ok("batch_num_tokens 0, bool mask: NaN", agg(batch_num_tokens=0), lambda r: bool(r.isnan())),
        ok("global_batch_size 1, bool mask: NaN", agg(loss_agg_mode="seq-mean-token-mean", global_batch_size=1),
           lambda r: bool(r.isnan())),
    ]


def _kl_cases() -> list[Case]:
    return [
        bad("log_probs list", lambda: kl_penalty(LOGP.tolist(), OLD), TypeError, r"log_probs must be a torch.Tensor"),
        bad("ref_log_probs broadcast", lambda: kl_penalty(LOGP, OLD[0]), ValueError,
            r"ref_log_probs must have shape \[3, 4\], got \(4,\)"),
        bad("log_probs int", lambda: kl_penalty(LOGP.long(), OLD), TypeError, r"log_probs must be float"),
        bad("ref_log_probs on meta", lambda: kl_penalty(LOGP, OLD.to("meta")), ValueError, r"ref_log_probs is on meta"),
        bad("kl_type", lambda: kl_penalty(LOGP, OLD, "k4"), ValueError, r"kl_type: kl type 'k4' is unknown"),
        bad("kl_type None", lambda: kl_penalty(LOGP, OLD, None), ValueError, r"kl_type: kl type None is unknown"),
        ok("k3+", lambda: kl_penalty(LOGP, OLD, "k3+"), lambda r: r.shape == LOGP.shape),
        # documented: k3 clamps; k1 propagates a non-finite difference
        ok("k3 of -inf is clamped", lambda: kl_penalty(_with(LOGP, (0, 0), -INF), OLD, "k3"), lambda r: r[0, 0] == 10.0),
    ]


# ============================================================================ advantages and rewards
SCORES = torch.tensor([1.0, 0.0, 2.0, 2.0, 3.0, 5.0])
GROUPS = torch.tensor([0, 0, 1, 1, 2, 2])


def _adv(**kw):
    args = dict(scores=SCORES, group_ids=GROUPS)
    args.update(kw)
    return lambda: group_advantages(**args)


def _group_advantages_cases() -> list[Case]:
    return [
        bad("scores list", _adv(scores=SCORES.tolist()), TypeError, r"scores must be a torch.Tensor"),
        bad("scores int", _adv(scores=SCORES.long()), TypeError, r"scores must be float"),
        bad("scores 0-d", _adv(scores=SCORES[0]), ValueError, r"scores must be \[B\] or \[B, K\]"),
        bad("scores 3-D", _adv(scores=SCORES[:, None, None]), ValueError, r"scores must be \[B\] or \[B, K\]"),
        bad("group_ids list", _adv(group_ids=GROUPS.tolist()), TypeError, r"group_ids must be a torch.Tensor"),
        bad("group_ids float", _adv(group_ids=GROUPS.float()), ValueError, r"group_ids must be an integer tensor"),
        bad("group_ids bool", _adv(group_ids=GROUPS > 0), ValueError, r"group_ids must be an integer tensor"),
        bad("group_ids length", _adv(group_ids=GROUPS[:5]), ValueError, r"group_ids must be an integer tensor of shape \(6,\)"),
        bad("group_ids on meta", _adv(group_ids=GROUPS.to("meta")), ValueError, r"group_ids is on meta"),
        bad("estimator", _adv(estimator="ppo"), ValueError, r"estimator='ppo'"),
        bad("eps 0", _adv(eps=0.0), ValueError, r"eps=0\.0 is out of range: it must be >= 1\.17"),
        bad("eps 0 in float32", _adv(eps=1e-60), ValueError, r"eps=1e-60 is out of range"),
        bad("eps negative", _adv(eps=-1e-6), ValueError, r"eps=-1e-06 is out of range"),
        bad("eps nan", _adv(eps=NAN), ValueError, r"eps=nan must be a finite number"),
        bad("eps str", _adv(eps="1e-6"), TypeError, r"eps must be a number"),
        ok("no samples", _adv(scores=SCORES[:0], group_ids=GROUPS[:0]), lambda r: r.shape == (0,)),
        ok("no columns", _adv(scores=SCORES[:, None][:, :0]), lambda r: r.shape == (6, 0)),
        # documented: a non-finite score makes its own group NaN, no other
        ok("nan score propagates to its group", _adv(scores=_with(SCORES, 2, NAN)),
           lambda r: bool(r[2:4].isnan().all()) and bool(r[[0, 1, 4, 5]].isfinite().all())),
    ]


LOSS = SpanTable.from_lists([[Span(2, 5)], [], [Span(1, 4)]])  # 3 + 0 + 3 loss tokens
REWARDS = torch.tensor([1.0, 0.0, 3.0])
REGIONS = SpanTable.from_lists([[Span(0, 4)], [], []])


def _sr(**kw):
    args = dict(batch=LOSS, rewards=REWARDS)
    args.update(kw)
    return lambda: scatter_rewards(**args)


def _reward_cases() -> list[Case]:
    regions = SpanReward(REGIONS, torch.tensor([1.0]), name="regions")
    return [
        bad("batch list", _sr(batch=[[Span(2, 5)]]), TypeError, r"batch must be an RLBatch or its loss_spans SpanTable, got list"),
        bad("rewards list", _sr(rewards=[1.0, 0.0, 3.0]), TypeError, r"rewards must be a torch.Tensor"),
        bad("rewards shape", _sr(rewards=REWARDS[:2]), SchemaError, r"rewards has shape \(2,\)"),
        bad("rewards int", _sr(rewards=REWARDS.long()), SchemaError, r"rewards must be floating point"),
        bad("rewards nan", _sr(rewards=_with(REWARDS, 0, NAN)), SchemaError, r"rewards: sample 0 .* finite"),
        bad("reward on a sample without loss tokens", _sr(rewards=_with(REWARDS, 1, 2.0)), SchemaError,
            r"rewards: sample 1 .* covers no loss token"),
        bad("mode", _sr(mode="first"), ValueError, r"mode='first'"),
        bad("spans a single SpanReward", _sr(spans=regions), TypeError, r"spans must be a list or tuple of SpanReward"),
        bad("spans of tuples", _sr(spans=[(REGIONS, torch.tensor([1.0]))]), TypeError, r"spans\[0\] must be a SpanReward, got tuple"),
        bad("span table samples", _sr(spans=[SpanReward(SpanTable.from_lists([[Span(0, 4)]]), torch.tensor([1.0]), name="regions")]),
            SchemaError, r"regions: its span table covers 1 samples"),
        bad("overlapping spans", _sr(spans=[SpanReward(SpanTable.from_lists([[Span(0, 4), Span(3, 6)], [], []]),
                                                       torch.tensor([1.0, 1.0]), name="regions")]),
            SchemaError, r"regions: sample 0, span \[3, 6\) overlaps"),
        bad("length_penalty scalar", _sr(length_penalty=20), TypeError, r"length_penalty must be a pair \(max_length, buffer\)"),
        bad("length_penalty buffer 0", _sr(length_penalty=(20, 0)), ValueError, r"buffer"),
        bad("length_penalty float", _sr(length_penalty=(20.5, 4)), TypeError, r"max_length must be an int"),
        bad("num_tokens wrong", _sr(num_tokens=5), ValueError, r"num_tokens=5 but the loss spans hold 6 tokens"),
        bad("num_tokens negative", _sr(num_tokens=-1), ValueError, r"num_tokens=-1 is out of range"),
        bad("num_tokens float", _sr(num_tokens=6.0), TypeError, r"num_tokens must be an int"),
        bad("check str", _sr(check="yes"), TypeError, r"check must be True or False"),
        ok("region rewards", _sr(spans=[regions]), lambda r: r.shape == (6,) and r[:2].sum() == 1.0),
        ok("no samples", lambda: scatter_rewards(SpanTable.from_lists([]), torch.zeros(0)), lambda r: r.shape == (0,)),
        bad("SpanReward spans list", lambda: SpanReward([[Span(0, 4)]], torch.tensor([1.0])), TypeError,
            r"SpanReward spans must be a SpanTable, got list"),
        bad("SpanReward values list", lambda: SpanReward(REGIONS, [1.0]), TypeError, r"span rewards: values must be a torch.Tensor"),
        bad("SpanReward values shape", lambda: SpanReward(REGIONS, torch.tensor([1.0, 2.0]), name="regions"), ValueError,
            r"regions: values has shape \(2,\); expected \(1,\)"),
        bad("SpanReward values int", lambda: SpanReward(REGIONS, torch.tensor([1]), name="regions"), SchemaError,
            r"regions: values must be floating point"),
        bad("SpanReward mode", lambda: SpanReward(REGIONS, torch.tensor([1.0]), mode="first", name="regions"), ValueError,
            r"regions: mode='first'"),
        bad("SpanReward name", lambda: SpanReward(REGIONS, torch.tensor([1.0]), name=3), TypeError, r"SpanReward name must be a str"),
        bad("overlong lengths list", lambda: overlong_penalty([3, 4], 20, 8), TypeError, r"lengths must be a torch.Tensor"),
        bad("overlong lengths float", lambda: overlong_penalty(torch.tensor([3.0]), 20, 8), TypeError, r"lengths must be int64"),
        bad("overlong lengths negative", lambda: overlong_penalty(torch.tensor([3, -3]), 20, 8), ValueError,
            r"lengths\[1\] = -3 is negative"),
        bad("overlong max_length float", lambda: overlong_penalty(torch.tensor([3]), 20.0, 8), TypeError, r"max_length must be an int"),
        bad("overlong max_length bool", lambda: overlong_penalty(torch.tensor([3]), True, 1), TypeError, r"max_length must be an int"),
        bad("overlong buffer 0", lambda: overlong_penalty(torch.tensor([3]), 20, 0), ValueError, r"buffer=0"),
        bad("overlong buffer above max_length", lambda: overlong_penalty(torch.tensor([3]), 20, 21), ValueError, r"buffer=21"),
        ok("overlong", lambda: overlong_penalty(torch.tensor([0, 16, 25]), 20, 8), lambda r: r.tolist() == [0.0, -0.5, -1.0]),
    ]


# ============================================================================ integrations
def _verl():
    return importlib.import_module("rlk_mm.integrations.verl")


def _actor_config(**kw):
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **kw)


def _verl_loss(config_kw=None, batch_info=None, **kw):
    def call():
        cfg = _actor_config(**(config_kw or {}))
        cfg.global_batch_info.update(batch_info or {})
        args = dict(old_log_prob=OLD, log_prob=LOGP, advantages=ADV, response_mask=MASK, config=cfg)
        args.update(kw)
        return _verl().compute_policy_loss(**args)

    return call


TOKEN_REWARDS = torch.randn(6, 4, generator=_g)
UIDS = ["a", "a", "b", "b", "c", "c"]


def _verl_adv(name="grpo", **kw):
    def call():
        args = dict(token_level_rewards=TOKEN_REWARDS, response_mask=torch.ones(6, 4), index=UIDS)
        args.update(kw)
        return getattr(_verl(), f"compute_{name}_outcome_advantage")(**args)

    return call


def _verl_cases() -> list[Case]:
    plain = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    return [
        # issue 31: D-06 (a dict config works; what is no config is named), D-01 (global counts below the data)
        ok("loss: config a dict", _verl_loss(config=plain), lambda r: torch.equal(r[0], _verl_loss()()[0])),
        bad("loss: config a str", _verl_loss(config="fsdp"), TypeError, r"config must be verl's ActorConfig"),
        bad("gspo: config a list", lambda: _verl().compute_policy_loss_gspo(OLD, LOGP, ADV, MASK, config=[0.2]), TypeError,
            r"config must be verl's ActorConfig"),
        bad("loss: global_batch_info batch_num_tokens 0", _verl_loss(batch_info={"batch_num_tokens": 0}), ValueError,
            r"batch_num_tokens is 0\.0 but this batch alone scores 8"),
        bad("loss: global_batch_info global_batch_size 0", _verl_loss(batch_info={"global_batch_size": 0},
                                                                      loss_agg_mode="seq-mean-token-mean"),
            ValueError, r"global_batch_size is 0\.0 but this batch alone has 3"),
        bad("loss: config missing", _verl_loss(config=None), ValueError, r"config \(verl's ActorConfig\) is required"),
        bad("loss: no clip ratio", _verl_loss({"clip_ratio": None, "clip_ratio_low": None}), ValueError,
            r"config.clip_ratio_low and config.clip_ratio are both None"),
        bad("loss: clip_ratio_low negative", _verl_loss({"clip_ratio_low": -0.2}), ValueError, r"clip_ratio_low=-0\.2 is out of range"),
        bad("loss: dp_size 0", _verl_loss(batch_info={"dp_size": 0}), ValueError, r"dp_size=0 is out of range"),
        bad("loss: log_prob list", _verl_loss(log_prob=LOGP.tolist()), TypeError, r"log_prob must be a torch.Tensor"),
        bad("loss: old_log_prob int", _verl_loss(old_log_prob=OLD.long()), TypeError, r"old_log_prob must be float"),
        bad("loss: response_mask shape", _verl_loss(response_mask=MASK[:, :2]), ValueError,
            r"response_mask must have shape \[3, 4\], got \(3, 2\)"),
        bad("loss: response_mask negative", _verl_loss(response_mask=_with(MASK.float(), (0, 1), -1.0)), ValueError,
            r"mask: sample 0, position 1 is -1\.0"),
        bad("loss: rollout_is_weights negative", _verl_loss(rollout_is_weights=-torch.ones(3, 4)), ValueError,
            r"rollout_is_weights: sample 0, position 0 is -1\.0"),
        bad("loss: loss_agg_mode", _verl_loss(loss_agg_mode="mean"), ValueError, r"loss_agg_mode='mean'"),
        bad("gspo: response_mask shape", lambda: _verl().compute_policy_loss_gspo(OLD, LOGP, ADV, MASK[:2], config=_actor_config()),
            ValueError, r"response_mask must have shape \[3, 4\]"),
        bad("grpo: token_level_rewards 1-D", _verl_adv(token_level_rewards=TOKEN_REWARDS[:, 0]), ValueError,
            r"token_level_rewards must be 2-D"),
        bad("grpo: token_level_rewards int", _verl_adv(token_level_rewards=TOKEN_REWARDS.long()), TypeError,
            r"token_level_rewards must be float"),
        bad("grpo: response_mask shape", _verl_adv(response_mask=torch.ones(6, 1)), ValueError,
            r"response_mask must have shape \[6, 4\], got \(6, 1\)"),
        bad("grpo: index length", _verl_adv(index=UIDS[:5]), ValueError, r"index has 5 entries but token_level_rewards has 6 rows"),
        bad("grpo: epsilon 0", _verl_adv(epsilon=0.0), ValueError, r"epsilon=0\.0 is out of range"),
        bad("grpo: norm flag str", _verl_adv(norm_adv_by_std_in_grpo="false"), TypeError,
            r"norm_adv_by_std_in_grpo must be True or False"),
        bad("rloo: index length", _verl_adv("rloo", index=UIDS[:4]), ValueError, r"index has 4 entries"),
        bad("rloo: response_mask shape", _verl_adv("rloo", response_mask=torch.ones(4)), ValueError, r"response_mask must have shape"),
        ok("grpo", _verl_adv(), lambda r: r[0].shape == (6, 4)),
    ]


def _easyr1_cases() -> list[Case]:
    def pl(**kw):
        args = dict(old_log_probs=OLD, log_probs=LOGP, advantages=ADV, response_mask=MASK)
        args.update(kw)
        return lambda: easyr1.compute_policy_loss(**args)

    def adv(**kw):
        args = dict(token_level_rewards=TOKEN_REWARDS, response_mask=torch.ones(6, 4), index=UIDS)
        args.update(kw)
        return lambda: easyr1.compute_grpo_outcome_advantage(**args)

    return [
        bad("average_loss mode", lambda: easyr1.average_loss(LOGP, MASK, "mean"), ValueError, r"mode='mean'"),
        bad("average_loss values int", lambda: easyr1.average_loss(LOGP.long(), MASK, "token"), TypeError, r"values must be float"),
        bad("average_loss mask shape", lambda: easyr1.average_loss(LOGP, MASK[0], "token"), ValueError, r"mask must have shape \[3, 4\]"),
        bad("average_loss mask negative", lambda: easyr1.average_loss(LOGP, -MASK.float(), "seq"), ValueError,
            r"mask: sample 0, position 0 is -1\.0"),
        bad("average_loss eps", lambda: easyr1.average_loss(LOGP, MASK, "token", eps=1e-6), ValueError, r"eps=1e-06"),
        bad("compute_kl int", lambda: easyr1.compute_kl(LOGP.long(), OLD, "kl"), TypeError, r"log_probs must be float"),
        bad("compute_kl shape", lambda: easyr1.compute_kl(LOGP, OLD[0], "kl"), ValueError, r"ref_log_probs must have shape \[3, 4\]"),
        bad("compute_kl kind", lambda: easyr1.compute_kl(LOGP, OLD, "full"), ValueError, r"kl_penalty='full'"),
        bad("loss: loss_type", pl(loss_type="sapo"), ValueError, r"loss_type='sapo'"),
        bad("loss: loss_avg_mode", pl(loss_avg_mode="token-mean"), ValueError, r"loss_avg_mode='token-mean': EasyR1 averages by"),
        bad("loss: clip_ratio_low", pl(clip_ratio_low=1.0), ValueError, r"clip_ratio_low=1\.0"),
        bad("loss: clip_ratio_high negative", pl(clip_ratio_high=-0.1), ValueError, r"clip_ratio_high=-0\.1 is out of range"),
        bad("loss: clip_ratio_dual", pl(clip_ratio_dual=0.5), ValueError, r"clip_ratio_dual=0\.5: the dual-clip bound must be > 1"),
        bad("loss: response_mask shape", pl(response_mask=MASK[:1]), ValueError, r"response_mask must have shape \[3, 4\]"),
        bad("loss: log_probs int", pl(log_probs=LOGP.long()), TypeError, r"log_probs must be float"),
        bad("loss: advantages nan", pl(advantages=_with(ADV, (0, 0), NAN)), ValueError, r"advantages: sample 0, position 0 is nan"),
        bad("grpo: index length", adv(index=UIDS[:5]), ValueError, r"index has 5 entries but token_level_rewards has 6 rows"),
        bad("grpo: eps 0", adv(eps=0.0), ValueError, r"eps=0\.0 is out of range"),
        bad("grpo: response_mask shape", adv(response_mask=torch.ones(6)), ValueError, r"response_mask must have shape \[6, 4\]"),
        bad("grpo: single response", adv(index=["a", "a", "b", "b", "c", "d"]), ValueError, r"group 'c' \(sample 4\) has a single"),
        ok("loss", pl(), lambda r: math.isfinite(r[0].item())),
    ]


def _fused(shape=(2, 5), **kw):
    h = torch.randn(*shape, 16, generator=torch.Generator().manual_seed(3))
    ids = torch.arange(math.prod(shape)).reshape(shape) % 30
    args = dict(hidden_states=h, vocab_weights=W, input_ids=ids)
    args.update(kw)
    return lambda: FusedLinearForPPO()(**args)


def _verl_fused_cases() -> list[Case]:
    ids = torch.arange(10).reshape(2, 5)
    return [
        bad("chunk_size 0", lambda: FusedLinearForPPO(chunk_size=0), ValueError, r"chunk_size=0 is out of range"),
        bad("chunk_size str", lambda: FusedLinearForPPO(chunk_size="512"), TypeError, r"chunk_size must be an int"),
        bad("impl_backend", lambda: FusedLinearForPPO(impl_backend="cuda"), ValueError, r"Unsupported FusedLinearForPPO backend"),
        bad("hidden_states list", _fused(hidden_states=[[0.0]]), TypeError, r"hidden_states must be a torch.Tensor"),
        bad("hidden_states 4-D", _fused(hidden_states=torch.zeros(1, 2, 5, 16)), ValueError, r"hidden_states must be 2D or 3D"),
        bad("input_ids float", _fused(input_ids=ids.float()), TypeError, r"input_ids must be an integer tensor"),
        bad("input_ids list", _fused(input_ids=ids.tolist()), TypeError, r"input_ids must be a torch.Tensor"),
        bad("input_ids shape", _fused(input_ids=ids[:, :4]), ValueError, r"must match hidden_states shape"),
        bad("input_ids ignore index", _fused(input_ids=_with(ids, (0, 3), -100)), ValueError,
            r"input_ids\[0, 3\] = -100 .*ignore index"),
        bad("input_ids outside vocabulary", _fused(input_ids=_with(ids, (1, 2), 40)), ValueError,
            r"input_ids\[1, 2\] = 40 is out of range: there are 30 vocabulary"),
        bad("input_ids packed outside vocabulary", _fused((7,), input_ids=_with(torch.arange(7), 5, 30)), ValueError,
            r"input_ids\[5\] = 30 is out of range"),
        bad("vocab_weights dtype", _fused(vocab_weights=W.double()), TypeError, r"hidden_states is torch.float32 but vocab_weights"),
        bad("temperature str", _fused(temperature="1"), TypeError, r"temperature must be a number"),
        bad("temperature 0", _fused(temperature=0.0), ValueError, r"temperature must be a finite number >= 1e-05"),
        bad("scoring rows float", lambda: scoring(torch.tensor([1.0]), torch.tensor([0, 3])).__enter__(), TypeError,
            r"rows must be int64"),
        bad("scoring cu_seqlens 2-D", lambda: scoring(torch.tensor([1]), torch.tensor([[0, 3]])).__enter__(), ValueError,
            r"cu_seqlens must be 1-D"),
        bad("enable response_only str", lambda: enable(response_only="yes"), TypeError, r"response_only must be True or False"),
        ok("3-D", _fused(), lambda r: r[0].shape == (2, 5)),
        ok("2-D", _fused((7,)), lambda r: r[0].shape == (7,)),
    ]


# ============================================================================ sampling, Lagrangian (issue 31, D-06)
def _sampling_cases() -> list[Case]:
    from rlk_mm.ops import Lagrangian, sample

    seeds = torch.tensor([1, 2])
    return [
        bad("sample: empty vocabulary", lambda: sample(torch.zeros(2, 0), seeds=seeds), ValueError,
            r"the vocabulary is empty: logits \[B, V\] .* V = 0"),
        bad("sample: empty vocabulary, top_k", lambda: sample(torch.zeros(2, 0), seeds=seeds, top_k=1), ValueError,
            r"the vocabulary is empty"),
        ok("sample: one entry", lambda: sample(torch.zeros(2, 1), seeds=seeds), lambda r: r.tokens.tolist() == [0, 0]),
        bad("Lagrangian: device 'gpu'", lambda: Lagrangian(0.5, device="gpu"), ValueError, r"device='gpu' is not a torch device"),
    ]


# ============================================================================ the tables as tests
OP_CASES = {"selected_logprob": _selected_logprob_cases, "policy_loss": _policy_loss_cases, "agg_loss": _agg_cases}
CASES = {
    "kl_penalty": _kl_cases, "group_advantages": _group_advantages_cases, "rewards": _reward_cases,
    "easyr1": _easyr1_cases, "verl_fused": _verl_fused_cases, "sampling": _sampling_cases,
}
VERL_CASES = {"verl": _verl_cases}


def _table(groups: dict) -> list:
    return [pytest.param(case, id=f"{group}: {case.name}") for group, make in groups.items() for case in make()]


def _assert_well(case: Case) -> None:
    kind, detail = outcome(case)
    assert kind == "well", f"{kind}: {detail}"


@pytest.mark.parametrize("case", _table(OP_CASES))
def test_op_inputs(backend, case):
    _assert_well(case)


@pytest.mark.parametrize("case", _table(CASES))
def test_inputs(case):
    _assert_well(case)


@pytest.mark.parametrize("case", _table(VERL_CASES))
def test_verl_inputs(requires_verl, case):
    _assert_well(case)


# ============================================================================ properties
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
@given(
    B=st.integers(1, 4), R=st.integers(1, 6), data=st.data(),
    field=st.sampled_from(["advantages", "old_log_probs", "rollout_is_weights", "ref_log_probs", "mask"]),
    value=st.sampled_from([NAN, INF, -INF, -1.0]),
)
def test_a_bad_value_is_named_at_its_sample_and_position(B, R, data, field, value):
    """One bad value at a scored position of any data input: the error names the field, the
    sample and the position; the same value at a masked position changes nothing."""
    if value == -1.0 and field not in ("rollout_is_weights", "mask"):
        value = NAN  # -1 is a fine advantage or log-prob
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    inputs = dict(log_probs=torch.randn(B, R, generator=g) - 1, old_log_probs=torch.randn(B, R, generator=g) - 1,
                  advantages=torch.randn(B, R, generator=g), rollout_is_weights=torch.rand(B, R, generator=g),
                  ref_log_probs=torch.randn(B, R, generator=g) - 1, mask=torch.rand(B, R, generator=g) > 0.3)
    b, t = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, R - 1))
    inputs["mask"][b, t] = True
    inputs["mask"] = inputs["mask"].float()
    inputs[field] = _with(inputs[field], (b, t), value)
    with pytest.raises(ValueError, match=rf"{field}: sample {b}, position {t} is {value}"):
        policy_loss(**inputs, kl_coef=0.1)
    if field != "mask":
        inputs["mask"][b, t] = 0.0
        assert torch.isfinite(policy_loss(**inputs, kl_coef=0.1)[0])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), V=st.integers(1, 40), data=st.data())
def test_a_target_outside_the_vocabulary_is_named(n, V, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    targets = torch.randint(0, V, (n,), generator=g)
    i = data.draw(st.integers(0, n - 1))
    token = data.draw(st.one_of(st.integers(V, V + 5), st.integers(-200, -1)))
    targets[i] = token
    with pytest.raises(ValueError, match=rf"targets\[{i}\] = {token} is out of range: there are {V} vocabulary entries"):
        selected_logprob(torch.randn(n, 8), torch.randn(V, 8), index=torch.arange(n), targets=targets)


_REAL = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5))


@settings(max_examples=60, deadline=None)
@given(
    knob=st.sampled_from(["clip_ratio_low", "clip_ratio_high", "kl_coef", "entropy_coeff", "eps", "temperature"]),
    value=_REAL,
)
def test_a_knob_out_of_range_is_refused_and_one_in_range_works(knob, value):
    """Every value of a numeric knob is either accepted with a finite result or refused
    with an error naming the knob: no knob flips a sign or gives NaN."""
    if knob == "eps":
        call = lambda: group_advantages(SCORES, GROUPS, eps=value)  # noqa: E731
    elif knob == "temperature":
        call = lambda: selected_logprob(H, W, index=IDX, targets=TGT, temperature=value)  # noqa: E731
    else:
        call = lambda: policy_loss(LOGP, OLD, ADV, MASK, ref_log_probs=LOGP, entropy=torch.ones(3, 4), **{knob: value})[0]  # noqa: E731
    in_range = {
        "clip_ratio_low": 0 <= value <= 1, "clip_ratio_high": 0 <= value <= F32_MAX or value == INF,
        "kl_coef": 0 <= value <= F32_MAX, "entropy_coeff": 0 <= value <= F32_MAX, "eps": F32_TINY <= value < INF,
        "temperature": MIN_TEMPERATURE <= value < INF,
    }[knob]
    if in_range:
        assert torch.isfinite(call()).all()
    else:
        with pytest.raises(ValueError, match=rf"{knob}(=| must)"):
            call()


@settings(max_examples=40, deadline=None)
@given(groups=st.lists(st.integers(0, 4), min_size=1, max_size=20), data=st.data(),
       estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]), value=st.sampled_from([NAN, INF, -INF]))
def test_a_non_finite_score_stays_in_its_group(groups, data, estimator, value):
    """Documented: a non-finite score propagates to its own group's advantages, no further."""
    ids = torch.tensor(groups)
    scores = torch.randn(len(groups), generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    i = data.draw(st.integers(0, len(groups) - 1))
    out = group_advantages(_with(scores, i, value), ids, estimator=estimator)
    others = ids != ids[i]
    assert torch.equal(out[others], group_advantages(scores[others], ids[others], estimator=estimator))


# ============================================================================ the tally
def tally() -> dict[str, dict[str, int]]:
    """{function group: {class: count}} over every table (torch backend)."""
    counts: dict[str, dict[str, int]] = {}
    groups = {**OP_CASES, **CASES, **VERL_CASES}
    with use_backend("torch"):
        for group, make in groups.items():
            for case in make():
                kind, detail = outcome(case)
                row = counts.setdefault(group, dict.fromkeys(("well", "silent", "crash", "unclear"), 0))
                row[kind] += 1
                if kind != "well" and "-v" in sys.argv:
                    print(f"  {kind:8s} {group}: {case.name}: {detail[:160]}")
    return counts


if __name__ == "__main__":
    import conftest  # noqa: F401  (TRITON_INTERPRET, the ray stand-in)

    total = dict.fromkeys(("well", "silent", "crash", "unclear"), 0)
    for group, row in tally().items():
        print(f"{group:18s} " + "  ".join(f"{k} {v:3d}" for k, v in row.items()))
        for k, v in row.items():
            total[k] += v
    print(f"{'total':18s} " + "  ".join(f"{k} {v:3d}" for k, v in total.items()) + f"   of {sum(total.values())}")
