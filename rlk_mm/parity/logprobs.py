"""Log-prob comparison between a rollout and a trainer, gated by layout parity.

A log-prob, KL or ratio comparison between two different token layouts is meaningless,
so ``compare_logprobs`` refuses (``LayoutParityError``) unless the layouts match.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from ..counts import plural
from ..schema import RLBatch
from ..schema.batch import batch_arg
from ..schema.checks import first_true, float_arg, tensor_arg
from .contract import LOGPROB_MAX_ABS
from .layout import LayoutParityError, check_layout_parity

__all__ = ["compare_logprobs", "LogprobComparison"]

#: importance ratios outside 1 ± this are counted (the PPO clip range's usual size)
RATIO_BAND = 0.2


@dataclass
class LogprobComparison:
    """Differences of two log-prob tensors over the same loss tokens."""

    tolerance: float
    num_tokens: int
    max_abs: float
    mean_abs: float
    per_sample_max_abs: list[float] = field(default_factory=list)
    per_sample_mean_abs: list[float] = field(default_factory=list)
    first_beyond: Optional[dict] = None  # sample, position, rollout, training, abs_diff
    ratio_min: float = 1.0
    ratio_max: float = 1.0
    ratio_outside_band: float = 0.0

    @property
    def ok(self) -> bool:
        return self.first_beyond is None

    def to_dict(self) -> dict:
        return {"ok": self.ok, **asdict(self)}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        head = "log-prob parity OK" if self.ok else "log-prob parity FAILED"
        text = (
            f"{head}: {plural(self.num_tokens, 'token')}, max |Δ| {self.max_abs:.3g}, mean |Δ| {self.mean_abs:.3g} "
            f"(tolerance {self.tolerance:g}); ratio exp(Δ) in [{self.ratio_min:.4f}, {self.ratio_max:.4f}], "
            f"{100 * self.ratio_outside_band:.2f}% outside 1±{RATIO_BAND}"
        )
        if self.first_beyond:
            f = self.first_beyond
            text += (
                f"\n  first token beyond tolerance: sample {f['sample']}, position {f['position']}: "
                f"rollout {f['rollout']:.6g} vs training {f['training']:.6g} (|Δ| {f['abs_diff']:.3g})"
            )
        return text


def _flat(values, batch: RLBatch, name: str) -> torch.Tensor:
    """Loss-token log-probs as fp64 ``[n]`` on the CPU (loss-span order), from ``[n]`` or padded
    ``[B, R]`` over the responses (column ``c`` of row ``b``: the token at ``prompt_lengths[b] + c``)."""
    values = tensor_arg(name, values)
    if not values.dtype.is_floating_point:
        raise TypeError(f"{name} must be float log-probs, got {values.dtype}")
    n = int(batch.loss_spans.lengths().sum())
    sample, pos, _ = batch.loss_spans.token_positions()
    if values.dim() == 1:
        if values.numel() != n:
            raise ValueError(f"{name} has {values.numel()} values; the batch has {n} loss tokens")
        flat = values
    elif values.dim() == 2:
        if values.shape[0] != batch.num_samples:
            raise ValueError(f"{name} has {values.shape[0]} rows; the batch has {batch.num_samples} samples")
        if batch.prompt_lengths is None:
            raise ValueError(f"{name}: a [B, R] tensor needs the batch's prompt_lengths (column c of row b is the token at "
                             "prompt_lengths[b] + c); give [n] loss-token log-probs instead")
        col = pos - batch.prompt_lengths.to(pos.device)[sample]
        if n and int(col.max()) >= values.shape[1]:
            raise ValueError(f"{name} has {values.shape[1]} response columns; loss tokens reach column {int(col.max())}")
        flat = values[sample.to(values.device), col.to(values.device)]
    else:
        raise ValueError(f"{name} has shape {tuple(values.shape)}; expected [n loss tokens] or [B, R] over the responses")
    flat = flat.detach().double().cpu()
    bad = torch.isnan(flat) | (flat > 0)
    if bool(bad.any()):
        (k,) = first_true(bad)
        v = float(flat[k])
        raise ValueError(f"{name}: sample {int(sample[k])}, position {int(pos[k])} is {v:.6g}{' > 0' if v > 0 else ''}: log-probs "
                         "are numbers <= 0 (-inf allowed); pass log-probabilities, not probabilities or logits")
    return flat


def compare_logprobs(
    rollout_logprobs: torch.Tensor,
    training_logprobs: torch.Tensor,
    rollout: RLBatch,
    training: RLBatch,
    *,
    dtype: torch.dtype = torch.float32,
    tolerance: Optional[float] = None,
    tokenizer=None,
) -> LogprobComparison:
    """Compare log-probs of the same loss tokens; refuses (``LayoutParityError``) unless the layouts match.

    Each log-prob tensor is ``[n]`` (loss-span order, what ``selected_logprob`` returns) or
    ``[B, R]`` right-padded over the responses (verl's layout: column ``c`` of row ``b`` is
    the token at ``prompt_lengths[b] + c``; padding entries are never read). Log-probs must
    be <= 0 and not NaN (an error names the sample and position); -inf is a value: equal on
    both sides it agrees, else its |Δ| is inf. ``dtype`` is the models' compute dtype and
    picks the contract's tolerance (fp32: 1e-5, bf16/fp16: 2e-3) unless ``tolerance`` (>= 0)
    is given.
    """
    batch_arg("rollout", rollout)
    batch_arg("training", training)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a torch floating dtype (the models' compute dtype, e.g. torch.bfloat16), got {dtype!r}")
    tol = LOGPROB_MAX_ABS.for_dtype(dtype) if tolerance is None else float_arg("tolerance", tolerance, min=0)
    for name, values in (("rollout_logprobs", rollout_logprobs), ("training_logprobs", training_logprobs)):
        tensor_arg(name, values)
        if values.is_meta:
            raise ValueError(f"{name} is on the meta device (no data to compare); pass the log-probs as a CPU or CUDA tensor")
    report = check_layout_parity(rollout, training, tokenizer=tokenizer)
    if not report.ok:
        raise LayoutParityError(report)
    a = _flat(rollout_logprobs, rollout, "rollout_logprobs")
    b = _flat(training_logprobs, training, "training_logprobs")
    sample, pos, _ = training.loss_spans.token_positions()
    sample, pos = sample.cpu(), pos.cpu()
    same = a == b  # equal infinities agree
    diff = torch.where(same, 0.0, (b - a).abs())
    B = training.num_samples
    counts = torch.bincount(sample, minlength=B).double()
    per_max = torch.zeros(B, dtype=torch.float64).scatter_reduce_(0, sample, diff, reduce="amax", include_self=False)
    per_mean = torch.zeros(B, dtype=torch.float64).index_add_(0, sample, diff) / counts.clamp(min=1)
    beyond = torch.nonzero(diff > tol).flatten()
    first = None
    if beyond.numel():
        k = int(beyond[0])
        first = dict(sample=int(sample[k]), position=int(pos[k]), rollout=float(a[k]), training=float(b[k]), abs_diff=float(diff[k]))
    ratio = torch.where(same, 1.0, torch.exp(b - a))
    n = diff.numel()
    return LogprobComparison(
        tolerance=tol,
        num_tokens=n,
        max_abs=float(diff.max()) if n else 0.0,
        mean_abs=float(diff.mean()) if n else 0.0,
        per_sample_max_abs=per_max.tolist(),
        per_sample_mean_abs=per_mean.tolist(),
        first_beyond=first,
        ratio_min=float(ratio.min()) if n else 1.0,
        ratio_max=float(ratio.max()) if n else 1.0,
        ratio_outside_band=float(((ratio - 1).abs() > RATIO_BAND).double().mean()) if n else 0.0,
    )
