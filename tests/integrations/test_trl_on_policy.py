"""``OnPolicyGRPOTrainer``: TRL 1.16's real GRPOTrainer generating through ``generate_on_policy``,
with the tiny Qwen2.5-VL, the real Qwen-VL processor and image prompts, fp32 on the CPU.

- Two GRPO steps (the second after an update): at every step the log-probs TRL receives from the
  rollout are bitwise the log-probs of the training loss, token by token, and the logged
  ``on_policy/max_abs_diff`` and ``on_policy/tokens_differ`` are 0.
- The same seed gives the same completions and log-probs in a second trainer.
- Unsupported settings are refused, naming the ``GRPOConfig`` field.
"""

import importlib.util
import subprocess
import sys

import pytest
import torch

from rlk_mm.fixtures import IM_END_TOKEN_ID, qwen_vl_processor, synthetic_image_text, tiny_qwen2_5_vl

if importlib.util.find_spec("trl") is None:
    pytest.skip("trl is not installed (the [test] extra installs trl==1.16.0)", allow_module_level=True)

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from rlk_mm.integrations.trl.on_policy import OnPolicyGRPOTrainer  # noqa: E402


def reward(completions, **kwargs):
    """A deterministic reward that differs between completions."""
    return [float(len(c[0]["content"]) % 5) for c in completions]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Qwen2.5-VL, its <|im_end|> row scaled so that completions end at different lengths."""
    model = tiny_qwen2_5_vl(seed=0)
    with torch.no_grad():
        model.lm_head.weight[IM_END_TOKEN_ID] *= 60.0
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dataset():
    samples = synthetic_image_text(4, seed=0, max_images=2)
    return Dataset.from_dict({"prompt": [s.messages for s in samples], "images": [s.images for s in samples]})


def make_trainer(checkpoint, dataset, out, **options):
    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0,
        per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=2,
        optim="sgd", learning_rate=0.5, logging_steps=1, **options,
    )
    processor = qwen_vl_processor()
    processor.tokenizer.padding_side = "left"  # TRL pads prompt ids left, and the media fields as the processor does
    return OnPolicyGRPOTrainer(model=checkpoint, reward_funcs=reward, args=args, train_dataset=dataset,
                               processing_class=processor)


def train_recording(trainer):
    """Train; per loss call: (training log-probs, rollout log-probs, mask); per rollout: the completions."""
    losses, rollouts = [], []
    log_metrics, generate = trainer._log_loss_metrics, trainer._generate_single_turn

    def recorded_metrics(mode, stats, entropies, mask, inputs):
        losses.append((stats["log_probs"].clone(), inputs["sampling_per_token_logps"].clone(), mask.bool()))
        return log_metrics(mode, stats, entropies, mask, inputs)

    def recorded_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        rollouts.append(out)
        return out

    trainer._log_loss_metrics, trainer._generate_single_turn = recorded_metrics, recorded_generate
    trainer.train()
    return losses, rollouts


@pytest.fixture(scope="module")
def trained(checkpoint, dataset, tmp_path_factory):
    trainer = make_trainer(checkpoint, dataset, tmp_path_factory.mktemp("on_policy"))
    return trainer, *train_recording(trainer)


def test_rollout_log_probs_are_the_training_log_probs_at_every_step(trained):
    trainer, losses, rollouts = trained
    assert len(losses) == 2 and len(rollouts) == 2
    for step, (train_logps, rollout_logps, mask) in enumerate(losses):
        assert mask.sum() > 0
        assert torch.equal(train_logps[mask], rollout_logps[mask]), f"step {step}"
    lengths = {len(ids) for completions, _ in rollouts for ids in completions}
    assert len(lengths) > 1, "completions should stop at different lengths"
    logged = [h for h in trainer.state.log_history if "on_policy/max_abs_diff" in h]
    assert [h["on_policy/max_abs_diff"] for h in logged] == [0.0, 0.0]
    assert [h["on_policy/tokens_differ"] for h in logged] == [0.0, 0.0]
    assert all(h["on_policy/rejected"] == 0.0 for h in logged)
    start = tiny_qwen2_5_vl(seed=0)
    assert not torch.equal(trainer.model.model.language_model.layers[0].mlp.up_proj.weight,
                           start.model.language_model.layers[0].mlp.up_proj.weight), "the first update moves the policy"


def test_the_same_seed_gives_the_same_rollouts(trained, checkpoint, dataset, tmp_path):
    _, _, rollouts = trained
    _, again = train_recording(make_trainer(checkpoint, dataset, tmp_path))
    assert again == rollouts


@pytest.mark.parametrize("field, value, message", [
    ("min_p", 0.1, "GRPOConfig.min_p=0.1 is not supported"),
    ("repetition_penalty", 1.1, "GRPOConfig.repetition_penalty=1.1"),
    ("generation_kwargs", {"top_k": 3}, "GRPOConfig.generation_kwargs="),
    ("cast_lm_head_to_fp32", True, "GRPOConfig.cast_lm_head_to_fp32=True"),
    ("use_transformers_continuous_batching", True, "use_transformers_continuous_batching=True"),
])
def test_unsupported_settings_are_refused(trained, monkeypatch, field, value, message):
    trainer = trained[0]
    monkeypatch.setattr(trainer.args, field, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("{", r"\{")):
        trainer._check_on_policy()


def test_a_right_padding_processor_is_refused(trained, monkeypatch):
    trainer = trained[0]
    monkeypatch.setattr(trainer.processing_class.tokenizer, "padding_side", "right")
    with pytest.raises(ValueError, match="processing_class pads on the right: .*tokenizer.padding_side = 'left'"):
        trainer._check_supported()


def test_tools_and_rollout_functions_are_refused(trained, monkeypatch):
    trainer = trained[0]
    monkeypatch.setattr(trainer, "rollout_func", lambda prompts, trainer: {})
    with pytest.raises(ValueError, match="rollout_func=...") as info:
        trainer._check_on_policy()
    assert "rlk_mm.integrations.trl.GRPOTrainer" in str(info.value)


def test_kernels_argument_is_checked(checkpoint, dataset, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(ValueError, match="kernels='fast': expected one of invariant, default"):
        OnPolicyGRPOTrainer(model=checkpoint, reward_funcs=reward, args=args, train_dataset=dataset, kernels="fast")


def test_import_does_not_import_trl_or_transformers():
    code = ("import sys, rlk_mm.integrations.trl.on_policy; "
            "assert 'trl' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
