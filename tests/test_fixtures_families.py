"""rlk_mm.fixtures per family: the Qwen2-VL and Qwen3-VL processors beside Qwen2.5-VL's, each a
real transformers processor, and a tiny random model of each family (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, Qwen3-VL-MoE) run on its own processor's output."""

import hashlib
import json
import math

import pytest
import torch
from PIL import Image
from transformers import (
    AutoTokenizer,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLForConditionalGeneration,
    Qwen2VLProcessor,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from rlk_mm import fixtures as F

pytestmark = pytest.mark.usefixtures("one_thread")

VS, VE = "<|vision_start|>", "<|vision_end|>"
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"

#: family -> (processor builder, model builder, processor class, model class, vision patch)
FAMILIES = {
    "qwen2_vl": (F.qwen2_vl_processor, F.tiny_qwen2_vl, Qwen2VLProcessor, Qwen2VLForConditionalGeneration, 14),
    "qwen2_5_vl": (F.qwen_vl_processor, F.tiny_qwen2_5_vl, Qwen2_5_VLProcessor, Qwen2_5_VLForConditionalGeneration, 14),
    "qwen3_vl": (F.qwen3_vl_processor, F.tiny_qwen3_vl, Qwen3VLProcessor, Qwen3VLForConditionalGeneration, 16),
    "qwen3_vl_moe": (F.qwen3_vl_processor, F.tiny_qwen3_vl_moe, Qwen3VLProcessor, Qwen3VLMoeForConditionalGeneration, 16),
}


@pytest.fixture(scope="module")
def processors():
    """One processor per builder (Qwen3-VL and Qwen3-VL-MoE share theirs)."""
    built = {}
    return {name: built.setdefault(make, make()) for name, (make, *_) in FAMILIES.items()}


@pytest.fixture(scope="module")
def models():
    return {name: make(seed=0) for name, (_, make, *_) in FAMILIES.items()}


def _runs(ids: list[int], token: int) -> list[int]:
    """Length of each run of `token`, checking every run sits between vision start and end."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            assert ids[i - 1] == F.VISION_START_TOKEN_ID and ids[j] == F.VISION_END_TOKEN_ID
            runs.append(j - i)
            i = j
        else:
            i += 1
    return runs


def _types(ids: torch.Tensor) -> torch.Tensor:
    """The mm_token_type_ids Qwen's processors write: 1 image placeholder, 2 video placeholder."""
    return (ids == F.IMAGE_TOKEN_ID).long() + 2 * (ids == F.VIDEO_TOKEN_ID).long()


def _video_prompt(question: str = "What colour is the moving square?") -> str:
    return SYSTEM + "<|im_start|>user\n{}" + question + "<|im_end|>\n<|im_start|>assistant\n"


# --------------------------------------------------------------------------- processors


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_processor_is_its_familys_real_processor(processors, name):
    processor, (_, _, processor_class, _, patch) = processors[name], FAMILIES[name]
    assert isinstance(processor, processor_class)
    others = {Qwen2VLProcessor, Qwen2_5_VLProcessor, Qwen3VLProcessor} - {processor_class}
    assert not any(isinstance(processor, other) for other in others)
    image, video = processor.image_processor, processor.video_processor
    assert (image.patch_size, image.merge_size, image.temporal_patch_size) == (patch, 2, 2)
    assert (video.patch_size, video.merge_size, video.temporal_patch_size) == (patch, 2, 2)
    assert list(video.image_mean) == list(image.image_mean) and list(video.image_std) == list(image.image_std)
    tokenizer = processor.tokenizer
    specials = ("<|image_pad|>", "<|video_pad|>", VS, VE, "<|im_end|>", "<|endoftext|>")
    assert tokenizer.convert_tokens_to_ids(list(specials)) == [
        F.IMAGE_TOKEN_ID, F.VIDEO_TOKEN_ID, F.VISION_START_TOKEN_ID, F.VISION_END_TOKEN_ID, F.IM_END_TOKEN_ID,
        F.ENDOFTEXT_TOKEN_ID,
    ]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert f"{VS}<|image_pad|>{VE}{VS}<|video_pad|>{VE}?" in text


def test_qwen3_vl_processor_follows_the_released_preprocessing(processors):
    """Patch 16, and the mean / std of transformers' Qwen3-VL video processor (0.5 per channel, as
    the released checkpoints' image processor); pixel limits in 32-pixel units."""
    image = processors["qwen3_vl"].image_processor
    assert list(image.image_mean) == list(Qwen3VLVideoProcessor.image_mean) == [0.5] * 3
    assert list(image.image_std) == list(Qwen3VLVideoProcessor.image_std) == [0.5] * 3
    assert (image.size.shortest_edge, image.size.longest_edge) == (F.QWEN3_VL_MIN_PIXELS, F.QWEN3_VL_MAX_PIXELS)
    assert (F.QWEN3_VL_MIN_PIXELS, F.QWEN3_VL_MAX_PIXELS) == (4 * 32 * 32, 64 * 32 * 32)
    processor = F.qwen3_vl_processor()
    prompt = f"{VS}<|image_pad|>{VE}"
    for side, grid in ((64, [1, 4, 4]), (256, [1, 16, 16]), (512, [1, 16, 16]), (20, [1, 4, 4])):
        out = processor(text=[prompt], images=[Image.new("RGB", (side, side))], return_tensors="pt")
        assert out["image_grid_thw"].tolist() == [grid], side
        assert out["pixel_values"].shape == (math.prod(grid), 3 * 2 * 16 * 16)
    wider = F.qwen3_vl_processor(max_pixels=128 * 32 * 32)
    assert wider.image_processor.size.longest_edge == wider.video_processor.size["longest_edge"] == 128 * 32 * 32


def test_qwen3_vl_image_prompt_placeholders_and_token_types(processors):
    processor = processors["qwen3_vl"]
    samples = F.synthetic_image_text(3, seed=4, max_images=2)
    out = F.processor_inputs(processor, samples)
    assert set(out) == {"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"}
    grids = iter(out["image_grid_thw"].tolist())
    for b, sample in enumerate(samples):
        ids = out["input_ids"][b][out["attention_mask"][b].bool()]
        assert _runs(ids.tolist(), F.IMAGE_TOKEN_ID) == [math.prod(next(grids)) // 4 for _ in sample.images]
        assert torch.equal(out["mm_token_type_ids"][b][out["attention_mask"][b].bool()], _types(ids))
    assert next(grids, None) is None
    assert out["pixel_values"].shape == (int(out["image_grid_thw"].prod(-1).sum()), 3 * 2 * 16 * 16)


@pytest.mark.parametrize(
    ("num_frames", "fps", "stamps"),
    [
        (4, None, ["0.2", "1.2"]),  # 2 fps: patches (0, 0.5 s) and (1, 1.5 s), their midpoints 0.25 and 1.25 s
        (5, None, ["0.2", "1.2", "2.0"]),  # the odd last frame is repeated: (2, 2 s)
        (4, 1.0, ["0.5", "2.5"]),
    ],
)
def test_qwen3_vl_video_is_written_per_temporal_patch_with_timestamps(processors, num_frames, fps, stamps):
    """transformers' own Qwen3-VL expansion: each temporal patch as `<t seconds>` text, vision
    start, its placeholders and vision end; the chat template's outer pair is collapsed, so no
    vision start / end surrounds the whole video."""
    processor = processors["qwen3_vl"]
    sample = F.synthetic_video_text(1, seed=3, num_frames=num_frames)[0]  # 84x56 frames: 4x6 patches -> 6 tokens
    text = processor.apply_chat_template(sample.messages, tokenize=False, add_generation_prompt=True)
    assert f"{VS}<|video_pad|>{VE}" in text
    kwargs = {} if fps is None else {"fps": fps}
    out = processor(text=[text], videos=sample.videos, return_tensors="pt", **kwargs)
    assert set(out) == {"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values_videos", "video_grid_thw"}
    assert out["video_grid_thw"].tolist() == [[len(stamps), 4, 6]]
    video = "".join(f"<{t} seconds>{VS}{'<|video_pad|>' * 6}{VE}" for t in stamps)
    want = processor.tokenizer(_video_prompt().format(video), return_tensors="pt")["input_ids"]
    assert torch.equal(out["input_ids"], want)
    ids = out["input_ids"][0]
    assert int((ids == F.VISION_START_TOKEN_ID).sum()) == int((ids == F.VISION_END_TOKEN_ID).sum()) == len(stamps)
    assert _runs(ids.tolist(), F.VIDEO_TOKEN_ID) == [6] * len(stamps)
    assert torch.equal(out["mm_token_type_ids"][0], _types(ids))
    assert out["pixel_values_videos"].shape == (len(stamps) * 24, 3 * 2 * 16 * 16)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen2_families_write_a_video_as_one_run(processors, name):
    """Qwen2-VL and Qwen2.5-VL: one vision start, t*h*w/4 placeholders, one vision end, no
    timestamps; only Qwen2.5-VL reports seconds per temporal patch."""
    processor = processors[name]
    sample = F.synthetic_video_text(1, seed=3, num_frames=4)[0]  # 84x56 -> 6x4 patches of 14 (resized)
    text = processor.apply_chat_template(sample.messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], videos=sample.videos, return_tensors="pt")
    t, h, w = out["video_grid_thw"][0].tolist()
    want = processor.tokenizer(_video_prompt().format(f"{VS}{'<|video_pad|>' * (t * h * w // 4)}{VE}"), return_tensors="pt")
    assert torch.equal(out["input_ids"], want["input_ids"])
    assert torch.equal(out["mm_token_type_ids"][0], _types(out["input_ids"][0]))
    assert ("second_per_grid_ts" in out) == (name == "qwen2_5_vl")


def test_qwen3_vl_processor_from_a_local_model_directory(tmp_path, processors):
    """A directory laid out like a Qwen3-VL release (tokenizer, preprocessor_config.json with patch
    16 and mean / std 0.5, chat_template.json) gives the offline processor's output."""
    processor = processors["qwen3_vl"]
    processor.tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = {
        "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": F.QWEN2_VL_CHAT_TEMPLATE}))
    loaded = F.qwen3_vl_processor(tmp_path, min_pixels=F.QWEN3_VL_MIN_PIXELS, max_pixels=F.QWEN3_VL_MAX_PIXELS)
    assert isinstance(loaded, Qwen3VLProcessor) and loaded.image_processor.patch_size == 16
    samples = F.synthetic_image_text(2, seed=5) + F.synthetic_video_text(1, seed=5, with_image=True)
    ours, theirs = F.processor_inputs(loaded, samples), F.processor_inputs(processor, samples)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_qwen2_5_vl_fixture_is_unchanged(processors):
    """`qwen_vl_processor()` is still Qwen2.5-VL's processor built from the parts it has always
    used (patch 14, OpenAI CLIP mean / std, the default pixel limits), with the same output."""
    processor = processors["qwen2_5_vl"]
    assert type(processor) is F.Qwen2_5_VLFramesProcessor and issubclass(F.Qwen2_5_VLFramesProcessor, Qwen2_5_VLProcessor)
    image = processor.image_processor
    assert (list(image.image_mean), list(image.image_std)) == (list(OPENAI_CLIP_MEAN), list(OPENAI_CLIP_STD))
    assert (image.size.shortest_edge, image.size.longest_edge) == (F.DEFAULT_MIN_PIXELS, F.DEFAULT_MAX_PIXELS)
    by_hand = F.Qwen2_5_VLFramesProcessor(
        image_processor=type(image)(min_pixels=F.DEFAULT_MIN_PIXELS, max_pixels=F.DEFAULT_MAX_PIXELS),
        tokenizer=AutoTokenizer.from_pretrained(F.qwen_tokenizer_dir()),
        video_processor=F.FramesVideoProcessor(),
        chat_template=F.QWEN2_VL_CHAT_TEMPLATE,
    )
    samples = F.synthetic_image_text(3, seed=1) + F.synthetic_video_text(1, seed=1, num_frames=5, with_image=True)
    ours, theirs = F.processor_inputs(processor, samples), F.processor_inputs(by_hand, samples)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    # as the fixture wrote them before the other families joined (computed with that code)
    assert ours["image_grid_thw"].prod(-1).tolist() == [24, 40, 24, 48, 60, 16, 16]
    assert ours["video_grid_thw"].tolist() == [[3, 4, 6]] and ours["second_per_grid_ts"].tolist() == [1.0]
    assert hashlib.sha256(ours["input_ids"].numpy().tobytes()).hexdigest()[:16] == "28f18c9c88d276ee"


# --------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tiny_model_config_agrees_with_its_processor(processors, models, name):
    processor, model, (*_, model_class, patch) = processors[name], models[name], FAMILIES[name]
    assert type(model) is model_class and not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    config, text, vision = model.config, model.config.text_config, model.config.vision_config
    assert config._attn_implementation == "sdpa" and not config.tie_word_embeddings
    assert (config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id) == (
        F.IMAGE_TOKEN_ID, F.VIDEO_TOKEN_ID, F.VISION_START_TOKEN_ID, F.VISION_END_TOKEN_ID)
    assert (text.eos_token_id, text.pad_token_id) == (F.IM_END_TOKEN_ID, F.ENDOFTEXT_TOKEN_ID)
    assert text.vocab_size == len(processor.tokenizer) == F.QWEN_VOCAB_SIZE
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (patch, 2, 2)
    out_hidden = vision.hidden_size if name == "qwen2_vl" else vision.out_hidden_size
    assert out_hidden == text.hidden_size
    head_dim = text.hidden_size // text.num_attention_heads
    attention = model.model.language_model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (text.num_attention_heads * head_dim, text.hidden_size)
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    if name.startswith("qwen3"):
        assert text.rope_parameters["mrope_interleaved"] is True
        assert text.rope_parameters["mrope_section"] == [4, 2, 2]  # 24 : 20 : 20 of Qwen3-VL's 64
        assert all(0 <= i < vision.depth for i in vision.deepstack_visual_indexes)
        assert math.isqrt(vision.num_position_embeddings) ** 2 == vision.num_position_embeddings
    if name == "qwen3_vl_moe":
        assert (text.num_experts, text.num_experts_per_tok) == (4, 2)
        for layer in model.model.language_model.layers:
            assert type(layer.mlp).__name__ == "Qwen3VLMoeTextSparseMoeBlock" and bool(layer.mlp.gate.weight.any())


def _samples(content: str):
    if content == "image":
        return F.synthetic_image_text(2, seed=6, max_images=2)
    return F.synthetic_video_text(2, seed=6, num_frames=4, with_image=True)


@pytest.mark.parametrize("content", ["image", "video"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_tiny_model_runs_on_its_own_processors_output(processors, models, name, content):
    processor, model = processors[name], models[name]
    out = F.processor_inputs(processor, _samples(content))
    with torch.no_grad():
        logits = model(**out).logits
    assert logits.shape == (*out["input_ids"].shape, F.QWEN_VOCAB_SIZE) and bool(logits.isfinite().all())

    kw = {k: out[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in out}
    positions, _ = model.model.get_rope_index(
        out["input_ids"], mm_token_type_ids=out["mm_token_type_ids"], attention_mask=out["attention_mask"], **kw
    )
    assert positions.shape == (3, *out["input_ids"].shape)
    for b in range(len(out["input_ids"])):
        mask = out["attention_mask"][b].bool()
        ids, pos = out["input_ids"][b][mask], positions[:, b, mask]
        text = out["mm_token_type_ids"][b][mask] == 0
        assert pos[0, 0] == 0 and torch.equal(pos[0, text], pos[1, text]) and torch.equal(pos[0, text], pos[2, text])
        if content == "video" and name.startswith("qwen3"):
            # every temporal patch is its own vision item: one t, placed after the previous patch and its timestamp
            video = (ids == F.VIDEO_TOKEN_ID).nonzero().flatten()
            first, second = video[:6], video[6:]
            assert len(video) == 12 and bool((pos[0, first] == pos[0, first[0]]).all())
            assert bool((pos[0, second] == pos[0, second[0]]).all()) and pos[0, second[0]] > pos[:, first].max()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tiny_model_weights_depend_on_the_seed_alone(name):
    make = FAMILIES[name][1]
    rng = torch.get_rng_state()
    a, b, c = make(seed=3), make(seed=3), make(seed=4)
    assert torch.equal(torch.get_rng_state(), rng)
    a, b, c = a.state_dict(), b.state_dict(), c.state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    drawn = [k for k in a if k.endswith("weight") and a[k].dim() >= 2]
    assert drawn and all(not torch.equal(a[k], c[k]) for k in drawn)
