"""Coordinates: boxes and points with an explicit coordinate system (``CoordinateSystem``).

Coordinates are converted only by explicit calls (``convert_boxes``/``convert_points``),
never implicitly: a box in resized-image pixels is not a box in original pixels.
Only coordinates inside the image convert: every coordinate lies in the source system's
extent (``extent``: 0..1 normalized, 0..1000 normalized_1000, 0..width x 0..height of the
original or resized image where its size is given), edges included; one outside it, or not
finite, is refused naming its row (it would convert to a plausible pixel that lies off the
image, a silently wrong target; nothing is clamped). The conversion is exact at the edges:
0 stays 0 and an image's edge lands on the other system's edge, bitwise.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .checks import FLOAT_DTYPES, INTEGER_DTYPES, first_true, int_arg, readable
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
    size = extent(system, original_size, resized_size)
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
    return readable(name, value)


def extent(system: CoordinateSystem, original_size=None, resized_size=None) -> tuple[float, float] | None:
    """(width, height) of the image in ``system`` coordinates: (1, 1) normalized, (1000, 1000)
    normalized_1000, the original or resized size in pixels; None where that size is unknown."""
    if system is CoordinateSystem.NORMALIZED:
        return 1.0, 1.0
    if system is CoordinateSystem.NORMALIZED_1000:
        return 1000.0, 1000.0
    size = original_size if system is CoordinateSystem.ABSOLUTE else resized_size
    return None if size is None else (float(size[0]), float(size[1]))


def outside(rows: torch.Tensor, width: float | torch.Tensor, height: float | torch.Tensor) -> torch.Tensor:
    """bool ``[...]``: rows ``[..., 2k]`` (x, y pairs) with a coordinate outside ``0..width`` x
    ``0..height`` (edges inside) or not finite (nan is outside everything)."""
    xs, ys = rows[..., 0::2], rows[..., 1::2]
    inside = (xs >= 0) & (xs <= width) & (ys >= 0) & (ys <= height)
    return ~inside.all(-1)


def check_inside(name: str, rows: torch.Tensor, system: CoordinateSystem, size: tuple[float, float] | None,
                 where: str = "") -> None:
    """Refuses rows ``[..., 2k]`` of ``system`` coordinates outside the image of ``size``
    (``extent``; None: unknown, unchecked), naming the first one."""
    if size is None or rows.numel() == 0:
        return
    bad = outside(rows, *size)
    if bool(bad.any()):
        index = first_true(bad)
        at = "".join(f"[{i}]" for i in index)
        values = [float(f"{v:.6g}") for v in rows[index].tolist()]
        what = ("is not finite" if not bool(torch.isfinite(rows[index]).all()) else
                f"lies outside the image (0..{size[0]:g} x 0..{size[1]:g} in {system.value} coordinates)")
        raise SchemaError(f"{name}{at}{where} is {values}: it {what}; only coordinates inside the image convert "
                          "(nothing is clamped): fix or drop that row, or name the system the values are really in")


def _convert(points: torch.Tensor, source, target, original_size, resized_size, name: str, check) -> torch.Tensor:
    source = CoordinateSystem.parse(source, "source", SchemaError)
    target = CoordinateSystem.parse(target, "target", SchemaError)
    sizes = {name: None if size is None else size_arg(name, size)
             for name, size in (("original_size", original_size), ("resized_size", resized_size))}
    # multiply first, then divide: exact for integer sizes, so an edge stays an edge (w * W / w == W) and 0 stays 0
    target_scale, source_scale = _scale(target, **sizes), _scale(source, **sizes)
    check_inside(name, check, source, extent(source, **sizes))
    converted = points.double() if source is target else points.double() * target_scale / source_scale
    return converted.to(points.dtype if points.is_floating_point() else torch.float32)


def convert_points(points: torch.Tensor, source, target, *, original_size=None, resized_size=None) -> torch.Tensor:
    """Points ``[..., 2]`` (x, y) from ``source`` to ``target`` coordinate system.

    Sizes are ``(width, height)`` in pixels, positive ints. Integer points come back
    float32, floating ones in their dtype (computed in float64).

    Raises
    ------
    SchemaError
        A point outside the image in ``source`` coordinates (below 0, above 1 normalized, above
        1000 normalized_1000, beyond the original or resized size where it is given) or not
        finite, naming its index; a size the conversion needs and lacks."""
    points = _coordinates("points", points, 2, "(x, y)")
    return _convert(points, source, target, original_size, resized_size, "points", points)


def convert_boxes(boxes: torch.Tensor, source, target, *, original_size=None, resized_size=None) -> torch.Tensor:
    """Boxes ``[..., 4]`` (x0, y0, x1, y1) from ``source`` to ``target`` coordinate system,
    as their two corner points (``convert_points``; a box with a corner outside the image is
    refused, naming its index)."""
    boxes = _coordinates("boxes", boxes, 4, "(x0, y0, x1, y1)")
    pts = boxes.reshape(*boxes.shape[:-1], 2, 2)
    return _convert(pts, source, target, original_size, resized_size, "boxes", boxes).reshape(boxes.shape)


def size_arg(name: str, value) -> tuple[int, int]:
    """An image size ``(width, height)`` of two positive ints."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, torch.Tensor, np.ndarray)):
        raise TypeError(f"{name} must be (width, height), got {type(value).__name__} {value!r}")
    if len(value) != 2:
        raise ValueError(f"{name} must be (width, height), got {tuple(value)!r}")
    return tuple(int_arg(f"{name}[{i}]", v, min=1) for i, v in enumerate(value))
