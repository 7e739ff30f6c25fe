"""TRL adapter: TRL's ``GRPOTrainer`` with rlk_mm's LM head and loss.

The switch: ``from rlk_mm.integrations.trl import GRPOTrainer`` in place of
``from trl import GRPOTrainer``, same arguments. For a ``GRPOTrainer`` subclass of your own,
put ``RLKGRPOMixin`` first: ``class MyTrainer(RLKGRPOMixin, MyGRPOTrainer)``.

What changes: TRL's fused LM head (``model(..., labels=..., fused_lm_head=True)``) becomes
``selected_logprob`` over the labelled rows only, i.e. the completion tokens (policy, reference
and old log-probs alike), and ``_compute_loss`` becomes rlk_mm's; generation, rewards and
advantages stay TRL's. The training loss runs, by default, in ``linear_policy_loss`` (the LM
head fused with the loss: three logits-sized products, the gradient formed in the forward)
wherever TRL's loss is expressible there: ``beta == 0`` and ``entropy_coef == 0`` unless
``loss_type="bnpo"`` (with old log-probs, or on-policy without them: ``num_iterations=1``). Elsewhere it runs ``grpo_loss`` on
``selected_logprob``'s log-probs (four products), and says why once. ``linear_loss=False``
keeps that path throughout.

``grpo_loss`` reproduces TRL 1.16's loss types (``LOSS_TYPES``) with TRL's semantics (no
log-ratio clamp, ``delta`` as the dual clip, TRL's k3 KL); the options refused at construction
are listed in ``docs/guides/trl.md``, among them a processor that pads on the right.

Importing this module imports neither TRL nor transformers: ``GRPOTrainer`` is built (and TRL
imported) on first access.
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Optional

import torch
from torch import Tensor

from ..ops.logprob import selected_logprob
from ..ops.loss.config import PolicyLossConfig
from ..ops.loss.fused import linear_policy_loss
from ..ops.loss.op import agg_loss, policy_loss
from ..ops.options import RatioMode
from ..schema.checks import FLOAT_DTYPES, INTEGER_DTYPES, bool_arg, float_arg, int_arg, tensor_arg

__all__ = ["dapo_normalizer", "grpo_loss", "GRPOTrainer", "loss_config", "LOSS_TYPES", "RLKGRPOMixin"]

#: TRL loss types this adapter reproduces (TRL 1.16)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
_LEVELS = ("token", "sequence")
_IGNORE_INDEX = -100  # TRL's label for a token that is not scored
#: the media fields of TRL 1.16's batches that its scoring method (_get_per_token_logps_and_entropies) takes
_MEDIA_FIELDS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)
#: text-config fields that scale or soft-cap the logits: selected_logprob computes plain logits
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the loss
def grpo_loss(
    per_token_logps: Tensor,
    old_per_token_logps: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: Optional[float] = None,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_per_token_logps: Optional[Tensor] = None,
    use_bias_correction_kl: bool = True,
    importance_sampling_ratio: Optional[Tensor] = None,
    max_completion_length: Optional[int] = None,
    num_items: Optional[float | Tensor] = None,
    gradient_accumulation_steps: int = 1,
) -> tuple[Tensor, dict[str, Optional[Tensor]]]:
    """TRL ``GRPOTrainer``'s loss (``_compute_loss`` without the entropy bonus), by TRL's names.

    Parameters
    ----------
    per_token_logps, old_per_token_logps, completion_mask : Tensor
        Padded ``[B, C]`` over the completions.
    advantages : Tensor
        ``[B, C]`` or ``[B]``.
    loss_type : str
        ``grpo`` (mean of per-sequence means), ``bnpo`` (token mean), ``dr_grpo`` (sum / (B *
        ``max_completion_length``)), ``dapo`` (sum / ``num_items``), ``luspo`` (mean of per-sequence
        sums); all but ``dapo`` are then divided by ``gradient_accumulation_steps``.
    epsilon_low, epsilon_high, delta : float
        The clip and the dual clip (None: off).
    importance_sampling_level : str
        ``token`` or ``sequence`` (GSPO).
    beta, ref_per_token_logps : float, Tensor
        The KL weight and the reference log-probs (needed when ``beta > 0``).
    use_bias_correction_kl : bool
        TRL's setting of that name.
    importance_sampling_ratio : Tensor, optional
        ``[B, C]`` or ``[B, 1]`` vLLM importance-sampling correction.
    max_completion_length, num_items : int, float or Tensor, optional
        ``dr_grpo``'s and ``dapo``'s divisors (see ``dapo_normalizer``).
    gradient_accumulation_steps : int

    Returns
    -------
    tuple
        ``(loss, stats)``: ``policy_loss`` (the loss before the accumulation division, detached),
        ``ratio`` (TRL's ``coef_1``, detached: ``[B, C]``, or ``[B, 1]`` at the sequence level) and
        ``kl`` (the per-token KL term, detached; None without ``beta``).

    Raises
    ------
    ValueError, TypeError
        For a bad argument, naming TRL's name for it.
    """
    C = tensor_arg("per_token_logps", per_token_logps, ndim=2, dtypes=FLOAT_DTYPES).shape[1]
    B = per_token_logps.shape[0]
    tensor_arg("old_per_token_logps", old_per_token_logps, shape=(B, C), dtypes=FLOAT_DTYPES)
    tensor_arg("completion_mask", completion_mask, shape=(B, C))
    tensor_arg("advantages", advantages, ndim=(1, 2), dtypes=FLOAT_DTYPES)
    if advantages.shape not in ((B,), (B, 1), (B, C)):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [B={B}] (one per completion) or [B, C={C}]")
    loss_type, level, low, high, delta, beta = _options(
        loss_type, importance_sampling_level, epsilon_low, epsilon_high, delta, beta
    )
    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError(f"beta={beta} needs ref_per_token_logps (the reference model's log-probs); or set beta=0")
        tensor_arg("ref_per_token_logps", ref_per_token_logps, shape=(B, C), dtypes=FLOAT_DTYPES)
    use_bias_correction_kl = bool_arg("use_bias_correction_kl", use_bias_correction_kl)
    if importance_sampling_ratio is not None:
        importance_sampling_ratio = _per_token_is_ratio(importance_sampling_ratio, B, C)
    gradient_accumulation_steps = int_arg("gradient_accumulation_steps", gradient_accumulation_steps, min=1)
    config = loss_config(loss_type, level, low, high, delta, num_completions=B,
                         max_completion_length=max_completion_length)
    normalizer = dapo_normalizer(num_items) if loss_type == "dapo" else None

    ratio = _importance_ratio(per_token_logps, old_per_token_logps, completion_mask, level)
    loss, _ = policy_loss(
        per_token_logps, old_per_token_logps, advantages.reshape(B, -1).expand(B, C), completion_mask,
        rollout_is_weights=importance_sampling_ratio, config=config,
    )
    kl = None
    if beta != 0.0:
        # TRL's k3, unclamped: exp(ref - logp) - (ref - logp) - 1, times the ratio for the bias correction
        diff = ref_per_token_logps - per_token_logps
        kl = torch.exp(diff) - diff - 1.0
        if use_bias_correction_kl:
            kl = kl * ratio
        # policy_loss has checked the mask: a 0/1 integer mask as bool needs no second check (host read)
        kl_mask = completion_mask if completion_mask.is_floating_point() else completion_mask.bool()
        loss = loss + beta * agg_loss(kl, kl_mask, config.loss_agg_mode,
                                      global_batch_size=config.global_batch_size,
                                      loss_scale_factor=config.loss_scale_factor)
        kl = kl.detach()
    if normalizer is not None:
        loss = loss / normalizer
    stats = {"policy_loss": loss.detach(), "ratio": ratio.detach(), "kl": kl}
    if loss_type != "dapo":
        loss = loss / gradient_accumulation_steps
    return loss, stats


def dapo_normalizer(num_items) -> float | Tensor:
    """TRL's ``dapo`` divisor ``num_items``.

    ``num_items_in_batch`` clamped at 1, divided by the processes, rescaled to one accumulation window.

    Parameters
    ----------
    num_items : float or Tensor
        A number > 0 (checked), or a 0-d float tensor (not read on the host).

    Returns
    -------
    float or Tensor
        The divisor; a tensor is NaN where it is <= 0 or not finite, so the loss shows it.

    Raises
    ------
    ValueError, TypeError
        For a number that is not > 0, or another type.
    """
    if num_items is None:
        raise ValueError("loss_type='dapo' needs num_items (TRL's normalizer: the active tokens of the accumulation "
                         "window, num_items_in_batch clamped at 1, per process)")
    if not isinstance(num_items, Tensor):
        return float_arg("num_items", num_items, min=0.0, min_open=True)
    tensor_arg("num_items", num_items, ndim=0, dtypes=FLOAT_DTYPES + INTEGER_DTYPES)
    n = num_items.to(torch.float32)
    return torch.where((n > 0) & torch.isfinite(n), n, torch.full_like(n, float("nan")))


def _per_token_is_ratio(ratio: Tensor, B: int, C: int) -> Tensor:
    """vLLM's importance-sampling ratio (per token ``[B, C]`` or per sequence ``[B, 1]``) as ``[B, C]``."""
    tensor_arg("importance_sampling_ratio", ratio, dtypes=FLOAT_DTYPES)
    if ratio.shape not in ((B, C), (B, 1)):
        raise ValueError(
            f"importance_sampling_ratio has shape {tuple(ratio.shape)}; expected [B={B}, C={C}] (per token) or "
            "[B, 1] (per sequence)"
        )
    return ratio.expand(B, C)


def _importance_ratio(logps: Tensor, old: Tensor, mask: Tensor, level: str) -> Tensor:
    """TRL's ``coef_1``: exp of the log-ratio per token ``[B, C]``, or of its masked sequence mean ``[B, 1]``."""
    log_ratio = logps - old
    if level == "sequence":
        mask = mask.float()
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return torch.exp(log_ratio)


def loss_config(loss_type: str, importance_sampling_level: str, epsilon_low: float, epsilon_high: float,
                delta: Optional[float], *, num_completions: int, max_completion_length: Optional[int] = None,
                entropy_coeff: float = 0.0) -> PolicyLossConfig:
    """The ``PolicyLossConfig`` of TRL ``GRPOConfig``'s loss settings, by TRL's names.

    Parameters
    ----------
    loss_type : str
        The aggregation (see ``grpo_loss``). ``dapo`` is the token sum: the caller divides by
        ``dapo_normalizer``'s divisor rather than passing it as ``batch_num_tokens``.
    importance_sampling_level : str
        ``token``, or ``sequence``: GSPO with the gradient through the sequence mean.
    epsilon_low, epsilon_high : float
        The clip (no log-ratio clamp).
    delta : float or None
        The dual clip.
    num_completions : int
        The batch's completions.
    max_completion_length : int, optional
        For ``dr_grpo``.
    entropy_coeff : float
        The entropy bonus.

    Returns
    -------
    PolicyLossConfig

    Raises
    ------
    ValueError, TypeError
        For a setting rlk_mm cannot reproduce, naming it.
    """
    loss_type, level, low, high, delta, _ = _options(loss_type, importance_sampling_level, epsilon_low, epsilon_high,
                                                     delta, 0.0)
    return PolicyLossConfig(
        clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=delta,
        ratio=RatioMode.GSPO if level == "sequence" else RatioMode.TOKEN, log_ratio_clamp=(None, None),
        entropy_coeff=entropy_coeff, **_aggregation(loss_type, num_completions, max_completion_length),
    )


def _options(loss_type, level, epsilon_low, epsilon_high, delta, beta):
    """The loss options checked, by TRL's names: (loss_type, level, epsilon_low, epsilon_high, delta, beta)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"loss_type={loss_type!r}: rlk_mm reproduces {', '.join(LOSS_TYPES)}; keep TRL's own GRPOTrainer for "
            "cispo, sapo and vespo"
        )
    if level not in _LEVELS:
        raise ValueError(f"importance_sampling_level={level!r}: expected 'token' or 'sequence'")
    epsilon_low = float_arg("epsilon", epsilon_low, min=0.0, max=1.0)
    epsilon_high = float_arg("epsilon_high", epsilon_high, min=0.0)
    if delta is not None:
        delta = float_arg("delta", delta)
        if not delta > 1.0 + epsilon_high:
            raise ValueError(
                f"delta={delta} must be > 1 + epsilon_high = {1.0 + epsilon_high}: at or below it TRL's two-sided clip "
                "also caps positive-advantage ratios, which rlk_mm's dual clip does not; raise delta or set it to None"
            )
    beta = float_arg("beta", beta, min=0.0)
    return loss_type, level, epsilon_low, epsilon_high, delta, beta


def _aggregation(loss_type: str, B: int, max_completion_length) -> dict:
    """``policy_loss`` / ``agg_loss`` aggregation arguments of a TRL loss type."""
    if loss_type == "grpo":
        return {"loss_agg_mode": "seq"}
    if loss_type == "bnpo":
        return {"loss_agg_mode": "token-mean"}
    if loss_type == "luspo":
        return {"loss_agg_mode": "seq-mean-token-sum", "global_batch_size": B}
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (it divides by B * max_completion_length)")
        length = int_arg("max_completion_length", max_completion_length, min=1)
        return {"loss_agg_mode": "seq-mean-token-sum-norm", "global_batch_size": B, "loss_scale_factor": length}
    return {"loss_agg_mode": "token-sum"}  # dapo: the caller divides by TRL's normalizer (dapo_normalizer)


# ----------------------------------------------------------------------------- the LM head
def _install_head(model, temperature: float, entropy: bool) -> None:
    """Makes TRL's fused-head call ``model(..., labels=..., fused_lm_head=True)`` score the labelled
    tokens with ``selected_logprob`` (or, given ``policy_loss_args``, return ``linear_policy_loss``
    over them); any other call goes to the forward the model had."""
    text_config = model.config.get_text_config()
    for name in _LOGIT_TRANSFORMS:
        if getattr(text_config, name, None) not in (None, 1, 1.0):
            raise ValueError(
                f"the model's config sets {name}={getattr(text_config, name)}: rlk_mm's LM head computes plain "
                "logits (h @ W.T + b) / temperature; use TRL's own GRPOTrainer for this model"
            )
    backbone = _backbone_attribute(model, text_config)
    if getattr(model, backbone) is model:
        raise ValueError(f"{type(model).__name__} has no backbone ({backbone}) apart from its LM head")
    plain_forward = model.forward

    @functools.wraps(type(model).forward)  # generate() checks its keyword arguments against this signature
    def forward(self, *args, fused_lm_head=False, policy_loss_args=None, **kwargs):
        if not fused_lm_head:
            return plain_forward(*args, **kwargs)
        return _scored_forward(self, backbone, args, kwargs, temperature, entropy, policy_loss_args)

    model.forward = types.MethodType(forward, model)


def _backbone_attribute(model, text_config) -> str:
    """Where the model keeps its backbone: ``base_model``; before transformers 5 a vision-language
    model's language backbone is ``model`` (as TRL's own fused head reads it)."""
    if text_config is model.config:
        return "base_model"
    import transformers

    return "base_model" if int(transformers.__version__.split(".")[0]) >= 5 else "model"


def _scored_forward(model, backbone: str, args, kwargs, temperature: float, entropy: bool, policy_loss_args):
    """The backbone, then, for the tokens whose label is not -100: their log-probs (and entropies),
    zero elsewhere, as TRL's ``FusedCausalLMOutput``; or, given ``policy_loss_args``,
    ``linear_policy_loss`` over them (per-token arguments compact, in row-major token order)."""
    labels = kwargs.pop("labels")
    for name in ("shift_labels", "num_items_in_batch", "output_router_logits"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name} is not supported by rlk_mm's LM head (sequence parallelism, MoE aux losses)")
    hidden = getattr(model, backbone)(*args, use_cache=False, **kwargs).last_hidden_state
    head = model.get_output_embeddings()
    scored = labels[:, 1:] != _IGNORE_INDEX  # target t + 1 is scored from hidden state t
    b, t = scored.nonzero(as_tuple=True)
    rows = dict(index=b * hidden.shape[1] + t, targets=labels[b, t + 1], temperature=temperature, bias=head.bias)
    hidden = hidden.to(head.weight.dtype)
    if policy_loss_args is not None:
        return linear_policy_loss(hidden, head.weight, **rows, **policy_loss_args)
    from trl.trainer.utils import FusedCausalLMOutput

    out = selected_logprob(hidden, head.weight, **rows, return_entropy=entropy)
    logp, ent = out if entropy else (out, None)
    return FusedCausalLMOutput(log_probs=_spread(logp, scored), entropy=None if ent is None else _spread(ent, scored),
                               label_mask=scored)


def _spread(values: Tensor, where: Tensor) -> Tensor:
    """Compact per-token values back to the padded ``where.shape``, zero elsewhere."""
    return values.new_zeros(where.shape).masked_scatter(where, values)


# ----------------------------------------------------------------------------- the trainer
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
        _install_head(policy, self.temperature, entropy=True)
        if self.ref_model is not None:
            _install_head(self.ref_model, self.temperature, entropy=False)

    def _check_supported(self) -> None:
        args = self.args
        _options(args.loss_type, args.importance_sampling_level, self.epsilon_low, self.epsilon_high, args.delta, args.beta)
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
        _options(self.loss_type, level, self.epsilon_low, self.epsilon_high, self.args.delta, self.beta)
        scored = mask.bool()
        b, c = scored.nonzero(as_tuple=True)
        labels = torch.full_like(prompt_ids, _IGNORE_INDEX)
        labels = torch.cat([labels, completion_ids.masked_fill(~scored, _IGNORE_INDEX)], dim=1)
        advantages = inputs["advantages"]
        tensor_arg("advantages", advantages, ndim=(1, 2), dtypes=FLOAT_DTYPES)
        if advantages.shape not in ((B,), (B, 1), (B, C)):
            raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [B={B}] or [B, C={C}]")
        per_token = {"advantages": advantages.reshape(B, -1).expand(B, C)}
        if old is not None:
            per_token["old_log_probs"] = old
        if self.use_vllm and self.vllm_importance_sampling_correction:
            per_token["rollout_is_weights"] = _per_token_is_ratio(inputs["importance_sampling_ratio"], B, C)
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
        logps = _spread(out.log_probs, scored)
        old = logps if old is None else old.masked_fill(~scored, 0.0)
        pg_loss = out.metrics["pg_loss"] / normalizer if self.loss_type == "dapo" else out.metrics["pg_loss"]
        stats = {"policy_loss": pg_loss, "kl": None, "ratio": _importance_ratio(logps, old, mask, level),
                 "log_probs": logps.detach()}
        return loss, stats, _spread(out.entropy, scored)

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
def _trainer_class():
    from trl import GRPOTrainer as TRLGRPOTrainer

    doc = "TRL's GRPOTrainer with rlk_mm's LM head and loss (see rlk_mm.integrations.trl); TRL's arguments."
    return type("GRPOTrainer", (RLKGRPOMixin, TRLGRPOTrainer), {"__module__": __name__, "__doc__": doc})


def __getattr__(name: str):
    """``GRPOTrainer``: built on first access, so that importing this module does not import TRL."""
    if name == "GRPOTrainer":
        return _trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
