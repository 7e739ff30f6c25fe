"""EasyR1 adapter: drop-in functions with the signatures of EasyR1's ``verl/trainer/core_algos.py``.

EasyR1 (hiyouga/EasyR1) is not on PyPI; these follow its documented semantics:
PPO clipping in log space with ``clip_ratio_high`` 0.3 by default (DAPO's clip-higher),
the ratio's log clamped to ±20 before ``exp``, dual clip for negative advantages,
``loss_avg_mode`` ``token`` (masked mean over the batch) or ``seq`` (mean of per-sequence
means), metrics as floats, and GRPO / RLOO that need at least two samples per group.
Clipping ``exp(clamp(log r, log(1 - lo), log(1 + hi)))`` equals ``clamp(r, 1 - lo, 1 + hi)``
up to one rounding of ``exp`` at the band edges; rlk_mm's fused kernel uses the latter.
``examples/easyr1_swap.py`` shows how to swap these into an EasyR1 run.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..ops import loss as _loss
from ..ops._loss_args import dual_clip
from ..ops._loss_terms import LOG_RATIO_LIMIT, MEAN_EPS
from ..ops.loss import AggMode, KLType, agg_loss, policy_loss
from ..ops.rewards import group_advantages
from ..schema import dense_group_index
from ..schema.checks import FLOAT_DTYPES, float_arg, tensor_arg
from ._args import outcome_inputs, padded_inputs

#: EasyR1 loss types this module fuses; ``cispo`` and ``sapo`` are not provided
LOSS_TYPES = ("default", "gspo", "gspo_token")
_KL = (KLType.KL, KLType.ABS, KLType.MSE, KLType.LOW_VAR_KL)  # EasyR1's kl_penalty names


def _avg_mode(argument: str, mode) -> AggMode:
    if mode not in (AggMode.TOKEN, AggMode.SEQ):
        raise ValueError(f"{argument}={mode!r}: EasyR1 averages by 'token' or 'seq'")
    return AggMode(mode)


def average_loss(values: torch.Tensor, mask: torch.Tensor, mode: Literal["token", "seq"], eps: float = MEAN_EPS) -> torch.Tensor:
    """EasyR1's ``average_loss``: ``token`` = masked mean, ``seq`` = mean over rows of row masked means."""
    padded_inputs({"values": values, "mask": mask}, mask="mask")
    mode = _avg_mode("mode", mode)
    if eps != MEAN_EPS:
        raise ValueError(f"eps={eps}: rlk_mm implements EasyR1's default eps {MEAN_EPS} only")
    return agg_loss(values, mask, mode)


def compute_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """EasyR1's ``compute_kl`` (``kl``, ``abs``, ``mse``, ``low_var_kl``), in float32."""
    if kl_penalty not in _KL:
        raise ValueError(
            f"kl_penalty={kl_penalty!r}: expected one of {', '.join(_KL)} ('full' needs whole distributions, "
            "not the selected log-probs rlk_mm works on)"
        )
    for name, t in (("log_probs", log_probs), ("ref_log_probs", ref_log_probs)):
        tensor_arg(name, t, dtypes=FLOAT_DTYPES)
    return _loss.kl_penalty(log_probs.float(), ref_log_probs.float(), kl_penalty)


def compute_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.3,
    clip_ratio_dual: float = 3.0,
    tau_positive: float = 1.0,
    tau_negative: float = 1.05,
    loss_type: str = "default",
    loss_avg_mode: str = "token",
    **kwargs,
) -> tuple[torch.Tensor, dict[str, float]]:
    """EasyR1's ``compute_policy_loss`` for ``default``, ``gspo`` and ``gspo_token``, fused.

    Returns ``(pg_loss, metrics)`` with EasyR1's metric names: ``ppo_kl``, ``entropy_loss``
    (mean of -log-prob, an entropy estimate), ``pg_clipfrac_higher``, ``pg_clipfrac_lower``
    (floats). ``tau_positive``/``tau_negative`` belong to ``sapo``, which is not provided.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"loss_type={loss_type!r}: rlk_mm fuses {', '.join(LOSS_TYPES)}; keep EasyR1's own "
            "compute_policy_loss for cispo and sapo"
        )
    padded_inputs({"log_probs": log_probs, "old_log_probs": old_log_probs, "advantages": advantages,
                   "response_mask": response_mask}, mask="response_mask")
    loss_avg_mode = _avg_mode("loss_avg_mode", loss_avg_mode)
    clip_ratio_low = float_arg("clip_ratio_low", clip_ratio_low)
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low={clip_ratio_low}: log-space clipping needs 0 <= clip_ratio_low < 1")
    dual_clip("clip_ratio_dual", clip_ratio_dual)  # policy_loss checks it too, but names it clip_ratio_c
    loss, fused = policy_loss(
        log_probs, old_log_probs, advantages, response_mask,
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_dual,
        ratio="token" if loss_type == "default" else loss_type, log_ratio_clamp=(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT),
        loss_agg_mode=loss_avg_mode,
    )
    with torch.no_grad():
        mask = response_mask.to(torch.float32)
        count = mask.sum() + MEAN_EPS
        # policy_loss has checked the mask: a 0/1 integer mask as bool needs no second check (no more host syncs)
        metric_mask = response_mask if response_mask.is_floating_point() else response_mask.bool()
        ppo_kl = agg_loss(old_log_probs.float() - log_probs.float(), metric_mask, "token")
        entropy = agg_loss(-log_probs.float(), metric_mask, loss_avg_mode)
        entropy = entropy * mask.sum() / count  # EasyR1 takes the masked mean of this scalar
        values = torch.stack([ppo_kl, entropy, fused["pg_clipfrac"], fused["pg_clipfrac_lower"]]).tolist()
    names = ("ppo_kl", "entropy_loss", "pg_clipfrac_higher", "pg_clipfrac_lower")
    return loss, dict(zip(names, values))


def _groups(ids: list, estimator: str) -> torch.Tensor:
    """EasyR1 group ids -> dense int64 group numbers; every group needs two samples or more."""
    groups = dense_group_index(ids)
    single = torch.nonzero(torch.bincount(groups) < 2).flatten()
    if single.numel():
        sample = int(torch.nonzero(groups == single[0])[0])
        raise ValueError(
            f"{estimator}: group {ids[sample]!r} (sample {sample}) has a single response; "
            f"{estimator} needs rollout.n > 1"
        )
    return groups


def _outcome_advantage(token_level_rewards, response_mask, index, estimator, eps):
    ids = outcome_inputs(token_level_rewards, response_mask, index)
    eps = float_arg("eps", eps, min=0.0, min_open=True)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        groups = _groups(ids, estimator.upper()).to(scores.device)
        adv = group_advantages(scores, groups, estimator=estimator, eps=eps)
        returns = adv.unsqueeze(-1) * response_mask
    return returns, returns


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, eps: float = 1e-6, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """EasyR1's GRPO: (s - mean_g) / (std_g + eps) on every response token; (advantages, returns)."""
    return _outcome_advantage(token_level_rewards, response_mask, index, "grpo", eps)


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """EasyR1's RLOO: the score minus the mean of the group's other scores; (advantages, returns)."""
    return _outcome_advantage(token_level_rewards, response_mask, index, "rloo", 1e-6)


def patch() -> None:
    """Swap these functions into an installed EasyR1 (its package is also named ``verl``).

    Patches ``verl.trainer.core_algos`` (the advantage map used by the driver's trainer, and
    the loss functions) and ``verl.workers.actor.dp_actor`` (which imported the loss
    functions by name). Call it in the driver and in every Ray worker, e.g.
    ``ray.init(runtime_env={"worker_process_setup_hook": "rlk_mm.integrations.easyr1.patch"})``.
    """
    import importlib

    try:
        core = importlib.import_module("verl.trainer.core_algos")
    except ModuleNotFoundError:
        core = None
    if not hasattr(core, "ADV_ESTIMATOR_MAP"):
        raise ImportError(
            "no verl.trainer.core_algos with an ADV_ESTIMATOR_MAP: the installed 'verl' is not EasyR1 "
            "(for verl itself, use rlk_mm.integrations.verl)"
        )
    core.ADV_ESTIMATOR_MAP["grpo"] = torch.no_grad()(compute_grpo_outcome_advantage)
    core.ADV_ESTIMATOR_MAP["rloo"] = torch.no_grad()(compute_rloo_outcome_advantage)
    actor = importlib.import_module("verl.workers.actor.dp_actor")
    for module in (core, actor):
        for name in ("compute_policy_loss", "compute_kl", "average_loss"):
            if hasattr(module, name):
                setattr(module, name, globals()[name])
