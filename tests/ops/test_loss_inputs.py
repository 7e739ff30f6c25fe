"""Bad and unusual inputs to policy_loss, agg_loss (both backends), kl_penalty and Lagrangian, and properties over
generated inputs: a bad value is named at its sample and position; a knob out of range is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm.ops import (
    Lagrangian,
    agg_loss,
    group_advantages,
    kl_penalty,
    policy_loss,
    selected_logprob,
)
from rlk_mm.schema.checks import MIN_TEMPERATURE
from support.op_cases import (
    ADV,
    F32_MAX,
    F32_TINY,
    GROUPS,
    IDX,
    INF,
    LOGP,
    MASK,
    NAN,
    OLD,
    SAMPLE,
    SCORES,
    TGT,
    Case,
    H,
    W,
    assert_well,
    bad,
    finite_scalar,
    ok,
    table,
    with_value,
)


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
        bad("log_probs int", _pl(log_probs=LOGP.long()), TypeError,
            r"log_probs must be float64/float32/float16/bfloat16"),
        bad("log_probs 3-D", _pl(log_probs=LOGP[..., None]), ValueError,
            r"log_probs has shape \(3, 4, 1\): padded inputs are \[B, R\]"),
        bad("log_probs 1-D without sample_index", _pl(log_probs=LOGP[0]), ValueError, r"padded inputs are \[B, R\]"),
        bad("old_log_probs shape", _pl(old_log_probs=OLD[:, :3]), ValueError, r"old_log_probs has shape \(3, 3\)"),
        bad("old_log_probs list", _pl(old_log_probs=OLD.tolist()), TypeError, r"old_log_probs must be a torch.Tensor"),
        bad("old_log_probs on meta", _pl(old_log_probs=OLD.to("meta")), ValueError, r"old_log_probs is on meta"),
        bad("old_log_probs -inf scored", _pl(old_log_probs=with_value(OLD, (0, 1), -INF)), ValueError,
            r"old_log_probs: sample 0, position 1 is -inf"),
        bad("advantages broadcast shape", _pl(advantages=ADV[:, :1]), ValueError, r"advantages has shape \(3, 1\)"),
        bad("advantages int", _pl(advantages=ADV.long()), TypeError, r"advantages must be float"),
        bad("advantages nan scored", _pl(advantages=with_value(ADV, (1, 2), NAN)), ValueError,
            r"advantages: sample 1, position 2 is nan"),
        bad("advantages inf scored", _pl(advantages=with_value(ADV, (2, 0), INF)), ValueError,
            r"advantages: sample 2, position 0 is inf"),
        ok("advantages nan masked", _pl(advantages=with_value(ADV, (2, 3), NAN)),
           _same_loss(advantages=with_value(ADV, (2, 3), 0.0))),
        bad("mask shape", _pl(mask=MASK[:2]), ValueError, r"mask has shape \(2, 4\)"),
        bad("mask list", _pl(mask=MASK.tolist()), TypeError, r"mask must be a torch.Tensor"),
        bad("mask on meta", _pl(mask=MASK.to("meta")), ValueError, r"mask is on meta"),
        bad("mask negative weight", _pl(mask=with_value(MASK.float(), (2, 0), -1.0)), ValueError,
            r"mask: sample 2, position 0 is -1\.0.*>= 0"),
        bad("mask int 2", _pl(mask=with_value(MASK.long(), (0, 3), 2)), ValueError,
            r"mask: sample 0, position 3 is 2.*0 or 1"),
        bad("mask nan", _pl(mask=with_value(MASK.float(), (1, 1), NAN)), ValueError,
            r"mask: sample 1, position 1 is nan"),
        bad("mask complex", _pl(mask=MASK.to(torch.complex64)), TypeError, r"mask must be bool"),
        ok("mask 0/1 int", _pl(mask=MASK.long()), _same_loss()),
        ok("mask float weights", _pl(mask=MASK.float() * 0.5), finite_scalar),
        bad("clip_ratio_low negative", _pl(clip_ratio_low=-0.1), ValueError, r"clip_ratio_low=-0\.1 is out of range"),
        bad("clip_ratio_low above 1", _pl(clip_ratio_low=1.5), ValueError, r"clip_ratio_low=1\.5 is out of range"),
        bad("clip_ratio_low nan", _pl(clip_ratio_low=NAN), ValueError, r"clip_ratio_low=nan must be a finite number"),
        bad("clip_ratio_low str", _pl(clip_ratio_low="0.2"), TypeError, r"clip_ratio_low must be a number"),
        bad("clip_ratio_high negative", _pl(clip_ratio_high=-0.2), ValueError,
            r"clip_ratio_high=-0\.2 is out of range"),
        bad("clip_ratio_high nan", _pl(clip_ratio_high=NAN), ValueError, r"clip_ratio_high=nan"),
        bad("clip_ratio_high beyond float32", _pl(clip_ratio_high=1e39), ValueError,
            r"clip_ratio_high=1e\+39 is out of range: float32"),
        bad("clip_ratio_c below 1", _pl(clip_ratio_c=0.5), ValueError,
            r"clip_ratio_c=0\.5: the dual-clip bound must be > 1"),
        bad("clip_ratio_c nan", _pl(clip_ratio_c=NAN), ValueError, r"clip_ratio_c=nan"),
        bad("clip_ratio_c str", _pl(clip_ratio_c="3"), TypeError, r"clip_ratio_c must be a number"),
        bad("ratio", _pl(ratio="seq"), ValueError, r"ratio='seq': expected one of"),
        bad("log_ratio_clamp reversed", _pl(log_ratio_clamp=(5.0, -5.0)), ValueError,
            r"log_ratio_clamp=\(5\.0, -5\.0\): the lower bound must be <= the upper"),
        bad("log_ratio_clamp scalar", _pl(log_ratio_clamp=20.0), TypeError, r"log_ratio_clamp must be a pair"),
        bad("log_ratio_clamp nan", _pl(log_ratio_clamp=(NAN, 1.0)), ValueError, r"log_ratio_clamp\[0\]=nan"),
        bad("log_ratio_clamp as ratio bounds", _pl(log_ratio_clamp=(0.8, 1.25)), ValueError,
            r"log_ratio_clamp=\(0\.8, 1\.25\) does not hold 0, the log-ratio of an on-policy token"),
        bad("log_ratio_clamp above 0", _pl(log_ratio_clamp=(1.0, 2.0), ratio="gspo"), ValueError,
            r"log_ratio_clamp=\(1\.0, 2\.0\) does not hold 0"),
        bad("log_ratio_clamp 0 wide", _pl(log_ratio_clamp=(0.0, 0.0)), ValueError, r"does not hold 0"),
        ok("log_ratio_clamp unbounded", _pl(log_ratio_clamp=(None, None)), _same_loss()),
        bad("clip ratios both 0", _pl(clip_ratio_low=0.0, clip_ratio_high=0), ValueError,
            r"clip_ratio_low=0 and clip_ratio_high=0 make the clip interval \[1, 1\]"),
        ok("clip_ratio_low 0 alone", _pl(clip_ratio_low=0.0), finite_scalar),
        ok("clip off (low 1, high inf)", _pl(clip_ratio_low=1.0, clip_ratio_high=INF), finite_scalar),
        bad("EasyR1 seq mode with dp_size", _pl(loss_agg_mode="seq", dp_size=4), ValueError,
            r"loss_agg_mode='seq' \(EasyR1's\) averages over this batch alone: dp_size=4 would be ignored"),
        bad("EasyR1 token mode with a count", _pl(loss_agg_mode="token", global_batch_size=3), ValueError,
            r"loss_agg_mode='token' \(EasyR1's\).*global_batch_size=3\.0 would be ignored"),
        bad("global_batch_size fractional, token-mean", _pl(global_batch_size=2.5), ValueError,
            r"global_batch_size=2\.5: a count of sequences is a whole number"),
        bad("batch_num_tokens beyond float32", _pl(batch_num_tokens=1e39), ValueError,
            r"batch_num_tokens=1e\+39 is out of range: float32"),
        bad("entropy a list", _pl(entropy=[1.0] * 12, entropy_coeff=0.01), TypeError, r"entropy must be a torch.Tensor"),
        bad("every input on meta", _pl(log_probs=LOGP.to("meta"), old_log_probs=OLD.to("meta"),
                                       advantages=ADV.to("meta"), mask=MASK.to("meta")), ValueError,
            r"log_probs is on the meta device, which holds no values: policy_loss"),
        bad("batch_num_tokens a tensor on meta", _pl(batch_num_tokens=torch.tensor(8.0, device="meta")), ValueError,
            r"batch_num_tokens is on the meta device"),
        bad("dp_size beyond float32's integers", _pl(dp_size=2**25, batch_num_tokens=8), ValueError,
            r"dp_size=33554432 is out of range: the loss is multiplied by it in float32, exact .* 2\^24"),
        bad("compact: num_samples beyond int32", _compact(num_samples=2**40, loss_agg_mode="seq-mean-token-mean"),
            ValueError, r"num_samples=1099511627776 is out of range"),
        bad("rollout_is_weights negative", _pl(rollout_is_weights=with_value(torch.ones(3, 4), (0, 0), -0.5)),
            ValueError,
            r"rollout_is_weights: sample 0, position 0 is -0\.5.*>= 0"),
        bad("rollout_is_weights nan", _pl(rollout_is_weights=with_value(torch.ones(3, 4), (1, 3), NAN)), ValueError,
            r"rollout_is_weights: sample 1, position 3 is nan"),
        bad("rollout_is_weights shape", _pl(rollout_is_weights=torch.ones(4)), ValueError,
            r"rollout_is_weights has shape \(4,\)"),
        bad("rollout_is_weights int", _pl(rollout_is_weights=torch.ones(3, 4, dtype=torch.long)), TypeError,
            r"rollout_is_weights must be float"),
        bad("ref_log_probs nan scored", _pl(ref_log_probs=with_value(LOGP, (1, 0), NAN), kl_coef=0.1), ValueError,
            r"ref_log_probs: sample 1, position 0 is nan"),
        bad("ref_log_probs shape", _pl(ref_log_probs=LOGP[0], kl_coef=0.1), ValueError,
            r"ref_log_probs has shape \(4,\)"),
        bad("kl_coef negative", _pl(ref_log_probs=LOGP, kl_coef=-0.1), ValueError, r"kl_coef=-0\.1 is out of range"),
        bad("kl_coef nan", _pl(ref_log_probs=LOGP, kl_coef=NAN), ValueError, r"kl_coef=nan"),
        bad("kl_coef without ref", _pl(kl_coef=0.1), ValueError, r"kl_coef is set but ref_log_probs is None"),
        bad("kl_type", _pl(ref_log_probs=LOGP, kl_coef=0.1, kl_type="k4"), ValueError,
            r"kl_type: kl type 'k4' is unknown"),
        bad("kl_type None", _pl(ref_log_probs=LOGP, kl_coef=0.1, kl_type=None), ValueError,
            r"kl_type: kl type None is unknown"),
        bad("entropy int", _pl(entropy=torch.ones(3, 4, dtype=torch.long), entropy_coeff=0.01), TypeError,
            r"entropy must be float"),
        bad("entropy_coeff negative", _pl(entropy=torch.ones(3, 4), entropy_coeff=-0.01), ValueError,
            r"entropy_coeff=-0\.01 is out of range"),
        bad("entropy_coeff without entropy", _pl(entropy_coeff=0.01), ValueError,
            r"entropy_coeff is set but entropy is None"),
        bad("loss_agg_mode", _pl(loss_agg_mode="mean"), ValueError, r"loss_agg_mode='mean'"),
        bad("dp_size 0", _pl(dp_size=0), ValueError, r"dp_size=0 is out of range: it must be >= 1"),
        bad("dp_size negative", _pl(dp_size=-1, loss_agg_mode="token-sum"), ValueError, r"dp_size=-1 is out of range"),
        bad("dp_size float", _pl(dp_size=2.5), TypeError, r"dp_size must be an int"),
        bad("dp_size bool", _pl(dp_size=True), TypeError, r"dp_size must be an int"),
        bad("dp_size > 1 without counts", _pl(dp_size=2), ValueError,
            r"batch_num_tokens .* is required when dp_size > 1"),
        bad("batch_num_tokens negative", _pl(dp_size=2, batch_num_tokens=-5), ValueError,
            r"batch_num_tokens=-5\.0 is out of range"),
        bad("batch_num_tokens str", _pl(batch_num_tokens="100"), TypeError, r"batch_num_tokens must be a number"),
        bad("batch_num_tokens tensor negative", _pl(batch_num_tokens=torch.tensor(-5)), ValueError,
            r"batch_num_tokens is -5.*>= 0"),
        bad("batch_num_tokens tensor 1-D", _pl(batch_num_tokens=torch.tensor([5, 6])), ValueError,
            r"batch_num_tokens must be a number or a 0-d tensor"),
        bad("global_batch_size negative", _pl(loss_agg_mode="seq-mean-token-mean", global_batch_size=-2), ValueError,
            r"global_batch_size=-2\.0 is out of range"),
        bad("loss_scale_factor 0", _pl(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=0), ValueError,
            r"loss_scale_factor=0\.0 is out of range: it must be > 0"),
        bad("num_samples without sample_index", _pl(num_samples=3), ValueError,
            r"num_samples is only for compact inputs"),
        ok("batch_num_tokens as a 0-d tensor", _pl(dp_size=2, batch_num_tokens=torch.tensor(9)),
           _same_loss(dp_size=2, batch_num_tokens=9)),
        bad("compact: num_samples missing", _compact(num_samples=None), ValueError,
            r"num_samples is required with sample_index"),
        bad("compact: num_samples negative", _compact(num_samples=-1), ValueError, r"num_samples=-1 is out of range"),
        bad("compact: num_samples float", _compact(num_samples=3.0), TypeError, r"num_samples must be an int"),
        bad("compact: sample_index float", _compact(sample_index=SAMPLE.float()), TypeError,
            r"sample_index must be int64/int32"),
        bad("compact: sample_index shape", _compact(sample_index=SAMPLE[:5]), ValueError,
            r"sample_index must have shape \[8\]"),
        bad("compact: sample_index list", _compact(sample_index=SAMPLE.tolist()), TypeError,
            r"sample_index must be a torch.Tensor"),
        bad("compact: sample_index unsorted", _compact(sample_index=SAMPLE.flip(0)), ValueError,
            r"sample_index\[1\] = 1 follows 2"),
        bad("compact: sample_index out of range", _compact(num_samples=2), ValueError,
            r"sample_index\[7\] = 2 is outside \[0, num_samples=2\)"),
        bad("compact: mask 2-D", _compact(mask=MASK), ValueError, r"mask has shape \(3, 4\)"),
        bad("compact: advantages nan", _compact(advantages=with_value(ADV[MASK], 2, NAN)), ValueError,
            r"advantages\[2\] \(sample 0\) is nan"),
        bad("compact: 2-D with sample_index", _compact(log_probs=LOGP), ValueError,
            r"with sample_index, inputs are compact \[n\]"),
        ok("compact equals padded", _compact(), lambda r: torch.allclose(r[0], _pl()()[0])),
        ok("no samples", _pl(log_probs=LOGP[:0], old_log_probs=OLD[:0], advantages=ADV[:0], mask=MASK[:0]),
           lambda r: r[0].item() == 0),
        ok("fully masked", _pl(mask=torch.zeros_like(MASK)), lambda r: r[0].item() == 0),
        ok("no tokens per sample", _pl(log_probs=LOGP[:, :0], old_log_probs=OLD[:, :0], advantages=ADV[:, :0],
                                       mask=MASK[:, :0], loss_agg_mode="seq-mean-token-sum-norm", ratio="gspo"),
           lambda r: r[0].item() == 0),
        ok("no samples, EasyR1 seq mode",
           _pl(log_probs=LOGP[:0], old_log_probs=OLD[:0], advantages=ADV[:0], mask=MASK[:0],
                                              loss_agg_mode="seq"), lambda r: r[0].item() == 0),
        ok("log_probs nan masked", _pl(log_probs=with_value(LOGP, (2, 2), NAN)), finite_scalar),
        # documented: non-finite log_probs and entropy (model outputs) at scored positions propagate
        ok("log_probs nan scored propagates", _pl(log_probs=with_value(LOGP, (1, 1), NAN)),
           lambda r: bool(r[0].isnan())),
        ok("entropy nan scored propagates", _pl(entropy=with_value(torch.ones(3, 4), (0, 0), NAN), entropy_coeff=0.01),
           lambda r: bool(r[0].isnan())),
        ok("infinite clip_ratio_high", _pl(clip_ratio_high=INF), finite_scalar),
        # a global count below what this batch shows (8 scored tokens in 3 sequences)
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
        # GSPO with every constant slot filled (compact, mask, KL, IS weights, a seq mode) runs backward
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
        bad("loss_mat 3-D", agg(loss_mat=LOGP[None]), ValueError,
            r"loss_mat has shape \(1, 3, 4\): padded inputs are \[B, R\]"),
        bad("mask shape", agg(mask=MASK.T), ValueError, r"mask has shape \(4, 3\)"),
        bad("mask negative", agg(mask=with_value(MASK.float(), (1, 2), -2.0)), ValueError,
            r"mask: sample 1, position 2 is -2\.0"),
        bad("mask int 3", agg(mask=with_value(MASK.int(), (0, 0), 3)), ValueError, r"mask: sample 0, position 0 is 3"),
        bad("loss_agg_mode", agg(loss_agg_mode="sum"), ValueError, r"loss_agg_mode='sum'"),
        bad("dp_size 0", agg(dp_size=0), ValueError, r"dp_size=0 is out of range"),
        bad("loss_scale_factor negative", agg(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=-1),
            ValueError,
            r"loss_scale_factor=-1\.0 is out of range"),
        bad("num_samples without sample_index", agg(num_samples=3), ValueError,
            r"num_samples is only for compact inputs"),
        bad("EasyR1 seq mode with dp_size", agg(loss_agg_mode="seq", dp_size=2), ValueError,
            r"loss_agg_mode='seq' \(EasyR1's\) averages over this batch alone"),
        bad("EasyR1 token mode with loss_scale_factor", agg(loss_agg_mode="token", loss_scale_factor=4), ValueError,
            r"loss_scale_factor=4\.0 would be ignored"),
        ok("token-mean ignores loss_scale_factor (verl passes it with every mode)", agg(loss_scale_factor=4),
           lambda r: torch.equal(r, agg_loss(LOGP, MASK))),
        bad("int mask on meta (its values are read)", agg(loss_mat=LOGP.to("meta"), mask=MASK.long().to("meta")),
            ValueError, r"loss_mat is on the meta device.*agg_loss"),
        ok("bool mask on meta (nothing is read)", agg(loss_mat=LOGP.to("meta"), mask=MASK.to("meta")),
           lambda r: r.device.type == "meta" and r.shape == ()),
        bad("compact norm without loss_scale_factor",
            lambda: agg_loss(LOGP[MASK], loss_agg_mode="seq-mean-token-sum-norm", sample_index=SAMPLE, num_samples=3),
            ValueError, r"loss_scale_factor is required"),
        ok("nan masked", agg(loss_mat=with_value(LOGP, (0, 3), NAN)), finite_scalar),
        ok("no mask", agg(mask=None), finite_scalar),
        # refused in the host read the call makes anyway; NaN where it makes none (bool mask)
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
        ok("k3 of -inf is clamped", lambda: kl_penalty(with_value(LOGP, (0, 0), -INF), OLD, "k3"),
           lambda r: r[0, 0] == 10.0),
    ]


def _lagrangian_cases() -> list[Case]:
    return [
        bad("device 'gpu'", lambda: Lagrangian(0.5, device="gpu"), ValueError, r"device='gpu' is not a torch device"),
        bad("max_value 0 pins the multiplier", lambda: Lagrangian(0.5, max_value=0.0), ValueError,
            r"max_value=0\.0 pins the multiplier at 0.*None for no bound"),
        bad("lr beyond float32", lambda: Lagrangian(0.5, lr=1e39), ValueError,
            r"lr=1e\+39 is out of range: the multiplier is float32"),
        bad("init beyond float32", lambda: Lagrangian(0.5, init=1e39), ValueError, r"init=1e\+39 is out of range"),
        bad("budget beyond float32", lambda: Lagrangian(-1e39), ValueError, r"budget=-1e\+39 is out of range"),
        bad("max_value below init", lambda: Lagrangian(0.5, init=1.0, max_value=0.5), ValueError,
            r"max_value=0\.5 is out of range"),
        bad("lr bool", lambda: Lagrangian(0.5, lr=True), TypeError, r"lr must be a number"),
        ok("max_value inf is no bound", lambda: Lagrangian(0.5, lr=10.0, max_value=INF).step(torch.tensor([9.0, 9.0])),
           lambda r: r.item() == 85.0),
    ]


OP_CASES = {"policy_loss": _policy_loss_cases, "agg_loss": _agg_cases}


@pytest.mark.parametrize("case", table(OP_CASES))
def test_op_inputs(backend, case):
    assert_well(case)


CASES = {"kl_penalty": _kl_cases, "lagrangian": _lagrangian_cases}


@pytest.mark.parametrize("case", table(CASES))
def test_inputs(case):
    assert_well(case)


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
    inputs[field] = with_value(inputs[field], (b, t), value)
    with pytest.raises(ValueError, match=rf"{field}: sample {b}, position {t} is {value}"):
        policy_loss(**inputs, kl_coef=0.1)
    if field != "mask":
        inputs["mask"][b, t] = 0.0
        assert torch.isfinite(policy_loss(**inputs, kl_coef=0.1)[0])


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
        call = lambda: policy_loss(LOGP, OLD, ADV, MASK, ref_log_probs=LOGP, entropy=torch.ones(3, 4),  # noqa: E731
                                   **{knob: value})[0]
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

