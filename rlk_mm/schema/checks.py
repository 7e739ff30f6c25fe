"""Argument checks shared by the public entry points of rlk_mm.

Every public function checks its arguments before any work and raises an error that
names the argument (and, where the value has them, the sample and the position) and says
what to change. These helpers are the common part:

- ``tensor_arg`` / ``int_arg`` / ``float_arg`` / ``bool_arg``: type, shape, dtype and range
  of one argument, read on the host (no device sync);
- ``sequence_arg`` / ``sample_index`` / ``sample_indices`` / ``group_id_list`` /
  ``device_arg``: lists, indices, group ids and devices, with no silent coercion;
- ``DeviceChecks``: checks of tensor *values* (finiteness, ranges, order) gathered as
  device flags and read with one host sync (together with any integer values the caller
  needs, e.g. an output size), so a call validates in one round trip; the error message
  is built only when a check fails.

Nothing is coerced silently: a float tensor is not an id tensor, a bool is not an int,
a string is not a sequence of ids.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Iterable, NoReturn, Optional, Sequence

import numpy as np
import torch

__all__: list[str] = []

Tensor = torch.Tensor

INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
#: the floating dtypes the kernels take (they accumulate in float32; float64 is for references)
KERNEL_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the smallest sampling temperature: below it samplers decode greedily (vLLM), and
#: logits / temperature can overflow float32
MIN_TEMPERATURE = 1e-5


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return "/".join(str(d).replace("torch.", "") for d in dtypes)


def tensor_arg(
    name: str,
    value,
    *,
    ndim: Optional[int | Sequence[int]] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    device: Optional[torch.device] = None,
    error: type[Exception] = ValueError,
) -> Tensor:
    """``value`` itself when it is a tensor of the given rank, shape (None: any size on that
    axis), dtype and device; else ``error`` (``TypeError`` for a non-tensor or a wrong dtype)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            want = " or ".join(f"{d}-D" for d in allowed)
            raise error(f"{name} must be {want}, got shape {tuple(value.shape)}")
    if shape is not None:
        if value.dim() != len(shape) or any(s is not None and s != v for s, v in zip(shape, value.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise error(f"{name} must have shape {want}, got {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name} must be {_dtype_names(dtypes)}, got {value.dtype}")
    if device is not None and value.device != torch.device(device):
        raise error(f"{name} is on {value.device}; expected {torch.device(device)} like the other inputs")
    return value


def int_arg(name: str, value, *, min: Optional[int] = None, max: Optional[int] = None) -> int:
    """``value`` as an ``int`` (Python or 0-d integer tensor/numpy integer; never a bool or a
    float), within ``[min, max]``."""
    if isinstance(value, Tensor) and value.dim() == 0 and value.dtype in INTEGER_DTYPES:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if (min is not None and value < min) or (max is not None and value > max):
        raise ValueError(f"{name}={value} is out of range: it must be {_range_text(min, max)}")
    return value


def float_arg(
    name: str,
    value,
    *,
    min: Optional[float] = None,
    max: Optional[float] = None,
    min_open: bool = False,
    finite: bool = True,
) -> float:
    """``value`` as a ``float`` (a real number, not a bool), finite unless ``finite=False``,
    within ``[min, max]`` (``(min, max]`` with ``min_open``)."""
    if isinstance(value, Tensor) and value.dim() == 0 and value.dtype.is_floating_point:
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{name}={value} must be a finite number")
    low_bad = min is not None and (value <= min if min_open else value < min)
    if low_bad or (max is not None and value > max):
        raise ValueError(f"{name}={value} is out of range: it must be {_range_text(min, max, min_open)}")
    return value


def pad_token_arg(name: str, value, batch) -> int:
    """A pad token id for ``batch`` (an ``RLBatch``): an int >= 0 (never a bool or a float) that is
    not one of the batch's media placeholders (``image_token_id``, ``video_token_id``). The model
    counts every placeholder token as a media item's token, so padding written with one would
    misplace the vision features (or fail inside the model)."""
    value = int_arg(name, value, min=0, max=2**63 - 1)
    for field, label in (("image_token_id", "image"), ("video_token_id", "video")):
        if value == getattr(batch, field, None):
            raise ValueError(f"{name}={value} is the batch's {label} placeholder token ({field}): the model would count "
                             f"padding written with it as {label} tokens and misplace the vision features; pass the "
                             "tokenizer's pad token (tokenizer.pad_token_id) or another id that is no media placeholder")
    return value


def bool_arg(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def sequence_arg(name: str, value, what: str, *, ordered: bool = False) -> Sequence:
    """``value`` as a list: a list, tuple, range or other iterable, but never a str, bytes,
    dict or a single object that happens to iterate (``what`` names the expected items). With
    ``ordered`` (the items' order means something: one per sample, per item, ...) a set is
    refused too: it has no order, and drops repeats."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of {what}, got {type(value).__name__}")
    if ordered and isinstance(value, (set, frozenset)):
        raise TypeError(f"{name} must be a list of {what}, got {type(value).__name__}: a set has no order (and holds no "
                        "repeats); pass a list in the intended order")
    return list(value)


def readable(name: str, value: Tensor) -> Tensor:
    """``value`` itself unless it is on the meta device, which holds no values to check or read."""
    if value.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no values to check or read: pass a tensor with "
                         "values (on the CPU or a GPU)")
    return value


def describe(value) -> str:
    """A value for an error message: its type and repr ("None" for None)."""
    return "None" if value is None else f"{type(value).__name__} {value!r}"


def group_id_list(value, name: str = "group_ids") -> list:
    """Group ids (str or int) from a list, a numpy array (verl's ``uid``) or a 1-D integer
    tensor. None, floats (nan never equals itself), bools and a mix of str and int ids are refused."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        items = value.tolist()
    else:
        items = sequence_arg(name, value, "group ids (str or int) or a 1-D tensor/array", ordered=True)
    for i, g in enumerate(items):
        if isinstance(g, bool) or not isinstance(g, (str, numbers.Integral)):
            raise TypeError(f"{name}[{i}] is {describe(g)}; a group id is a str or an int")
        if isinstance(g, str) != isinstance(items[0], str):
            raise TypeError(f"{name} mixes str and int ids ({name}[0] is {describe(items[0])}, {name}[{i}] is "
                            f"{describe(g)}): 1 and '1' would be one group in a batch and two in group_seeds; give "
                            "every id one type")
    return items


def sample_indices(value, count: int, owner: str) -> list[int]:
    """Sample indices ``[0, count)`` from a list of ints, a 1-D integer tensor or numpy array.

    A bool mask, floats or a str are refused (each would select other samples than meant);
    ``owner`` ("batch" or "table") names what the indices select from."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        dtype = value.dtype
        if dtype in (torch.bool, np.bool_):
            raise TypeError("indices is a bool tensor (a mask): pass sample indices, e.g. torch.nonzero(mask).flatten()")
        if value.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {tuple(value.shape)}")
        if not (dtype in INTEGER_DTYPES or (isinstance(dtype, np.dtype) and np.issubdtype(dtype, np.integer))):
            raise TypeError(f"indices must be integers, got dtype {dtype}")
        items = value.tolist()
    else:
        items = sequence_arg("indices", value, "sample indices or a 1-D integer tensor", ordered=True)
    out = []
    for i, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise TypeError(f"indices[{i}] is {describe(item)}; sample indices are ints")
        if not 0 <= item < count:
            raise IndexError(f"indices[{i}] is {item}; the {owner} has {count} samples (indices 0..{count - 1})")
        out.append(int(item))
    return out


def sample_index(value, count: int, owner: str) -> int:
    """One sample index in ``[0, count)`` (an int, never a bool or float)."""
    b = value if type(value) is int else int_arg("sample", value)
    if not 0 <= b < count:
        raise IndexError(f"sample {b} is out of range for a {owner} of {count} samples")
    return b


def device_arg(value) -> torch.device:
    """``value`` (a device, a string such as "cuda:0", or a CUDA index) as a ``torch.device``
    that exists on this machine."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={value!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:1')") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={value!r}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device={value!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _range_text(low, high, low_open: bool = False) -> str:
    if low is not None and high is not None:
        return f"{'>' if low_open else '>='} {low} and <= {high}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    return f"<= {high}"


class DeviceChecks:
    """Value checks of device tensors, read with one host sync.

    ``add(bad, fail)``: ``bad`` is a 0-d bool tensor (True means the check failed) and
    ``fail()`` raises the error, naming argument, sample and position (it may read the
    device: it runs only on failure). ``run(*values)`` reads every flag, and the 0-d
    integer ``values`` the caller needs, at once; it calls the ``fail`` of the first failed
    check, else returns the values as ints. With nothing to read, it costs nothing."""

    def __init__(self):
        self._flags: list[Tensor] = []
        self._fails: list[Callable[[], NoReturn]] = []

    def add(self, bad: Tensor, fail: Callable[[], NoReturn]) -> None:
        self._flags.append(bad.reshape(()).to(torch.bool))
        self._fails.append(fail)

    def run(self, *values: Tensor) -> list[int]:
        wanted = [f.long() for f in self._flags] + [v.reshape(()).long() for v in values]
        if not wanted:
            return []
        read = torch.stack([w.to(wanted[0].device) for w in wanted]).tolist()  # the one sync
        for bad, fail in zip(read, self._fails):
            if bad:
                fail()
                raise AssertionError("a DeviceChecks fail() returned instead of raising")  # a bug in rlk_mm
        return read[len(self._flags):]


def first_true(mask: Tensor) -> tuple[int, ...]:
    """The index of the first True entry of ``mask`` (row-major), for error messages."""
    return tuple(int(i) for i in torch.nonzero(mask)[0].tolist())


def temperature_arg(value) -> float:
    """A sampling temperature (a number or a 0-d float tensor; never a bool or a string) as a
    float >= ``MIN_TEMPERATURE``: the one rule of every op and runner that divides logits by it."""
    if isinstance(value, Tensor) and value.dim() == 0 and value.is_floating_point():
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"temperature must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value >= MIN_TEMPERATURE):
        raise ValueError(
            f"temperature must be a finite number >= {MIN_TEMPERATURE}; got {value} (logits are divided by it; "
            "1.0 leaves them as they are; for greedy decoding, temperature 0, take logits.argmax(-1) instead of sampling)"
        )
    return value
