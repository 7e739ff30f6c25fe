"""The loss ops' tensor arguments, checked: the token layout (padded ``[B, R]`` or compact
``[n]`` with ``sample_index``), the mask and the constant inputs (their values gathered into
the call's one host sync), and a config's aggregation for a layout (``PolicyLossConfig``
checks the knobs themselves). Errors name the argument, and for a value its sample and
position, and say what to change."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ...schema.checks import FLOAT_DTYPES, INTEGER_DTYPES, DeviceChecks, first_true, int_arg, tensor_arg
from ..options import AggMode
from .config import SEQ_MODES, PolicyLossConfig

__all__: list[str] = []


#: the most samples a batch has (its ``cu_seqlens`` are int32; the seq modes take a value per sample)
MAX_SAMPLES = 2**31 - 1


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
    num_samples = int_arg("num_samples", num_samples, min=0, max=MAX_SAMPLES)
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


def add_count_check(name: str, value, checks: DeviceChecks) -> None:
    """A global count given as a 0-d tensor (``PolicyLossConfig`` checked its type): its value,
    a finite number >= 0, goes to ``checks``."""
    if not isinstance(value, Tensor):
        return

    def fail():
        raise ValueError(f"{name} is {value.item()}; a count must be a finite number >= 0")

    checks.add(~((value >= 0) & (value < math.inf)), fail)


# ----------------------------------------------------------------------------- aggregation
#: a global count may fall short of this batch's float32 mask sum by this share of it (its
#: rounding: exact below 2^22 tokens for 0/1 masks) ...
COUNT_ROUNDING = 2.0**-22
#: ... and, for a float mask (weights), by this share (the caller summed the weights in another order)
WEIGHTED_COUNT_SLACK = 1e-5


@dataclass(frozen=True)
class Agg:
    """A checked aggregation: the mode, dp_size, the global counts and the ``-norm`` divisor;
    ``slack``: the share of this batch's mask sum a global token count may fall short of it by."""

    mode: AggMode
    dp_size: int
    batch_num_tokens: Optional[float | Tensor]
    global_batch_size: Optional[float | Tensor]
    norm: float
    slack: float = COUNT_ROUNDING


def agg_args(layout: Layout, checks: DeviceChecks, config: PolicyLossConfig, mask: Optional[Tensor] = None, *,
             check_counts: bool = True) -> Agg:
    """``config``'s aggregation for this layout and ``mask`` (its tensor counts' values go to
    ``checks``). The global count the mode uses (``batch_num_tokens`` for ``token-mean``,
    ``global_batch_size`` for the ``seq-mean-*`` modes) is at least what this batch shows, before
    the ``dp_size`` factor: the mask's sum, the sequences with a scored token; a count of
    sequences is an integer. With ``check_counts`` that goes to ``checks`` too (the caller reads
    them anyway); either way ``aggregation`` turns a contradicted count into NaN."""
    add_count_check("batch_num_tokens", config.batch_num_tokens, checks)
    add_count_check("global_batch_size", config.global_batch_size, checks)
    mode, loss_scale_factor = config.loss_agg_mode, config.loss_scale_factor
    norm = 1.0
    if mode is AggMode.SEQ_MEAN_TOKEN_SUM_NORM:
        if loss_scale_factor is None and not layout.padded:
            raise ValueError(
                "loss_scale_factor is required for seq-mean-token-sum-norm on compact inputs "
                "(verl's default is the padded response length)"
            )
        norm = layout.row_length if loss_scale_factor is None else loss_scale_factor
    weighted = mask is not None and mask.is_floating_point()
    slack = WEIGHTED_COUNT_SLACK if weighted else COUNT_ROUNDING
    if mode is AggMode.TOKEN_MEAN and config.batch_num_tokens is not None and check_counts:
        _add_token_count_check(checks, config.batch_num_tokens, _mask_sum(layout, mask), slack)
    if mode in SEQ_MODES and config.global_batch_size is not None:
        _integer_count("global_batch_size", config.global_batch_size, checks)
        if check_counts:
            _add_sequence_count_check(checks, config.global_batch_size, _present(layout, mask))
    return Agg(mode, config.dp_size, config.batch_num_tokens, config.global_batch_size, norm, slack)


def _mask_sum(layout: Layout, mask: Optional[Tensor]) -> Tensor:
    if mask is None:
        return torch.tensor(float(layout.shape.numel()), device=layout.device)
    return mask.reshape(-1).to(torch.float32).sum()


def _present(layout: Layout, mask: Optional[Tensor]) -> Tensor:
    """The number of sequences with a scored token (float32, 0-d)."""
    n = layout.shape.numel()
    m = torch.ones(n, device=layout.device) if mask is None else mask.reshape(-1).to(torch.float32)
    return (layout.seq_sum(m) > 0).sum().to(torch.float32)


def _add_token_count_check(checks: DeviceChecks, count, total: Tensor, slack: float) -> None:
    def fail():
        have = total.item()
        raise ValueError(
            f"batch_num_tokens is {float(count)} but this batch alone scores {have:g} tokens (the mask's sum): "
            "token-mean's global count, over every data-parallel rank and before the dp_size factor, is at least "
            "that; pass the global batch's count of scored tokens, or None for this batch's"
        )

    checks.add(torch.as_tensor(count, device=total.device).to(torch.float32) < total * (1.0 - slack), fail)


def _add_sequence_count_check(checks: DeviceChecks, count, present: Tensor) -> None:
    def fail():
        raise ValueError(
            f"global_batch_size is {float(count)} but this batch alone has {present.item():g} sequences with a scored "
            "token: the seq-mean modes' global count, over every data-parallel rank and before the dp_size factor, "
            "is at least that; pass the global batch's count of sequences, or None for this batch's"
        )

    checks.add(torch.as_tensor(count, device=present.device).to(torch.float32) < present, fail)


def _integer_count(name: str, count, checks: DeviceChecks) -> None:
    """A count of sequences is a whole number (a number now; a tensor in ``checks``)."""
    rule = "a count of sequences is a whole number"
    if not isinstance(count, Tensor):
        if count != math.floor(count):
            raise ValueError(f"{name}={count}: {rule}")
        return

    def fail():
        raise ValueError(f"{name} is {count.item()}: {rule}")

    if count.is_floating_point():
        checks.add(count != torch.floor(count), fail)
