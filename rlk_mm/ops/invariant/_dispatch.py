"""What the batch-invariant ops share: the mode's state, the backend choice, the op-call choice,
and the per-forward cache of attention segments.

``STATE`` is process-wide, like the dispatcher overrides ``batch_invariant()`` installs.
"""

from __future__ import annotations

import weakref

import torch

from .._backend import resolve_backend, use_triton
from ..options import Backend

__all__ = ["cached", "SEGMENT_CACHE", "STATE", "through_op", "triton_for"]


class _State:
    """Process-wide, like the dispatcher overrides it mirrors."""

    active = False
    backend: Backend | None = None  # AUTO, TORCH or TRITON while active
    stock = 0  # > 0 inside stock_kernels(): the matmul overrides take the stock kernels


STATE = _State()
SEGMENT_CACHE: dict[int, tuple] = {}


def triton_for(*tensors: torch.Tensor) -> bool:
    """Backend choice of the ops below: inside ``batch_invariant()`` the one resolved when
    the block was entered (its ``backend``, else ``RLK_MM_BACKEND``: no environment lookup
    per op in a launch-bound forward), outside it the env/device."""
    backend = STATE.backend
    if backend is None:
        return use_triton(*tensors)
    on_cuda = any(t.is_cuda for t in tensors)
    chosen = resolve_backend(backend, on_cuda=on_cuda, source="batch_invariant(backend='triton')", environment=False)
    return chosen is Backend.TRITON


def through_op(*tensors: torch.Tensor) -> bool:
    """Whether a call needs the registered custom op (autograd or torch.compile). A no-grad
    eager call runs the same function directly: the op's dispatch costs tens of
    microseconds a call, which a launch-bound forward (a short prompt, one image) feels."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def cached(fn, tensor: torch.Tensor, *args):
    """``fn(tensor, *args)``, computed once per tensor inside batch_invariant(): every layer
    of a forward gets the same mask / cu_seqlens object, and this spares a host sync each."""
    if not STATE.active:
        return fn(tensor, *args)
    key = (id(tensor), *(id(a) if torch.is_tensor(a) else a for a in args))
    check = (tensor._version, *(a._version if torch.is_tensor(a) else a for a in args))
    hit = SEGMENT_CACHE.get(key)
    if hit is not None and hit[0]() is tensor and hit[1] == check:
        return hit[2]
    value = fn(tensor, *args)
    SEGMENT_CACHE[key] = (weakref.ref(tensor), check, value)
    return value
