"""rlk_mm as verl's fused-kernel backend: a drop-in ``FusedLinearForPPO`` that scores
only response tokens and, for ``loss_mode=rlk_mm``, computes the policy loss in the LM head.

verl 0.9.1 (``actor_rollout_ref.model.use_fused_kernels=True``, backend ``torch``)
computes log-probs and entropies with ``verl.utils.experimental.torch_functional.
FusedLinearForPPO``, a 512-row chunked torch loop. Its model patches (``dense_common``,
``qwen2_vl``, ``qwen3_vl``, ``qwen3_5``, ``glm4v``) import that class from its module
each time the LM head runs, so replacing the module attribute swaps the implementation.

``enable()`` puts this module's ``FusedLinearForPPO`` (backed by
``rlk_mm.ops.selected_logprob(..., return_entropy=True)``) there, and wraps the FSDP
engine's ``forward_step`` so that, for RL micro-batches, only the rows verl's losses
read (response tokens under ``response_mask``) are scored; prompt and image rows cost
nothing and hold zeros.

In ``update_actor`` with ``policy_loss.loss_mode=rlk_mm`` the wrapper goes further: the
LM head computes the whole actor loss with ``rlk_mm.ops.linear_policy_loss`` (three
logits-sized products: the gradient is formed in the forward) from the micro-batch's
``old_log_probs``, ``advantages``, ``rollout_is_weights`` and, with ``use_kl_loss``,
``ref_log_prob``, under the actor config's clip ratios, dual clip, ``loss_agg_mode``,
global-batch scaling, ``entropy_coeff`` and KL settings (see ``fused_loss_plan``). verl's
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

import contextlib
import contextvars
import functools
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..ops.logprob import TargetError, selected_logprob
from ..ops.loss.config import PolicyLossConfig, kl_estimator
from ..ops.loss.fused import PolicyLossOutput, linear_policy_loss
from ..schema.checks import INTEGER_DTYPES, bool_arg, int_arg, tensor_arg
from ._args import clip_ratios

__all__ = [
    "disable", "enable", "enabled", "ENV_SWITCH", "fused_loss_config", "fused_loss_plan", "FusedLinearForPPO",
    "FusedLossPlan", "register", "response_rows", "scoring", "take_fused_loss",
]

Tensor = torch.Tensor

ENV_SWITCH = "RLK_MM_VERL_FUSED"
_TORCH_FUNCTIONAL = "verl.utils.experimental.torch_functional"
_FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"
_LOSSES = "verl.workers.utils.losses"


# ------------------------------------------------------------------ which rows to score
@dataclass(frozen=True)
class _Scoring:
    """Rows whose outputs are read, as packed positions (``log_probs[t]`` scores token
    ``t + 1``), and the packed sample offsets ``cu_seqlens`` [B+1]."""

    rows: Tensor
    cu_seqlens: Tensor

    def rows_for(self, shape: torch.Size, device: torch.device) -> Optional[Tensor]:
        """The rows in the layout of ``input_ids`` of ``shape``, or None when it is neither
        the packed ``[1, T (+ padding)]``/``[T]`` nor the padded ``[B, L]`` layout."""
        cu = self.cu_seqlens.to(device=device, dtype=torch.int64)
        rows = self.rows.to(device=device, dtype=torch.int64)
        total, samples = int(cu[-1]), cu.numel() - 1
        if len(shape) == 1 or (len(shape) == 2 and shape[0] == 1):
            return rows if shape[-1] >= total else None
        if len(shape) == 2 and shape[0] == samples and samples > 1:
            sample = torch.searchsorted(cu, rows, right=True) - 1
            if int((cu[1:] - cu[:-1]).max()) > shape[1]:
                return None
            return sample * shape[1] + (rows - cu[sample])
        return None


_SCORING: contextvars.ContextVar[Optional[_Scoring]] = contextvars.ContextVar("rlk_mm_verl_scoring", default=None)


@contextlib.contextmanager
def scoring(rows: Tensor, cu_seqlens: Tensor):
    """Within the block, ``FusedLinearForPPO`` scores only packed positions ``rows`` of the
    samples laid out by ``cu_seqlens`` (packed or padded inputs), and returns zeros elsewhere."""
    tensor_arg("rows", rows, ndim=1, dtypes=INTEGER_DTYPES)
    tensor_arg("cu_seqlens", cu_seqlens, ndim=1, dtypes=INTEGER_DTYPES)
    token = _SCORING.set(_Scoring(rows, cu_seqlens))
    try:
        yield
    finally:
        _SCORING.reset(token)


def _response_slots(micro_batch) -> Optional[tuple[Tensor, Tensor, Tensor]]:
    """(window [B, R]: the packed row whose log-prob verl reads for each response slot,
    ``response_mask`` [B, R] as bool, ``cu_seqlens`` [B+1]) of an RL micro-batch in verl's
    no-padding layout, or None for other batches."""
    from verl.workers.utils.padding import no_padding_2_padding

    if not all(k in micro_batch.keys() for k in ("input_ids", "prompts", "responses", "response_mask")):
        return None
    input_ids = micro_batch["input_ids"]
    if not input_ids.is_nested:
        return None
    cu = input_ids.offsets()
    packed = torch.nested.nested_tensor_from_jagged(torch.arange(int(cu[-1]), device=cu.device), cu)
    window = no_padding_2_padding(packed, micro_batch)  # [B, R]: packed row of each response slot
    mask = _padded(micro_batch["response_mask"], window.shape)
    if mask is None:
        return None
    return window, mask.to(device=window.device).bool(), cu


def _padded(t: Tensor, shape: torch.Size) -> Optional[Tensor]:
    """``t`` as a dense ``shape`` tensor (nested ones padded with 0), or None if it does not fit."""
    if t.is_nested:
        t = t.to_padded_tensor(0, output_size=tuple(shape))
    return t if tuple(t.shape) == tuple(shape) else None


def response_rows(micro_batch) -> Optional[tuple[Tensor, Tensor]]:
    """(rows, cu_seqlens) of an RL micro-batch in verl's no-padding layout: the packed
    positions whose log-probs verl's RL losses read (``no_padding_2_padding``: the response
    window shifted by one), kept where ``response_mask`` is set, in the mask's row-major
    order. None for other batches."""
    slots = _response_slots(micro_batch)
    if slots is None:
        return None
    window, mask, cu = slots
    return window[mask], cu


# ------------------------------------------------------------------ the loss in the LM head
@dataclass
class FusedLossPlan:
    """One micro-batch's ``linear_policy_loss`` inputs besides the LM head's (compact ``[n]``
    per-token tensors in ``response_rows`` order, the sample of each, the loss config from the
    actor config's knobs: ``fused_loss_config``), and its result once the LM head ran."""

    per_token: dict[str, Optional[Tensor]]
    sample_index: Tensor
    num_samples: int
    config: PolicyLossConfig
    result: Optional[PolicyLossOutput] = field(default=None, repr=False)

    def compute(self, hidden: Tensor, weight: Tensor, rows: Tensor, targets: Tensor, temperature: float):
        """The fused loss over ``rows``; returns their log-probs and entropies (detached)."""
        if self.result is not None:
            raise RuntimeError(
                "rlk_mm's fused policy loss: the LM head ran twice in one micro-batch; turn the fused loss off "
                "(actor_rollout_ref.actor.policy_loss.loss_mode=vanilla) for models that call it more than once"
            )
        if rows.numel() != self.sample_index.numel():
            raise RuntimeError(
                f"rlk_mm's fused policy loss: the LM head scores {rows.numel()} rows but the micro-batch's "
                f"response_mask selects {self.sample_index.numel()} tokens"
            )
        device = hidden.device
        per_token = {k: None if v is None else v.to(device) for k, v in self.per_token.items()}
        self.result = linear_policy_loss(
            hidden, weight, index=rows, targets=targets, temperature=temperature, **per_token,
            sample_index=self.sample_index.to(device), num_samples=self.num_samples, config=self.config,
        )
        return self.result.log_probs, self.result.entropy


_FUSED_LOSS: contextvars.ContextVar[Optional[FusedLossPlan]] = contextvars.ContextVar("rlk_mm_verl_loss", default=None)


def fused_loss_plan(micro_batch, loss_function) -> Optional[FusedLossPlan]:
    """The fused-loss plan of a training micro-batch, or None where the loss stays verl's
    (see the module docstring for what falls back)."""
    from verl.utils import tensordict_utils as tu

    losses = sys.modules.get(_LOSSES)
    if not (isinstance(loss_function, functools.partial) and losses is not None
            and loss_function.func is getattr(losses, "ppo_loss", None) and "config" in loss_function.keywords):
        return None
    config = loss_function.keywords["config"]
    flag = functools.partial(tu.get_non_tensor_data, data=micro_batch, default=False)
    if (config.policy_loss.get("loss_mode", "vanilla") != "rlk_mm" or flag(key="calculate_sum_pi_squared")
            or flag(key="distillation_use_topk") or flag(key="distillation_only")):
        return None
    if config.use_kl_loss:
        try:
            kl_estimator(config.kl_loss_type, "kl_loss_type")
        except ValueError:
            return None
    slots = _response_slots(micro_batch)
    if slots is None:
        return None
    window, mask, _ = slots
    names = {"old_log_probs": "old_log_probs", "advantages": "advantages", "rollout_is_weights": "rollout_is_weights"}
    if config.use_kl_loss:
        names["ref_log_probs"] = "ref_log_prob"
    per_token = {}
    for ours, theirs in names.items():
        value = micro_batch.get(theirs, None)
        value = None if value is None else _padded(value, window.shape)
        if value is None and theirs != "rollout_is_weights":
            return None  # verl's ppo_loss raises on it; let it say so
        per_token[ours] = None if value is None else value.to(mask.device)[mask]
    loss_config = fused_loss_config(config, micro_batch, mask.shape[1], entropy=flag(key="calculate_entropy"))
    sample_index = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)[mask]
    return FusedLossPlan(per_token, sample_index, mask.shape[0], loss_config)


def fused_loss_config(config, micro_batch, response_length: int, *, entropy: bool) -> PolicyLossConfig:
    """The ``PolicyLossConfig`` of verl's whole actor loss on one micro-batch: the actor
    ``config``'s clip ratios, dual clip, ``loss_agg_mode`` and ``loss_scale_factor`` (verl's
    default for the ``-norm`` mode: the padded ``response_length``), ``entropy_coeff`` when verl
    computes the entropy, its KL settings with ``use_kl_loss``; the micro-batch's global counts."""
    low, high = clip_ratios(config)
    kl = dict(kl_type=config.kl_loss_type, kl_coef=config.kl_loss_coef) if config.use_kl_loss else {}
    return PolicyLossConfig(
        clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=config.get("clip_ratio_c", 3.0),
        loss_agg_mode=config.loss_agg_mode, dp_size=micro_batch["dp_size"],
        batch_num_tokens=micro_batch["batch_num_tokens"], global_batch_size=micro_batch["global_batch_size"],
        loss_scale_factor=config.loss_scale_factor if config.loss_scale_factor is not None else response_length,
        entropy_coeff=config.entropy_coeff if entropy else 0.0, **kl,
    )


def take_fused_loss(log_prob: Tensor, response_mask: Tensor) -> Optional[tuple[Tensor, dict[str, Tensor]]]:
    """For the registered ``rlk_mm`` policy loss: the loss the LM head computed for this
    micro-batch, or None (then the log-prob path runs).

    Returns ``(loss, metrics)``: the loss's value is the PPO term alone, as verl's policy
    losses return it, but its gradient is the whole fused loss's (PPO term, KL, entropy
    bonus). verl's ``ppo_loss`` then subtracts the entropy bonus and adds the KL term it
    computes from the detached log-probs and entropies, which add values but no gradient:
    the total has verl's value and the fused gradient.
    """
    plan = _FUSED_LOSS.get()
    if plan is None or plan.result is None:
        return None
    result, plan.result = plan.result, None  # one policy-loss call per LM-head run
    tensor_arg("response_mask", response_mask, ndim=2)
    scored = int(response_mask.bool().sum())
    if log_prob.shape[0] != plan.num_samples or scored != result.log_probs.numel():
        raise RuntimeError(
            f"rlk_mm's fused policy loss was computed for {plan.num_samples} samples and {result.log_probs.numel()} "
            f"tokens, but verl's loss passes log_prob {tuple(log_prob.shape)} with {scored} masked-in tokens"
        )
    pg = result.metrics["pg_loss"]
    return pg + (result.loss - result.loss.detach()), result.metrics


# ------------------------------------------------------------------ the drop-in class
class FusedLinearForPPO(torch.nn.Module):
    """verl's ``FusedLinearForPPO`` (same constructor and call), computed by rlk_mm.

    Under a fused-loss plan (``update_actor`` with ``loss_mode=rlk_mm``) it computes the actor loss
    with ``linear_policy_loss`` and returns the log-probs and entropies detached.

    Parameters
    ----------
    chunk_size, impl_backend : int, str
        Accepted for compatibility (rlk_mm tiles the vocabulary itself).

    Raises
    ------
    ValueError
        For a backend verl does not know.
    """

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"Unsupported FusedLinearForPPO backend: {impl_backend}. Choose 'torch' or 'liger'.")
        self.chunk_size = int_arg("chunk_size", chunk_size, min=1)
        self.impl_backend = impl_backend

    def forward(self, hidden_states: Tensor, vocab_weights: Tensor, input_ids: Tensor, temperature: float = 1.0):
        """Log-probs and entropies of ``input_ids``, with gradients through both.

        Parameters
        ----------
        hidden_states, vocab_weights, input_ids : Tensor
            ``[B, L, H]`` or ``[T, H]``; ``[V, H]``; ``[B, L]`` or ``[T]``.
        temperature : float

        Returns
        -------
        tuple of Tensor
            ``(log_probs fp32, entropy in hidden_states' dtype)`` shaped like ``input_ids``. Logits are
            formed in autocast's dtype when autocast is on.

        Raises
        ------
        ValueError, TypeError
            For other shapes or dtypes, or a token id outside the vocabulary (naming its place).
        """
        tensor_arg("hidden_states", hidden_states)
        tensor_arg("vocab_weights", vocab_weights)
        tensor_arg("input_ids", input_ids)
        if hidden_states.dim() not in (2, 3):
            raise ValueError(f"hidden_states must be 2D or 3D, got shape {tuple(hidden_states.shape)}")
        if input_ids.dtype not in INTEGER_DTYPES:
            raise TypeError(f"input_ids must be an integer tensor of token ids, got {input_ids.dtype}")
        if tuple(input_ids.shape) != tuple(hidden_states.shape[:-1]):
            raise ValueError(
                f"input_ids shape {tuple(input_ids.shape)} must match hidden_states shape {tuple(hidden_states.shape[:-1])}"
            )
        dtype = _logits_dtype(hidden_states, vocab_weights)
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1]).to(dtype)
        weight = vocab_weights.to(dtype)
        ids = input_ids.reshape(-1).to(torch.int64)
        plan = _SCORING.get()
        rows = None if plan is None else plan.rows_for(input_ids.shape, ids.device)
        scored, targets = (torch.arange(ids.numel(), device=ids.device), ids) if rows is None else (rows, ids[rows])
        loss_plan = _FUSED_LOSS.get()
        try:
            if loss_plan is not None and rows is not None and torch.is_grad_enabled():
                logp, ent = loss_plan.compute(hidden, weight, rows, targets, temperature)
            else:
                logp, ent = selected_logprob(hidden, weight, index=scored, targets=targets, temperature=temperature,
                                             return_entropy=True)
        except TargetError as e:
            place = ", ".join(str(int(i)) for i in torch.unravel_index(scored[e.at].cpu(), tuple(input_ids.shape)))
            raise ValueError(f"input_ids[{place}] = {e.token} {e.problem}") from None
        if rows is not None:  # zeros where nothing is read
            logp = logp.new_zeros(ids.numel()).index_copy(0, rows, logp)
            ent = ent.new_zeros(ids.numel()).index_copy(0, rows, ent)
        return logp.view(input_ids.shape), ent.to(hidden_states.dtype).view(input_ids.shape)


def _logits_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype verl's ``hidden_states @ vocab_weights.t()`` would produce: autocast's
    when it is on, else the (common) input dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden_states is {hidden.dtype} but vocab_weights is {weight.dtype} (and autocast is off)")
    return hidden.dtype




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
        token = _FUSED_LOSS.set(loss_plan)
        try:
            with scoring(*plan):
                return forward_step(self, micro_batch, loss_function, forward_only)
        finally:
            _FUSED_LOSS.reset(token)

    setattr(wrapped, _STANDS_FOR, forward_step)
    return wrapped


def _swap_class() -> None:
    """rlk_mm's ``FusedLinearForPPO`` in verl's module and in every verl module that bound the name."""
    module = importlib.import_module(_TORCH_FUNCTIONAL)
    current = module.FusedLinearForPPO
    if current is FusedLinearForPPO:
        return
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
            "rlk_mm.integrations.verl_fused.enable() again",
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
    """Whether verl's LM head runs this module's ``FusedLinearForPPO``.

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
