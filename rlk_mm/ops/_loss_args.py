"""The loss ops' arguments, checked: the token layout (padded ``[B, R]`` or compact ``[n]`` with ``sample_index``), the mask and
the constant inputs (their values gathered into the call's one host sync), the
aggregation's global counts, and the numeric knobs. Errors name the argument, and for a
value its sample and position, and say what to change."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..schema.checks import FLOAT_DTYPES, INTEGER_DTYPES, DeviceChecks, first_true, float_arg, int_arg, tensor_arg
from ._loss_terms import KLEstimator
from .options import AggMode, KLType

_F32_MAX = torch.finfo(torch.float32).max


# ----------------------------------------------------------------------------- layout and values
@dataclass(frozen=True)
class Layout:
    """Where each token's sequence is: row of a padded [B, R] tensor, or sample_index[t]."""

    shape: torch.Size
    device: torch.device
    num_seqs: int
    row_length: int  # R for padded tensors, 0 for compact ones
    sample_index: Optional[Tensor]  # int64 [n] for compact tensors, None for padded ones
    ref: str = "log_probs"  # the argument whose layout this is (the other inputs follow it)

    @property
    def padded(self) -> bool:
        return self.sample_index is None

    def token_seq(self) -> Tensor:
        """int64 [N]: the sequence of each token."""
        if self.padded:
            return torch.arange(self.num_seqs * self.row_length, device=self.device) // max(self.row_length, 1)
        return self.sample_index

    def seq_sum(self, values: Tensor) -> Tensor:
        """Per-sequence sums of a flat per-token tensor, deterministic (no atomics)."""
        if self.padded:
            return values.reshape(self.num_seqs, self.row_length).sum(-1)
        offsets = torch.searchsorted(self.sample_index, torch.arange(self.num_seqs + 1, device=values.device))
        return torch.segment_reduce(values, "sum", offsets=offsets, unsafe=True)

    def at(self, name: str, i: int) -> str:
        """Where flat token ``i`` is, for error messages: ``name: sample b, position t`` or ``name[i] (sample b)``."""
        if self.padded:
            return f"{name}: sample {i // self.row_length}, position {i % self.row_length}"
        return f"{name}[{i}] (sample {int(self.sample_index[i])})"


def layout_of(name: str, ref, sample_index, num_samples, checks: DeviceChecks) -> Layout:
    """The layout of ``ref`` (the differentiable input); ``sample_index``'s order and range go to ``checks``."""
    tensor_arg(name, ref, dtypes=FLOAT_DTYPES)
    if sample_index is None:
        if num_samples is not None:
            raise ValueError("num_samples is only for compact inputs (with sample_index); padded [B, R] have B rows")
        if ref.ndim != 2:
            raise ValueError(
                f"{name} has shape {tuple(ref.shape)}: padded inputs are [B, R]; for compact [n] inputs pass "
                "sample_index (RLBatch.loss_token_sample()) and num_samples"
            )
        return Layout(ref.shape, ref.device, ref.shape[0], ref.shape[1], None, name)
    if ref.ndim != 1:
        raise ValueError(f"{name} has shape {tuple(ref.shape)}: with sample_index, inputs are compact [n]")
    if num_samples is None:
        raise ValueError("num_samples is required with sample_index (the batch size B)")
    num_samples = int_arg("num_samples", num_samples, min=0)
    tensor_arg("sample_index", sample_index, dtypes=(torch.int64, torch.int32))
    tensor_arg("sample_index", sample_index, shape=tuple(ref.shape), device=ref.device)
    idx = sample_index.long()
    if idx.numel():
        checks.add((idx[1:] < idx[:-1]).any() | (idx[0] < 0) | (idx[-1] >= num_samples),
                   lambda: _raise_sample_index(idx, num_samples))
    return Layout(ref.shape, ref.device, num_samples, 0, idx, name)


def _raise_sample_index(idx: Tensor, num_samples: int):
    down = torch.nonzero(idx[1:] < idx[:-1])
    if down.numel():
        t = int(down[0]) + 1
        raise ValueError(
            f"sample_index[{t}] = {int(idx[t])} follows {int(idx[t - 1])}: loss tokens must be grouped by "
            "sample in non-decreasing order (loss-span order, as RLBatch.loss_token_sample() returns)"
        )
    t = 0 if int(idx[0]) < 0 else idx.numel() - 1
    raise ValueError(f"sample_index[{t}] = {int(idx[t])} is outside [0, num_samples={num_samples})")


def like(layout: Layout, name: str, t, dtypes=FLOAT_DTYPES) -> None:
    """``t`` is a tensor of ``dtypes`` shaped and placed like the layout's reference input."""
    tensor_arg(name, t, dtypes=dtypes, device=layout.device)
    if t.shape != layout.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(layout.shape)} like {layout.ref}")


def _add_value_check(layout: Layout, checks: DeviceChecks, name: str, values: Tensor, bad: Tensor, rule: str) -> None:
    """Adds to ``checks``: no ``bad`` entry (flat bool, True where a value of ``name`` breaks ``rule``)."""

    def fail():
        i = first_true(bad)[0]
        raise ValueError(f"{layout.at(name, i)} is {values.reshape(-1)[i].item()}; {rule}")

    checks.add(bad.any(), fail)


def checked_mask(layout: Layout, checks: DeviceChecks, mask) -> Optional[Tensor]:
    """Checks ``mask`` (bool; integer 0/1; float weights, finite and >= 0); returns the flat
    "scored" flags (``mask != 0``), None without a mask (every token scored)."""
    if mask is None:
        return None
    like(layout, "mask", mask, dtypes=(torch.bool, *INTEGER_DTYPES, *FLOAT_DTYPES))
    flat = mask.reshape(-1)
    if flat.is_floating_point():
        bad = ~((flat >= 0) & (flat < math.inf))
        rule = "a mask weight must be finite and >= 0 (0 leaves the token out)"
        _add_value_check(layout, checks, "mask", flat, bad, rule)
    elif flat.dtype != torch.bool:
        bad = (flat != 0) & (flat != 1)
        rule = "an integer mask holds 0 or 1 (a float mask weights tokens)"
        _add_value_check(layout, checks, "mask", flat, bad, rule)
    return flat != 0


def check_data(layout: Layout, checks: DeviceChecks, scored: Optional[Tensor], name: str, t, weights: bool = False):
    """A constant input (no gradient) must be finite at scored tokens (importance ``weights`` also >= 0)."""
    if t is None:
        return
    like(layout, name, t)
    flat = t.reshape(-1)
    bad = ~((flat >= 0) & (flat < math.inf)) if weights else ~torch.isfinite(flat)
    if scored is not None:
        bad = bad & scored
    rule = "importance weights must be finite and >= 0" if weights else "it must be finite"
    _add_value_check(layout, checks, name, flat, bad, f"{rule} where the mask is set: fix the value, or mask the token")


def _count_arg(name: str, value, checks: DeviceChecks):
    """A global count: a number >= 0, or a 0-d tensor (its value checked with ``checks``)."""
    if value is None:
        return None
    if not isinstance(value, Tensor):
        return float_arg(name, value, min=0.0)
    if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
        raise ValueError(f"{name} must be a number or a 0-d tensor, got {value.dtype} of shape {tuple(value.shape)}")

    def fail():
        raise ValueError(f"{name} is {value.item()}; a count must be a finite number >= 0")

    checks.add(~((value >= 0) & (value < math.inf)), fail)
    return value


# ----------------------------------------------------------------------------- aggregation and knobs
@dataclass(frozen=True)
class Agg:
    """A checked aggregation: the mode, dp_size, the global counts and the ``-norm`` divisor."""

    mode: AggMode
    dp_size: int
    batch_num_tokens: Optional[float | Tensor]
    global_batch_size: Optional[float | Tensor]
    norm: float


def agg_args(layout: Layout, checks: DeviceChecks, mode, dp_size, batch_num_tokens, global_batch_size,
             loss_scale_factor) -> Agg:
    """The aggregation arguments checked (tensor counts' values go to ``checks``)."""
    mode = AggMode.parse(mode, "loss_agg_mode")
    dp_size = int_arg("dp_size", dp_size, min=1)
    batch_num_tokens = _count_arg("batch_num_tokens", batch_num_tokens, checks)
    global_batch_size = _count_arg("global_batch_size", global_batch_size, checks)
    if loss_scale_factor is not None:
        loss_scale_factor = float_arg("loss_scale_factor", loss_scale_factor, min=0.0, min_open=True)
    seq_modes = (AggMode.SEQ_MEAN_TOKEN_SUM, AggMode.SEQ_MEAN_TOKEN_MEAN, AggMode.SEQ_MEAN_TOKEN_SUM_NORM)
    if dp_size > 1 and mode is AggMode.TOKEN_MEAN and batch_num_tokens is None:
        raise ValueError("batch_num_tokens (the global token count) is required when dp_size > 1")
    if dp_size > 1 and mode in seq_modes and global_batch_size is None:
        raise ValueError("global_batch_size is required when dp_size > 1")
    norm = 1.0
    if mode is AggMode.SEQ_MEAN_TOKEN_SUM_NORM:
        if loss_scale_factor is None and not layout.padded:
            raise ValueError(
                "loss_scale_factor is required for seq-mean-token-sum-norm on compact inputs "
                "(verl's default is the padded response length)"
            )
        norm = layout.row_length if loss_scale_factor is None else loss_scale_factor
    return Agg(mode, dp_size, batch_num_tokens, global_batch_size, norm)


def f32_arg(name: str, value, *, min: Optional[float] = None, inf_ok: bool = False) -> float:
    """A knob of the float32 math: a number within float32's range (``inf_ok``: or ±inf, no bound)."""
    value = float_arg(name, value, min=min, finite=not inf_ok)
    if math.isfinite(value) and abs(value) > _F32_MAX:
        raise ValueError(f"{name}={value} is out of range: float32 math needs |{name}| <= {_F32_MAX:.7g}")
    return value


def dual_clip(name: str, value) -> float:
    """The dual-clip bound ``c`` (> 1), ``inf`` for None (off)."""
    if value is None:
        return math.inf
    value = f32_arg(name, value, inf_ok=True)
    if not value > 1.0:
        raise ValueError(f"{name}={value}: the dual-clip bound must be > 1 (or None to turn it off)")
    return value


def log_ratio_bounds(value) -> tuple[float, float]:
    """``log_ratio_clamp`` as (low, high), None meaning unbounded; low <= high."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"log_ratio_clamp must be a pair (low, high) of numbers or None, got {value!r}")
    lo, hi = (
        bound if v is None else f32_arg(f"log_ratio_clamp[{k}]", v, inf_ok=True)
        for k, (v, bound) in enumerate(zip(value, (-math.inf, math.inf)))
    )
    if lo > hi:
        raise ValueError(f"log_ratio_clamp=({lo}, {hi}): the lower bound must be <= the upper")
    return lo, hi


def kl_estimator(kind, argument: str) -> tuple[KLEstimator, bool]:
    """(estimator, straight-through) of a ``KLType`` name, optionally with a trailing ``+``."""
    straight = isinstance(kind, str) and kind.endswith("+")
    try:
        estimator = KLType(kind[:-1] if straight else kind).estimator
    except ValueError:
        message = f"{argument}: kl type {kind!r} is unknown; expected one of {', '.join(KLType)} (or one with a '+')"
        raise ValueError(message) from None
    return estimator, straight and estimator != KLEstimator.K2
