"""EasyR1 adapter: drop-in functions with the signatures of EasyR1's ``verl/trainer/core_algos.py``.

EasyR1 (hiyouga/EasyR1) is not on PyPI; these follow its semantics (checked against its own
functions by ``tests/integrations/frameworks/easyr1_equivalence.py`` where its source is at hand):
PPO clipping in log space with ``clip_ratio_high`` 0.3 by default (DAPO's clip-higher),
the ratio's log clamped to ±20 before ``exp``, dual clip for negative advantages,
``loss_avg_mode`` ``token`` (masked mean over the batch) or ``seq`` (mean of per-sequence
means), metrics as floats, and GRPO / RLOO that need at least two samples per group.
Clipping ``exp(clamp(log r, log(1 - lo), log(1 + hi)))`` equals ``clamp(r, 1 - lo, 1 + hi)``
up to one rounding of ``exp`` at the band edges; rlk_mm's fused kernel uses the latter.
``patch()`` swaps them into an installed EasyR1 (``examples/easyr1_swap.py``);
``micro_batch_loss`` fuses the LM head with the loss in an actor's own loop (not patched in).

This module imports neither EasyR1 nor transformers: ``pip install rlk-mm`` sits beside
EasyR1's transformers 4.5x.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Mapping
from typing import Callable, Literal, Optional

import torch

from ..ops import loss as _loss
from ..ops.loss.config import PolicyLossConfig, dual_clip
from ..ops.loss.op import agg_loss, policy_loss
from ..ops.loss.terms import LOG_RATIO_LIMIT, MEAN_EPS
from ..ops.options import AggMode, KLType, RatioMode
from ..ops.rewards import group_advantages
from ..schema import dense_group_index
from ..schema.checks import FLOAT_DTYPES, float_arg, temperature_arg, tensor_arg
from .args import outcome_inputs, padded_inputs
from .micro_batch import MediaTokens, check_padded_micro_batch

__all__ = [
    "ADVANTAGES", "average_loss", "compute_grpo_outcome_advantage", "compute_kl", "compute_policy_loss",
    "compute_rloo_outcome_advantage", "loss_config", "LOSS_TYPES", "micro_batch_loss", "patch", "runtime_env_hook",
    "SETUP_HOOK", "SUPPORTED",
]

#: EasyR1 loss types this module fuses; ``cispo`` and ``sapo`` are not provided
LOSS_TYPES = ("default", "gspo", "gspo_token")
_KL = (KLType.KL, KLType.ABS, KLType.MSE, KLType.LOW_VAR_KL)  # EasyR1's kl_penalty names but 'full'

#: Ray's ``worker_process_setup_hook`` that patches every worker of an EasyR1 job
SETUP_HOOK = "rlk_mm.integrations.easyr1.patch"

logger = logging.getLogger(__name__)


def _avg_mode(argument: str, mode) -> AggMode:
    if mode not in (AggMode.TOKEN, AggMode.SEQ):
        raise ValueError(f"{argument}={mode!r}: EasyR1 averages by 'token' or 'seq'")
    return AggMode(mode)


def average_loss(values: torch.Tensor, mask: torch.Tensor, mode: Literal["token", "seq"], eps: float = MEAN_EPS) -> torch.Tensor:
    """EasyR1's ``average_loss``: ``token`` = masked mean, ``seq`` = mean over rows of row masked means.

    A bad argument raises ValueError or TypeError naming it, as every function here does.

    Parameters
    ----------
    values, mask : Tensor
        ``[B, R]`` per-token values and the response mask.
    mode : {"token", "seq"}
    eps : float
        Added to the denominators, as EasyR1 does.

    Returns
    -------
    Tensor
    """
    padded_inputs({"values": values, "mask": mask}, mask="mask")
    mode = _avg_mode("mode", mode)
    if eps != MEAN_EPS:
        raise ValueError(f"eps={eps}: rlk_mm implements EasyR1's default eps {MEAN_EPS} only (patch() runs EasyR1's own for others)")
    return agg_loss(values, mask, mode)


def compute_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """EasyR1's ``compute_kl`` (``kl``, ``abs``, ``mse``, ``low_var_kl``), in float32.

    Parameters
    ----------
    log_probs, ref_log_probs : Tensor
    kl_penalty : str

    Returns
    -------
    Tensor
    """
    if kl_penalty not in _KL:
        raise ValueError(
            f"kl_penalty={kl_penalty!r}: expected one of {', '.join(_KL)} ('full' needs whole distributions, "
            "not the selected log-probs rlk_mm works on: patch() runs EasyR1's own compute_kl for it)"
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

    Parameters
    ----------
    old_log_probs, log_probs, advantages, response_mask : Tensor
        ``[B, R]``, as EasyR1 passes them.
    clip_ratio_low, clip_ratio_high, clip_ratio_dual, loss_type, loss_avg_mode
        EasyR1's settings (see ``loss_config``).
    tau_positive, tau_negative, **kwargs
        ``sapo``'s (not fused), and what EasyR1 passes besides: ignored.

    Returns
    -------
    tuple
        ``(pg_loss, metrics)`` with EasyR1's metric names: ``ppo_kl``, ``entropy_loss`` (mean of
        -log-prob, an entropy estimate), ``pg_clipfrac_higher``, ``pg_clipfrac_lower`` (floats).

    Raises
    ------
    ValueError, TypeError
        For a bad argument, naming it.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"loss_type={loss_type!r}: rlk_mm fuses {', '.join(LOSS_TYPES)}; EasyR1's own "
            "compute_policy_loss serves cispo and sapo (patch() falls back to it)"
        )
    padded_inputs({"log_probs": log_probs, "old_log_probs": old_log_probs, "advantages": advantages,
                   "response_mask": response_mask}, mask="response_mask")
    config = loss_config(clip_ratio_low, clip_ratio_high, clip_ratio_dual, loss_type, loss_avg_mode)
    loss, fused = policy_loss(log_probs, old_log_probs, advantages, response_mask, config=config)
    return loss, _policy_metrics(old_log_probs, log_probs, response_mask, config.loss_agg_mode, fused)


def loss_config(clip_ratio_low, clip_ratio_high, clip_ratio_dual, loss_type: str, loss_avg_mode: str, *,
                kl_penalty: Optional[str] = None, kl_coef: float = 0.0, names: str = "") -> PolicyLossConfig:
    """The ``PolicyLossConfig`` of EasyR1's loss settings.

    Parameters
    ----------
    clip_ratio_low, clip_ratio_high, clip_ratio_dual : float
        PPO clipping in log space (``0 <= clip_ratio_low < 1``) and the dual clip.
    loss_type : str
        The ratio: ``default`` (per token), ``gspo``, ``gspo_token``; the log-ratio is clamped at
        ±``LOG_RATIO_LIMIT``.
    loss_avg_mode : str
        ``token`` or ``seq``.
    kl_penalty, kl_coef : str or None, float
        The KL term (``kl``, ``abs``, ``mse``, ``low_var_kl``) and its weight.
    names : str
        Prefix of the names in errors, e.g. ``config.`` for an ``ActorConfig``'s fields.

    Returns
    -------
    PolicyLossConfig

    Raises
    ------
    ValueError, TypeError
        For a bad argument, naming it.
    """
    avg_mode = _avg_mode(f"{names}loss_avg_mode", loss_avg_mode)
    if not 0.0 <= float_arg(f"{names}clip_ratio_low", clip_ratio_low) < 1.0:
        raise ValueError(f"{names}clip_ratio_low={clip_ratio_low}: log-space clipping needs 0 <= clip_ratio_low < 1")
    dual_clip(f"{names}clip_ratio_dual", clip_ratio_dual)  # PolicyLossConfig checks it too, but names it clip_ratio_c
    kl = {}
    if kl_penalty is not None:
        if kl_penalty not in _KL:
            raise ValueError(f"{names}kl_penalty={kl_penalty!r}: the fused loss implements {', '.join(_KL)}")
        kl = dict(kl_type=kl_penalty, kl_coef=kl_coef)
    return PolicyLossConfig(
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_dual,
        ratio=RatioMode.TOKEN if loss_type == "default" else loss_type,
        log_ratio_clamp=(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT), loss_agg_mode=avg_mode, **kl,
    )


@torch.no_grad()
def _policy_metrics(old_log_probs, log_probs, response_mask, loss_avg_mode, fused: dict) -> dict[str, float]:
    """EasyR1's ``compute_policy_loss`` metrics (floats) from padded log-probs and ``policy_loss``'s metrics."""
    mask = response_mask.to(torch.float32)
    count = mask.sum() + MEAN_EPS
    # policy_loss has checked the mask: a 0/1 integer mask as bool needs no second check (no more host syncs)
    metric_mask = response_mask if response_mask.is_floating_point() else response_mask.bool()
    ppo_kl = agg_loss(old_log_probs.float() - log_probs.float(), metric_mask, "token")
    entropy = agg_loss(-log_probs.float(), metric_mask, loss_avg_mode)
    entropy = entropy * mask.sum() / count  # EasyR1 takes the masked mean of this scalar
    values = torch.stack([ppo_kl, entropy, fused["pg_clipfrac"], fused["pg_clipfrac_lower"]]).tolist()
    names = ("ppo_kl", "entropy_loss", "pg_clipfrac_higher", "pg_clipfrac_lower")
    return dict(zip(names, values))


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
    metrics = _policy_metrics(per_token["old_log_probs"], log_probs, response_mask, knobs.loss_agg_mode, out.metrics)
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
    from ..ops.loss.fused import linear_policy_loss

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
    """EasyR1's GRPO: (s - mean_g) / (std_g + eps) on every response token.

    Parameters
    ----------
    token_level_rewards, response_mask : Tensor
        ``[B, R]``; a sample's score is its rewards' sum.
    index : array-like
        Each sample's group id.
    eps, **kwargs
        Added to the std; the rest is ignored.

    Returns
    -------
    tuple of Tensor
        ``(advantages, returns)``.
    """
    return _outcome_advantage(token_level_rewards, response_mask, index, "grpo", eps)


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """EasyR1's RLOO: the score minus the mean of the group's other scores.

    Parameters
    ----------
    token_level_rewards, response_mask : Tensor
        ``[B, R]``; a sample's score is its rewards' sum.
    index, **kwargs
        Each sample's group id; the rest is ignored.

    Returns
    -------
    tuple of Tensor
        ``(advantages, returns)``.
    """
    return _outcome_advantage(token_level_rewards, response_mask, index, "rloo", 1e-6)


#: per function: the setting that picks rlk_mm's implementation, and the values it implements
SUPPORTED = {
    "compute_policy_loss": ("loss_type", LOSS_TYPES),
    "compute_kl": ("kl_penalty", tuple(str(k) for k in _KL)),
    "average_loss": ("eps", (MEAN_EPS,)),
}
ADVANTAGES = {"grpo": compute_grpo_outcome_advantage, "rloo": compute_rloo_outcome_advantage}
_ORIGINAL = "_easyr1_original"  # on a swapped-in function: the EasyR1 function it replaced
_said: set = set()


def _with_fallback(ours: Callable, theirs: Callable, setting: str, supported: tuple) -> Callable:
    """``ours`` where the call's ``setting`` is one of ``supported``, else EasyR1's own ``theirs``
    (logged once per value)."""
    signature = inspect.signature(ours)
    default = signature.parameters[setting].default

    @functools.wraps(ours)
    def call(*args, **kwargs):
        value = signature.bind(*args, **kwargs).arguments.get(setting, default)
        if value in supported:
            return ours(*args, **kwargs)
        if (ours.__name__, repr(value)) not in _said:
            _said.add((ours.__name__, repr(value)))
            logger.warning(
                "rlk_mm: %s with %s=%r runs EasyR1's own function (rlk_mm implements %s=%s)",
                ours.__name__, setting, value, setting, "/".join(map(str, supported)),
            )
        return theirs(*args, **kwargs)

    setattr(call, _ORIGINAL, theirs)
    return call


def _core_algos():
    """EasyR1's ``verl.trainer.core_algos`` (its package is also named ``verl``)."""
    try:
        core = importlib.import_module("verl.trainer.core_algos")
    except ModuleNotFoundError:
        core = None
    if not hasattr(core, "ADV_ESTIMATOR_MAP"):
        raise ImportError(
            "no verl.trainer.core_algos with an ADV_ESTIMATOR_MAP: the installed 'verl' is not EasyR1 "
            "(for verl itself, use rlk_mm.integrations.verl)"
        )
    missing = [name for name in SUPPORTED if not callable(getattr(core, name, None))]
    missing += [f"ADV_ESTIMATOR_MAP[{key!r}]" for key in ADVANTAGES if key not in core.ADV_ESTIMATOR_MAP]
    if missing:
        raise ImportError(f"EasyR1's verl.trainer.core_algos has no {', '.join(missing)}: an EasyR1 version rlk_mm does not know")
    return core


def patch() -> list[str]:
    """Swap these functions into an installed EasyR1 (idempotent).

    ``compute_policy_loss``, ``compute_kl``, ``average_loss`` (falling back to EasyR1's own for
    settings rlk_mm lacks) and GRPO / RLOO, wherever ``verl.*`` holds them; see ``runtime_env_hook``.

    Returns
    -------
    list of str
        The names replaced.

    Raises
    ------
    ImportError
        When EasyR1 is not installed.
    """
    core = _core_algos()
    swaps: dict[int, tuple[Callable, Callable]] = {}  # id -> (what a module may hold, its replacement)
    for name, (setting, supported) in SUPPORTED.items():
        current = getattr(core, name)
        theirs = getattr(current, _ORIGINAL, current)
        ours = _with_fallback(globals()[name], theirs, setting, supported)
        swaps[id(current)], swaps[id(theirs)] = (current, ours), (theirs, ours)
    for key, fn in ADVANTAGES.items():
        current = core.ADV_ESTIMATOR_MAP[key]
        theirs = getattr(current, _ORIGINAL, current)
        ours = torch.no_grad()(fn)  # as EasyR1's register_adv_estimator wraps its own
        setattr(ours, _ORIGINAL, theirs)
        core.ADV_ESTIMATOR_MAP[key] = ours
        swaps[id(current)], swaps[id(theirs)] = (current, ours), (theirs, ours)
    replaced = [f"verl.trainer.core_algos.ADV_ESTIMATOR_MAP[{key!r}]" for key in ADVANTAGES]
    for module_name, module in sorted(sys.modules.items()):
        if module is None or module_name.split(".")[0] != "verl":
            continue
        for attr, value in list(vars(module).items()):
            swap = swaps.get(id(value))
            if swap is not None and swap[0] is value:
                setattr(module, attr, swap[1])
                replaced.append(f"{module_name}.{attr}")
    logger.info("rlk_mm: patched EasyR1: %s", ", ".join(replaced))
    return replaced


def runtime_env_hook(runtime_env: Optional[Mapping]) -> dict:
    """Ray's ``RAY_RUNTIME_ENV_HOOK``: every Ray worker calls ``patch()`` before any EasyR1 code.

    Parameters
    ----------
    runtime_env : Mapping or None
        The job's ``runtime_env``.

    Returns
    -------
    dict
        ``runtime_env`` plus ``SETUP_HOOK`` as its ``worker_process_setup_hook``.

    Raises
    ------
    TypeError, ValueError
        For a ``runtime_env`` that is not a dict, or one with another setup hook.
    """
    if runtime_env is not None and not isinstance(runtime_env, Mapping):
        raise TypeError(f"runtime_env must be a dict or None (Ray passes ray.init's), got {type(runtime_env).__name__}")
    env = dict(runtime_env or {})
    hook = env.setdefault("worker_process_setup_hook", SETUP_HOOK)
    if hook != SETUP_HOOK:
        raise ValueError(
            f"runtime_env already has worker_process_setup_hook={hook!r}: call rlk_mm.integrations.easyr1.patch() "
            "from that hook instead"
        )
    return env
