"""Which backend runs an op: the one resolver every op, the sampler and ``batch_invariant()`` use.

Triton on CUDA tensors, torch elsewhere. ``RLK_MM_BACKEND=torch`` or ``=triton`` forces one
for every op; an op's ``backend=`` argument (``sample``, ``batch_invariant``) forces one for
that call. Forcing Triton on CPU tensors works only under ``TRITON_INTERPRET=1`` (Triton's
interpreter; slow, for tests); otherwise ``BackendUnavailableError``, the one error type for
a backend that cannot run here. A name that is no backend is a ``ValueError`` naming the
argument (or the environment variable).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..schema import Choice
from .options import Backend

__all__ = [
    "Backend", "BackendUnavailableError", "backend_arg", "backend_name", "readable_args", "resolve_backend",
    "triton_interpreting", "use_triton",
]

#: the backends ``RLK_MM_BACKEND`` and most ``backend=`` arguments take
OP_BACKENDS = (Backend.TORCH, Backend.TRITON)


class BackendUnavailableError(RuntimeError, ValueError):
    """A backend that cannot run here: Triton on CPU tensors without ``TRITON_INTERPRET=1``.

    A ``RuntimeError`` and a ``ValueError`` both, as the places that raised this condition
    before raised one or the other."""


def _choices_text(allowed: tuple[Choice, ...]) -> str:
    names = ["None"] + [repr(m.value) for m in allowed]
    return ", ".join(names[:-1]) + " or " + names[-1]


def backend_arg(value, argument: str = "backend", allowed: tuple[Backend, ...] = OP_BACKENDS) -> Backend:
    """A ``backend=`` argument as a member: None (or ``"auto"``) is ``Backend.AUTO``; else one of
    ``allowed``; anything else a ``ValueError`` naming ``argument``."""
    if value is None:
        return Backend.AUTO
    try:
        member = Backend(value)
    except (ValueError, TypeError):
        member = None
    if member is Backend.AUTO or member in allowed:
        return member
    raise ValueError(f"{argument}={value!r}: backend must be {_choices_text(allowed)} "
                     "(None: RLK_MM_BACKEND, else Triton on CUDA and torch elsewhere)")


def backend_name() -> Backend:
    """The backend ``RLK_MM_BACKEND`` asks for (``Backend.AUTO`` when unset)."""
    value = os.environ.get("RLK_MM_BACKEND", "auto").strip().lower() or "auto"
    try:
        member = Backend(value)
    except ValueError:
        member = None
    if member is Backend.AUTO or member in OP_BACKENDS:
        return member
    raise ValueError(f"RLK_MM_BACKEND={value!r}: expected one of auto, torch, triton")


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: Optional[Backend] = Backend.AUTO, *, on_cuda: bool, source: Optional[str] = None,
                    environment: bool = True) -> Backend:
    """The backend to run: ``backend`` (a checked member, see ``backend_arg``), where it is
    ``AUTO`` ``RLK_MM_BACKEND`` (unless ``environment=False``), where that is ``AUTO`` Triton
    ``on_cuda`` and torch otherwise. Triton without CUDA needs the interpreter, else
    ``BackendUnavailableError``; ``source`` names where the choice came from in that error
    (default: ``backend='triton'``, or ``RLK_MM_BACKEND='triton'``)."""
    chosen = Backend.AUTO if backend is None else backend
    if chosen is Backend.AUTO and environment:
        chosen = backend_name()
        source = source or "RLK_MM_BACKEND='triton'"
    if chosen is Backend.AUTO:
        return Backend.TRITON if on_cuda else Backend.TORCH
    if chosen is Backend.TRITON and not on_cuda and not triton_interpreting():
        raise BackendUnavailableError(
            f"{source or 'backend=' + repr('triton')} on CPU tensors needs TRITON_INTERPRET=1 (set it before rlk_mm is "
            "imported), or move the tensors to CUDA"
        )
    return chosen


def readable_args(op: str, **tensors) -> None:
    """Refuses, by name, a tensor among ``tensors`` on the meta device: ``op`` reads its inputs'
    values (to check them, or to size its output) and a meta tensor holds none (the error
    from inside torch said only that it could not copy). Non-tensors are left to the op's checks."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device, which holds no values: {op} computes with its inputs' "
                             "values and checks them; pass tensors with data")


def use_triton(*tensors: Optional[torch.Tensor]) -> bool:
    """True when the op should run its Triton kernel for these tensors (``RLK_MM_BACKEND``, then the device)."""
    on_cuda = any(t is not None and t.is_cuda for t in tensors)
    return resolve_backend(on_cuda=on_cuda) is Backend.TRITON
