"""Grounding: boxes and points with an explicit coordinate system.

Coordinates are converted only by explicit calls (``convert_boxes``/``convert_points``),
never implicitly: a box in resized-image pixels is not a box in original pixels.
"""

from __future__ import annotations

import torch

from .choice import Choice
from .spans import SchemaError


class CoordinateSystem(Choice):
    ABSOLUTE = "absolute"  # pixels of the original image
    RESIZED = "resized"  # pixels of the image as the processor resized it
    NORMALIZED = "normalized"  # 0-1
    NORMALIZED_1000 = "normalized_1000"  # 0-1000 (Qwen-VL grounding convention)


def _scale(system: CoordinateSystem, original_size, resized_size) -> torch.Tensor:
    """(sx, sy): multiply normalized-0-1 coordinates by this to get ``system`` coordinates."""
    if system is CoordinateSystem.NORMALIZED:
        return torch.tensor([1.0, 1.0], dtype=torch.float64)
    if system is CoordinateSystem.NORMALIZED_1000:
        return torch.tensor([1000.0, 1000.0], dtype=torch.float64)
    size = original_size if system is CoordinateSystem.ABSOLUTE else resized_size
    if size is None:
        raise SchemaError(f"converting {system.value} coordinates needs the {'original' if system is CoordinateSystem.ABSOLUTE else 'resized'} image size (width, height)")
    w, h = size
    return torch.tensor([float(w), float(h)], dtype=torch.float64)


def convert_points(points: torch.Tensor, source, target, *, original_size=None, resized_size=None) -> torch.Tensor:
    """Points ``[..., 2]`` (x, y) from ``source`` to ``target`` coordinate system."""
    source = CoordinateSystem.parse(source, "source", SchemaError)
    target = CoordinateSystem.parse(target, "target", SchemaError)
    if points.shape[-1] != 2:
        raise SchemaError(f"points must have a last dimension of 2 (x, y), got shape {tuple(points.shape)}")
    factor = _scale(target, original_size, resized_size) / _scale(source, original_size, resized_size)
    return (points.double() * factor).to(points.dtype if points.is_floating_point() else torch.float32)


def convert_boxes(boxes: torch.Tensor, source, target, *, original_size=None, resized_size=None) -> torch.Tensor:
    """Boxes ``[..., 4]`` (x0, y0, x1, y1) from ``source`` to ``target`` coordinate system."""
    if boxes.shape[-1] != 4:
        raise SchemaError(f"boxes must have a last dimension of 4 (x0, y0, x1, y1), got shape {tuple(boxes.shape)}")
    pts = boxes.reshape(*boxes.shape[:-1], 2, 2)
    out = convert_points(pts, source, target, original_size=original_size, resized_size=resized_size)
    return out.reshape(boxes.shape)
