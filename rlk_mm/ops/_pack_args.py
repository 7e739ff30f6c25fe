"""Argument checks of the packing entry points, beyond ``schema.checks``: a tensor
pack/unpad copies, and a fill value of a dtype."""

from __future__ import annotations

import math
import numbers
import torch

from ..schema.checks import tensor_arg

Tensor = torch.Tensor

#: the dtypes pack/unpad copies
DTYPES = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)
DTYPE_NAMES = ", ".join(str(d).replace("torch.", "") for d in DTYPES)


def data_arg(name: str, value, min_dim: int, layout: str) -> Tensor:
    """``value``: a tensor of ``min_dim`` or more dims (``layout``, e.g. "[T, *]") and a dtype pack/unpad copies."""
    value = tensor_arg(name, value)
    if value.dim() < min_dim:
        raise ValueError(f"{name} must be a {layout} tensor ({min_dim}-D or more), got shape {tuple(value.shape)}")
    if value.dtype not in DTYPES:
        raise TypeError(f"{name} is {value.dtype}; pack/unpad copies {DTYPE_NAMES}")
    return value


def fill_arg(fill, dtype: torch.dtype) -> float:
    """``fill`` as a float that is a value of ``dtype``: exact for integer dtypes (within
    ±2**53, what a float carries exactly); for float dtypes NaN and ±inf are values, a finite
    number that rounds to inf is not."""
    if isinstance(fill, bool) or not isinstance(fill, numbers.Real):
        raise TypeError(f"fill must be an int or float, got {type(fill).__name__} {fill!r}")
    try:
        value = float(fill)
    except OverflowError:  # an int beyond any float
        value = math.inf
    if dtype.is_floating_point:
        fits = not math.isfinite(value) or math.isfinite(torch.tensor(value, dtype=torch.float64).to(dtype).item())
    else:
        low, high = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
        fits = math.isfinite(value) and value == int(value) and low <= int(value) <= high and abs(value) <= 2**53
    if not fits:
        within = "" if dtype.is_floating_point else " (integers within ±2**53)"
        raise ValueError(f"fill {fill!r} is not a value of {dtype}{within}")
    return value
