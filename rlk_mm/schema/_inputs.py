"""The builders' arguments → checked CPU tensors and lists, before any work.

Token ids are ints in the tokenizer's vocabulary (never floats, bools, None, strings or an
ignore index such as -100); masks are 0/1 or bool of the right shape; padding is stripped
only where a mask says where it is, and a row that still starts or ends with the pad token
is refused (an ambiguous layout is never guessed). Errors name the argument, the sample
and the position. Builders run on CPU data, so these checks read values freely.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .checks import INTEGER_DTYPES, describe, first_true, group_id_list, sequence_arg, tensor_arg
from .coordinates import CoordinateSystem, extent, outside, size_arg
from .spans import SchemaError
from .unsupported import require_no_audio_inputs

__all__ = [
    "chat_markers", "check_image_size", "check_plain_text", "check_response_unpadded", "check_unpadded",
    "check_vocabulary", "coordinate_system_arg", "id_matrix", "vl_processor_arg",
    "mask_matrix", "multi_modal_inputs", "padded_positions", "PaddedPositions", "per_sample_targets",
    "per_sample_values", "processor_limits", "processor_outputs", "screen_sizes", "str_list", "token_rows", "unpad",
]

#: the largest finite float32: rewards and costs are stored as float32
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
#: the most extreme width/height ratio the Qwen-VL image processors accept
MAX_ASPECT_RATIO = 200

Tensor = torch.Tensor


def token_rows(name: str, rows, vocab_size: int) -> list[Tensor]:
    """Per-sample token ids (lists of ints or 1-D integer tensors) as int64 CPU tensors."""
    rows = sequence_arg(name, rows, "token-id sequences", ordered=True)
    out = []
    for b, row in enumerate(rows):
        if isinstance(row, np.ndarray):
            row = row.tolist()
        if isinstance(row, Tensor):
            if row.dtype not in INTEGER_DTYPES:
                raise TypeError(f"{name}[{b}] must hold int token ids, got dtype {row.dtype}")
            if row.ndim != 1:
                raise TypeError(f"{name}[{b}] must be 1-D (one sample's token ids), got shape {tuple(row.shape)}")
            ids = row.long().cpu()
        else:
            if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
                raise TypeError(f"{name}[{b}] is {describe(row)}; expected a sequence of token ids (ints)")
            for p, t in enumerate(row):
                if type(t) is not int and (isinstance(t, bool) or not isinstance(t, numbers.Integral)):
                    raise TypeError(f"{name}[{b}][{p}] is {describe(t)}; token ids are ints")
            ids = torch.tensor([int(t) for t in row], dtype=torch.int64)
        check_vocabulary(name, ids, vocab_size, sample=b)
        out.append(ids)
    return out


def check_vocabulary(name: str, ids: Tensor, vocab_size: int, *, sample: Optional[int] = None, real: Optional[Tensor] = None) -> None:
    """Every id lies in ``[0, vocab_size)``: ``ids`` is sample ``sample``'s row, or a padded
    ``[B, L]`` matrix whose tokens ``real`` marks (positions are then the padded row's)."""
    bad = (ids < 0) | (ids >= vocab_size)
    if real is not None:
        bad &= real
    if bool(bad.any()):
        b, p = (sample, *first_true(bad)) if sample is not None else first_true(bad)
        value = int(ids[p] if sample is not None else ids[b, p])
        hint = ("; an ignore index such as -100 is not a token: leave unscored tokens out of the loss instead"
                if value < 0 else "")
        raise SchemaError(f"{name}: sample {b}, position {p} is {value}; token ids lie in the tokenizer's "
                          f"vocabulary of {vocab_size} ids{hint}")


def id_matrix(name: str, value) -> Tensor:
    """A padded ``[B, L]`` integer tensor of token ids (on the CPU)."""
    value = tensor_arg(name, value)
    if value.dtype not in INTEGER_DTYPES:
        raise TypeError(f"{name} must be int (a [B, L] tensor of token ids), got {value.dtype}")
    if value.ndim != 2:
        raise SchemaError(f"{name} must be 2-D [batch, length] as the processor returns, got shape {tuple(value.shape)}")
    return value.long().cpu()


def mask_matrix(name: str, value, shape: tuple[int, int]) -> Tensor:
    """A ``[B, L]`` mask of bools or 0/1 integers, as a bool CPU tensor."""
    value = tensor_arg(name, value)
    if value.dtype != torch.bool and value.dtype not in INTEGER_DTYPES:
        raise TypeError(f"{name} must be bool/int 0-1 values, got {value.dtype}")
    tensor_arg(name, value, shape=shape, error=SchemaError)
    value = value.cpu()
    if value.dtype != torch.bool:
        bad = (value != 0) & (value != 1)
        if bool(bad.any()):
            b, p = first_true(bad)
            raise SchemaError(f"{name}: sample {b}, position {p} is {int(value[b, p])}; expected 0 or 1")
    return value.bool()


def unpad(row: Tensor, mask: Tensor, name: str, b: int, offset: int = 0) -> Tensor:
    """The entries of ``row`` where ``mask`` is set: one contiguous run (left or right padding)."""
    kept = torch.nonzero(mask).flatten()
    if not kept.numel():
        raise SchemaError(f"{name}: sample {b} has no real tokens (the mask is 0 everywhere)")
    first, last = int(kept[0]), int(kept[-1])
    if last - first + 1 != kept.numel():
        hole = first + first_true(~mask[first:last])[0]
        raise SchemaError(f"{name}: sample {b} has holes: position {hole + offset} is 0 between real tokens; expected one "
                          "contiguous run of real tokens (left or right padding)")
    return row[first : last + 1]


def check_unpadded(ids: Tensor, b: int, pad_token_id: Optional[int], name: str, fix: str, mask_start: Optional[int] = None) -> None:
    """A prompt that still starts or ends with the pad token is padded. ``mask_start``: where
    a mask cut the prompt from its padded row (the error then blames the mask); ``name`` and
    ``fix`` make the message otherwise."""
    if pad_token_id is None or not ids.numel():
        return
    for at, p in (("starts", 0), ("ends", ids.numel() - 1)):
        if int(ids[p]) != pad_token_id:
            continue
        if mask_start is not None:
            raise SchemaError(f"attention_mask: sample {b} marks position {mask_start + p}, the pad token {pad_token_id}, as a "
                              "real token: the mask must be 0 at padding (pass the processor's own attention_mask)")
        raise SchemaError(f"{name}: sample {b} {at} with the pad token {pad_token_id}{fix}")


def check_response_unpadded(name: str, ids: Tensor, b: int, pad_token_id: Optional[int]) -> None:
    """A response ending with two pad tokens still holds padding (generation stops at the
    first end token, which may itself be the pad token)."""
    n = ids.numel()
    if pad_token_id is not None and n >= 2 and bool((ids[-2:] == pad_token_id).all()):
        raise SchemaError(f"{name}: sample {b} ends with the pad token {pad_token_id} at response positions {n - 2} and {n - 1}: "
                          "that is padding, not generated tokens; strip it (or mark it 0 in the mask)")


@dataclass
class PaddedPositions:
    """What ``padded_positions`` read: the layout it took, and each sample's positions."""

    layout: tuple  # the shape position_ids was read as, e.g. (3, B, L)
    per_sample: list[Tensor]  # (3, L_b) positions of each sample's real tokens


def padded_positions(position_ids, mask: Optional[Tensor], shape: tuple[int, int], *, batch_first: bool) -> PaddedPositions:
    """Each sample's (3, L_b) positions from padded positions (``mask``: its real tokens,
    None for all): ``(B, L)`` 1-D positions, or 3-D as ``(B, 4, L)`` (verl: row 0 text
    positions, rows 1-3 M-RoPE) / ``(B, 3, L)`` when ``batch_first``, else ``(3, B, L)``
    (transformers' ``get_rope_index``)."""
    B, L = shape
    value = tensor_arg("position_ids", position_ids)
    if value.dtype not in INTEGER_DTYPES:
        raise TypeError(f"position_ids must be int (int64 positions), got {value.dtype}")
    layouts = [(B, 4, L), (B, 3, L), (B, L)] if batch_first else [(3, B, L), (B, L)]
    layout = tuple(value.shape)
    if layout not in layouts:
        raise SchemaError(f"position_ids must have shape {' or '.join(map(str, layouts))} (B = {B} samples, L = {L} "
                          f"tokens), got {layout}")
    value = value.long().cpu()
    per_sample = []
    for b in range(B):
        keep = torch.ones(L, dtype=torch.bool) if mask is None else mask[b]
        if value.ndim == 2:
            per_sample.append(value[b][keep].unsqueeze(0).expand(3, -1).clone())
        elif not batch_first:
            per_sample.append(value[:, b][:, keep])
        else:
            per_sample.append(value[b, -3:][:, keep])
    return PaddedPositions(layout, per_sample)


def check_positions(name: str, given: Tensor, expected: Tensor, b: int, tokens: Tensor, *, start: int = 0,
                    hint: str = "", fix: str = "") -> None:
    """Refuses sample ``b``'s caller positions ``given`` (3, L) where they differ from the M-RoPE
    positions the model computes (``expected``), naming the first differing token; ``start``
    shifts the reported position (padding before the real tokens), ``hint`` explains a likely
    cause and ``fix`` adds a way out to the message."""
    wrong = torch.nonzero((given != expected).any(0))
    if not wrong.numel():
        return
    t = int(wrong[0])
    raise SchemaError(
        f"{name}: sample {b}, position {start + t} (token {int(tokens[t])}) has t/h/w positions {given[:, t].tolist()} "
        f"but the model computes {expected[:, t].tolist()} there{hint}: pass the positions get_rope_index computes "
        f"for these tokens and grids{fix}")


def per_sample_values(name: str, values, B: int) -> Optional[list]:
    """One value per sample: group ids as str (from str or int), rewards and costs as float
    (from real numbers, never bools, None or strings; finite and within float32's range); None
    when ``values`` is None."""
    if values is None:
        return None
    if name == "group_ids":
        items = [str(g) for g in group_id_list(values)]
    else:
        if isinstance(values, (Tensor, np.ndarray)):
            if values.ndim != 1:
                raise SchemaError(f"{name} must have shape [{B}] (one value per sample), got {tuple(values.shape)}")
            values = values.tolist()
        items = sequence_arg(name, values, "numbers, one per sample", ordered=True)
        for b, v in enumerate(items):
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"{name}[{b}] is {describe(v)}; {name} are numbers")
            if not abs(float(v)) <= FLOAT32_MAX:  # nan fails too
                raise SchemaError(f"{name}[{b}] is {float(v)} (sample {b}); {name} are finite numbers within float32's "
                                  f"range (|x| <= {FLOAT32_MAX:.4g}), the dtype the batch stores them in")
        items = [float(v) for v in items]
    if len(items) != B:
        raise SchemaError(f"{name} has {len(items)} entries; expected one per sample ({B})")
    return items


def per_sample_targets(name: str, values, B: int, what: str, system: Optional[str] = None) -> Optional[list[Tensor]]:
    """Grounding targets of each sample as float32 ``[k, width]`` CPU tensors; None when
    ``values`` is None. ``what`` is ``"box"`` (rows ``(x0, y0, x1, y1)``) or ``"point"``
    (``(x, y)``). One entry per sample: a ``[k, width]`` tensor or array, a list of k rows
    of numbers, or None / ``[]`` for none. Coordinates are real numbers (never bools or
    strings) and finite; a box has ``x0 <= x1`` and ``y0 <= y1``; in a normalized ``system``
    every coordinate lies in the image (0..1 normalized, 0..1000 normalized_1000; pixel
    coordinates are checked where the image is known: ``grounding_rewards``). Errors name the
    sample and the row."""
    if values is None:
        return None
    width = 4 if what == "box" else 2
    row = "(x0, y0, x1, y1)" if what == "box" else "(x, y)"
    items = sequence_arg(name, values, f"one entry per sample: a list of {row} rows, a [k, {width}] tensor, or None", ordered=True)
    if len(items) != B:
        raise SchemaError(f"{name} has {len(items)} entries; expected one per sample ({B}), each a list of {row} rows (or None)")
    out = []
    for b, item in enumerate(items):
        where = f"{name}: sample {b}"
        if item is None:
            out.append(torch.zeros(0, width))
            continue
        if isinstance(item, np.ndarray):
            item = torch.from_numpy(item)
        if isinstance(item, Tensor):
            if item.dtype == torch.bool or not (item.is_floating_point() or item.dtype in INTEGER_DTYPES):
                raise TypeError(f"{where} has dtype {item.dtype}; coordinates are real numbers (a float or int tensor)")
            if item.numel() == 0:
                item = item.reshape(0, width)
            if item.ndim != 2 or item.shape[1] != width:
                raise SchemaError(f"{where} has shape {tuple(item.shape)}; expected [k, {width}]: one {row} row per {what}")
            rows = item.detach().cpu().double()
        else:
            rows = sequence_arg(f"{name}[{b}]", item, f"{row} rows", ordered=True)
            for j, r in enumerate(rows):
                if isinstance(r, (str, bytes)) or not isinstance(r, (Sequence, Tensor, np.ndarray)) or len(r) != width:
                    raise SchemaError(f"{where}, {what} {j} is {describe(r)}; expected {width} numbers {row}")
                for v in r.tolist() if isinstance(r, (Tensor, np.ndarray)) else r:
                    if isinstance(v, bool) or not isinstance(v, numbers.Real):
                        raise TypeError(f"{where}, {what} {j} holds {describe(v)}; coordinates are numbers")
            rows = torch.tensor([[float(v) for v in (r.tolist() if isinstance(r, (Tensor, np.ndarray)) else r)] for r in rows],
                                dtype=torch.float64).reshape(-1, width)
        rules = [(~torch.isfinite(rows).all(1), "coordinates must be finite")]
        size = None if system is None else extent(CoordinateSystem(system))
        if size is not None:
            rules.append((outside(rows, *size), f"it lies outside the image (0..{size[0]:g} x 0..{size[1]:g} in {system} "
                          "coordinates): fix or drop it, or pass the coordinate_system its values are really in "
                          "(nothing is clamped)"))
        if what == "box":
            rules.append(((rows[:, 0] > rows[:, 2]) | (rows[:, 1] > rows[:, 3]), "a box has x0 <= x1 and y0 <= y1"))
        for mask, rule in rules:
            if bool(mask.any()):
                j = first_true(mask)[0]
                raise SchemaError(f"{where}, {what} {j} is {rows[j].tolist()}; {rule}")
        out.append(rows.float())
    return out


def screen_sizes(values, B: int) -> Optional[Tensor]:
    """``screen_size``: one ``(width, height)`` of positive ints per sample (a list of pairs or
    a ``[B, 2]`` integer tensor), as int64 ``[B, 2]``; None when ``values`` is None."""
    if values is None:
        return None
    if isinstance(values, (Tensor, np.ndarray)) and values.ndim != 2:
        raise SchemaError(f"screen_size must have shape [{B}, 2] (width, height per sample), got {tuple(values.shape)}")
    items = sequence_arg("screen_size", values, "(width, height) pairs, one per sample", ordered=True)
    if len(items) != B:
        raise SchemaError(f"screen_size has {len(items)} entries; expected one (width, height) per sample ({B})")
    return torch.tensor([size_arg(f"screen_size[{b}]", size) for b, size in enumerate(items)], dtype=torch.int64).reshape(B, 2)


def coordinate_system_arg(value) -> Optional[str]:
    """The name of a ``CoordinateSystem`` (a member or its string); None stays None."""
    return None if value is None else CoordinateSystem.parse(value, "coordinate_system", SchemaError).value


def str_list(name: str, values) -> Optional[list[str]]:
    """A list of str (media ids, media cache keys); None when ``values`` is None."""
    if values is None:
        return None
    items = sequence_arg(name, values, "str", ordered=True)
    for i, v in enumerate(items):
        if not isinstance(v, str):
            raise TypeError(f"{name}[{i}] is {describe(v)}; {name} are str")
        if not v.strip():
            raise SchemaError(f"{name}[{i}] is {v!r}: an empty str would name every item alike; give each item a non-blank "
                              f"str (or leave {name} out: the builder derives it from the pixels)")
    return items


def processor_outputs(processor_output) -> Mapping:
    if not isinstance(processor_output, Mapping):
        raise TypeError(f"processor_output must be a mapping (the processor's BatchFeature or a dict), got {type(processor_output).__name__}")
    if "input_ids" not in processor_output:
        raise SchemaError(f"processor_output has no 'input_ids' (keys: {sorted(processor_output)}): pass the processor's whole output")
    return require_no_audio_inputs(processor_output, "processor_output")


def multi_modal_inputs(value, B: int) -> list[dict]:
    """verl's per-sample dicts of media inputs (None or {} for a text-only sample)."""
    items = [] if value is None else sequence_arg("multi_modal_inputs", value, "per-sample dicts", ordered=True)
    if items and len(items) != B:
        raise SchemaError(f"multi_modal_inputs has {len(items)} entries; expected one per sample ({B})")
    for b, item in enumerate(items):
        if item is not None and not isinstance(item, Mapping):
            raise TypeError(f"multi_modal_inputs[{b}] must be a dict (or None for a text-only sample), got {type(item).__name__}")
        require_no_audio_inputs(item or {}, f"multi_modal_inputs[{b}]")
    return [dict(item or {}) for item in items] or [{} for _ in range(B)]


def vl_processor_arg(processor):
    """``processor`` itself when it is a Qwen-VL processor: a tokenizer, an image processor and a
    chat template (checked before any third-party code runs on it)."""
    missing = [name for name in ("tokenizer", "image_processor", "apply_chat_template") if not hasattr(processor, name)]
    if processor is None or missing:
        raise TypeError(f"processor must be a Qwen-VL processor (AutoProcessor.from_pretrained(...)) with a tokenizer, "
                        f"an image processor and a chat template; got {type(processor).__name__}, which lacks "
                        f"{', '.join(missing)}")
    return processor


def processor_limits(processor) -> tuple[int, int]:
    """(min_pixels, max_pixels) of the processor's image processor."""
    ip = processor.image_processor
    size = getattr(ip, "size", None) or {}
    low = size.get("shortest_edge") or getattr(ip, "min_pixels", None)
    high = size.get("longest_edge") or getattr(ip, "max_pixels", None)
    if not low or not high:
        raise ValueError(f"processor: its image processor {type(ip).__name__} names no min/max pixels (size shortest_edge/longest_edge)")
    return int(low), int(high)


def chat_markers(processor) -> tuple[str, ...]:
    """The texts of the tokens that the chat template and the processor write themselves (turn
    markers, end and pad tokens, media markers and placeholders) and that exist in the
    tokenizer's vocabulary: a text field holding one would forge a turn or a media item."""
    tokenizer = getattr(processor, "tokenizer", processor)
    added = tokenizer.get_added_vocab()
    candidates = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                  "<|video_pad|>", tokenizer.eos_token, tokenizer.pad_token,
                  getattr(processor, "image_token", None), getattr(processor, "video_token", None)]
    return tuple(dict.fromkeys(t for t in candidates if isinstance(t, str) and t in added))


def check_plain_text(where: str, text, markers: Sequence[str]) -> str:
    """``text`` itself when it is a str holding none of ``markers`` (``chat_markers``); ``where``
    names the field in the error."""
    if not isinstance(text, str):
        raise TypeError(f"{where} must be a str, got {describe(text)}")
    found = [(at, marker) for marker in markers if (at := text.find(marker)) >= 0]
    if found:
        at, marker = min(found)
        raise SchemaError(f"{where} holds the chat marker {marker!r} at character {at}: the chat template and the "
                          "processor write these tokens themselves (turns, media); remove it from the text")
    return text


def check_image_size(where: str, width: int, height: int) -> None:
    """An image of ``width`` x ``height`` pixels the Qwen-VL image processors can resize: both
    at least 1, and a width/height ratio within ``MAX_ASPECT_RATIO``."""
    if width < 1 or height < 1:
        raise SchemaError(f"{where} is {width}x{height} pixels: an image needs a width and a height of at least 1")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise SchemaError(f"{where} is {width}x{height} pixels: its aspect ratio exceeds {MAX_ASPECT_RATIO}, the most "
                          "the Qwen-VL image processors accept; crop or pad it")
