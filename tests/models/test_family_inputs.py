"""The family layer tried as a new user would: models, processors and batches of the wrong family
are refused naming both sides; a subclass under any name resolves to its base family; a
Qwen3-VL video built with another family's processor names the real cause; the parity check
names a Qwen3-VL video's timestamps or outer vision pair. Real parts throughout."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm import fixtures
from rlk_mm.fixtures import IM_END_TOKEN_ID, VISION_END_TOKEN_ID, VISION_START_TOKEN_ID, processor_inputs
from rlk_mm.models import VisionCache, batch_logprobs, forward_hidden, generate_on_policy, group_logprobs, model_family
from rlk_mm.models.decode import decode_hidden
from rlk_mm.parity import check_layout_parity
from rlk_mm.parity.invariance import invariance_sweep
from rlk_mm.schema import LayoutFamily, Modality, RLBatch, SchemaError, layout_family_of

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def parts():
    """Each family's processor and tiny model, and a Qwen3-VL image + video prompt."""
    return {
        "qwen2_vl": (fixtures.qwen2_vl_processor(), fixtures.tiny_qwen2_vl()),
        "qwen2_5_vl": (fixtures.qwen_vl_processor(), fixtures.tiny_qwen2_5_vl()),
        "qwen3_vl": (fixtures.qwen3_vl_processor(), fixtures.tiny_qwen3_vl()),
    }


def _batch(processor, samples, **kw):
    out = processor_inputs(processor, samples)
    responses = [processor.tokenizer.encode("yes") + [IM_END_TOKEN_ID] for _ in samples]
    return RLBatch.from_qwen_vl(out, processor=processor, responses=responses, **kw)


def _qwen3_5():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    config = Qwen3_5Config(
        text_config=dict(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                         linear_num_key_heads=2, linear_num_value_heads=2),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32))
    return Qwen3_5ForConditionalGeneration(config)


# --------------------------------------------------------------------------- models
@pytest.mark.parametrize("make, words", [
    (lambda: None, r"model NoneType is not a supported model family"),
    (lambda: torch.nn.Linear(2, 2), r"model Linear is not a supported model family"),
    (lambda: fixtures.tiny_qwen2_5_vl().model, r"model Qwen2_5_VLModel is not a supported .* Qwen2\.5-VL \(Qwen2_5_VLFor"),
    (_qwen3_5, r"model Qwen3_5ForConditionalGeneration is not a supported model family: Qwen3\.5's Gated-DeltaNet"),
], ids=["none", "linear", "inner-model", "qwen3.5"])
def test_unsupported_models_are_refused_by_name_everywhere(parts, make, words):
    model = make()
    processor, _ = parts["qwen2_5_vl"]
    batch = _batch(processor, fixtures.synthetic_image_text(1))
    calls = [lambda: model_family(model), lambda: forward_hidden(model, batch), lambda: batch_logprobs(model, batch),
             lambda: group_logprobs(model, batch), lambda: decode_hidden(model, batch), lambda: VisionCache(model),
             lambda: generate_on_policy(model, processor_inputs(processor, fixtures.synthetic_image_text(1)),
                                        processor=processor, max_new_tokens=1, seed=0),
             lambda: invariance_sweep(model, processor, fixtures.synthetic_image_text(2))]
    for call in calls:
        with pytest.raises(TypeError, match=words):
            call()


def test_a_subclass_of_a_supported_model_resolves_to_its_family():
    policy_class = type("MyPolicy", (type(fixtures.tiny_qwen3_vl_moe()),), {})
    assert model_family(policy_class.__new__(policy_class)).name == "qwen3_vl_moe"


# --------------------------------------------------------------------------- processors
@settings(max_examples=20, deadline=None)
@given(name=st.from_regex(r"[A-Z][A-Za-z0-9_]{0,20}", fullmatch=True))
def test_a_processor_subclass_under_any_name_keeps_its_family(name):
    for base, family in ((fixtures.Qwen2VLFramesProcessor, LayoutFamily.QWEN2_VL),
                         (fixtures.Qwen2_5_VLFramesProcessor, LayoutFamily.QWEN2_5_VL),
                         (fixtures.Qwen3VLFramesProcessor, LayoutFamily.QWEN3_VL)):
        cls = type(name, (base,), {})
        assert layout_family_of(cls.__new__(cls)) is family


def test_a_renamed_qwen2_5_vl_processor_gets_qwen2_5_vl_video_positions(parts):
    """The old rule ("2_5" in the class name) gave a renamed Qwen2.5-VL processor Qwen2-VL positions."""
    processor, model = parts["qwen2_5_vl"]
    renamed = type("PolicyProcessor", (type(processor),), {})(
        image_processor=processor.image_processor, tokenizer=processor.tokenizer,
        video_processor=processor.video_processor, chat_template=processor.chat_template)
    samples = fixtures.synthetic_video_text(2, num_frames=6)
    assert torch.equal(_batch(renamed, samples).position_ids, _batch(processor, samples).position_ids)
    assert _batch(renamed, samples).layout_family == "qwen2_5_vl"


def test_other_processors_are_refused_and_a_tokenizer_records_no_family(parts):
    processor, _ = parts["qwen3_vl"]

    class OtherProcessor:
        image_processor = processor.image_processor
        tokenizer = processor.tokenizer

    with pytest.raises(TypeError, match=r"processor OtherProcessor is not a supported Qwen-VL processor: .*Qwen3VLProcessor"):
        RLBatch.from_token_lists([[1, 2]], [[3]], processor=OtherProcessor())
    assert RLBatch.from_token_lists([[1, 2]], [[3]], processor=processor.tokenizer).layout_family is None


def test_tokens_per_second_is_refused_for_families_that_do_not_scale_time(parts):
    for name in ("qwen2_vl", "qwen3_vl"):
        processor, _ = parts[name]
        with pytest.raises(ValueError, match=r"tokens_per_second=2\.0: Qwen.*-VL does not scale video time"):
            RLBatch.from_token_lists([[1, 2]], [[3]], processor=processor, tokens_per_second=2.0)


# --------------------------------------------------------------------------- family mismatches
def test_a_batch_of_another_family_is_refused_naming_both(parts):
    qwen2_5_processor, _ = parts["qwen2_5_vl"]
    _, qwen2_model = parts["qwen2_vl"]
    batch = _batch(qwen2_5_processor, fixtures.synthetic_video_text(1))
    words = r"built by a Qwen2\.5-VL processor .* the model is Qwen2VLForConditionalGeneration \(Qwen2-VL"
    for call in (lambda: forward_hidden(qwen2_model, batch), lambda: batch_logprobs(qwen2_model, batch),
                 lambda: decode_hidden(qwen2_model, batch), lambda: group_logprobs(qwen2_model, batch),
                 lambda: VisionCache(qwen2_model)(batch)):
        with pytest.raises(ValueError, match=words):
            call()


def test_a_processor_of_another_family_is_refused_naming_both(parts):
    qwen2_5_processor, _ = parts["qwen2_5_vl"]
    _, qwen3_model = parts["qwen3_vl"]
    prompts = processor_inputs(qwen2_5_processor, fixtures.synthetic_image_text(1))
    words = r"Qwen2_5_VLFramesProcessor is a Qwen2\.5-VL processor but the model is Qwen3VLForConditionalGeneration"
    with pytest.raises(ValueError, match=words):
        generate_on_policy(qwen3_model, prompts, processor=qwen2_5_processor, max_new_tokens=1, seed=0)
    with pytest.raises(ValueError, match=words):
        invariance_sweep(qwen3_model, qwen2_5_processor, fixtures.synthetic_image_text(2))


def test_a_video_batch_without_a_family_is_refused(parts):
    processor, model = parts["qwen3_vl"]
    out = processor_inputs(processor, fixtures.synthetic_video_text(1))
    ids = out["input_ids"][0][out["attention_mask"][0].bool()].tolist()
    grid = out["video_grid_thw"].repeat_interleave(out["video_grid_thw"][:, 0], 0)
    grid[:, 0] = 1
    batch = RLBatch.from_token_lists([ids], [[IM_END_TOKEN_ID]], processor=processor.tokenizer, video_grid_thw=grid,
                                     pixel_values_videos=out["pixel_values_videos"])
    assert batch.layout_family is None
    with pytest.raises(ValueError, match=r"records no layout_family .* holds videos, .* build it with the Qwen3-VL processor"):
        forward_hidden(model, batch)


def test_media_embeds_without_the_deepstack_levels_are_refused(parts):
    processor, model = parts["qwen3_vl"]
    batch = _batch(processor, fixtures.synthetic_image_text(1))
    rows = VisionCache(model)(batch)
    assert rows.shape[1:] == (3, 64)  # merged rows, then the two DeepStack levels of tiny_qwen3_vl
    with pytest.raises(ValueError, match=r"media_embeds must be \[\d+, 1 \+ 2, 64\] .*DeepStack levels"):
        forward_hidden(model, batch, media_embeds=rows[:, 0])


# --------------------------------------------------------------------------- Qwen3-VL video in the schema
def test_a_timestamped_video_built_with_a_qwen2_5_vl_processor_names_the_real_cause(parts):
    qwen3_processor, _ = parts["qwen3_vl"]
    qwen2_5_processor, _ = parts["qwen2_5_vl"]
    out = processor_inputs(qwen3_processor, fixtures.synthetic_video_text(1))
    with pytest.raises(SchemaError, match=r"video 0 at positions .* one temporal patch's placeholders: the prompt writes "
                                          r"the video per temporal patch with timestamps \(Qwen3-VL's layout\), but the "
                                          r"batch is built with Qwen2\.5-VL's processor"):
        RLBatch.from_qwen_vl(out, processor=qwen2_5_processor)


def test_a_qwen3_vl_video_item_of_several_temporal_patches_is_refused(parts):
    processor, _ = parts["qwen2_5_vl"]
    batch = _batch(processor, fixtures.synthetic_video_text(1))
    fields = {name: getattr(batch, name) for name in type(batch).model_fields}
    with pytest.raises(SchemaError, match=r"media_grid_thw: video item \d+ has grid \[2, .* in a Qwen3-VL batch each temporal "
                                          r"patch of a video is its own item"):
        RLBatch(**{**fields, "layout_family": "qwen3_vl"})
    with pytest.raises(SchemaError, match=r"layout_family='qwen4_vl': expected one of qwen2_vl, qwen2_5_vl, qwen3_vl"):
        RLBatch(**{**fields, "layout_family": "qwen4_vl"})


def test_qwen3_vl_video_items_are_temporal_patches_sharing_keys_when_frames_repeat(parts):
    processor, _ = parts["qwen3_vl"]
    sample = fixtures.synthetic_video_text(1, num_frames=4)[0]
    sample.videos[0] = [sample.videos[0][0]] * 4  # a still video: both temporal patches hold the same frames
    batch = _batch(processor, [sample])
    videos = [g for g, m in enumerate(batch.media_modality.tolist()) if m == int(Modality.VIDEO)]
    assert [batch.media_grid_thw[g, 0].item() for g in videos] == [1, 1]
    assert batch.media_cache_keys[videos[0]] == batch.media_cache_keys[videos[1]]


# --------------------------------------------------------------------------- parity
def _qwen3_token_lists(processor, fps):
    sample = fixtures.synthetic_video_text(1)[0]
    text = processor.apply_chat_template(sample.messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], videos=sample.videos, return_tensors="pt", videos_kwargs={"fps": fps})
    return out["input_ids"][0].tolist(), out


def test_parity_names_other_timestamps_as_the_cause(parts):
    processor, _ = parts["qwen3_vl"]
    batches = []
    for fps in (2.0, 1.0):
        ids, out = _qwen3_token_lists(processor, fps)
        batches.append(RLBatch.from_token_lists([ids], [[IM_END_TOKEN_ID]], processor=processor,
                                                video_grid_thw=out["video_grid_thw"],
                                                pixel_values_videos=out["pixel_values_videos"]))
    report = check_layout_parity(*batches)
    assert not report.ok and "the timestamps ('<t seconds>' before each patch)" in report.first.diagnosis


def test_parity_names_the_outer_vision_pair_as_the_cause(parts):
    processor, _ = parts["qwen3_vl"]
    ids, out = _qwen3_token_lists(processor, 2.0)
    video = [i for i, t in enumerate(ids) if t == processor.video_token_id]
    first_stamp = max(i for i in range(video[0]) if ids[i] == VISION_START_TOKEN_ID) - 1
    while ids[first_stamp - 1] != VISION_END_TOKEN_ID and not processor.tokenizer.decode(ids[first_stamp - 1]).endswith("\n"):
        first_stamp -= 1
    last_end = video[-1] + 1
    outer = ids[:first_stamp] + [VISION_START_TOKEN_ID] + ids[first_stamp : last_end + 1] + [VISION_END_TOKEN_ID] + ids[last_end + 1 :]
    kw = dict(processor=processor, video_grid_thw=out["video_grid_thw"], pixel_values_videos=out["pixel_values_videos"])
    plain = RLBatch.from_token_lists([ids], [[IM_END_TOKEN_ID]], **kw)
    wrapped = RLBatch.from_token_lists([outer], [[IM_END_TOKEN_ID]], **kw)
    report = check_layout_parity(wrapped, plain)
    assert not report.ok and "outer <|vision_start|> ... <|vision_end|> pair" in report.first.diagnosis


# --------------------------------------------------------------------------- chat messages
def test_qwen3_vl_messages_give_one_item_per_temporal_patch_timestamped_at_the_videos_rate(parts):
    processor, model = parts["qwen3_vl"]
    sample = fixtures.synthetic_video_text(1, seed=4, num_frames=6, with_image=True)[0]

    def conversation(fps):
        return [{"role": "user", "content": [{"type": "image", "image": sample.images[0]},
                                             {"type": "video", "video": sample.videos[0], "fps": fps},
                                             {"type": "text", "text": "what?"}]}]

    batch = RLBatch.from_messages([conversation(1.0)], processor=processor)
    text = processor.tokenizer.decode(batch.input_ids)
    assert "<0.5 seconds>" in text and "<2.5 seconds>" in text and "<4.5 seconds>" in text  # patches of 2 frames at 1 fps
    assert batch.media_grid_thw[:, 0].tolist() == [1, 1, 1, 1] and batch.layout_family == "qwen3_vl"
    with torch.no_grad():
        forward_hidden(model, batch)
    with pytest.raises(ValueError, match=r"the videos have frame rates \[1\.0, 2\.0\]; Qwen3-VL writes each temporal patch's "
                                         r"timestamp from one frame rate"):
        RLBatch.from_messages([conversation(1.0), conversation(2.0)], processor=processor)
