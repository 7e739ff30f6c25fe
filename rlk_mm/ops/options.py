"""The option sets of the ops, in one public home.

Each is a ``Choice`` (``rlk_mm.schema.choice``): a ``str`` enum, so a member and its string
are interchangeable wherever an op takes the option (``loss_agg_mode="token-mean"`` or
``loss_agg_mode=AggMode.TOKEN_MEAN``), and ``parse`` turns either into the member or raises
an error that names the argument and lists the accepted values. Every member carries a
one-line description (``AggMode.TOKEN_MEAN.__doc__``; ``help(AggMode)`` lists them all).

* ``AggMode``: how per-token losses become a scalar (``loss_agg_mode``);
* ``KLType``: the KL estimator (``kl_type``);
* ``RatioMode``: the importance ratio of the policy loss (``ratio``);
* ``Estimator``: the group-relative advantage estimator (``estimator``);
* ``RewardPlacement``: where a reward lands on its span's loss tokens (``mode``);
* ``Backend``: which implementation runs an op (``backend``, ``RLK_MM_BACKEND``);
* ``PaddingSide``: where a padded row's real entries sit (``padding``); defined in
  ``rlk_mm.schema`` (the batch views take it too, and schema imports nothing of ops).
"""

from __future__ import annotations

from ..schema import Choice, PaddingSide
from .loss.terms import KLEstimator

__all__ = ["AggMode", "Backend", "Estimator", "KLType", "PaddingSide", "RatioMode", "RewardPlacement"]


class Option(Choice):
    """A ``Choice`` whose members are declared as ``NAME = "value", "one-line description"``.

    The description becomes the member's ``__doc__``, and the class docstring gains a list of
    the members, so ``help()`` on the class (or on a signature annotated with it) shows every
    accepted value and what it means."""

    def __new__(cls, value: str, doc: str = ""):
        member = str.__new__(cls, value)
        member._value_ = value
        member.__doc__ = doc
        return member

    @classmethod
    def _missing_(cls, value):
        """``AggMode("mean")`` and the like: an error that lists the accepted values (Python's
        own said only that the value is not valid)."""
        raise ValueError(f"{value!r} is not a valid {cls.__name__}: expected one of {', '.join(m.value for m in cls)}")


def _list_members(cls):
    """Appends ``value: description`` of each member to the class docstring."""
    lines = "\n".join(f"    ``{m.value!r}``: {m.__doc__}" for m in cls)
    cls.__doc__ = f"{(cls.__doc__ or '').rstrip()}\n\n    Members (or their strings):\n\n{lines}\n"
    return cls


@_list_members
class AggMode(Option):
    """How per-token losses become a scalar (``loss_agg_mode``): verl 0.9.1's modes and EasyR1's."""

    TOKEN_MEAN = "token-mean", "sum over tokens / the token count (batch_num_tokens) * dp_size"
    TOKEN_SUM = "token-sum", "sum over tokens * dp_size"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum", "sum of per-sequence token sums / global_batch_size * dp_size"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean", "sum of per-sequence token means / global_batch_size * dp_size"
    SEQ_MEAN_TOKEN_SUM_NORM = (
        "seq-mean-token-sum-norm", "seq-mean-token-sum further / loss_scale_factor (default: the padded length R)")
    TOKEN = "token", "EasyR1: the masked mean over every token"
    SEQ = "seq", "EasyR1: the mean over sequences of their masked means"


@_list_members
class KLType(Option):
    """KL estimators by verl's and EasyR1's names (``kl_type``); a trailing ``+`` (e.g.
    ``"k3+"``) keeps the estimate's value and takes k2's gradient (straight-through)."""

    KL = "kl", "k1: x = logp - ref (EasyR1's name)"
    K1 = "k1", "x = logp - ref"
    ABS = "abs", "|x|"
    MSE = "mse", "k2: x^2 / 2 (EasyR1's name)"
    K2 = "k2", "x^2 / 2"
    LOW_VAR_KL = "low_var_kl", "k3: exp(-x) + x - 1, clamped (verl's name)"
    K3 = "k3", "exp(-x) + x - 1, the exponent and the value clamped as verl clamps them"

    @property
    def estimator(self) -> KLEstimator:
        """The estimator the kernels compute for this name."""
        return _KL_ESTIMATORS[self]


_KL_ESTIMATORS = {
    KLType.KL: KLEstimator.K1, KLType.K1: KLEstimator.K1, KLType.ABS: KLEstimator.ABS, KLType.MSE: KLEstimator.K2,
    KLType.K2: KLEstimator.K2, KLType.LOW_VAR_KL: KLEstimator.K3, KLType.K3: KLEstimator.K3,
}


@_list_members
class RatioMode(Option):
    """The importance ratio of ``policy_loss`` (``ratio``)."""

    TOKEN = "token", "PPO: each token's own ratio exp(logp - old)"
    GSPO_TOKEN = (
        "gspo_token", "GSPO's sequence ratio, each token with its own gradient (verl's 'gspo', EasyR1's 'gspo_token')")
    GSPO = "gspo", "GSPO with the gradient through the sequence's mean log-ratio (EasyR1's 'gspo')"


@_list_members
class Estimator(Option):
    """Group-relative advantage estimators of ``group_advantages`` (``estimator``)."""

    GRPO = "grpo", "(s - mean_g) / (std_g + eps)"
    DR_GRPO = "dr_grpo", "s - mean_g (Dr.GRPO: no std normalization)"
    RLOO = "rloo", "s - the mean of the group's other scores"


@_list_members
class RewardPlacement(Option):
    """Where ``scatter_rewards`` puts a value over its span's loss tokens (``mode``)."""

    LAST = "last", "on the last loss token (verl's convention)"
    SPREAD = "spread", "split evenly over the loss tokens (sums are kept)"


@_list_members
class Backend(Option):
    """Which implementation runs an op (``backend=``, or ``RLK_MM_BACKEND`` for every op)."""

    AUTO = "auto", "Triton on CUDA tensors, torch elsewhere (the default; None means the same)"
    TORCH = "torch", "plain torch (any device)"
    TRITON = "triton", "the Triton kernels (CUDA; on CPU tensors only under TRITON_INTERPRET=1)"
    FLASHINFER = "flashinfer", "sample() only: FlashInfer's sampler (CUDA; reproducible, not batch-invariant)"
