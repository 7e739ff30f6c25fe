"""rlk_mm as verl's fused-kernel backend: switched on with ``enable()`` (or ``RLK_MM_VERL_FUSED=1``
through ``register()``), a drop-in ``FusedLinearForPPO`` that scores only response tokens and,
for ``loss_mode=rlk_mm``, computes the policy loss in the LM head.

verl 0.9.1 (``actor_rollout_ref.model.use_fused_kernels=True``, backend ``torch``)
computes log-probs and entropies with ``verl.utils.experimental.torch_functional.
FusedLinearForPPO``, a 512-row chunked torch loop. Its model patches (``dense_common``,
``qwen2_vl``, ``qwen3_vl``, ``qwen3_5``, ``glm4v``) import that class from its module
each time the LM head runs, so replacing the module attribute swaps the implementation.

``enable()`` puts rlk_mm's ``FusedLinearForPPO`` (``verl.lm_head``, backed by
``rlk_mm.ops.selected_logprob(..., return_entropy=True)``) there, and wraps the FSDP
engine's ``forward_step`` so that, for RL micro-batches, only the rows verl's losses
read (response tokens under ``response_mask``: ``verl.rows``) are scored; prompt and image
rows cost nothing and hold zeros.

In ``update_actor`` with ``policy_loss.loss_mode=rlk_mm`` the wrapper goes further: the
LM head computes the whole actor loss with ``rlk_mm.ops.linear_policy_loss`` (three
logits-sized products: the gradient is formed in the forward) from the micro-batch's
``old_log_probs``, ``advantages``, ``rollout_is_weights`` and, with ``use_kl_loss``,
``ref_log_prob``, under the actor config's clip ratios, dual clip, ``loss_agg_mode``,
global-batch scaling, ``entropy_coeff`` and KL settings (see ``verl.fused_loss``). verl's
``ppo_loss`` still runs and still produces every metric from the (detached) log-probs and
entropies; the registered ``rlk_mm`` policy loss hands it the fused loss (see
``take_fused_loss``). Everything else falls back to the log-prob path (four products):
``compute_log_prob``, ``loss_mode`` other than ``rlk_mm`` (``rlk_mm_gspo``: sequence
ratios need every token before a gradient), sequence parallelism, a loss function other
than verl's ``ppo_loss`` (distillation), ``calculate_sum_pi_squared``, a ``kl_loss_type``
rlk_mm does not implement (``full``), and any layout ``FusedLinearForPPO`` cannot map.

``disable()`` restores every attribute it replaced. ``register()`` enables when
``RLK_MM_VERL_FUSED=1``. Where verl's engine cannot be imported yet when the plugin loads
(verl loads plugins while it is itself importing, e.g. under a platform plugin), ``enable()``
warns, keeps the class swap, and wraps the engine when verl imports it; calling ``enable()``
again completes whatever part is missing, also after this module was imported anew.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import warnings

from ...schema.checks import bool_arg
from .fused_loss import fused_loss_plan, using_plan
from .lm_head import FusedLinearForPPO
from .rows import response_rows, scoring

__all__ = ["disable", "enable", "enabled", "ENV_SWITCH", "register"]

#: the environment variable ``register()`` reads: 1/true/yes/on enables, 0/false/no/off (or unset) does not
ENV_SWITCH = "RLK_MM_VERL_FUSED"
_TORCH_FUNCTIONAL = "verl.utils.experimental.torch_functional"
_FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"


# ------------------------------------------------------------------ enable / disable
#: (owner, attribute) -> verl's own object there, for ``disable``
_REPLACED: dict[tuple[object, str], object] = {}
#: set on each replacement: the verl object it stands for (survives a re-import of this module)
_STANDS_FOR = "_rlk_mm_stands_for"


def _verl_original(value: object) -> object:
    """verl's own object behind ``value``: ``value`` unless an rlk_mm replacement (from this
    or an earlier import of this module) is there."""
    while getattr(value, _STANDS_FOR, None) is not None:
        value = getattr(value, _STANDS_FOR)
    return value


def _replace(owner: object, name: str, value: object, original: object) -> None:
    _REPLACED.setdefault((owner, name), original)
    setattr(owner, name, value)


def _with_response_scoring(forward_step):
    """Wrap an engine's ``forward_step``: for RL micro-batches (fused kernels on, no sequence
    parallelism) score only the response rows, and in training compute the loss in the LM
    head where ``fused_loss_plan`` allows; everything else runs unchanged."""

    @functools.wraps(forward_step)
    def wrapped(self, micro_batch, loss_function, forward_only):
        from verl.utils import tensordict_utils as tu

        plan = None
        if tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False) and not getattr(
            self, "use_ulysses_sp", False
        ):
            plan = response_rows(micro_batch)
        if plan is None:
            return forward_step(self, micro_batch, loss_function, forward_only)
        loss_plan = None if forward_only else fused_loss_plan(micro_batch, loss_function)
        with using_plan(loss_plan), scoring(*plan):
            return forward_step(self, micro_batch, loss_function, forward_only)

    setattr(wrapped, _STANDS_FOR, forward_step)
    return wrapped


def _swap_class() -> None:
    """rlk_mm's ``FusedLinearForPPO`` in verl's module and in every verl module that bound the name
    (recorded for ``disable`` even where it is there already, as after a re-import of this module)."""
    module = importlib.import_module(_TORCH_FUNCTIONAL)
    current = module.FusedLinearForPPO
    original = _verl_original(current)
    setattr(FusedLinearForPPO, _STANDS_FOR, original)
    for name, mod in list(sys.modules.items()):
        if (name == "verl" or name.startswith("verl.")) and getattr(mod, "FusedLinearForPPO", None) in (original, current):
            _replace(mod, "FusedLinearForPPO", FusedLinearForPPO, original)


def _wrap_engine() -> bool:
    """Wrap ``FSDPEngineWithLMHead.forward_step`` (once). Where the engine cannot be imported
    now (e.g. while verl, still importing, loads its plugins), warn, and wrap it when verl
    imports it later; returns whether it is wrapped now."""
    try:
        engine = importlib.import_module(_FSDP_ENGINE)
    except Exception as error:  # its optional dependencies raise more than ImportError
        if not any(isinstance(f, _WrapOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _WrapOnImport())
        warnings.warn(
            f"rlk_mm: verl's FSDP engine ({_FSDP_ENGINE}) could not be imported ({type(error).__name__}: {error}). "
            "rlk_mm's FusedLinearForPPO is on, but until the engine is wrapped every row is scored and the policy "
            "loss is not fused into the LM head; rlk_mm wraps it when verl imports it, or call "
            "rlk_mm.integrations.verl.fused.enable() again",
            RuntimeWarning, stacklevel=3,
        )
        return False
    _wrap(engine.FSDPEngineWithLMHead)
    return True


def _wrap(engine: type) -> None:
    current = engine.__dict__["forward_step"]
    if getattr(current, "__code__", None) is _WRAPPER_CODE:  # wrapped by this import of the module
        return
    original = _verl_original(current)
    _replace(engine, "forward_step", _with_response_scoring(original), original)


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps the engine's ``forward_step`` right after verl's engine module is next imported."""

    def find_spec(self, name, path, target=None):
        if name != _FSDP_ENGINE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        sys.meta_path.remove(self)
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _wrap(module.FSDPEngineWithLMHead)

        spec.loader.exec_module = exec_and_wrap
        return spec


def enable(*, response_only: bool = True) -> bool:
    """Use rlk_mm's ``FusedLinearForPPO`` wherever verl looks the class up.

    Completes whatever part is missing, so it is safe to call again.

    Parameters
    ----------
    response_only : bool
        Also wrap the FSDP engine's ``forward_step`` (response rows only, and the loss in the LM
        head for ``loss_mode=rlk_mm``).

    Returns
    -------
    bool
        Whether every requested part is on (a warning says what is not).
    """
    response_only = bool_arg("response_only", response_only)
    _swap_class()
    return _wrap_engine() if response_only else True


def disable() -> None:
    """Undo ``enable()``: verl's original objects back, and a pending wrap of the engine dropped.
    """
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != _WrapOnImport.__name__]
    while _REPLACED:
        (owner, name), original = _REPLACED.popitem()
        setattr(owner, name, original)


def enabled() -> bool:
    """Whether verl's LM head runs rlk_mm's ``FusedLinearForPPO``.

    Returns
    -------
    bool
    """
    module = sys.modules.get(_TORCH_FUNCTIONAL)
    return module is not None and module.FusedLinearForPPO is FusedLinearForPPO


def register() -> bool:
    """Hook for verl's plugin loader: ``enable()`` when ``RLK_MM_VERL_FUSED`` is 1/true/yes/on.

    Returns
    -------
    bool
        Whether rlk_mm is now verl's fused backend.
    """
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        enable()
    elif value not in ("", "0", "false", "no", "off"):
        raise ValueError(f"{ENV_SWITCH}={value!r}: expected 1/true/yes/on or 0/false/no/off")
    return enabled()


#: the code object of every wrapper this import of the module makes
_WRAPPER_CODE = _with_response_scoring(lambda self, micro_batch, loss_function, forward_only: None).__code__
