"""Audio (a modality no op supports) has an explicit status: the batch builds, and every
public function that takes a batch either refuses it with ``UnsupportedModalityError`` or,
where its result depends on the token layout alone, returns what it returns on the
fallback batch (``mask_unsupported_media``: the text scored, the audio span masked).

The audio batches come from a real Qwen-VL processor batch in which some image items are
relabelled audio: their placeholder tokens become <|AUDIO|> (id 151646 in Qwen2-Audio and
Qwen2.5-Omni; the schema keeps no audio placeholder id) and their pixels leave the batch.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlk_mm
from rlk_mm import models, ops, parity, viz
from rlk_mm.fixtures import Sample, processor_inputs, qwen_vl_processor, synthetic_image_text
from rlk_mm.models import forward as qwen_forward
from rlk_mm.schema import Modality, RLBatch, SpanTable, UnsupportedModalityError, mask_unsupported_media
from rlk_mm.schema.media import offsets, token_counts
from rlk_mm.schema.unsupported import RFC_PATH, require_supported, require_supported_messages

AUDIO_PLACEHOLDER = 151646
NUM_SAMPLES = 4


@functools.lru_cache(maxsize=1)
def image_batch() -> RLBatch:
    """A real processor batch of 4 samples, one image each, 3 response tokens each."""
    processor = qwen_vl_processor()
    out = processor_inputs(processor, synthetic_image_text(NUM_SAMPLES, seed=1, max_images=1))
    return RLBatch.from_qwen_vl(out, processor=processor, responses=[[9707, 13, 151645]] * NUM_SAMPLES,
                                group_ids=["a", "b", "c", "d"], rewards=[1.0, 0.0, 0.5, 0.25])


def with_audio(batch: RLBatch, items: list[int]) -> RLBatch:
    """``batch`` with media ``items`` relabelled audio (placeholders, spans, records, pixels)."""
    fields = {name: getattr(batch, name) for name in RLBatch.model_fields}
    modality = batch.media_modality.clone()
    modality[items] = int(Modality.AUDIO)
    rows = batch.media_pixel_rows()
    images = [g for g in range(batch.num_media) if int(modality[g]) == int(Modality.IMAGE)]
    fields["pixel_values"] = torch.cat([rows[g] for g in images]) if images else None
    fields["image_grid_thw"] = batch.media_grid_thw[images] if images else None
    fields["media_modality"] = modality
    fields["vision_token_offsets"] = offsets(token_counts(batch.media_grid_thw, batch.spatial_merge_size), modality)
    table = batch.modality_spans
    audio = (table.media_index >= 0) & torch.isin(table.media_index, torch.tensor(items, dtype=torch.int32))
    fields["modality_spans"] = SpanTable(table.starts, table.ends, table.sample_ptr,
                                         torch.where(audio, int(Modality.AUDIO), table.modality), table.media_index)
    ids = batch.input_ids.clone()
    ids[batch.per_token(audio)] = AUDIO_PLACEHOLDER
    fields["input_ids"] = ids
    return RLBatch(**fields).select(range(batch.num_samples))  # media in the builders' order: images, videos, audio


@functools.lru_cache(maxsize=1)
def audio_batch() -> RLBatch:
    return with_audio(image_batch(), [1, 2])


def check_refusal(error: UnsupportedModalityError, name: str = "batch") -> None:
    message = str(error)
    assert error.modality is Modality.AUDIO
    assert message.startswith(f"{name}: sample 1, media item 2 (id ")
    assert f"tokens [{audio_batch().modality_spans_of(1)[1].start}, " in message
    assert "is audio, a modality rlk_mm's operators do not support" in message
    assert RFC_PATH in message and "docs/rfc/continuous_latent_rl.md" == RFC_PATH
    assert ("Fallback: score the text only, with the audio span masked: "
            "rlk_mm.schema.mask_unsupported_media(batch)") in message


# ------------------------------------------------------------------ the batch itself handles audio
def test_an_audio_batch_builds_selects_concats_saves_and_loads(tmp_path):
    batch = audio_batch()
    assert batch.media_modality.tolist() == [1, 1, 3, 3]
    assert [s.modality for s in batch.modality_spans_of(2)] == [Modality.TEXT, Modality.AUDIO, Modality.TEXT]
    picked = batch.select([2, 0])
    assert picked.media_modality.tolist() == [1, 3]  # images first, then audio
    assert torch.equal(picked.input_ids, torch.cat([batch.sample_tokens(2), batch.sample_tokens(0)]))
    assert RLBatch.concat([batch, batch]).media_modality.tolist().count(3) == 4
    loaded = RLBatch.load(batch.save(tmp_path / "audio.safetensors"))
    assert loaded.media_ids == batch.media_ids and torch.equal(loaded.media_modality, batch.media_modality)
    assert loaded.modality_spans == batch.modality_spans


# ------------------------------------------------------------------ the table: every public op on an audio batch
def _hidden(batch):
    return torch.randn(batch.num_tokens, 16, generator=torch.Generator().manual_seed(0))


_HEAD = torch.randn(151669, 16, generator=torch.Generator().manual_seed(1)) * 0.1


def _loss(batch):
    n = int(batch.loss_spans.token_counts().sum())
    return ops.linear_policy_loss(_hidden(batch), _HEAD, batch, old_log_probs=torch.full((n,), -3.0),
                                  advantages=torch.linspace(-1, 1, n)).loss


REFUSED = {
    "models.layout_inputs": lambda b, model, tmp: models.layout_inputs(b),
    "models.forward_hidden": lambda b, model, tmp: models.forward_hidden(model, b),
    "models.batch_logprobs": lambda b, model, tmp: models.batch_logprobs(model, b),
    "models.VisionCache.__call__": lambda b, model, tmp: models.VisionCache(model)(b),
    "models.group_logprobs": lambda b, model, tmp: models.group_logprobs(model, b),
    "models.forward.group_hidden": lambda b, model, tmp: qwen_forward.group_hidden(model, b),
    "models.forward.check_inputs": lambda b, model, tmp: qwen_forward.check_inputs(model, b),
    "models.forward.language_inputs":
        lambda b, model, tmp: qwen_forward.language_inputs(model, b, torch.zeros(1, 64)),
    "models.forward.fill_media":
        lambda b, model, tmp: qwen_forward.fill_media(torch.zeros(b.num_tokens, 16), b, torch.zeros(1, 16)),
    "parity.check_layout_parity": lambda b, model, tmp: parity.check_layout_parity(b, image_batch()),
    "parity.compare_logprobs":
        lambda b, model, tmp: parity.compare_logprobs(torch.zeros(12), torch.zeros(12), image_batch(), b),
    "viz.draw_layout": lambda b, model, tmp: viz.draw_layout(b, tmp / "layout.png"),
}
#: ops whose result depends on the token layout alone: on an audio batch they give the fallback batch's result
TOKEN_LAYOUT_OPS = {
    "ops.selected_logprob": lambda b: ops.selected_logprob(_hidden(b), _HEAD, b),
    "ops.linear_policy_loss": _loss,
    "ops.scatter_rewards": lambda b: ops.scatter_rewards(b),
    "ops.pack": lambda b: ops.pack(b, align=8).input_ids,
    "ops.unpack": lambda b: ops.unpack(ops.pack(b, align=8)).input_ids,
    "models.forward.prompt_lengths": lambda b: torch.tensor(qwen_forward.prompt_lengths(b)),
    "ops.group_advantages": lambda b: ops.group_advantages(torch.arange(b.num_samples, dtype=torch.float32), batch=b),
    "ops.lagrangian_advantages": lambda b: ops.lagrangian_advantages(
        torch.arange(b.num_samples, dtype=torch.float32), torch.ones(b.num_samples), lam=torch.tensor(0.5),
        batch=b).advantages,
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_op_refuses_an_audio_batch(name, tiny_model, tmp_path):
    with pytest.raises(UnsupportedModalityError) as caught:
        REFUSED[name](audio_batch(), tiny_model, tmp_path)
    check_refusal(caught.value, "training" if name == "parity.compare_logprobs" else
                  "rollout" if name == "parity.check_layout_parity" else "batch")


@pytest.mark.parametrize("name", sorted(TOKEN_LAYOUT_OPS))
def test_token_layout_op_gives_the_fallback_result_on_an_audio_batch(name):
    batch = audio_batch()
    masked = mask_unsupported_media(batch)
    assert torch.equal(TOKEN_LAYOUT_OPS[name](batch), TOKEN_LAYOUT_OPS[name](masked))


def test_pack_round_trip_keeps_the_audio_items():
    batch = audio_batch()
    back = ops.unpack(ops.pack(batch, max_tokens_per_pack=128))
    assert back.media_modality.tolist() == batch.media_modality.tolist()
    assert torch.equal(back.input_ids, batch.input_ids) and back.modality_spans == batch.modality_spans


def test_the_table_covers_every_public_function_that_takes_a_batch():
    """A new public op taking an RLBatch must join REFUSED or TOKEN_LAYOUT_OPS."""
    found = set()
    for prefix, module in (("ops", ops), ("models", models), ("models.forward", qwen_forward), ("parity", parity),
                           ("viz", viz)):
        for attr in getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]:
            value = getattr(module, attr)
            if inspect.isclass(value):
                value, attr = getattr(value, "__call__", None), f"{attr}.__call__"
            if not inspect.isfunction(value) or not value.__module__.startswith("rlk_mm"):
                continue
            params = inspect.signature(value).parameters
            if {"batch", "rollout", "training"} & set(params) or "loss_spans" in params:
                found.add(f"{prefix}.{attr}")
    covered = set(REFUSED) | set(TOKEN_LAYOUT_OPS)
    missing = {name for name in found
               if name not in covered and not any(name.endswith("." + c.split(".")[-1]) for c in covered)}
    assert not missing, f"public functions taking a batch with no audio row in the table: {sorted(missing)}"


def test_image_only_batches_pass_the_check_untouched():
    batch = image_batch()
    assert require_supported("batch", batch) is batch
    assert mask_unsupported_media(batch) is batch


# ------------------------------------------------------------------ the fallback, as a property
@settings(max_examples=12, deadline=None)
@given(st.sets(st.integers(0, NUM_SAMPLES - 1), min_size=1))
def test_mask_unsupported_media_keeps_tokens_and_loss_and_drops_only_audio(items):
    batch = with_audio(image_batch(), sorted(items))
    with pytest.raises(UnsupportedModalityError, match=f"sample {min(items)}, media item {NUM_SAMPLES - len(items)} "):
        require_supported("batch", batch)
    masked = mask_unsupported_media(batch)
    assert torch.equal(masked.input_ids, batch.input_ids) and torch.equal(masked.position_ids, batch.position_ids)
    assert masked.loss_spans == batch.loss_spans
    kept = NUM_SAMPLES - len(items)
    assert masked.media_ids == batch.media_ids[:kept] and masked.media_cache_keys == batch.media_cache_keys[:kept]
    assert masked.media_modality.tolist() == [1] * kept
    assert (masked.pixel_values is None) == (batch.pixel_values is None) == (kept == 0)
    assert kept == 0 or torch.equal(masked.pixel_values, batch.pixel_values)
    assert torch.equal(masked.token_modality() == int(Modality.IMAGE), batch.token_modality() == int(Modality.IMAGE))
    assert not (masked.token_modality() == int(Modality.AUDIO)).any()
    assert require_supported("batch", masked) is masked


# ------------------------------------------------------------------ builders: audio inputs are refused, never dropped
@functools.lru_cache(maxsize=1)
def whisper_features() -> torch.Tensor:
    """Real log-mel features (transformers' WhisperFeatureExtractor) of two synthetic clips."""
    from transformers import WhisperFeatureExtractor

    from rlk_mm.fixtures.codec import synthetic_clips

    clips = list(synthetic_clips(2, 16_000).numpy())
    return WhisperFeatureExtractor()(clips, sampling_rate=16_000, return_tensors="pt")["input_features"]


def test_from_qwen_vl_refuses_a_processor_output_with_audio_features():
    processor = qwen_vl_processor()
    out = dict(processor_inputs(processor, synthetic_image_text(2, seed=1, max_images=1)))
    out["input_features"] = whisper_features()
    with pytest.raises(UnsupportedModalityError,
                       match=r"processor_output holds audio inputs \(input_features\); "
                             r"their modality is audio") as caught:
        RLBatch.from_qwen_vl(out, processor=processor, responses=[[9707, 151645]] * 2)
    message = str(caught.value)
    assert "build the batch from the output without input_features" in message and RFC_PATH in message


def test_from_verl_refuses_multi_modal_inputs_with_audio_features():
    processor = qwen_vl_processor()
    ids = torch.tensor(processor.tokenizer(["Who speaks?", "Say it again."], padding="longest",
                                           padding_side="left")["input_ids"])
    attention = (ids != processor.tokenizer.pad_token_id).long()
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    mm = [{},
          {"input_features": whisper_features()[1:], "feature_attention_mask": torch.ones(1, 3000, dtype=torch.int64)}]
    with pytest.raises(UnsupportedModalityError,
                       match=r"multi_modal_inputs\[1\] holds audio inputs \(input_features, feature_attention_mask\)"):
        RLBatch.from_verl(ids, attention, positions, processor=processor, multi_modal_inputs=mm)


# ------------------------------------------------------------------ chat prompts and the smoke test
def test_smoke_task_refuses_an_audio_prompt():
    from rlk_mm.smoke.tasks import Task

    audio = Sample("clip-0",
                   [{"role": "user",
                     "content": [{"type": "audio", "audio": "clip.wav"}, {"type": "text", "text": "Who speaks?"}]}])
    task = Task("audio", lambda rng, n, stream: [audio] * n, lambda text, s: 0.0, lambda label: label, max_new_tokens=2)
    with pytest.raises(UnsupportedModalityError,
                       match=r"smoke task 'audio', prompt 'clip-0': messages\[0\].content\[0\] \(type 'audio'\) is "
                             r"audio"):
        task.batch(None, 2, "train")


def test_smoke_command_exits_2_on_an_audio_task(monkeypatch, capsys, tmp_path):
    """End to end: ``rlk-mm smoke`` on a task with audio prompts stops with exit 2 (bad input) and the message."""
    from rlk_mm.smoke import cli
    from rlk_mm.smoke.tasks import TASKS, Task

    audio = Sample("clip-0",
                   [{"role": "user", "content": [{"type": "input_audio"}, {"type": "text", "text": "Who speaks?"}]}])
    monkeypatch.setitem(TASKS, "colour",
                        lambda data, tuning: Task("audio", lambda rng, n, s: [audio] * n, lambda t, s: 0.0, str, 2))
    code = cli.main(["--steps", "1", "--warmup-steps", "1", "--prompts", "1", "--quiet", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "type 'input_audio') is audio" in err and RFC_PATH in err


BAD_MESSAGES = [
    ("not a list", "hello", TypeError, r"smoke messages must be a list of chat messages"),
    ("message not a dict", ["hello"], TypeError, r"smoke: messages\[0\] is str; a chat message is a dict"),
    ("audio_url part", [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "audio_url"}]}],
     UnsupportedModalityError, r"smoke: messages\[0\].content\[1\] \(type 'audio_url'\) is audio"),
]


@pytest.mark.parametrize("label, messages, error, match", BAD_MESSAGES, ids=[b[0] for b in BAD_MESSAGES])
def test_require_supported_messages_bad_input(label, messages, error, match):
    with pytest.raises(error, match=match):
        require_supported_messages(messages, "smoke")


PART_TYPES = ["text", "image", "video", "audio", "input_audio", "audio_url", "tool_call"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.sampled_from(PART_TYPES), max_size=4), max_size=4))
def test_require_supported_messages_refuses_exactly_the_first_audio_part(parts):
    messages = [{"role": "user", "content": [{"type": t} for t in message]} for message in parts]
    audio = [(m, p) for m, message in enumerate(parts) for p, t in enumerate(message) if "audio" in t]
    if not audio:
        assert require_supported_messages(messages, "prompt") is messages
        return
    m, p = audio[0]
    with pytest.raises(UnsupportedModalityError,
                       match=rf"prompt: messages\[{m}\].content\[{p}\] \(type '{parts[m][p]}'\) is audio"):
        require_supported_messages(messages, "prompt")


def test_supported_messages_pass_untouched():
    content = [{"type": "image"}, {"type": "text", "text": "a"}, {"type": ["odd"]}, "raw"]
    messages = [{"role": "user", "content": content},
                {"role": "assistant", "content": "b"}]
    assert require_supported_messages(messages, "smoke") is messages


def test_mask_unsupported_media_refuses_a_non_batch():
    with pytest.raises(TypeError, match="batch must be an RLBatch, got dict"):
        mask_unsupported_media({"input_ids": []})


def test_error_is_a_not_implemented_error_exported_at_the_top():
    assert rlk_mm.UnsupportedModalityError is UnsupportedModalityError
    assert issubclass(UnsupportedModalityError, NotImplementedError)
