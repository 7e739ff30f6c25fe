"""TRL's GRPOTrainer with rlk_mm's LM head and loss: a few GRPO steps on image prompts, on the CPU.

The switch is one import; the trainer's arguments are TRL's::

    from rlk_mm.integrations.trl import GRPOTrainer   # instead of: from trl import GRPOTrainer

Policy, old and reference log-probs run in ``selected_logprob`` over the completion tokens
only; the training loss runs in ``linear_policy_loss`` (the LM head fused with the loss) where
TRL's settings allow it (``beta=0``, old log-probs present: here ``num_iterations=2``), else in
``selected_logprob`` + ``policy_loss``, said once in the log. Settings rlk_mm cannot reproduce
(``loss_type`` cispo/sapo/vespo, ``top_entropy_quantile``, ...) raise at construction.

Here: the tiny random Qwen2.5-VL and the real Qwen-VL processor (``rlk_mm.fixtures``, the
``rlk-mm[vl]`` extra), synthetic colour/shape questions with images, and a toy reward.
Swap in your model path, data set and reward functions.

    python examples/trl_grpo.py                 # 4 steps, rlk_mm's trainer
    python examples/trl_grpo.py --stock         # the same run with TRL's own GRPOTrainer
    python examples/trl_grpo.py --loss-type grpo --beta 0.04
"""

from __future__ import annotations

import argparse
import tempfile

from datasets import Dataset
from trl import GRPOConfig

from rlk_mm.fixtures import qwen_vl_processor, synthetic_image_text, tiny_qwen2_5_vl


def length_reward(completions, **kwargs) -> list[float]:
    """A toy reward: prefers completions of about 20 characters."""
    return [-abs(len(c[0]["content"]) - 20) / 20.0 for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--loss-type", default="dapo", help="grpo, bnpo, dr_grpo, dapo or luspo")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0: no reference model)")
    parser.add_argument("--stock", action="store_true", help="run TRL's own GRPOTrainer instead")
    args = parser.parse_args()

    if args.stock:
        from trl import GRPOTrainer
    else:
        from rlk_mm.integrations.trl import GRPOTrainer

    samples = synthetic_image_text(8, seed=0, max_images=2)
    dataset = Dataset.from_dict({"prompt": [s.messages for s in samples], "images": [s.images for s in samples]})
    with tempfile.TemporaryDirectory() as out:
        model_dir = f"{out}/tiny_qwen2_5_vl"
        tiny_qwen2_5_vl(seed=0).save_pretrained(model_dir)  # TRL loads the policy (and reference) from a path
        config = GRPOConfig(
            output_dir=f"{out}/run", use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0,
            per_device_train_batch_size=4, num_generations=2, max_completion_length=16, max_steps=args.steps,
            num_iterations=2, loss_type=args.loss_type, beta=args.beta, learning_rate=1e-3, logging_steps=1,
        )
        processor = qwen_vl_processor()
        processor.tokenizer.padding_side = "left"  # TRL pads prompt ids left, its media fields as the processor does
        trainer = GRPOTrainer(model=model_dir, reward_funcs=length_reward, args=config, train_dataset=dataset,
                              processing_class=processor)
        trainer.train()
    for entry in trainer.state.log_history:  # a step that re-uses the last completions logs no reward
        if "loss" in entry:
            reward = f"{entry['reward']:+.3f}" if "reward" in entry else "(re-used completions)"
            print(f"step {entry['step']}: loss {entry['loss']:+.6f}  entropy {entry['entropy']:.4f}  "
                  f"clip {entry['clip_ratio/region_mean']:.3f}  reward {reward}")


if __name__ == "__main__":
    main()
