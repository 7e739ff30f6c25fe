"""rlk_mm as verl's fused-kernel backend: a drop-in ``FusedLinearForPPO`` that scores
only response tokens.

verl 0.9.1 (``actor_rollout_ref.model.use_fused_kernels=True``, backend ``torch``)
computes log-probs and entropies with ``verl.utils.experimental.torch_functional.
FusedLinearForPPO``, a 512-row chunked torch loop. Its model patches (``dense_common``,
``qwen2_vl``, ``qwen3_vl``, ``qwen3_5``, ``glm4v``) import that class from its module
each time the LM head runs, so replacing the module attribute swaps the implementation.

``enable()`` puts this module's ``FusedLinearForPPO`` (backed by
``rlk_mm.ops.selected_logprob(..., return_entropy=True)``) there, and wraps the FSDP
engine's ``forward_step`` so that, for RL micro-batches, only the rows verl's losses
read (response tokens under ``response_mask``) are scored; prompt and image rows cost
nothing and hold zeros. ``disable()`` restores every attribute it replaced.
``register()`` enables when ``RLK_MM_VERL_FUSED=1``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from ..ops.logprob import TargetError, selected_logprob
from ..schema.checks import INTEGER_DTYPES, bool_arg, int_arg, tensor_arg

Tensor = torch.Tensor

ENV_SWITCH = "RLK_MM_VERL_FUSED"
_TORCH_FUNCTIONAL = "verl.utils.experimental.torch_functional"
_FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"


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


def response_rows(micro_batch) -> Optional[tuple[Tensor, Tensor]]:
    """(rows, cu_seqlens) of an RL micro-batch in verl's no-padding layout: the packed
    positions whose log-probs verl's RL losses read (``no_padding_2_padding``: the response
    window shifted by one), kept where ``response_mask`` is set. None for other batches."""
    from verl.workers.utils.padding import no_padding_2_padding

    if not all(k in micro_batch.keys() for k in ("input_ids", "prompts", "responses", "response_mask")):
        return None
    input_ids = micro_batch["input_ids"]
    if not input_ids.is_nested:
        return None
    cu = input_ids.offsets()
    packed = torch.nested.nested_tensor_from_jagged(torch.arange(int(cu[-1]), device=cu.device), cu)
    window = no_padding_2_padding(packed, micro_batch)  # [B, R]: packed row of each response slot
    mask = micro_batch["response_mask"]
    if mask.is_nested:
        mask = mask.to_padded_tensor(0, output_size=tuple(window.shape))
    if tuple(mask.shape) != tuple(window.shape):
        return None
    return window[mask.to(device=window.device).bool()], cu


# ------------------------------------------------------------------ the drop-in class
class FusedLinearForPPO(torch.nn.Module):
    """verl's ``FusedLinearForPPO`` (same constructor and call), computed by rlk_mm.

    ``forward(hidden_states [B, L, H] | [T, H], vocab_weights [V, H], input_ids [B, L] | [T],
    temperature)`` returns ``(log_probs fp32, entropy in hidden_states' dtype)`` shaped like
    ``input_ids``, as verl's does, with gradients through both. Logits are formed in
    autocast's dtype when autocast is on (as verl's matmul would be). ``chunk_size`` and ``impl_backend`` are
    accepted for compatibility (rlk_mm tiles the vocabulary itself). A token id outside the
    vocabulary raises, naming its place in ``input_ids``.
    """

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"Unsupported FusedLinearForPPO backend: {impl_backend}. Choose 'torch' or 'liger'.")
        self.chunk_size = int_arg("chunk_size", chunk_size, min=1)
        self.impl_backend = impl_backend

    def forward(self, hidden_states: Tensor, vocab_weights: Tensor, input_ids: Tensor, temperature: float = 1.0):
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
        try:
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
_REPLACED: dict[tuple[object, str], object] = {}


def _replace(owner: object, name: str, value: object) -> None:
    _REPLACED.setdefault((owner, name), owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name))
    setattr(owner, name, value)


def _with_response_scoring(forward_step):
    """Wrap an engine's ``forward_step``: score only the response rows of RL micro-batches
    (fused kernels on, no sequence parallelism); everything else runs unchanged."""

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
        with scoring(*plan):
            return forward_step(self, micro_batch, loss_function, forward_only)

    return wrapped


def enable(*, response_only: bool = True) -> None:
    """Use rlk_mm's ``FusedLinearForPPO`` wherever verl looks the class up (idempotent).

    With ``response_only``, also wrap the FSDP engine's ``forward_step`` so that only the
    response rows are scored (skipped, with scoring of every row, when that engine cannot
    be imported, e.g. without its optional dependencies).
    """
    import importlib

    response_only = bool_arg("response_only", response_only)
    if _REPLACED:
        return
    module = importlib.import_module(_TORCH_FUNCTIONAL)
    original = module.FusedLinearForPPO
    for name, mod in list(sys.modules.items()):  # the home module and any module that bound the name
        if (name == "verl" or name.startswith("verl.")) and getattr(mod, "FusedLinearForPPO", None) is original:
            _replace(mod, "FusedLinearForPPO", FusedLinearForPPO)
    if response_only:
        try:
            engine = importlib.import_module(_FSDP_ENGINE).FSDPEngineWithLMHead
        except ImportError:
            return
        _replace(engine, "forward_step", _with_response_scoring(engine.__dict__["forward_step"]))


def disable() -> None:
    """Undo ``enable()``: every replaced attribute gets its original object back."""
    while _REPLACED:
        (owner, name), original = _REPLACED.popitem()
        setattr(owner, name, original)


def enabled() -> bool:
    return bool(_REPLACED)


def register() -> bool:
    """Hook for verl's plugin loader: ``enable()`` when ``RLK_MM_VERL_FUSED`` is 1/true/yes/on.
    Returns whether rlk_mm is now verl's fused backend."""
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        enable()
    elif value not in ("", "0", "false", "no", "off"):
        raise ValueError(f"{ENV_SWITCH}={value!r}: expected 1/true/yes/on or 0/false/no/off")
    return enabled()
