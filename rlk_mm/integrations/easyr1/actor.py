"""One micro-batch of EasyR1's ``update_policy`` with the LM head fused with the loss:
``micro_batch_loss`` runs the actor's model with its ``lm_head`` call replaced by
``rlk_mm.ops.linear_policy_loss`` over the response tokens, under ``loss_config`` of the actor's
``ActorConfig``, after the checks the builders run on a verl-style padded micro-batch
(``integrations.micro_batch``). It is for an actor loop of your own: ``patch`` does not swap it in.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...schema.checks import FLOAT_DTYPES, temperature_arg, tensor_arg
from ..args import padded_inputs
from ..micro_batch import MediaTokens, check_padded_micro_batch
from .config import LOSS_TYPES, loss_config
from .losses import policy_metrics

__all__ = ["micro_batch_loss"]


#: what ``micro_batch_loss`` reads of a micro-batch (besides the optional ``ref_log_probs``, ``multi_modal_inputs``)
_MICRO_BATCH_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "old_log_probs",
                     "advantages")


def micro_batch_loss(actor, micro_batch: Mapping, temperature: float) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch of EasyR1's ``update_policy`` with the LM head fused with the loss.

    ``linear_policy_loss`` inside the model's own ``lm_head`` call. In an actor of your own, this
    replaces ``_forward_micro_batch``, ``compute_policy_loss``, ``compute_kl`` and ``average_loss``::

        loss, batch_metrics = micro_batch_loss(self, model_inputs, temperature)
        loss = loss * torch.sum(response_mask) * self.world_size / total_response_tokens

    Parameters
    ----------
    actor : DataParallelPPOActor
        An EasyR1 actor (``actor_module``: the causal LM; ``config``: its ``ActorConfig``).
    micro_batch : Mapping
        ``update_policy``'s ``model_inputs`` (``input_ids``, ``attention_mask``, ``position_ids``,
        ``responses``, ``response_mask``, ``old_log_probs``, ``advantages``, optional
        ``ref_log_probs`` and ``multi_modal_inputs``), padded or padding-free.
    temperature : float

    Returns
    -------
    tuple
        ``(loss, metrics)``: EasyR1's ``pg_loss + kl_coef * kl_loss`` before ``update_policy`` scales
        it by the micro-batch's token share (call ``backward`` once), and the ``actor/...`` floats.

    Raises
    ------
    ValueError, TypeError
        For a micro-batch ``RLBatch.from_verl`` would refuse (one host read), naming the key; for
        settings not fused: ``loss_type`` cispo/sapo, ``kl_penalty='full'``, ``ulysses_size > 1``.
    """
    config = _actor_config(actor)
    if not isinstance(micro_batch, Mapping):
        raise TypeError(
            f"micro_batch must be a dict of tensors (update_policy's model_inputs), got {type(micro_batch).__name__}")
    if config.loss_type not in LOSS_TYPES:
        raise ValueError(f"config.loss_type={config.loss_type!r}: the fused loss implements {', '.join(LOSS_TYPES)}; "
                         "use EasyR1's own update_policy for cispo and sapo")
    if config.ulysses_size != 1:
        raise ValueError(f"config.ulysses_size={config.ulysses_size}: the fused loss has no sequence parallelism; set 1")
    temperature = temperature_arg(temperature)
    with_kl = config.use_kl_loss and "ref_log_probs" in micro_batch
    knobs = loss_config(config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_dual, config.loss_type,
                        config.loss_avg_mode, kl_penalty=config.kl_penalty if with_kl else None, kl_coef=config.kl_coef,
                        names="config.")
    missing = [key for key in _MICRO_BATCH_KEYS if key not in micro_batch]
    if missing:
        raise KeyError(f"micro_batch has no {', '.join(missing)}: pass update_policy's model_inputs")
    check_padded_micro_batch(micro_batch, MediaTokens(actor.actor_module))  # the builders' checks; one host read
    ids, attention, responses = (micro_batch[k] for k in ("input_ids", "attention_mask", "responses"))
    B, L = ids.shape
    R = responses.shape[1]
    per_token = {"old_log_probs": micro_batch["old_log_probs"], "advantages": micro_batch["advantages"],
                 "ref_log_probs": micro_batch["ref_log_probs"] if with_kl else None}
    for name in ("old_log_probs", "advantages"):
        tensor_arg(name, per_token[name], shape=(B, R), dtypes=FLOAT_DTYPES)
    response_mask = micro_batch["response_mask"]
    padded_inputs({**per_token, "response_mask": response_mask}, mask="response_mask")

    model_inputs, rows = _model_inputs(ids, attention, micro_batch["position_ids"], config.padding_free, R)
    model_inputs.update(_multi_modal(micro_batch.get("multi_modal_inputs")))
    b, r = response_mask.nonzero(as_tuple=True)
    loss_args = {k: v[b, r] for k, v in per_token.items() if v is not None}
    out = _run_fused_head(
        actor.actor_module, model_inputs, index=rows[b, r], targets=responses[b, r], temperature=temperature,
        mask=response_mask[b, r], sample_index=b, num_samples=B, config=knobs, **loss_args,
    )
    log_probs = torch.zeros(B, R, device=out.log_probs.device).index_put_((b, r), out.log_probs)
    pg_loss = out.metrics["pg_loss"]
    metrics = policy_metrics(per_token["old_log_probs"], log_probs, response_mask, knobs.loss_agg_mode, out.metrics)
    metrics = {f"actor/{k}": v for k, v in metrics.items()}
    metrics["actor/pg_loss"] = pg_loss.item()
    if with_kl:
        metrics["actor/kl_loss"], metrics["actor/kl_coef"] = out.metrics["kl_loss"].item(), config.kl_coef
    return out.loss, metrics


#: the ActorConfig fields micro_batch_loss reads
_ACTOR_FIELDS = ("loss_type", "ulysses_size", "use_kl_loss", "clip_ratio_low", "clip_ratio_high", "clip_ratio_dual",
                 "loss_avg_mode", "padding_free", "kl_penalty", "kl_coef")


def _actor_config(actor):
    """``actor.config`` of an EasyR1 actor (its model ``actor_module``, its ``ActorConfig``), checked."""
    if actor is None or not hasattr(actor, "actor_module") or not hasattr(actor, "config"):
        raise TypeError(f"actor must be EasyR1's DataParallelPPOActor (with actor_module, the model, and config, its "
                        f"ActorConfig), got {type(actor).__name__}")
    missing = [name for name in _ACTOR_FIELDS if not hasattr(actor.config, name)]
    if missing:
        raise ValueError(f"actor.config has no {', '.join(missing)}: pass the actor's EasyR1 ActorConfig (these fields "
                         "set the loss)")
    return actor.config


def _model_inputs(ids, attention, position_ids, padding_free: bool, R: int):
    """(the model's keyword inputs as EasyR1 builds them, the row of the flattened hidden states that
    scores each response position ``[B, R]``: the one before it)."""
    B, L = ids.shape
    if position_ids.dim() == 3:  # M-RoPE: EasyR1 stores (B, C, L), the model takes (C, B, L)
        position_ids = position_ids.transpose(0, 1)
    before = torch.arange(L - R - 1, L - 1, device=ids.device)
    rows = torch.arange(B, device=ids.device)[:, None] * L + before  # in the padded [B * L] rows
    if not padding_free:
        return dict(input_ids=ids, attention_mask=attention, position_ids=position_ids, use_cache=False), rows
    kept = attention.reshape(-1).nonzero().squeeze(1)  # the tokens, packed into one row
    packed_row = torch.full((B * L,), -1, dtype=torch.long, device=ids.device)
    packed_row[kept] = torch.arange(kept.numel(), device=ids.device)
    packed_positions = position_ids.reshape(*position_ids.shape[:-2], B * L)[..., kept].unsqueeze(-2)
    inputs = dict(input_ids=ids.reshape(-1)[kept][None], attention_mask=None, position_ids=packed_positions,
                  use_cache=False)
    return inputs, packed_row[rows]


def _multi_modal(items) -> dict:
    """EasyR1's per-sample ``multi_modal_inputs`` (dicts of tensors) concatenated per key."""
    if items is None or len(items) == 0:
        return {}
    return {key: torch.cat([item[key] for item in items], dim=0) for key in items[0]}


def _run_fused_head(model, model_inputs: dict, **loss_args):
    """``model``'s forward with its LM head call replaced by ``linear_policy_loss`` over the
    given rows; returns that op's ``PolicyLossOutput``."""
    from ...ops.loss.fused import linear_policy_loss

    head = model.get_output_embeddings()
    result = []

    def fused_head(hidden):
        result.append(linear_policy_loss(hidden.to(head.weight.dtype), head.weight, bias=head.bias, **loss_args))
        return hidden.new_zeros(*hidden.shape[:-1], 1)  # stands for the logits, which nothing reads

    head.forward = fused_head
    try:
        model(**model_inputs)
    finally:
        del head.forward
    if len(result) != 1:
        raise RuntimeError(f"{type(model).__name__}'s forward called its LM head {len(result)} times; expected once")
    return result[0]
