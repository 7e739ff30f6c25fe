"""verl integration: the registered loss and estimators match verl 0.9.1's own, and verl's
plugin loader finds them through the entry point declared in pyproject.toml."""

import dataclasses
import importlib
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from rlk_mm.parity.contract import ELEMENTWISE_LOSS_MAX_ABS
from support.helpers import close, skip_module_without_verl

skip_module_without_verl()  # an installed verl that fails to import errors below, never skips
import verl.trainer.ppo.core_algos as core_algos  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from rlk_mm.integrations import verl as rlk_verl  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOL = ELEMENTWISE_LOSS_MAX_ABS.fp32


def batch(seed, B=8, R=19):
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(B, R, generator=g) * 0.5 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, R, generator=g) * 0.3
    adv = torch.randn(B, R, generator=g)
    mask = torch.arange(R)[None] < torch.randint(0, R + 1, (B,), generator=g)[:, None]
    mask[1] = False
    return logp, old, adv, mask


def config(**kw):
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2, **kw)


@pytest.mark.parametrize("mode",
                         ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                          "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("with_weights", [False, True])
def test_registered_loss_equals_vanilla(mode, with_weights):
    logp, old, adv, mask = batch(1)
    weights = torch.rand(mask.shape) + 0.5 if with_weights else None
    cfg = config(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.3, clip_ratio_c=4.0)
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=torch.tensor(150), global_batch_size=16,
                                 loss_scale_factor=40)
    fn = core_algos.get_policy_loss_fn("rlk_mm")
    assert fn is rlk_verl.compute_policy_loss
    expected, m_expected = core_algos.compute_policy_loss_vanilla(old, logp, adv, mask, mode, cfg, weights)
    (g_expected,) = torch.autograd.grad(expected, logp)
    actual, m_actual = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                          loss_agg_mode=mode, config=cfg, rollout_is_weights=weights)
    (g_actual,) = torch.autograd.grad(actual, logp)
    close(actual, expected)
    close(g_actual, g_expected)
    assert m_actual.keys() == m_expected.keys()
    assert all(isinstance(v, float) for v in m_actual.values())
    for k in m_expected:
        assert m_actual[k] == pytest.approx(m_expected[k], abs=TOL)


def test_registered_gspo_equals_verl_gspo():
    logp, old, adv, mask = batch(2)
    adv = adv[:, :1].expand_as(adv).contiguous()  # sequence-level advantages, as GSPO uses
    cfg = config(clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    expected, m_expected = core_algos.compute_policy_loss_gspo(old, logp, adv, mask, "seq-mean-token-mean", cfg)
    (g_expected,) = torch.autograd.grad(expected, logp)
    actual, m_actual = core_algos.get_policy_loss_fn("rlk_mm_gspo")(old, logp, adv, mask, "seq-mean-token-mean", cfg)
    (g_actual,) = torch.autograd.grad(actual, logp)
    close(actual, expected)
    close(g_actual, g_expected)
    for k in m_expected:
        assert m_actual[k] == pytest.approx(m_expected[k], abs=TOL)


def uids(seed, B):
    """verl-style uid strings: groups of 4, one singleton group, shuffled order."""
    g = np.random.default_rng(seed)
    ids = np.array([f"uid-{i // 4}" for i in range(B - 1)] + ["lonely"], dtype=object)
    return ids[g.permutation(B)]


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_estimator_equals_verl(norm):
    B, R = 21, 7
    g = torch.Generator().manual_seed(3)
    mask = (torch.arange(R)[None] < torch.randint(0, R + 1, (B,), generator=g)[:, None]).float()
    rewards = torch.randn(B, R, generator=g) * mask
    index = uids(3, B)
    expected = core_algos.compute_grpo_outcome_advantage(rewards.clone(), mask, index, norm_adv_by_std_in_grpo=norm)
    est = core_algos.get_adv_estimator_fn("rlk_mm_grpo")
    actual = est(token_level_rewards=rewards, response_mask=mask, index=index, norm_adv_by_std_in_grpo=norm)
    for a, e in zip(actual, expected):
        close(a, e)
    # verl's trainer passes the algorithm config instead of the flag
    from verl.trainer.config import AlgoConfig

    via_config = est(token_level_rewards=rewards, response_mask=mask, index=index,
                     config=AlgoConfig(norm_adv_by_std_in_grpo=norm))
    close(via_config[0], expected[0])


def test_rloo_estimator_equals_verl():
    B, R = 17, 5
    g = torch.Generator().manual_seed(4)
    mask = torch.ones(B, R)
    mask[3] = 0
    rewards = torch.randn(B, R, generator=g)
    index = uids(4, B)
    expected = core_algos.compute_rloo_outcome_advantage(rewards.clone(), mask, index)
    actual = core_algos.get_adv_estimator_fn("rlk_mm_rloo")(token_level_rewards=rewards, response_mask=mask,
                                                            index=index)
    for a, e in zip(actual, expected):
        close(a, e)


def test_verl_plugin_entry_point_registers(tmp_path):
    """verl's own loader (verl/__init__.py) imports our pyproject entry point in a fresh process."""
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["verl.plugins"]
    dist = tmp_path / "rlk_mm_entry-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rlk-mm-entry\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[verl.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in entry.items()))
    script = textwrap.dedent(
        """
        import sys, torch
        import conftest  # the ray stand-in
        import verl  # loads the verl.plugins entry points
        assert "rlk_mm.integrations.verl" in sys.modules, "entry point not loaded"
        from verl.trainer.ppo import core_algos
        from verl.workers.config import ActorConfig
        fn = core_algos.get_policy_loss_fn("rlk_mm")
        x = torch.randn(2, 3)
        loss, metrics = fn(x, x, torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), "token-mean",
                           ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1))
        assert abs(loss.item() + 1.0) < 1e-6, loss
        assert "rlk_mm_grpo" in core_algos.ADV_ESTIMATOR_REGISTRY
        print("registered")
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), str(ROOT / "tests")]))
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    env.pop("RLK_MM_VERL_FUSED", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "registered" in done.stdout


def test_register_enables_fused_path_on_request(monkeypatch):
    monkeypatch.setenv("RLK_MM_VERL_FUSED", "1")
    try:
        verl_fused = importlib.import_module("rlk_mm.integrations.verl.fused")
    except ModuleNotFoundError:
        with pytest.raises(ModuleNotFoundError, match="verl.fused"):
            rlk_verl.register()
        return
    calls = []
    monkeypatch.setattr(verl_fused, "enable", lambda *a, **k: calls.append(1))
    rlk_verl.register()
    assert calls == [1]
    assert rlk_verl.enable is verl_fused.enable  # the re-export


def test_loss_config_is_built_in_one_place():
    """``verl.loss_config``: the actor config as one ``PolicyLossConfig`` (vanilla and gspo)."""
    from rlk_mm.ops import AggMode, RatioMode

    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_high=0.28)
    vanilla = rlk_verl.loss_config(cfg, "seq-mean-token-mean")
    assert (vanilla.clip_ratio_low, vanilla.clip_ratio_high, vanilla.clip_ratio_c) == (0.2, 0.28, 3.0)
    assert vanilla.ratio is RatioMode.TOKEN and vanilla.loss_agg_mode is AggMode.SEQ_MEAN_TOKEN_MEAN
    gspo = rlk_verl.loss_config(cfg, "token-mean", gspo=True)
    assert (gspo.ratio, gspo.clip_ratio_c, gspo.log_ratio_clamp) == (RatioMode.GSPO_TOKEN, None, (-float("inf"), 10.0))


def test_loss_config_of_the_loss_in_the_lm_head():
    """The loss the LM head computes (``verl.fused_loss``) runs under the same ``loss_config``: the
    clip ratios and ``clip_ratio_c`` read as for the registered loss, the global counts from the
    micro-batch (verl's ppo_loss copies them into global_batch_info only after the LM head ran),
    ``loss_scale_factor`` defaulting to the padded response length, the entropy bonus and the KL term."""
    from rlk_mm.ops import AggMode, KLType

    knobs = dict(clip_ratio_high=0.28, clip_ratio_c=4.0, loss_agg_mode="seq-mean-token-sum-norm", entropy_coeff=0.01,
                 use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.1)
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **knobs)
    counts = {"dp_size": 2, "batch_num_tokens": 23, "global_batch_size": 5}
    fused = rlk_verl.loss_config(cfg, micro_batch=counts, response_length=7, entropy=True)
    assert (fused.clip_ratio_low, fused.clip_ratio_high, fused.clip_ratio_c) == (0.2, 0.28, 4.0)
    assert fused.loss_agg_mode is AggMode.SEQ_MEAN_TOKEN_SUM_NORM and fused.loss_scale_factor == 7
    assert (fused.dp_size, fused.batch_num_tokens, fused.global_batch_size) == (2, 23, 5)
    assert (fused.entropy_coeff, fused.kl_type, fused.kl_coef) == (0.01, KLType.LOW_VAR_KL, 0.1)
    assert rlk_verl.loss_config(cfg, micro_batch=counts, response_length=7).entropy_coeff == 0.0
    scaled = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_scale_factor=16)
    assert rlk_verl.loss_config(scaled, micro_batch=counts, response_length=7).loss_scale_factor == 16
    # the registered loss: the same keys read the same way, the counts from global_batch_info, no entropy
    # bonus or KL term (verl's ppo_loss adds them)
    cfg.global_batch_info.update(counts, loss_scale_factor=None)
    vanilla = rlk_verl.loss_config(cfg, "seq-mean-token-sum-norm")
    assert dataclasses.replace(fused, loss_scale_factor=None, entropy_coeff=0.0, kl_coef=0.0) == vanilla
    # a mapping of the fields reads as the ActorConfig; clip_ratio_c is verl's 3.0 where it has none
    fields = {"clip_ratio": 0.2, **knobs}
    assert rlk_verl.loss_config(fields, micro_batch=counts, response_length=7, entropy=True) == fused
    del fields["clip_ratio_c"]
    assert rlk_verl.loss_config(fields, micro_batch=counts, response_length=7).clip_ratio_c == 3.0


def test_a_mapping_config_equals_the_actor_config():
    """Issue 31, D-06: a plain dict (or any mapping) of ActorConfig's fields works as the config,
    as verl's own ``config.get`` reads do; anything else is refused, naming ``config``."""
    logp, old, adv, mask = batch(4)
    fields = dict(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.3, clip_ratio_c=4.0)
    info = dict(dp_size=2, batch_num_tokens=150, global_batch_size=16)
    cfg = config(**fields)
    cfg.global_batch_info.update(info)
    for fn in (rlk_verl.compute_policy_loss, rlk_verl.compute_policy_loss_gspo):
        expected = fn(old, logp, adv, mask, "seq-mean-token-mean", cfg)[0]
        close(fn(old, logp, adv, mask, "seq-mean-token-mean", {**fields, "global_batch_info": info})[0], expected)
        plain = fn(old, logp, adv, mask, "seq-mean-token-mean", {"clip_ratio": 0.2})[0]  # the rest: verl's defaults
        close(plain, fn(old, logp, adv, mask, "seq-mean-token-mean", config(clip_ratio=0.2))[0])
        for bad in ("fsdp", 3, [0.2]):
            with pytest.raises(TypeError, match=r"config must be verl's ActorConfig \(or a mapping of its fields\)"):
                fn(old, logp, adv, mask, "token-mean", bad)


@pytest.mark.parametrize("info, mode, message", [
    (dict(batch_num_tokens=0), "token-mean", "batch_num_tokens is 0"),
    (dict(batch_num_tokens=5), "token-mean", "batch_num_tokens is 5"),
    (dict(global_batch_size=0), "seq-mean-token-mean", "global_batch_size is 0"),
    (dict(dp_size=2, global_batch_size=3, batch_num_tokens=200), "seq-mean-token-sum", "global_batch_size is 3"),
])
def test_global_batch_info_below_the_micro_batch_is_refused(info, mode, message):
    """Issue 31, D-01: verl's global counts are at least this micro-batch's (verl's own function
    gives -inf or a silently scaled loss; ours gave 0): refused, naming the count."""
    logp, old, adv, mask = batch(5)  # 6 of 8 rows hold tokens
    cfg = config()
    cfg.global_batch_info.update(info)
    with pytest.raises(ValueError, match=message):
        rlk_verl.compute_policy_loss(old, logp, adv, mask, mode, cfg)
