"""``batch_invariant()``: inside the block a transformers forward gives bitwise the same
results for a sequence however it is batched, padded, packed or cached.

Inside the block:

* ``aten::mm``, ``addmm``, ``bmm``, ``baddbmm`` and patch-embedding ``convolution`` on
  the CPU and CUDA dispatch keys run ``matmul.matmul``, whose tiles depend on the weight
  shape only. Only the forward is pinned: the products the autograd engine issues during
  a backward take the stock kernels (cuBLAS / MKL), and the attention's gradient is torch's
  fused SDPA backward (``attention``), both within the numerical contract.
* transformers' attention registry entries ``sdpa`` and ``eager`` (and their mask
  functions) run ``attention.segment_attention``: the 4-D mask is turned into
  per-sequence segments, and key tiles start at each sequence's first key.
* model classes get the patches their model module registered with
  ``register_module_patches`` (``rlk_mm.models.qwen2_5_vl``: Qwen2.5-VL's RMSNorm, vision
  attention and shared-input projections).

Everything is restored exactly when the block exits. The LM head is not here: score
tokens with ``selected_logprob`` (its reduction order is fixed by H, V and dtype).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Optional

import torch

from .._backend import backend_arg, backend_name, resolve_backend
from ..options import Backend
from ._dispatch import SEGMENT_CACHE, STATE
from .attention import attention_interface, full_bool_mask
from .matmul import ATEN_OVERRIDES

__all__ = ["batch_invariant"]

#: (class, attribute, replacement) triples that ``batch_invariant()`` sets while active
ModulePatches = list[tuple[type, str, object]]
#: the values of ``batch_invariant(backend=...)``
BACKENDS = (None, Backend.TORCH, Backend.TRITON)
_MODULE_PATCHES: list[Callable[[], ModulePatches]] = []


def register_module_patches(provider: Callable[[], ModulePatches]) -> None:
    """Have ``batch_invariant()`` apply ``provider()``'s patches to model classes while active.

    A model module registers its classes' batch-invariant forwards this way (ops never
    import a model); ``import rlk_mm`` imports ``rlk_mm.models``, so they are always known."""
    if provider not in _MODULE_PATCHES:
        _MODULE_PATCHES.append(provider)


def _registries():
    try:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return []
    return [(AttentionInterface, attention_interface), (AttentionMaskInterface, full_bool_mask)]


_MISSING = object()


@contextlib.contextmanager
def batch_invariant(backend: Backend | str | None = None):
    """Route matmuls, attention and RMSNorm through batch-invariant kernels inside the block.

    ``backend`` (a ``Backend`` or its string): None (Triton on CUDA, torch on CPU;
    ``RLK_MM_BACKEND`` forces one), ``"triton"`` or ``"torch"``; checked on entry, with
    ``RLK_MM_BACKEND`` (Triton needs CUDA or ``TRITON_INTERPRET=1``:
    ``BackendUnavailableError``). Not re-entrant; restores every override on exit.
    """
    chosen = backend_arg(backend, "backend", BACKENDS[1:])
    source = "batch_invariant(backend='triton')"
    if chosen is Backend.AUTO:
        chosen, source = backend_name(), "batch_invariant() with RLK_MM_BACKEND='triton'"
    if chosen is Backend.TRITON:  # the kernels run where the model is: refused here unless CUDA or the interpreter
        resolve_backend(chosen, on_cuda=torch.cuda.is_available(), source=source, environment=False)
    if STATE.active:
        raise RuntimeError("batch_invariant() is already active in this thread (it is not re-entrant)")
    lib = torch.library.Library("aten", "IMPL")
    saved: list[tuple[object, str, object]] = []
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
            warnings.filterwarnings("ignore", message=".*Warning only once for all operators.*")
            for op, fn in ATEN_OVERRIDES.items():
                for key in ("CPU", "CUDA"):
                    lib.impl(op, fn, key)
        for registry, fn in _registries():
            mapping = registry._global_mapping
            for name in ("sdpa", "eager"):
                saved.append((mapping, name, mapping.get(name, _MISSING)))
                mapping[name] = fn
        for cls, attr, fn in (patch for provider in _MODULE_PATCHES for patch in provider()):
            saved.append((cls, attr, cls.__dict__.get(attr, _MISSING)))
            setattr(cls, attr, fn)
        STATE.active, STATE.backend = True, chosen
        yield
    finally:
        STATE.active, STATE.backend = False, None
        SEGMENT_CACHE.clear()
        for target, name, old in reversed(saved):
            if isinstance(target, dict):
                if old is _MISSING:
                    target.pop(name, None)
                else:
                    target[name] = old
            elif old is _MISSING:
                delattr(target, name)
            else:
                setattr(target, name, old)
        lib._destroy()


@contextlib.contextmanager
def stock_kernels():
    """Inside ``batch_invariant()``, run the block's matmuls with the stock kernels.

    For ops that fix their own reduction order and must give the same bits inside and
    outside the mode: the LM-head ops (``selected_logprob``, ``linear_policy_loss``,
    ``sample_from_hidden``) multiply fixed-shape, zero-padded row chunks, batch-invariant by
    construction; routed through the mode's per-row product they would be slower and round
    differently from the same call outside the mode, so they enter this block themselves.
    Nests; a no-op outside ``batch_invariant()``."""
    STATE.stock += 1
    try:
        yield
    finally:
        STATE.stock -= 1


def batch_invariant_active() -> bool:
    """Whether a ``batch_invariant()`` block is active (the mode is process-wide)."""
    return STATE.active


def active_backend() -> Optional[str]:
    """The backend the active ``batch_invariant()`` block was given (``"torch"``, ``"triton"``,
    or None: Triton on CUDA tensors, torch elsewhere); None outside a block too."""
    return None if STATE.backend is None else str(STATE.backend)


def within_batch_invariant(backend: Backend | str | None = None):
    """``batch_invariant(backend)``, or nothing inside an active block (which then decides the
    backend): for code that needs the mode and may be called from inside it (the mode is not
    re-entrant)."""
    return contextlib.nullcontext() if STATE.active else batch_invariant(backend)

