"""Layout parity on the checked-in drift fixtures, random single changes, verl tensors, log-prob gating, CLI."""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm import BatchFileError, Modality, RLBatch, SchemaError, Span, SpanTable
from rlk_mm.cli import main as cli_main
from rlk_mm.fixtures import processor_inputs, synthetic_image_text
from rlk_mm.parity import LayoutParityError, check_layout_parity, compare_logprobs

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "parity"


def pair(case):
    return RLBatch.load(FIXTURES / f"{case}.rollout.safetensors"), RLBatch.load(FIXTURES / "training.safetensors")


@pytest.fixture(scope="module")
def training():
    return RLBatch.load(FIXTURES / "training.safetensors")


@pytest.fixture(scope="module")
def image0(training):
    return next(s for s in training.modality_spans_of(0) if s.modality == Modality.IMAGE)


def test_left_vs_right_padding_passes():
    report = check_layout_parity(*pair("left_vs_right_padding"))
    assert report.ok and report.first is None and "OK" in str(report)
    report.raise_if_mismatch()


def test_missing_mm_token_type_ids(image0):
    first = check_layout_parity(*pair("missing_mm_token_type_ids")).first
    # 1-D positions agree with M-RoPE on the first patch (0, 0) and part ways on the second
    assert (first.field, first.sample, first.position) == ("position_ids.t", 0, image0.start + 1)
    assert (first.rollout, first.training) == (image0.start + 1, image0.start)
    assert first.span == f"image #0[{image0.start}, {image0.end})"


def test_different_max_pixels(image0):
    report = check_layout_parity(*pair("different_max_pixels"))
    first = report.first
    assert (first.field, first.sample, first.position) == ("media_cache_keys", 0, image0.start)
    assert first.span == f"image #0[{image0.start}, {image0.end})"
    assert "processor_fingerprint" in report.fields()
    # the rollout's smaller image has 4 tokens: its <|vision_end|> stands where training has a placeholder
    tokens = [m for m in report.mismatches if m.field == "input_ids" and m.sample == 0][0]
    assert (tokens.position, tokens.rollout, tokens.training) == (image0.start + 4, 151653, 151655)


def test_reprocessed_image(image0):
    report = check_layout_parity(*pair("reprocessed_image"))
    assert (report.first.field, report.first.sample, report.first.position) == ("media_cache_keys", 0, image0.start)
    assert "processor_fingerprint" not in report.fields()  # same processor, different pixels
    tokens = [m for m in report.mismatches if m.field == "input_ids" and m.sample == 0][0]
    assert (tokens.position, tokens.rollout, tokens.training) == (image0.start + 4, 151653, 151655)


def test_chat_template_whitespace(image0, processor):
    report = check_layout_parity(*pair("chat_template_whitespace"), tokenizer=processor.tokenizer)
    first = report.first
    # the rollout's template put a space token (220) where the training prompt opens the image
    assert (first.field, first.sample, first.position) == ("input_ids", 0, image0.start - 1)
    assert (first.rollout, first.training) == (220, 151652)
    assert first.span == f"text[0, {image0.start})"
    assert "' '" in first.context_rollout and "<|vision_start|>" in first.context_training
    assert "processor_fingerprint" in report.fields()


def test_different_eos_token(training):
    report = check_layout_parity(*pair("different_eos_token"))
    last = int(training.seq_lengths()[0]) - 1
    assert (report.first.field, report.first.sample, report.first.position) == ("input_ids", 0, last)
    assert (report.first.rollout, report.first.training) == (151643, 151645)
    assert [(m.field, m.sample) for m in report.mismatches] == [("input_ids", 0), ("input_ids", 1)]


def test_contract_breaking_rollouts_fail_to_load(image0):
    with pytest.raises(BatchFileError, match=rf"image #0\[{image0.start}, {image0.start + 10}\) has 10 placeholder "
                                             rf"tokens but grid_thw \[1, 8, 8\] .* implies 16 .*cut by truncation"):
        RLBatch.load(FIXTURES / "truncated_image_span.rollout.safetensors")
    with pytest.raises(BatchFileError, match=rf"loss_spans: sample 0, span text\[1, \d+\) intersects media span "
                                             rf"image #0\[{image0.start}, {image0.end}\) at position {image0.start}"):
        RLBatch.load(FIXTURES / "loss_covers_image.rollout.safetensors")


def test_report_outputs():
    report = check_layout_parity(*pair("different_eos_token"))
    data = json.loads(report.to_json())
    assert data["ok"] is False and data["first"]["field"] == "input_ids" and len(data["mismatches"]) == 2
    with pytest.raises(LayoutParityError) as err:
        report.raise_if_mismatch()
    assert err.value.report is report and "first: input_ids: sample 0" in str(err.value)


# ------------------------------------------------------------------ random single changes
FIELDS = ("input_ids", "position_ids", "loss_spans", "media_ids", "media_cache_keys")


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(FIELDS), sample=st.integers(0, 1), pick=st.integers(0, 10_000), row=st.integers(0, 2))
def test_single_change_is_found(training, field, sample, pick, row):
    values = {name: getattr(training, name) for name in type(training).model_fields}
    lo = int(training.cu_seqlens[sample])
    spans = training.modality_spans_of(sample)
    text_positions = [p for s in spans if s.modality == Modality.TEXT for p in range(s.start, s.end)]
    if field == "input_ids":
        p = text_positions[pick % len(text_positions)]
        ids = training.input_ids.clone()
        ids[lo + p] = 100 if int(ids[lo + p]) != 100 else 101
        values["input_ids"], expected = ids, ("input_ids", p)
    elif field == "position_ids":
        p = pick % int(training.seq_lengths()[sample])
        pos = training.position_ids.clone()
        pos[row, lo + p] += 1
        values["position_ids"], expected = pos, ("position_ids." + "thw"[row], p)
    elif field == "loss_spans":
        per = training.loss_spans.to_lists()
        s = per[sample][0]
        per[sample] = [Span(s.start, s.end - 1)]  # the last target is no longer scored
        values["loss_spans"], expected = SpanTable.from_lists(per), ("loss_spans", s.end - 1)
    else:
        media = [s for s in spans if s.media_index >= 0]
        target = media[pick % len(media)]
        changed = list(getattr(training, field))
        changed[target.media_index] = changed[target.media_index] + "-changed"
        values[field], expected = changed, (field, target.start)
    rollout = RLBatch(**values)
    report = check_layout_parity(rollout, training)
    assert not report.ok
    assert (report.first.field, report.first.sample, report.first.position) == (expected[0], sample, expected[1])
    assert check_layout_parity(training, training).ok


# ------------------------------------------------------------------ verl tensors
@pytest.fixture(scope="module")
def verl_case(processor, tiny_model):
    model = tiny_model
    samples = synthetic_image_text(3, seed=4, max_images=2)
    out = processor_inputs(processor, samples, padding_side="left")
    tok = processor.tokenizer
    responses = [tok.encode(t) + [151645] for t in ("red", "it is blue", "green")]
    R = max(map(len, responses)) + 2
    resp = torch.full((3, R), tok.pad_token_id)
    resp_mask = torch.zeros(3, R, dtype=torch.long)
    for b, r in enumerate(responses):
        resp[b, : len(r)] = torch.tensor(r)
        resp_mask[b, : len(r)] = 1
    input_ids = torch.cat([out["input_ids"], resp], dim=1)
    attention = torch.cat([out["attention_mask"], resp_mask], dim=1)
    types = torch.cat([out["mm_token_type_ids"], torch.zeros_like(resp, dtype=out["mm_token_type_ids"].dtype)], dim=1)
    mrope, _ = model.model.get_rope_index(input_ids, types, out["image_grid_thw"], attention_mask=attention)
    text_pos = (attention.cumsum(-1) - 1).clamp(min=0)
    position_ids = torch.cat([text_pos.unsqueeze(1), mrope.permute(1, 0, 2)], dim=1)  # (B, 4, L) as verl builds it
    counts = (out["image_grid_thw"].prod(-1)).tolist()
    per_sample_images = [len(s.images) for s in samples]
    mm, row, item = [], 0, 0
    for n in per_sample_images:
        rows = sum(counts[item : item + n])
        mm.append({"pixel_values": out["pixel_values"][row : row + rows], "image_grid_thw": out["image_grid_thw"][item : item + n]})
        row, item = row + rows, item + n
    reference = RLBatch.from_qwen_vl(out, processor=processor, responses=responses, group_ids=["u0", "u1", "u2"])
    return dict(processor=processor, input_ids=input_ids, attention=attention, position_ids=position_ids, resp=resp,
                resp_mask=resp_mask, mm=mm, reference=reference, text_pos=text_pos)


def test_from_verl_matches_processor_path(verl_case):
    c = verl_case
    batch = RLBatch.from_verl(c["input_ids"], c["attention"], c["position_ids"], processor=c["processor"],
                              responses=c["resp"], response_mask=c["resp_mask"], multi_modal_inputs=c["mm"],
                              group_ids=["u0", "u1", "u2"])
    assert check_layout_parity(batch, c["reference"]).ok
    # the same tensors with 1-D (B, L) positions are refused: the model computes others there ...
    image = next(s for s in c["reference"].modality_spans_of(0) if s.modality == Modality.IMAGE)
    with pytest.raises(SchemaError, match=rf"position_ids: sample 0, position {image.start + 1} .*allow_position_drift=True"):
        RLBatch.from_verl(c["input_ids"], c["attention"], c["text_pos"], processor=c["processor"],
                          responses=c["resp"], response_mask=c["resp_mask"], multi_modal_inputs=c["mm"])
    # ... and recorded when the rollout really used them: the drift is found in the first image
    one_d = RLBatch.from_verl(c["input_ids"], c["attention"], c["text_pos"], processor=c["processor"],
                              responses=c["resp"], response_mask=c["resp_mask"], multi_modal_inputs=c["mm"],
                              allow_position_drift=True)
    report = check_layout_parity(one_d, c["reference"])
    assert (report.first.field, report.first.sample, report.first.position) == ("position_ids.t", 0, image.start + 1)
    # a response mask that skips a token makes the loss spans differ there
    partial = c["resp_mask"].clone()
    partial[1, 0] = 0
    masked = RLBatch.from_verl(c["input_ids"], c["attention"], c["position_ids"], processor=c["processor"],
                               responses=c["resp"], response_mask=partial, multi_modal_inputs=c["mm"])
    report = check_layout_parity(masked, c["reference"])
    assert (report.first.field, report.first.sample, report.first.position) == ("loss_spans", 1, int(c["reference"].prompt_lengths[1]))


def test_from_token_lists_matches(verl_case):
    ref = verl_case["reference"]
    prompts = [ref.sample_tokens(b)[: int(ref.prompt_lengths[b])].tolist() for b in range(ref.num_samples)]
    responses = [ref.sample_tokens(b)[int(ref.prompt_lengths[b]) :].tolist() for b in range(ref.num_samples)]
    batch = RLBatch.from_token_lists(prompts, responses, processor=verl_case["processor"],
                                     image_grid_thw=ref.image_grid_thw, pixel_values=ref.pixel_values,
                                     group_ids=ref.group_ids)
    assert check_layout_parity(batch, ref).ok


# ------------------------------------------------------------------ log-prob comparison
def test_compare_logprobs_gated_and_measured(training):
    n = int(training.loss_spans.lengths().sum())
    base = -torch.rand(n, dtype=torch.float64) * 3 - 0.5  # log-probs <= 0 also after the +0.3 drift below
    rollout, _ = pair("different_eos_token")
    with pytest.raises(LayoutParityError, match="first: input_ids: sample 0"):
        compare_logprobs(base, base, rollout, training)
    result = compare_logprobs(base, base.clone(), training, training)
    assert result.ok and result.max_abs == 0 and result.ratio_min == result.ratio_max == 1.0
    drifted = base.clone()
    drifted[5] += 0.3
    drifted[7] += 1e-6
    result = compare_logprobs(base, drifted, training, training)
    sample, pos, _ = training.loss_spans.token_positions()
    assert not result.ok
    assert result.first_beyond["sample"] == int(sample[5]) and result.first_beyond["position"] == int(pos[5])
    assert result.max_abs == pytest.approx(0.3) and result.ratio_max == pytest.approx(float(torch.exp(torch.tensor(0.3))))
    assert result.ratio_outside_band == pytest.approx(1 / n)
    assert compare_logprobs(base, drifted, training, training, dtype=torch.bfloat16, tolerance=0.5).ok
    assert "first token beyond tolerance" in str(result)


# ------------------------------------------------------------------ CLI
def test_cli_exit_codes(capsys, tmp_path):
    assert cli_main(["parity", str(FIXTURES / "left_vs_right_padding.rollout.safetensors"), str(FIXTURES / "training.safetensors")]) == 0
    assert cli_main(["parity", str(FIXTURES / "missing_mm_token_type_ids.rollout.safetensors"),
                     str(FIXTURES / "training.safetensors"), "--json"]) == 1
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{") :])["first"]["field"] == "position_ids.t"
    assert cli_main(["parity", str(FIXTURES / "truncated_image_span.rollout.safetensors"), str(FIXTURES / "training.safetensors")]) == 2
    (tmp_path / "x.safetensors").write_bytes(b"not a batch")
    assert cli_main(["parity", str(tmp_path / "x.safetensors"), str(FIXTURES / "training.safetensors")]) == 2
    png = tmp_path / "layout.png"
    assert cli_main(["inspect", str(FIXTURES / "training.safetensors"), "--png", str(png)]) == 0
    assert png.stat().st_size > 1000 and "2 samples" in capsys.readouterr().out
