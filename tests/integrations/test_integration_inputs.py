"""Bad and unusual inputs to the verl, EasyR1 and fused verl adapters."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm.integrations import easyr1
from rlk_mm.integrations.verl import FusedLinearForPPO, enable, scoring
from support.op_cases import (
    ADV,
    LOGP,
    MASK,
    NAN,
    OLD,
    TOKEN_REWARDS,
    UIDS,
    Case,
    W,
    assert_well,
    bad,
    ok,
    table,
    with_value,
)


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
        bad("gspo: config a list", lambda: _verl().compute_policy_loss_gspo(OLD, LOGP, ADV, MASK, config=[0.2]),
            TypeError,
            r"config must be verl's ActorConfig"),
        bad("loss: global_batch_info batch_num_tokens 0", _verl_loss(batch_info={"batch_num_tokens": 0}), ValueError,
            r"batch_num_tokens is 0\.0 but this batch alone scores 8"),
        bad("loss: global_batch_info global_batch_size 0",
            _verl_loss(batch_info={"global_batch_size": 0}, loss_agg_mode="seq-mean-token-mean"),
            ValueError, r"global_batch_size is 0\.0 but this batch alone has 3"),
        bad("loss: config missing", _verl_loss(config=None), ValueError, r"config \(verl's ActorConfig\) is required"),
        bad("loss: no clip ratio", _verl_loss({"clip_ratio": None, "clip_ratio_low": None}), ValueError,
            r"config.clip_ratio_low and config.clip_ratio are both None"),
        bad("loss: clip_ratio_low negative", _verl_loss({"clip_ratio_low": -0.2}), ValueError,
            r"clip_ratio_low=-0\.2 is out of range"),
        bad("loss: dp_size 0", _verl_loss(batch_info={"dp_size": 0}), ValueError, r"dp_size=0 is out of range"),
        bad("loss: log_prob list", _verl_loss(log_prob=LOGP.tolist()), TypeError, r"log_prob must be a torch.Tensor"),
        bad("loss: old_log_prob int", _verl_loss(old_log_prob=OLD.long()), TypeError, r"old_log_prob must be float"),
        bad("loss: response_mask shape", _verl_loss(response_mask=MASK[:, :2]), ValueError,
            r"response_mask must have shape \[3, 4\], got \(3, 2\)"),
        bad("loss: response_mask negative", _verl_loss(response_mask=with_value(MASK.float(), (0, 1), -1.0)),
            ValueError,
            r"mask: sample 0, position 1 is -1\.0"),
        bad("loss: rollout_is_weights negative", _verl_loss(rollout_is_weights=-torch.ones(3, 4)), ValueError,
            r"rollout_is_weights: sample 0, position 0 is -1\.0"),
        bad("loss: loss_agg_mode", _verl_loss(loss_agg_mode="mean"), ValueError, r"loss_agg_mode='mean'"),
        bad("loss: clip ratios both 0", _verl_loss({"clip_ratio": 0.0, "clip_ratio_low": 0.0, "clip_ratio_high": 0.0}),
            ValueError, r"clip_ratio_low=0 and clip_ratio_high=0 make the clip interval \[1, 1\]"),
        bad("loss: EasyR1's seq mode with verl's dp_size", _verl_loss(batch_info={"dp_size": 2, "global_batch_size": 3},
                                                                      loss_agg_mode="seq"),
            ValueError, r"loss_agg_mode='seq' \(EasyR1's\) averages over this batch alone: dp_size=2"),
        ok("loss: loss_scale_factor with token-mean (verl ignores it)", _verl_loss(batch_info={"loss_scale_factor": 64}),
           lambda r: torch.equal(r[0], _verl_loss()()[0])),
        bad("gspo: response_mask shape",
            lambda: _verl().compute_policy_loss_gspo(OLD, LOGP, ADV, MASK[:2], config=_actor_config()),
            ValueError, r"response_mask must have shape \[3, 4\]"),
        bad("grpo: token_level_rewards 1-D", _verl_adv(token_level_rewards=TOKEN_REWARDS[:, 0]), ValueError,
            r"token_level_rewards must be 2-D"),
        bad("grpo: token_level_rewards int", _verl_adv(token_level_rewards=TOKEN_REWARDS.long()), TypeError,
            r"token_level_rewards must be float"),
        bad("grpo: response_mask shape", _verl_adv(response_mask=torch.ones(6, 1)), ValueError,
            r"response_mask must have shape \[6, 4\], got \(6, 1\)"),
        bad("grpo: index length", _verl_adv(index=UIDS[:5]), ValueError,
            r"index has 5 entries but token_level_rewards has 6 rows"),
        bad("grpo: epsilon 0", _verl_adv(epsilon=0.0), ValueError, r"epsilon=0\.0 is out of range"),
        bad("grpo: norm flag str", _verl_adv(norm_adv_by_std_in_grpo="false"), TypeError,
            r"norm_adv_by_std_in_grpo must be True or False"),
        bad("rloo: index length", _verl_adv("rloo", index=UIDS[:4]), ValueError, r"index has 4 entries"),
        bad("rloo: response_mask shape", _verl_adv("rloo", response_mask=torch.ones(4)), ValueError,
            r"response_mask must have shape"),
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
        bad("average_loss values int", lambda: easyr1.average_loss(LOGP.long(), MASK, "token"), TypeError,
            r"values must be float"),
        bad("average_loss mask shape", lambda: easyr1.average_loss(LOGP, MASK[0], "token"), ValueError,
            r"mask must have shape \[3, 4\]"),
        bad("average_loss mask negative", lambda: easyr1.average_loss(LOGP, -MASK.float(), "seq"), ValueError,
            r"mask: sample 0, position 0 is -1\.0"),
        bad("average_loss eps", lambda: easyr1.average_loss(LOGP, MASK, "token", eps=1e-6), ValueError, r"eps=1e-06"),
        bad("compute_kl int", lambda: easyr1.compute_kl(LOGP.long(), OLD, "kl"), TypeError, r"log_probs must be float"),
        bad("compute_kl shape", lambda: easyr1.compute_kl(LOGP, OLD[0], "kl"), ValueError,
            r"ref_log_probs must have shape \[3, 4\]"),
        bad("compute_kl kind", lambda: easyr1.compute_kl(LOGP, OLD, "full"), ValueError, r"kl_penalty='full'"),
        bad("loss: loss_type", pl(loss_type="sapo"), ValueError, r"loss_type='sapo'"),
        bad("loss: loss_avg_mode", pl(loss_avg_mode="token-mean"), ValueError,
            r"loss_avg_mode='token-mean': EasyR1 averages by"),
        bad("loss: clip_ratio_low", pl(clip_ratio_low=1.0), ValueError, r"clip_ratio_low=1\.0"),
        bad("loss: clip_ratio_high negative", pl(clip_ratio_high=-0.1), ValueError,
            r"clip_ratio_high=-0\.1 is out of range"),
        bad("loss: clip_ratio_dual", pl(clip_ratio_dual=0.5), ValueError,
            r"clip_ratio_dual=0\.5: the dual-clip bound must be > 1"),
        bad("loss: clip ratios both 0", pl(clip_ratio_low=0.0, clip_ratio_high=0.0), ValueError,
            r"clip_ratio_low=0 and clip_ratio_high=0 clip every ratio"),
        bad("loss_config: loss_type named", lambda: easyr1.loss_config(0.2, 0.3, 3.0, "cispo", "token", names="config."),
            ValueError, r"config\.loss_type='cispo': the fused loss implements default, gspo, gspo_token"),
        bad("loss_config: clip ratios both 0 named", lambda: easyr1.loss_config(0, 0, 3.0, "default", "seq",
                                                                                names="config."),
            ValueError, r"config\.clip_ratio_low=0 and config\.clip_ratio_high=0"),
        bad("loss: response_mask shape", pl(response_mask=MASK[:1]), ValueError,
            r"response_mask must have shape \[3, 4\]"),
        bad("loss: log_probs int", pl(log_probs=LOGP.long()), TypeError, r"log_probs must be float"),
        bad("loss: advantages nan", pl(advantages=with_value(ADV, (0, 0), NAN)), ValueError,
            r"advantages: sample 0, position 0 is nan"),
        bad("grpo: index length", adv(index=UIDS[:5]), ValueError,
            r"index has 5 entries but token_level_rewards has 6 rows"),
        bad("grpo: eps 0", adv(eps=0.0), ValueError, r"eps=0\.0 is out of range"),
        bad("grpo: token_level_rewards nan", adv(token_level_rewards=with_value(TOKEN_REWARDS, (2, 1), NAN)), ValueError,
            r"token_level_rewards: row 2, column 1 is nan: rewards must be finite"),
        bad("grpo: token_level_rewards -inf", adv(token_level_rewards=with_value(TOKEN_REWARDS, (0, 3), -math.inf)),
            ValueError, r"token_level_rewards: row 0, column 3 is -inf"),
        bad("grpo: token_level_rewards meta", adv(token_level_rewards=TOKEN_REWARDS.to("meta")), ValueError,
            r"token_level_rewards is on the meta device"),
        bad("compute_kl: meta", lambda: easyr1.compute_kl(LOGP.to("meta"), LOGP, "kl"), ValueError,
            r"log_probs is on the meta device"),
        bad("grpo: index set", adv(index=set(UIDS)), TypeError, r"index must be in row order.*got a set"),
        bad("grpo: response_mask shape", adv(response_mask=torch.ones(6)), ValueError,
            r"response_mask must have shape \[6, 4\]"),
        bad("grpo: single response", adv(index=["a", "a", "b", "b", "c", "d"]), ValueError,
            r"group 'c' \(sample 4\) has a single"),
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
        bad("impl_backend", lambda: FusedLinearForPPO(impl_backend="cuda"), ValueError,
            r"Unsupported FusedLinearForPPO backend"),
        bad("hidden_states list", _fused(hidden_states=[[0.0]]), TypeError, r"hidden_states must be a torch.Tensor"),
        bad("hidden_states 4-D", _fused(hidden_states=torch.zeros(1, 2, 5, 16)), ValueError,
            r"hidden_states must be 2D or 3D"),
        bad("input_ids float", _fused(input_ids=ids.float()), TypeError, r"input_ids must be an integer tensor"),
        bad("input_ids list", _fused(input_ids=ids.tolist()), TypeError, r"input_ids must be a torch.Tensor"),
        bad("input_ids shape", _fused(input_ids=ids[:, :4]), ValueError, r"must match hidden_states shape"),
        bad("input_ids ignore index", _fused(input_ids=with_value(ids, (0, 3), -100)), ValueError,
            r"input_ids\[0, 3\] = -100 .*ignore index"),
        bad("input_ids outside vocabulary", _fused(input_ids=with_value(ids, (1, 2), 40)), ValueError,
            r"input_ids\[1, 2\] = 40 is out of range: there are 30 vocabulary"),
        bad("input_ids packed outside vocabulary", _fused((7,), input_ids=with_value(torch.arange(7), 5, 30)),
            ValueError,
            r"input_ids\[5\] = 30 is out of range"),
        bad("vocab_weights dtype", _fused(vocab_weights=W.double()), TypeError,
            r"hidden_states is torch.float32 but vocab_weights"),
        bad("temperature str", _fused(temperature="1"), TypeError, r"temperature must be a number"),
        bad("temperature 0", _fused(temperature=0.0), ValueError, r"temperature must be a finite number >= 1e-05"),
        bad("scoring rows float", lambda: scoring(torch.tensor([1.0]), torch.tensor([0, 3])).__enter__(), TypeError,
            r"rows must be int64"),
        bad("scoring cu_seqlens 2-D", lambda: scoring(torch.tensor([1]), torch.tensor([[0, 3]])).__enter__(),
            ValueError,
            r"cu_seqlens must be 1-D"),
        bad("enable response_only str", lambda: enable(response_only="yes"), TypeError,
            r"response_only must be True or False"),
        ok("3-D", _fused(), lambda r: r[0].shape == (2, 5)),
        ok("2-D", _fused((7,)), lambda r: r[0].shape == (7,)),
    ]


def _trl_config_cases() -> list[Case]:
    from rlk_mm.integrations.trl import loss_config

    def config(**kw):
        args = dict(loss_type="grpo", importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.2, delta=None,
                    num_completions=4)
        args.update(kw)
        return lambda: loss_config(**args)

    return [
        bad("epsilons both 0", config(epsilon_low=0.0, epsilon_high=0.0), ValueError,
            r"epsilon=0 and epsilon_high=0 make the clip interval \[1, 1\]"),
        bad("num_completions bool", config(loss_type="luspo", num_completions=True), TypeError,
            r"num_completions must be an int"),
        bad("num_completions float", config(loss_type="dr_grpo", num_completions=4.5, max_completion_length=8),
            TypeError, r"num_completions must be an int"),
        ok("epsilon 0 on one side", config(epsilon_low=0.0), lambda c: c.clip_ratio_low == 0.0),
        ok("luspo's count", config(loss_type="luspo"), lambda c: c.global_batch_size == 4.0),
    ]


CASES = {"easyr1": _easyr1_cases, "verl_fused": _verl_fused_cases, "trl config": _trl_config_cases}


@pytest.mark.parametrize("case", table(CASES))
def test_inputs(case):
    assert_well(case)


VERL_CASES = {"verl": _verl_cases}


@pytest.mark.parametrize("case", table(VERL_CASES))
def test_verl_inputs(requires_verl, case):
    assert_well(case)



@settings(deadline=None, max_examples=40)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=6, max_size=6))
def test_outcome_advantage_refuses_exactly_non_finite_rewards(scores):
    """EasyR1's GRPO advantage accepts a reward tensor exactly when every entry is finite, and then its
    advantages are finite."""
    rewards = torch.zeros(6, 4)
    rewards[:, -1] = torch.tensor(scores)
    call = lambda: easyr1.compute_grpo_outcome_advantage(rewards, torch.ones(6, 4), UIDS)  # noqa: E731
    if all(math.isfinite(v) for v in scores):
        assert bool(torch.isfinite(call()[0]).all())
    else:
        with pytest.raises(ValueError, match=r"token_level_rewards: row \d, column 3 is .*must be finite"):
            call()
