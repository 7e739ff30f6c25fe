"""verl 0.9.1's own actor worker, driven as its PPO trainer drives it, with verl's defaults and
with rlk_mm switched on as the README says; on the CPU, around the tiny Qwen2.5-VL with images.

Each arm is a Ray worker group of verl's ``ActorRolloutRefWorker`` (role ``actor``) built from
verl's own ``ppo_trainer`` config. The trainer's own ``_compute_old_log_prob`` and
``_update_actor`` drive it: ``compute_log_prob``, then ``update_actor`` on the same rollout with
those log-probs as ``old_log_probs``. The rlk_mm arm differs only by the README's switch:
``policy_loss.loss_mode=rlk_mm``, ``model.use_fused_kernels=True`` and ``RLK_MM_VERL_FUSED=1``
in the workers' environment (verl loads the plugin there), so its ``update_actor`` computes the
loss in the LM head (``linear_policy_loss``, three products). Two layouts:

* ``padded`` (``use_remove_padding=False``): verl's defaults (token-mean, no KL, no entropy bonus);
* ``packed`` (``use_remove_padding=True``): seq-mean-token-mean, a k3 KL loss to reference
  log-probs, an entropy bonus, rollout IS weights, and old log-probs shifted by fixed noise so
  that the clip and the dual clip bind; the same data and knobs in both arms.

Checked against the contract (``rlk_mm.parity.contract``): the log-probs and entropy of
``compute_log_prob`` on response tokens, every loss metric of ``update_actor`` and its grad
norm, and the parameters after the update; that the rlk_mm arm scores response tokens only
(its log-probs are exactly zero everywhere else) and that its loss was the fused one. The
optimizer is SGD (lr 1, no weight decay), so the update is the clipped gradient itself:
AdamW's first step is about lr * sign(g), which would hide gradient differences.

Test-only shims for verl's GPU assumptions are in ``verl_cpu`` (see there). Runs in the verl
environment that ``tests/integrations/frameworks/verl_env.sh`` builds (verl needs transformers < 5.11);
skipped elsewhere.
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import os
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent


def _why_not_here():
    """Why verl's worker cannot run in this environment, or None."""
    try:
        needs = next(r for r in map(Requirement, importlib.metadata.requires("verl") or ()) if r.name == "transformers")
        has = importlib.metadata.version("transformers")
    except (importlib.metadata.PackageNotFoundError, StopIteration):
        return "verl is not installed: run tests/integrations/frameworks/verl_env.sh"
    if has not in needs.specifier:
        return f"verl needs transformers{needs.specifier}, here {has}: run tests/integrations/frameworks/verl_env.sh"
    return None


if _why_not_here():
    pytest.skip(_why_not_here(), allow_module_level=True)

#: the shims' switches (verl_cpu), set before verl is imported here and inherited by the Ray workers
SHIM_ENV = {"VERL_USE_EXTERNAL_MODULES": "verl_cpu", "VERL_PLATFORM": "cpu"}
os.environ.update(SHIM_ENV)
sys.path.insert(0, str(HERE))  # verl_cpu, for verl's import of it here

import ray  # noqa: E402
import verl  # noqa: E402,F401  (first: verl imports verl_cpu whole, before it loads rlk_mm's plugin)
import verl_cpu  # noqa: E402
from hydra import compose, initialize_config_module  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.single_controller.base.decorator import Dispatch, register  # noqa: E402
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from verl.trainer.ppo.ray_trainer import RayPPOTrainer  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402

from rlk_mm.fixtures import processor_inputs, qwen_vl_processor, synthetic_image_text, tiny_qwen2_5_vl  # noqa: E402
from rlk_mm.integrations.verl import fused as verl_fused  # noqa: E402
from rlk_mm.integrations.verl import fused_loss  # noqa: E402
from rlk_mm.integrations.verl import rows as verl_rows  # noqa: E402
from rlk_mm.parity.contract import (  # noqa: E402
    ELEMENTWISE_LOSS_MAX_ABS,
    LOGPROB_GRAD_REL,
    LOGPROB_MAX_ABS,
    relative_error,
)

SAMPLES, RESPONSE_LEN, MICRO_BATCH = 4, 24, 2
#: the README's switch: verl's defaults plus these (config overrides, workers' environment)
RLK_MM = (["actor_rollout_ref.actor.policy_loss.loss_mode=rlk_mm", "actor_rollout_ref.model.use_fused_kernels=True"],
          {"RLK_MM_VERL_FUSED": "1"})
#: per layout: use_remove_padding, the knobs both arms share, and whether the rollout carries
#: reference log-probs, IS weights and shifted old log-probs
LAYOUTS = {
    "padded": (False, [], False),
    "packed": (True, [
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
    ], True),
}
#: what update_actor reports and both arms must agree on, within ELEMENTWISE_LOSS_MAX_ABS
LOSS_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


class CPUActorWorker(ActorRolloutRefWorker):
    """verl's worker, plus test-only additions: a one-rank gloo group made before verl makes
    its own (shim: see ``verl_cpu``), ``parameters()`` to read the actor's weights, and
    ``rlk_mm_state()``: whether the plugin is fully on here and how often the LM head computed
    the fused loss (observed by wrapping ``FusedLossPlan.compute``, which it then calls)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        verl_cpu.install()
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        self._fused_losses = 0
        compute = fused_loss.FusedLossPlan.compute

        def counted(plan, *args, **kwargs):
            self._fused_losses += 1
            return compute(plan, *args, **kwargs)

        fused_loss.FusedLossPlan.compute = counted

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def parameters(self):
        return {name: p.detach().clone() for name, p in self.actor.engine.module.named_parameters()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rlk_mm_state(self):
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        wrapped = FSDPEngineWithLMHead.__dict__["forward_step"].__code__ is verl_fused._WRAPPER_CODE
        return {"class": verl_fused.enabled(), "engine": wrapped, "fused_losses": self._fused_losses}


def trainer_config(model_dir: Path, remove_padding: bool, extra: list[str]):
    """verl's ``ppo_trainer`` config, as its CLI composes it, for one CPU actor."""
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.use_remove_padding={remove_padding}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # shim: flash-attn 2 needs a GPU
        f"actor_rollout_ref.actor.ppo_mini_batch_size={SAMPLES}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO_BATCH}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={MICRO_BATCH}",
        "actor_rollout_ref.actor.optim.total_training_steps=1",
        "actor_rollout_ref.actor.optim.optimizer=SGD",  # the update is the clipped gradient (module docstring)
        "actor_rollout_ref.actor.optim.lr=1.0",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        *extra,
    ]
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def rollout(model, processor, seed: int = 0) -> DataProto:
    """A rollout as verl's agent loop hands it to the trainer: left-padded prompts with
    images, right-padded responses (one tool token inside masked out of ``response_mask``),
    4-row M-RoPE position ids, per-sample ``multi_modal_inputs``, outcome advantages."""
    samples = synthetic_image_text(SAMPLES, seed=seed, max_images=2)
    prompt = processor_inputs(processor, samples)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(RESPONSE_LEN // 3, RESPONSE_LEN + 1, (SAMPLES,), generator=g)
    response_mask = (torch.arange(RESPONSE_LEN) < lengths[:, None]).long()
    vocab = model.config.text_config.vocab_size
    responses = torch.randint(0, vocab, (SAMPLES, RESPONSE_LEN), generator=g) * response_mask
    attention_mask = torch.cat([prompt["attention_mask"], response_mask], 1)
    response_mask[0, 2] = 0  # a tool-output token: attended, not trained on
    input_ids = torch.cat([prompt["input_ids"], responses], 1)
    mm_token_type_ids = torch.cat([prompt["mm_token_type_ids"], torch.zeros_like(responses)], 1)
    vision_positions, _ = model.model.get_rope_index(
        input_ids, mm_token_type_ids, image_grid_thw=prompt["image_grid_thw"], attention_mask=attention_mask
    )
    text_positions = (attention_mask.cumsum(1) - 1).clamp(min=0)
    position_ids = torch.cat([text_positions[None], vision_positions]).transpose(0, 1)  # [B, 4, L]

    grids = prompt["image_grid_thw"].split([len(s.images) for s in samples])
    pixels = prompt["pixel_values"].split([int(grid.prod(-1).sum()) for grid in grids])
    multi_modal_inputs = np.array(
        [{"pixel_values": p, "image_grid_thw": grid, "images_seqlens": grid[:, 1] * grid[:, 2]}
         for p, grid in zip(pixels, grids)],
        dtype=object,
    )
    advantages = torch.randn(SAMPLES, 1, generator=g) * response_mask
    return DataProto.from_dict(
        tensors={
            "prompts": prompt["input_ids"], "responses": responses, "response_mask": response_mask,
            "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "advantages": advantages,
        },
        non_tensors={"multi_modal_inputs": multi_modal_inputs},
        meta_info={
            "global_token_num": attention_mask.sum(-1).tolist(),
            "images_seqlens": torch.cat([m["images_seqlens"] for m in multi_modal_inputs]).tolist(),
            "temperature": 1.0,
        },
    )


def off_policy(batch: DataProto, old: DataProto) -> DataProto:
    """The packed layout's extras, the same in both arms: old log-probs shifted by fixed noise
    (so the clip and the dual clip bind), reference log-probs and rollout IS weights."""
    g = torch.Generator().manual_seed(7)
    mask = batch.batch["response_mask"].float()
    logp = old.batch["old_log_probs"]
    noise = lambda scale: torch.randn(logp.shape, generator=g) * scale * mask  # noqa: E731
    extra = {
        "old_log_probs": logp + noise(1.0),
        "ref_log_prob": logp + noise(0.3),
        "rollout_is_weights": (0.5 + torch.rand(logp.shape, generator=g)) * mask,
    }
    return DataProto.from_dict(tensors={**old.batch, **extra})


class _Recorder:
    """The worker group as the trainer sees it; keeps what ``compute_log_prob`` got and returned."""

    def __init__(self, group):
        self.group, self.log_prob_input, self.log_prob_output = group, None, None

    def compute_log_prob(self, data):
        self.log_prob_input, self.log_prob_output = data, self.group.compute_log_prob(data)
        return self.log_prob_output

    def update_actor(self, data):
        return self.group.update_actor(data)


def run_arm(config, off_policy_extras: bool, batch: DataProto, env=None) -> dict:
    """One trainer step of verl's actor on ``batch``: log-probs, the update's metrics, the weights."""
    pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
    worker = RayClassWithInitArgs(cls=ray.remote(CPUActorWorker), config=config.actor_rollout_ref, role="actor")
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker, device_name="cpu", worker_env=env or {})
    try:
        group.init_model()
        trainer = SimpleNamespace(config=config, actor_rollout_wg=_Recorder(group))
        batch = copy.deepcopy(batch)  # the trainer adds to it
        old, _ = RayPPOTrainer._compute_old_log_prob(trainer, batch)
        update_input = batch.union(off_policy(batch, old) if off_policy_extras else old)
        metrics = RayPPOTrainer._update_actor(trainer, update_input).meta_info["metrics"]
        (params,) = group.parameters()
        (state,) = group.rlk_mm_state()
    finally:  # give the CPU back for the next arm
        for handle in group.workers:
            ray.kill(handle)
        for placement_group in pool.pgs or ():
            ray.util.remove_placement_group(placement_group)
    recorded = trainer.actor_rollout_wg
    return {
        "log_probs": old.batch["old_log_probs"], "entropy": old.batch["entropys"],
        "all_log_probs": tu.get(recorded.log_prob_output, "log_probs").values(),
        "log_prob_input": recorded.log_prob_input, "metrics": metrics, "params": params, "state": state,
    }


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {**SHIM_ENV, "PYTHONPATH": str(HERE)}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    tiny_qwen2_5_vl(seed=0).save_pretrained(path)
    qwen_vl_processor().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def batch():
    return rollout(tiny_qwen2_5_vl(seed=0), qwen_vl_processor())


@pytest.fixture(scope="module", params=list(LAYOUTS))
def arms(request, cluster, model_dir, batch):
    """Both arms of one layout, run side by side (one CPU each)."""
    remove_padding, knobs, extras = LAYOUTS[request.param]
    overrides, env = RLK_MM
    configs = (trainer_config(model_dir, remove_padding, knobs),
               trainer_config(model_dir, remove_padding, knobs + overrides))
    with ThreadPoolExecutor(2) as pool:  # hydra's composing above is not thread-safe; the runs are
        verl_arm = pool.submit(run_arm, configs[0], extras, batch)
        rlk_mm_arm = pool.submit(run_arm, configs[1], extras, batch, env)
        return request.param, {"verl": verl_arm.result(), "rlk_mm": rlk_mm_arm.result()}


def _scalar(value) -> float:
    """A metric as ``_update_actor`` reports it (a float, or a list of one per step)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    assert len(values) == 1, f"one optimizer step expected, got {values}"
    return float(values[0])


def test_plugin_is_fully_on_and_fuses_the_loss(arms):
    _, runs = arms
    assert runs["verl"]["state"] == {"class": False, "engine": False, "fused_losses": 0}
    # one fused loss per training micro-batch: SAMPLES / MICRO_BATCH of them
    assert runs["rlk_mm"]["state"] == {"class": True, "engine": True, "fused_losses": SAMPLES // MICRO_BATCH}


def test_log_probs_and_entropy_agree_on_response_tokens(arms, batch):
    _, runs = arms
    mask = batch.batch["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        ours, theirs = runs["rlk_mm"][key][mask], runs["verl"][key][mask]
        assert (ours - theirs).abs().max() <= LOGPROB_MAX_ABS.fp32, key


def test_only_response_rows_are_scored(arms):
    _, runs = arms
    ours, theirs = runs["rlk_mm"], runs["verl"]
    rows, _ = verl_rows.response_rows(ours["log_prob_input"])
    scored = torch.zeros(ours["all_log_probs"].numel(), dtype=torch.bool)
    scored[rows] = True
    assert torch.count_nonzero(ours["all_log_probs"][~scored]) == 0
    assert torch.count_nonzero(theirs["all_log_probs"][~scored]) > 0  # verl scores them: the check can fail
    assert (ours["all_log_probs"][scored] - theirs["all_log_probs"][scored]).abs().max() <= LOGPROB_MAX_ABS.fp32


def test_update_agrees(arms, model_dir):
    layout, runs = arms
    ours, theirs = runs["rlk_mm"]["metrics"], runs["verl"]["metrics"]
    names = LOSS_METRICS + (("actor/entropy_loss", "actor/kl_loss") if LAYOUTS[layout][2] else ())
    assert set(names) <= set(ours) and set(names) <= set(theirs)
    tol = ELEMENTWISE_LOSS_MAX_ABS.fp32  # relative to values above 1 (sums round off as they grow)
    for name in names:
        assert _scalar(ours[name]) == pytest.approx(_scalar(theirs[name]), rel=tol, abs=tol), name
    if LAYOUTS[layout][2]:  # the knobs bind: both clips, the KL and entropy terms
        assert all(_scalar(theirs[f"actor/{name}"]) > 0 for name in ("pg_clipfrac", "pg_clipfrac_lower", "kl_loss"))
    grad_norm = _scalar(ours["actor/grad_norm"]), _scalar(theirs["actor/grad_norm"])
    assert grad_norm[1] > 0 and abs(grad_norm[0] - grad_norm[1]) <= LOGPROB_GRAD_REL.fp32 * grad_norm[1]

    before = dict(tiny_qwen2_5_vl(seed=0).named_parameters())
    names = sorted(runs["verl"]["params"])
    assert names == sorted(before)
    update = {arm: torch.cat([(runs[arm]["params"][k] - before[k]).flatten() for k in names]) for arm in runs}
    assert update["verl"].abs().max() > 0
    assert relative_error(update["rlk_mm"], update["verl"]) <= LOGPROB_GRAD_REL.fp32


# ---------------------------------------------------------------- the plugin in this process
@pytest.fixture
def fresh_plugin():
    """verl's engine and LM-head class as verl ships them, before and after the test."""
    verl_fused.disable()
    yield
    importlib.import_module("rlk_mm.integrations.verl.fused").disable()


def test_enable_completes_after_the_engine_failed_to_import(fresh_plugin, monkeypatch):
    from verl.utils.experimental import torch_functional
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    verl_class, verl_step = torch_functional.FusedLinearForPPO, FSDPEngineWithLMHead.__dict__["forward_step"]
    real_import = importlib.import_module

    def failing(name, *args):
        if name == verl_fused._FSDP_ENGINE:
            raise ImportError("simulated: an optional dependency of verl's engine is missing")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", failing)
    with pytest.warns(RuntimeWarning, match="every row is scored.*enable\\(\\) again"):
        assert verl_fused.enable() is False
    assert torch_functional.FusedLinearForPPO is verl_fused.FusedLinearForPPO  # half on
    assert FSDPEngineWithLMHead.__dict__["forward_step"] is verl_step
    monkeypatch.setattr(importlib, "import_module", real_import)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert verl_fused.enable() is True and verl_fused.enable() is True  # completes, then idempotent
    assert FSDPEngineWithLMHead.__dict__["forward_step"].__code__ is verl_fused._WRAPPER_CODE
    verl_fused.disable()
    assert torch_functional.FusedLinearForPPO is verl_class
    assert FSDPEngineWithLMHead.__dict__["forward_step"] is verl_step


def test_reimport_is_tolerated(fresh_plugin):
    from verl.trainer.ppo import core_algos
    from verl.utils.experimental import torch_functional
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    verl_class, verl_step = torch_functional.FusedLinearForPPO, FSDPEngineWithLMHead.__dict__["forward_step"]
    verl_fused.enable()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither "already registered" nor a plugin warning
        fused = importlib.reload(verl_fused)
        adapter = importlib.reload(importlib.import_module("rlk_mm.integrations.verl"))
        assert fused.enable() is True
    assert core_algos.get_adv_estimator_fn("rlk_mm_grpo") is adapter.compute_grpo_outcome_advantage
    assert core_algos.get_policy_loss_fn("rlk_mm") is adapter.compute_policy_loss
    assert torch_functional.FusedLinearForPPO is fused.FusedLinearForPPO
    step = FSDPEngineWithLMHead.__dict__["forward_step"]
    assert step.__code__ is fused._WRAPPER_CODE and step.__wrapped__ is verl_step  # not a wrapper of a wrapper
    fused.disable()  # the new import's disable gives verl's own objects back, not the old import's
    assert torch_functional.FusedLinearForPPO is verl_class
    assert FSDPEngineWithLMHead.__dict__["forward_step"] is verl_step


def test_plugin_completes_when_verl_imports_its_engine_later():
    """The half-on state as a platform plugin causes it: ``verl_cpu`` imported before verl, so
    that verl loads rlk_mm's plugin while the ``cpu`` platform is not registered yet and its
    engine cannot be imported. The plugin warns, and wraps the engine once verl imports it."""
    script = (
        "import warnings; warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    import verl_cpu\n"
        "from rlk_mm.integrations.verl import fused as verl_fused\n"
        "print('warned', any('rlk_mm wraps it when verl imports it' in str(w.message) for w in caught))\n"
        "print('half', verl_fused.enabled(), verl_fused._FSDP_ENGINE in __import__('sys').modules)\n"
        "from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead as E\n"
        "print('full', E.__dict__['forward_step'].__code__ is verl_fused._WRAPPER_CODE)\n"
    )
    env = {**os.environ, **SHIM_ENV, "RLK_MM_VERL_FUSED": "1", "PYTHONPATH": str(HERE)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:3] == ["warned True", "half True False", "full True"], out.stdout
