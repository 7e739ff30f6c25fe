"""verl's whole actor loss computed in the LM head, for ``update_actor`` with ``loss_mode=rlk_mm``.

The engine wrapper (``verl.fused``) asks ``fused_loss_plan`` for a training micro-batch's plan:
its per-token inputs (``old_log_probs``, ``advantages``, ``rollout_is_weights`` and, with
``use_kl_loss``, ``ref_log_prob``) gathered at the scored response rows (``verl.rows``), the
sample of each, and the ``PolicyLossConfig`` that ``loss_config`` (``verl.config``) reads from the
actor config and the micro-batch. While the plan is active (``using_plan``),
``FusedLinearForPPO`` (``verl.lm_head``) computes the loss with ``rlk_mm.ops.linear_policy_loss``
(three logits-sized products: the gradient is formed in the forward), and the registered
``rlk_mm`` policy loss hands it to verl's ``ppo_loss`` (``take_fused_loss``). Where the plan is
None the loss stays verl's: see ``fused_loss_plan`` for what falls back.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

from ...ops.loss.config import PolicyLossConfig, kl_estimator
from ...ops.loss.fused import PolicyLossOutput, linear_policy_loss
from ...schema.checks import tensor_arg
from .config import loss_config, setting
from .rows import padded, response_slots

__all__: list[str] = []

Tensor = torch.Tensor

_LOSSES = "verl.workers.utils.losses"


@dataclass
class FusedLossPlan:
    """One micro-batch's ``linear_policy_loss`` inputs besides the LM head's (compact ``[n]``
    per-token tensors in ``response_rows`` order, the sample of each, the loss config from the
    actor config's knobs: ``loss_config``), and its result once the LM head ran."""

    per_token: dict[str, Optional[Tensor]]
    sample_index: Tensor
    num_samples: int
    config: PolicyLossConfig
    result: Optional[PolicyLossOutput] = field(default=None, repr=False)

    def compute(self, hidden: Tensor, weight: Tensor, rows: Tensor, targets: Tensor, temperature: float):
        """The fused loss over ``rows``; returns their log-probs and entropies (detached)."""
        if self.result is not None:
            raise RuntimeError(
                "rlk_mm's fused policy loss: the LM head ran twice in one micro-batch; turn the fused loss off "
                "(actor_rollout_ref.actor.policy_loss.loss_mode=vanilla) for models that call it more than once"
            )
        if rows.numel() != self.sample_index.numel():
            raise RuntimeError(
                f"rlk_mm's fused policy loss: the LM head scores {rows.numel()} rows but the micro-batch's "
                f"response_mask selects {self.sample_index.numel()} tokens"
            )
        device = hidden.device
        per_token = {k: None if v is None else v.to(device) for k, v in self.per_token.items()}
        self.result = linear_policy_loss(
            hidden, weight, index=rows, targets=targets, temperature=temperature, **per_token,
            sample_index=self.sample_index.to(device), num_samples=self.num_samples, config=self.config,
        )
        return self.result.log_probs, self.result.entropy


_FUSED_LOSS: contextvars.ContextVar[Optional[FusedLossPlan]] = contextvars.ContextVar("rlk_mm_verl_loss", default=None)


@contextlib.contextmanager
def using_plan(plan: Optional[FusedLossPlan]):
    """Within the block, the LM head computes ``plan``'s loss (None: the log-prob path)."""
    token = _FUSED_LOSS.set(plan)
    try:
        yield
    finally:
        _FUSED_LOSS.reset(token)


def active_plan() -> Optional[FusedLossPlan]:
    """The plan ``using_plan`` set for the running block, or None."""
    return _FUSED_LOSS.get()


def fused_loss_plan(micro_batch, loss_function) -> Optional[FusedLossPlan]:
    """The fused-loss plan of a training micro-batch, or None where the loss stays verl's: a loss
    function other than verl's ``ppo_loss`` (distillation), a ``loss_mode`` other than ``rlk_mm``
    (``rlk_mm_gspo``: sequence ratios need every token before a gradient),
    ``calculate_sum_pi_squared``, a ``kl_loss_type`` rlk_mm does not implement (``full``), and any
    micro-batch whose response rows cannot be found or whose per-token inputs do not fit them."""
    from verl.utils import tensordict_utils as tu

    losses = sys.modules.get(_LOSSES)
    if not (isinstance(loss_function, functools.partial) and losses is not None
            and loss_function.func is getattr(losses, "ppo_loss", None) and "config" in loss_function.keywords):
        return None
    config = loss_function.keywords["config"]
    flag = functools.partial(tu.get_non_tensor_data, data=micro_batch, default=False)
    if (setting(setting(config, "policy_loss"), "loss_mode", "vanilla") != "rlk_mm"
            or flag(key="calculate_sum_pi_squared") or flag(key="distillation_use_topk")
            or flag(key="distillation_only")):
        return None
    with_kl = setting(config, "use_kl_loss")
    if with_kl:
        try:
            kl_estimator(setting(config, "kl_loss_type"), "kl_loss_type")
        except ValueError:
            return None
    slots = response_slots(micro_batch)
    if slots is None:
        return None
    window, mask, _ = slots
    names = {"old_log_probs": "old_log_probs", "advantages": "advantages", "rollout_is_weights": "rollout_is_weights"}
    if with_kl:
        names["ref_log_probs"] = "ref_log_prob"
    per_token = {}
    for ours, theirs in names.items():
        value = micro_batch.get(theirs, None)
        value = None if value is None else padded(value, window.shape)
        if value is None and theirs != "rollout_is_weights":
            return None  # verl's ppo_loss raises on it; let it say so
        per_token[ours] = None if value is None else value.to(mask.device)[mask]
    knobs = loss_config(config, micro_batch=micro_batch, response_length=mask.shape[1],
                        entropy=flag(key="calculate_entropy"))
    sample_index = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)[mask]
    return FusedLossPlan(per_token, sample_index, mask.shape[0], knobs)


def take_fused_loss(log_prob: Tensor, response_mask: Tensor) -> Optional[tuple[Tensor, dict[str, Tensor]]]:
    """For the registered ``rlk_mm`` policy loss: the loss the LM head computed for this
    micro-batch, or None (then the log-prob path runs).

    Returns ``(loss, metrics)``: the loss's value is the PPO term alone, as verl's policy
    losses return it, but its gradient is the whole fused loss's (PPO term, KL, entropy
    bonus). verl's ``ppo_loss`` then subtracts the entropy bonus and adds the KL term it
    computes from the detached log-probs and entropies, which add values but no gradient:
    the total has verl's value and the fused gradient.
    """
    plan = _FUSED_LOSS.get()
    if plan is None or plan.result is None:
        return None
    result, plan.result = plan.result, None  # one policy-loss call per LM-head run
    tensor_arg("response_mask", response_mask, ndim=2)
    scored = int(response_mask.bool().sum())
    if log_prob.shape[0] != plan.num_samples or scored != result.log_probs.numel():
        raise RuntimeError(
            f"rlk_mm's fused policy loss was computed for {plan.num_samples} samples and {result.log_probs.numel()} "
            f"tokens, but verl's loss passes log_prob {tuple(log_prob.shape)} with {scored} masked-in tokens"
        )
    pg = result.metrics["pg_loss"]
    return pg + (result.loss - result.loss.detach()), result.metrics
