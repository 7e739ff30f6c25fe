"""``PolicyLossConfig``: the knobs of the policy loss, typed and checked once; ``PolicyLoss``: its result.

``policy_loss`` and ``linear_policy_loss`` take ``config=PolicyLossConfig(...)``; their keyword
knobs (``clip_ratio_low=0.28, ...``) are sugar that builds one. A config is frozen and
checked when built, so one made from a trainer's settings can be reused call after call;
``dataclasses.replace(config, kl_coef=0.01)`` gives a checked copy with one knob changed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, TypedDict

import torch
from torch import Tensor

from ...schema.checks import float_arg, int_arg
from ..options import AggMode, KLType, RatioMode
from .terms import LOG_RATIO_LIMIT, KLEstimator

__all__ = ["PolicyLoss", "PolicyLossConfig", "PolicyLossKnobs"]

_F32_MAX = torch.finfo(torch.float32).max
#: the aggregation modes that average over sequences (their counts: ``global_batch_size``)
SEQ_MODES = (AggMode.SEQ_MEAN_TOKEN_SUM, AggMode.SEQ_MEAN_TOKEN_MEAN, AggMode.SEQ_MEAN_TOKEN_SUM_NORM)
#: the largest ``dp_size``: the factor multiplies in float32, exact for integers up to 2^24
MAX_DP_SIZE = 2**24


class PolicyLoss(NamedTuple):
    """``policy_loss``'s result, a NamedTuple: ``loss, metrics = policy_loss(...)``.

    Attributes
    ----------
    loss : Tensor
        The float32 scalar loss.
    metrics : dict of str to Tensor
        0-d float32 tensors, named as verl names them.
    """

    loss: Tensor
    metrics: dict[str, Tensor]


@dataclass(frozen=True)
class PolicyLossConfig:
    """The knobs of ``policy_loss`` and ``linear_policy_loss``, checked when built.

    Defaults are verl's vanilla PPO. Strings are parsed to the enum members, numbers to floats
    (ints for ``dp_size``).

    Parameters
    ----------
    clip_ratio_low : float
        The PPO clip's lower side, ``r >= 1 - clip_ratio_low``; in [0, 1] (1: no lower bound).
    clip_ratio_high : float
        The PPO clip's upper side, ``r <= 1 + clip_ratio_high``; >= 0 (inf: no bound). Not both
        sides 0: the interval ``[1, 1]`` would clip every ratio that leaves 1.
    clip_ratio_c : float or None
        The dual-clip bound for negative advantages, > 1; None turns it off.
    ratio : RatioMode or str
        The importance ratio: ``"token"``, ``"gspo_token"``, ``"gspo"``.
    log_ratio_clamp : tuple of float, optional
        (low, high) bounds of the log-ratio (not the ratio) before ``exp``, ``low < 0 < high`` so
        that an on-policy token (log-ratio 0) is never clamped; None for no bound (kept as ±inf).
    kl_type : KLType or str
        The KL estimator (a trailing ``+``, e.g. ``"k3+"``: k2's gradient).
    kl_coef : float
        The KL term's weight, >= 0 (0: no KL term; > 0 needs ``ref_log_probs``).
    entropy_coeff : float
        The entropy bonus's weight, >= 0 (> 0 needs the entropy).
    loss_agg_mode : AggMode or str
        How per-token losses become a scalar.
    dp_size : int
        Data-parallel ranks the global counts span, in [1, 2^24]. EasyR1's ``token`` and ``seq`` modes
        average this batch alone: they take no ``dp_size`` above 1 and no global count.
    batch_num_tokens : float or Tensor, optional
        The global token count of ``token-mean`` (None: this batch's mask sum); a number >= 0 or a
        0-d tensor (its value checked in the op's one host sync), at least this batch's mask sum.
    global_batch_size : float or Tensor, optional
        The global sequence count of the seq modes (None: this batch's sequences with a token); a
        whole number >= 0 or a 0-d tensor, at least this batch's sequences with a token.
    loss_scale_factor : float, optional
        ``seq-mean-token-sum-norm``'s divisor, > 0 (None: the padded length R). The verl modes
        ignore a count or ``loss_scale_factor`` they do not use (verl's trainer passes them all
        with every mode).

    Raises
    ------
    ValueError, TypeError
        For a bad value, or values that cannot be meant together, naming the fields and what to change.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = 3.0
    ratio: RatioMode | str = RatioMode.TOKEN
    log_ratio_clamp: tuple[Optional[float], Optional[float]] = (-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    kl_type: KLType | str = KLType.LOW_VAR_KL
    kl_coef: float = 0.0
    entropy_coeff: float = 0.0
    loss_agg_mode: AggMode | str = AggMode.TOKEN_MEAN
    dp_size: int = 1
    batch_num_tokens: float | Tensor | None = None
    global_batch_size: float | Tensor | None = None
    loss_scale_factor: Optional[float] = None

    def __post_init__(self):
        checked = dict(
            ratio=RatioMode.parse(self.ratio, "ratio"),
            clip_ratio_low=float_arg("clip_ratio_low", self.clip_ratio_low, min=0.0, max=1.0),
            clip_ratio_high=f32_arg("clip_ratio_high", self.clip_ratio_high, min=0.0, inf_ok=True),
            clip_ratio_c=None if self.clip_ratio_c is None else dual_clip("clip_ratio_c", self.clip_ratio_c),
            log_ratio_clamp=log_ratio_bounds(self.log_ratio_clamp),
            kl_coef=f32_arg("kl_coef", self.kl_coef, min=0.0),
            entropy_coeff=f32_arg("entropy_coeff", self.entropy_coeff, min=0.0),
            kl_type=_kl_type(self.kl_type),
            loss_agg_mode=AggMode.parse(self.loss_agg_mode, "loss_agg_mode"),
            dp_size=_dp_size(self.dp_size),
            batch_num_tokens=_count_arg("batch_num_tokens", self.batch_num_tokens),
            global_batch_size=_count_arg("global_batch_size", self.global_batch_size),
            loss_scale_factor=None if self.loss_scale_factor is None else f32_arg(
                "loss_scale_factor", self.loss_scale_factor, min=0.0, open_min=True),
        )
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        _check_clip(self.clip_ratio_low, self.clip_ratio_high)
        _check_aggregation(self)

    @property
    def kl_estimator(self) -> tuple[KLEstimator, bool]:
        """(the estimator the kernels compute, straight-through) of ``kl_type``."""
        return kl_estimator(self.kl_type, "kl_type")

    @property
    def dual_clip_bound(self) -> float:
        """``clip_ratio_c`` as the kernels take it: ``inf`` when off."""
        return math.inf if self.clip_ratio_c is None else self.clip_ratio_c


_FIELDS = tuple(f.name for f in dataclasses.fields(PolicyLossConfig))


class PolicyLossKnobs(TypedDict, total=False):
    """``PolicyLossConfig``'s fields as the loss ops' keywords (``**knobs: Unpack[PolicyLossKnobs]``),
    so that ``help()``, IDEs and type checkers show each knob and its type; a test keeps the two
    in step."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: Optional[float]
    ratio: RatioMode | str
    log_ratio_clamp: tuple[Optional[float], Optional[float]]
    kl_type: KLType | str
    kl_coef: float
    entropy_coeff: float
    loss_agg_mode: AggMode | str
    dp_size: int
    batch_num_tokens: float | Tensor | None
    global_batch_size: float | Tensor | None
    loss_scale_factor: Optional[float]


def policy_loss_config(config: Optional[PolicyLossConfig], knobs: dict, op: str) -> PolicyLossConfig:
    """The config of a call: ``config``, or one built from the keyword ``knobs`` (not both).

    Parameters
    ----------
    config : PolicyLossConfig or None
        The caller's config.
    knobs : dict
        The caller's keyword knobs, ``PolicyLossConfig``'s fields.
    op : str
        The op's name, for the error message.

    Returns
    -------
    PolicyLossConfig

    Raises
    ------
    TypeError
        For both a config and knobs, an unknown knob, or a config of another type.
    """
    if config is None:
        unknown = sorted(set(knobs) - set(_FIELDS))
        if unknown:
            raise TypeError(
                f"{op}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; the loss knobs are "
                f"PolicyLossConfig's fields: {', '.join(_FIELDS)}"
            )
        return PolicyLossConfig(**knobs)
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    if knobs:
        raise TypeError(
            f"{op}: pass the loss knobs either as config= or as keywords, not both (got config= and "
            f"{', '.join(sorted(knobs))}); dataclasses.replace(config, ...) changes a config's knobs"
        )
    return config


# ----------------------------------------------------------------------------- the knobs' checks
def f32_arg(name: str, value, *, min: Optional[float] = None, inf_ok: bool = False, open_min: bool = False) -> float:
    """The knob ``name``'s ``value`` as a float the float32 math can hold: at least ``min``
    (above it with ``open_min``; when given), finite unless ``inf_ok`` (±inf: no bound), and
    within float32's range; otherwise a ``ValueError`` or ``TypeError`` naming the knob."""
    value = float_arg(name, value, min=min, finite=not inf_ok, min_open=open_min)
    if math.isfinite(value) and abs(value) > _F32_MAX:
        raise ValueError(f"{name}={value} is out of range: float32 math needs |{name}| <= {_F32_MAX:.7g}")
    return value


def dual_clip(name: str, value) -> float:
    """The dual-clip bound ``c``.

    Parameters
    ----------
    name : str
        The knob's name, for the error message.
    value : float or None
        The bound, > 1; None turns the dual clip off.

    Returns
    -------
    float
        The bound, ``inf`` for None.

    Raises
    ------
    ValueError, TypeError
        For a value that is not a number > 1.
    """
    if value is None:
        return math.inf
    value = f32_arg(name, value, inf_ok=True)
    if not value > 1.0:
        raise ValueError(f"{name}={value}: the dual-clip bound must be > 1 (or None to turn it off)")
    return value


def log_ratio_bounds(value) -> tuple[float, float]:
    """``log_ratio_clamp`` as (low, high).

    Parameters
    ----------
    value : tuple of float or None
        (low, high), None meaning unbounded; low <= high.

    Returns
    -------
    tuple of float
        (low, high), ±inf where unbounded.

    Raises
    ------
    ValueError, TypeError
        For anything else, or low > high.
    """
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"log_ratio_clamp must be a pair (low, high) of numbers or None, got {value!r}")
    lo, hi = (
        bound if v is None else f32_arg(f"log_ratio_clamp[{k}]", v, inf_ok=True)
        for k, (v, bound) in enumerate(zip(value, (-math.inf, math.inf)))
    )
    if lo > hi:
        raise ValueError(f"log_ratio_clamp=({lo}, {hi}): the lower bound must be <= the upper")
    if not lo < 0.0 < hi:
        hint = (f"; for ratio bounds ({lo:g}, {hi:g}) pass their logs ({math.log(lo):.4g}, {math.log(hi):.4g})"
                if 0.0 < lo < 1.0 < hi else "")
        raise ValueError(
            f"log_ratio_clamp=({lo}, {hi}) does not hold 0, the log-ratio of an on-policy token: every such token "
            f"would be clamped and the loss changed. The bounds apply to log(ratio) before exp and need "
            f"low < 0 < high (default ±{LOG_RATIO_LIMIT:g}; None: unbounded){hint}"
        )
    return lo, hi


def _check_clip(low: float, high: float) -> None:
    """The clip interval ``[1 - low, 1 + high]`` must have room on some side of 1."""
    if low == 0.0 and high == 0.0:
        raise ValueError(
            "clip_ratio_low=0 and clip_ratio_high=0 make the clip interval [1, 1]: every ratio that moves off 1 is "
            "clipped, so no token's probability can change past the first step. Give the clip its width (verl's "
            "default is 0.2 on each side), or to turn clipping off pass clip_ratio_low=1.0 and clip_ratio_high=inf"
        )


def _check_aggregation(config: PolicyLossConfig) -> None:
    """The aggregation's settings agree: the global counts a ``dp_size > 1`` needs, and none for
    EasyR1's modes, which average this batch alone."""
    mode, dp_size = config.loss_agg_mode, config.dp_size
    if mode in (AggMode.TOKEN, AggMode.SEQ):
        given = [f"{name}={getattr(config, name)!r}" for name in ("batch_num_tokens", "global_batch_size",
                                                                "loss_scale_factor") if getattr(config, name) is not None]
        given = ([f"dp_size={dp_size}"] if dp_size != 1 else []) + given
        if given:
            raise ValueError(
                f"loss_agg_mode={mode.value!r} (EasyR1's) averages over this batch alone: {', '.join(given)} would be "
                "ignored. Leave dp_size at 1 and the counts and loss_scale_factor at None, or choose a verl mode "
                "(token-mean, token-sum, seq-mean-*) that takes them"
            )
    if dp_size > 1 and mode is AggMode.TOKEN_MEAN and config.batch_num_tokens is None:
        raise ValueError("batch_num_tokens (the global token count) is required when dp_size > 1")
    if dp_size > 1 and mode in SEQ_MODES and config.global_batch_size is None:
        raise ValueError("global_batch_size is required when dp_size > 1")


def kl_estimator(kl_type, argument: str) -> tuple[KLEstimator, bool]:
    """The estimator of a ``KLType`` name, optionally with a trailing ``+``.

    Parameters
    ----------
    kl_type : KLType or str
        The estimator's name.
    argument : str
        The argument's name, for the error message.

    Returns
    -------
    tuple of (KLEstimator, bool)
        The estimator, and whether the gradient is k2's (straight-through, the ``+`` form).

    Raises
    ------
    ValueError
        For an unknown name.
    """
    straight = isinstance(kl_type, str) and kl_type.endswith("+")
    try:
        estimator = KLType(kl_type[:-1] if straight else kl_type).estimator
    except ValueError:
        message = f"{argument}: kl type {kl_type!r} is unknown; expected one of {', '.join(KLType)} (or one with a '+')"
        raise ValueError(message) from None
    return estimator, straight and estimator != KLEstimator.K2


def _kl_type(value) -> KLType | str:
    """``value`` checked: its ``KLType`` member, or the name with its ``+`` (a str) for straight-through."""
    kl_estimator(value, "kl_type")
    straight = value.endswith("+")
    return f"{KLType(value[:-1]).value}+" if straight else KLType(value)


def _dp_size(value) -> int:
    value = int_arg("dp_size", value, min=1)
    if value > MAX_DP_SIZE:
        raise ValueError(f"dp_size={value} is out of range: the loss is multiplied by it in float32, exact for whole "
                         f"numbers up to 2^24 = {MAX_DP_SIZE}; pass the number of data-parallel ranks")
    return value


def _count_arg(name: str, value):
    """A global count: None, a number >= 0 within float32's range (as a float; a count of
    sequences whole) or a 0-d real tensor (its value is checked by the op, in its one host sync)."""
    if value is None:
        return None
    if not isinstance(value, Tensor):
        value = f32_arg(name, value, min=0.0)
        if name == "global_batch_size" and value != math.floor(value):
            raise ValueError(f"{name}={value}: a count of sequences is a whole number")
        return value
    if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
        raise ValueError(f"{name} must be a number or a 0-d tensor, got {value.dtype} of shape {tuple(value.shape)}")
    if value.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no value: the loss reads it; pass a number or a "
                         "tensor with data")
    return value
