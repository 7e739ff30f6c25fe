"""rlk_mm's FusedLinearForPPO against verl 0.9.1's own class (torch backend, from the
installed wheel); response-only scoring on a micro-batch built by verl's own padding
helpers; enable()/disable() leave verl exactly as it was."""

import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from support.helpers import skip_module_without_verl

skip_module_without_verl()  # an installed verl that fails to import errors below, never skips
import verl.utils.experimental.torch_functional as verl_tf  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from rlk_mm.integrations.verl import fused as verl_fused  # noqa: E402
from rlk_mm.integrations.verl import fused_loss, lm_head  # noqa: E402
from rlk_mm.integrations.verl import rows as verl_rows  # noqa: E402
from rlk_mm.parity.contract import (  # noqa: E402
    ELEMENTWISE_LOSS_MAX_ABS,
    LOGPROB_GRAD_REL,
    LOGPROB_MAX_ABS,
    relative_error,
)

VERL_CLASS = verl_tf.FusedLinearForPPO

# Without peft (the main environment) verl's engine never imports, so each enable() warns that it
# is half on; test_enable_after_the_engine_failed_to_import... checks that warning itself.
pytestmark = pytest.mark.filterwarnings("ignore:rlk_mm. verl's FSDP engine:RuntimeWarning")


@pytest.fixture(autouse=True)
def _restore_verl():
    yield
    verl_fused.disable()


def _inputs(shape, H, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.2).to(dtype)
    ids = torch.randint(0, V, shape, generator=g)
    return h, w, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37,), (3, 13)], ids=["2d", "3d"])
def test_matches_verl_class(dtype, shape):
    """Ours on (dtype) inputs vs verl's class on the same inputs upcast to fp32."""
    H, V, temperature = 32, 250, 0.7
    h, w, ids = _inputs(shape, H, V, dtype)
    g = torch.Generator().manual_seed(1)
    up_logp, up_ent = torch.randn(shape, generator=g), torch.randn(shape, generator=g)

    def run(cls, h, w):
        hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = cls()(hg, wg, ids, temperature=temperature)
        torch.autograd.backward([logp, ent], [up_logp, up_ent.to(ent.dtype)])
        return logp, ent, hg.grad, wg.grad

    logp, ent, dh, dw = run(lm_head.FusedLinearForPPO, h, w)
    r_logp, r_ent, r_dh, r_dw = run(VERL_CLASS, h.float(), w.float())
    assert logp.shape == ent.shape == ids.shape
    assert (logp.dtype, ent.dtype) == (r_logp.dtype, torch.float32 if dtype == torch.float32 else dtype)
    tol, gtol = LOGPROB_MAX_ABS.for_dtype(dtype), LOGPROB_GRAD_REL.for_dtype(dtype)
    assert (logp - r_logp).abs().max() <= tol
    # entropy is returned in hidden_states' dtype, as verl does: the contract plus that rounding
    rounding = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2 * r_ent.abs().max().item()
    assert (ent.float() - r_ent).abs().max() <= tol + rounding
    assert dh.shape == h.shape and dh.dtype == dtype
    assert relative_error(dh, r_dh) <= gtol and relative_error(dw, r_dw) <= gtol


def test_constructor_and_errors_match_verl():
    ours = lm_head.FusedLinearForPPO(chunk_size=256, impl_backend="liger")
    assert (ours.chunk_size, ours.impl_backend) == (256, "liger")
    for cls in (VERL_CLASS, lm_head.FusedLinearForPPO):
        with pytest.raises(ValueError, match="Unsupported FusedLinearForPPO backend"):
            cls(impl_backend="cuda")
    h, w, ids = _inputs((4, 5), 16, 30, torch.float32)
    with pytest.raises(ValueError, match="must match hidden_states shape"):
        lm_head.FusedLinearForPPO()(h, w, ids[:, :4])


def test_autocast_gives_verl_dtypes():
    h, w, ids = _inputs((2, 6), 16, 40, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = lm_head.FusedLinearForPPO()(h, w, ids)
        r_logp, r_ent = VERL_CLASS()(h, w, ids)
    assert (logp.dtype, ent.dtype) == (r_logp.dtype, r_ent.dtype) == (torch.float32, torch.float32)
    assert (logp - r_logp).abs().max() <= 0.1  # verl's logits are rounded to bf16 here; ours are not


def _rl_micro_batch():
    """verl's RL data (left-padded prompts, right-padded responses, a masked tool token)
    turned into its no-padding micro-batch by verl's own ``left_right_2_no_padding``."""
    B, P, R = 3, 6, 5
    g = torch.Generator().manual_seed(2)
    prompt_len, response_len = [6, 3, 4], [5, 2, 4]
    prompts = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    attention = torch.zeros(B, P + R, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.long)
    for b in range(B):
        prompts[b, P - prompt_len[b]:] = torch.randint(1, 50, (prompt_len[b],), generator=g)
        responses[b, : response_len[b]] = torch.randint(1, 50, (response_len[b],), generator=g)
        attention[b, P - prompt_len[b] : P + response_len[b]] = 1
        response_mask[b, : response_len[b]] = 1
    response_mask[0, 2] = 0  # e.g. a tool-output token inside the response
    data = TensorDict(
        {
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention, "response_mask": response_mask,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
        },
        batch_size=[B],
    )
    return left_right_2_no_padding(data)


def test_response_rows_are_what_verl_reads():
    mb = _rl_micro_batch()
    rows, cu = verl_rows.response_rows(mb)
    # sample 0: 6 prompt + 5 response tokens, slot 2 masked; sample 1: 3 + 2; sample 2: 4 + 4
    assert rows.tolist() == [5, 6, 8, 9, 13, 14, 19, 20, 21, 22]
    assert cu.tolist() == [0, 11, 16, 24]


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_response_only_scoring_matches_full_where_verl_reads(layout):
    mb = _rl_micro_batch()
    cu = mb["input_ids"].offsets()
    total, H, V = int(cu[-1]), 24, 60
    h, w, _ = _inputs((total,), H, V, torch.float32, seed=3)
    labels = torch.roll(mb["input_ids"].values(), -1)
    if layout == "packed":  # verl's remove-padding layout: [1, total]
        hidden, ids = h[None], labels[None]
    else:  # [B, max_len], right padded
        L = int((cu[1:] - cu[:-1]).max())
        hidden, ids = torch.zeros(3, L, H), torch.zeros(3, L, dtype=torch.long)
        for b in range(3):
            n = int(cu[b + 1] - cu[b])
            hidden[b, :n], ids[b, :n] = h[cu[b] : cu[b + 1]], labels[cu[b] : cu[b + 1]]
    mask = mb["response_mask"].bool()
    valid = torch.arange(ids.shape[-1]) < (cu[1:] - cu[:-1])[:, None]

    def packed(t):  # back to verl's packed order (what its engine does with padded outputs)
        return t.reshape(-1) if layout == "packed" else t[valid]

    def run(plan):
        hg, wg = hidden.clone().requires_grad_(), w.clone().requires_grad_()
        if plan is None:
            logp, ent = lm_head.FusedLinearForPPO()(hg, wg, ids, temperature=0.9)
        else:
            with verl_rows.scoring(*plan):
                logp, ent = lm_head.FusedLinearForPPO()(hg, wg, ids, temperature=0.9)
        read_logp = no_padding_2_padding(packed(logp), mb)  # what verl's losses read, [B, R]
        read_ent = no_padding_2_padding(packed(ent), mb)
        ((read_logp * mask).sum() + (read_ent * mask).sum()).backward()
        return logp, read_logp, read_ent, hg.grad, wg.grad

    full = run(None)
    plan = verl_rows.response_rows(mb)
    part = run(plan)
    assert torch.equal(part[1][mask], full[1][mask]) and torch.equal(part[2][mask], full[2][mask])
    scored = torch.zeros(full[0].numel(), dtype=torch.bool)
    scored[plan[0] if layout == "packed" else verl_rows._Scoring(*plan).rows_for(ids.shape, ids.device)] = True
    assert torch.count_nonzero(part[0].reshape(-1)[~scored]) == 0  # zeros where nothing is read
    assert relative_error(part[3], full[3]) <= LOGPROB_GRAD_REL.fp32
    assert relative_error(part[4], full[4]) <= LOGPROB_GRAD_REL.fp32


def test_unknown_layout_scores_every_row():
    plan = verl_rows._Scoring(torch.tensor([1, 2]), torch.tensor([0, 3, 5]))
    assert plan.rows_for(torch.Size([1, 4]), torch.device("cpu")) is None  # shorter than the batch
    assert plan.rows_for(torch.Size([5, 8]), torch.device("cpu")) is None  # not [B, L]
    h, w, ids = _inputs((1, 4), 8, 20, torch.float32)
    with verl_rows.scoring(*plan.__dict__.values()):
        logp, _ = lm_head.FusedLinearForPPO()(h, w, ids)
    assert torch.count_nonzero(logp) == 4


def test_engine_wrapper_sets_plan_only_for_fused_rl_micro_batches():
    seen = []

    class Engine:
        use_ulysses_sp = False

        def forward_step(self, micro_batch, loss_function, forward_only):
            seen.append(verl_rows._SCORING.get())
            return "out"

    step = verl_fused._with_response_scoring(Engine.forward_step)
    mb = _rl_micro_batch()
    from verl.utils import tensordict_utils as tu

    assert step(Engine(), mb, None, True) == "out" and seen[-1] is None  # fused kernels off
    tu.assign_non_tensor_data(mb, "use_fused_kernels", True)
    assert step(Engine(), mb, None, True) == "out"
    assert seen[-1].rows.tolist() == [5, 6, 8, 9, 13, 14, 19, 20, 21, 22]
    assert verl_rows._SCORING.get() is None  # reset after the step
    sp = Engine()
    sp.use_ulysses_sp = True
    step(sp, mb, None, True)
    assert seen[-1] is None  # sequence-parallel shards: every row is scored


def _fsdp_engine():
    """verl's FSDP engine class, or None where its optional dependencies (peft) are missing."""
    try:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    except ImportError:
        return None
    return FSDPEngineWithLMHead


def test_enable_disable_restore_verl_exactly():
    original_class = verl_tf.FusedLinearForPPO
    engine = _fsdp_engine()
    original_step = None if engine is None else vars(engine)["forward_step"]
    before = {name: vars(mod).get("FusedLinearForPPO") for name, mod in sys.modules.items() if name.startswith("verl")}
    verl_fused.enable()
    verl_fused.enable()  # idempotent
    assert verl_fused.enabled()
    from verl.utils.experimental.torch_functional import FusedLinearForPPO  # how verl's model patches look it up

    assert FusedLinearForPPO is lm_head.FusedLinearForPPO
    if engine is not None:
        assert vars(engine)["forward_step"] is not original_step
    verl_fused.disable()
    assert not verl_fused.enabled() and verl_tf.FusedLinearForPPO is original_class
    after = {name: vars(mod).get("FusedLinearForPPO") for name, mod in sys.modules.items() if name.startswith("verl")}
    assert {k: v for k, v in after.items() if k in before} == before
    if engine is not None:
        assert vars(engine)["forward_step"] is original_step


def test_register_reads_the_environment_switch(monkeypatch):
    monkeypatch.delenv(verl_fused.ENV_SWITCH, raising=False)
    assert verl_fused.register() is False and verl_tf.FusedLinearForPPO is VERL_CLASS
    monkeypatch.setenv(verl_fused.ENV_SWITCH, "1")
    assert verl_fused.register() is True and verl_tf.FusedLinearForPPO is lm_head.FusedLinearForPPO
    verl_fused.disable()
    monkeypatch.setenv(verl_fused.ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match="RLK_MM_VERL_FUSED='maybe'"):
        verl_fused.register()


def test_verl_model_patch_runs_rlk_mm_after_enable(monkeypatch):
    """verl's own model patch (as its FSDP engine applies it) on a tiny Qwen2: enable()
    makes it call rlk_mm, with verl's results; disable() gives verl's class back."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    class TinyQwen2(Qwen2ForCausalLM):  # verl patches the class: keep that off Qwen2ForCausalLM
        pass

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    model = TinyQwen2(config)
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    calls = []
    forward = lm_head.FusedLinearForPPO.forward
    monkeypatch.setattr(lm_head.FusedLinearForPPO, "forward", lambda self, *a,
                        **k: calls.append(1) or forward(self, *a, **k))
    input_ids = torch.randint(0, 300, (2, 10))

    def run():
        model.zero_grad()
        out = model(input_ids=input_ids, temperature=0.7, return_dict=True)
        (out.log_probs.sum() + out.entropy.sum()).backward()
        return out.log_probs.detach(), out.entropy.detach(), model.lm_head.weight.grad.clone()

    theirs = run()
    verl_fused.enable()
    ours = run()
    verl_fused.disable()
    again = run()
    assert len(calls) == 1
    assert (ours[0] - theirs[0]).abs().max() <= LOGPROB_MAX_ABS.fp32
    assert (ours[1] - theirs[1]).abs().max() <= LOGPROB_MAX_ABS.fp32
    assert relative_error(ours[2], theirs[2]) <= LOGPROB_GRAD_REL.fp32
    assert all(torch.equal(a, b) for a, b in zip(theirs, again))


# ---------------------------------------------------------------- the loss in the LM head
def _training_micro_batch(seed: int = 4):
    """``_rl_micro_batch`` as ``update_actor`` hands it to the engine: with the trainer's
    per-token inputs (old log-probs far enough from the policy that the clips bind,
    advantages, reference log-probs, IS weights) and the engine's global-batch info."""
    mb = _rl_micro_batch()
    g = torch.Generator().manual_seed(seed)
    B, R = mb["response_mask"].shape
    mb["old_log_probs"] = torch.randn(B, R, generator=g) - 4.0
    mb["advantages"] = torch.randn(B, 1, generator=g).expand(B, R).contiguous()
    mb["ref_log_prob"] = torch.randn(B, R, generator=g) - 4.0
    mb["rollout_is_weights"] = 0.5 + torch.rand(B, R, generator=g)
    tu.assign_non_tensor(mb, use_fused_kernels=True, calculate_entropy=True, dp_size=2, batch_num_tokens=23,
                         global_batch_size=5)
    return mb


def _actor_config(loss_mode: str, **knobs):
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, clip_ratio_low=0.2,
                       clip_ratio_high=0.28, policy_loss={"loss_mode": loss_mode}, **knobs)


class _LMHeadEngine:
    """What ``FSDPEngineWithLMHead.forward_step`` does around the LM head (packed layout):
    verl's ``FusedLinearForPPO`` (whichever class is installed) on the rolled input ids, the
    outputs as nested tensors, then the loss function. The worker test runs verl's own."""

    use_ulysses_sp = False

    def __init__(self, hidden, weight, temperature=0.9):
        self.hidden, self.weight, self.temperature = hidden, weight, temperature

    def forward_step(self, micro_batch, loss_function, forward_only):
        labels = torch.roll(micro_batch["input_ids"].values(), -1)[None]
        logp, ent = verl_tf.FusedLinearForPPO()(self.hidden[None], self.weight, labels, temperature=self.temperature)
        cu = micro_batch["input_ids"].offsets()
        output = {k: torch.nested.nested_tensor_from_jagged(v[0], cu)
                  for k, v in (("log_probs", logp), ("entropy", ent))}
        return loss_function(model_output=output, data=micro_batch, dp_group=None)


def _train_step(loss_mode, knobs, fused: bool, micro_batch=None, seed=5):
    """verl's ppo_loss on one micro-batch through the LM head: (loss, metrics, d hidden, d weight)."""
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    mb = _training_micro_batch() if micro_batch is None else micro_batch
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(int(mb["input_ids"].offsets()[-1]), 24, generator=g).requires_grad_()
    weight = (torch.randn(60, 24, generator=g) * 0.3).requires_grad_()
    engine = _LMHeadEngine(hidden, weight)
    step = _LMHeadEngine.forward_step
    if fused:
        verl_fused._swap_class()
        step = verl_fused._with_response_scoring(step)
    loss, metrics = step(engine, mb, partial(ppo_loss, config=_actor_config(loss_mode, **knobs)), False)
    loss.backward()
    values = {k: v.aggregate() if hasattr(v, "aggregate") else v for k, v in metrics.items()}
    return loss.detach(), values, hidden.grad, weight.grad


FUSED_CASES = {
    "defaults": {},
    "token-sum": {"loss_agg_mode": "token-sum"},
    "seq-mean-token-mean+k3+entropy": {"loss_agg_mode": "seq-mean-token-mean", "use_kl_loss": True,
                                       "kl_loss_type": "low_var_kl", "kl_loss_coef": 0.1, "entropy_coeff": 0.01},
    "seq-mean-token-sum+k1": {"loss_agg_mode": "seq-mean-token-sum", "use_kl_loss": True, "kl_loss_type": "kl",
                              "kl_loss_coef": 0.2},
    "seq-mean-token-sum-norm+k2+": {"loss_agg_mode": "seq-mean-token-sum-norm", "use_kl_loss": True,
                                    "kl_loss_type": "k2+", "kl_loss_coef": 0.05, "clip_ratio_c": 1.5},
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_loss_matches_verl_ppo_loss(case):
    """rlk_mm's loss computed in the LM head (loss_mode=rlk_mm) against verl's vanilla loss
    with verl's own FusedLinearForPPO: loss, every metric, d hidden and d weight."""
    knobs = FUSED_CASES[case]
    expected = _train_step("vanilla", knobs, fused=False)
    verl_fused.disable()
    plans = []
    compute = fused_loss.FusedLossPlan.compute
    with pytest.MonkeyPatch.context() as mp:  # observe that the LM head computed the loss
        mp.setattr(fused_loss.FusedLossPlan, "compute", lambda plan, *a: plans.append(plan) or compute(plan, *a))
        actual = _train_step("rlk_mm", knobs, fused=True)
    assert len(plans) == 1 and plans[0].result is None  # computed once, handed to verl's loss once
    tol = ELEMENTWISE_LOSS_MAX_ABS.fp32  # relative to values above 1: sums (token-sum) round off as they grow
    assert float(actual[0]) == pytest.approx(float(expected[0]), rel=tol, abs=tol)
    assert actual[1].keys() == expected[1].keys()
    for name in expected[1]:
        assert actual[1][name] == pytest.approx(expected[1][name], rel=tol, abs=tol), name
    assert expected[1]["actor/pg_clipfrac"] > 0  # the clip binds: the check can tell
    assert relative_error(actual[2], expected[2]) <= LOGPROB_GRAD_REL.fp32
    assert relative_error(actual[3], expected[3]) <= LOGPROB_GRAD_REL.fp32


@pytest.mark.parametrize("why", ["gspo", "kl_full", "not_ppo_loss", "forward_only", "sum_pi_squared", "sp"])
def test_fused_loss_falls_back(why):
    """Where the loss cannot be formed in the LM head, the wrapper leaves verl's path alone."""
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    mb = _training_micro_batch()
    mode, knobs = ("rlk_mm_gspo", {}) if why == "gspo" else ("rlk_mm", {})
    if why == "kl_full":
        knobs = {"use_kl_loss": True, "kl_loss_type": "full"}
    loss_function = partial(ppo_loss, config=_actor_config(mode, **knobs))
    if why == "not_ppo_loss":
        loss_function = partial(lambda config, **kw: ppo_loss(config, **kw), config=loss_function.keywords["config"])
    if why == "sum_pi_squared":
        tu.assign_non_tensor(mb, calculate_sum_pi_squared=True)
    seen = []

    class Engine:
        use_ulysses_sp = why == "sp"

        def forward_step(self, micro_batch, loss_function, forward_only):
            seen.append(fused_loss._FUSED_LOSS.get())
            return "out"

    step = verl_fused._with_response_scoring(Engine.forward_step)
    assert step(Engine(), mb, loss_function, why == "forward_only") == "out"
    assert seen == [None]
    # control: the same micro-batch as update_actor gives it, with loss_mode=rlk_mm, has a plan
    with_plan = fused_loss.fused_loss_plan(_training_micro_batch(), partial(ppo_loss, config=_actor_config("rlk_mm")))
    assert with_plan is not None and with_plan.sample_index.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 2]


def test_fused_loss_refuses_a_mismatch():
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    mb = _training_micro_batch()
    plan = fused_loss.fused_loss_plan(mb, partial(ppo_loss, config=_actor_config("rlk_mm")))
    h, w, _ = _inputs((30,), 8, 40, torch.float32)
    rows, _ = verl_rows.response_rows(mb)
    with pytest.raises(RuntimeError, match="scores 3 rows but the micro-batch's response_mask selects 10"):
        plan.compute(h, w, rows[:3], torch.zeros(3, dtype=torch.long), 1.0)
    plan.compute(h, w, rows, torch.zeros(10, dtype=torch.long), 1.0)
    with pytest.raises(RuntimeError, match="LM head ran twice"):
        plan.compute(h, w, rows, torch.zeros(10, dtype=torch.long), 1.0)
    token = fused_loss._FUSED_LOSS.set(plan)
    try:
        with pytest.raises(RuntimeError, match="for 3 samples and 10 tokens.*log_prob \\(2, 5\\) with 10"):
            fused_loss.take_fused_loss(torch.zeros(2, 5), torch.ones(2, 5))
    finally:
        fused_loss._FUSED_LOSS.reset(token)
    assert fused_loss.take_fused_loss(torch.zeros(3, 5), torch.ones(3, 5)) is None  # no plan: the log-prob path


def test_enable_after_the_engine_failed_to_import_warns_and_stays_half_on(monkeypatch):
    """verl logs plugin errors at debug level only: enable() says it with a warning, keeps the
    class swap, and a later enable() completes (the worker test checks that with verl's engine)."""
    import importlib

    real_import = importlib.import_module

    def failing(name, *args):
        if name == verl_fused._FSDP_ENGINE:
            raise ImportError("simulated: an optional dependency of verl's engine is missing")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", failing)
    with pytest.warns(RuntimeWarning, match="could not be imported.*simulated.*enable\\(\\) again"):
        assert verl_fused.enable() is False
    assert verl_fused.enabled() and verl_tf.FusedLinearForPPO is lm_head.FusedLinearForPPO


def test_plugin_errors_become_warnings(monkeypatch):
    import importlib

    adapter = importlib.import_module("rlk_mm.integrations.verl")
    monkeypatch.setenv(verl_fused.ENV_SWITCH, "maybe")
    with pytest.warns(RuntimeWarning, match="rlk_mm's verl plugin did not register.*RLK_MM_VERL_FUSED='maybe'"):
        adapter._register_on_import()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fused_loss_matches_verl_on_any_layout(data):
    """Random prompt/response lengths, masked-out response tokens (a sample may have none),
    aggregation mode and KL kind: the fused loss equals verl's, loss and gradients."""
    B = data.draw(st.integers(1, 4), label="samples")
    prompt_len = data.draw(st.lists(st.integers(1, 5), min_size=B, max_size=B), label="prompt_len")
    response_len = data.draw(st.lists(st.integers(1, 6), min_size=B, max_size=B), label="response_len")
    P, R = max(prompt_len), max(response_len)
    keep = data.draw(st.lists(st.booleans(), min_size=B * R, max_size=B * R), label="keep")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    prompts, responses = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    attention, response_mask = torch.zeros(B, P + R, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    for b in range(B):
        prompts[b, P - prompt_len[b]:] = torch.randint(1, 50, (prompt_len[b],), generator=g)
        responses[b, : response_len[b]] = torch.randint(1, 50, (response_len[b],), generator=g)
        attention[b, P - prompt_len[b] : P + response_len[b]] = 1
        response_mask[b, : response_len[b]] = torch.tensor(keep[b * R : b * R + response_len[b]])
    td = TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention, "response_mask": response_mask,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
        "old_log_probs": torch.randn(B, R, generator=g) - 4.0, "advantages": torch.randn(B, R, generator=g),
        "ref_log_prob": torch.randn(B, R, generator=g) - 4.0,
    }, batch_size=[B])
    mb = left_right_2_no_padding(td)
    tu.assign_non_tensor(mb, use_fused_kernels=True, calculate_entropy=True, dp_size=1,
                         batch_num_tokens=max(int(response_mask.sum()), 1), global_batch_size=B)
    knobs = {"loss_agg_mode": data.draw(st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])),
             "use_kl_loss": True, "kl_loss_type": data.draw(st.sampled_from(["kl", "abs", "mse", "low_var_kl"])),
             "kl_loss_coef": 0.1, "entropy_coeff": 0.01}
    verl_fused.disable()
    expected = _train_step("vanilla", knobs, fused=False, micro_batch=mb)
    actual = _train_step("rlk_mm", knobs, fused=True, micro_batch=mb)
    verl_fused.disable()
    # the loss and metrics are functions of log-probs that agree within LOGPROB_MAX_ABS, not
    # bitwise (verl's logits and ours reduce in other orders): a k2 KL of 1.02 was seen 1.3e-6 apart
    tol = LOGPROB_MAX_ABS.fp32
    assert float(actual[0]) == pytest.approx(float(expected[0]), rel=tol, abs=tol)
    for name in expected[1]:
        assert actual[1][name] == pytest.approx(expected[1][name], rel=tol, abs=tol), name
    for ours, theirs in ((actual[2], expected[2]), (actual[3], expected[3])):
        assert relative_error(ours, theirs) <= LOGPROB_GRAD_REL.fp32
