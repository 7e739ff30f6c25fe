"""Boxes and points read from a model's own response tokens, in that model's convention.

Coordinate conventions differ by model, and a reward computed in the wrong one is silently
wrong, so the convention is always named (``Convention``) and fixes the syntax and the
``CoordinateSystem`` of what the model writes:

- ``qwen2_vl``: ``<|box_start|>(x1,y1),(x2,y2)<|box_end|>`` (one pair: a point), 0-1000;
- ``qwen2_5_vl`` (and ``ui_tars_1_5``, which follows it): JSON ``"bbox_2d": [x1, y1, x2, y2]``
  / ``"point_2d": [x, y]`` in pixels of the smart-resized image;
- ``qwen3_vl``: the same JSON keys, 0-1000.

``find_regions`` is the syntax alone (bytes in, byte ranges out) and serves decoded text
too (the smoke task); ``parse_grounding`` reads one sample of an ``RLBatch``: each loss
span's tokens as bytes, every box or point with the exact token span of its coordinates,
converted to the original image's pixels through the item's ``image_grid_thw``. Malformed
or out-of-range output is a recorded ``ParseFailure`` (never clamped); it scores the
failure reward in ``grounding_rewards``.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..schema import Choice, CoordinateSystem, Modality, RLBatch, SchemaError, Span, convert_boxes, convert_points
from ..schema.batch import batch_arg
from ..schema.checks import INTEGER_DTYPES, int_arg, sample_index, sequence_arg
from ..schema.coordinates import size_arg

__all__ = [
    "check_values", "Convention", "CONVENTION_SYSTEM", "find_regions", "Found", "Grounding", "ImageSize",
    "parse_grounding", "ParseFailure", "Region", "token_bytes",
]


class Convention(Choice):
    """How a model writes boxes and points."""

    QWEN2_VL = "qwen2_vl"
    QWEN2_5_VL = "qwen2_5_vl"
    QWEN3_VL = "qwen3_vl"
    UI_TARS_1_5 = "ui_tars_1_5"


#: the coordinate system each convention writes in
CONVENTION_SYSTEM = {
    Convention.QWEN2_VL: CoordinateSystem.NORMALIZED_1000,
    Convention.QWEN2_5_VL: CoordinateSystem.RESIZED,
    Convention.QWEN3_VL: CoordinateSystem.NORMALIZED_1000,
    Convention.UI_TARS_1_5: CoordinateSystem.RESIZED,
}

_NUMBER = rb"\s*(-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*"
_JSON_KEY = re.compile(rb'"(bbox_2d|point_2d)"\s*:')
_JSON_ARRAY = {
    b"bbox_2d": re.compile(rb"\s*\[" + rb",".join([_NUMBER] * 4) + rb"\]"),
    b"point_2d": re.compile(rb"\s*\[" + rb",".join([_NUMBER] * 2) + rb"\]"),
}
_BOX_TAG = re.compile(rb"<\|box_start\|>(.*?)(<\|box_end\|>|$)", re.DOTALL)
_PAIR = rb"\(" + _NUMBER + rb"," + _NUMBER + rb"\)"
_TAG_BODY = re.compile(rb"\s*" + _PAIR + rb"(?:\s*,\s*" + _PAIR + rb")?\s*")
_SCAN_LIMIT = 64  # bytes of a malformed array named in its failure span


@dataclass(frozen=True)
class Found:
    """One box or point as ``find_regions`` saw it: ``kind`` ("box"/"point"), the byte range
    ``[lo, hi)`` of its coordinates (of the whole attempt on a failure), the values as
    written (None on a failure) and, on a failure, why."""

    kind: str
    lo: int
    hi: int
    values: Optional[tuple[float, ...]] = None
    reason: str = ""


def find_regions(data: bytes, convention) -> list[Found]:
    """Every box or point ``data`` (a response's bytes) writes in ``convention``'s syntax, in
    order. Syntax only: ranges are checked by ``check_values``."""
    if not isinstance(data, bytes):
        raise TypeError(f"data must be bytes (a response's UTF-8 bytes), got {type(data).__name__}")
    convention = Convention.parse(convention, "convention", SchemaError)
    return _find_tags(data) if convention is Convention.QWEN2_VL else _find_json(data)


def _numbers(match: re.Match) -> tuple[float, ...]:
    return tuple(float(g) for g in match.groups() if g is not None)


def _find_json(data: bytes) -> list[Found]:
    out = []
    keys = list(_JSON_KEY.finditer(data))
    for k, key in enumerate(keys):
        name = key.group(1)
        kind = "box" if name == b"bbox_2d" else "point"
        array = _JSON_ARRAY[name].match(data, key.end())
        if array is None:  # the failure covers up to its "]", at most _SCAN_LIMIT bytes, never into the next key
            stop = data.find(b"]", key.end())
            limit = min(key.end() + _SCAN_LIMIT, keys[k + 1].start() if k + 1 < len(keys) else len(data))
            hi = limit if stop < 0 else min(stop + 1, limit)
            want = "[x1, y1, x2, y2]" if kind == "box" else "[x, y]"
            out.append(Found(kind, key.start(), hi, reason=f'malformed "{name.decode()}": expected {want} of numbers'))
            continue
        out.append(Found(kind, array.start(1), array.end(array.lastindex), _numbers(array)))
    return out


def _find_tags(data: bytes) -> list[Found]:
    out = []
    for tag in _BOX_TAG.finditer(data):
        body = _TAG_BODY.fullmatch(tag.group(1))
        if not tag.group(2):
            out.append(Found("box", tag.start(), tag.end(), reason="<|box_start|> without <|box_end|>"))
        elif body is None:
            out.append(Found("box", tag.start(), tag.end(), reason="malformed box: expected (x1,y1),(x2,y2) or (x,y)"))
        else:
            values = _numbers(body)
            kind = "box" if len(values) == 4 else "point"
            out.append(Found(kind, tag.start(1) + body.start(1), tag.start(1) + body.end(body.lastindex), values))
    return out


def check_values(kind: str, values: tuple[float, ...], system, resized_size) -> str:
    """Why ``values`` (a box or point as written, in ``system``) are out of range, or "".
    The range is the image: 0..1000, 0..1, or 0..width / 0..height of the resized image
    (edges included); a box also needs x1 <= x2 and y1 <= y2. ``kind`` is ``"box"`` (4 values)
    or ``"point"`` (2); ``values`` real numbers (a tuple, list, array or tensor; never bools)."""
    if kind not in ("box", "point"):
        raise ValueError(f"kind={kind!r}: expected 'box' or 'point'")
    values = _real_values(values, 4 if kind == "box" else 2, "(x1, y1, x2, y2)" if kind == "box" else "(x, y)", kind)
    system = CoordinateSystem.parse(system, "system", SchemaError)
    if system is CoordinateSystem.RESIZED:
        width, height = size_arg("resized_size", resized_size)
    else:
        width = height = {CoordinateSystem.NORMALIZED: 1.0, CoordinateSystem.NORMALIZED_1000: 1000.0}.get(system)
        if width is None:
            raise SchemaError(f"system={system.value}: a model writes resized, normalized or normalized_1000 coordinates")
    if not all(math.isfinite(v) for v in values):
        return f"non-finite coordinate in {list(values)}"
    xs, ys = values[0::2], values[1::2]
    if any(not 0 <= x <= width for x in xs) or any(not 0 <= y <= height for y in ys):
        return f"{kind} {list(values)} lies outside the image (0..{width:g} x 0..{height:g} in {system.value} coordinates)"
    if kind == "box" and (values[0] > values[2] or values[1] > values[3]):
        return f"box {list(values)} has x1 > x2 or y1 > y2"
    return ""


def _real_values(values, n: int, layout: str, kind: str) -> tuple[float, ...]:
    if isinstance(values, (torch.Tensor, np.ndarray)):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, (tuple, list)):
        raise TypeError(f"values must be {n} numbers {layout}, got {type(values).__name__}")
    if len(values) != n:
        raise ValueError(f"values must be {n} numbers {layout} for a {kind}, got {len(values)}: {list(values)!r:.80}")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"values[{i}] is {type(v).__name__} {v!r}; coordinates are real numbers")
    return tuple(float(v) for v in values)


# ----------------------------------------------------------------------------- a batch's tokens
@dataclass(frozen=True)
class ImageSize:
    """An image that a ``Grounding``'s coordinates refer to: its index among the sample's images
    (0-based), its original ``(width, height)`` in pixels and its ``(width, height)`` as the
    processor resized it."""

    image: int
    original: tuple[int, int]
    resized: tuple[int, int]


@dataclass(frozen=True)
class Region:
    """A parsed box (x1, y1, x2, y2) or point (x, y): the token span of its coordinates
    (positions in the sample), the values as written (in ``Grounding.system``), in pixels of
    the original image, and that image (its index among the sample's images, ``Grounding.size_of``)."""

    kind: str
    span: Span
    values: tuple[float, ...]
    absolute: tuple[float, ...]
    image: int


@dataclass(frozen=True)
class ParseFailure:
    """Malformed or out-of-range output: the tokens it covers and why."""

    span: Span
    reason: str


@dataclass(frozen=True)
class Grounding:
    """What ``parse_grounding`` read from one sample; ``images``: the images its coordinates refer
    to, in the sample's order (one, or in an episode each screenshot its actions answer)."""

    sample: int
    convention: Convention
    system: CoordinateSystem  # of Region.values
    images: tuple[ImageSize, ...]
    regions: tuple[Region, ...]
    failures: tuple[ParseFailure, ...]

    def size_of(self, image: int) -> ImageSize:
        """The sizes of the sample's image ``image`` (a ``Region.image``)."""
        image = int_arg("image", image, min=0)
        for size in self.images:
            if size.image == image:
                return size
        raise SchemaError(f"sample {self.sample}: image={image} is not one its coordinates refer to "
                          f"(images {[s.image for s in self.images]}): pass a Region's image")

    @property
    def original_size(self) -> tuple[int, int]:
        """``(width, height)`` of the original image the coordinates refer to (several images: their
        common size, refused where they differ)."""
        return self._one_size().original

    @property
    def resized_size(self) -> tuple[int, int]:
        """``(width, height)`` of that image as the processor resized it (``original_size``'s rule)."""
        return self._one_size().resized

    def _one_size(self) -> ImageSize:
        if not self.images:
            raise SchemaError(f"sample {self.sample} has no loss spans, so no image its coordinates refer to")
        sizes = {(s.original, s.resized) for s in self.images}
        if len(sizes) > 1:
            named = ", ".join(f"#{s.image} {s.original[0]}x{s.original[1]}" for s in self.images)
            raise SchemaError(f"sample {self.sample}: its coordinates refer to images of different sizes ({named}): no one "
                              "image size holds for the whole sample; read each Region's size with size_of(region.image), "
                              "or build one sample per step (RLBatch.from_trajectories(history=k))")
        return self.images[0]


def _byte_decoder() -> dict[str, int]:
    """The inverse of the byte-level BPE alphabet (GPT-2's): a printable character per byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTES = _byte_decoder()


def token_bytes(tokenizer, ids: list[int]) -> list[bytes]:
    """The exact bytes of each token of a byte-level BPE tokenizer (Qwen's); added tokens
    (``<|box_start|>``, ...) are their text. ``ids``: ints in ``[0, len(tokenizer))`` (a list
    or a 1-D integer tensor or array)."""
    if not callable(getattr(tokenizer, "convert_ids_to_tokens", None)):
        raise TypeError(f"tokenizer must be a byte-level BPE tokenizer (with convert_ids_to_tokens), got "
                        f"{type(tokenizer).__name__}")
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        if ids.ndim != 1 or not (ids.dtype in INTEGER_DTYPES or (isinstance(ids.dtype, np.dtype) and np.issubdtype(ids.dtype, np.integer))):
            raise TypeError(f"ids must be a list of token ids (ints) or a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
        ids = ids.tolist()
    ids = sequence_arg("ids", ids, "token ids (ints)", ordered=True)
    vocab = len(tokenizer)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"ids[{i}] is {type(t).__name__} {t!r}; token ids are ints")
        if not 0 <= t < vocab:
            raise ValueError(f"ids[{i}] is {t}; token ids lie in [0, {vocab}) for this tokenizer")
    ids = [int(t) for t in ids]
    added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    pieces = tokenizer.convert_ids_to_tokens(ids)
    out = []
    for i, piece in zip(ids, pieces):
        if i in added:
            out.append(added[i].encode())
        elif piece is None or any(c not in _BYTES for c in piece):
            raise SchemaError(f"token {i} ({piece!r}) is not a byte-level BPE token: parse_grounding reads Qwen-style tokenizers")
        else:
            out.append(bytes(_BYTES[c] for c in piece))
    return out


def _sample_images(batch: RLBatch, b: int) -> list[int]:
    """The batch-wide media indices of sample ``b``'s images, in the sample's order."""
    if batch.media_sample is None:
        return []
    mine = (batch.media_sample == b) & (batch.media_modality == int(Modality.IMAGE))
    return torch.nonzero(mine).flatten().tolist()


def _answered(batch: RLBatch, b: int, items: list[int], loss: Span) -> int:
    """The image (index among the sample's images ``items``) shown last before ``loss``: the
    screenshot an action answers."""
    before = [items.index(s.media_index) for s in batch.modality_spans_of(b)
              if s.modality is Modality.IMAGE and s.end <= loss.start]
    if not before:
        raise SchemaError(f"sample {b}, loss span [{loss.start}, {loss.end}): no image precedes it, so it answers no "
                          f"screenshot: pass image= (0..{len(items) - 1}) to name the one its coordinates refer to")
    return before[-1]


def _check_aspect(where: str, original: tuple[int, int], resized: tuple[int, int], factor: int) -> None:
    """The resized image keeps the original's aspect up to the resize's rounding to ``factor``
    (each side within ``factor`` of one common scale): a swapped or foreign size is refused."""
    (ow, oh), (rw, rh) = original, resized
    if abs(rh - oh * rw / ow) > factor * (1 + oh / ow) + 1e-9:
        raise SchemaError(f"{where}: original_size {ow}x{oh} cannot have been resized to the image's {rw}x{rh} (another "
                          "aspect ratio): pass the (width, height) of the image the processor resized")


def _original(batch: RLBatch, b: int, image: int, items: list[int], given, recorded: list) -> tuple[int, int]:
    """The original size of sample ``b``'s image ``image``: ``given`` (the caller's), else the size
    the batch records for it, else, for the sample's last image, ``screen_size``; a given or
    screen size other than the recorded one is refused, and so is an unknown size."""
    where, item = f"sample {b}, image #{image}", items[image]
    own = recorded[item]
    last = batch.screen_size is not None and image == len(items) - 1
    screen = tuple(batch.screen_size[b].tolist()) if last else None
    if given is not None:
        given = size_arg("original_size", given)
        if own is not None and given != own:
            raise SchemaError(f"{where}: original_size={given[0]}x{given[1]}, but the batch records {own[0]}x{own[1]} for "
                              f"that image (media_cache_keys[{item}]): leave original_size out, or pass the recorded size")
        return given
    if own is not None:
        if screen is not None and screen != own:
            raise SchemaError(f"{where}: screen_size[{b}] is {screen[0]}x{screen[1]}, but the batch records {own[0]}x{own[1]} "
                              f"for that image, the sample's last (media_cache_keys[{item}]): build the batch with "
                              "screen_size the original size of each sample's last image")
        return own
    if screen is not None:
        return screen
    why = "the batch records no size for it (built from a processor's output, not from the images)"
    if batch.screen_size is not None:
        why += f", and screen_size is the size of the sample's last image (#{len(items) - 1})"
    build = " or with screen_size (each sample's last image's size)" if image == len(items) - 1 else ""
    raise SchemaError(f"{where}: its original size is unknown: {why}: pass image={image} with original_size=(width, height) "
                      f"of that image, or build the batch with RLBatch.from_messages or from_trajectories (which record "
                      f"each image's size){build}")


def parse_grounding(batch, sample: int, *, processor, convention="qwen2_5_vl", image: Optional[int] = None,
                    original_size=None) -> Grounding:
    """Boxes and points in sample ``sample``'s loss spans (its responses), as ``convention`` writes them.

    ``processor``: the batch's processor (its tokenizer decodes the tokens; its image
    processor's ``patch_size`` gives the resized size from ``image_grid_thw``). ``image``: which
    of the sample's images (0-based) the coordinates refer to. By default its only image; in an
    episode (a batch with ``action_spans``, ``RLBatch.from_trajectories``) with several
    screenshots, each loss span's own: the screenshot shown last before it, the one that action
    answers (``Region.image`` names it); there ``image`` keeps only the actions that answer
    that screenshot. ``original_size``: the named image's (width, height) in
    pixels; by default the size the batch records for that image (``RLBatch.media_original_sizes``:
    ``from_trajectories`` and ``from_messages`` record each image's), else, for the sample's last
    image, ``batch.screen_size``.
    Each region's span covers the tokens holding its coordinates' characters; malformed or
    out-of-range output becomes a ``ParseFailure`` over the tokens it covers.

    Raises
    ------
    SchemaError
        Naming the sample and the image: ``image`` beyond the sample's images, or none given for a
        sample of several images outside an episode; an image whose original size is unknown (pass
        ``image=`` with ``original_size=``); ``original_size`` (or ``screen_size``) other than the
        size the batch records for that image, or not of the resized image's aspect;
        ``original_size`` without ``image=`` where the actions answer several screenshots; in an
        episode, ``image`` naming a screenshot no scored action answers.
    TypeError, ValueError
        ``batch`` not an ``RLBatch``, ``processor`` not a Qwen-VL processor, ``image`` not an int
        >= 0, ``original_size`` not two ints >= 1, ``sample`` out of range."""
    batch = batch_arg("batch", batch)
    b = sample_index(sample, batch.num_samples, "batch")
    convention = Convention.parse(convention, "convention", SchemaError)
    system = CONVENTION_SYSTEM[convention]
    tokenizer = getattr(processor, "tokenizer", None)
    patch = getattr(getattr(processor, "image_processor", None), "patch_size", None)
    if tokenizer is None or patch is None:
        raise TypeError(f"processor must be a Qwen-VL processor (with .tokenizer and .image_processor.patch_size), got {type(processor).__name__}")
    items = _sample_images(batch, b)
    if not items:
        raise SchemaError(f"sample {b} has no image: coordinates refer to one; parse a sample with an image")
    losses = batch.loss_spans_of(b)
    if image is not None:
        image = int_arg("image", image, min=0)
        if image >= len(items):
            raise SchemaError(f"image={image}, but sample {b} has {len(items)} images: pass image= 0..{len(items) - 1}")
        if batch.action_spans is not None and len(items) > 1:  # an episode: only the actions that answer `image`
            losses = [loss for loss in losses if _answered(batch, b, items, loss) == image]
            if not losses:
                raise SchemaError(f"sample {b}: no scored action answers screenshot {image}: name the screenshot an "
                                  "action answers, or leave image= out (each action converts with its own)")
        answered = [image] * len(losses)
    elif len(items) == 1:
        image, answered = 0, [0] * len(losses)
    elif batch.action_spans is None:
        raise SchemaError(f"sample {b} has {len(items)} images: pass image= (0..{len(items) - 1}) to say which one the "
                          "coordinates refer to")
    else:
        answered = [_answered(batch, b, items, loss) for loss in losses]
        if original_size is not None and len(set(answered)) > 1:
            raise SchemaError(f"sample {b}: original_size is one image's size, but its actions answer the screenshots "
                              f"{sorted(set(answered))}: pass image= with it, or leave it out (the batch records each "
                              "screenshot's size)")
    recorded = batch.media_original_sizes()
    images = {}
    for i in sorted({*answered, *([] if image is None else [image])}):
        _, grid_h, grid_w = batch.media_grid_thw[items[i]].tolist()
        resized = (grid_w * int(patch), grid_h * int(patch))
        original = _original(batch, b, i, items, original_size, recorded)
        _check_aspect(f"sample {b}, image #{i}", original, resized, int(patch) * batch.spatial_merge_size)
        images[i] = ImageSize(i, original, resized)
    tokens = batch.sample_tokens(b).tolist()
    regions, failures = [], []
    for loss, i in zip(losses, answered):
        pieces = token_bytes(tokenizer, tokens[loss.start : loss.end])
        ends = torch.tensor([len(p) for p in pieces]).cumsum(0)

        def span(lo: int, hi: int) -> Span:  # the tokens holding bytes [lo, hi)
            first = int(torch.searchsorted(ends, lo, right=True))
            last = int(torch.searchsorted(ends, max(hi - 1, lo), right=True))
            return Span(loss.start + first, loss.start + last + 1)

        for found in find_regions(b"".join(pieces), convention):
            reason = found.reason or check_values(found.kind, found.values, system, images[i].resized)
            if reason:
                failures.append(ParseFailure(span(found.lo, found.hi), reason))
                continue
            values = torch.tensor(found.values, dtype=torch.float64)
            convert = convert_boxes if found.kind == "box" else convert_points
            absolute = convert(values, system, CoordinateSystem.ABSOLUTE, original_size=images[i].original,
                               resized_size=images[i].resized)
            regions.append(Region(found.kind, span(found.lo, found.hi), found.values, tuple(absolute.tolist()), i))
    return Grounding(b, convention, system, tuple(images.values()), tuple(regions), tuple(failures))
