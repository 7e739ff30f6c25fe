"""verl 0.9.1 adapter: rlk_mm's fused policy loss and advantage estimators in verl's registries.

Registered names (importing this package registers them):

* policy losses: ``rlk_mm`` (verl's ``vanilla`` PPO: dual clip, rollout importance weights,
  every ``loss_agg_mode``) and ``rlk_mm_gspo`` (verl's ``gspo``), selected with
  ``actor_rollout_ref.actor.policy_loss.loss_mode=rlk_mm``;
* advantage estimators: ``rlk_mm_grpo`` (honours ``algorithm.norm_adv_by_std_in_grpo``;
  False = Dr.GRPO) and ``rlk_mm_rloo``, selected with ``algorithm.adv_estimator=rlk_mm_grpo``.

verl imports every ``verl.plugins`` entry point when ``verl`` is imported (in the driver
and in each Ray worker), unless ``VERL_USE_EXTERNAL_PLUGINS=none``. It only *imports*
the target — ``rlk_mm.integrations.verl:register`` — and logs plugin errors at debug
level only, so this package registers on import and turns any error there into a warning;
``register()`` is idempotent and tolerates a re-import of this package (call it to see the
traceback). With ``RLK_MM_VERL_FUSED=1``, ``register()`` also calls
``rlk_mm.integrations.verl.fused.enable()``: fused LM-head log-probs in verl's actor and,
for ``loss_mode=rlk_mm``, the whole actor loss in the LM head (three products).

The package, one module a concept: ``config`` (``loss_config``, the one reading of verl's
actor config), ``losses`` (the policy losses), ``advantages`` (the estimators), and the fused
path: ``fused`` (``enable``, ``disable``, ``enabled``: switching it on and off), ``lm_head``
(``FusedLinearForPPO``), ``rows`` (``scoring``, ``response_rows``: which rows the LM head
scores) and ``fused_loss`` (the actor loss computed in the LM head). The fused path's API is
served here too, read from its home module on each access.
"""

from __future__ import annotations

import importlib
import warnings

from .advantages import ADV_ESTIMATORS, compute_grpo_outcome_advantage, compute_rloo_outcome_advantage
from .config import loss_config
from .losses import POLICY_LOSSES, compute_policy_loss, compute_policy_loss_gspo

__all__ = [
    "ADV_ESTIMATORS", "compute_grpo_outcome_advantage", "compute_policy_loss", "compute_policy_loss_gspo",
    "compute_rloo_outcome_advantage", "disable", "enable", "enabled", "FusedLinearForPPO", "loss_config",
    "POLICY_LOSSES", "register", "response_rows", "scoring",
]


def register() -> None:
    """Register the policy losses and advantage estimators with verl.

    Idempotent: replaces what an earlier import of this package registered.

    Raises
    ------
    ValueError
        verl's, when one of the names is already taken by someone else's estimator.
    """
    from verl.trainer.ppo import core_algos

    for name, loss in zip(POLICY_LOSSES, (compute_policy_loss, compute_policy_loss_gspo)):
        core_algos.register_policy_loss(name)(loss)
    for name, estimator in zip(ADV_ESTIMATORS, (compute_grpo_outcome_advantage, compute_rloo_outcome_advantage)):
        if getattr(core_algos.ADV_ESTIMATOR_REGISTRY.get(name), "__module__", None) == estimator.__module__:
            del core_algos.ADV_ESTIMATOR_REGISTRY[name]  # ours, from an earlier import of this package
        core_algos.register_adv_est(name)(estimator)
    importlib.import_module("rlk_mm.integrations.verl.fused").register()  # honours RLK_MM_VERL_FUSED


# ---------------------------------------------------------------------------------------------
# The fused LM-head path's API, served here from its home modules on each access (imported on
# first use): a name patched or re-imported there is the one served here.
_FUSED_EXPORTS = {"FusedLinearForPPO": "lm_head", "enable": "fused", "disable": "fused", "enabled": "fused",
                  "scoring": "rows", "response_rows": "rows"}


def __getattr__(name: str):
    if name in _FUSED_EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_FUSED_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: what to install when the module verl needs is missing, by its top-level name: verl's package
#: imports ray, so without it verl itself cannot be imported (``make setup`` installs verl without
#: its dependencies, ray among them: the main suite uses the tests' ray stand-in)
_INSTALL = {
    "ray": ("verl imports ray, which is not installed here, so verl itself cannot be imported: pip install ray "
            "(or, in rlk_mm's clone, pip install -e '.[verl]': verl 0.9.1 with all of its dependencies)"),
    "verl": "verl is not installed here: pip install -e '.[verl]' in rlk_mm's clone (verl 0.9.1 and its dependencies)",
}


def _missing(error: BaseException) -> str | None:
    """The top-level name of the module whose absence caused ``error`` (it or an exception it chains), if any."""
    while error is not None:
        if isinstance(error, ModuleNotFoundError) and error.name:
            return error.name.split(".")[0]
        error = error.__cause__ or error.__context__
    return None


def _register_on_import() -> None:
    """Register, turning an error into a warning: verl's plugin loader would log it at debug level only."""
    try:
        register()
    except Exception as error:
        hint = _INSTALL.get(_missing(error))
        if hint is not None:
            message = (f"rlk_mm's verl plugin did not register: {hint}. Once it is, verl's plugin loader registers "
                       "rlk_mm when verl is imported")
        else:
            message = (f"rlk_mm's verl plugin did not register ({type(error).__name__}: {error}); verl runs without "
                       "rlk_mm. Call rlk_mm.integrations.verl.register() to see the traceback")
        warnings.warn(message, RuntimeWarning, stacklevel=2)


_register_on_import()
