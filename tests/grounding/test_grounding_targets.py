"""Grounding targets given to the builders: ``bbox_targets`` / ``point_targets`` (one entry per
sample), ``screen_size`` and ``coordinate_system`` through ``from_token_lists``,
``from_qwen_vl`` and ``from_messages`` (real Qwen-VL processor), checked like the other
fields, equal to the batch built field by field, and kept by select / concat / save."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from rlk_mm import CoordinateSystem, RLBatch, SchemaError
from rlk_mm.fixtures import processor_inputs, synthetic_image_text

IM_END = 151645
BOXES = [[[10, 20, 30, 40], [0.5, 1.5, 2.5, 3.5]], [], [[1, 2, 3, 4]]]
POINTS = [[[5, 6]], None, torch.tensor([[7.25, 8.0], [0.0, 0.0]], dtype=torch.float64)]
SCREENS = [(112, 112), (84, 56), (56, 84)]


@pytest.fixture(scope="module")
def prompts(processor):
    out = processor_inputs(processor, synthetic_image_text(3, seed=5, max_images=1, sizes=[(56, 56), (84, 56)]), padding_side="left")
    ids = [row[mask.bool()].tolist() for row, mask in zip(out["input_ids"], out["attention_mask"])]
    responses = [processor.tokenizer.encode(t) + [IM_END] for t in ('{"bbox_2d": [1, 2, 3, 4]}', "no", "yes")]
    return out, ids, responses


def lists(processor, prompts, **grounding):
    out, ids, responses = prompts
    return RLBatch.from_token_lists(ids, responses, processor=processor, image_grid_thw=out["image_grid_thw"],
                                    pixel_values=out["pixel_values"], **grounding)


def test_builder_targets_equal_the_batch_built_field_by_field(processor, prompts):
    built = lists(processor, prompts, bbox_targets=BOXES, point_targets=POINTS, screen_size=SCREENS,
                  coordinate_system="absolute")
    plain = lists(processor, prompts)
    fields = {name: getattr(plain, name) for name in RLBatch.model_fields}
    fields.update(
        coordinate_system="absolute",
        bbox_targets=torch.tensor([[10, 20, 30, 40], [0.5, 1.5, 2.5, 3.5], [1, 2, 3, 4]], dtype=torch.float32),
        bbox_sample=torch.tensor([0, 0, 2]),
        point_targets=torch.tensor([[5, 6], [7.25, 8.0], [0.0, 0.0]], dtype=torch.float32),
        point_sample=torch.tensor([0, 2, 2]),
        screen_size=torch.tensor(SCREENS),
    )
    assert built == RLBatch(**fields)
    assert built.coordinate_system == "absolute" and type(built.coordinate_system) is str


def test_targets_travel_with_their_samples(processor, prompts, tmp_path):
    built = lists(processor, prompts, bbox_targets=BOXES, point_targets=POINTS, screen_size=SCREENS,
                  coordinate_system=CoordinateSystem.NORMALIZED_1000)
    picked = built.select([2, 0])
    assert picked.bbox_targets.tolist() == [[1, 2, 3, 4], [10, 20, 30, 40], [0.5, 1.5, 2.5, 3.5]]
    assert picked.bbox_sample.tolist() == [0, 1, 1] and picked.screen_size.tolist() == [[56, 84], [112, 112]]
    assert RLBatch.concat([built.select([0, 1]), built.select([2])]) == built
    built.save(tmp_path / "b.safetensors")
    assert RLBatch.load(tmp_path / "b.safetensors") == built


def test_from_qwen_vl_and_from_messages_take_the_targets(processor, prompts):
    out, _, responses = prompts
    grounding = dict(bbox_targets=BOXES, screen_size=torch.tensor(SCREENS), coordinate_system="resized")
    batch = RLBatch.from_qwen_vl(out, processor=processor, responses=responses, **grounding)
    assert batch.bbox_sample.tolist() == [0, 0, 2] and batch.point_targets is None and batch.coordinate_system == "resized"
    image = Image.new("RGB", (84, 56), (250, 250, 250))
    conversations = [[{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Click it."}]}]] * 2
    batch = RLBatch.from_messages(conversations, processor=processor, responses=responses[:2],
                                  point_targets=[[[42, 28]], [[1, 2]]], screen_size=[image.size] * 2, coordinate_system="absolute")
    assert batch.point_targets.tolist() == [[42, 28], [1, 2]] and batch.screen_size.tolist() == [[84, 56]] * 2


def test_screen_size_and_coordinate_system_alone(processor, prompts):
    built = lists(processor, prompts, screen_size=np.array(SCREENS), coordinate_system="normalized")
    assert built.screen_size.dtype == torch.int64 and built.bbox_targets is None and built.coordinate_system == "normalized"


@pytest.mark.parametrize("grounding,error,message", [
    (dict(bbox_targets=BOXES), SchemaError, r"bbox_targets given without coordinate_system: say which system"),
    (dict(point_targets=POINTS, coordinate_system="pixels"), SchemaError, r"coordinate_system='pixels': expected one of absolute"),
    (dict(bbox_targets=BOXES[:2], coordinate_system="absolute"), SchemaError, r"bbox_targets has 2 entries; expected one per sample \(3\)"),
    (dict(bbox_targets="boxes", coordinate_system="absolute"), TypeError, r"bbox_targets must be a list of one entry per sample"),
    (dict(bbox_targets=[[[1, 2, 3]], [], []], coordinate_system="absolute"), SchemaError,
     r"bbox_targets: sample 0, box 0 is list \[1, 2, 3\]; expected 4 numbers \(x0, y0, x1, y1\)"),
    (dict(bbox_targets=[[], [[1, 2, 3, True]], []], coordinate_system="absolute"), TypeError,
     r"bbox_targets: sample 1, box 0 holds bool True; coordinates are numbers"),
    (dict(bbox_targets=[[], [], [["1", 2, 3, 4]]], coordinate_system="absolute"), TypeError, r"sample 2, box 0 holds str '1'"),
    (dict(bbox_targets=[[], [], [[3, 2, 1, 4]]], coordinate_system="absolute"), SchemaError,
     r"bbox_targets: sample 2, box 0 is \[3.0, 2.0, 1.0, 4.0\]; a box has x0 <= x1 and y0 <= y1"),
    (dict(point_targets=[[[math.nan, 1]], None, None], coordinate_system="absolute"), SchemaError,
     r"point_targets: sample 0, point 0 is \[nan, 1.0\]; coordinates must be finite"),
    (dict(point_targets=[torch.zeros(2, 3), None, None], coordinate_system="absolute"), SchemaError,
     r"point_targets: sample 0 has shape \(2, 3\); expected \[k, 2\]"),
    (dict(point_targets=[torch.zeros(1, 2, dtype=torch.bool), None, None], coordinate_system="absolute"), TypeError,
     r"point_targets: sample 0 has dtype torch.bool; coordinates are real numbers"),
    (dict(screen_size=SCREENS[:2]), SchemaError, r"screen_size has 2 entries; expected one \(width, height\) per sample \(3\)"),
    (dict(screen_size=[(112, 112), (0, 56), (56, 84)]), ValueError, r"screen_size\[1\]\[0\]=0 is out of range"),
    (dict(screen_size=[(112, 112), (84.5, 56), (56, 84)]), TypeError, r"screen_size\[1\]\[0\] must be an int"),
    (dict(screen_size=torch.tensor([112, 112, 84])), SchemaError, r"screen_size must have shape \[3, 2\]"),
])
def test_bad_targets_name_the_argument_sample_and_row(processor, prompts, grounding, error, message):
    with pytest.raises(error, match=message):
        lists(processor, prompts, **grounding)
