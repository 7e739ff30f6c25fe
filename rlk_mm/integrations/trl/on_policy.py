"""Exactly on-policy GRPO in TRL: ``OnPolicyGRPOTrainer`` generates with ``generate_on_policy``.

The switch: ``from rlk_mm.integrations.trl.on_policy import OnPolicyGRPOTrainer`` in place of
``trl.GRPOTrainer`` (same arguments, plus ``kernels``), for a Qwen2.5-VL policy with TRL's
transformers generation (``use_vllm=False``). It is ``rlk_mm.integrations.trl.GRPOTrainer``
(rlk_mm's LM head and loss) whose generation goes through ``generate_on_policy``: the
decode runs under ``batch_invariant()`` and every token is drawn by ``sample_from_hidden``
from the final hidden state, seeded by ``GRPOConfig.seed`` and a per-process rollout count.
The training step (the loss, TRL's old and reference log-prob passes and the backward) runs
under ``batch_invariant()`` too, so the rollout's log-probs are bitwise the training's: TRL
receives them as its sampling log-probs, and the trainer logs ``on_policy/max_abs_diff``
and ``on_policy/tokens_differ`` (0 and 0 while the policy has not moved since the rollout,
i.e. at every step with ``num_iterations=1``). With ``num_iterations=1`` TRL already skips
its old-log-prob forward (the current log-probs, detached, are the old ones): exact here.

TRL's sampling settings carry over (``temperature``, ``top_k``, ``top_p``,
``max_completion_length``, EOS ids as stop ids). Refused at construction, naming the
``GRPOConfig`` field, besides what ``GRPOTrainer`` refuses: ``use_vllm``, transformers
continuous batching, ``min_p``, ``repetition_penalty != 1``, ``generation_kwargs``,
``cast_lm_head_to_fp32``, tools, environments and ``rollout_func``. A row whose draw is a
media placeholder or past the tokenizer's vocabulary (``OnPolicyRollout.rejected``; TRL's own
generate suppresses the image token instead) gets an empty completion, which scores no token;
``on_policy/rejected`` counts them.
"""

from __future__ import annotations

import numpy as np
import torch

from ...models.rollout import Kernels, generate_on_policy
from ...ops.invariant.mode import within_batch_invariant
from .trainer import RLKGRPOMixin, trainer_class

__all__ = ["OnPolicyGRPOTrainer", "OnPolicyRolloutMixin"]


class OnPolicyRolloutMixin:
    """Put before ``RLKGRPOMixin`` in a TRL ``GRPOTrainer`` (sub)class: generation through
    ``generate_on_policy`` and the scoring forwards under ``batch_invariant()``.

    Parameters
    ----------
    *args, **kwargs
        ``RLKGRPOMixin``'s and ``GRPOTrainer``'s.
    kernels : "invariant" or "default"
        The rollout's kernels; ``"default"`` is the control (its log-probs drift from the
        training's, which ``on_policy/max_abs_diff`` shows).
    """

    def __init__(self, *args, kernels: Kernels | str = Kernels.INVARIANT, **kwargs):
        kernels = Kernels.parse(kernels, "kernels")
        super().__init__(*args, **kwargs)
        self._check_on_policy()
        self._rollout_kernels = kernels
        self._rollouts = 0

    def _check_on_policy(self) -> None:
        args = self.args
        refused = {
            "use_vllm": (args.use_vllm, "set it to False (vLLM runs its own kernels)"),
            "use_transformers_continuous_batching": (args.use_transformers_continuous_batching, "set it to False"),
            "min_p": (args.min_p is not None, "set it to None (generate_on_policy has temperature, top_k, top_p)"),
            "repetition_penalty": (args.repetition_penalty != 1.0, "set it to 1.0"),
            "generation_kwargs": (args.generation_kwargs is not None, "set it to None"),
            "cast_lm_head_to_fp32": (args.cast_lm_head_to_fp32, "set it to False (the rollout scores with the "
                                     "training head as it is)"),
        }
        for name, (bad, fix) in refused.items():
            if bad:
                raise ValueError(f"GRPOConfig.{name}={getattr(args, name)!r} is not supported by OnPolicyGRPOTrainer: "
                                 f"{fix}, or use rlk_mm.integrations.trl.GRPOTrainer")
        for name in ("tools", "environment_factories", "rollout_func"):
            if getattr(self, name, None):
                raise ValueError(f"GRPOTrainer({name}=...) is not supported by OnPolicyGRPOTrainer: its rollout is "
                                 "one turn through generate_on_policy; use rlk_mm.integrations.trl.GRPOTrainer")

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's one-turn generation, through ``generate_on_policy``: (completion ids, log-probs) per row."""
        from trl.models import unwrap_model_for_generation
        from trl.trainer.utils import pad

        def left_padded(per_row, value):  # as TRL's own generate pads them
            return pad([torch.as_tensor(np.asarray(row)) for row in per_row], padding_value=value, padding_side="left")

        rows = len(prompt_ids)
        inputs = {"input_ids": left_padded(prompt_ids, self._tokenizer.pad_token_id),
                  "attention_mask": left_padded([[1] * len(ids) for ids in prompt_ids], 0)}
        for key, value in multimodal_fields.items():
            if isinstance(value, torch.Tensor):
                inputs[key] = value
            elif isinstance(value, (list, tuple)) and len(value) == rows and all(
                    len(row) == len(ids) for row, ids in zip(value, prompt_ids)):  # per token (mm_token_type_ids)
                inputs[key] = left_padded(value, 0)
            else:
                inputs[key] = torch.as_tensor(np.asarray(value))
        rank, step = self.accelerator.process_index, self._rollouts
        self._rollouts += 1
        with unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                         gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                                         gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs) as model:
            rollout = generate_on_policy(
                model, inputs, processor=self.processing_class, max_new_tokens=self.max_completion_length,
                temperature=self.temperature, top_k=self.top_k or None, top_p=None if self.top_p == 1.0 else self.top_p,
                seed=self.args.seed, step=step, stop_token_ids=self.eos_token_ids,
                group_ids=[f"{rank}:{r}" for r in range(rows)], kernels=self._rollout_kernels)
        kept = dict(zip(rollout.rows, zip(rollout.responses, rollout.log_probs)))
        completions = [kept[r][0].tolist() if r in kept else [] for r in range(rows)]
        log_probs = [kept[r][1].tolist() if r in kept else [] for r in range(rows)]
        self._metrics["train" if self.model.training else "eval"]["on_policy/rejected"].append(
            float(self.accelerator.gather(torch.tensor(len(rollout.rejected), device=self.accelerator.device)).sum()))
        return completions, log_probs

    def training_step(self, *args, **kwargs):
        """TRL's step (generation, scoring, loss and backward) under ``batch_invariant()``: an
        activation-checkpointed backward recomputes the forward with the kernels it ran with."""
        with within_batch_invariant():
            return super().training_step(*args, **kwargs)

    def _compute_loss(self, model, inputs):  # also evaluation's
        with within_batch_invariant():
            return super()._compute_loss(model, inputs)

    def _log_loss_metrics(self, mode, stats, entropies, mask, inputs) -> None:
        """TRL's metrics, and how far the training log-probs are from the rollout's (0 and 0 on-policy)."""
        rollout = inputs.get("sampling_per_token_logps")
        if rollout is not None:
            scored = mask.bool()
            diff = (stats["log_probs"] - rollout).abs()[scored]
            differ = (stats["log_probs"] != rollout)[scored].sum()
            peak = diff.max() if diff.numel() else diff.new_zeros(())
            self._metrics[mode]["on_policy/max_abs_diff"].append(self.accelerator.gather(peak).max().item())
            self._metrics[mode]["on_policy/tokens_differ"].append(self.accelerator.gather(differ).sum().item())
        super()._log_loss_metrics(mode, stats, entropies, mask, inputs)


def __getattr__(name: str):
    """``OnPolicyGRPOTrainer``: built on first access, so that importing this module does not import TRL."""
    if name == "OnPolicyGRPOTrainer":
        return trainer_class("OnPolicyGRPOTrainer", (OnPolicyRolloutMixin, RLKGRPOMixin), __name__,
                             "TRL's GRPOTrainer with rlk_mm's LM head and loss, generating through generate_on_policy "
                             "(see rlk_mm.integrations.trl.on_policy); TRL's arguments and kernels.")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
