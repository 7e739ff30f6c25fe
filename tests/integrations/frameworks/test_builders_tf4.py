"""The builders with the Qwen2.5-VL processor of the installed transformers: 5.x or 4.5x.

EasyR1 pins transformers 4.5x (no ``mm_token_type_ids`` unless asked, and then only image
tokens marked; another image-processor class; no torchvision-free video processor), verl
and rlk_mm's own extras 5.x. The main suite runs this module under 5.x;
``tests/integrations/frameworks/tf4_env.sh`` runs it under 4.5x in ``.venv-tf4``. It takes no fixture of
``tests/conftest.py`` (that environment runs it with ``--noconftest``).

Each version's batches are checked against that version's own model code (``get_rope_index``
of the tiny Qwen2.5-VL) and against one another: ``REFERENCE`` holds digests of every field
of a batch built under transformers 5.x, and the batch built here must match them, except the
two fields that name the processor's classes by design. Regenerate it under 5.x, after a
deliberate change, with ``python tests/integrations/frameworks/test_builders_tf4.py``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import pytest
import torch
import transformers

from rlk_mm import Modality, RLBatch, SchemaError
from rlk_mm.fixtures import (
    IM_END_TOKEN_ID,
    IMAGE_TOKEN_ID,
    VIDEO_TOKEN_ID,
    processor_inputs,
    qwen_vl_processor,
    synthetic_image_text,
    synthetic_video_text,
    tiny_qwen2_5_vl,
)
from rlk_mm.fixtures.processor import PilImageProcessor
from rlk_mm.schema import SpanTable

TF_MAJOR = int(transformers.__version__.split(".")[0])
REFERENCE = Path(__file__).with_name("qwen2_5_vl_batch_tf5.json")
#: fields that name the processor's classes (the fingerprint, and the media keys that hash it)
VERSION_BOUND = ("processor_fingerprint", "media_cache_keys")


@pytest.fixture(scope="module")
def processor():
    return qwen_vl_processor()


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2_5_vl(seed=0)


def samples():
    """Images of several sizes (1-3 a sample), a text-only sample, and image + 3-frame video samples."""
    images = synthetic_image_text(4, seed=1, allow_text_only=True)
    assert any(not s.images for s in images) and any(len(s.images) > 1 for s in images)
    return images + synthetic_video_text(2, seed=0, with_image=True, num_frames=3)


def responses(processor, n):
    texts = ["red", "The answer is \\boxed{80}.", "blue", "7"]
    return [processor.tokenizer.encode(texts[b % len(texts)]) + [IM_END_TOKEN_ID] for b in range(n)]


def build(processor, padding_side="left") -> RLBatch:
    items = samples()
    out = processor_inputs(processor, items, padding_side=padding_side)
    return RLBatch.from_qwen_vl(
        out, processor=processor, responses=responses(processor, len(items)), group_ids=[s.id for s in items],
        rewards=[float(b % 2) for b in range(len(items))], media_ids=[m for s in items for m in s.media_ids],
    )


def rope_positions(model, batch: RLBatch, b: int) -> torch.Tensor:
    """Sample ``b``'s (3, L) positions from this transformers version's ``get_rope_index``
    on its unpadded prompt + response (5.x also takes ``mm_token_type_ids``, 4.5x cannot)."""
    ids = batch.sample_tokens(b).unsqueeze(0)
    kwargs = {"input_ids": ids}
    for modality, name in ((Modality.IMAGE, "image_grid_thw"), (Modality.VIDEO, "video_grid_thw")):
        chosen = (batch.media_sample == b) & (batch.media_modality == int(modality))
        kwargs[name] = batch.media_grid_thw[chosen] if bool(chosen.any()) else None
    if kwargs["video_grid_thw"] is not None:
        videos = batch.media_sample[batch.media_modality == int(Modality.VIDEO)]
        kwargs["second_per_grid_ts"] = batch.second_per_grid_ts[videos == b]
    if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters:
        kwargs["mm_token_type_ids"] = (ids == IMAGE_TOKEN_ID).int() + 2 * (ids == VIDEO_TOKEN_ID).int()
    positions, _ = model.model.get_rope_index(**kwargs)
    return positions[:, 0]


def digest(batch: RLBatch) -> dict[str, str]:
    """sha256 of each field's dtype, shape and bytes (spans: their CSR tensors), JSON for the others."""
    out = {}
    for name in type(batch).model_fields:
        if name in VERSION_BOUND:
            continue
        value = getattr(batch, name)
        if isinstance(value, SpanTable):
            tensors = value.tensors(name)
        else:
            tensors = {name: value} if isinstance(value, torch.Tensor) else None
        h = hashlib.sha256()
        if tensors is None:
            h.update(json.dumps(value).encode())
        for key, t in sorted(tensors.items()) if tensors else ():
            h.update(f"{key} {t.dtype} {tuple(t.shape)}".encode())
            h.update(t.contiguous().numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def test_the_processor_is_this_versions_real_one(processor):
    assert isinstance(processor, transformers.Qwen2_5_VLProcessor)
    assert isinstance(processor.image_processor, PilImageProcessor)
    expected = "Qwen2VLImageProcessorPil" if TF_MAJOR >= 5 else "Qwen2VLImageProcessor"
    assert type(processor.image_processor).__name__ == expected
    keys = set(processor_inputs(processor, samples(), padding_side="left"))
    assert ("mm_token_type_ids" in keys) == (TF_MAJOR >= 5)
    assert {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"} <= keys


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_positions_are_this_versions_get_rope_index(processor, model, padding_side):
    batch = build(processor, padding_side)
    assert {int(m) for m in batch.media_modality} == {int(Modality.IMAGE), int(Modality.VIDEO)}
    for b in range(batch.num_samples):
        assert torch.equal(batch.sample_positions(b), rope_positions(model, batch, b)), f"sample {b}"


def test_the_batch_matches_the_one_built_under_transformers_5(processor):
    reference = json.loads(REFERENCE.read_text())
    actual = digest(build(processor))
    differing = sorted(name for name in reference["fields"] if actual[name] != reference["fields"][name])
    assert not differing, (
        f"fields {differing} differ from the batch transformers {reference['transformers']} built ({REFERENCE.name}); "
        "if transformers 5 changed its processor on purpose, regenerate it: python "
        "tests/integrations/frameworks/test_builders_tf4.py"
    )
    assert actual.keys() == reference["fields"].keys()


def test_the_processors_own_mm_token_type_ids_are_accepted(processor):
    """Asked for them, 4.5x marks video tokens 0 (only image tokens 1); 5.x marks them 2."""
    items = samples()
    texts = [processor.apply_chat_template(s.messages, tokenize=False, add_generation_prompt=True) for s in items]
    out = processor(
        text=texts, images=[i for s in items for i in s.images], videos=[v for s in items for v in s.videos],
        padding=True, padding_side="left", return_tensors="pt", return_mm_token_type_ids=True,
    )
    types, ids = out["mm_token_type_ids"], out["input_ids"]
    assert set(types[ids == VIDEO_TOKEN_ID].tolist()) == ({2} if TF_MAJOR >= 5 else {0})
    with_types = RLBatch.from_qwen_vl(out, processor=processor)
    out.pop("mm_token_type_ids")
    assert torch.equal(with_types.position_ids, RLBatch.from_qwen_vl(out, processor=processor).position_ids)


@pytest.mark.parametrize("video_type", [0, 2])
def test_mixed_video_token_types_are_refused(processor, video_type):
    """Video tokens are all 2 (5.x) or all 0 (4.5x): one 1, or a mix of 0 and 2, is a drift."""
    out = processor_inputs(processor, samples(), padding_side="left")
    ids = out["input_ids"]
    out["mm_token_type_ids"] = (ids == IMAGE_TOKEN_ID).long() + video_type * (ids == VIDEO_TOKEN_ID).long()
    RLBatch.from_qwen_vl(out, processor=processor)
    b, p = (int(i) for i in torch.nonzero(ids == VIDEO_TOKEN_ID)[-1])
    out["mm_token_type_ids"][b, p] = 2 - video_type
    with pytest.raises(SchemaError,
                       match=rf"says [02] but token {VIDEO_TOKEN_ID} implies [02]: video tokens are all 2 "
                             rf"\(transformers 5\) or all 0"):
        RLBatch.from_qwen_vl(out, processor=processor)


def test_easyr1_layout_through_from_verl(processor, model):
    """EasyR1's rollout batch: a left-padded prompt, a right-padded response and (B, 3, L)
    positions from the model's rope index, with each sample's media in its own dict."""
    items = samples()
    out = processor_inputs(processor, items, padding_side="left")
    expected = build(processor)
    resp = responses(processor, len(items))
    R, pad = max(map(len, resp)), processor.tokenizer.pad_token_id
    response_ids = torch.tensor([r + [pad] * (R - len(r)) for r in resp])
    response_mask = torch.tensor([[1] * len(r) + [0] * (R - len(r)) for r in resp])
    input_ids = torch.cat([out["input_ids"], response_ids], dim=1)
    attention_mask = torch.cat([out["attention_mask"], response_mask], dim=1)
    positions = torch.zeros(len(items), 3, input_ids.shape[1], dtype=torch.int64)
    for b in range(len(items)):
        real = attention_mask[b].bool()
        positions[b][:, real] = rope_positions(model, expected, b)
    per_sample = []
    for b in range(len(items)):
        mine = expected.select([b])
        per_sample.append({k: v for k, v in {
            "pixel_values": mine.pixel_values, "image_grid_thw": mine.image_grid_thw,
            "pixel_values_videos": mine.pixel_values_videos, "video_grid_thw": mine.video_grid_thw,
            "second_per_grid_ts": mine.second_per_grid_ts,
        }.items() if v is not None})
    batch = RLBatch.from_verl(
        input_ids, attention_mask, positions, processor=processor, responses=response_ids, response_mask=response_mask,
        multi_modal_inputs=per_sample,
    )
    for name in ("input_ids", "cu_seqlens", "position_ids", "media_grid_thw", "pixel_values", "pixel_values_videos"):
        assert torch.equal(getattr(batch, name), getattr(expected, name)), name
    assert batch.media_cache_keys == expected.media_cache_keys


if __name__ == "__main__":
    if TF_MAJOR < 5:
        raise SystemExit(f"the reference is the batch of transformers 5; this is {transformers.__version__}")
    fields = digest(build(qwen_vl_processor()))
    REFERENCE.write_text(json.dumps({"transformers": transformers.__version__, "fields": fields}, indent=1) + "\n")
    print(f"wrote {REFERENCE} ({len(fields)} fields, transformers {transformers.__version__})")
