"""rlk_mm.grounding: parse_grounding on real Qwen tokens (every convention), exact token spans,
conversion to original pixels through image_grid_thw, recorded failures (never clamped),
IoU/GIoU/point-in-box/action rewards placed by scatter_rewards, and the errors for bad input."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from rlk_mm.grounding import (
    action_match,
    box_giou,
    box_iou,
    find_regions,
    grounding_rewards,
    parse_action,
    parse_grounding,
    point_in_box,
)
from rlk_mm.ops import scatter_rewards
from rlk_mm.schema import RLBatch, SchemaError

ORIGINAL = (200, 150)  # (width, height); the processor resizes it to 196 x 140 (grid 10 x 14 patches of 14)
RESIZED = (196, 140)


@pytest.fixture(scope="module")
def prompt(processor):
    """(prompt ids, image_grid_thw, pixel_values) of one real prompt with one 200x150 image."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where is the button?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    out = processor(text=[text], images=[Image.new("RGB", ORIGINAL, (250, 250, 250))], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, RESIZED[1] // 14, RESIZED[0] // 14]]
    return out["input_ids"][0].tolist(), out["image_grid_thw"], out["pixel_values"]


def batch_of(processor, prompt, responses, *, targets=None, system="absolute", sizes=None):
    """A batch of one prompt per response text, with screen sizes and (optional) box targets."""
    ids, grid, pixels = prompt
    B = len(responses)
    boxes = None if targets is None else [[t for owner, t in targets if owner == b] for b in range(B)]
    return RLBatch.from_token_lists(
        [ids] * B, [processor.tokenizer.encode(r) + [151645] for r in responses], processor=processor,
        image_grid_thw=grid.repeat(B, 1), pixel_values=pixels.repeat(B, 1),
        screen_size=sizes or [ORIGINAL] * B, bbox_targets=boxes, coordinate_system=None if targets is None else system,
    )


def span_text(processor, batch, b, span):
    return processor.tokenizer.decode(batch.sample_tokens(b)[span.start : span.end].tolist())


# ----------------------------------------------------------------------------- conventions
@pytest.mark.parametrize("convention,text,kind,values,absolute", [
    ("qwen2_5_vl", '{"bbox_2d": [49, 28, 98, 70], "label": "button"}', "box", (49, 28, 98, 70), (50, 30, 100, 75)),
    ("ui_tars_1_5", '{"point_2d": [98, 70]}', "point", (98, 70), (100, 75)),
    ("qwen3_vl", '```json\n[{"bbox_2d": [250, 200, 500, 500]}]\n```', "box", (250, 200, 500, 500), (50, 30, 100, 75)),
    ("qwen2_vl", "<|object_ref_start|>the button<|object_ref_end|><|box_start|>(250,200),(500,500)<|box_end|>", "box",
     (250, 200, 500, 500), (50, 30, 100, 75)),
    ("qwen2_vl", "<|box_start|>(500,500)<|box_end|>", "point", (500, 500), (100, 75)),
], ids=["qwen2.5-box", "ui-tars-point", "qwen3-box", "qwen2-box", "qwen2-point"])
def test_each_convention_reads_its_own_syntax_and_system(processor, prompt, convention, text, kind, values, absolute):
    batch = batch_of(processor, prompt, [text])
    g = parse_grounding(batch, 0, processor=processor, convention=convention)
    assert g.failures == () and len(g.regions) == 1
    r = g.regions[0]
    assert (r.kind, r.values) == (kind, tuple(float(v) for v in values))
    assert r.absolute == pytest.approx(absolute, rel=1e-12)
    assert g.original_size == ORIGINAL and g.resized_size == RESIZED
    # the span is exactly the tokens of the coordinates: from the first digit to the last
    inside = span_text(processor, batch, 0, r.span).strip()
    assert inside[0].isdigit() and inside[-1].isdigit()
    assert [float(v) for v in inside.replace("(", "").replace(")", "").replace(",", " ").split()] == list(r.values)
    ls = batch.loss_spans_of(0)[0]
    assert ls.start <= r.span.start < r.span.end <= ls.end


def test_the_wrong_convention_does_not_silently_match(processor, prompt):
    """Qwen2-VL tags are not JSON, and 0-1000 values read as resized pixels fall outside the image."""
    batch = batch_of(processor, prompt, ['{"bbox_2d": [250, 200, 500, 500]}'])
    assert parse_grounding(batch, 0, processor=processor, convention="qwen2_vl").regions == ()
    g = parse_grounding(batch, 0, processor=processor, convention="qwen2_5_vl")
    assert g.regions == () and "outside the image" in g.failures[0].reason


@pytest.mark.parametrize("text,reason", [
    ('{"bbox_2d": [10, 20, 300, 40]}', "outside the image"),
    ('{"bbox_2d": [-1, 20, 30, 40]}', "outside the image"),
    ('{"bbox_2d": [50, 20, 30, 40]}', "x1 > x2"),
    ('{"bbox_2d": [10, 20, 30]}', "malformed"),
    ('{"point_2d": [10, "a"]}', "malformed"),
    ('{"point_2d": [10, 2e9]}', "outside the image"),
])
def test_bad_output_is_a_recorded_failure_never_clamped(processor, prompt, text, reason):
    batch = batch_of(processor, prompt, [text], targets=[(0, [0, 0, 200, 150])])
    g = parse_grounding(batch, 0, processor=processor)
    assert g.regions == () and len(g.failures) == 1 and reason in g.failures[0].reason
    assert g.failures[0].span.start >= batch.loss_spans_of(0)[0].start
    out = grounding_rewards(batch, [g])  # the target covers the whole image: a clamp would have scored > 0
    assert out.sequence.tolist() == [0.0]
    assert grounding_rewards(batch, [g], failure_reward=-0.5).sequence.tolist() == [-0.5]


def test_qwen2_vl_unterminated_and_malformed_tags():
    assert find_regions(b"<|box_start|>(1,2),(3,4)", "qwen2_vl")[0].reason.startswith("<|box_start|> without")
    assert "malformed" in find_regions(b"<|box_start|>(1,2,3)<|box_end|>", "qwen2_vl")[0].reason


# ----------------------------------------------------------------------------- hypothesis
COORD = st.integers(0, 139)


@st.composite
def json_outputs(draw):
    """A response of 1-3 boxes/points (resized pixels, valid or not), with filler text between."""
    items, parts = [], []
    for _ in range(draw(st.integers(1, 3))):
        parts.append(draw(st.sampled_from(["", "ok ", "点击 ", "\n"])))
        if draw(st.booleans()):
            x1, x2 = sorted(draw(st.lists(st.integers(0, 196), min_size=2, max_size=2)))
            y1, y2 = sorted(draw(st.lists(COORD, min_size=2, max_size=2)))
            values = (x1, y1, x2, y2)
            parts.append('{"bbox_2d": [%d, %d, %d, %d]}' % values)
            items.append(("box", values))
        else:
            values = (draw(st.integers(-20, 260)), draw(st.integers(-20, 180)))
            parts.append('{"point_2d": [%d,%d]}' % values)
            items.append(("point", values))
    return "".join(parts), items


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(json_outputs())
def test_parse_round_trips_values_and_spans(processor, prompt, output):
    """Every written box/point comes back in order with its values, or as a failure exactly
    when out of range; each span decodes to its own coordinates; spans are disjoint."""
    text, items = output
    batch = batch_of(processor, prompt, [text])
    g = parse_grounding(batch, 0, processor=processor)
    valid = [(k, v) for k, v in items if all(0 <= x <= RESIZED[0] for x in v[0::2]) and all(0 <= y <= RESIZED[1] for y in v[1::2])]
    assert [(r.kind, tuple(int(x) for x in r.values)) for r in g.regions] == valid
    assert len(g.failures) == len(items) - len(valid)
    spans = sorted([r.span for r in g.regions] + [f.span for f in g.failures])
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))
    for r in g.regions:
        digits = [int(t) for t in span_text(processor, batch, 0, r.span).replace(",", " ").split()]
        assert tuple(digits) == tuple(int(v) for v in r.values)
        scale = [ORIGINAL[0] / RESIZED[0], ORIGINAL[1] / RESIZED[1]] * (len(r.values) // 2)
        assert r.absolute == pytest.approx([v * s for v, s in zip(r.values, scale)], rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=80), st.sampled_from(["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "ui_tars_1_5"]))
def test_find_regions_never_raises_on_arbitrary_bytes(data, convention):
    found = find_regions(b'"bbox_2d": ' + data + b'"point_2d": [' + data + b"<|box_start|>" + data, convention)
    for f in found:
        assert 0 <= f.lo <= f.hi
        assert (f.values is None) == bool(f.reason)
    assert all(a.hi <= b.lo for a, b in zip(found, found[1:]))  # in order and disjoint: spans never share a coordinate


# ----------------------------------------------------------------------------- rewards
def test_iou_giou_point_in_box_known_values():
    a = torch.tensor([[0.0, 0, 2, 2], [0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]])
    b = torch.tensor([[1.0, 1, 3, 3], [0, 0, 1, 1], [2, 0, 3, 1], [1, 1, 1, 1]])
    assert box_iou(a, b).tolist() == pytest.approx([1 / 7, 1.0, 0.0, 1.0])
    assert box_giou(a, b).tolist() == pytest.approx([1 / 7 - (9 - 7) / 9, 1.0, -1 / 3, 1.0])
    pts = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])  # inside, on an edge, outside
    assert point_in_box(pts, b[:3]).tolist() == [1.0, 1.0, 0.0]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(*[st.floats(0, 100, allow_nan=False)] * 8), min_size=1, max_size=6))
def test_iou_properties(rows):
    boxes = torch.tensor([[min(r[0], r[2]), min(r[1], r[3]), max(r[0], r[2]), max(r[1], r[3])] for r in rows], dtype=torch.float64)
    other = torch.tensor([[min(r[4], r[6]), min(r[5], r[7]), max(r[4], r[6]), max(r[5], r[7])] for r in rows], dtype=torch.float64)
    iou, giou = box_iou(boxes, other), box_giou(boxes, other)
    assert torch.equal(iou, box_iou(other, boxes))
    assert bool(((iou >= 0) & (iou <= 1)).all()) and bool(((giou >= -1) & (giou <= iou + 1e-12)).all())
    assert bool((box_iou(boxes, boxes) == 1).all())


def test_grounding_rewards_best_target_region_and_sequence_placement(processor, prompt):
    """Per-prediction IoU against the best target of its own sample, region rewards spread on
    the coordinate tokens, the sequence reward the mean, and scatter_rewards places both."""
    texts = ['{"bbox_2d": [49, 28, 98, 70]} {"bbox_2d": [0, 0, 196, 140]}', '{"point_2d": [98, 70]}', "no box here"]
    targets = [(0, [50, 30, 100, 75]), (0, [0, 0, 10, 10]), (1, [90, 60, 110, 80]), (2, [0, 0, 5, 5])]
    batch = batch_of(processor, prompt, texts, targets=targets)
    gs = [parse_grounding(batch, b, processor=processor) for b in range(3)]
    out = grounding_rewards(batch, gs)
    whole = (50 * 45) / (200 * 150)
    assert out.region.values.tolist() == pytest.approx([1.0, whole, 0.0])  # the point is the wrong kind for IoU
    assert out.sequence.tolist() == pytest.approx([(1 + whole) / 2, 0.0, 0.0])
    assert [[(s.start, s.end) for s in row] for row in out.region.spans.to_lists()] == \
        [[(r.span.start, r.span.end) for r in g.regions] for g in gs]
    tokens = scatter_rewards(batch.loss_spans, spans=[out.region])
    sample = batch.loss_token_sample()
    assert float(tokens[sample == 0].sum()) == pytest.approx(1 + whole, rel=1e-6)
    pos = batch.loss_spans.token_positions()[1]
    span = gs[0].regions[0].span
    on = (sample == 0) & (pos >= span.start) & (pos < span.end)
    assert torch.allclose(tokens[on], torch.full((int(on.sum()),), 1.0 / len(span)))
    seq = scatter_rewards(batch.loss_spans, out.sequence)
    assert seq.sum().item() == pytest.approx(out.sequence.sum().item())
    pib = grounding_rewards(batch, gs, metric="point_in_box")
    assert pib.sequence.tolist() == [0.0, 1.0, 0.0]
    giou = grounding_rewards(batch, gs, metric="giou")
    assert giou.region.values[0] == pytest.approx(1.0)


def test_targets_in_other_systems_are_converted(processor, prompt):
    batch = batch_of(processor, prompt, ['{"bbox_2d": [49, 28, 98, 70]}'], targets=[(0, [250, 200, 500, 500])],
                     system="normalized_1000")
    assert grounding_rewards(batch, [parse_grounding(batch, 0, processor=processor)]).sequence.tolist() == pytest.approx([1.0])


def test_actions():
    assert parse_action('I will click. {"action": "click", "point_2d": [5, 6]} done') == {"action": "click", "point_2d": [5, 6]}
    assert parse_action('{"foo": 1} {"action": "type", "text": "hi"}') == {"action": "type", "text": "hi"}
    assert parse_action('{"action": "fly"}') is None and parse_action("{broken") is None
    targets = [{"action": "click", "bbox_2d": [0, 0, 10, 10]}, {"action": "type", "text": "hello"},
               {"action": "scroll", "direction": "down"}, {"action": "done"}]
    actions = [{"action": "click", "point_2d": [5, 5]}, {"action": "type", "text": "hell"},
               {"action": "click", "point_2d": [1, 1]}, None]
    assert action_match(actions, targets).tolist() == [1.0, 0.5, 0.0, 0.0]
    assert action_match(actions, targets, failure_reward=-1).tolist()[-1] == -1.0
    assert action_match([{"action": "click", "point_2d": [50, 5]}], targets[:1]).tolist() == [0.5]


# ----------------------------------------------------------------------------- errors
def test_bad_input_errors_name_the_argument_sample_and_span(processor, prompt):
    batch = batch_of(processor, prompt, ['{"point_2d": [98, 70]}'], targets=[(0, [0, 0, 10, 10])])
    g = parse_grounding(batch, 0, processor=processor)
    bad_region = type(g.regions[0])("point", g.regions[0].span, (98.0, 70.0), (400.0, 75.0), 0)
    s = g.regions[0].span
    cases = [
        (lambda: parse_grounding(batch, 0, processor=processor, convention="qwen9"), SchemaError, "convention='qwen9'"),
        (lambda: parse_grounding(batch, 3, processor=processor), IndexError, "sample 3 is out of range"),
        (lambda: parse_grounding(batch, 0, processor=processor.tokenizer), TypeError, "Qwen-VL processor"),
        (lambda: parse_grounding(batch, 0, processor=processor, image=1), SchemaError, "image=1, but sample 0 has 1 images"),
        (lambda: parse_grounding(batch, 0, processor=processor, original_size=(0, 5)), ValueError, r"original_size\[0\]=0"),
        (lambda: parse_grounding("batch", 0, processor=processor), TypeError, "batch must be an RLBatch"),
        (lambda: grounding_rewards(batch, [g, g]), SchemaError, "groundings has 2 entries; the batch has 1"),
        (lambda: grounding_rewards(batch, [g], metric="dice"), ValueError, "metric='dice'"),
        (lambda: grounding_rewards(batch, [g], failure_reward=math.nan), ValueError, "failure_reward=nan"),
        (lambda: grounding_rewards(batch, [g.__class__(**{**g.__dict__, "regions": (bad_region,)})]), SchemaError,
         rf"sample 0, span \[{s.start}, {s.end}\): point \[400.0, 75.0\] lies outside the 200x150 image"),
        (lambda: box_iou(torch.tensor([[2.0, 0, 1, 1]]), torch.zeros(1, 4)), SchemaError, r"pred\[0\] .* x1 <= x2"),
        (lambda: box_iou(torch.zeros(2, 4), torch.zeros(1, 4)), SchemaError, "pred has 2 rows, target 1"),
        (lambda: point_in_box(torch.tensor([[math.inf, 0.0]]), torch.zeros(1, 4)), SchemaError, r"points\[0\] .* finite"),
        (lambda: box_giou(torch.zeros(1, 3), torch.zeros(1, 4)), ValueError, r"pred must have shape \[\*, 4\]"),
        (lambda: action_match([None], [{"action": "jump"}]), ValueError, r"targets\[0\]"),
        (lambda: action_match([None, None], [{"action": "done"}]), ValueError, "actions has 2 entries, targets 1"),
        (lambda: parse_action(b"{}"), TypeError, "text must be a str"),
        (lambda: find_regions("text", "qwen2_5_vl"), TypeError, "data must be bytes"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


def test_targets_outside_the_image_and_missing_targets_are_refused(processor, prompt):
    batch = batch_of(processor, prompt, ['{"bbox_2d": [1, 2, 3, 4]}'], targets=[(0, [0, 0, 300, 10])])
    g = parse_grounding(batch, 0, processor=processor)
    with pytest.raises(SchemaError, match=r"bbox_targets\[0\] \(sample 0\) .* outside the 200x150 image"):
        grounding_rewards(batch, [g])
    two = batch_of(processor, prompt, ['{"bbox_2d": [1, 2, 3, 4]}'] * 2, targets=[(0, [0, 0, 30, 10])])
    gs = [parse_grounding(two, b, processor=processor) for b in range(2)]
    with pytest.raises(SchemaError, match=r"sample 1, span \[\d+, \d+\): a predicted box but the sample has no bbox_targets"):
        grounding_rewards(two, gs)
    plain = RLBatch(**{k: getattr(batch, k) for k in RLBatch.model_fields if k not in ("screen_size",)})
    with pytest.raises(SchemaError, match=r"sample 0, image #0: its original size is unknown: .* or with screen_size"):
        parse_grounding(plain, 0, processor=processor)
