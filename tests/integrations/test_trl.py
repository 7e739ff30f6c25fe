"""The TRL adapter against TRL 1.16's own GRPOTrainer: the real trainer, the tiny Qwen2.5-VL, the
real Qwen-VL processor and image prompts, fp32 on the CPU.

- ``test_two_steps_match_trl``: per loss type, TRL's GRPOTrainer and ours train 2 steps from one
  checkpoint and seed (the second step re-uses the first step's completions, so its ratios are
  off 1 and clip); without KL (TRL's default: our loss runs in ``linear_policy_loss``), and for
  ``bnpo`` with KL to the reference with TRL's default bias correction (``selected_logprob`` +
  ``grpo_loss``); log-probs, losses, metrics, gradient norms and parameters agree within the
  numerical contract.
- ``test_loss_options_match_trl``: on one batch with perturbed old and reference log-probs
  (clipped ratios, KL estimates beyond verl's clamps), TRL's ``_compute_loss`` and our
  ``selected_logprob`` path give the same loss, gradients and metrics for every loss type, both
  importance-sampling levels, each KL form, ``delta``, vLLM importance ratios, the entropy bonus
  and a tool mask.
- ``test_linear_loss_matches_trl``: the same batch through the whole model: TRL's trainer and
  ours (``linear_policy_loss``) give the same loss, parameter gradients and metrics for every
  option ``linear_policy_loss`` expresses; the others fall back, saying so once.
"""

import importlib.util
import subprocess
import sys

import pytest
import torch

from rlk_mm.fixtures import IM_END_TOKEN_ID, qwen_vl_processor, synthetic_image_text, tiny_qwen2_5_vl
from rlk_mm.parity.contract import ELEMENTWISE_LOSS_MAX_ABS, LOGPROB_GRAD_REL, LOGPROB_MAX_ABS, relative_error

if importlib.util.find_spec("trl") is None:
    pytest.skip("trl is not installed (the [test] extra installs trl==1.16.0)", allow_module_level=True)

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402
from trl import GRPOTrainer as TRLGRPOTrainer  # noqa: E402

from rlk_mm.integrations.trl import LOSS_TYPES, GRPOTrainer, grpo_loss  # noqa: E402

STEPS = 2
LR = 0.5  # plain SGD: Adam's first steps turn round-off in near-zero gradients into whole steps
#: the second step's log-probs come from parameters that already differ by the first update's round-off
STEP_2_LOGPROB_MAX_ABS = 1e-4
TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def reward(completions, **kwargs):
    """A deterministic reward that differs between completions."""
    return [float(len(c[0]["content"]) % 5) for c in completions]


@pytest.fixture(scope="module")
def start():
    """The tiny Qwen2.5-VL, its <|im_end|> row scaled so that completions end at different lengths."""
    model = tiny_qwen2_5_vl(seed=0)
    with torch.no_grad():
        model.lm_head.weight[IM_END_TOKEN_ID] *= 60.0
    return model


@pytest.fixture(scope="module")
def checkpoint(start, tmp_path_factory):
    """``start`` saved: TRL builds the reference model from the policy's path."""
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    start.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dataset():
    samples = synthetic_image_text(4, seed=0, max_images=2)
    return Dataset.from_dict({"prompt": [s.messages for s in samples], "images": [s.images for s in samples]})


def make_trainer(cls, checkpoint, dataset, out, *, linear_loss=None, **options):
    """``cls`` (TRL's trainer or ours; ``linear_loss``: ours only) with the test's config plus ``options``."""
    extra = {} if linear_loss is None else {"linear_loss": linear_loss}
    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0,
        per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=STEPS,
        num_iterations=2, optim="sgd", learning_rate=LR, logging_steps=1, **options,
    )
    processor = qwen_vl_processor()
    processor.tokenizer.padding_side = "left"  # TRL pads prompt ids left, its media fields as the processor does
    return cls(model=checkpoint, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=processor,
               **extra)


def train(cls, checkpoint, dataset, out, loss_type, beta):
    """(trainer, the log-probs of each scoring call, in order) after STEPS steps."""
    trainer = make_trainer(cls, checkpoint, dataset, out, loss_type=loss_type, beta=beta)
    calls = []
    score = trainer._get_per_token_logps_and_entropies

    def recorded(*args, **kwargs):
        out = score(*args, **kwargs)
        calls.append(out[0].detach().clone())
        return out

    trainer._get_per_token_logps_and_entropies = recorded
    trainer.train()
    return trainer, calls


@pytest.mark.parametrize("loss_type, beta", [
    ("grpo", 0.0), ("bnpo", 0.04), ("dr_grpo", 0.0), ("dapo", 0.0),
])
def test_two_steps_match_trl(start, checkpoint, dataset, tmp_path, loss_type, beta):
    stock, stock_calls = train(TRLGRPOTrainer, checkpoint, dataset, tmp_path / "trl", loss_type, beta)
    ours, our_calls = train(GRPOTrainer, checkpoint, dataset, tmp_path / "ours", loss_type, beta)

    # scoring calls: old (and reference) log-probs, then one loss call per step; ours scores the loss
    # tokens inside linear_policy_loss when beta = 0
    before_loss = 1 if beta == 0.0 else 2
    assert len(stock_calls) == before_loss + STEPS
    assert len(our_calls) == (before_loss if beta == 0.0 else before_loss + STEPS)
    for i, (a, b) in enumerate(zip(our_calls, stock_calls)):
        bound = LOGPROB_MAX_ABS.fp32 if i <= before_loss else STEP_2_LOGPROB_MAX_ABS
        assert (a - b).abs().max().item() <= bound, f"scoring call {i}"

    logs, stock_logs = ours.state.log_history, stock.state.log_history
    assert [set(s) for s in logs] == [set(s) for s in stock_logs]
    for step, (mine, theirs) in enumerate(zip(logs, stock_logs)):
        for key, value in theirs.items():
            if key in TIMING:
                continue
            if key == "grad_norm":
                assert abs(mine[key] - value) <= LOGPROB_GRAD_REL.fp32 * value, (step, key)
            elif key.startswith("clip_ratio") or key.startswith("completions") or key.startswith("reward"):
                assert mine[key] == value, (step, key)
            else:  # loss, KL, entropy
                assert abs(mine[key] - value) <= ELEMENTWISE_LOSS_MAX_ABS.fp32 * max(1.0, abs(value)), (step, key)
    # the steps exercised ragged completions, the KL and the clip
    assert stock_logs[0]["completions/min_length"] < stock_logs[0]["completions/max_length"]
    assert stock_logs[1]["clip_ratio/region_mean"] > 0 and (beta == 0.0 or stock_logs[1]["kl"] > 0)

    start = dict(start.named_parameters())
    ours_p, stock_p = dict(ours.model.named_parameters()), dict(stock.model.named_parameters())
    ours_update = torch.cat([(ours_p[k] - start[k]).flatten() for k in start])
    stock_update = torch.cat([(stock_p[k] - start[k]).flatten() for k in start])
    assert relative_error(ours_update, stock_update) <= LOGPROB_GRAD_REL.fp32


# ----------------------------------------------------------------------------- the loss, option by option
KL_FORMS = [(0.0, True), (0.1, True), (0.1, False)]  # (beta, use_bias_correction_kl)
OPTIONS = [
    dict(loss_type=t, importance_sampling_level=level, beta=beta, use_bias_correction_kl=corrected)
    for t in LOSS_TYPES for level in ("token", "sequence") for beta, corrected in KL_FORMS
] + [
    dict(loss_type="grpo", delta=1.6, beta=0.1),
    dict(loss_type="dapo", delta=1.3, importance_sampling_level="sequence"),
    dict(loss_type="bnpo", use_vllm=True, beta=0.1),
    dict(loss_type="grpo", use_vllm=True, importance_sampling_level="sequence"),
    dict(loss_type="dr_grpo", entropy_coef=0.05, beta=0.1),
    dict(loss_type="grpo", tool_mask=True, beta=0.1),
    dict(loss_type="dapo", tool_mask=True, beta=0.1),
    dict(loss_type="luspo", tool_mask=True, importance_sampling_level="sequence"),
    dict(loss_type="bnpo", far_off_policy=True),
    dict(loss_type="grpo", far_off_policy=True, beta=0.1, importance_sampling_level="sequence"),
]


@pytest.fixture(scope="module")
def one_batch(checkpoint, dataset, tmp_path_factory):
    """Our trainer (2 accumulation steps), one batch of its inputs with the old and reference
    log-probs perturbed (ratios off 1 per token and per sequence; k3 estimates beyond verl's clamp at 10),
    vLLM importance ratios, and the batch's policy log-probs and entropies (the loss's differentiable inputs)."""
    trainer = make_trainer(GRPOTrainer, checkpoint, dataset, tmp_path_factory.mktemp("one_batch"), loss_type="grpo")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    media = {k: inputs[k] for k in ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids") if k in inputs}
    with torch.no_grad():
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, inputs["completion_ids"].shape[1], compute_entropy=True, **media
        )
    mask = inputs["completion_mask"]
    g = torch.Generator().manual_seed(1)
    shift = 0.3 * torch.randn(mask.shape, generator=g) + 0.5 * torch.randn(mask.shape[0], 1, generator=g)
    inputs["old_per_token_logps"] = logps + shift * mask
    inputs["ref_per_token_logps"] = logps + 2.0 * torch.randn(mask.shape, generator=g) * mask
    inputs["importance_sampling_ratio"] = 0.5 + torch.rand(mask.shape, generator=g)
    diff = inputs["ref_per_token_logps"] - logps
    assert (torch.exp(diff) - diff - 1)[mask.bool()].max() > 10  # verl's k3 clamp would cut these
    return trainer, inputs, logps, entropies


def loss_grads_metrics(compute, trainer, inputs, logps, entropies):
    """The loss, its gradients to the log-probs and entropies, and the metrics one call logs."""
    leaves = logps.clone().requires_grad_(), entropies.clone().requires_grad_()
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (*leaves, None)
    logged = {k: len(v) for k, v in trainer._metrics["train"].items()}
    try:
        loss = compute(trainer.model, inputs)
    finally:
        del trainer._get_per_token_logps_and_entropies
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    metrics = {k: v[logged.get(k, 0):] for k, v in trainer._metrics["train"].items() if len(v) > logged.get(k, 0)}
    return loss.detach(), [torch.zeros_like(x) if d is None else d for d, x in zip(grads, leaves)], metrics


def configure(trainer, monkeypatch, options, inputs):
    """Sets the trainer's loss options (TRL's names, plus the test's own batch edits); returns the inputs."""
    options = dict(options)
    shape = inputs["completion_mask"].shape
    if options.pop("tool_mask", False):  # tool-output tokens are not scored; sample 0 has no other
        tool_mask = (torch.arange(shape[1]) % 3 != 1).long().repeat(shape[0], 1)
        tool_mask[0] = 0
        inputs = {**inputs, "tool_mask": tool_mask}
    if options.pop("far_off_policy", False):  # a log-ratio of 25, beyond verl's clamp at 20, where A < 0
        old = inputs["old_per_token_logps"].clone()
        old[int(torch.nonzero(inputs["advantages"] < 0)[0]), 0] -= 25.0
        inputs = {**inputs, "old_per_token_logps": old}
    if options.pop("on_policy", False):  # TRL leaves the old log-probs out when they equal the new ones
        inputs = {k: v for k, v in inputs.items() if k != "old_per_token_logps"}
    use_vllm = options.pop("use_vllm", False)
    monkeypatch.setattr(trainer, "use_vllm", use_vllm)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_correction", use_vllm)
    entropy_coef = options.pop("entropy_coef", 0.0)
    monkeypatch.setattr(trainer, "entropy_coef", entropy_coef)
    monkeypatch.setattr(trainer, "_entropy_bonus_enabled", entropy_coef != 0.0)
    for name in ("loss_type", "importance_sampling_level", "beta"):
        if name in options:
            monkeypatch.setattr(trainer, name, options[name])
    for name, value in options.items():
        monkeypatch.setattr(trainer.args, name, value)
    return inputs


def assert_metrics_match(metrics, stock_metrics):
    assert metrics.keys() == stock_metrics.keys()
    for key, values in stock_metrics.items():
        assert metrics[key] == pytest.approx(values, rel=1e-6, abs=1e-7, nan_ok=True), key


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_loss_options_match_trl(one_batch, monkeypatch, options):
    trainer, inputs, logps, entropies = one_batch
    monkeypatch.setattr(trainer, "_linear_loss", False)
    inputs = configure(trainer, monkeypatch, options, inputs)
    trainer._check_supported()

    stock = loss_grads_metrics(lambda *a: TRLGRPOTrainer._compute_loss(trainer, *a), trainer, inputs, logps, entropies)
    ours = loss_grads_metrics(trainer._compute_loss, trainer, inputs, logps, entropies)
    (loss, grads, metrics), (stock_loss, stock_grads, stock_metrics) = ours, stock
    assert abs(loss.item() - stock_loss.item()) <= ELEMENTWISE_LOSS_MAX_ABS.fp32 * max(1.0, abs(stock_loss.item()))
    for name, mine, theirs in zip(("log-probs", "entropies"), grads, stock_grads):
        assert relative_error(mine, theirs) <= LOGPROB_GRAD_REL.fp32, name
    assert_metrics_match(metrics, stock_metrics)
    assert stock_metrics["clip_ratio/region_mean"][0] > 0


# ----------------------------------------------------------------------------- the fused LM-head loss
LINEAR_OPTIONS = [  # every loss type once; each option once
    dict(loss_type="grpo", importance_sampling_level="sequence", use_vllm=True),
    dict(loss_type="bnpo", entropy_coef=0.05),
    dict(loss_type="dr_grpo", tool_mask=True),
    dict(loss_type="dapo", delta=1.3),
    dict(loss_type="luspo", far_off_policy=True),
    dict(loss_type="dapo", on_policy=True),  # TRL's defaults: num_iterations=1, no old log-probs
    dict(loss_type="grpo", importance_sampling_level="sequence", on_policy=True),
]
#: options linear_policy_loss does not express: ours runs selected_logprob + grpo_loss, saying why once
FALLBACKS = [
    (dict(loss_type="grpo", beta=0.1), "beta=0.1"),
    (dict(loss_type="dapo", entropy_coef=0.05), "entropy_coef=0.05 with loss_type='dapo'"),
]


@pytest.fixture(scope="module")
def stock_trainer(checkpoint, dataset, tmp_path_factory):
    """TRL's own trainer on the same checkpoint, in the same state as ``one_batch``'s."""
    trainer = make_trainer(TRLGRPOTrainer, checkpoint, dataset, tmp_path_factory.mktemp("stock"), loss_type="grpo")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def model_loss_grads_metrics(trainer, compute, inputs):
    """The loss of one ``_compute_loss`` call through the whole model, d loss / d (the backbone's
    last hidden state, the input of the LM head), the parameters' gradients (by name), the metrics
    the call logs, and the hidden state (its autograd graph kept)."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    logged = {k: len(v) for k, v in trainer._metrics["train"].items()}
    captured = []
    hook = model.model.language_model.register_forward_hook(
        lambda module, args, out: captured.append(out.last_hidden_state))
    try:
        loss = compute(model, inputs)
    finally:
        hook.remove()
    (hidden,) = captured
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    d_hidden, *grads = torch.autograd.grad(loss, [hidden, *params], retain_graph=True, allow_unused=True)
    grads = {n: torch.zeros_like(p) if g is None else g for n, p, g in zip(names, params, grads)}
    metrics = {k: v[logged.get(k, 0):] for k, v in trainer._metrics["train"].items() if len(v) > logged.get(k, 0)}
    return loss.detach(), d_hidden, grads, metrics, hidden


def fp64_head_gradients(trainer, inputs, hidden):
    """d loss / d hidden and d loss / d (LM-head weight) of TRL's own ``_compute_loss`` with the LM head
    in fp64 on the same (fp32) hidden states and weight: the numerical contract's reference."""
    C = inputs["completion_ids"].shape[1]
    h = hidden.detach().double().requires_grad_()
    w = trainer.model.lm_head.weight.detach().double().requires_grad_()
    logits = (h[:, -C - 1: -1] @ w.T) / trainer.temperature
    logps = logits.log_softmax(-1).gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
    entropies = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    inputs64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in inputs.items()}
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, entropies, None)
    try:
        loss = TRLGRPOTrainer._compute_loss(trainer, trainer.model, inputs64)
    finally:
        del trainer._get_per_token_logps_and_entropies
    return torch.autograd.grad(loss, (h, w))


def run_both(one_batch, stock_trainer, monkeypatch, options):
    """Our trainer and TRL's on one batch through the whole model: loss and metrics equal TRL's;
    the gradients are checked where the numerical contract bounds them, and the rest is TRL's own
    backward.

    The contract bounds log-prob gradients against fp64 from the same inputs: here the gradients
    of the LM head's inputs (the backbone's last hidden state, the head's weight), with TRL's loss
    in fp64 as the reference. The whole model's parameter gradients are not compared with TRL's
    fp32 ones under that bound: two fp32 computations of a peaked softmax row (the <|im_end|> row
    is scaled 60x here, p near 1) differ in 1 - p by about the rounding of a large logit over 1 - p,
    which the backbone's backward then carries to every parameter; with ``delta`` most tokens'
    gradients are clipped to 0, so such a token carries the gradient and the fp32-vs-fp32
    difference of the parameters reached 1.3e-5 while ours stayed within the contract at the
    head (8e-6 against fp64, TRL's fp32 9e-7). So the backbone's parameter gradients are checked
    as TRL's own backward of our head gradient: the same model, the same upstream gradient."""
    trainer, inputs = one_batch[:2]
    ours_inputs = configure(trainer, monkeypatch, options, inputs)
    stock_inputs = configure(stock_trainer, monkeypatch, options, inputs)
    trainer._check_supported()
    loss, d_hidden, grads, metrics, _ = model_loss_grads_metrics(trainer, trainer._compute_loss, ours_inputs)
    stock_loss, _, _, stock_metrics, stock_hidden = model_loss_grads_metrics(
        stock_trainer, stock_trainer._compute_loss, stock_inputs)
    assert abs(loss.item() - stock_loss.item()) <= ELEMENTWISE_LOSS_MAX_ABS.fp32 * max(1.0, abs(stock_loss.item()))
    assert_metrics_match(metrics, stock_metrics)
    # the LM head's gradients (the contract's log-prob gradients) against fp64
    ref_hidden, ref_weight = fp64_head_gradients(stock_trainer, stock_inputs, stock_hidden)
    assert relative_error(d_hidden, ref_hidden) <= LOGPROB_GRAD_REL.fp32
    assert relative_error(grads["lm_head.weight"], ref_weight) <= LOGPROB_GRAD_REL.fp32
    # the backbone's: TRL's backward of our head-input gradient (the same ops on the same upstream)
    names, params = zip(*[(n, p) for n, p in stock_trainer.model.named_parameters() if n != "lm_head.weight"])
    through = torch.autograd.grad(stock_hidden, params, grad_outputs=d_hidden, allow_unused=True)
    through = torch.cat([torch.zeros(p.numel()) if g is None else g.flatten() for p, g in zip(params, through)])
    assert relative_error(torch.cat([grads[n].flatten() for n in names]), through) <= LOGPROB_GRAD_REL.fp32


@pytest.mark.parametrize("options", LINEAR_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_linear_loss_matches_trl(one_batch, stock_trainer, monkeypatch, caplog, options):
    trainer = one_batch[0]
    calls = []
    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", lambda *a, **k: calls.append(1))
    with caplog.at_level("WARNING", logger="rlk_mm.integrations.trl"):
        run_both(one_batch, stock_trainer, monkeypatch, options)
    assert not calls and not caplog.records  # the loss ran in linear_policy_loss


@pytest.mark.parametrize("options, reason", FALLBACKS, ids=[r for _, r in FALLBACKS])
def test_linear_loss_falls_back_saying_why_once(one_batch, monkeypatch, caplog, options, reason):
    trainer, inputs, logps, entropies = one_batch
    monkeypatch.setattr(trainer, "_said", set())
    inputs = configure(trainer, monkeypatch, options, inputs)
    stock = loss_grads_metrics(lambda *a: TRLGRPOTrainer._compute_loss(trainer, *a), trainer, inputs, logps, entropies)
    with caplog.at_level("WARNING", logger="rlk_mm.integrations.trl"):
        for _ in range(2):
            loss, grads, metrics = loss_grads_metrics(trainer._compute_loss, trainer, inputs, logps, entropies)
    assert len(caplog.records) == 1 and reason in caplog.records[0].getMessage()
    assert abs(loss.item() - stock[0].item()) <= ELEMENTWISE_LOSS_MAX_ABS.fp32 * max(1.0, abs(stock[0].item()))
    for name, mine, theirs in zip(("log-probs", "entropies"), grads, stock[1]):
        assert relative_error(mine, theirs) <= LOGPROB_GRAD_REL.fp32, name
    assert_metrics_match(metrics, stock[2])


# ----------------------------------------------------------------------------- refusals and the import
@pytest.mark.parametrize("field, value, message", [
    ("loss_type", "cispo", "keep TRL's own GRPOTrainer for cispo"),
    ("top_entropy_quantile", 0.5, r"GRPOConfig.top_entropy_quantile=0.5 is not supported .* set it to 1.0"),
    ("off_policy_mask_threshold", 0.5, "off_policy_mask_threshold=0.5 is not supported"),
    ("use_adaptive_entropy", True, "use_adaptive_entropy=True is not supported"),
    ("delta", 1.1, r"delta=1.1 must be > 1 \+ epsilon_high"),
])
def test_unsupported_options_are_refused(one_batch, monkeypatch, field, value, message):
    trainer = one_batch[0]
    monkeypatch.setattr(trainer.args, field, value)
    with pytest.raises(ValueError, match=message):
        trainer._check_supported()


def test_a_right_padding_processor_is_refused(checkpoint, dataset, tmp_path):
    """TRL left-pads the prompt ids but builds mm_token_type_ids with the processor's padding:
    a right-padding processor would train media at other positions than it generated them at."""
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(ValueError, match="processing_class pads on the right: .*padding_side = 'left'"):
        GRPOTrainer(model=checkpoint, reward_funcs=reward, args=args, train_dataset=dataset,
                    processing_class=qwen_vl_processor())


def test_grpo_loss_checks_its_arguments():
    logp = torch.randn(2, 5)
    mask = torch.ones(2, 5, dtype=torch.bool)
    adv = torch.randn(2)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\); expected \[B=2\]"):
        grpo_loss(logp, logp, torch.randn(3), mask)
    with pytest.raises(ValueError, match="beta=0.1 needs ref_per_token_logps"):
        grpo_loss(logp, logp, adv, mask, beta=0.1, num_items=10)
    with pytest.raises(ValueError, match="loss_type='dapo' needs num_items"):
        grpo_loss(logp, logp, adv, mask)
    with pytest.raises(ValueError, match="loss_type='dr_grpo' needs max_completion_length"):
        grpo_loss(logp, logp, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="importance_sampling_level='seq'"):
        grpo_loss(logp, logp, adv, mask, importance_sampling_level="seq")
    with pytest.raises(ValueError, match=r"importance_sampling_ratio has shape \(2, 4\)"):
        grpo_loss(logp, logp, adv, mask, loss_type="grpo", importance_sampling_ratio=torch.ones(2, 4))
    with pytest.raises(ValueError, match="epsilon=1.5 is out of range"):
        grpo_loss(logp, logp, adv, mask, loss_type="grpo", epsilon_low=1.5)
    loss, stats = grpo_loss(logp, logp, adv, mask, loss_type="grpo")
    assert stats["kl"] is None and torch.equal(stats["ratio"], torch.ones(2, 5))


def test_linear_loss_argument_is_checked(checkpoint, dataset, tmp_path):
    with pytest.raises(TypeError, match="linear_loss"):
        make_trainer(GRPOTrainer, checkpoint, dataset, tmp_path, loss_type="grpo", linear_loss="yes")


def test_import_does_not_import_trl_or_transformers():
    code = "import sys, rlk_mm.integrations.trl; print(sorted({'trl', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_loss_config_is_built_in_one_place():
    """``trl.loss_config``: TRL's loss settings as one ``PolicyLossConfig`` (grpo_loss and the fused path use it)."""
    from rlk_mm.integrations.trl import loss_config
    from rlk_mm.ops import AggMode, RatioMode

    dapo = loss_config("dapo", "token", 0.2, 0.28, None, num_completions=4)  # the token sum, divided by num_items after
    assert (dapo.loss_agg_mode, dapo.batch_num_tokens, dapo.ratio, dapo.clip_ratio_c) == (
        AggMode.TOKEN_SUM, None, RatioMode.TOKEN, None)
    assert dapo.log_ratio_clamp == (-float("inf"), float("inf"))
    dr = loss_config("dr_grpo", "sequence", 0.2, 0.2, 3.0, num_completions=4, max_completion_length=16,
                     entropy_coeff=0.01)
    got = (dr.loss_agg_mode, dr.global_batch_size, dr.loss_scale_factor)
    assert got == (AggMode.SEQ_MEAN_TOKEN_SUM_NORM, 4.0, 16.0)
    assert (dr.ratio, dr.clip_ratio_c, dr.entropy_coeff) == (RatioMode.GSPO, 3.0, 0.01)
    with pytest.raises(ValueError, match="needs max_completion_length"):
        loss_config("dr_grpo", "token", 0.2, 0.2, None, num_completions=4)


def test_dapo_normalizer_number_and_tensor_paths_agree():
    """Issue 31, D-01: TRL's dapo divisor ``num_items`` is no count of this batch's tokens (it is
    per process and per accumulation window: fractional, or below a long batch's tokens). Any
    value > 0 divides the token sum, as a number or a 0-d tensor alike; a number <= 0 is refused,
    a tensor <= 0 (not read on the host) gives NaN, never 1/tiny (the 4.3e37 it gave)."""
    g = torch.Generator().manual_seed(5)
    logp, old = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    adv, mask = torch.randn(2, generator=g), torch.ones(2, 5, dtype=torch.long)
    total, _ = grpo_loss(logp, old, adv, mask, loss_type="dapo", num_items=1.0)
    for n in (0.5, 3.0, 37.0):  # 10 tokens scored here: 3.0 is below them, and valid for TRL
        for value in (n, torch.tensor(n)):
            loss, stats = grpo_loss(logp, old, adv, mask, loss_type="dapo", num_items=value)
            torch.testing.assert_close(loss, total / n)
            torch.testing.assert_close(stats["policy_loss"], total / n)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="num_items"):
            grpo_loss(logp, old, adv, mask, loss_type="dapo", num_items=bad)
        assert grpo_loss(logp, old, adv, mask, loss_type="dapo", num_items=torch.tensor(float(bad)))[0].isnan()
    with pytest.raises(ValueError, match=r"num_items must be 0-D, got shape \(1,\)"):
        grpo_loss(logp, old, adv, mask, loss_type="dapo", num_items=torch.tensor([7.0]))
