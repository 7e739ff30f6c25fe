"""rlk_mm's LM head in a TRL policy: ``install_head`` makes TRL's fused-head call
``model(..., labels=..., fused_lm_head=True)`` run the backbone, then score only the labelled
tokens (the completion tokens) with ``rlk_mm.ops.selected_logprob``, or, given
``policy_loss_args``, compute the loss over them with ``rlk_mm.ops.linear_policy_loss``; any other
call goes to the forward the model had. Models whose config scales or soft-caps the logits are
refused: these ops compute plain logits.
"""

from __future__ import annotations

import functools
import types

from torch import Tensor

from ...ops.logprob import selected_logprob
from ...ops.loss.fused import linear_policy_loss

__all__: list[str] = []

#: TRL's label for a token that is not scored
IGNORE_INDEX = -100
#: text-config fields that scale or soft-cap the logits: selected_logprob computes plain logits
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


def install_head(model, temperature: float, entropy: bool) -> None:
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
    scored = labels[:, 1:] != IGNORE_INDEX  # target t + 1 is scored from hidden state t
    b, t = scored.nonzero(as_tuple=True)
    rows = dict(index=b * hidden.shape[1] + t, targets=labels[b, t + 1], temperature=temperature, bias=head.bias)
    hidden = hidden.to(head.weight.dtype)
    if policy_loss_args is not None:
        return linear_policy_loss(hidden, head.weight, **rows, **policy_loss_args)
    from trl.trainer.utils import FusedCausalLMOutput

    out = selected_logprob(hidden, head.weight, **rows, return_entropy=entropy)
    logp, ent = out if entropy else (out, None)
    return FusedCausalLMOutput(log_probs=spread(logp, scored), entropy=None if ent is None else spread(ent, scored),
                               label_mask=scored)


def spread(values: Tensor, where: Tensor) -> Tensor:
    """Compact per-token values back to the padded ``where.shape``, zero elsewhere."""
    return values.new_zeros(where.shape).masked_scatter(where, values)
