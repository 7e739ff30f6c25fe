"""TRL ``GRPOConfig``'s loss settings as one ``PolicyLossConfig``: ``loss_config``, the one builder
that ``grpo_loss`` and the trainer's fused path both use, by TRL's names; ``check_options`` checks
the settings rlk_mm reproduces (``LOSS_TYPES``, the importance-sampling levels, the clip and
``delta``) and refuses the others at construction, naming them.

TRL 1.16's semantics: no log-ratio clamp, ``delta`` as the dual clip, GSPO's gradient through
the sequence mean, and each loss type's aggregation (``dapo``'s divisor is applied by the caller,
see ``dapo_normalizer``).
"""

from __future__ import annotations

from typing import Optional

from ...ops.loss.config import PolicyLossConfig
from ...ops.options import RatioMode
from ...schema.checks import float_arg, int_arg

__all__ = ["loss_config", "LOSS_TYPES"]

#: TRL loss types this adapter reproduces (TRL 1.16)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
_LEVELS = ("token", "sequence")


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
        What ``grpo_loss`` and the trainer's fused path (``linear_policy_loss``) both run under.

    Raises
    ------
    ValueError, TypeError
        For a setting rlk_mm cannot reproduce, naming it.
    """
    loss_type, level, low, high, delta, _ = check_options(loss_type, importance_sampling_level, epsilon_low, epsilon_high,
                                                     delta, 0.0)
    num_completions = int_arg("num_completions", num_completions, min=0)
    return PolicyLossConfig(
        clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=delta,
        ratio=RatioMode.GSPO if level == "sequence" else RatioMode.TOKEN, log_ratio_clamp=(None, None),
        entropy_coeff=entropy_coeff, **_aggregation(loss_type, num_completions, max_completion_length),
    )


def check_options(loss_type, level, epsilon_low, epsilon_high, delta, beta):
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
    if epsilon_low == 0.0 and epsilon_high == 0.0:
        raise ValueError("epsilon=0 and epsilon_high=0 make the clip interval [1, 1]: every ratio that moves off 1 is "
                         "clipped, so no token's probability can change past the first step; give the clip its width "
                         "(TRL's default epsilon is 0.2)")
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
