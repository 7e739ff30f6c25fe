"""Batch-invariant RMSNorm with transformers' Qwen semantics (one fixed reduction tree per row)."""

from __future__ import annotations

import torch

from ...schema.checks import KERNEL_FLOAT_DTYPES, float_arg, tensor_arg
from .._torch import invariant as _ref
from ._dispatch import through_op, triton_for

__all__: list[str] = []


def _rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, use_triton: bool) -> torch.Tensor:
    if use_triton:
        from .._triton.rmsnorm import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps)
    return _ref.rms_norm(x, weight, eps)


_rms_norm_op = torch.library.custom_op("rlk_mm::bi_rms_norm", _rms_norm_impl, mutates_args=())


@_rms_norm_op.register_fake
def _(x, weight, eps, use_triton):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_backward(ctx, grad):
    """Closed-form gradient in fp32 (the rounding to the input dtype is passed straight through)."""
    x, weight = ctx.saved_tensors
    xf, g = x.float(), grad.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
    y = xf * r
    gy = g * weight.float()
    dx = r * (gy - y * (gy * y).mean(-1, keepdim=True))
    dw = (g * y).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype), None, None


_rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Batch-invariant RMSNorm with transformers' Qwen semantics (weight [H] over x [..., H]'s
    last dim, ``eps`` >= 0). Shapes are checked on the host; NaN and inf in a row propagate
    to that row only."""
    tensor_arg("x", x, dtypes=KERNEL_FLOAT_DTYPES)
    tensor_arg("weight", weight, dtypes=KERNEL_FLOAT_DTYPES, device=x.device)
    if x.dim() < 1:
        raise ValueError(f"rms_norm: x must be [..., H] (1-D or more), got shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")
    eps = float_arg("eps", eps, min=0)
    op = _rms_norm_op if through_op(x, weight) else _rms_norm_impl
    return op(x, weight, eps, triton_for(x))
