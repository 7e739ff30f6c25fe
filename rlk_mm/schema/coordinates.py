"""Coordinates: boxes and points with an explicit coordinate system (``CoordinateSystem``).

Coordinates are converted only by explicit calls (``convert_boxes``/``convert_points``),
never implicitly: a box in resized-image pixels is not a box in original pixels.
The conversion is element-wise: non-finite coordinates stay non-finite (nan stays nan,
inf stays inf) and coordinates outside the image are converted like any other. It is exact
at the edges: 0 stays 0 and an image's edge lands on the other system's edge, bitwise.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .checks import FLOAT_DTYPES, INTEGER_DTYPES, int_arg
from .choice import Choice
from .spans import SchemaError

__all__ = ["CoordinateSystem", "convert_boxes", "convert_points"]


class CoordinateSystem(Choice):
    ABSOLUTE = "absolute"  # pixels of the original image
    RESIZED = "resized"  # pixels of the image as the processor resized it
    NORMALIZED = "normalized"  # 0-1
    NORMALIZED_1000 = "normalized_1000"  # 0-1000 (Qwen-VL grounding convention)


def _scale(system: CoordinateSystem, original_size: tuple | None, resized_size: tuple | None) -> torch.Tensor:
    """(sx, sy): multiply normalized-0-1 coordinates by this to get ``system`` coordinates."""
    if system is CoordinateSystem.NORMALIZED:
        return torch.tensor([1.0, 1.0], dtype=torch.float64)
    if system is CoordinateSystem.NORMALIZED_1000:
        return torch.tensor([1000.0, 1000.0], dtype=torch.float64)
    size = original_size if system is CoordinateSystem.ABSOLUTE else resized_size
    if size is None:
        raise SchemaError(
            f"converting {system.value} coordinates needs the "
            f"{'original' if system is CoordinateSystem.ABSOLUTE else 'resized'} image size (width, height)"
        )
    return torch.tensor(size, dtype=torch.float64)


def _coordinates(name: str, value, width: int, layout: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [..., {width}] {layout}, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES + INTEGER_DTYPES:
        raise TypeError(f"{name} must be a real (float or integer) tensor, got {value.dtype}")
    if value.dim() == 0 or value.shape[-1] != width:
        raise SchemaError(f"{name} must have a last dimension of {width} {layout}, got shape {tuple(value.shape)}")
    return value


def _convert(points: torch.Tensor, source, target, original_size, resized_size) -> torch.Tensor:
    source = CoordinateSystem.parse(source, "source", SchemaError)
    target = CoordinateSystem.parse(target, "target", SchemaError)
    sizes = {name: None if size is None else size_arg(name, size)
             for name, size in (("original_size", original_size), ("resized_size", resized_size))}
    # multiply first, then divide: exact for integer sizes, so an edge stays an edge (w * W / w == W) and 0 stays 0
    target_scale, source_scale = _scale(target, **sizes), _scale(source, **sizes)
    converted = points.double() if source is target else points.double() * target_scale / source_scale
    return converted.to(points.dtype if points.is_floating_point() else torch.float32)


def convert_points(points: torch.Tensor, source, target, *, original_size=None, resized_size=None) -> torch.Tensor:
    """Points ``[..., 2]`` (x, y) from ``source`` to ``target`` coordinate system.

    Sizes are ``(width, height)`` in pixels, positive ints. Integer points come back
    float32, floating ones in their dtype (computed in float64)."""
    points = _coordinates("points", points, 2, "(x, y)")
    return _convert(points, source, target, original_size, resized_size)


def convert_boxes(boxes: torch.Tensor, source, target, *, original_size=None, resized_size=None) -> torch.Tensor:
    """Boxes ``[..., 4]`` (x0, y0, x1, y1) from ``source`` to ``target`` coordinate system,
    as their two corner points (``convert_points``)."""
    boxes = _coordinates("boxes", boxes, 4, "(x0, y0, x1, y1)")
    pts = boxes.reshape(*boxes.shape[:-1], 2, 2)
    return _convert(pts, source, target, original_size, resized_size).reshape(boxes.shape)


def size_arg(name: str, value) -> tuple[int, int]:
    """An image size ``(width, height)`` of two positive ints."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, torch.Tensor, np.ndarray)):
        raise TypeError(f"{name} must be (width, height), got {type(value).__name__} {value!r}")
    if len(value) != 2:
        raise ValueError(f"{name} must be (width, height), got {tuple(value)!r}")
    return tuple(int_arg(f"{name}[{i}]", v, min=1) for i, v in enumerate(value))
