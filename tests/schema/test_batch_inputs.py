"""Bad and unusual input to every public function of rlk_mm.schema (the builders, RLBatch and its
operations, spans, media sizes), as a new user gives it.

``BAD`` is a table of inputs that must be refused: each case names the error type and a
pattern its message must match (the argument, the sample and the position where there
are ones, and what to change). ``UNUSUAL`` holds unusual inputs that are valid: each must
give its documented result. ``outcome`` sorts a case into ok / silent (no error, or a
wrong result) / crash (an error that rlk_mm did not raise itself, e.g. a raw torch error)
/ unclear (rlk_mm's own error, but not the expected one). The property tests at the end
corrupt valid batches and builder inputs at random and check that every corruption is
refused with an error naming the field, the sample and the position.

``PYTHONPATH=tests python tests/schema/test_batch_inputs.py`` prints the tally per kind (with
``PYTHONPATH=<an older checkout>`` it counts that version).
"""

from __future__ import annotations

import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm.fixtures import processor_inputs, qwen_vl_processor, synthetic_image_text, synthetic_video_text
from rlk_mm.schema import (
    BatchFileError,
    Modality,
    RLBatch,
    SchemaError,
    Span,
    SpanTable,
    complement,
    convert_boxes,
    convert_points,
    dense_group_index,
    intersect,
    mask_from_spans,
    media_cache_key,
    media_token_counts,
    mrope_positions,
    normalize,
    processor_fingerprint,
    spans_from_mask,
    union,
    vision_token_offsets,
)
from support.helpers import PACKAGE_DIR, raised_by_rlk_mm

IM_END, PAD, IMAGE, VIDEO = 151645, 151643, 151655, 151656


# ----------------------------------------------------------------------------- the context
def make_context(processor) -> SimpleNamespace:
    """Three samples of one image each (56x56, 112x112, 84x56: sample 0 and 2 left-padded),
    their responses, the batch built from them and the same data as verl tensors."""
    samples = [
        synthetic_image_text(1, seed=s, sizes=[size], max_images=1)[0]
        for s, size in ((1, (56, 56)), (2, (112, 112)), (3, (84, 56)))
    ]
    out = processor_inputs(processor, samples, padding_side="left")
    tok = processor.tokenizer
    resp = [tok.encode(t) + [IM_END] for t in ("red", "it is blue", "3")]
    batch = RLBatch.from_qwen_vl(out, processor=processor, responses=resp, group_ids=["a", "b", "c"],
                                 rewards=[1.0, 0.0, 0.5])
    prompts = [out["input_ids"][b][out["attention_mask"][b].bool()].tolist() for b in range(3)]
    B, Lp = out["input_ids"].shape
    R = max(map(len, resp)) + 1
    r_ids = torch.full((B, R), PAD)
    r_mask = torch.zeros(B, R, dtype=torch.int64)
    for b, r in enumerate(resp):
        r_ids[b, : len(r)] = torch.tensor(r)
        r_mask[b, : len(r)] = 1
    ids = torch.cat([out["input_ids"], r_ids], 1)
    attention = torch.cat([out["attention_mask"], r_mask], 1)
    pos = torch.zeros(B, 3, Lp + R, dtype=torch.int64)
    for b in range(B):
        pos[b][:, attention[b].bool()] = batch.sample_positions(b)
    rows = out["image_grid_thw"].prod(1).tolist()
    starts = [0, rows[0], rows[0] + rows[1]]
    mm = [{"pixel_values": out["pixel_values"][s : s + n], "image_grid_thw": out["image_grid_thw"][b : b + 1]}
          for b, (s, n) in enumerate(zip(starts, rows))]
    verl = dict(input_ids=ids, attention_mask=attention, position_ids=pos, responses=r_ids, response_mask=r_mask,
                multi_modal_inputs=mm)
    grounded = rebuild(SimpleNamespace(batch=batch), coordinate_system="normalized",
                       bbox_targets=torch.tensor([[0.1, 0.1, 0.5, 0.5]]), bbox_sample=torch.tensor([1]),
                       region_spans=SpanTable.from_lists([[Span(len(prompts[0]), len(prompts[0]) + 1)], [], []]),
                       region_rewards=torch.tensor([1.0]))
    return SimpleNamespace(p=processor, out=out, resp=resp, batch=batch, prompts=prompts, verl=verl, grounded=grounded,
                           grid=out["image_grid_thw"], pixels=out["pixel_values"])


def rebuild(ctx, batch=None, **changes) -> RLBatch:
    """``RLBatch(**fields)`` of ``ctx.batch`` (or ``batch``) with some fields changed."""
    batch = batch or ctx.batch
    return RLBatch(**{**{k: getattr(batch, k) for k in type(batch).model_fields}, **changes})


def qwen(ctx, **changes):
    """``from_qwen_vl`` on the context's processor output, with keys of it or arguments changed."""
    out = dict(ctx.out)
    kwargs = dict(processor=ctx.p, responses=ctx.resp)
    for key, value in changes.items():
        target = out if key in ctx.out or key in ("pixel_values_videos", "video_grid_thw",
                                                  "second_per_grid_ts") else kwargs
        if value is None and target is out:
            out.pop(key, None)
        else:
            target[key] = value
    return RLBatch.from_qwen_vl(out, **kwargs)


def lists(ctx, **changes):
    """``from_token_lists`` on the context's unpadded prompts, responses, grids and pixels."""
    kwargs = dict(prompt_token_ids=ctx.prompts, response_token_ids=ctx.resp, processor=ctx.p,
                  image_grid_thw=ctx.grid, pixel_values=ctx.pixels)
    kwargs.update(changes)
    return RLBatch.from_token_lists(**kwargs)


def verl(ctx, **changes):
    kwargs = dict(ctx.verl, processor=ctx.p)
    kwargs.update(changes)
    return RLBatch.from_verl(kwargs.pop("input_ids"), kwargs.pop("attention_mask"), kwargs.pop("position_ids"),
                             **kwargs)


def edited(tensor: torch.Tensor, index, value) -> torch.Tensor:
    out = tensor.clone()
    out[index] = value
    return out


# ----------------------------------------------------------------------------- cases
@dataclass
class Case:
    name: str
    call: Callable[[Any], Any]
    error: Optional[type | tuple] = None  # the error it must raise; None: it must succeed
    match: str = ""  # a pattern of the error message
    check: Callable[[Any, Any], bool] = lambda ctx, result: True  # the documented result

    def __str__(self) -> str:
        return self.name


def bad(name, call, error, match) -> Case:
    return Case(name, call, error, match)


def unusual(name, call, check) -> Case:
    return Case(name, call, None, "", check)


BAD = [
    # ---- RLBatch(**fields): types and dtypes
    bad("batch.input_ids float", lambda c: rebuild(c, input_ids=c.batch.input_ids.float()), SchemaError,
        r"input_ids must be a 1-D int64"),
    bad("batch.input_ids list", lambda c: rebuild(c, input_ids=c.batch.input_ids.tolist()), SchemaError,
        r"input_ids.*Tensor"),
    bad("batch.input_ids 2-D", lambda c: rebuild(c, input_ids=c.batch.input_ids[None]), SchemaError,
        r"input_ids must be a 1-D int64"),
    bad("batch.input_ids -100",
        lambda c: rebuild(c, input_ids=edited(c.batch.input_ids, int(c.batch.cu_seqlens[1]) + 3, -100)),
        SchemaError, r"input_ids: sample 1, position 3 is -100.*ignore index"),
    bad("batch.cu_seqlens int64", lambda c: rebuild(c, cu_seqlens=c.batch.cu_seqlens.long()), SchemaError,
        r"cu_seqlens must be a 1-D int32"),
    bad("batch.cu_seqlens decreasing",
        lambda c: rebuild(c, cu_seqlens=edited(c.batch.cu_seqlens, 1, int(c.batch.cu_seqlens[2]) + 1)),
        SchemaError, r"cu_seqlens: sample 1 has -\d+ tokens"),
    bad("batch.cu_seqlens end", lambda c: rebuild(c, cu_seqlens=edited(c.batch.cu_seqlens, -1, c.batch.num_tokens - 1)),
        SchemaError, r"cu_seqlens must run from 0 to the token count"),
    bad("batch.position_ids float", lambda c: rebuild(c, position_ids=c.batch.position_ids.float()), SchemaError,
        r"position_ids must be int64"),
    bad("batch.position_ids short", lambda c: rebuild(c, position_ids=c.batch.position_ids[:, 1:]), SchemaError,
        r"position_ids must be int64 of shape"),
    bad("batch.position_ids negative",
        lambda c: rebuild(c, position_ids=edited(c.batch.position_ids, (1, int(c.batch.cu_seqlens[2]) + 4), -3)),
        SchemaError, r"position_ids: sample 2, position 4 is -3"),
    bad("batch.image_token_id float", lambda c: rebuild(c, image_token_id=float(IMAGE)), SchemaError,
        r"image_token_id.*integer"),
    bad("batch.image_token_id str", lambda c: rebuild(c, image_token_id=str(IMAGE)), SchemaError,
        r"image_token_id.*integer"),
    bad("batch.image_token_id bool", lambda c: rebuild(c, image_token_id=True), SchemaError,
        r"image_token_id.*integer"),
    bad("batch.video_token_id = image", lambda c: rebuild(c, video_token_id=IMAGE), SchemaError,
        r"image_token_id and video_token_id are both 151655"),
    bad("batch.spatial_merge_size 0", lambda c: rebuild(c, spatial_merge_size=0), SchemaError,
        r"spatial_merge_size=0.*>= 1"),
    bad("batch.spatial_merge_size 3", lambda c: rebuild(c, spatial_merge_size=3), SchemaError,
        r"media_grid_thw\[0\] is \[1, 4, 4\]: h and w must be multiples of the merge size 3"),
    bad("batch.processor_fingerprint empty", lambda c: rebuild(c, processor_fingerprint=""), SchemaError,
        r"processor_fingerprint is empty"),
    bad("batch.media_ids tuple", lambda c: rebuild(c, media_ids=tuple(c.batch.media_ids)), SchemaError,
        r"media_ids.*list"),
    bad("batch.media_ids int", lambda c: rebuild(c, media_ids=[0, 1, 2]), SchemaError, r"media_ids.*string"),
    bad("batch.media_cache_keys shared by other grids",
        lambda c: rebuild(c, media_cache_keys=[c.batch.media_cache_keys[0]] * 3),
        SchemaError, r"media_cache_keys: media items 0 and 1 share a key but have different grids"),
    bad("batch.media_grid_thw float", lambda c: rebuild(c, media_grid_thw=c.batch.media_grid_thw.float()), SchemaError,
        r"media_grid_thw must be int64"),
    bad("batch.media_grid_thw [M, 2]", lambda c: rebuild(c, media_grid_thw=c.batch.media_grid_thw[:, 1:]), SchemaError,
        r"media_grid_thw has shape \(3, 2\); expected \[3, 3\]"),
    bad("batch.media_modality 5", lambda c: rebuild(c, media_modality=edited(c.batch.media_modality, 0, 5)),
        SchemaError, r"media_modality\[0\] is 5"),
    bad("batch.media_sample out of range", lambda c: rebuild(c, media_sample=edited(c.batch.media_sample, 2, 7)),
        SchemaError, r"media_sample\[2\] is 7.*samples 0\.\.2"),
    bad("batch.vision_token_offsets", lambda c: rebuild(c, vision_token_offsets=c.batch.vision_token_offsets + 1),
        SchemaError, r"vision_token_offsets\[0\] is 1, expected 0"),
    bad("batch.pixel_values extra row", lambda c: rebuild(c, pixel_values=torch.cat([c.pixels, c.pixels[:1]])),
        SchemaError, r"pixel_values has 105 rows; image_grid_thw needs 104"),
    bad("batch.pixel_values nan", lambda c: rebuild(c, pixel_values=edited(c.pixels, (20, 3), math.nan)),
        SchemaError, r"pixel_values: row 20, column 3 is nan \(image 1\)"),
    bad("batch.pixel_values int", lambda c: rebuild(c, pixel_values=c.pixels.long()), SchemaError,
        r"pixel_values must be float64 or float32"),
    bad("batch.image_grid_thw disagrees", lambda c: rebuild(c, image_grid_thw=c.grid.flip(0)), SchemaError,
        r"image_grid_thw\[0\] is \[1, 4, 6\] but media item 0 \(image\) has grid \[1, 4, 4\]"),
    bad("batch.image_grid_thw missing", lambda c: rebuild(c, image_grid_thw=None, pixel_values=None), SchemaError,
        r"image_grid_thw is missing: the batch has 3 image items"),
    bad("batch.second_per_grid_ts without videos", lambda c: rebuild(c, second_per_grid_ts=torch.ones(1)), SchemaError,
        r"second_per_grid_ts has shape \(1,\); expected \[0\] \(one per video\)"),
    bad("batch.prompt_lengths float", lambda c: rebuild(c, prompt_lengths=c.batch.prompt_lengths.float()), SchemaError,
        r"prompt_lengths must be int64"),
    bad("batch.prompt_lengths too long", lambda c: rebuild(c, prompt_lengths=edited(c.batch.prompt_lengths, 1, 500)),
        SchemaError, r"prompt_lengths\[1\] is 500 but sample 1 has \d+ tokens"),
    bad("batch.prompt_lengths negative", lambda c: rebuild(c, prompt_lengths=edited(c.batch.prompt_lengths, 0, -2)),
        SchemaError, r"prompt_lengths\[0\] is -2"),
    bad("batch.rewards float64", lambda c: rebuild(c, rewards=c.batch.rewards.double()), SchemaError,
        r"rewards must be float32"),
    bad("batch.rewards [B, 1]", lambda c: rebuild(c, rewards=c.batch.rewards[:, None]), SchemaError,
        r"rewards has shape \(3, 1\); expected \[3\] \(one value per sample\)"),
    bad("batch.rewards nan", lambda c: rebuild(c, rewards=edited(c.batch.rewards, 2, math.nan)), SchemaError,
        r"rewards\[2\] is nan \(sample 2\)"),
    bad("batch.group_ids ints", lambda c: rebuild(c, group_ids=[0, 0, 1]), SchemaError, r"group_ids.*string"),
    bad("batch.region_rewards inf", lambda c: rebuild(c, c.grounded, region_rewards=torch.tensor([math.inf])),
        SchemaError, r"region_rewards\[0\] is inf"),
    bad("batch.bbox_targets nan",
        lambda c: rebuild(c, c.grounded, bbox_targets=torch.tensor([[0.1, math.nan, 0.5, 0.5]])),
        SchemaError, r"bbox_targets\[0\] \(sample 1\) is \[0.1, nan, 0.5, 0.5\]; coordinates must be finite"),
    bad("batch.bbox_targets x1 < x0",
        lambda c: rebuild(c, c.grounded, bbox_targets=torch.tensor([[0.5, 0.1, 0.1, 0.5]])),
        SchemaError, r"bbox_targets\[0\] \(sample 1\) is \[0.5, 0.1, 0.1, 0.5\]; a box has x0 <= x1 and y0 <= y1"),
    bad("batch.bbox_sample float", lambda c: rebuild(c, c.grounded, bbox_sample=torch.tensor([1.0])), SchemaError,
        r"bbox_sample must be int64"),
    bad("batch.bbox_sample out of range", lambda c: rebuild(c, c.grounded, bbox_sample=torch.tensor([3])), SchemaError,
        r"bbox_sample\[0\] is 3.*samples 0\.\.2"),
    bad("batch.bbox without coordinate_system", lambda c: rebuild(c, c.grounded, coordinate_system=None), SchemaError,
        r"bbox_targets given without coordinate_system"),
    bad("batch.point_targets inf",
        lambda c: rebuild(c, c.grounded, point_targets=torch.tensor([[math.inf, 0.0]]), point_sample=torch.tensor([0])),
        SchemaError, r"point_targets\[0\] \(sample 0\) is \[inf, 0.0\]; coordinates must be finite"),
    bad("batch.screen_size zero", lambda c: rebuild(c, screen_size=torch.tensor([[640, 480], [0, 480], [640, 480]])),
        SchemaError, r"screen_size\[1\] is \[0, 480\]"),
    bad("batch.screen_size float", lambda c: rebuild(c, screen_size=torch.ones(3, 2)), SchemaError,
        r"screen_size must be int64"),
    bad("batch.rewards on meta", lambda c: rebuild(c, rewards=c.batch.rewards.to("meta")), SchemaError,
        r"rewards is on meta; input_ids is on cpu"),
    bad("batch.coordinate_system unknown", lambda c: rebuild(c, coordinate_system="pixels"), SchemaError,
        r"coordinate_system='pixels': expected one of"),
    bad("batch.modality_spans lists", lambda c: rebuild(c, modality_spans=c.batch.modality_spans.to_lists()),
        SchemaError, r"modality_spans.*SpanTable"),
    bad("batch.loss_spans with a media modality",
        lambda c: rebuild(c,
                          loss_spans=SpanTable(c.batch.loss_spans.starts, c.batch.loss_spans.ends,
                                               c.batch.loss_spans.sample_ptr, [1, 0, 0])),
        SchemaError, r"loss_spans: sample 0, span image\[\d+, \d+\) is not a text span"),
    # ---- from_qwen_vl
    bad("qwen.processor_output tensor", lambda c: RLBatch.from_qwen_vl(c.out["input_ids"], processor=c.p), TypeError,
        r"processor_output must be a mapping"),
    bad("qwen.processor_output no input_ids", lambda c: qwen(c, input_ids=None), SchemaError,
        r"processor_output has no 'input_ids'"),
    bad("qwen.no attention_mask, left padding", lambda c: qwen(c, attention_mask=None), SchemaError,
        r"input_ids: sample 0 starts with the pad token 151643 but no attention_mask was given"),
    bad("qwen.all-ones attention_mask, left padding",
        lambda c: qwen(c, attention_mask=torch.ones_like(c.out["attention_mask"])), SchemaError,
        r"attention_mask: sample 0 marks position 0, the pad token 151643, as a real token"),
    bad("qwen.attention_mask shape", lambda c: qwen(c, attention_mask=c.out["attention_mask"][:, 1:]), SchemaError,
        r"attention_mask must have shape \[3, 51\]"),
    bad("qwen.attention_mask float", lambda c: qwen(c, attention_mask=c.out["attention_mask"].float()), TypeError,
        r"attention_mask must be bool/int"),
    bad("qwen.attention_mask 2", lambda c: qwen(c, attention_mask=edited(c.out["attention_mask"], (1, 7), 2)),
        SchemaError, r"attention_mask: sample 1, position 7 is 2; expected 0 or 1"),
    bad("qwen.attention_mask all zero", lambda c: qwen(c, attention_mask=edited(c.out["attention_mask"], 1, 0)),
        SchemaError, r"attention_mask: sample 1 has no real tokens"),
    bad("qwen.attention_mask holes", lambda c: qwen(c, attention_mask=edited(c.out["attention_mask"], (1, 20), 0)),
        SchemaError, r"attention_mask: sample 1 has holes.*position 20"),
    bad("qwen.input_ids float", lambda c: qwen(c, input_ids=c.out["input_ids"].float()), TypeError,
        r"input_ids must be int"),
    bad("qwen.input_ids 1-D", lambda c: qwen(c, input_ids=c.out["input_ids"][0]), SchemaError,
        r"input_ids must be 2-D"),
    bad("qwen.input_ids -100", lambda c: qwen(c, input_ids=edited(c.out["input_ids"], (1, 5), -100)), SchemaError,
        r"input_ids: sample 1, position 5 is -100.*ignore index"),
    bad("qwen.input_ids beyond vocabulary", lambda c: qwen(c, input_ids=edited(c.out["input_ids"], (1, 5), 200_000)),
        SchemaError,
        r"input_ids: sample 1, position 5 is 200000.*vocabulary of 151669"),
    bad("qwen.mm_token_type_ids shape", lambda c: qwen(c, mm_token_type_ids=c.out["mm_token_type_ids"][:2]),
        SchemaError, r"mm_token_type_ids must have shape \[3, 51\]"),
    bad("qwen.pixel_values extra row", lambda c: qwen(c, pixel_values=torch.cat([c.pixels, c.pixels[:1]])), SchemaError,
        r"pixel_values has 105 rows; image_grid_thw needs 104"),
    bad("qwen.pixel_values nan", lambda c: qwen(c, pixel_values=edited(c.pixels, (100, 0), math.inf)), SchemaError,
        r"pixel_values: row 100, column 0 is inf \(image 2\)"),
    bad("qwen.pixel_values 1-D", lambda c: qwen(c, pixel_values=c.pixels.flatten()), SchemaError,
        r"pixel_values must be 2-D"),
    bad("qwen.image_grid_thw flat", lambda c: qwen(c, image_grid_thw=c.grid.flatten()), SchemaError,
        r"image_grid_thw must have shape \[N, 3\]"),
    bad("qwen.image_grid_thw float", lambda c: qwen(c, image_grid_thw=c.grid.float()), TypeError,
        r"image_grid_thw must be int"),
    bad("qwen.image_grid_thw not divisible by merge",
        lambda c: qwen(c, image_grid_thw=edited(c.grid, 0, torch.tensor([1, 1, 16]))), SchemaError,
        r"image_grid_thw\[0\] is \[1, 1, 16\]: h and w must be multiples of the merge size 2"),
    bad("qwen.image_grid_thw zero", lambda c: qwen(c, image_grid_thw=edited(c.grid, (1, 0), 0)), SchemaError,
        r"image_grid_thw\[1\] is \[0, 8, 8\]"),
    bad("qwen.responses str item", lambda c: qwen(c, responses=["red", *c.resp[1:]]), TypeError,
        r"responses\[0\] is str"),
    bad("qwen.responses None item", lambda c: qwen(c, responses=[None, *c.resp[1:]]), TypeError,
        r"responses\[0\] is None"),
    bad("qwen.responses floats", lambda c: qwen(c, responses=[[1.0, 2.0], *c.resp[1:]]), TypeError,
        r"responses\[0\]\[0\] is float 1.0"),
    bad("qwen.responses scalars", lambda c: qwen(c, responses=[5, 6, 7]), TypeError, r"responses\[0\] is int"),
    bad("qwen.responses nested", lambda c: qwen(c, responses=[[r] for r in c.resp]), TypeError,
        r"responses\[0\]\[0\] is list"),
    bad("qwen.responses -100", lambda c: qwen(c, responses=[c.resp[0], c.resp[1][:2] + [-100], c.resp[2]]), SchemaError,
        r"responses: sample 1, position 2 is -100"),
    bad("qwen.responses beyond vocabulary", lambda c: qwen(c, responses=[c.resp[0], [999_999], c.resp[2]]), SchemaError,
        r"responses: sample 1, position 0 is 999999"),
    bad("qwen.responses a str", lambda c: qwen(c, responses="abc"), TypeError,
        r"responses must be a list of token-id sequences or a \[B, R\] tensor, got str"),
    bad("qwen.responses float tensor",
        lambda c: qwen(c, responses=c.verl["responses"].float(),
                       response_mask=c.verl["response_mask"]), TypeError, r"responses must be int"),
    bad("qwen.response_mask shape",
        lambda c: qwen(c, responses=c.verl["responses"], response_mask=c.verl["response_mask"][:, 1:]), SchemaError,
        r"response_mask must have shape \[3, \d+\]"),
    bad("qwen.response_mask without responses",
        lambda c: qwen(c, responses=None,
                       response_mask=c.verl["response_mask"]), SchemaError, r"response_mask given without responses"),
    bad("qwen.response_mask with list responses", lambda c: qwen(c, response_mask=c.verl["response_mask"]), SchemaError,
        r"response_mask is for a padded \[B, R\] responses tensor"),
    bad("qwen.assistant_mask shape", lambda c: qwen(c, assistant_mask=c.out["attention_mask"][:, :-1]), SchemaError,
        r"assistant_mask must have shape \[3, 51\]"),
    bad("qwen.assistant_mask over an image", lambda c: qwen(c, assistant_mask=(c.out["input_ids"] == IMAGE).long()),
        SchemaError,
        r"assistant_mask: sample 0 marks position \d+, a media placeholder"),
    bad("qwen.position_ids shape", lambda c: qwen(c, position_ids=torch.zeros(3, 3, 50, dtype=torch.int64)),
        SchemaError, r"position_ids must have shape \(3, 3, 51\) or \(3, 51\)"),
    bad("qwen.position_ids float", lambda c: qwen(c, position_ids=torch.zeros(3, 3, 51)), TypeError,
        r"position_ids must be int"),
    bad("qwen.position_ids (B, 3, L) for (3, B, L)",
        lambda c: qwen(c, position_ids=padded_positions(c).transpose(0, 1).contiguous()), SchemaError,
        r"position_ids: .*\(3, B, L\).*sample \d, position \d+ .*t, h, w"),
    bad("qwen.position_ids shifted", lambda c: qwen(c, position_ids=padded_positions(c) + 1), SchemaError,
        r"position_ids: sample 0, position 0 \(token \d+\) has t/h/w positions \[1, 1, 1\] but the model computes "
        r"\[0, 0, 0\].*allow_position_drift=True"),
    bad("qwen.position_ids 1-D with images", lambda c: qwen(c, position_ids=text_positions(c)), SchemaError,
        r"position_ids: sample 0, position \d+ \(token 151655\) has t/h/w positions .* but the model computes"),
    bad("qwen.allow_position_drift str", lambda c: qwen(c, position_ids=padded_positions(c), allow_position_drift="yes"),
        TypeError, r"allow_position_drift must be True or False, got str"),
    bad("qwen.group_ids str", lambda c: qwen(c, group_ids="abc"), TypeError, r"group_ids must be a list .* got str"),
    bad("qwen.group_ids None item", lambda c: qwen(c, group_ids=["a", None, "b"]), TypeError,
        r"group_ids\[1\] is None"),
    bad("qwen.group_ids float item", lambda c: qwen(c, group_ids=[1.5, 1.5, 2.0]), TypeError,
        r"group_ids\[0\] is float 1.5"),
    bad("qwen.rewards None item", lambda c: qwen(c, rewards=[None, 1.0, 0.0]), TypeError, r"rewards\[0\] is None"),
    bad("qwen.rewards str item", lambda c: qwen(c, rewards=["1", 1.0, 0.0]), TypeError, r"rewards\[0\] is str"),
    bad("qwen.rewards bool item", lambda c: qwen(c, rewards=[True, 1.0, 0.0]), TypeError, r"rewards\[0\] is bool"),
    bad("qwen.rewards [B, 1]", lambda c: qwen(c, rewards=torch.ones(3, 1)), SchemaError,
        r"rewards must have shape \[3\]"),
    bad("qwen.rewards nan", lambda c: qwen(c, rewards=[0.0, math.nan, 1.0]), SchemaError,
        r"rewards\[1\] is nan \(sample 1\)"),
    bad("qwen.costs inf", lambda c: qwen(c, costs=[0.0, 0.0, math.inf]), SchemaError,
        r"costs\[2\] is inf \(sample 2\)"),
    bad("qwen.media_ids str", lambda c: qwen(c, media_ids="abc"), TypeError,
        r"media_ids must be a list of str, got str"),
    bad("qwen.media_ids ints", lambda c: qwen(c, media_ids=[1, 2, 3]), TypeError, r"media_ids\[0\] is int"),
    bad("qwen.tokens_per_second nan", lambda c: qwen(c, tokens_per_second=math.nan), ValueError,
        r"tokens_per_second=nan"),
    bad("qwen.tokens_per_second negative", lambda c: qwen(c, tokens_per_second=-2.0), ValueError,
        r"tokens_per_second=-2.0 is out of range"),
    bad("qwen.processor None", lambda c: qwen(c, processor=None), TypeError,
        r"processor must be a Qwen-VL processor or tokenizer"),
    # ---- from_token_lists
    bad("lists.prompts str", lambda c: lists(c, prompt_token_ids="abc", response_token_ids=None), TypeError,
        r"prompt_token_ids must be a list .* got str"),
    bad("lists.prompt str item", lambda c: lists(c, prompt_token_ids=["hello", *c.prompts[1:]]), TypeError,
        r"prompt_token_ids\[0\] is str"),
    bad("lists.prompt floats", lambda c: lists(c, prompt_token_ids=[[float(t) for t in c.prompts[0]], *c.prompts[1:]]),
        TypeError, r"prompt_token_ids\[0\]\[0\] is float"),
    bad("lists.prompt empty", lambda c: lists(c, prompt_token_ids=[[], *c.prompts[1:]]), SchemaError,
        r"prompt_token_ids: sample 0 is empty"),
    bad("lists.prompt -100",
        lambda c: lists(c, prompt_token_ids=[c.prompts[0], [c.prompts[1][0], -100, *c.prompts[1][2:]], c.prompts[2]]),
        SchemaError, r"prompt_token_ids: sample 1, position 1 is -100"),
    bad("lists.prompt padded", lambda c: lists(c, prompt_token_ids=[[PAD, PAD, *c.prompts[0]], *c.prompts[1:]]),
        SchemaError,
        r"prompt_token_ids: sample 0 starts with the pad token 151643"),
    bad("lists.response None item", lambda c: lists(c, response_token_ids=[None, *c.resp[1:]]), TypeError,
        r"response_token_ids\[0\] is None"),
    bad("lists.responses short", lambda c: lists(c, response_token_ids=c.resp[:2]), SchemaError,
        r"response_token_ids has 2 entries; prompt_token_ids has 3"),
    bad("lists.grids more than placeholders",
        lambda c: lists(c, image_grid_thw=torch.cat([c.grid, c.grid[:1]]),
                        pixel_values=torch.cat([c.pixels, c.pixels[:16]])),
        SchemaError, r"image_grid_thw has 4 items but the prompts hold placeholders for 3"),
    bad("lists.pixel_values extra rows", lambda c: lists(c, pixel_values=torch.cat([c.pixels, c.pixels[:4]])),
        SchemaError, r"pixel_values has 108 rows; image_grid_thw needs 104"),
    bad("lists.pixel_values without grids", lambda c: lists(c, image_grid_thw=None), SchemaError,
        r"pixel_values given without image_grid_thw"),
    bad("lists.position_ids float",
        lambda c: lists(c, position_ids=[c.batch.sample_positions(b).float() for b in range(3)]), TypeError,
        r"position_ids\[0\] must be int"),
    bad("lists.position_ids count", lambda c: lists(c, position_ids=[c.batch.sample_positions(0)]), SchemaError,
        r"position_ids has 1 entries; expected one per sample \(3\)"),
    bad("lists.position_ids shape",
        lambda c: lists(c, position_ids=[c.batch.sample_positions(b)[:, 1:] for b in range(3)]), SchemaError,
        r"position_ids: sample 0 has shape \(3, \d+\), expected \(3, \d+\)"),
    bad("lists.position_ids one token off",
        lambda c: lists(c, position_ids=[c.batch.sample_positions(0), edited(c.batch.sample_positions(1), (2, 7), 0),
                                         c.batch.sample_positions(2)]),
        SchemaError, r"position_ids: sample 1, position 7 \(token \d+\) has t/h/w positions \[\d+, \d+, 0\] but the model"),
    bad("verl.position_ids shifted response", lambda c: verl(c, position_ids=shifted_response(c)), SchemaError,
        r"position_ids: sample 2, position \d+ \(token \d+\) has t/h/w positions .* but the model computes"),
    bad("lists.media_cache_keys str", lambda c: lists(c, media_cache_keys="abc"), TypeError,
        r"media_cache_keys must be a list of str, got str"),
    bad("lists.media_cache_keys shared by other pixels", lambda c: lists(c, media_cache_keys=["k", "k", "z"]),
        SchemaError,
        r"media_cache_keys: media items 0 and 1 share the key 'k' but their (grids|pixel rows) differ"),
    bad("lists.second_per_grid_ts without videos", lambda c: lists(c, second_per_grid_ts=torch.ones(1)), SchemaError,
        r"second_per_grid_ts has 1 entries; video_grid_thw has 0 videos"),
    bad("lists.video_grid_thw without placeholders",
        lambda c: lists(c, video_grid_thw=torch.tensor([[2, 4, 4]]), pixel_values_videos=torch.zeros(32, 1176)),
        SchemaError, r"video_grid_thw has 1 items but the prompts hold placeholders for 0"),
    # ---- from_verl
    bad("verl.input_ids 1-D", lambda c: verl(c, input_ids=c.verl["input_ids"][0]), SchemaError,
        r"input_ids must be 2-D"),
    bad("verl.attention_mask None", lambda c: verl(c, attention_mask=None), TypeError,
        r"attention_mask must be a torch.Tensor"),
    bad("verl.attention_mask shape", lambda c: verl(c, attention_mask=c.verl["attention_mask"][:, 1:]), SchemaError,
        r"attention_mask must have shape \[3, \d+\]"),
    bad("verl.all-ones attention_mask", lambda c: verl(c, attention_mask=torch.ones_like(c.verl["attention_mask"])),
        SchemaError,
        r"attention_mask: sample 0 marks position 0, the pad token 151643, as a real token"),
    bad("verl.responses wider than input_ids", lambda c: verl(c, responses=torch.cat([c.verl["input_ids"]] * 2, 1)),
        SchemaError, r"responses has \d+ columns; input_ids has only \d+"),
    bad("verl.responses differ from input tail", lambda c: verl(c, responses=edited(c.verl["responses"], (2, 1), 5)),
        SchemaError,
        r"responses: sample 2, response position 1 is 5 but input_ids holds \d+ there"),
    bad("verl.response_mask over padding", lambda c: verl(c, response_mask=torch.ones_like(c.verl["response_mask"])),
        SchemaError,
        r"response_mask: sample 0, response position \d+ is set but attention_mask is 0 there"),
    bad("verl.response_mask shape", lambda c: verl(c, response_mask=c.verl["response_mask"][:2]), SchemaError,
        r"response_mask must have shape \[3, \d+\]"),
    bad("verl.position_ids short", lambda c: verl(c, position_ids=c.verl["position_ids"][..., 1:]), SchemaError,
        r"position_ids must have shape"),
    bad("verl.position_ids batch", lambda c: verl(c, position_ids=c.verl["position_ids"][:2, 0]), SchemaError,
        r"position_ids must have shape"),
    bad("verl.multi_modal_inputs misassigned",
        lambda c: verl(c,
                       multi_modal_inputs=[merge_inputs(c.verl["multi_modal_inputs"][:2]), {},
                                           c.verl["multi_modal_inputs"][2]]),
        SchemaError, r"multi_modal_inputs: sample 0 holds 2 image\(s\) but its prompt has placeholders for 1"),
    bad("verl.multi_modal_inputs item", lambda c: verl(c, multi_modal_inputs=["x", {}, {}]), TypeError,
        r"multi_modal_inputs\[0\] must be a dict"),
    bad("verl.multi_modal_inputs count", lambda c: verl(c, multi_modal_inputs=c.verl["multi_modal_inputs"][:2]),
        SchemaError, r"multi_modal_inputs has 2 entries; expected one per sample \(3\)"),
    # ---- views
    bad("select bools", lambda c: c.batch.select([True, False]), TypeError, r"indices\[0\] is bool"),
    bad("select floats", lambda c: c.batch.select([1.0]), TypeError, r"indices\[0\] is float"),
    bad("select bool mask", lambda c: c.batch.select(torch.tensor([True, False, True])), TypeError,
        r"indices is a bool tensor"),
    bad("select str", lambda c: c.batch.select("10"), TypeError,
        r"indices must be a list of sample indices or a 1-D integer tensor, got str"),
    bad("select 2-D", lambda c: c.batch.select(torch.tensor([[0, 1]])), ValueError, r"indices must be 1-D"),
    bad("select out of range", lambda c: c.batch.select([0, 5]), IndexError,
        r"indices\[1\] is 5; the batch has 3 samples"),
    bad("select negative", lambda c: c.batch.select([-1]), IndexError, r"indices\[0\] is -1; the batch has 3 samples"),
    bad("concat without rewards", lambda c: RLBatch.concat([c.batch, rebuild(c, rewards=None)]), SchemaError,
        r"RLBatch.concat: batch 1 has no rewards but batch 0 has"),
    bad("concat without group_ids", lambda c: RLBatch.concat([rebuild(c, group_ids=None), c.batch]), SchemaError,
        r"RLBatch.concat: batch 1 has group_ids but batch 0 has none"),
    bad("concat without pixels", lambda c: RLBatch.concat([c.batch, rebuild(c, pixel_values=None)]), SchemaError,
        r"RLBatch.concat: batch 1 has no pixel_values but batch 0 has"),
    bad("concat one batch", lambda c: RLBatch.concat(c.batch), TypeError,
        r"batches must be a list of RLBatch, got RLBatch"),
    bad("concat non-batch", lambda c: RLBatch.concat([c.batch, "x"]), TypeError, r"batches\[1\] is str"),
    bad("concat devices", lambda c: RLBatch.concat([c.batch, c.batch.to("meta")]), SchemaError,
        r"batch 1 is on meta, batch 0 on cpu"),
    bad("to unknown device", lambda c: c.batch.to("nonsense"), ValueError, r"device='nonsense' is not a torch device"),
    bad("save to a directory", lambda c: c.batch.save(c.tmp), (IsADirectoryError, BatchFileError),
        re.escape("Is a directory")),
    bad("load a directory", lambda c: RLBatch.load(c.tmp), BatchFileError, r"is a directory, not a batch file"),
    bad("load bad metadata", lambda c: RLBatch.load(saved_with(c, group_ids=[1, 2, 3])), BatchFileError,
        r"group_ids is \[1, 2, 3\], not the value saved: the file was changed after RLBatch.save"),
    bad("loss_token_index float", lambda c: c.batch.loss_token_index(padded_length=200.5, padding="right"), TypeError,
        r"padded_length must be an int"),
    bad("loss_token_index bool", lambda c: c.batch.loss_token_index(padded_length=True, padding="right"), TypeError,
        r"padded_length must be an int"),
    bad("loss_token_index short", lambda c: c.batch.loss_token_index(padded_length=3, padding="right"), ValueError,
        r"a padded length of 3 is shorter than the longest sample"),
    bad("loss_token_index no side", lambda c: c.batch.loss_token_index(padded_length=200), ValueError,
        r"padded_length and padding go together"),
    bad("loss_token_index bad side", lambda c: c.batch.loss_token_index(padded_length=200, padding="middle"),
        ValueError, r"padding='middle': expected one of left, right"),
    bad("sample_tokens float", lambda c: c.batch.sample_tokens(1.0), TypeError, r"sample must be an int"),
    bad("sample_tokens bool", lambda c: c.batch.sample_tokens(True), TypeError, r"sample must be an int"),
    bad("sample_tokens negative", lambda c: c.batch.sample_tokens(-1), IndexError,
        r"sample -1 is out of range for a batch of 3"),
    bad("sample_positions out of range", lambda c: c.batch.sample_positions(3), IndexError,
        r"sample 3 is out of range for a batch of 3"),
    bad("summary max_rows negative", lambda c: c.batch.summary(max_rows=-1), ValueError,
        r"max_rows=-1 is out of range"),
    # ---- SpanTable
    bad("SpanTable float starts", lambda c: SpanTable([0.5], [1.5], [0, 1]), TypeError,
        r"SpanTable.starts must be int"),
    bad("SpanTable end < start", lambda c: SpanTable([3], [1], [0, 1]), SchemaError,
        r"SpanTable: sample 0, span 0 is \[3, 1\)"),
    bad("SpanTable negative start", lambda c: SpanTable([-1], [1], [0, 1]), SchemaError,
        r"SpanTable: sample 0, span 0 is \[-1, 1\)"),
    bad("SpanTable unsorted", lambda c: SpanTable([5, 0], [6, 1], [0, 2]), SchemaError,
        r"SpanTable: sample 0, span 1 \[0, 1\) starts before span 0 \[5, 6\)"),
    bad("SpanTable int32 overflow", lambda c: SpanTable([2**31], [2**31 + 1], [0, 1]), SchemaError,
        r"SpanTable.starts\[0\] is 2147483648.*int32"),
    bad("SpanTable modality 7", lambda c: SpanTable([0], [1], [0, 1], [7]), SchemaError,
        r"SpanTable.modality\[0\] is 7"),
    bad("SpanTable media_index -5", lambda c: SpanTable([0], [1], [0, 1], [1], [-5]), SchemaError,
        r"SpanTable.media_index\[0\] is -5"),
    bad("SpanTable 2-D starts", lambda c: SpanTable([[0]], [[1]], [0, 1]), SchemaError,
        r"SpanTable.starts must be 1-D"),
    bad("SpanTable float sample_ptr", lambda c: SpanTable([0], [1], [0.0, 1.0]), TypeError,
        r"SpanTable.sample_ptr must be int"),
    bad("SpanTable.from_lists tuples", lambda c: SpanTable.from_lists([[(0, 3)]]), TypeError,
        r"per_sample\[0\]\[0\] is tuple; expected a Span"),
    bad("SpanTable.from_lists str", lambda c: SpanTable.from_lists("ab"), TypeError,
        r"per_sample must be a list of lists of Span, got str"),
    bad("SpanTable.select out of range", lambda c: c.batch.loss_spans.select([3]), IndexError,
        r"indices\[0\] is 3; the table has 3 samples"),
    bad("SpanTable.select negative", lambda c: c.batch.loss_spans.select([-1]), IndexError, r"indices\[0\] is -1"),
    bad("SpanTable.spans_of negative", lambda c: c.batch.loss_spans.spans_of(-1), IndexError,
        r"sample -1 is out of range for a table of 3"),
    bad("SpanTable.spans_of float", lambda c: c.batch.loss_spans.spans_of(0.0), TypeError, r"sample must be an int"),
    bad("SpanTable.from_tensors list", lambda c: SpanTable.from_tensors([1, 2], "x"), TypeError,
        r"tensors must be a dict"),
    bad("SpanTable.from_tensors float",
        lambda c: SpanTable.from_tensors({**c.batch.loss_spans.tensors("x"), "x.starts": torch.zeros(3)}, "x"),
        TypeError, r"SpanTable.starts must be int"),
    bad("SpanTable.tensors prefix", lambda c: c.batch.loss_spans.tensors(5), TypeError, r"prefix must be a str"),
    bad("SpanTable.to unknown device", lambda c: c.batch.loss_spans.to("nonsense"), ValueError,
        r"device='nonsense' is not a torch device"),
    # ---- Span and the algebra
    bad("Span float", lambda c: Span(1.5, 3), TypeError, r"Span.start must be an int"),
    bad("Span bool", lambda c: Span(True, 3), TypeError, r"Span.start must be an int"),
    bad("Span str", lambda c: Span("0", 3), TypeError, r"Span.start must be an int"),
    bad("Span modality 7", lambda c: Span(0, 3, 7), ValueError,
        r"Span.modality=7: expected one of text \(0\), image \(1\), video \(2\), audio \(3\)"),
    bad("Span media_index -2", lambda c: Span(0, 3, Modality.IMAGE, -2), ValueError, r"Span.media_index=-2"),
    bad("Span text with media index", lambda c: Span(0, 3, Modality.TEXT, 2), ValueError,
        r"a text span has media_index -1, got 2"),
    bad("normalize tuples", lambda c: normalize([(0, 3)]), TypeError, r"spans\[0\] is tuple; expected a Span"),
    bad("union a Span", lambda c: union(Span(0, 3), []), TypeError, r"a must be a list of Span, got Span"),
    bad("intersect str", lambda c: intersect("ab", []), TypeError, r"a must be a list of Span, got str"),
    bad("complement negative length", lambda c: complement([Span(0, 5)], -1), ValueError, r"length=-1 is out of range"),
    bad("complement float length", lambda c: complement([Span(0, 5)], 2.5), TypeError, r"length must be an int"),
    bad("complement span past length", lambda c: complement([Span(0, 5)], 3), SchemaError,
        r"span text\[0, 5\) ends past the sequence length 3"),
    bad("spans_from_mask 2-D", lambda c: spans_from_mask([[1, 0], [0, 1]]), ValueError, r"mask must be 1-D"),
    bad("spans_from_mask float", lambda c: spans_from_mask(torch.tensor([0.5, 0.0])), TypeError,
        r"mask must be bool or integer"),
    bad("spans_from_mask 2", lambda c: spans_from_mask([0, 2, 1]), ValueError, r"mask\[1\] is 2; expected 0 or 1"),
    bad("spans_from_mask str", lambda c: spans_from_mask("1010"), TypeError,
        r"mask must be a 1-D bool tensor or a list of bools, got str"),
    bad("spans_from_mask None", lambda c: spans_from_mask(None), TypeError,
        r"mask must be a 1-D bool tensor or a list of bools, got NoneType"),
    bad("mask_from_spans negative length", lambda c: mask_from_spans([Span(0, 2)], -1), ValueError,
        r"length=-1 is out of range"),
    bad("mask_from_spans float length", lambda c: mask_from_spans([Span(0, 2)], 2.0), TypeError,
        r"length must be an int"),
    # ---- grounding
    bad("convert zero width",
        lambda c: convert_points(torch.zeros(1, 2), "absolute", "normalized",
                                 original_size=(0, 10)), ValueError, r"original_size\[0\]=0 is out of range"),
    bad("convert negative width",
        lambda c: convert_points(torch.zeros(1, 2), "normalized", "absolute",
                                 original_size=(-640, 480)), ValueError, r"original_size\[0\]=-640 is out of range"),
    bad("convert 1-tuple", lambda c: convert_points(torch.zeros(1, 2), "absolute", "normalized", original_size=(640,)),
        ValueError, r"original_size must be \(width, height\), got \(640,\)"),
    bad("convert str size",
        lambda c: convert_points(torch.zeros(1, 2), "absolute", "normalized",
                                 original_size="640x480"), TypeError, r"original_size must be \(width, height\)"),
    bad("convert float size",
        lambda c: convert_boxes(torch.zeros(1, 4), "resized", "normalized",
                                resized_size=(448.5, 336)), TypeError, r"resized_size\[0\] must be an int"),
    bad("convert complex",
        lambda c: convert_points(torch.zeros(1, 2, dtype=torch.complex64), "normalized",
                                 "normalized_1000"), TypeError, r"points must be a real"),
    bad("convert bool", lambda c: convert_boxes(torch.zeros(1, 4, dtype=torch.bool), "normalized", "normalized_1000"),
        TypeError, r"boxes must be a real"),
    bad("convert non-finite", lambda c: convert_points(torch.tensor([[0.5, 0.5], [math.nan, math.inf]]), "normalized",
                                                        "absolute", original_size=(10, 20)),
        SchemaError, r"points\[1\] is \[nan, inf\]: it is not finite; only coordinates inside the image convert"),
    bad("convert list", lambda c: convert_points([[0.5, 0.5]], "normalized", "normalized_1000"), TypeError,
        r"points must be a torch.Tensor"),
    bad("convert 0-d", lambda c: convert_points(torch.tensor(1.0), "normalized", "normalized_1000"), SchemaError,
        r"points must have a last dimension of 2"),
    # ---- media identity and positions
    bad("media_cache_key list", lambda c: media_cache_key([[0.0]], [1, 1, 1], "image", "f"), TypeError,
        r"pixel_rows must be a torch.Tensor"),
    bad("media_cache_key rows", lambda c: media_cache_key(torch.zeros(10, 4), [1, 4, 4], "image", "f"), ValueError,
        r"pixel_rows has 10 rows; grid_thw \[1, 4, 4\] needs 16"),
    bad("media_cache_key modality", lambda c: media_cache_key(torch.zeros(16, 4), [1, 4, 4], "picture", "f"),
        ValueError, r"modality='picture': expected one of image, video"),
    bad("media_cache_key fingerprint", lambda c: media_cache_key(torch.zeros(16, 4), [1, 4, 4], "image", None),
        TypeError, r"fingerprint must be a str"),
    bad("media_cache_key grid", lambda c: media_cache_key(torch.zeros(16, 4), [4, 4], "image", "f"), ValueError,
        r"grid_thw must be 3 ints \(t, h, w\)"),
    bad("media_cache_key nan", lambda c: media_cache_key(torch.full((16, 4), math.nan), [1, 4, 4], "image", "f"),
        ValueError, r"pixel_rows: row 0, column 0 is nan"),
    bad("processor_fingerprint None", lambda c: processor_fingerprint(None), TypeError,
        r"processor must be a Qwen-VL processor or tokenizer"),
    bad("media_token_counts [N, 2]", lambda c: media_token_counts(torch.ones(2, 2, dtype=torch.int64), 2), ValueError,
        r"grid_thw must have shape \[N, 3\]"),
    bad("media_token_counts merge 0", lambda c: media_token_counts(c.grid, 0), ValueError,
        r"merge_size=0 is out of range"),
    bad("media_token_counts not divisible", lambda c: media_token_counts(torch.tensor([[1, 1, 16]]), 2), ValueError,
        r"grid_thw\[0\] is \[1, 1, 16\]: h and w must be multiples of the merge size 2"),
    bad("media_token_counts float", lambda c: media_token_counts(c.grid.float(), 2), TypeError,
        r"grid_thw must be int"),
    bad("vision_token_offsets length", lambda c: vision_token_offsets(c.grid, torch.ones(2, dtype=torch.int8), 2),
        ValueError, r"modality must have shape \[3\]"),
    bad("vision_token_offsets text",
        lambda c: vision_token_offsets(c.grid, torch.tensor([1, 0, 1], dtype=torch.int8),
                                       2), ValueError, r"modality\[1\] is 0"),
    bad("mrope float ids", lambda c: mrope_positions(torch.zeros(5), [], 2, None), TypeError, r"ids must be int"),
    bad("mrope start past end",
        lambda c: mrope_positions(torch.zeros(5, dtype=torch.int64),
                                  [(3, Modality.IMAGE, torch.tensor([1, 4, 4]), None)], 2, None),
        ValueError, r"media\[0\] at \[3, 7\) runs past the 5 tokens"),
    bad("mrope overlap",
        lambda c: mrope_positions(torch.zeros(20, dtype=torch.int64),
                                  [(1, Modality.IMAGE, torch.tensor([1, 4, 4]), None),
                                   (3, Modality.IMAGE, torch.tensor([1, 4, 4]), None)], 2, None),
        ValueError, r"media\[1\] starts at 3, inside media\[0\] at \[1, 5\)"),
    bad("mrope grid",
        lambda c: mrope_positions(torch.zeros(20, dtype=torch.int64),
                                  [(1, Modality.IMAGE, torch.tensor([1, 3, 4]), None)], 2, None),
        ValueError, r"media\[0\] grid_thw \[1, 3, 4\]: h and w must be multiples of the merge size 2"),
    bad("mrope tokens_per_second", lambda c: mrope_positions(torch.zeros(5, dtype=torch.int64), [], 2, math.nan),
        ValueError, r"tokens_per_second=nan"),
    bad("mrope media item", lambda c: mrope_positions(torch.zeros(5, dtype=torch.int64), [3], 2, None), TypeError,
        r"media\[0\] must be \(start, modality, grid_thw, second_per_grid\)"),
    bad("dense_group_index str", lambda c: dense_group_index("abab"), TypeError,
        r"group_ids must be a list .* got str"),
    bad("dense_group_index None", lambda c: dense_group_index(["a", None]), TypeError, r"group_ids\[1\] is None"),
    bad("dense_group_index nan", lambda c: dense_group_index([math.nan, math.nan]), TypeError,
        r"group_ids\[0\] is float nan"),
    bad("dense_group_index lists", lambda c: dense_group_index([[1], [1]]), TypeError, r"group_ids\[0\] is list"),
]


def padded_positions(ctx) -> torch.Tensor:
    """(3, B, L) positions of the processor output (zeros at padding), as get_rope_index gives them."""
    out = ctx.out
    pos = torch.zeros(3, *out["input_ids"].shape, dtype=torch.int64)
    for b in range(pos.shape[1]):
        n = int(out["attention_mask"][b].sum())
        pos[:, b, out["attention_mask"][b].bool()] = ctx.batch.sample_positions(b)[:, :n]
    return pos


def text_positions(ctx) -> torch.Tensor:
    """(B, L) 1-D positions over the real tokens: what a rollout without M-RoPE uses."""
    return (ctx.out["attention_mask"].cumsum(-1) - 1).clamp(min=0)


def shifted_response(ctx) -> torch.Tensor:
    """verl's positions with sample 2's response one further on than the model puts it."""
    pos = ctx.verl["position_ids"].clone()
    R = ctx.verl["responses"].shape[1]
    pos[2, :, -R:] += 1
    return pos


def merge_inputs(items: list[dict]) -> dict:
    return {key: torch.cat([d[key] for d in items]) for key in items[0]}


def saved_with(ctx, **metadata) -> Path:
    """A saved batch whose JSON metadata fields were then changed."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    path = ctx.batch.save(ctx.tmp / "edited.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    fields = json.loads(meta["fields"])
    fields.update(metadata)
    save_file(tensors, str(path), metadata={**meta, "fields": json.dumps(fields)})
    return path


def with_changed_do_resize(ctx):
    """The processor's fingerprint before and after a change of do_resize (then restored)."""
    image_processor = ctx.p.image_processor
    before, old = processor_fingerprint(ctx.p), image_processor.do_resize
    try:
        image_processor.do_resize = not old
        return before, processor_fingerprint(ctx.p)
    finally:
        image_processor.do_resize = old


def multi_turn(ctx) -> RLBatch:
    """The README's multi-turn case: an assistant_mask over earlier turns plus appended responses."""
    assistant = torch.zeros_like(ctx.out["input_ids"])
    assistant[:, -3:] = 1  # the generation prompt's last tokens stand in for an earlier assistant turn
    return qwen(ctx, assistant_mask=assistant)


def region_select(ctx) -> RLBatch:
    return ctx.grounded.select([2])  # sample 2 has no region spans and no boxes


def video_batch(ctx) -> RLBatch:
    samples = synthetic_video_text(2, seed=1, with_image=True)
    out = processor_inputs(ctx.p, samples, padding_side="right")
    return RLBatch.from_qwen_vl(out, processor=ctx.p, responses=[[1, IM_END], [2, IM_END]])


UNUSUAL = [
    unusual("multi-turn assistant_mask with responses", multi_turn,
            lambda c, b: all(b.loss_spans_of(s)[0].start == int(b.prompt_lengths[s])
                             == int(c.out["attention_mask"][s].sum()) - 3
                             and b.loss_spans_of(s)[-1].end == int(b.seq_lengths()[s]) for s in range(3))),
    unusual("right padding, no attention_mask needed",
            lambda c: RLBatch.from_qwen_vl(processor_inputs(c.p, [synthetic_image_text(1, seed=1, max_images=1)[0]] * 2,
                                                            padding_side="right"), processor=c.p),
            lambda c, b: b.num_samples == 2),
    unusual("empty batch", lambda c: RLBatch.from_token_lists([], [], processor=c.p),
            lambda c, b: b.num_samples == 0 and b.num_tokens == 0),
    unusual("the model's own positions pass", lambda c: (qwen(c, position_ids=padded_positions(c)), verl(c)),
            lambda c, r: all(torch.equal(b.position_ids, c.batch.position_ids) for b in r)),
    unusual("drifted positions recorded as given when allowed",
            lambda c: qwen(c, position_ids=text_positions(c), allow_position_drift=True),
            lambda c, b: all(torch.equal(b.sample_positions(s)[:, : int(c.out["attention_mask"][s].sum())],
                                         torch.arange(int(c.out["attention_mask"][s].sum())).expand(3, -1))
                             for s in range(3))),
    unusual("empty response", lambda c: lists(c, response_token_ids=[[], *c.resp[1:]]),
            lambda c, b: b.loss_spans_of(0) == [] and int(b.prompt_lengths[0]) == len(c.prompts[0])),
    unusual("select of no samples", lambda c: c.batch.select([]),
            lambda c, b: b.num_samples == 0 and b.rewards is not None and b.group_ids == []),
    unusual("select keeps an empty region table", region_select,
            lambda c, b: b.region_spans is not None and b.region_spans.num_spans == 0
            and b.region_rewards.shape == (0,) and b.bbox_targets.shape == (0, 4)),
    unusual("concat keeps every field", lambda c: RLBatch.concat([c.grounded.select([0]), c.grounded.select([1, 2])]),
            lambda c, b: all(_same(getattr(b, k), getattr(c.grounded, k)) for k in type(b).model_fields)),
    unusual("select with a tensor and numpy",
            lambda c: (c.batch.select(torch.tensor([2, 0])), c.batch.select(np.array([2, 0]))),
            lambda c, r: r[0].group_ids == r[1].group_ids == ["c", "a"]),
    unusual("group ids as a verl uid array", lambda c: qwen(c, group_ids=np.array(["u0", "u1", "u2"], dtype=object)),
            lambda c, b: b.group_ids == ["u0", "u1", "u2"]),
    unusual("group ids as ints", lambda c: qwen(c, group_ids=[7, 8, 9]), lambda c, b: b.group_ids == ["7", "8", "9"]),
    unusual("rewards as a tensor", lambda c: qwen(c, rewards=torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)),
            lambda c, b: b.rewards.tolist() == [1.0, 0.0, 1.0]),
    unusual("video and image", video_batch,
            lambda c, b: b.second_per_grid_ts is not None and b.video_grid_thw.shape == (2, 3)),
    unusual("saved batch readable by others", lambda c: os.stat(c.batch.save(c.tmp / "mode.safetensors")).st_mode,
            lambda c, mode: stat.S_IMODE(mode) == 0o666 & ~c.umask),
    unusual("fingerprint follows processor changes", with_changed_do_resize, lambda c, r: r[0] != r[1]),
    unusual("dense_group_index of a tensor", lambda c: dense_group_index(torch.tensor([3, 3, 1])),
            lambda c, g: g.tolist() == [0, 0, 1]),
    unusual("dense_group_index of numpy strings", lambda c: dense_group_index(np.array(["b", "a", "b"])),
            lambda c, g: g.tolist() == [0, 1, 0]),
    unusual("integer coordinates become float32",
            lambda c: convert_boxes(torch.tensor([[0, 0, 10, 20]]), "absolute", "normalized", original_size=(10, 20)),
            lambda c, b: b.dtype == torch.float32 and b.tolist() == [[0.0, 0.0, 1.0, 1.0]]),
    unusual("spans_from_mask of 0/1 ints", lambda c: spans_from_mask([0, 1, 1, 0, 1]),
            lambda c, s: s == [Span(1, 3), Span(4, 5)]),
    unusual("to meta keeps lists apart", lambda c: c.batch.to("meta"),
            lambda c, b: b.group_ids == c.batch.group_ids and b.group_ids is not c.batch.group_ids),
]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


# ----------------------------------------------------------------------------- sorting outcomes
def outcome(case: Case, ctx) -> tuple[str, str]:
    """(kind, detail): kind is ok, silent, crash or unclear."""
    try:
        result = case.call(ctx)
    except Exception as error:  # noqa: BLE001 - sorting every error is the point
        text = f"{type(error).__name__}: {error}"
        if case.error is not None and isinstance(error, case.error) and re.search(case.match, str(error)):
            return "ok", text
        return ("unclear" if raised_by_rlk_mm(error) else "crash"), text
    if case.error is None and case.check(ctx, result):
        return "ok", ""
    return "silent", "no error" if case.error is not None else f"wrong result ({type(result).__name__})"


@pytest.fixture(scope="module")
def ctx(processor, tmp_path_factory):
    context = make_context(processor)
    context.tmp = tmp_path_factory.mktemp("adversarial")
    context.umask = _umask()
    return context


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("case", BAD + UNUSUAL, ids=str)
def test_input(ctx, case):
    kind, detail = outcome(case, ctx)
    error = case.error.__name__ if isinstance(case.error, type) else case.error
    expected = f"{error} matching {case.match!r}" if case.error else "success"
    assert kind == "ok", f"{case.name}: {kind} ({detail}); expected {expected}"


# ----------------------------------------------------------------------------- properties
@st.composite
def text_or_image_prompts(draw):
    """1-4 unpadded prompts of text ids with 0-2 images each (grids of even sides), and responses."""
    B = draw(st.integers(1, 4))
    prompts, responses, grids = [], [], []
    for _ in range(B):
        text = draw(st.lists(st.integers(0, 150_000), min_size=1, max_size=6))
        cuts = sorted(draw(st.lists(st.integers(1, len(text)), max_size=2)))
        ids, previous = [], 0
        for cut in cuts:  # an image after text[:cut]
            h, w = 2 * draw(st.integers(1, 3)), 2 * draw(st.integers(1, 3))
            ids += text[previous:cut] + [151652] + [IMAGE] * (h * w // 4) + [151653]
            grids.append([1, h, w])
            previous = cut
        prompts.append(ids + text[previous:])
        responses.append(draw(st.lists(st.integers(0, 150_000), min_size=0, max_size=4)) + [IM_END])
    return prompts, responses, grids


def build_lists(processor, prompts, responses, grids, **kwargs) -> RLBatch:
    grid = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    rows = int(grid.prod(1).sum())
    pixels = torch.arange(rows * 6, dtype=torch.float32).reshape(rows, 6) / 7  # content differs per item
    return RLBatch.from_token_lists(prompts, responses, processor=processor, image_grid_thw=grid, pixel_values=pixels,
                                    **kwargs)


@settings(max_examples=25, deadline=None)
@given(data=text_or_image_prompts(), order=st.randoms(use_true_random=False))
def test_select_concat_save_keep_every_field(processor, tmp_path_factory, data, order):
    """Valid token lists build a batch; a shuffled select, then concat of its halves, and a
    save/load round trip give back every field."""
    prompts, responses, grids = data
    B = len(prompts)
    batch = build_lists(processor, prompts, responses, grids, group_ids=[f"g{b}" for b in range(B)],
                        rewards=[float(b) for b in range(B)], costs=[0.5] * B)
    perm = list(range(B))
    order.shuffle(perm)
    shuffled = batch.select(perm)
    back = RLBatch.concat([shuffled.select(range(0, B // 2 + 1)),
                           shuffled.select(range(B // 2 + 1, B))]).select(np.argsort(perm))
    path = back.save(tmp_path_factory.mktemp("p") / "b.safetensors")
    for other in (back, RLBatch.load(path)):
        for name in type(batch).model_fields:
            assert _same(getattr(other, name), getattr(batch, name)), name


CORRUPTIONS = ("negative id", "text position", "grid", "media sample", "pixel rows", "offset", "reward",
               "loss into prompt")


@settings(max_examples=60, deadline=None)
@given(data=text_or_image_prompts(), corruption=st.sampled_from(CORRUPTIONS), pick=st.integers(0, 10_000))
def test_a_corrupted_batch_is_refused_naming_the_place(processor, data, corruption, pick):
    """Every single corruption of a valid batch's fields raises SchemaError naming the field
    (and the sample and position where the corruption has them); nothing else escapes."""
    prompts, responses, grids = data
    batch = build_lists(processor, prompts, responses, grids, rewards=[1.0] * len(prompts))
    fields = {k: getattr(batch, k) for k in type(batch).model_fields}
    b = pick % batch.num_samples
    lo, n = int(batch.cu_seqlens[b]), int(batch.seq_lengths()[b])
    p = pick % n
    if corruption == "negative id":
        fields["input_ids"], match = edited(batch.input_ids, lo + p,
                                            -1 - pick), rf"input_ids: sample {b}, position {p} is -{1 + pick}"
    elif corruption == "text position":
        fields["position_ids"], match = edited(batch.position_ids, (pick % 3, lo + p),
                                               -1), rf"position_ids: sample {b}, position {p} is -1"
    elif corruption == "reward":
        fields["rewards"], match = edited(batch.rewards, b, math.nan), rf"rewards\[{b}\] is nan \(sample {b}\)"
    elif corruption == "loss into prompt":
        span = batch.loss_spans_of(b)[0]
        start = pick % span.start  # somewhere in the prompt
        spans = batch.loss_spans.to_lists()
        spans[b] = [Span(start, span.end)]
        fields["loss_spans"], match = SpanTable.from_lists(spans), rf"loss_spans: sample {b}, "
    elif not batch.num_media:
        return
    else:
        g = pick % batch.num_media
        if corruption == "grid":
            grid = int(batch.media_grid_thw[g, 1 + pick % 2]) + 2
            fields["media_grid_thw"], match = edited(batch.media_grid_thw, (g, 1 + pick % 2), grid), (
                r"media_grid_thw|image_grid_thw|modality_spans")
        elif corruption == "media sample":
            other = (int(batch.media_sample[g]) + 1 + pick % max(batch.num_samples, 1)) % (batch.num_samples + 1)
            fields["media_sample"], match = edited(batch.media_sample, g, other), (
                rf"media_sample\[{g}\]|modality_spans: sample \d+, .* media_sample\[{g}\]")
        elif corruption == "pixel rows":
            fields["pixel_values"] = batch.pixel_values[: -1 - pick % 3]
            match = r"pixel_values has \d+ rows; image_grid_thw needs \d+"
        else:
            fields["vision_token_offsets"], match = edited(batch.vision_token_offsets, g,
                                                           -1), rf"vision_token_offsets\[{g}\] is -1"
    with pytest.raises(SchemaError, match=match):
        RLBatch(**fields)


BAD_IDS = st.sampled_from([-100, -1, 151669, 10**9, 1.0, None, "a", True])


@settings(max_examples=60, deadline=None)
@given(data=text_or_image_prompts(), bad_id=BAD_IDS, where=st.sampled_from(["prompt", "response"]),
       pick=st.integers(0, 10_000))
def test_a_bad_token_id_is_refused_naming_sample_and_position(processor, data, bad_id, where, pick):
    """A negative, out-of-vocabulary, float, None, str or bool id anywhere in the token lists
    is refused: TypeError for a non-int, SchemaError naming the sample and position otherwise."""
    prompts, responses, grids = data
    lists_ = prompts if where == "prompt" else responses
    b = pick % len(lists_)
    p = pick % len(lists_[b])
    lists_[b][p] = bad_id
    name = "prompt_token_ids" if where == "prompt" else "response_token_ids"
    if isinstance(bad_id, int) and not isinstance(bad_id, bool):
        error, match = SchemaError, rf"{name}: sample {b}, position {p} is {bad_id}"
    else:
        error, match = TypeError, rf"{name}\[{b}\]\[{p}\] is {'None' if bad_id is None else type(bad_id).__name__}"
    with pytest.raises(error, match=match):
        build_lists(processor, prompts, responses, grids)


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.lists(st.text(max_size=3), max_size=12), st.lists(st.integers(-5, 5), max_size=12)))
def test_dense_group_index_numbers_groups_in_first_appearance_order(ids):
    dense = dense_group_index(ids).tolist()
    first = {}
    assert dense == [first.setdefault(g, len(first)) for g in ids]


@settings(max_examples=100, deadline=None)
@given(size=st.tuples(st.one_of(st.integers(-3, 0), st.floats(0.5, 10.5), st.just(None)), st.integers(1, 100)),
       key=st.sampled_from(["original_size", "resized_size"]), flip=st.booleans())
def test_bad_image_sizes_are_refused_naming_the_argument(size, key, flip):
    size = size[::-1] if flip else size
    system = "absolute" if key == "original_size" else "resized"
    with pytest.raises((TypeError, ValueError), match=rf"{key}\[{int(flip)}\]"):
        convert_points(torch.zeros(2, 2), system, "normalized", **{key: size})


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 1), min_size=1, max_size=20), st.integers(2, 9), st.integers(0, 100))
def test_a_non_binary_mask_value_is_refused_at_its_position(mask, value, pick):
    p = pick % len(mask)
    mask[p] = value
    with pytest.raises(ValueError, match=rf"mask\[{p}\] is {value}; expected 0 or 1"):
        spans_from_mask(mask)


if __name__ == "__main__":  # the tally of BAD + UNUSUAL for the version of rlk_mm on the path
    import collections
    import tempfile

    context = make_context(qwen_vl_processor())
    context.tmp, context.umask = Path(tempfile.mkdtemp()), _umask()
    tally = collections.Counter()
    for case in BAD + UNUSUAL:
        kind, detail = outcome(case, context)
        tally[kind] += 1
        if kind != "ok":
            print(f"{kind:8} {case.name}: {detail[:160]}")
    print(dict(tally), "of", len(BAD) + len(UNUSUAL), "inputs, from", PACKAGE_DIR)


@settings(max_examples=60, deadline=None)
@given(data=text_or_image_prompts(), pick=st.integers(0, 10_000), row=st.integers(0, 2), delta=st.sampled_from([-1, 1, 5]))
def test_caller_positions_that_differ_from_the_model_are_refused_at_their_token(processor, data, pick, row, delta):
    """One t/h/w position changed anywhere is refused naming its sample and token; the same
    positions are recorded exactly with allow_position_drift=True."""
    prompts, responses, grids = data
    batch = build_lists(processor, prompts, responses, grids)
    positions = [batch.sample_positions(b).clone() for b in range(batch.num_samples)]
    b = pick % len(positions)
    t = pick // len(positions) % positions[b].shape[1]
    positions[b][row, t] += delta if int(positions[b][row, t]) + delta >= 0 else 1  # positions stay >= 0
    with pytest.raises(SchemaError, match=rf"position_ids: sample {b}, position {t} \(token \d+\) has t/h/w positions"):
        build_lists(processor, prompts, responses, grids, position_ids=positions)
    drifted = build_lists(processor, prompts, responses, grids, position_ids=positions, allow_position_drift=True)
    assert torch.equal(drifted.position_ids, torch.cat(positions, dim=1))
