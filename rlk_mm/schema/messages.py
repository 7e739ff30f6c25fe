"""The builder from chat messages: ``RLBatch.from_messages`` (``fields_from_messages``).

Conversations in the Qwen-VL message format name their media inline, with per-item
resize settings. Each item is decoded here (so that an error names the conversation and
the item) and resized by ``qwen_vl_utils`` (its ``fetch_image`` for images; its
``smart_resize`` of the original frame size picks a video's frame size, and PIL resizes the
frames once; qwen-vl-utils' ``fetch_video`` resizes a frame list twice and may pick another
size), the chat template is
applied, the processor is called with exactly those sizes (no second resize), and the
processor output goes through ``fields_from_qwen_vl``. Every item's settings, and the
size of the image (or frames) it was resized from, are recorded in its cache key
(``media.settings_key``).

``qwen_vl_utils`` imports torchvision at import time, only for its video-file readers and
its tensor resize. Where torchvision cannot be imported, ``vision_process()`` imports it
with a stand-in ``torchvision`` whose every use raises, then removes the stand-in: the
image path (``fetch_image``, ``smart_resize``) is qwen-vl-utils' own, and video files are
refused (frame lists need no decoder).
"""

from __future__ import annotations

import base64
import binascii
import importlib
import io
import math
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

from ._inputs import chat_markers, check_image_size, check_plain_text, processor_limits, vl_processor_arg
from .layouts import layout_family_of
from .media import ResizeSettings, settings_key
from .qwen_vl import fields_from_qwen_vl

if TYPE_CHECKING:  # Pillow is the [vl] extra's: imported where an image is opened
    from PIL import Image

IMAGE_KEYS = {"type", "image", "min_pixels", "max_pixels", "resized_height", "resized_width"}
VIDEO_KEYS = {"type", "video", "min_pixels", "max_pixels", "total_pixels", "resized_height", "resized_width", "fps", "nframes"}
DEFAULT_FPS = 2.0
"""Frame rate of a frame list without ``fps`` (qwen-vl-utils samples videos at 2 fps)."""


# ----------------------------------------------------------------------------- qwen-vl-utils
class _Unavailable(types.ModuleType):
    """A stand-in torchvision module: importing names from it works, using them raises."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self.__name__} is not available (torchvision cannot be imported here): qwen-vl-utils needs it to read "
            "video files; pass a video as a list of frames instead"
        )


def _torchvision_importable() -> bool:
    try:
        importlib.import_module("torchvision")
        return True
    except Exception:  # ImportError, or a broken install raising anything at import time
        return False


def vision_process():
    """``qwen_vl_utils.vision_process``, imported even where torchvision cannot be (see the
    module docstring)."""
    if "qwen_vl_utils.vision_process" in sys.modules or _torchvision_importable():
        return importlib.import_module("qwen_vl_utils.vision_process")
    names = ("torchvision", "torchvision.io", "torchvision.transforms", "torchvision.transforms.functional")
    stand_ins = {name: _Unavailable(name) for name in names}
    stand_ins["torchvision"].__version__ = "0.0.0"
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules.update(stand_ins)
    try:
        return importlib.import_module("qwen_vl_utils.vision_process")
    finally:
        for name, module in saved.items():  # nothing else may see the stand-in
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


# ----------------------------------------------------------------------------- argument checks
def _count(where: str, name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _positive(where: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_keys(where: str, part: dict, allowed: set) -> None:
    unknown = sorted(set(part) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; a {part['type']} part takes {sorted(allowed)}")


def _pixel_limits(where: str, part: dict, defaults: tuple[int, int]) -> tuple[int, int]:
    """(min_pixels, max_pixels): the part's, else the processor's."""
    low = _count(where, "min_pixels", part["min_pixels"]) if "min_pixels" in part else defaults[0]
    high = _count(where, "max_pixels", part["max_pixels"]) if "max_pixels" in part else defaults[1]
    if low > high:
        source = {k: "" if k in part else " (the processor's)" for k in ("min_pixels", "max_pixels")}
        raise ValueError(f"{where}: min_pixels {low}{source['min_pixels']} > max_pixels {high}{source['max_pixels']}; "
                         "give min_pixels <= max_pixels")
    return low, high


def _requested_size(where: str, part: dict) -> Optional[tuple[int, int]]:
    given = [k for k in ("resized_height", "resized_width") if k in part]
    if len(given) == 1:
        raise ValueError(f"{where}: {given[0]} without its pair: give both resized_height and resized_width, or neither")
    return (_count(where, "resized_height", part["resized_height"]), _count(where, "resized_width", part["resized_width"])) if given else None


def _open_image(where: str, value) -> "Image.Image":
    """A PIL image from a PIL image, a path, ``file://`` or ``data:image/...;base64,``; URLs refused."""
    from PIL import Image  # the [vl] extra: the core never imports Pillow
    if isinstance(value, Image.Image):
        check_image_size(where, *value.size)
        return value
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str):
        raise TypeError(f"{where}: expected a path, 'file://...', 'data:image/...;base64,...' or a PIL image, got {type(value).__name__}")
    if value.startswith(("http://", "https://")):
        raise ValueError(f"{where}: {value!r} is a URL; rlk_mm does not download media: fetch it and pass the file or a PIL image")
    if value.startswith("data:image"):
        _, sep, data = value.partition("base64,")
        try:
            source = io.BytesIO(base64.b64decode(data, validate=True))
        except (binascii.Error, ValueError):
            sep = ""
        if not sep:
            raise ValueError(f"{where}: a data URI must be 'data:image/<type>;base64,<base64 data>'")
        name = "its base64 data"
    else:
        path = Path(value[len("file://"):] if value.startswith("file://") else value)
        if not path.is_file():
            raise FileNotFoundError(f"{where}: image file {str(path)!r} not found")
        source, name = path, repr(str(path))
    try:
        with Image.open(source) as opened:
            opened.load()
            image = opened.copy()
    except OSError as error:
        raise ValueError(f"{where}: cannot decode image {name}: {error}") from None
    check_image_size(where, *image.size)
    return image


# ----------------------------------------------------------------------------- media items
def _fetch_image(vp, where: str, part: dict, limits: tuple[int, int], patch: int):
    """qwen-vl-utils' ``fetch_image`` on the checked part: (resized RGB image, settings with its original size)."""
    _check_keys(where, part, IMAGE_KEYS)
    if part.get("image") is None:
        raise ValueError(f"{where}: an image part needs 'image' (a path, 'file://...', 'data:image/...;base64,...' or a PIL image)")
    low, high = _pixel_limits(where, part, limits)
    requested = _requested_size(where, part)
    original = _open_image(where, part["image"])
    element = {"image": original, "min_pixels": low, "max_pixels": high}
    if requested:
        element.update(resized_height=requested[0], resized_width=requested[1])
    try:
        image = vp.fetch_image(element, image_patch_size=patch)
    except (ValueError, AssertionError, OSError) as error:
        raise ValueError(f"{where}: qwen-vl-utils could not resize it: {error}") from None
    return image, ResizeSettings(low, high, image.height, image.width, original_height=original.height,
                                 original_width=original.width)


def _fetch_frames(vp, where: str, part: dict, limits: tuple[int, int], patch: int, temporal: int):
    """A frame list resized once, to qwen-vl-utils' ``smart_resize`` of the original frame size
    under the item's limits: (frames, settings). qwen-vl-utils' own ``fetch_video`` resizes a
    frame list twice (``fetch_image`` at twice the factor, then ``smart_resize``), so its
    size can differ; rlk_mm does not claim that size."""
    _check_keys(where, part, VIDEO_KEYS)
    video = part.get("video")
    if isinstance(video, (str, Path)):
        raise ValueError(
            f"{where}: a video file ({str(video)!r}) needs a video decoder, which rlk_mm does not run: decode it and pass "
            "its frames as a list (paths or PIL images), with 'fps' their frame rate"
        )
    if not isinstance(video, (list, tuple)) or not video:
        raise ValueError(f"{where}: a video part needs 'video': a non-empty list of frames (paths or PIL images)")
    if "fps" in part and "nframes" in part:
        raise ValueError(f"{where}: give 'fps' or 'nframes', not both (qwen-vl-utils accepts one)")
    frames = [vp.to_rgb(_open_image(f"{where}, frame {f}", frame)) for f, frame in enumerate(video)]
    for f, frame in enumerate(frames):
        if frame.size != frames[0].size:
            raise ValueError(f"{where}: frame {f} is {frame.width}×{frame.height} but frame 0 is "
                             f"{frames[0].width}×{frames[0].height}; a video's frames must share one size")
    fps = _positive(where, "fps", part["fps"]) if "fps" in part else DEFAULT_FPS
    indices = list(range(len(frames)))
    if "nframes" in part:
        indices = _sampled_frames(vp, where, _count(where, "nframes", part["nframes"]), len(frames))
    if len(indices) < temporal:
        raise ValueError(f"{where}: {len(indices)} frame(s); a video needs at least the temporal patch, {temporal} frames")
    indices += [indices[-1]] * (-len(indices) % temporal)  # qwen-vl-utils repeats the last frame up to the frame factor
    low, high = _pixel_limits(where, part, limits)
    total = _count(where, "total_pixels", part["total_pixels"]) if "total_pixels" in part else None
    if total is not None:  # qwen-vl-utils' per-frame cap from a whole-video budget
        high = min(high, max(int(total / len(indices) * temporal), int(low * 1.05)))
    requested = _requested_size(where, part)
    factor = patch * vp.SPATIAL_MERGE_SIZE
    try:
        if requested:
            height, width = vp.smart_resize(*requested, factor=factor)
        else:
            height, width = vp.smart_resize(frames[0].height, frames[0].width, factor=factor, min_pixels=low, max_pixels=high)
    except (ValueError, AssertionError) as error:
        raise ValueError(f"{where}: qwen-vl-utils could not resize it: {error}") from None
    if height < factor or width < factor:  # smart_resize floors a narrow frame's short side to 0 under max_pixels
        raise ValueError(f"{where}: qwen-vl-utils sized its {frames[0].width}×{frames[0].height} frames to {width}×{height}, "
                         "a side below one patch: raise max_pixels or give less narrow frames")
    from PIL import Image

    resized = [frames[i].resize((width, height), Image.BICUBIC) for i in indices]
    return resized, ResizeSettings(low, high, height, width, total, fps, tuple(indices), original_height=frames[0].height,
                                   original_width=frames[0].width)


def _sampled_frames(vp, where: str, nframes: int, total: int) -> list[int]:
    """The indices of the frames qwen-vl-utils' video readers keep for ``nframes`` of ``total``
    frames: ``nframes`` rounded to the nearest multiple of its frame factor (2; Python's
    ``round``, so a half rounds to even: 3 -> 4, 5 -> 4, 7 -> 8), which must lie in
    ``[2, total]``, then that many indices spread evenly over ``[0, total - 1]`` and rounded
    (``linspace(...).round()``). An odd ``nframes`` is thus never taken as it is."""
    factor = vp.FRAME_FACTOR
    count = vp.round_by_factor(nframes, factor)
    if not factor <= count <= total:
        raise ValueError(f"{where}: nframes {nframes} rounds to {count} frames (qwen-vl-utils takes the nearest multiple "
                         f"of {factor}, a half rounding to even), outside [{factor}, {total}] for the {total} frames "
                         f"given: give nframes between {factor} and {total - total % factor}, or more frames")
    return torch.linspace(0, total - 1, count).round().long().tolist()


def _conversation_list(conversations, markers: Sequence[str]) -> list:
    """The conversations, checked: messages with a str role and a str or list content, text
    parts with a str text, no text holding a chat marker (``markers``)."""
    if isinstance(conversations, (str, bytes, dict)) or not isinstance(conversations, Sequence):
        raise TypeError(f"conversations must be a list of conversations (each a list of message dicts), got {type(conversations).__name__}")
    if not conversations:
        raise ValueError("conversations is empty")
    if isinstance(conversations[0], dict):
        raise TypeError("conversations is a list of messages (one conversation): pass a list of conversations, e.g. [messages]")
    for c, conversation in enumerate(conversations):
        if isinstance(conversation, (str, bytes, dict)) or not isinstance(conversation, Sequence) or not conversation:
            raise TypeError(f"conversation {c} must be a non-empty list of message dicts, got {type(conversation).__name__}")
        for m, message in enumerate(conversation):
            where = f"conversation {c}, message {m}"
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"{where}: a message is a dict with 'role' and 'content'")
            if not isinstance(message["role"], str) or not message["role"]:
                raise TypeError(f"{where}: 'role' must be a non-empty str ('system', 'user', 'assistant'), got "
                                f"{message['role']!r:.80}")
            content = message["content"]
            if isinstance(content, str):
                check_plain_text(f"{where}: content", content, markers)
                continue
            if not isinstance(content, list):
                raise TypeError(f"{where}: 'content' must be a str or a list of parts, got {type(content).__name__}")
            for k, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("text", "image", "video"):
                    raise ValueError(f"{where}, part {k}: a content part is a dict with 'type' "
                                     f"'text', 'image' or 'video', got {part!r:.80}")
                if part["type"] == "text":
                    if not isinstance(part.get("text"), str):
                        raise TypeError(f"{where}, part {k}: a text part needs 'text', a str; got "
                                        f"{'no text' if 'text' not in part else type(part['text']).__name__}")
                    check_plain_text(f"{where}, part {k}: text", part["text"], markers)
    return list(conversations)


def _media_parts(conversation) -> list[dict]:
    return [p for m in conversation if isinstance(m["content"], list) for p in m["content"] if p["type"] != "text"]


# ----------------------------------------------------------------------------- the builder
def fields_from_messages(
    conversations,
    *,
    processor,
    responses=None,
    add_generation_prompt: bool = True,
    response_mask=None,
    group_ids=None,
    rewards=None,
    costs=None,
    media_ids: Optional[Sequence[str]] = None,
    tokens_per_second: Optional[float] = None,
    assistant_turns: bool = False,
    bbox_targets=None,
    point_targets=None,
    screen_size=None,
    coordinate_system=None,
) -> dict:
    """The fields of an RLBatch (``RLBatch.from_messages``) from Qwen-VL chat conversations.

    ``conversations``: a list of conversations, each a list of ``{"role", "content"}``
    messages; content parts are ``{"type": "text", "text"}``, ``{"type": "image", "image":
    path | "file://..." | "data:image/...;base64,..." | PIL image, "min_pixels", "max_pixels",
    "resized_height", "resized_width"}`` and ``{"type": "video", "video": [frames: paths or
    PIL images], "fps" (the frames' rate) or "nframes" (sampled as qwen-vl-utils' video readers sample: rounded
    to an even count, a half to even, then spread evenly over the frames), "min_pixels",
    "max_pixels", "total_pixels", "resized_height", "resized_width"}``. Pixel limits an item
    does not give are the processor's. URLs and video files are refused.
    ``assistant_turns=True`` scores every assistant message of a conversation (its content
    tokens and its ``<|im_end|>``, as a response is scored) besides the appended
    ``responses``; for a finished conversation pass ``add_generation_prompt=False``. The other
    arguments are ``from_qwen_vl``'s. Each item's cache key ends with its settings and its
    original size (``media.key_settings`` reads them; ``RLBatch.media_original_sizes`` the
    sizes). Errors name the conversation and the item.

    Raises
    ------
    TypeError
        ``processor`` is not a Qwen-VL processor; a message's role is not a str, its content
        neither a str nor a list of parts, or a text part has no str ``text``.
    SchemaError
        A text holds a chat marker the template writes itself (a forged turn or media item), or
        an image or frame has a zero side or an aspect ratio above 200.
    ValueError, FileNotFoundError
        A media item that cannot be read or resized, or bad resize settings (naming the item)."""
    processor = vl_processor_arg(processor)
    conversations = _conversation_list(conversations, chat_markers(processor))
    if not isinstance(add_generation_prompt, bool):
        raise TypeError(f"add_generation_prompt must be a bool, got {type(add_generation_prompt).__name__}")
    vp = vision_process()
    limits = processor_limits(processor)
    ip = processor.image_processor
    images, videos, fps = [], [], []
    image_settings, video_settings = [], []
    texts = []
    for c, conversation in enumerate(conversations):
        counts = {"image": 0, "video": 0}
        for part in _media_parts(conversation):
            kind = part["type"]
            where = f"conversation {c}, {kind} #{counts[kind]}"
            counts[kind] += 1
            if kind == "image":
                image, settings = _fetch_image(vp, where, part, limits, ip.patch_size)
                images.append(image)
                image_settings.append((where, settings))
            else:
                frames, settings = _fetch_frames(vp, where, part, limits, ip.patch_size, ip.temporal_patch_size)
                videos.append(frames)
                fps.append(settings.fps)
                video_settings.append((where, settings))
        text = processor.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        for kind, token in (("image", processor.image_token), ("video", processor.video_token)):
            if text.count(token) != counts[kind]:
                raise ValueError(
                    f"conversation {c}: its chat text holds {text.count(token)} {token} placeholder(s) but it names "
                    f"{counts[kind]} {kind} item(s): a text part must not hold {token}; name each {kind} by a "
                    f"{{'type': '{kind}'}} part"
                )
        texts.append(text)
    family = layout_family_of(processor)
    video_kwargs = {}
    if videos and family is not None and family.splits_video:  # Qwen3-VL writes each patch's time from the frame rate
        if len(set(fps)) > 1:
            raise ValueError(f"conversations: the videos have frame rates {sorted(set(fps))}; {family.label} writes each "
                             "temporal patch's timestamp from one frame rate per processor call: build videos of "
                             "different frame rates in separate calls")
        video_kwargs = {"videos_kwargs": {"fps": fps[0]}}
    output = processor(
        text=texts, images=images or None, videos=videos or None, padding=True, padding_side="left",
        return_tensors="pt", images_kwargs={"do_resize": False},  # exactly qwen-vl-utils' sizes
        **video_kwargs,
    )
    if videos:  # the processor takes one fps for all videos: each video's own, as the processor computes it
        output["second_per_grid_ts"] = torch.tensor([ip.temporal_patch_size / f for f in fps])
    recorded = image_settings + video_settings
    per_item = recorded
    if videos and family is not None and family.splits_video:  # one item per temporal patch: each carries its video's settings
        patches = output["video_grid_thw"][:, 0].tolist()
        per_item = image_settings + [settings for settings, t in zip(video_settings, patches) for _ in range(t)]
    _check_grids(output, recorded, ip.patch_size, ip.temporal_patch_size)
    fields = fields_from_qwen_vl(
        output, processor=processor, responses=responses, response_mask=response_mask, group_ids=group_ids,
        rewards=rewards, costs=costs, media_ids=media_ids, tokens_per_second=tokens_per_second,
        bbox_targets=bbox_targets, point_targets=point_targets, screen_size=screen_size, coordinate_system=coordinate_system,
        assistant_turns=assistant_turns,
    )
    fields["media_cache_keys"] = [settings_key(key, s) for key, (_, s) in zip(fields["media_cache_keys"], per_item, strict=True)]
    return fields


def _check_grids(output, recorded: list[tuple[str, ResizeSettings]], patch: int, temporal: int) -> None:
    """Every item's grid is the size qwen-vl-utils chose: the processor did not resize it again."""
    grids = [g for name in ("image_grid_thw", "video_grid_thw") if output.get(name) is not None for g in output[name].tolist()]
    for (where, s), grid in zip(recorded, grids):
        t = 1 if s.frames is None else len(s.frames) // temporal
        want = [t, s.resized_height // patch, s.resized_width // patch]
        if grid != want:
            raise ValueError(
                f"{where}: qwen-vl-utils resized it to {s.resized_width}×{s.resized_height} (grid {want}) but the processor "
                f"made grid {grid}: the processor's pixel limits exclude that size; give the item min/max_pixels within "
                "the processor's, or build the processor with wider limits"
            )


__all__: list[str] = []
