"""``PolicyLossConfig``: built and checked once, the keyword knobs as sugar, the result tuples.

A config's bad value raises naming the field; ``config=`` and the same keywords give bitwise
the same loss, gradients and metrics (torch and the Triton interpreter); ``PolicyLoss`` and
``PolicyLossOutput`` unpack as the tuples they replace.
"""

import dataclasses
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oracles import loss as oracle
from rlk_mm.ops import (
    AggMode,
    KLType,
    PolicyLoss,
    PolicyLossConfig,
    PolicyLossOutput,
    RatioMode,
    agg_loss,
    linear_policy_loss,
    policy_loss,
)
from support.helpers import use_backend
from support.op_cases import F32_MAX

B, R, H, V = 3, 5, 16, 40


# ----------------------------------------------------------------------------- construction
def test_defaults_are_vanilla_ppo_and_strings_become_members():
    c = PolicyLossConfig()
    assert (c.clip_ratio_low, c.clip_ratio_high, c.clip_ratio_c) == (0.2, 0.2, 3.0)
    assert c.ratio is RatioMode.TOKEN and c.kl_type is KLType.LOW_VAR_KL and c.loss_agg_mode is AggMode.TOKEN_MEAN
    assert (c.kl_coef, c.entropy_coeff, c.dp_size, c.log_ratio_clamp) == (0.0, 0.0, 1, (-20.0, 20.0))
    s = PolicyLossConfig(ratio="gspo", kl_type="k3", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=1,
                         log_ratio_clamp=(None, 10), batch_num_tokens=7)
    assert s.ratio is RatioMode.GSPO and s.kl_type is KLType.K3 and s.loss_agg_mode is AggMode.SEQ_MEAN_TOKEN_MEAN
    assert s.log_ratio_clamp == (-math.inf, 10.0) and s.clip_ratio_low == 1.0 and type(s.batch_num_tokens) is float
    assert PolicyLossConfig(kl_type="k3+").kl_type == "k3+"  # the straight-through form stays a name
    assert PolicyLossConfig(kl_type=KLType.MSE).kl_estimator == (KLType.K2.estimator, False)
    assert PolicyLossConfig(ratio=RatioMode.GSPO) == PolicyLossConfig(ratio="gspo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.kl_coef = 1.0
    assert dataclasses.replace(c, kl_coef=0.5).kl_coef == 0.5


BAD = [  # (field values, error type, the message names the field)
    (dict(clip_ratio_low=1.5), ValueError, r"clip_ratio_low=1\.5 is out of range"),
    (dict(clip_ratio_low=-0.1), ValueError, r"clip_ratio_low"),
    (dict(clip_ratio_low="0.2"), TypeError, r"clip_ratio_low must be a number"),
    (dict(clip_ratio_high=-1), ValueError, r"clip_ratio_high"),
    (dict(clip_ratio_high=float("nan")), ValueError, r"clip_ratio_high"),
    (dict(clip_ratio_c=1.0), ValueError, r"clip_ratio_c=1\.0: the dual-clip bound must be > 1"),
    (dict(ratio="seq"), ValueError, r"ratio='seq': expected one of token, gspo_token, gspo"),
    (dict(log_ratio_clamp=5.0), TypeError, r"log_ratio_clamp must be a pair"),
    (dict(log_ratio_clamp=(3, 1)), ValueError, r"log_ratio_clamp=\(3\.0, 1\.0\)"),
    (dict(log_ratio_clamp=(None, True)), TypeError, r"log_ratio_clamp\[1\]"),
    (dict(kl_type="k4"), ValueError, r"kl_type: kl type 'k4' is unknown"),
    (dict(kl_type=None), ValueError, r"kl_type: kl type None is unknown"),
    (dict(kl_coef=-1.0), ValueError, r"kl_coef"),
    (dict(kl_coef=1e39), ValueError, r"kl_coef=1e\+39 is out of range: float32"),
    (dict(entropy_coeff=-0.1), ValueError, r"entropy_coeff"),
    (dict(loss_agg_mode="mean"), ValueError, r"loss_agg_mode='mean': expected one of token-mean"),
    (dict(dp_size=0), ValueError, r"dp_size=0 is out of range"),
    (dict(dp_size=2.0), TypeError, r"dp_size must be an int"),
    (dict(dp_size=2), ValueError, r"batch_num_tokens \(the global token count\) is required when dp_size > 1"),
    (dict(dp_size=2, loss_agg_mode="seq-mean-token-sum"), ValueError, r"global_batch_size is required"),
    (dict(batch_num_tokens=-1), ValueError, r"batch_num_tokens=-1\.0 is out of range"),
    (dict(global_batch_size=torch.ones(2)), ValueError, r"global_batch_size must be a number or a 0-d tensor"),
    (dict(global_batch_size=torch.tensor(True)), ValueError, r"global_batch_size must be a number or a 0-d tensor"),
    (dict(loss_scale_factor=0), ValueError, r"loss_scale_factor=0\.0 is out of range"),
    # in range, but not what anyone means: refused naming the fields and what to pass instead
    (dict(log_ratio_clamp=(0.8, 1.25)), ValueError,
     r"log_ratio_clamp=\(0\.8, 1\.25\) does not hold 0.*pass their logs \(-0\.2231, 0\.2231\)"),
    (dict(log_ratio_clamp=(0, 20)), ValueError, r"log_ratio_clamp=\(0\.0, 20\.0\) does not hold 0.*low < 0 < high"),
    (dict(log_ratio_clamp=(-5, 0)), ValueError, r"log_ratio_clamp=\(-5\.0, 0\.0\) does not hold 0"),
    (dict(log_ratio_clamp=(None, -1)), ValueError, r"log_ratio_clamp=\(-inf, -1\.0\) does not hold 0"),
    (dict(log_ratio_clamp=(2, None)), ValueError, r"log_ratio_clamp=\(2\.0, inf\) does not hold 0"),
    (dict(clip_ratio_low=0, clip_ratio_high=0), ValueError,
     r"clip_ratio_low=0 and clip_ratio_high=0 make the clip interval \[1, 1\].*clip_ratio_high=inf"),
    (dict(loss_agg_mode="seq", dp_size=2), ValueError,
     r"loss_agg_mode='seq' \(EasyR1's\) averages over this batch alone: dp_size=2 would be ignored"),
    (dict(loss_agg_mode="token", batch_num_tokens=8), ValueError, r"'token' \(EasyR1's\).*batch_num_tokens=8\.0"),
    (dict(loss_agg_mode="seq", global_batch_size=torch.tensor(4)), ValueError, r"'seq' .*global_batch_size=tensor"),
    (dict(loss_agg_mode="token", loss_scale_factor=4), ValueError, r"'token' .*loss_scale_factor=4\.0 would be ignored"),
    (dict(global_batch_size=2.5), ValueError, r"global_batch_size=2\.5: a count of sequences is a whole number"),
    (dict(batch_num_tokens=1e39), ValueError, r"batch_num_tokens=1e\+39 is out of range: float32"),
    (dict(loss_scale_factor=1e39, loss_agg_mode="seq-mean-token-sum-norm"), ValueError,
     r"loss_scale_factor=1e\+39 is out of range: float32"),
]


@pytest.mark.parametrize("values, error, match", BAD, ids=[next(iter(v)) + str(i) for i, (v, _, _) in enumerate(BAD)])
def test_bad_values_name_the_field(values, error, match):
    with pytest.raises(error, match=match):
        PolicyLossConfig(**values)


def test_settings_a_mode_does_not_use_are_kept_for_verl_modes():
    """verl's trainer passes both global counts and ``loss_scale_factor`` with every one of its
    modes: a verl mode ignores those it does not use (the loss is the one without them)."""
    logp, old, adv, mask = _padded(0)
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"):
        base = policy_loss(logp, old, adv, mask, loss_agg_mode=mode, dp_size=2, batch_num_tokens=11,
                           global_batch_size=3).loss
        extra = policy_loss(logp, old, adv, mask, config=PolicyLossConfig(
            loss_agg_mode=mode, dp_size=2, batch_num_tokens=11, global_batch_size=3, loss_scale_factor=64)).loss
        assert torch.equal(base, extra)


_BOUND = st.one_of(st.none(), st.floats(allow_nan=False), st.sampled_from([0.0, -0.0, 0.22, -0.22, 1.25, 20.0]))


@settings(max_examples=80, deadline=None)
@given(lo=_BOUND, hi=_BOUND, clip_low=st.sampled_from([0.0, 0.1, 1.0]), clip_high=st.sampled_from([0.0, 0.3, math.inf]),
       clip_c=st.sampled_from([None, 1.5, 3.0]))
def test_a_config_built_leaves_an_on_policy_token_alone(lo, hi, clip_low, clip_high, clip_c):
    """Every log-ratio clamp and clip a config accepts leaves the on-policy ratio 1 unclamped and
    unclipped: on-policy (log_probs equal to old_log_probs) its loss and gradient are bitwise the
    default config's. What it refuses, it refuses naming the field."""
    try:
        config = PolicyLossConfig(log_ratio_clamp=(lo, hi), clip_ratio_low=clip_low, clip_ratio_high=clip_high,
                                  clip_ratio_c=clip_c)
    except (ValueError, TypeError) as e:
        assert re.match(r"(log_ratio_clamp|clip_ratio_low=0 and clip_ratio_high=0)", str(e)), str(e)
        low, high = (-math.inf if lo is None else lo), (math.inf if hi is None else hi)
        assert not (low < 0 < high and abs(low) <= F32_MAX >= abs(high)) or (clip_low == clip_high == 0)
        return
    logp, _, adv, mask = _padded(2)
    (a, ga), (b, gb) = (_run_policy_loss(logp, logp.detach(), adv, mask, {}, config=c)
                        for c in (config, PolicyLossConfig()))
    assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb)


_FIELD = r"(dp_size|batch_num_tokens|global_batch_size|loss_scale_factor|loss_agg_mode)"


@settings(max_examples=80, deadline=None)
@given(mode=st.sampled_from([m.value for m in AggMode]), dp_size=st.integers(1, 3),
       batch_num_tokens=st.none() | st.integers(0, 30) | st.floats(0.0, 30.0),
       global_batch_size=st.none() | st.integers(0, 6) | st.floats(0.0, 6.0),
       loss_scale_factor=st.none() | st.floats(0.5, 100.0))
def test_an_aggregation_is_refused_by_name_or_is_the_formula(mode, dp_size, batch_num_tokens, global_batch_size,
                                                             loss_scale_factor):
    """Any mix of mode, dp_size, global counts and loss_scale_factor is refused with an error naming
    one of them, or aggregates by the mode's formula with the settings it uses (never a setting
    silently dropped by EasyR1's modes, never a count below what the batch shows)."""
    logp, _, _, mask = _padded(5)
    settings_ = dict(dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
                     loss_scale_factor=loss_scale_factor)
    try:
        got = agg_loss(logp.detach(), mask.long(), mode, **settings_)  # an int mask: the counts are read and checked
    except ValueError as e:
        assert re.match(_FIELD, str(e)), str(e)
        if mode in ("token", "seq"):
            assert dp_size > 1 or any(v is not None for k, v in settings_.items() if k != "dp_size")
        return
    assert mode not in ("token", "seq") or (dp_size == 1 and batch_num_tokens is global_batch_size is None
                                            and loss_scale_factor is None)
    expected = oracle.agg(logp.detach().double(), mask, mode, **settings_)
    assert torch.allclose(got.double(), expected, rtol=1e-6, atol=1e-6), (got, expected)


def test_config_and_keywords_do_not_mix_and_unknown_knobs_are_named():
    logp, old, adv, mask = _padded(0)
    with pytest.raises(TypeError, match="either as config= or as keywords, not both"):
        policy_loss(logp, old, adv, mask, config=PolicyLossConfig(), kl_coef=0.1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) 'clip_low'; the loss knobs are Policy"):
        policy_loss(logp, old, adv, mask, clip_low=0.1)
    with pytest.raises(TypeError, match="config must be a PolicyLossConfig, got dict"):
        policy_loss(logp, old, adv, mask, config={"kl_coef": 0.1})
    h, w, idx, tgt = _head(torch.float32, int(mask.sum()))
    with pytest.raises(TypeError, match="linear_policy_loss: pass the loss knobs either"):
        linear_policy_loss(h, w, index=idx, targets=tgt, old_log_probs=old[mask], advantages=adv[mask],
                           sample_index=_sample_index(mask), num_samples=B, config=PolicyLossConfig(), ratio="gspo")


def test_a_tensor_count_value_is_checked_in_the_op():
    logp, old, adv, mask = _padded(0)
    config = PolicyLossConfig(batch_num_tokens=torch.tensor(-3.0))  # built: its value is the op's to read
    with pytest.raises(ValueError, match="batch_num_tokens is -3.0; a count must be a finite number >= 0"):
        policy_loss(logp, old, adv, mask, config=config)


# ----------------------------------------------------------------------------- sugar = config, bitwise
KNOBS = [
    dict(),
    dict(clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=None, loss_agg_mode="seq-mean-token-sum-norm",
         loss_scale_factor=4.0, kl_coef=0.05, kl_type="k3+", entropy_coeff=0.01),
    dict(ratio="gspo_token", log_ratio_clamp=(None, 10.0), loss_agg_mode="seq-mean-token-mean", dp_size=2,
         global_batch_size=torch.tensor(6.0)),
    dict(ratio=RatioMode.GSPO, loss_agg_mode=AggMode.TOKEN, kl_coef=0.1, kl_type=KLType.ABS),
]


def _padded(seed):
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(B, R, generator=g) * 0.3 - 1.0).requires_grad_()
    old = logp.detach() + torch.randn(B, R, generator=g) * 0.2
    adv = torch.randn(B, R, generator=g)
    mask = torch.arange(R)[None] < torch.tensor([[5], [2], [4]])
    return logp, old, adv, mask


def _sample_index(mask):
    return torch.arange(B)[:, None].expand(B, R)[mask]


def _head(dtype, n):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n + 2, H, generator=g).to(dtype), (torch.randn(V, H, generator=g) * 0.3).to(dtype),
            torch.randperm(n + 2, generator=g)[:n], torch.randint(0, V, (n,), generator=g))


def _run_policy_loss(logp, old, adv, mask, extra, **how):
    x = logp.detach().clone().requires_grad_()
    out = policy_loss(x, old, adv, mask, **extra, **how)
    out.loss.backward()
    return out, x.grad


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("k", range(len(KNOBS)))
def test_policy_loss_config_equals_keywords_bitwise(backend, k):
    knobs = KNOBS[k]
    logp, old, adv, mask = _padded(k)
    extra = dict(ref_log_probs=old - 0.1) if "kl_coef" in knobs else {}
    if "entropy_coeff" in knobs:
        extra["entropy"] = torch.rand(B, R)
    with use_backend(backend):
        (a, ga), (b, gb) = (_run_policy_loss(logp, old, adv, mask, extra, **how)
                            for how in (knobs, dict(config=PolicyLossConfig(**knobs))))
    assert isinstance(a, PolicyLoss) and isinstance(b, PolicyLoss)
    assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb)
    assert a.metrics.keys() == b.metrics.keys() and all(torch.equal(a.metrics[m], b.metrics[m]) for m in a.metrics)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_linear_policy_loss_config_equals_keywords_bitwise(backend, k):
    knobs = {k_: v for k_, v in KNOBS[k].items() if k_ != "entropy_coeff"} | {"entropy_coeff": 0.01}
    _, old, adv, mask = _padded(k)
    extra = dict(ref_log_probs=(old - 0.1)[mask]) if "kl_coef" in knobs else {}
    outs = []
    with use_backend(backend):
        for how in (knobs, dict(config=PolicyLossConfig(**knobs))):
            h, w, idx, tgt = _head(torch.float32, int(mask.sum()))
            h.requires_grad_(), w.requires_grad_()
            out = linear_policy_loss(h, w, index=idx, targets=tgt, old_log_probs=old[mask], advantages=adv[mask],
                                     sample_index=_sample_index(mask), num_samples=B, **extra, **how)
            out.loss.backward()
            outs.append((out, h.grad, w.grad))
    (a, ha, wa), (b, hb, wb) = outs
    assert isinstance(a, PolicyLossOutput)
    for x, y in ((a.loss, b.loss), (a.log_probs, b.log_probs), (a.entropy, b.entropy), (ha, hb), (wa, wb)):
        assert torch.equal(x, y)
    assert all(torch.equal(a.metrics[m], b.metrics[m]) for m in a.metrics)


# ----------------------------------------------------------------------------- the result tuples
def test_results_unpack_as_the_tuples_they_replace():
    logp, old, adv, mask = _padded(3)
    out = policy_loss(logp, old, adv, mask)
    loss, metrics = out
    assert out._fields == ("loss", "metrics") and loss is out.loss and metrics is out.metrics and out[0] is loss
    _, old, adv, mask = _padded(4)
    h, w, idx, tgt = _head(torch.float32, int(mask.sum()))
    full = linear_policy_loss(h, w, index=idx, targets=tgt, old_log_probs=old[mask], advantages=adv[mask],
                              sample_index=_sample_index(mask), num_samples=B)
    loss, metrics, log_probs, entropy = full
    assert full._fields[:2] == PolicyLoss._fields and full._fields == ("loss", "metrics", "log_probs", "entropy")
    assert PolicyLoss(*full[:2]) == (loss, metrics) and log_probs.shape == entropy.shape == (int(mask.sum()),)
    assert isinstance(full, PolicyLoss) and full.log_probs is log_probs and full.entropy is entropy
    assert full._asdict()["entropy"] is entropy and full._replace(loss=metrics).loss is metrics
    assert type(full)._make(full) == full and repr(full).startswith("PolicyLossOutput(loss=tensor(")


def test_the_typed_knobs_are_the_config_s_fields():
    """``**knobs: Unpack[PolicyLossKnobs]``: help() and IDEs show each knob, with the config's type."""
    import pydoc

    from rlk_mm.ops import linear_policy_loss, policy_loss
    from rlk_mm.ops.loss.config import PolicyLossConfig, PolicyLossKnobs

    fields = {f.name: str(f.type) for f in dataclasses.fields(PolicyLossConfig)}
    knobs = {name: (kind if isinstance(kind, str) else kind.__forward_arg__)
             for name, kind in PolicyLossKnobs.__annotations__.items()}
    assert knobs == fields
    for op in (policy_loss, linear_policy_loss):
        assert "**knobs: 'Unpack[PolicyLossKnobs]'" in pydoc.render_doc(op)
