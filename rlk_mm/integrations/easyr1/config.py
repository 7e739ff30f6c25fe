"""EasyR1's loss settings as one ``PolicyLossConfig``: ``loss_config``, the one builder that both
entry points use (the drop-in ``compute_policy_loss`` and the fused ``micro_batch_loss``), and
what rlk_mm implements of EasyR1's settings: ``LOSS_TYPES``, the KL penalties, the averaging modes.

EasyR1 clips in log space (``0 <= clip_ratio_low < 1``), clamps the log-ratio at
±``LOG_RATIO_LIMIT`` before ``exp``, and names the dual clip ``clip_ratio_dual``.
"""

from __future__ import annotations

from typing import Optional

from ...ops.loss.config import PolicyLossConfig, dual_clip
from ...ops.loss.terms import LOG_RATIO_LIMIT
from ...ops.options import AggMode, KLType, RatioMode
from ...schema.checks import float_arg

__all__ = ["loss_config", "LOSS_TYPES"]

#: EasyR1 loss types this module fuses; ``cispo`` and ``sapo`` are not provided
LOSS_TYPES = ("default", "gspo", "gspo_token")
#: EasyR1's ``kl_penalty`` names that rlk_mm implements: all but ``full``
KL_PENALTIES = (KLType.KL, KLType.ABS, KLType.MSE, KLType.LOW_VAR_KL)


def avg_mode_arg(argument: str, mode) -> AggMode:
    """EasyR1's ``loss_avg_mode`` (``token`` or ``seq``), passed as ``argument``, as an ``AggMode``."""
    if mode not in (AggMode.TOKEN, AggMode.SEQ):
        raise ValueError(f"{argument}={mode!r}: EasyR1 averages by 'token' or 'seq'")
    return AggMode(mode)


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
        What ``compute_policy_loss`` runs under (built from its arguments) and ``micro_batch_loss``
        (from the actor's ``ActorConfig``, ``names="config."``).

    Raises
    ------
    ValueError, TypeError
        For a bad argument, naming it.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"{names}loss_type={loss_type!r}: the fused loss implements {', '.join(LOSS_TYPES)}; EasyR1's "
                         "own loss serves cispo and sapo")
    agg_mode = avg_mode_arg(f"{names}loss_avg_mode", loss_avg_mode)
    if not 0.0 <= float_arg(f"{names}clip_ratio_low", clip_ratio_low) < 1.0:
        raise ValueError(f"{names}clip_ratio_low={clip_ratio_low}: log-space clipping needs 0 <= clip_ratio_low < 1")
    if clip_ratio_low == 0.0 and float_arg(f"{names}clip_ratio_high", clip_ratio_high, min=0.0, finite=False) == 0.0:
        raise ValueError(f"{names}clip_ratio_low=0 and {names}clip_ratio_high=0 clip every ratio that moves off 1, so "
                         "no token's probability can change past the first step: give the clip its width (e.g. 0.2)")
    dual_clip(f"{names}clip_ratio_dual", clip_ratio_dual)  # PolicyLossConfig checks it too, but names it clip_ratio_c
    kl = {}
    if kl_penalty is not None:
        if kl_penalty not in KL_PENALTIES:
            raise ValueError(f"{names}kl_penalty={kl_penalty!r}: the fused loss implements {', '.join(KL_PENALTIES)}")
        kl = dict(kl_type=kl_penalty, kl_coef=kl_coef)
    return PolicyLossConfig(
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_dual,
        ratio=RatioMode.TOKEN if loss_type == "default" else loss_type,
        log_ratio_clamp=(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT), loss_agg_mode=agg_mode, **kl,
    )
