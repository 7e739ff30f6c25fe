"""Swapping rlk_mm's functions into an installed EasyR1: ``patch`` (idempotent) replaces
``compute_policy_loss``, ``compute_kl``, ``average_loss`` and the GRPO / RLOO estimators
wherever ``verl.*`` (EasyR1's package is also named ``verl``) holds them, falling back to
EasyR1's own function for a setting rlk_mm does not implement (``SUPPORTED``);
``runtime_env_hook`` has every Ray worker of a job call it (``SETUP_HOOK``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Mapping
from typing import Callable, Optional

import torch

from ...ops.loss.terms import MEAN_EPS
from . import losses
from .advantages import ADVANTAGES
from .config import KL_PENALTIES, LOSS_TYPES

__all__ = ["patch", "runtime_env_hook", "SETUP_HOOK", "SUPPORTED"]

#: Ray's ``worker_process_setup_hook`` that patches every worker of an EasyR1 job
SETUP_HOOK = "rlk_mm.integrations.easyr1.patch"

logger = logging.getLogger(__name__)

#: per function: the setting that picks rlk_mm's implementation, and the values it implements
SUPPORTED = {
    "compute_policy_loss": ("loss_type", LOSS_TYPES),
    "compute_kl": ("kl_penalty", tuple(str(k) for k in KL_PENALTIES)),
    "average_loss": ("eps", (MEAN_EPS,)),
}
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
        ours = _with_fallback(getattr(losses, name), theirs, setting, supported)
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
