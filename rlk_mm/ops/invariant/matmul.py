"""Batch-invariant matmul: ``matmul`` (and the aten overrides that route torch's matmuls
through it inside ``batch_invariant()``), and ``shared_input_linears``.

Triton's persistent matmul (``_triton/matmul.py``) on CUDA, one batched BLAS entry per row
(``_torch/invariant.py``) elsewhere: tiles depend on the weight shape only, so a row's
result does not depend on how many rows there are. Only the forward is pinned: products
the autograd engine issues during a backward take the stock kernels (``in_backward``).
"""

from __future__ import annotations

import torch

from ...schema.checks import KERNEL_FLOAT_DTYPES, float_arg, tensor_arg
from .._torch import invariant as _ref
from ._dispatch import STATE, triton_for

__all__: list[str] = []


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           *, alpha: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """Batch-invariant ``alpha * (a @ b) + beta * bias`` for 2-D or 3-D (batched) a and b of one
    real dtype and device; ``bias`` of that dtype broadcasts to the output (as ``addmm``'s),
    ``alpha`` and ``beta`` finite. Shapes are checked on the host; NaN and inf in the operands
    propagate (each output row from its own input row only). Differentiable: the gradient
    products are stock ones (only the forward is batch-invariant)."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (a, b, bias)):
        return _Product.apply(a, b, bias, alpha, beta)
    return _product(a, b, bias, alpha=alpha, beta=beta)


class _Product(torch.autograd.Function):
    """``matmul`` called directly with tensors that need gradients (the aten overrides run
    below autograd and need no Function)."""

    @staticmethod
    def forward(ctx, a, b, bias, alpha, beta):
        ctx.save_for_backward(a, b)
        ctx.alpha, ctx.beta, ctx.bias_shape = alpha, beta, None if bias is None else bias.shape
        return _product(a, b, bias, alpha=alpha, beta=beta)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        da = db = dbias = None
        if ctx.needs_input_grad[0]:
            da = ctx.alpha * (grad @ b.transpose(-1, -2))
        if ctx.needs_input_grad[1]:
            db = ctx.alpha * (a.transpose(-1, -2) @ grad)
        if ctx.needs_input_grad[2]:
            dbias = ctx.beta * grad.sum_to_size(ctx.bias_shape)
        return da, db, dbias, None, None


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
             *, alpha: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """``matmul`` without autograd: the checks, then the kernel."""
    tensor_arg("a", a)
    tensor_arg("b", b)
    if a.dim() != b.dim() or a.dim() not in (2, 3):
        raise ValueError(f"matmul: expected two 2-D or two 3-D tensors, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-2] or (a.dim() == 3 and a.shape[0] != b.shape[0]):
        raise ValueError(f"matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul: expected both operands of one dtype, got {a.dtype} and {b.dtype}")
    if a.dtype == torch.bool or a.is_complex():
        raise TypeError(f"matmul: {a.dtype} operands are not supported (real floating or integer dtypes)")
    if a.device != b.device:
        raise ValueError(f"matmul: operands on {a.device} and {b.device}")
    alpha, beta = float_arg("alpha", alpha), float_arg("beta", beta)
    out_shape = (*a.shape[:-1], b.shape[-1])
    if bias is not None:
        _check_bias(tensor_arg("bias", bias), a, out_shape)
    if a.numel() == 0 or b.numel() == 0:  # no products to sum: the kernels need a row, a column and K
        out = a.new_zeros(out_shape)
        return out if bias is None or beta == 0 else out + beta * bias
    if a.dtype not in KERNEL_FLOAT_DTYPES or not triton_for(a, b):
        return _ref.matmul(a, b, bias, alpha=alpha, beta=beta)
    from .._triton import matmul as tm

    a3, b3 = (a, b) if a.dim() == 3 else (a[None], b[None])
    bias3 = None
    if bias is not None and beta != 0:
        bias3 = bias if bias.dim() == 3 else bias.reshape((1,) * (3 - bias.dim()) + tuple(bias.shape))
    out = tm.bmm(a3, b3, bias3, alpha=alpha, beta=beta)
    return out if a.dim() == 3 else out[0]


def _check_bias(bias: torch.Tensor, a: torch.Tensor, out_shape: tuple[int, ...]) -> None:
    if bias.dtype != a.dtype:
        raise ValueError(f"matmul: bias is {bias.dtype} but a and b are {a.dtype}")
    if bias.device != a.device:
        raise ValueError(f"matmul: bias is on {bias.device} but a and b are on {a.device}")
    if bias.shape != out_shape[-1:]:  # the common case, [N], needs no broadcast check
        try:
            broadcast = torch.broadcast_shapes(bias.shape, out_shape) == out_shape
        except RuntimeError:
            broadcast = False
        if not broadcast:
            raise ValueError(f"matmul: bias of shape {tuple(bias.shape)} does not broadcast to the output {out_shape}")


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (it sets the
    current graph task for the pass, reentrant and create_graph passes included)."""
    return torch._C._current_graph_task_id() != -1


def _takes_stock(a: torch.Tensor | None = None) -> bool:
    """Whether an overridden product runs the stock kernel: in a backward pass, inside
    ``stock_kernels()``, or, for ``mm``/``bmm`` (``a`` given), with K = 1: one product per
    entry, rounded once, so every kernel gives the same bits (M-RoPE's position x frequency
    product is one, batched over 3 x B)."""
    return STATE.stock > 0 or (a is not None and a.shape[-1] == 1) or in_backward()


# Inside batch_invariant() only the forward is pinned: a product that the autograd engine
# issues while it runs a backward (the gradient formulas of mm/addmm/bmm/baddbmm, and any
# recomputation inside it) takes the stock kernel through its out= overload, which the
# mode does not override. These overrides run below autograd, so create_graph still
# records the backward's own products at the autograd key (double backward works).
def _stock(op, *args, shape, like, **kwargs):
    return op(*args, **kwargs, out=torch.empty(shape, dtype=like.dtype, device=like.device))


def _aten_mm(a, b):
    if _takes_stock(a):
        return _stock(torch.mm, a, b, shape=(a.shape[0], b.shape[1]), like=a)
    return _product(a, b)


def _aten_addmm(bias, a, b, *, beta=1, alpha=1):
    if _takes_stock():
        return _stock(torch.addmm, bias, a, b, beta=beta, alpha=alpha, shape=(a.shape[0], b.shape[1]), like=a)
    return _product(a, b, bias, alpha=alpha, beta=beta)


def _aten_bmm(a, b):
    if _takes_stock(a):
        return _stock(torch.bmm, a, b, shape=(a.shape[0], a.shape[1], b.shape[2]), like=a)
    return _product(a, b)


def _aten_baddbmm(bias, a, b, *, beta=1, alpha=1):
    if _takes_stock():
        return _stock(torch.baddbmm, bias, a, b, beta=beta, alpha=alpha, shape=(a.shape[0], a.shape[1], b.shape[2]),
                      like=a)
    return _product(a, b, bias, alpha=alpha, beta=beta)


def _aten_convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A convolution whose kernel covers its whole input (a patch embedding) as a matmul."""
    if _takes_stock():
        return torch.ops.aten._convolution.default(x, weight, bias, stride, padding, dilation, transposed,
                                                   output_padding, groups, False, False, True, True)
    kernel = tuple(weight.shape[2:])
    if (transposed or groups != 1 or any(padding) or any(d != 1 for d in dilation)
            or tuple(x.shape[2:]) != kernel):
        raise NotImplementedError(
            "batch_invariant() supports convolution only as a patch embedding (input spatial size == "
            f"kernel size {kernel}, no padding, groups=1); got input {tuple(x.shape)}, stride {list(stride)}, "
            f"padding {list(padding)}, groups {groups}"
        )
    out = _product(x.reshape(x.shape[0], -1), weight.reshape(weight.shape[0], -1).t(), bias)
    return out.reshape(x.shape[0], weight.shape[0], *([1] * len(kernel)))


ATEN_OVERRIDES = {
    "mm": _aten_mm,
    "addmm": _aten_addmm,
    "bmm": _aten_bmm,
    "baddbmm": _aten_baddbmm,
    "convolution": _aten_convolution,
}


def _plain_linears(layers) -> bool:
    return all(type(l) is torch.nn.Linear and "forward" not in l.__dict__ for l in layers)


def shared_input_linears(x: torch.Tensor, layers) -> list[torch.Tensor]:
    """``[F.linear(x, l.weight, l.bias) for l in layers]`` for 1-3 ``nn.Linear`` of one input
    (``x``'s last dim their ``in_features``), as one launch where that is bitwise the same
    as running them one by one: a no-grad call on the Triton path, contiguous x, weights
    whose tiles agree (``_triton/matmul.linears``). A launch-bound forward (group scoring)
    saves launches."""
    tensor_arg("x", x)
    if isinstance(layers, torch.nn.Module) or not isinstance(layers, (list, tuple)):
        raise TypeError(f"layers must be a list of torch.nn.Linear, got {type(layers).__name__}")
    if not 1 <= len(layers) <= 3:
        raise ValueError(f"layers must hold 1 to 3 torch.nn.Linear layers, got {len(layers)}")
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.nn.Linear):
            raise TypeError(f"layers[{i}] must be a torch.nn.Linear, got {type(layer).__name__}")
        if x.dim() < 1 or layer.in_features != x.shape[-1]:
            raise ValueError(f"layers[{i}] takes {layer.in_features} input features but x has "
                             f"{x.shape[-1] if x.dim() else 'none'} (shape {tuple(x.shape)})")

    def one_by_one():
        return [torch.nn.functional.linear(x, l.weight, l.bias) for l in layers]

    needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(l.weight.requires_grad for l in layers))
    if (needs_grad or torch.compiler.is_compiling() or not x.is_contiguous() or x.dim() < 2
            or x.dtype not in KERNEL_FLOAT_DTYPES or not triton_for(x)):
        return one_by_one()
    from .._triton import matmul as tm

    out = tm.linears(x.reshape(-1, x.shape[-1]), [l.weight for l in layers], [l.bias for l in layers])
    if out is None:
        return one_by_one()
    parts = out.split([l.weight.shape[0] for l in layers], dim=1)
    return [part.view(*x.shape[:-1], part.shape[1]) for part in parts]


def shared_input_patch(original, names: tuple[str, ...], input_name: str):
    """``original`` (a module's forward) with its sub-layers ``names``, all applied to the
    forward's input, computed together by ``shared_input_linears``. The sub-layers are
    still called (hooks see their outputs); on that input they return what was computed."""

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs[input_name]
        layers = [getattr(self, n) for n in names]
        if not isinstance(x, torch.Tensor) or not _plain_linears(layers):
            return original(self, *args, **kwargs)
        outputs = shared_input_linears(x, layers)
        for layer, out in zip(layers, outputs):
            layer.forward = lambda inp, _layer=layer, _out=out: _out if inp is x else type(_layer).forward(_layer, inp)
        try:
            return original(self, *args, **kwargs)
        finally:
            for layer in layers:
                del layer.forward

    return forward
