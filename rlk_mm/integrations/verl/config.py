"""verl's actor config, read in one place: ``loss_config`` is the one builder of the
``PolicyLossConfig`` that both of rlk_mm's verl paths run under, the registered policy losses
(``verl.losses``) and the actor loss computed in the LM head (``verl.fused_loss``), so that
every verl key (the clip ratios, ``clip_ratio_c``, the aggregation, the global counts, the
entropy and KL settings) is read once, the same way, whichever path runs.

The config is verl's ``ActorConfig`` (or an object with its fields) or a mapping of its fields
(a dict, an OmegaConf ``DictConfig``), as verl's own ``config.get`` reads allow; ``actor_config``,
``setting`` and ``clip_ratios`` are the readers the losses also use to check their arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from ...ops.loss.config import PolicyLossConfig
from ...ops.options import RatioMode

__all__ = ["loss_config"]

#: the global counts verl's ``ppo_loss`` copies from each micro-batch into ``config.global_batch_info``
GLOBAL_COUNTS = ("dp_size", "batch_num_tokens", "global_batch_size")
#: verl's ``clip_ratio_c`` where the config has none (``ActorConfig``'s default)
CLIP_RATIO_C = 3.0


def actor_config(config):
    """verl's actor ``config``: an ``ActorConfig`` (or an object with its fields) or a mapping of
    its fields (a dict, an OmegaConf ``DictConfig``); None and other values are refused."""
    if config is None:
        raise ValueError("config (verl's ActorConfig) is required: it holds the clip ratios")
    if not isinstance(config, Mapping) and not hasattr(config, "clip_ratio"):
        raise TypeError(f"config must be verl's ActorConfig (or a mapping of its fields), got {type(config).__name__} "
                        f"{config!r}"[:300])
    return config


def setting(config, name: str, default=None):
    """Field ``name`` of verl's actor ``config`` (``actor_config``), ``default`` where it has none."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def clip_ratios(config) -> tuple[float, float]:
    """The clip ratios (low, high) of verl's actor config: ``clip_ratio_low``/``_high``, else ``clip_ratio``."""
    config = actor_config(config)
    ratios = []
    for side in ("low", "high"):
        value = setting(config, f"clip_ratio_{side}")
        value = setting(config, "clip_ratio") if value is None else value
        if value is None:
            raise ValueError(f"config.clip_ratio_{side} and config.clip_ratio are both None: set one of them")
        ratios.append(value)
    return tuple(ratios)


def loss_config(config, loss_agg_mode: Optional[str] = None, *, gspo: bool = False, micro_batch=None,
                response_length: Optional[int] = None, entropy: bool = False) -> PolicyLossConfig:
    """The ``PolicyLossConfig`` of verl's actor config: the one reading of its keys, for both paths.

    Without ``micro_batch``, the policy-loss term that verl's registered loss returns
    (``compute_policy_loss``): verl's ``ppo_loss`` adds the entropy bonus and the KL term itself,
    and has already copied the micro-batch's global counts into ``config.global_batch_info``.
    With ``micro_batch``, verl's whole actor loss on it, as the LM head computes it before
    ``ppo_loss`` runs: the counts are read from the micro-batch (where ``ppo_loss`` reads them),
    ``loss_scale_factor`` from the config (verl's default for the ``-norm`` mode where it is None:
    the padded ``response_length``), plus ``entropy_coeff`` when verl computes the entropy and,
    with ``use_kl_loss``, ``kl_loss_type`` and ``kl_loss_coef``.

    Parameters
    ----------
    config : ActorConfig or Mapping
        verl's actor config (its clip ratios, dual clip, ``loss_agg_mode``, ``global_batch_info``,
        ``loss_scale_factor``, entropy and KL settings), or a mapping of those fields.
    loss_agg_mode : str, optional
        verl's ``loss_agg_mode``, as verl passes it to a policy loss; None: the config's.
    gspo : bool
        verl's ``gspo`` (sequence ratio, log-ratio clamped at 10, no dual clip) instead of its
        vanilla PPO loss, whose dual clip is ``clip_ratio_c`` (3.0 where the config has none).
    micro_batch : TensorDict, optional
        The training micro-batch of the loss fused into the LM head (its ``dp_size``,
        ``batch_num_tokens`` and ``global_batch_size``).
    response_length : int, optional
        With ``micro_batch``: its padded response length.
    entropy : bool
        With ``micro_batch``: whether verl computes the entropy (its ``calculate_entropy``), so that
        the bonus is part of the loss.

    Returns
    -------
    PolicyLossConfig
        The global counts are checked against each micro-batch by the op that runs it: at least
        what the micro-batch shows.

    Raises
    ------
    ValueError, TypeError
        For a missing or bad field, naming it.
    """
    low, high = clip_ratios(config)
    if gspo:
        ratio = dict(clip_ratio_c=None, ratio=RatioMode.GSPO_TOKEN, log_ratio_clamp=(None, 10.0))
    else:
        ratio = dict(clip_ratio_c=setting(config, "clip_ratio_c", CLIP_RATIO_C))
    if loss_agg_mode is None:
        loss_agg_mode = setting(config, "loss_agg_mode")
    if micro_batch is None:
        info = dict(setting(config, "global_batch_info") or {})
        counts = {k: info[k] for k in (*GLOBAL_COUNTS, "loss_scale_factor") if info.get(k) is not None}
        return PolicyLossConfig(clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode=loss_agg_mode, **ratio,
                                **counts)
    counts = {k: micro_batch[k] for k in GLOBAL_COUNTS}
    scale = setting(config, "loss_scale_factor")
    terms = dict(entropy_coeff=setting(config, "entropy_coeff") if entropy else 0.0)
    if setting(config, "use_kl_loss"):
        terms.update(kl_type=setting(config, "kl_loss_type"), kl_coef=setting(config, "kl_loss_coef"))
    return PolicyLossConfig(clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode=loss_agg_mode, **ratio, **counts,
                            loss_scale_factor=response_length if scale is None else scale, **terms)
