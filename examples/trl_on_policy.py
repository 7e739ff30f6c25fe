"""Exactly on-policy GRPO in TRL: rollouts whose log-probs are the training step's, bit for bit.

``OnPolicyGRPOTrainer`` takes TRL 1.16's ``GRPOTrainer`` arguments (``use_vllm=False``) and
generates through ``rlk_mm.models.generate_on_policy`` under ``batch_invariant()``: the
log-probs TRL receives with each completion are those its training step computes, so the
importance ratio is exactly 1 and ``on_policy/max_abs_diff`` and ``on_policy/tokens_differ`` are
0 at every step. The processor must pad on the left (TRL pads the prompt ids left and its media
fields as the processor does).

Here: the tiny random Qwen2.5-VL and the real Qwen-VL processor (``rlk_mm.fixtures``, the
``rlk-mm[vl]`` extra), synthetic image questions and a toy reward, fp32 on the CPU. Swap in
your model path, data set and reward functions.

    python examples/trl_on_policy.py              # 2 GRPO steps of 2 prompts x 2 completions
    python examples/trl_on_policy.py --steps 4
"""

from __future__ import annotations

import argparse
import tempfile

from datasets import Dataset
from trl import GRPOConfig

from rlk_mm.fixtures import qwen_vl_processor, synthetic_image_text, tiny_qwen2_5_vl
from rlk_mm.integrations.trl.on_policy import OnPolicyGRPOTrainer


def length_reward(completions, **kwargs) -> list[float]:
    """A toy reward: prefers completions of about 20 characters."""
    return [-abs(len(c[0]["content"]) - 20) / 20.0 for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps (default 2)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step, two completions each (default 2)")
    parser.add_argument("--max-completion-length", type=int, default=8, help="tokens per completion (default 8)")
    args = parser.parse_args()

    samples = synthetic_image_text(4, seed=0, max_images=2)
    dataset = Dataset.from_dict({"prompt": [s.messages for s in samples], "images": [s.images for s in samples]})
    with tempfile.TemporaryDirectory() as out:
        model_dir = f"{out}/tiny_qwen2_5_vl"
        tiny_qwen2_5_vl(seed=0).save_pretrained(model_dir)  # TRL loads the policy from a path
        config = GRPOConfig(
            output_dir=f"{out}/run", use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0,
            per_device_train_batch_size=2 * args.prompts, num_generations=2, max_completion_length=args.max_completion_length,
            max_steps=args.steps, learning_rate=1e-3, logging_steps=1, use_vllm=False,
        )
        processor = qwen_vl_processor()
        processor.tokenizer.padding_side = "left"  # required: the trainer refuses a processor that pads on the right
        trainer = OnPolicyGRPOTrainer(model=model_dir, reward_funcs=length_reward, args=config,
                                      train_dataset=dataset, processing_class=processor)
        trainer.train()
    for entry in trainer.state.log_history:
        if "on_policy/max_abs_diff" in entry:
            print(f"step {entry['step']}: loss {entry['loss']:+.2e}  reward {entry['reward']:+.3f}  "
                  f"rollout vs training: max |Δ log-prob| {entry['on_policy/max_abs_diff']:g}, "
                  f"{entry['on_policy/tokens_differ']:g} tokens differ")


if __name__ == "__main__":
    main()
