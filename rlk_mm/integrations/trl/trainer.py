"""TRL's ``GRPOTrainer`` with rlk_mm's LM head and loss: ``RLKGRPOMixin``, and ``GRPOTrainer``,
the mixin on TRL's class, built on first access (``trainer_class``) so that importing this module
does not import TRL.

The mixin installs rlk_mm's LM head (``trl.lm_head``) in the policy and the reference model and
replaces ``_compute_loss``: the loss in ``linear_policy_loss`` where TRL's loss is expressible
there, else ``grpo_loss`` (``trl.losses``) on ``selected_logprob``'s log-probs; TRL's metrics are
logged as TRL logs them. Options it cannot reproduce are refused at construction.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from torch import Tensor

from ...ops.loss.op import agg_loss
from ...schema.checks import FLOAT_DTYPES, bool_arg, tensor_arg
from .config import check_options, loss_config
from .lm_head import IGNORE_INDEX, install_head, spread
from .losses import dapo_normalizer, grpo_loss, importance_ratio, per_token_is_ratio

__all__ = ["GRPOTrainer", "RLKGRPOMixin"]

#: the media fields of TRL 1.16's batches that its scoring method (_get_per_token_logps_and_entropies) takes
_MEDIA_FIELDS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)

logger = logging.getLogger(__name__)


class RLKGRPOMixin:
    """Put first in the bases of a TRL ``GRPOTrainer`` (sub)class: its LM head and its loss become rlk_mm's.

    Parameters
    ----------
    *args, **kwargs
        ``GRPOTrainer``'s.
    linear_loss : bool
        The LM head becomes ``selected_logprob``; the loss ``linear_policy_loss`` where the settings
        allow it (True), else ``grpo_loss``.

    Raises
    ------
    ValueError
        At construction, for options it cannot reproduce, naming the ``GRPOConfig`` field.
    """

    def __init__(self, *args, linear_loss: bool = True, **kwargs):
        linear_loss = bool_arg("linear_loss", linear_loss)
        super().__init__(*args, **kwargs)
        self._check_supported()
        self._linear_loss = linear_loss
        self._said: set = set()
        policy = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # PEFT
        install_head(policy, self.temperature, entropy=True)
        if self.ref_model is not None:
            install_head(self.ref_model, self.temperature, entropy=False)

    def _check_supported(self) -> None:
        args = self.args
        check_options(args.loss_type, args.importance_sampling_level, self.epsilon_low, self.epsilon_high, args.delta, args.beta)
        refused = {
            "top_entropy_quantile": (args.top_entropy_quantile < 1.0, "set it to 1.0"),
            "off_policy_mask_threshold": (args.off_policy_mask_threshold is not None, "set it to None"),
            "use_adaptive_entropy": (args.use_adaptive_entropy, "set it to False (a fixed entropy_coef is supported)"),
            "router_aux_loss_coef": (self.aux_loss_enabled, "set it to 0.0 (MoE aux losses are not supported)"),
        }
        for name, (bad, fix) in refused.items():
            if bad:
                raise ValueError(
                    f"GRPOConfig.{name}={getattr(args, name)!r} is not supported by rlk_mm's GRPOTrainer: {fix}, "
                    "or use trl.GRPOTrainer"
                )
        side = getattr(getattr(self.processing_class, "tokenizer", None), "padding_side", "left")
        if self._is_vlm and side != "left":  # TRL pads prompt ids left, mm_token_type_ids as the processor does
            raise ValueError(f"processing_class pads on the {side}: TRL 1.16 would train the media at other positions "
                             "than it generated them at (prompts of different lengths); set "
                             "processing_class.tokenizer.padding_side = 'left'")

    def _why_not_linear(self, inputs) -> Optional[str]:
        """Why this batch's loss cannot run in ``linear_policy_loss``, or None when it can."""
        if not self._linear_loss:
            return "linear_loss=False"
        if self.beta != 0.0:
            return f"beta={self.beta}: TRL's KL form (unclamped k3 times the ratio) is not one of linear_policy_loss's"
        if self.entropy_coef != 0.0 and self.loss_type != "bnpo":
            return (f"entropy_coef={self.entropy_coef} with loss_type={self.loss_type!r}: TRL's entropy bonus is a "
                    "token mean, linear_policy_loss aggregates it as the loss type does")
        return None

    def _compute_loss(self, model, inputs):
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_items = None
        if self.loss_type == "dapo":  # TRL's normalizer: the active tokens of one accumulation window
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * accumulation / self.args.steps_per_generation
        why_not = self._why_not_linear(inputs)
        if why_not is None:
            loss, stats, entropies = self._linear_loss_and_stats(model, inputs, mask, num_items, accumulation)
        else:
            if self._linear_loss and why_not not in self._said:
                self._said.add(why_not)
                logger.warning("rlk_mm: TRL's loss runs on selected_logprob + policy_loss (4 products): %s", why_not)
            loss, stats, entropies = self._scored_loss_and_stats(model, inputs, mask, num_items, accumulation)
        if self.entropy_coef != 0.0:
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(stats["policy_loss"]).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        self._log_loss_metrics(mode, stats, entropies, mask.float(), inputs)
        return loss

    def _scored_loss_and_stats(self, model, inputs, mask, num_items, accumulation):
        """TRL's loss from ``selected_logprob``'s log-probs and ``grpo_loss``: (loss, stats, entropies)."""
        completion_ids = inputs["completion_ids"]
        logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), completion_ids.shape[1],
            compute_entropy=True, **{k: inputs[k] for k in _MEDIA_FIELDS if k in inputs},
        )
        old = inputs.get("old_per_token_logps")
        vllm_ratio = self.use_vllm and self.vllm_importance_sampling_correction
        loss, stats = grpo_loss(
            logps, logps.detach() if old is None else old, inputs["advantages"], mask,
            loss_type=self.loss_type, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
            delta=self.args.delta, importance_sampling_level=self.importance_sampling_level, beta=self.beta,
            ref_per_token_logps=inputs.get("ref_per_token_logps"),
            use_bias_correction_kl=self.args.use_bias_correction_kl,
            importance_sampling_ratio=inputs["importance_sampling_ratio"] if vllm_ratio else None,
            max_completion_length=self.max_completion_length, num_items=num_items,
            gradient_accumulation_steps=accumulation,
        )
        if self.entropy_coef != 0.0:  # TRL's bonus: the token-mean entropy, whatever the loss type
            loss = loss - self.entropy_coef * agg_loss(entropies, mask, "token-mean") / accumulation
        return loss, {**stats, "log_probs": logps.detach()}, entropies.detach()

    def _linear_loss_and_stats(self, model, inputs, mask, num_items, accumulation):
        """TRL's loss in one ``linear_policy_loss`` over the loss tokens (``mask``): (loss, stats, entropies)."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        old = inputs.get("old_per_token_logps")  # None on-policy: TRL's old log-probs are then the new ones
        B, C = completion_ids.shape
        level = self.importance_sampling_level
        check_options(self.loss_type, level, self.epsilon_low, self.epsilon_high, self.args.delta, self.beta)
        scored = mask.bool()
        b, c = scored.nonzero(as_tuple=True)
        labels = torch.full_like(prompt_ids, IGNORE_INDEX)
        labels = torch.cat([labels, completion_ids.masked_fill(~scored, IGNORE_INDEX)], dim=1)
        advantages = inputs["advantages"]
        tensor_arg("advantages", advantages, ndim=(1, 2), dtypes=FLOAT_DTYPES)
        if advantages.shape not in ((B,), (B, 1), (B, C)):
            raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [B={B}] or [B, C={C}]")
        per_token = {"advantages": advantages.reshape(B, -1).expand(B, C)}
        if old is not None:
            per_token["old_log_probs"] = old
        if self.use_vllm and self.vllm_importance_sampling_correction:
            per_token["rollout_is_weights"] = per_token_is_ratio(inputs["importance_sampling_ratio"], B, C)
        loss_args = {"old_log_probs": None, **{name: x[b, c] for name, x in per_token.items()}}
        loss_args.update(sample_index=b, num_samples=B, config=loss_config(
            self.loss_type, level, self.epsilon_low, self.epsilon_high, self.args.delta, num_completions=B,
            max_completion_length=self.max_completion_length, entropy_coeff=self.entropy_coef))
        normalizer = dapo_normalizer(num_items) if self.loss_type == "dapo" else accumulation
        media = {k: inputs[k] for k in _MEDIA_FIELDS if k in inputs and k not in ("num_images", "num_tiles")}
        with self.accelerator.autocast():
            out = model(input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
                        attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                        **media, labels=labels, fused_lm_head=True, policy_loss_args=loss_args)
        loss = out.loss / normalizer
        logps = spread(out.log_probs, scored)
        old = logps if old is None else old.masked_fill(~scored, 0.0)
        pg_loss = out.metrics["pg_loss"] / normalizer if self.loss_type == "dapo" else out.metrics["pg_loss"]
        stats = {"policy_loss": pg_loss, "kl": None, "ratio": importance_ratio(logps, old, mask, level),
                 "log_probs": logps.detach()}
        return loss, stats, spread(out.entropy, scored)

    def _log_loss_metrics(self, mode: str, stats: dict, entropies: Tensor, mask: Tensor, inputs: dict) -> None:
        """TRL's metrics: KL, entropy and the clip fractions, over all processes (``stats``: the loss's,
        with the per-token ``log_probs``; ``inputs``: the batch)."""
        from trl.trainer.utils import nanmax, nanmin

        def mean(x):  # token-weighted; a [B, 1] value counts once per sequence
            if x.shape[1] == 1:
                sums = torch.stack([x.sum(), x.new_tensor(float(x.shape[0]))])
            else:
                sums = torch.stack([(x * mask).sum(), mask.sum()])
            sums = self.accelerator.reduce(sums, reduction="sum")
            return (sums[0] / sums[1].clamp(min=1.0)).item()

        def per_sequence(x):  # gathered from all processes; NaN for a sequence without tokens
            return self.accelerator.gather(x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1))

        metrics = self._metrics[mode]
        if stats["kl"] is not None:
            metrics["kl"].append(mean(stats["kl"]))
        metrics["entropy"].append(mean(entropies))
        ratio, advantages = stats["ratio"], inputs["advantages"].reshape(inputs["advantages"].shape[0], -1)
        low = ((ratio < 1.0 - self.epsilon_low) & (advantages < 0)).float()
        high = ((ratio > 1.0 + self.epsilon_high) & (advantages > 0)).float()
        metrics["clip_ratio/low_mean"].append(mean(low))
        metrics["clip_ratio/high_mean"].append(mean(high))
        metrics["clip_ratio/region_mean"].append(mean(torch.maximum(low, high)))
        metrics["clip_ratio/low_min"].append(nanmin(per_sequence(low)).item())
        metrics["clip_ratio/high_max"].append(nanmax(per_sequence(high)).item())


@functools.cache
def trainer_class(name: str, mixins: tuple[type, ...], module: str, doc: str) -> type:
    """The class ``name``: ``mixins`` first in the bases, then TRL's ``GRPOTrainer`` (imported now), as
    served by ``module``; built once per set of arguments."""
    from trl import GRPOTrainer as TRLGRPOTrainer

    return type(name, (*mixins, TRLGRPOTrainer), {"__module__": module, "__doc__": doc})


def __getattr__(name: str):
    """``GRPOTrainer``: built on first access, so that importing this module does not import TRL."""
    if name == "GRPOTrainer":
        return trainer_class("GRPOTrainer", (RLKGRPOMixin,), "rlk_mm.integrations.trl", "TRL's GRPOTrainer with rlk_mm's "
                             "LM head and loss (see rlk_mm.integrations.trl); TRL's arguments.")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
