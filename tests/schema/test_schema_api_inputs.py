"""Unusual and bad input to the public API of ``rlk_mm.schema`` (docs/api/schema.md) beyond the
builders' own tables: the batch's views and methods, spans and span tables, media identity,
coordinates, videos, trajectories and the option sets, fed wrong types, bools for ints, nan and
inf, empty and huge values, mismatched lengths, unicode and the meta device. Each case must give
its documented result or an error of rlk_mm's naming the argument (and where it has them the
sample and position) and saying what to change (``context_cases.classify``: a silent wrong
result, a raw torch/Python error or an unclear one fails)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlk_mm import RLBatch
from rlk_mm.schema import (
    CoordinateSystem,
    LayoutFamily,
    Modality,
    PaddingSide,
    ResizeSettings,
    SchemaError,
    Span,
    SpanTable,
    Step,
    Trajectory,
    VideoLayout,
    complement,
    convert_points,
    dense_group_index,
    key_settings,
    layout_family_of,
    mask_from_spans,
    media_cache_key,
    media_token_counts,
    mrope_positions,
    normalize,
    spans_from_mask,
    step_group_index,
    vision_token_offsets,
)
from support.context_cases import Case, Raises, Returns, assert_well, fail, make_schema_context
from support.helpers import raised_by_rlk_mm

PIXELS = torch.zeros(16, 8)


@pytest.fixture(scope="module")
def ctx(processor, tmp_path_factory):
    return make_schema_context(processor, tmp_path_factory.mktemp("api"))


def ok(check):
    return Returns(lambda r, c: check(r, c) or fail(r))


CASES = [
    # ---- RLBatch views: sample indices, per-span values, padded layouts, summaries
    Case("sample_tokens.bool", lambda c: c.batch.sample_tokens(True), Raises(TypeError, r"sample must be an int, got bool")),
    Case("sample_tokens.float", lambda c: c.batch.sample_tokens(1.0), Raises(TypeError, r"sample must be an int, got float")),
    Case("sample_tokens.negative", lambda c: c.batch.sample_tokens(-1), Raises(IndexError, r"sample -1 is out of range")),
    Case("sample_tokens.numpy", lambda c: c.batch.sample_tokens(np.int64(2)),
         ok(lambda r, c: torch.equal(r, c.batch.sample_tokens(2)))),
    Case("loss_spans_of.tensor", lambda c: c.batch.loss_spans_of(torch.tensor(1)),
         ok(lambda r, c: r == c.batch.loss_spans_of(1))),
    Case("per_token.short", lambda c: c.batch.per_token(torch.zeros(2)),
         Raises(ValueError, r"span_values must have shape \[9, \*\] \(one value per modality span, in the order of "
                            r"modality_spans\), got \(2,\)")),
    Case("per_token.list", lambda c: c.batch.per_token([1.0] * c.batch.modality_spans.num_spans),
         Raises(TypeError, r"span_values must be a torch.Tensor")),
    Case("per_token.rows", lambda c: c.batch.per_token(torch.arange(c.batch.modality_spans.num_spans * 2).reshape(-1, 2)),
         ok(lambda r, c: r.shape == (c.batch.num_tokens, 2))),
    Case("loss_token_index.middle", lambda c: c.batch.loss_token_index(padded_length=64, padding="middle"),
         Raises(ValueError, r"padding='middle': expected one of left, right")),
    Case("loss_token_index.numpy_length", lambda c: c.batch.loss_token_index(padded_length=np.int32(64), padding="left"),
         ok(lambda r, c: r[0].numel() == c.batch.loss_mask().sum())),
    Case("loss_token_index.short", lambda c: c.batch.loss_token_index(padded_length=3, padding=PaddingSide.RIGHT),
         Raises(ValueError, r"a padded length of 3 is shorter than the longest sample \(sample \d, \d+ tokens\)")),
    Case("summary.bool", lambda c: c.batch.summary(True), Raises(TypeError, r"max_rows must be an int, got bool")),
    Case("summary.zero", lambda c: c.batch.summary(0), ok(lambda r, c: "... 3 more samples" in r)),
    # ---- select / concat / to
    Case("select.set", lambda c: c.batch.select({2, 0}),
         Raises(TypeError, r"indices must be a list of sample indices .* got set: a set has no order")),
    Case("select.duplicates", lambda c: c.batch.select([2, 2]), ok(lambda r, c: r.num_samples == 2)),
    Case("select.range", lambda c: c.batch.select(range(3)), ok(lambda r, c: r.equals(c.batch))),
    Case("select.bool_list", lambda c: c.batch.select([True, False, True]),
         Raises(TypeError, r"indices\[0\] is bool True; sample indices are ints")),
    Case("select.float_tensor", lambda c: c.batch.select(torch.tensor([0.0])), Raises(TypeError, r"indices must be integers")),
    Case("select.2d", lambda c: c.batch.select(np.array([[0, 1]])), Raises(ValueError, r"indices must be 1-D")),
    Case("select.generator", lambda c: c.batch.select(b for b in (1, 0)), ok(lambda r, c: r.num_samples == 2)),
    Case("concat.tuple", lambda c: RLBatch.concat((c.batch.select([0]), c.batch.select([1, 2]))),
         ok(lambda r, c: r.equals(c.batch))),
    Case("concat.set", lambda c: RLBatch.concat(frozenset()),
         Raises(TypeError, r"batches must be a list of RLBatch, got frozenset: a set has no order")),
    Case("concat.dict", lambda c: RLBatch.concat({"a": c.batch}),
         Raises(TypeError, r"batches\[0\] is str; RLBatch.concat joins RLBatch objects")),
    Case("to.float", lambda c: c.batch.to(1.5), Raises(ValueError, r"device=1.5 is not a torch device")),
    Case("to.none", lambda c: c.batch.to(None), Raises(ValueError, r"device=None is not a torch device")),
    Case("equals.dict", lambda c: c.batch.equals(dict(c.batch)), ok(lambda r, c: r is False)),
    # ---- save / load paths
    Case("save.missing_folder", lambda c: c.batch.save(c.tmp / "no" / "such" / "b.safetensors"),
         Raises(FileNotFoundError, r"no/such/b\.safetensors")),
    Case("load.text_file", lambda c: RLBatch.load(_write(c, "notes.txt", b"hello")),
         Raises(SchemaError, r"notes\.txt: not a readable safetensors file")),
    Case("load.empty_file", lambda c: RLBatch.load(_write(c, "empty.safetensors", b"")),
         Raises(SchemaError, r"empty\.safetensors: not a readable safetensors file")),
    Case("load.unicode_path", lambda c: RLBatch.load(c.batch.save(c.tmp / "ünï cødé 批.safetensors")),
         ok(lambda r, c: r.equals(c.batch))),
    # ---- the constructor: identity strings
    Case("construct.empty_key", lambda c: RLBatch(**{**dict(c.batch), "media_cache_keys": ["", "", "x"]}),
         Raises(SchemaError, r"media_cache_keys\[0\] is empty: a key names one content")),
    Case("construct.empty_id", lambda c: RLBatch(**{**dict(c.batch), "media_ids": ["", "", "x"]}),
         Raises(SchemaError, r"media_ids\[0\] is empty")),
    Case("construct.blank_fingerprint", lambda c: RLBatch(**{**dict(c.batch), "processor_fingerprint": "  "}),
         Raises(SchemaError, r"processor_fingerprint is empty")),
    Case("construct.unicode_ids", lambda c: RLBatch(**{**dict(c.batch), "media_ids": ["图-1", "图-1", "ß"]}),
         ok(lambda r, c: r.media_ids[2] == "ß")),
    # ---- builders: sets where order means something, blank ids
    Case("build.rewards.set", lambda c: _lists(c, rewards={1.0, 0.0}),
         Raises(TypeError, r"rewards must be a list of numbers, one per sample, got set: a set has no order")),
    Case("build.group_ids.set", lambda c: _lists(c, group_ids={"a", "b"}), Raises(TypeError, r"group_ids .* got set")),
    Case("build.media_ids.blank", lambda c: RLBatch.from_token_lists(c.prompts, c.responses, processor=c.processor,
                                                                      image_grid_thw=c.batch.media_grid_thw,
                                                                      pixel_values=c.batch.pixel_values, media_ids=["a", " ", "b"]),
         Raises(SchemaError, r"media_ids\[1\] is ' ': an empty str would name every item alike")),
    Case("build.rewards.tuple", lambda c: _lists(c, rewards=(1, 0.5)), ok(lambda r, c: r.rewards.tolist() == [1.0, 0.5])),
    # ---- spans
    Case("Span.bool_start", lambda c: Span(True, 3), Raises(TypeError, r"Span.start must be an int, got bool")),
    Case("Span.numpy", lambda c: Span(np.int64(1), np.int32(4)), ok(lambda r, c: (r.start, r.end) == (1, 4))),
    Case("Span.reversed", lambda c: Span(3, 1), Raises(SchemaError, r"span \[3, 1\) is not a valid half-open range")),
    Case("Span.beyond_int32", lambda c: Span(0, 2**31),
         Raises(SchemaError, r"span \[0, 2147483648\) .* positions are int32")),
    Case("SpanTable.beyond_int32", lambda c: SpanTable.from_lists([[Span(2**31 - 1, 2**31 + 5)]]),
         Raises(SchemaError, r"positions are int32")),
    Case("normalize.generator", lambda c: normalize(s for s in [Span(2, 4), Span(0, 3)]),
         ok(lambda r, c: r == [Span(0, 4)])),
    Case("normalize.set", lambda c: normalize({Span(2, 4), Span(0, 3)}), ok(lambda r, c: r == [Span(0, 4)])),
    Case("complement.bool_length", lambda c: complement([], True), Raises(TypeError, r"length must be an int, got bool")),
    Case("mask_from_spans.huge", lambda c: mask_from_spans([Span(0, 2)], 2**40),
         Raises(ValueError, r"length=1099511627776 is out of range: it must be >= 0 and <= 2147483647")),
    Case("mask_from_spans.media", lambda c: mask_from_spans([Span(0, 2, Modality.IMAGE, 0)], 3),
         ok(lambda r, c: r.tolist() == [True, True, False])),
    Case("spans_from_mask.numpy_bool", lambda c: spans_from_mask(np.array([True, False, True])),
         ok(lambda r, c: r == [Span(0, 1), Span(2, 3)])),
    Case("spans_from_mask.meta", lambda c: spans_from_mask(torch.zeros(3, dtype=torch.bool, device="meta")),
         Raises(ValueError, r"mask is on the meta device, which holds no values")),
    Case("SpanTable.spans_of.bool", lambda c: c.batch.loss_spans.spans_of(False),
         Raises(TypeError, r"sample must be an int, got bool")),
    # ---- media identity
    Case("media_cache_key.meta", lambda c: media_cache_key(PIXELS.to("meta"), [1, 4, 4], "image", "f"),
         Raises(ValueError, r"pixel_rows is on the meta device, which holds no values to check or read")),
    Case("media_cache_key.bool_grid", lambda c: media_cache_key(PIXELS, [True, 4, 4], "image", "f"),
         Raises(TypeError, r"grid_thw\[0\] must be an int, got bool")),
    Case("media_cache_key.tensor_grid", lambda c: media_cache_key(PIXELS, torch.tensor([1, 4, 4]), "image", "f"),
         ok(lambda r, c: r == media_cache_key(PIXELS, [1, 4, 4], "image", "f"))),
    Case("media_cache_key.modality_enum", lambda c: media_cache_key(PIXELS, [1, 4, 4], Modality.IMAGE, "f"),
         Raises(ValueError, r"modality=<Modality.IMAGE: 1>: expected one of image, video, audio")),
    Case("media_token_counts.meta", lambda c: media_token_counts(torch.ones(1, 3, dtype=torch.int64, device="meta"), 2),
         Raises(ValueError, r"grid_thw is on the meta device, which holds no values")),
    Case("media_token_counts.bool_merge", lambda c: media_token_counts(torch.tensor([[1, 2, 2]]), True),
         Raises(TypeError, r"merge_size must be an int, got bool")),
    Case("vision_token_offsets.list", lambda c: vision_token_offsets([[1, 2, 2]], [1], 2),
         Raises(TypeError, r"modality must be a torch.Tensor")),
    Case("key_settings.none", lambda c: key_settings(None), Raises(TypeError, r"cache_key must be a str, got NoneType")),
    Case("key_settings.foreign_tag", lambda c: key_settings("abc#size=12"),
         Raises(ValueError, r"'size=12' is not a ResizeSettings tag")),
    Case("key_settings.nan_fps", lambda c: key_settings("k#min_pixels=1;max_pixels=2;resized_height=28;resized_width=28;fps=nan"),
         Raises(ValueError, r"'min_pixels=1;.*fps=nan' is a ResizeSettings tag of bad values: ResizeSettings.fps=nan: a "
                            r"frame rate is a finite number > 0")),
    Case("key_settings.plain", lambda c: key_settings("plain"), ok(lambda r, c: r is None)),
    Case("ResizeSettings.round_trip", lambda c: ResizeSettings.from_tag(ResizeSettings(1, 2, 28, 56, frames=(0, 2)).tag()),
         ok(lambda r, c: r == ResizeSettings(1, 2, 28, 56, frames=(0, 2)))),
    Case("mrope.bool_merge", lambda c: mrope_positions(torch.zeros(4, dtype=torch.int64), [], True, None),
         Raises(TypeError, r"merge_size must be an int, got bool")),
    Case("mrope.inf_tps", lambda c: mrope_positions(torch.zeros(4, dtype=torch.int64), [], 2, math.inf),
         Raises(ValueError, r"tokens_per_second=inf must be a finite number")),
    # ---- coordinates
    Case("convert.meta", lambda c: convert_points(torch.zeros(2, 2, device="meta"), "normalized", "normalized_1000"),
         Raises(ValueError, r"points is on the meta device, which holds no values to check")),
    Case("convert.numpy_size", lambda c: convert_points(torch.tensor([[0.5, 0.5]]), "normalized", "absolute",
                                                        original_size=np.array([640, 480])),
         ok(lambda r, c: r.tolist() == [[320.0, 240.0]])),
    Case("convert.float_tensor_size", lambda c: convert_points(torch.tensor([[0.5, 0.5]]), "normalized", "absolute",
                                                               original_size=torch.tensor([640.0, 480.0])),
         Raises(TypeError, r"original_size\[0\] must be an int")),
    Case("convert.enum_member", lambda c: convert_points(torch.tensor([[1.0, 1.0]]), CoordinateSystem.NORMALIZED,
                                                         CoordinateSystem.NORMALIZED_1000),
         ok(lambda r, c: r.tolist() == [[1000.0, 1000.0]])),
    Case("convert.grad", lambda c: convert_points(torch.tensor([[0.5, 0.5]], requires_grad=True), "normalized", "absolute",
                                                  original_size=(10, 10)),
         ok(lambda r, c: r.requires_grad)),
    # ---- groups, videos, trajectories, layout families, options
    Case("dense_group_index.set", lambda c: dense_group_index({"a", "b"}),
         Raises(TypeError, r"group_ids must be a list .* got set: a set has no order")),
    Case("dense_group_index.empty", lambda c: dense_group_index([]), ok(lambda r, c: r.tolist() == [])),
    Case("dense_group_index.unicode", lambda c: dense_group_index(["é", "e\u0301", "é"]),
         ok(lambda r, c: r.tolist() == [0, 1, 0])),
    Case("VideoLayout.no_videos", lambda c: VideoLayout(c.batch).num_frames(0), Raises(ValueError, r"the batch has no video items")),
    Case("VideoLayout.str", lambda c: VideoLayout("batch"), Raises(TypeError, r"batch must be an RLBatch, got str")),
    Case("step_group_index.str", lambda c: step_group_index("abc"), Raises(TypeError, r"batch must be an RLBatch")),
    Case("Trajectory.no_steps", lambda c: RLBatch.from_trajectories([Trajectory("e", "task", [])], processor=c.processor),
         Raises(SchemaError, r"trajectories\[0\] \('e'\) has no steps: an episode has at least one action")),
    Case("Trajectory.nan_reward",
         lambda c: RLBatch.from_trajectories([Trajectory("e", "t", [Step(_screen(), "click", math.nan)])], processor=c.processor),
         Raises(SchemaError, r"trajectories\[0\] \('e'\), step 0: reward is nan; a step reward is a finite number")),
    Case("Trajectory.bool_history",
         lambda c: RLBatch.from_trajectories([Trajectory("e", "t", [Step(_screen(), "click", 1.0)])], processor=c.processor,
                                             history=True),
         Raises(TypeError, r"history must be an int")),
    Case("layout_family_of.none", lambda c: layout_family_of(None), Raises(TypeError, r"processor")),
    Case("LayoutFamily.parse", lambda c: LayoutFamily.parse("qwen9", "family"), Raises(ValueError, r"family='qwen9'")),
    Case("Modality.parse", lambda c: Span(0, 1, "image"), Raises(ValueError, r"Span.modality='image': expected one of")),
]


def _lists(c, **kwargs) -> RLBatch:
    prompts, responses = c.verl_lists
    return RLBatch.from_token_lists(prompts, responses, processor=c.processor, **kwargs)


def _write(c, name: str, data: bytes):
    path = c.tmp / name
    path.write_bytes(data)
    return path


def _screen():
    from PIL import Image

    return Image.new("RGB", (56, 56), (10, 20, 30))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_input(case, ctx):
    assert_well(case, ctx)


CONTAINERS = {"list": list, "tuple": tuple, "generator": lambda v: (x for x in v), "set": set,
              "numpy": lambda v: np.array(v), "tensor": lambda v: torch.tensor(v), "dict": lambda v: dict(enumerate(v))}
NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10), st.booleans(), st.none(), st.just("1"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(sorted(CONTAINERS)), st.lists(NUMBER, min_size=1, max_size=3), st.sampled_from(["rewards", "costs"]))
def test_per_sample_numbers_in_any_container(ctx, container, values, name):
    """Rewards or costs of two samples in any container holding anything: the batch stores exactly the
    values as float32 when they are two finite real numbers (within float32) in an ordered container,
    else an error of rlk_mm names the argument; never a raw error, never other values."""
    try:
        given_values = CONTAINERS[container](values)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return  # numpy/torch cannot hold the mix: nothing reaches rlk_mm
    try:
        batch = _lists(ctx, **{name: given_values})
    except (TypeError, ValueError) as e:
        assert raised_by_rlk_mm(e) and name in str(e), f"{type(e).__name__}: {e}"
        return
    if container in ("numpy", "tensor"):  # what the array holds: numpy and torch convert a mix (False in floats is 0.0)
        values = given_values.tolist()
    assert container not in ("set", "dict") and len(values) == 2
    assert all(not isinstance(v, (bool, str)) and v is not None and abs(float(v)) <= 3.4028234663852886e38 for v in values)
    assert getattr(batch, name).tolist() == torch.tensor([float(v) for v in values], dtype=torch.float32).tolist()
