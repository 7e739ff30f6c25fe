"""rlk_mm.fixtures: the real processor, the tiny model, synthetic samples, Geo3K."""

import io
import json
from pathlib import Path

import jinja2
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from rlk_mm import fixtures as F

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def media_runs(ids: list[int]) -> list[tuple[int, int]]:
    """(token id, length) of each run of image/video placeholder tokens, checking that
    every run sits between <|vision_start|> and <|vision_end|>."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] in (F.IMAGE_TOKEN_ID, F.VIDEO_TOKEN_ID):
            j = i
            while j < len(ids) and ids[j] == ids[i]:
                j += 1
            assert ids[i - 1] == F.VISION_START_TOKEN_ID and ids[j] == F.VISION_END_TOKEN_ID
            runs.append((ids[i], j - i))
            i = j
        else:
            i += 1
    return runs


def check_layout(batch, samples, padding_side, tokenizer):
    """Per sample: padding on the asked side, and one placeholder run per media item, in
    order, whose length is prod(grid_thw) / merge**2."""
    image_grids = iter(batch.get("image_grid_thw", torch.zeros(0, 3)).tolist())
    video_grids = iter(batch.get("video_grid_thw", torch.zeros(0, 3)).tolist())
    generation_prompt = tokenizer("<|im_start|>assistant\n")["input_ids"]
    for b, sample in enumerate(samples):
        mask = batch["attention_mask"][b].bool()
        n = int(mask.sum())
        expected_mask = torch.zeros_like(mask)
        if padding_side == "left":
            expected_mask[len(mask) - n :] = True
        else:
            expected_mask[:n] = True
        assert torch.equal(mask, expected_mask)
        ids = batch["input_ids"][b][mask].tolist()
        assert ids[0] == F.IM_START_TOKEN_ID and ids[-len(generation_prompt) :] == generation_prompt
        expected = [(F.IMAGE_TOKEN_ID, next(image_grids)) for _ in sample.images]
        expected += [(F.VIDEO_TOKEN_ID, next(video_grids)) for _ in sample.videos]
        assert media_runs(ids) == [(token, t * h * w // 4) for token, (t, h, w) in expected]
        types = batch["mm_token_type_ids"][b][mask]
        ids_t = torch.tensor(ids)
        assert torch.equal(types, (ids_t == F.IMAGE_TOKEN_ID).long() + 2 * (ids_t == F.VIDEO_TOKEN_ID).long())
    assert next(image_grids, None) is None and next(video_grids, None) is None


# --------------------------------------------------------------------------- processor


def test_processor_is_the_real_qwen2_5_vl_processor(processor):
    assert isinstance(processor, Qwen2_5_VLProcessor)
    assert isinstance(processor.image_processor, Qwen2VLImageProcessorPil)
    tokenizer = processor.tokenizer
    assert len(tokenizer) == F.QWEN_VOCAB_SIZE
    expected = {
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<|vision_start|>": 151652,
        "<|vision_end|>": 151653,
        "<|image_pad|>": 151655,
        "<|video_pad|>": 151656,
        "<|endoftext|>": 151643,
    }
    assert {token: tokenizer.convert_tokens_to_ids(token) for token in expected} == expected
    assert (processor.image_token_id, processor.video_token_id) == (F.IMAGE_TOKEN_ID, F.VIDEO_TOKEN_ID)
    ip = processor.image_processor
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (14, 2, 2)
    assert (ip.size.shortest_edge, ip.size.longest_edge) == (F.DEFAULT_MIN_PIXELS, F.DEFAULT_MAX_PIXELS)
    assert F.qwen_vl_processor(max_pixels=28 * 28 * 16).image_processor.size.longest_edge == 28 * 28 * 16


def test_chat_template_one_and_two_images(processor):
    def render(messages, **kwargs):
        return processor.apply_chat_template(messages, tokenize=False, **kwargs)

    one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    assert render(one, add_generation_prompt=True) == (
        SYSTEM + "<|im_start|>user\n" + IMAGE + "What is this?<|im_end|>\n<|im_start|>assistant\n"
    )
    two = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "A:"},
                {"type": "image"},
                {"type": "text", "text": " B:"},
                {"type": "image"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Two."}]},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "And this?"}]},
    ]
    assert render(two) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nA:" + IMAGE + " B:" + IMAGE + "<|im_end|>\n"
        "<|im_start|>assistant\nTwo.<|im_end|>\n"
        "<|im_start|>user\n" + VIDEO + "And this?<|im_end|>\n"
    )
    with pytest.raises(jinja2.TemplateError, match="unknown content part type: audio"):
        render([{"role": "user", "content": [{"type": "audio"}]}])


def test_one_112x112_image_gives_16_image_tokens_in_the_exact_layout(processor):
    image = Image.new("RGB", (112, 112), (10, 200, 30))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    sample = F.Sample("one", messages, [image])
    batch = F.processor_inputs(processor, [sample])
    tokenizer = processor.tokenizer
    prefix = tokenizer(SYSTEM + "<|im_start|>user\n")["input_ids"]
    suffix = tokenizer("Hi<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    expected = prefix + [F.VISION_START_TOKEN_ID] + [F.IMAGE_TOKEN_ID] * 16 + [F.VISION_END_TOKEN_ID] + suffix
    assert batch["input_ids"].tolist() == [expected]
    assert batch["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert tuple(batch["pixel_values"].shape) == (64, 3 * 2 * 14 * 14)
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == F.IMAGE_TOKEN_ID).long())


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_processor_inputs_multi_image_and_text_only(processor, padding_side):
    samples = F.synthetic_image_text(6, seed=3, allow_text_only=True)
    assert {len(s.images) for s in samples} >= {0, 2}  # the seed gives text-only and multi-image samples
    batch = F.processor_inputs(processor, samples, padding_side=padding_side)
    assert set(batch) == {"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"}
    assert len(batch["image_grid_thw"]) == sum(len(s.images) for s in samples)
    assert len(batch["pixel_values"]) == int(batch["image_grid_thw"].prod(-1).sum())
    check_layout(batch, samples, padding_side, processor.tokenizer)
    with pytest.raises(ValueError, match="padding_side"):
        F.processor_inputs(processor, samples, padding_side="middle")


def test_processor_from_a_local_model_directory(tmp_path, processor):
    """A directory laid out like a Qwen2.5-VL release: tokenizer files, a
    preprocessor_config.json naming Qwen2VLImageProcessor, a legacy chat_template.json."""
    processor.tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()  # the offline tokenizer's own template is text-only
    config = {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": F.QWEN2_VL_CHAT_TEMPLATE}))

    loaded = F.qwen_vl_processor(tmp_path)
    assert isinstance(loaded, Qwen2_5_VLProcessor)
    assert (loaded.image_processor.size.shortest_edge, loaded.image_processor.size.longest_edge) == (3136, 12845056)
    assert loaded.chat_template == F.QWEN2_VL_CHAT_TEMPLATE

    narrowed = F.qwen_vl_processor(tmp_path, max_pixels=F.DEFAULT_MAX_PIXELS)
    samples = F.synthetic_image_text(2, seed=5) + F.synthetic_video_text(1, seed=5)
    ours, theirs = F.processor_inputs(narrowed, samples), F.processor_inputs(processor, samples)
    for key in ("input_ids", "attention_mask", "image_grid_thw", "video_grid_thw", "mm_token_type_ids"):
        assert torch.equal(ours[key], theirs[key]), key
    with pytest.raises(FileNotFoundError, match="not a directory"):
        F.qwen_vl_processor(tmp_path / "missing")


# --------------------------------------------------------------------------- video


def test_video_items_layout_and_model_positions(processor, tiny_model):
    model = tiny_model
    samples = F.synthetic_video_text(2, seed=1, num_frames=5, with_image=True)
    batch = F.processor_inputs(processor, samples, padding_side="right")
    # 84x56 frames: 6x4 patches; 5 frames padded to 6 -> 3 temporal patches
    assert batch["video_grid_thw"].tolist() == [[3, 4, 6], [3, 4, 6]]
    assert len(batch["pixel_values_videos"]) == 2 * 3 * 4 * 6
    assert batch["second_per_grid_ts"].tolist() == [2 / F.DEFAULT_VIDEO_FPS] * 2
    check_layout(batch, samples, "right", processor.tokenizer)

    positions, _ = model.model.get_rope_index(
        batch["input_ids"],
        batch["mm_token_type_ids"],
        batch["image_grid_thw"],
        batch["video_grid_thw"],
        batch["second_per_grid_ts"],
        batch["attention_mask"],
    )
    video = batch["input_ids"][0] == F.VIDEO_TOKEN_ID
    t, h, w = positions[:, 0, video].view(3, 3, 2, 3)  # [t, h/2, w/2] merged grid
    step = model.config.vision_config.tokens_per_second * 2 / F.DEFAULT_VIDEO_FPS
    assert torch.equal(t[:, 0, 0] - t[0, 0, 0], torch.arange(3) * int(step))
    assert torch.equal(h[0, :, 0] - h[0, 0, 0], torch.arange(2)) and torch.equal(w[0, 0] - w[0, 0, 0], torch.arange(3))
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (*batch["input_ids"].shape, F.QWEN_VOCAB_SIZE) and bool(logits.isfinite().all())


def test_video_patches_follow_the_real_image_processor_layout(processor):
    """Qwen's image path repeats a still image over the temporal patch, so a video of two
    equal frames must give exactly the image's patches; distinct frames fill the temporal
    slots in order, and an odd last frame is repeated."""
    image_processor = processor.image_processor
    frames = [Image.new("RGB", (84, 56), colour) for colour in ((250, 0, 0), (0, 250, 0), (0, 0, 250))]

    def video_patches(video):
        return processor.video_processor(videos=[video], return_tensors="pt")["pixel_values_videos"]

    def image_patches(image):  # [rows, C, temporal, 14*14]
        return image_processor(images=[image], return_tensors="pt")["pixel_values"].view(-1, 3, 2, 196)

    still = image_processor(images=[frames[0]], return_tensors="pt")["pixel_values"]
    assert torch.equal(video_patches([frames[0], frames[0]]), still)
    patches = video_patches(frames).view(2, -1, 3, 2, 196)  # 3 frames -> 2 temporal patches
    expected = [(0, 1), (2, 2)]
    for t, pair in enumerate(expected):
        for slot, frame in enumerate(pair):
            assert torch.equal(patches[t, :, :, slot], image_patches(frames[frame])[:, :, 0])
    as_array = np.stack([np.asarray(frame) for frame in frames])  # [T, H, W, C]; also [T, C, H, W] tensors
    assert torch.equal(video_patches(frames), video_patches(as_array))
    assert torch.equal(video_patches(frames), video_patches(torch.from_numpy(as_array).permute(0, 3, 1, 2)))
    text = IMAGE.replace("image", "video")
    out = processor(text=[text], videos=[frames[:2]], fps=4, return_tensors="pt")
    assert out["second_per_grid_ts"].tolist() == [0.5] and out["video_grid_thw"].tolist() == [[1, 4, 6]]
    with pytest.raises(ValueError, match=r"does not take \['num_frames'\]"):
        processor(text=[text], videos=[frames], num_frames=2)
    with pytest.raises(ValueError, match="same-sized frames"):
        processor.video_processor(videos=[[frames[0], Image.new("RGB", (140, 140))]])


# --------------------------------------------------------------------------- model


def test_tiny_model_forward_on_processor_output(processor, tiny_model):
    model = tiny_model
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration) and not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    config = model.config
    assert (config.image_token_id, config.video_token_id, config.vision_start_token_id) == (151655, 151656, 151652)
    assert config.text_config.vocab_size == len(processor.tokenizer)
    vision = config.vision_config
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (14, 2, 2)
    assert vision.out_hidden_size == config.text_config.hidden_size

    samples = F.synthetic_image_text(3, seed=2, allow_text_only=True)
    batch = F.processor_inputs(processor, samples)
    with torch.no_grad():
        features = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
        logits = model(**batch).logits
    assert [len(f) for f in features] == (batch["image_grid_thw"].prod(-1) // 4).tolist()
    assert logits.shape == (*batch["input_ids"].shape, F.QWEN_VOCAB_SIZE) and bool(logits.isfinite().all())

    positions, _ = model.model.get_rope_index(
        batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"], attention_mask=batch["attention_mask"]
    )
    for b in range(len(samples)):
        mask = batch["attention_mask"][b].bool()
        ids, pos = batch["input_ids"][b][mask], positions[:, b, mask]
        text = ids != F.IMAGE_TOKEN_ID
        assert torch.equal(pos[0, text], pos[1, text]) and torch.equal(pos[0, text], pos[2, text])
        assert pos[0, 0] == 0 and bool((pos[0, 1:][text[1:]] > pos[0, :-1][text[1:]]).all())


def test_tiny_model_is_deterministic_and_sizes_are_the_callers():
    rng_before = torch.get_rng_state()
    a, b = F.tiny_qwen2_5_vl(seed=7), F.tiny_qwen2_5_vl(seed=7)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert not a.training  # built in eval mode (the shared tiny_model fixture also calls .eval())
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = F.tiny_qwen2_5_vl(seed=8)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)

    big = F.tiny_qwen2_5_vl(hidden_size=128, vision_depth=1)
    assert big.config.text_config.hidden_size == 128 and big.config.vision_config.depth == 1
    assert big.config.vision_config.out_hidden_size == 128
    assert big.config.text_config.rope_parameters["mrope_section"] == [4, 6, 6]
    with pytest.raises(ValueError, match="num_heads"):
        F.tiny_qwen2_5_vl(hidden_size=60)
    # the rotary base: the checkpoints' 1e6 unless given; the width section's highest frequency
    assert big.config.text_config.rope_parameters["rope_theta"] == 1e6
    inv_freq = big.model.language_model.rotary_emb.inv_freq
    assert float(inv_freq[10]) < 2e-4  # 1e6 ** -0.625: adjacent image columns differ by < 2e-4 rad
    low = F.tiny_qwen2_5_vl(rope_theta=10.0)
    assert low.config.text_config.rope_parameters["rope_theta"] == 10.0
    for bad in (0.5, float("nan"), float("inf"), "10"):
        with pytest.raises((ValueError, TypeError), match="rope_theta"):
            F.tiny_qwen2_5_vl(rope_theta=bad)


# --------------------------------------------------------------------------- samples


def test_synthetic_samples_are_seeded():
    def fingerprint(samples):
        return [(s.id, s.messages, s.answer, [i.tobytes() for i in s.images]) for s in samples]

    a = F.synthetic_image_text(12, seed=4, allow_text_only=True)
    assert fingerprint(a) == fingerprint(F.synthetic_image_text(12, seed=4, allow_text_only=True))
    assert fingerprint(a) != fingerprint(F.synthetic_image_text(12, seed=5, allow_text_only=True))
    counts = [len(s.images) for s in a]
    assert 0 in counts and max(counts) <= 3 and len(set(counts)) >= 3
    for s in a:
        assert all(image.mode == "RGB" and image.size in F.DEFAULT_SIZES for image in s.images)
        if s.images:
            assert s.answer == str(sum(len(shapes) for shapes in s.meta["shapes"]))
        for image, shapes in zip(s.images, s.meta.get("shapes", [])):
            pixels = np.asarray(image)
            strip = image.width // len(shapes)
            for k, (colour, _) in enumerate(shapes):  # every counted shape is visible in its strip
                assert (pixels[:, k * strip : (k + 1) * strip] == F.SHAPE_COLOURS[colour]).all(-1).any()
    assert all(s.images for s in F.synthetic_image_text(12, seed=4))
    assert {len(s.images) for s in F.synthetic_image_text(8, seed=4, max_images=1, sizes=[(28, 28)])} == {1}
    with pytest.raises(ValueError, match="at least 28 pixels"):
        F.synthetic_image_text(1, sizes=[(20, 56)])

    v = F.synthetic_video_text(2, seed=4, num_frames=3)
    assert [[f.tobytes() for f in s.videos[0]] for s in v] == [
        [f.tobytes() for f in s.videos[0]] for s in F.synthetic_video_text(2, seed=4, num_frames=3)
    ]
    assert v[0].media_ids == [f"{v[0].id}/video0"]


def test_sample_checks_media_counts():
    with pytest.raises(ValueError, match=r"sample 'x': messages have 1 \{'type': 'image'\} parts but images holds 0"):
        F.Sample("x", [{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(ValueError, match="answer must be a str"):
        F.Sample("x", [{"role": "user", "content": "hi"}], answer=3)


# --------------------------------------------------------------------------- Geo3K


def test_load_geo3k_reads_all_real_problems(geo3k_dir, processor):
    samples = F.load_geo3k(geo3k_dir)
    rows = [json.loads(line) for line in (geo3k_dir / "problems.jsonl").read_text().splitlines()]
    assert len(samples) == 3
    assert [s.id for s in samples] == [f"geo3k-{i}" for i in (11, 12, 15)]
    assert samples[0].answer == "80" and samples[2].answer == "5 \\sqrt { 3 }"
    for sample, row in zip(samples, rows):
        assert sample.answer == row["choices"]["ABCD".index(row["answer_letter"])]
        assert [image.size for image in sample.images] == [(row["img_width"], row["img_height"])]
        assert sample.images[0].mode == "RGB"
        text = row["problem"].removeprefix("<image>")
        assert sample.messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        assert sample.meta["choices"] == row["choices"]
    batch = F.processor_inputs(processor, samples)
    check_layout(batch, samples, "left", processor.tokenizer)


def test_geo3k_sample_accepts_the_public_dataset_row_forms(geo3k_dir):
    diagram = Image.open(geo3k_dir / "12.png")
    png = io.BytesIO()
    diagram.save(png, format="PNG")
    forms = [
        ([diagram], None),
        ([{"bytes": png.getvalue(), "path": None}], None),
        ([str(geo3k_dir / "12.png")], None),
        ([{"path": "12.png"}], geo3k_dir),
    ]
    for images, root in forms:
        row = {"images": images, "problem": "<image>Find x.", "answer": "13"}
        sample = F.geo3k_sample(row, root=root, where="train[0]")
        assert sample.id == "geo3k-train[0]" and sample.answer == "13"
        assert sample.images[0].tobytes() == diagram.convert("RGB").tobytes()
    two = F.geo3k_sample({"images": [diagram, diagram], "problem": "Left <image> right <image>?", "answer": "1"})
    assert two.messages[0]["content"] == [
        {"type": "text", "text": "Left "},
        {"type": "image"},
        {"type": "text", "text": " right "},
        {"type": "image"},
        {"type": "text", "text": "?"},
    ]


def test_geo3k_bad_input_errors_name_the_place(tmp_path, geo3k_dir):
    with pytest.raises(FileNotFoundError, match="problems.jsonl"):
        F.load_geo3k(tmp_path)
    good = (geo3k_dir / "problems.jsonl").read_text().splitlines()[0]

    def load(*lines):
        (tmp_path / "problems.jsonl").write_text("\n".join(lines) + "\n")
        (tmp_path / "11.png").write_bytes((geo3k_dir / "11.png").read_bytes())
        return F.load_geo3k(tmp_path)

    assert [s.answer for s in load(good)] == ["80"]
    with pytest.raises(ValueError, match=r"problems.jsonl:2: not valid JSON"):
        load(good, "{not json")
    row = json.loads(good)
    with pytest.raises(ValueError, match=r"problems.jsonl:1: missing field 'answer'"):
        load(json.dumps({k: v for k, v in row.items() if k != "answer"}))
    with pytest.raises(ValueError, match=r"problems.jsonl:1: field 'answer' must be a string"):
        load(json.dumps({**row, "answer": 80}))
    with pytest.raises(ValueError, match=r"problems.jsonl:1: missing field 'images' \(or 'image'\)"):
        load(json.dumps({k: v for k, v in row.items() if k != "image"}))
    with pytest.raises(FileNotFoundError, match=r"problems.jsonl:1, image 0: image file .*99.png' not found"):
        load(json.dumps({**row, "image": "99.png"}))
    with pytest.raises(ValueError, match=r"jsonl:1: field 'problem' has 2 <image> placeholders but the row has 1"):
        load(json.dumps({**row, "problem": "<image><image>Find x."}))
    with pytest.raises(ValueError, match=r"row 3, image 0: cannot decode image its bytes"):
        F.geo3k_sample({"images": [{"bytes": b"not a png"}], "problem": "<image>", "answer": "1"}, where="row 3")
    with pytest.raises(ValueError, match="no problems"):
        load("")


def test_the_geo3k_sample_is_inside_the_repository_with_its_licence(geo3k_dir):
    root = Path(F.__file__).resolve().parents[2]
    assert geo3k_dir == F.GEO3K_SAMPLE_DIR and root in geo3k_dir.resolve().parents
    assert "MIT License" in (geo3k_dir / "LICENSE").read_text() and "Pan Lu" in (geo3k_dir / "README.md").read_text()
    assert sum(p.stat().st_size for p in geo3k_dir.iterdir()) < 200_000
