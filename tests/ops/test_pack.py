"""rlk_mm.ops.packed_batch and rlk_mm.ops.padded: RLBatch ↔ PackedBatch and [B, L, *] ↔ [T, *], bitwise, against the
sample-by-sample references in oracles/pack.py; the Triton gather under
TRITON_INTERPRET=1 at tiny shapes (forward and backward); clear errors: a table of bad and
unusual inputs (``context_cases``), and properties that draw broken masks, ``cu_seqlens`` and
pack selections and check the error names the first broken rule."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oracles import pack as ref
from rlk_mm import fixtures as F
from rlk_mm.ops.packed_batch import PackedBatch, pack, unpack
from rlk_mm.ops.padded import pack_padded, unpack_to_padded
from rlk_mm.schema import RLBatch, Span, media_token_counts
from rlk_mm.schema.spans import SpanTable
from support.context_cases import Case, Raises, Returns, assert_well, equal_nan, fail, same
from support.helpers import use_backend

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: where the Triton backend runs: the GPU, or Triton's interpreter on CPU (conftest sets it)
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_batches_equal(a: RLBatch, b: RLBatch) -> None:
    """Every field bitwise equal (tensors, span tables, strings, lists)."""
    for name in RLBatch.model_fields:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), name
        elif isinstance(x, SpanTable):
            assert x.equal(y), name
        else:
            assert x == y, name


# ============================================================ padded [B, L, *] ↔ packed [T, *]
@st.composite
def padded_cases(draw, max_b=4, max_l=9, dtypes=(torch.float32, torch.bfloat16, torch.int64, torch.bool)):
    """(x [B, L, *], mask [B, L], starts): random runs placed left, right or in the middle."""
    B, L = draw(st.integers(0, max_b)), draw(st.integers(0, max_l))
    side = draw(st.sampled_from(["left", "right", "middle"]))
    lengths = [draw(st.integers(0, L)) for _ in range(B)]
    starts = [0 if side == "right" else L - n if side == "left" else draw(st.integers(0, L - n)) for n in lengths]
    rest = draw(st.sampled_from([(), (3,), (2, 5)]))
    dtype = draw(st.sampled_from(dtypes))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if dtype.is_floating_point:
        x = torch.randn((B, L) + rest, generator=g).to(dtype)
    elif dtype == torch.bool:
        x = torch.rand((B, L) + rest, generator=g) > 0.5
    else:
        x = torch.randint(-(2**40), 2**40, (B, L) + rest, generator=g, dtype=dtype)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b, (s, n) in enumerate(zip(starts, lengths)):
        mask[b, s : s + n] = True
    if draw(st.booleans()):
        mask = mask.long()  # attention masks often come as 0/1 integers
    return x, mask, starts, side


def check_padded_round_trip(x, mask, starts, side, device="cpu"):
    packed, cu = pack_padded(x.to(device), mask.to(device))
    want, want_cu = ref.pack_padded(x, mask)
    assert packed.dtype == x.dtype and cu.dtype == torch.int32
    assert torch.equal(packed.cpu(), want) and torch.equal(cu.cpu(), want_cu)
    fill = 1 if x.dtype == torch.bool else -7
    for how in ([side] if side != "middle" else []) + [mask.to(device)]:
        back = unpack_to_padded(packed, cu, x.shape[1], how, fill=fill).cpu()
        assert torch.equal(back, ref.unpack_to_padded(want, want_cu, x.shape[1], starts, fill=fill))
        m = mask.bool().reshape(mask.shape + (1,) * (x.dim() - 2))
        assert torch.equal(torch.where(m, back, x), x)  # bitwise on the real rows


@settings(max_examples=60, **SETTINGS)
@given(padded_cases())
def test_padded_round_trip_torch(case):
    check_padded_round_trip(*case)


@settings(max_examples=12, **SETTINGS)
@given(padded_cases(max_b=3, max_l=6))
def test_padded_round_trip_triton(case):
    with use_backend("triton"):
        check_padded_round_trip(*case, device=TRITON_DEVICE)


def test_padded_backward_is_the_inverse_op(backend):
    """d pack = scatter of the packed gradient (zero at padding); d unpack = gather."""
    g = torch.Generator().manual_seed(3)
    dev = TRITON_DEVICE if backend == "triton" else "cpu"
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1]],
                        dtype=torch.bool)
    starts = [1, 0, 0, 3]
    x = torch.randn(4, 6, 5, generator=g).to(dev).requires_grad_()
    packed, cu = pack_padded(x, mask.to(dev))
    grad = torch.randn(packed.shape, generator=g)
    packed.backward(grad.to(dev))
    assert torch.equal(x.grad.cpu(), ref.unpack_to_padded(grad, cu.cpu(), 6, starts))

    y = torch.randn(packed.shape, generator=g).to(dev).requires_grad_()
    padded = unpack_to_padded(y, cu, 6, mask.to(dev), fill=3.0)
    grad = torch.randn(padded.shape, generator=g)
    padded.backward(grad.to(dev))
    assert torch.equal(y.grad.cpu(), ref.pack_padded(grad, mask)[0])

    # bf16 through both ops, composed: the gradient is 2·z on the real rows, 0 at padding
    z = torch.randn(4, 6, 8, generator=g).bfloat16().to(dev).requires_grad_()
    out = unpack_to_padded(pack_padded(z, mask.to(dev))[0], cu, 6, mask.to(dev))
    out.float().pow(2).sum().backward()
    m = mask[..., None].to(dev)
    assert torch.equal(z.grad, torch.where(m, 2 * z.detach(), torch.zeros_like(z)))


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) impls, autograd registration and AOT dispatch (torch.compile)."""
    starts = torch.tensor([0, 2, 1])
    cu = torch.tensor([0, 3, 6, 8], dtype=torch.int32)
    x = torch.randn(3, 5, 4, requires_grad=True)
    torch.library.opcheck(torch.ops.rlk_mm.pack_padded.default, (x, starts, cu, 8))
    y = torch.randn(8, 4, requires_grad=True)
    torch.library.opcheck(torch.ops.rlk_mm.unpack_to_padded.default, (y, starts, cu, 5, 0.0))


def test_padded_errors(backend):
    """Both backends raise the same errors, before any kernel runs."""
    dev = TRITON_DEVICE if backend == "triton" else "cpu"
    x = torch.randn(2, 5, 3, device=dev)
    good = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.bool, device=dev)
    with pytest.raises(ValueError, match=r"sample 1 has a hole at position 3"):
        pack_padded(x, torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 1]], dtype=torch.bool, device=dev))
    with pytest.raises(ValueError, match=r"mask has shape \(2, 4\)"):
        pack_padded(x, good[:, :4])
    with pytest.raises(ValueError, match=r"sample 0, position 1 holds 2"):
        pack_padded(x, torch.tensor([[1, 2, 1, 0, 0], [0, 0, 1, 1, 1]], device=dev))
    with pytest.raises(TypeError, match="mask must be bool or integer"):
        pack_padded(x, good.float())
    with pytest.raises(TypeError, match="complex64"):
        pack_padded(x.to(torch.complex64), good)
    packed, cu = pack_padded(x, good)
    with pytest.raises(ValueError, match=r"packed row count 5; got 0..6"):
        unpack_to_padded(packed[:5], cu, 5)
    with pytest.raises(ValueError, match=r"sample 0 has 3 rows, more than the padded length 2"):
        unpack_to_padded(packed, cu, 2, "left")
    with pytest.raises(ValueError, match="padding must be 'left', 'right'"):
        unpack_to_padded(packed, cu, 5, "up")
    with pytest.raises(ValueError, match=r"sample 1 has 2 set positions but cu_seqlens gives it 3"):
        unpack_to_padded(packed, cu, 5, torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 1, 1]], dtype=torch.bool, device=dev))
    with pytest.raises(ValueError, match="fill 0.5 is not a value of torch.int64"):
        unpack_to_padded(packed.long(), cu, 5, fill=0.5)
    with pytest.raises(ValueError, match="cu_seqlens decreases at sample 1"):
        unpack_to_padded(packed, torch.tensor([0, 4, 3, 6], device=dev), 5)


# ============================================================ RLBatch ↔ PackedBatch
@st.composite
def token_batches(draw, processor):
    """A real RLBatch from token lists: text, images and videos with real placeholder ids."""
    B = draw(st.integers(1, 5))
    text = st.lists(st.integers(0, 151642), min_size=0, max_size=6)
    prompts, responses, images, videos = [], [], [], []
    for _ in range(B):
        if prompts and F.VISION_START_TOKEN_ID not in prompts[-1] and draw(st.booleans()):
            prompts.append(list(prompts[-1]))  # another answer to the same text prompt: one GRPO group
            responses.append(draw(st.lists(st.integers(0, 151642), min_size=0, max_size=5)))
            continue
        prompt = [F.IM_START_TOKEN_ID] + draw(text)
        for _ in range(draw(st.integers(0, 2))):
            video = draw(st.integers(0, 4)) == 0
            t, h, w = (draw(st.integers(1, 2)) if video else 1), draw(st.integers(1, 3)), draw(st.integers(1, 3))
            (videos if video else images).append([t, 2 * h, 2 * w])
            pad = F.VIDEO_TOKEN_ID if video else F.IMAGE_TOKEN_ID
            prompt += [F.VISION_START_TOKEN_ID] + [pad] * (t * h * w) + [F.VISION_END_TOKEN_ID] + draw(text)
        prompts.append(prompt)
        responses.append(draw(st.lists(st.integers(0, 151642), min_size=0, max_size=5)))
    # a GRPO group answers one prompt: samples share a group id where they share the prompt
    groups = draw(st.one_of(st.none(), st.just([f"g{prompts.index(p)}" for p in prompts])))
    rewards = draw(st.one_of(st.none(), st.lists(st.floats(-2, 2, width=32), min_size=B, max_size=B)))
    return RLBatch.from_token_lists(
        prompts, responses, processor=processor,
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None,
        media_cache_keys=[f"key-{i}" for i in range(len(images) + len(videos))],
        group_ids=groups, rewards=rewards,
    )


def check_pack(batch: RLBatch, p: PackedBatch, align: int, pad: int) -> None:
    want = ref.pack_batch(batch, align, pad)
    for name in ("input_ids", "position_ids", "valid", "cu_seqlens"):
        assert torch.equal(getattr(p, name), want[name]), name
    assert torch.equal(p.modality_spans.starts, want["modality_starts"])
    assert torch.equal(p.loss_spans.starts, want["loss_starts"])
    for new, old in ((p.modality_spans, batch.modality_spans), (p.loss_spans, batch.loss_spans)):
        assert torch.equal(new.lengths(), old.lengths()) and torch.equal(new.sample_ptr, old.sample_ptr)
        assert torch.equal(new.modality, old.modality) and torch.equal(new.media_index, old.media_index)
    assert bool((torch.diff(p.cu_seqlens) % align == 0).all())
    assert torch.equal(p.seq_lengths, batch.seq_lengths())
    assert int(p.valid.sum()) == batch.num_tokens
    assert bool((p.input_ids[~p.valid] == pad).all())
    # spans keep their meaning at their new positions
    rows, targets = p.loss_token_index()
    assert torch.equal(targets, batch.loss_token_index()[1])
    assert bool(p.valid[rows].all())  # scored from a real token of the same sample


@settings(max_examples=20, **SETTINGS)
@given(st.data(), st.sampled_from([1, 8, 64]), st.sampled_from([0, F.ENDOFTEXT_TOKEN_ID]))
def test_pack_round_trip(processor, data, align, pad):
    batch = data.draw(token_batches(processor))
    p = pack(batch, align=align, pad_token_id=pad)
    check_pack(batch, p, align, pad)
    assert torch.equal(p.sample_index, torch.arange(batch.num_samples))
    assert p.batch is batch and p.source_tokens == batch.num_tokens
    assert_batches_equal(unpack(p), batch)
    # the row map: a token's hidden state at pack row r is the batch's row source_rows[r]
    rows, _ = p.loss_token_index()
    assert torch.equal(p.source_rows[rows], batch.loss_token_index()[0])
    values = torch.randn(batch.num_tokens, 2)
    packed_values = p.pack_tokens(values, fill=-1.0)
    assert bool((packed_values[~p.valid] == -1).all())
    assert torch.equal(unpack(p, packed_values), values)


@settings(max_examples=15, **SETTINGS)
@given(st.data(), st.sampled_from([1, 8]), st.sampled_from(["image", "video", "other"]), st.booleans())
def test_pack_refuses_a_media_placeholder_as_pad_id(processor, data, align, which, split):
    """Any batch, any alignment, one pack or several: a pad id equal to the batch's image or video
    placeholder is refused, naming the argument and the placeholder; any other id pads."""
    batch = data.draw(token_batches(processor))
    pad = {"image": F.IMAGE_TOKEN_ID, "video": F.VIDEO_TOKEN_ID, "other": F.ENDOFTEXT_TOKEN_ID}[which]
    limit = max(batch.seq_lengths().tolist(), default=0) + 8 if split else None
    if which == "other":
        got = pack(batch, align=align, pad_token_id=pad, max_tokens_per_pack=limit)
        for q in got if split else [got]:
            assert bool((q.input_ids[~q.valid] == pad).all())
    else:
        with pytest.raises(ValueError, match=rf"pad_token_id={pad} is the batch's {which} placeholder token"):
            pack(batch, align=align, pad_token_id=pad, max_tokens_per_pack=limit)


@settings(max_examples=12, **SETTINGS)
@given(st.data(), st.sampled_from([1, 8]), st.integers(0, 40))
def test_pack_split(processor, data, align, extra):
    batch = data.draw(token_batches(processor))
    slots = [-(-n // align) * align for n in batch.seq_lengths().tolist()]
    limit = max(slots) + extra
    packs = pack(batch, align=align, max_tokens_per_pack=limit)
    assert isinstance(packs, list) and all(isinstance(q, PackedBatch) for q in packs)
    assert torch.equal(torch.cat([q.sample_index for q in packs]), torch.arange(batch.num_samples))
    for q, nxt in zip(packs, packs[1:] + [None]):
        assert q.num_tokens <= limit
        if nxt is not None:  # next-fit: the next pack's first sample did not fit here
            assert q.num_tokens + slots[int(nxt.sample_index[0])] > limit
        sub = batch.select(q.sample_index.tolist())
        assert_batches_equal(q.batch, sub)
        check_pack(sub, q, align, 0)
        assert_batches_equal(unpack(q), sub)
        counts = media_token_counts(q.batch.media_grid_thw, 2) if q.batch.num_media else torch.zeros(0)
        media = q.modality_spans.media_index >= 0  # media spans index this pack's own media items
        assert torch.equal(q.modality_spans.lengths()[media].long(), counts[q.modality_spans.media_index[media].long()])
    assert_batches_equal(unpack(packs), batch)
    values = torch.randn(batch.num_tokens, 3).bfloat16()
    assert torch.equal(unpack(packs, [q.pack_tokens(values) for q in packs]), values)


def test_pack_real_processor_batch(processor):
    """Images and a video through the real processor, responses, groups, rewards: pack/unpack is bitwise."""
    samples = F.synthetic_image_text(3, seed=7) + F.synthetic_video_text(2, seed=7, with_image=True)
    inputs = F.processor_inputs(processor, samples, padding_side="left")
    responses = [[11, 22, 33, F.IM_END_TOKEN_ID], [44, F.IM_END_TOKEN_ID], [5] * 9, [6, 7], [8]]
    batch = RLBatch.from_qwen_vl(
        inputs, processor=processor, responses=responses, group_ids=["g0", "g1", "g2", "g3", "g4"],
        rewards=[1.0, 0.0, 0.5, 1.0, 0.0], media_ids=None,
    )
    p = pack(batch, align=64, pad_token_id=F.ENDOFTEXT_TOKEN_ID)
    check_pack(batch, p, 64, F.ENDOFTEXT_TOKEN_ID)
    assert_batches_equal(unpack(p), batch)
    limit = int(torch.diff(p.cu_seqlens).max()) + 64
    packs = pack(batch, align=64, max_tokens_per_pack=limit, pad_token_id=F.ENDOFTEXT_TOKEN_ID)
    assert len(packs) > 1
    assert torch.equal(torch.cat([q.batch.pixel_values for q in packs]), batch.pixel_values)
    assert_batches_equal(unpack(packs), batch)


def test_pack_errors(processor):
    batch = RLBatch.from_token_lists([[1, 2, 3], list(range(10, 41)), [4, 5]], [[6], [7, 8], [9]], processor=processor)
    with pytest.raises(ValueError,
                       match=r"sample 1 has 33 tokens \(40 aligned to 8\), more than max_tokens_per_pack=32"):
        pack(batch, align=8, max_tokens_per_pack=32)
    with pytest.raises(ValueError, match=r"sample 1 has 33 tokens, more than max_tokens_per_pack=20.*never split"):
        pack(batch, max_tokens_per_pack=20)
    for kwargs, name in (({"align": 0}, "align"), ({"pad_token_id": -1}, "pad_token_id"),
                         ({"max_tokens_per_pack": 0}, "max_tokens_per_pack")):
        with pytest.raises(ValueError, match=name):
            pack(batch, **kwargs)
    with pytest.raises(TypeError, match="align"):  # a bool is not an int (schema.checks.int_arg)
        pack(batch, align=True)
    with pytest.raises(TypeError, match="pack takes an RLBatch"):
        pack(torch.zeros(3))
    packs = pack(batch, max_tokens_per_pack=33)
    assert [q.sample_index.tolist() for q in packs] == [[0], [1], [2]]
    with pytest.raises(ValueError, match=r"the packs hold sample 1 0 times"):
        unpack([packs[0], packs[2]])
    with pytest.raises(ValueError, match=r"the packs hold sample 0 2 times"):
        unpack([packs[0], packs[0], packs[1], packs[2]])
    with pytest.raises(ValueError, match=r"values must be \[T', \*\] with T' = 4"):
        unpack(packs[0], torch.zeros(5))
    with pytest.raises(ValueError, match=r"T = 40"):
        packs[0].pack_tokens(torch.zeros(4))
    with pytest.raises(TypeError, match="non-empty list"):
        unpack([])


def _rich_batch() -> RLBatch:
    """Three text samples with every optional per-sample and per-span field set."""
    lengths, cu = [10, 8, 6], [0, 10, 18, 24]

    def table(per):
        return SpanTable.from_lists([[Span(a, b) for a, b in spans] for spans in per])

    return RLBatch(
        input_ids=torch.arange(24), cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        position_ids=torch.cat([torch.arange(n) for n in lengths]).expand(3, 24).clone(),
        modality_spans=table([[(0, n)] for n in lengths]), loss_spans=table([[(4, 10)], [(3, 8)], [(2, 6)]]),
        processor_fingerprint="test", rewards=torch.tensor([1.0, -1.0, 0.5]), costs=torch.tensor([0.1, 0.2, 0.3]),
        prompt_lengths=torch.tensor([4, 3, 2]), group_ids=["a", "a", "b"],
        region_spans=table([[(5, 7)], [], [(2, 3)]]), region_rewards=torch.tensor([0.5, 0.25]),
        action_spans=table([[(4, 6), (6, 10)], [(3, 8)], []]), turn_rewards=torch.tensor([0.2, 0.3, 0.4]),
        bbox_targets=torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.1, 0.1, 0.5, 0.5]]), bbox_sample=torch.tensor([0, 2]),
        point_targets=torch.tensor([[0.5, 0.5]]), point_sample=torch.tensor([1]),
        coordinate_system="normalized", screen_size=torch.tensor([[100, 200], [100, 200], [50, 50]]),
    )


@pytest.mark.parametrize("kwargs", [{}, {"max_tokens_per_pack": 10}, {"align": 4, "max_tokens_per_pack": 12}])
def test_pack_keeps_every_field(kwargs):
    """Every optional field (costs, prompt lengths, groups, region and turn rewards, boxes,
    points, screen sizes) comes back through pack/unpack, whole batch or split."""
    batch = _rich_batch()
    assert_batches_equal(unpack(pack(batch, **kwargs)), batch)


def test_pack_empty_batch(processor):
    batch = RLBatch.from_token_lists([], [], processor=processor)
    p = pack(batch, align=8)
    assert p.num_tokens == 0 and p.num_samples == 0 and p.max_seqlen == 0
    assert_batches_equal(unpack(p), batch)
    assert pack(batch, max_tokens_per_pack=4) == []


@pytest.mark.gpu
def test_pack_batch_on_cuda_matches_cpu(processor):
    samples = F.synthetic_image_text(4, seed=3)
    batch = RLBatch.from_qwen_vl(F.processor_inputs(processor, samples), processor=processor,
                                 responses=[[1, 2], [3], [4, 5, 6], [7]])
    cpu, gpu = pack(batch, align=8), pack(batch.to("cuda"), align=8)
    for name in ("input_ids", "position_ids", "cu_seqlens", "seq_lengths", "valid", "source_rows", "sample_index"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
    assert gpu.modality_spans.to("cpu").equal(cpu.modality_spans) and gpu.loss_spans.to("cpu").equal(cpu.loss_spans)
    assert_batches_equal(unpack(gpu).to("cpu"), batch)


@pytest.mark.gpu
def test_split_pack_on_cuda_stays_on_cuda():
    batch = _rich_batch().to("cuda")
    packs = pack(batch, align=4, max_tokens_per_pack=12)
    back = unpack(packs)
    assert {v.device.type for v in dict(back).values() if isinstance(v, torch.Tensor)} == {"cuda"}
    assert_batches_equal(back.to("cpu"), _rich_batch())
    values = [torch.randn(q.num_tokens, 2, device="cuda") for q in packs]
    assert torch.equal(unpack(packs, values), torch.cat([v[q.valid] for q, v in zip(packs, values)]))


# ============================================================ bad and unusual inputs
def _check_nan_pack(result, c):
    packed, cu = result
    assert equal_nan(packed, torch.tensor([math.nan, 1.0, math.inf, -math.inf])), packed
    assert cu.tolist() == [0, 2, 4]


BAD = [
    # ---------------------------------------------------------------- pack_padded(x, mask)
    Case("pack_padded.x.list", lambda c: pack_padded(c.x.tolist(), c.mask),
         Raises(TypeError, r"x must be a torch\.Tensor")),
    Case("pack_padded.x.1d", lambda c: pack_padded(torch.zeros(5), c.mask),
         Raises(ValueError, r"x must be .*\[B, L, \*\].*\(5,\)")),
    Case("pack_padded.x.complex", lambda c: pack_padded(c.x.to(torch.complex64), c.mask),
         Raises(TypeError, r"x .*complex64")),
    Case("pack_padded.mask.list", lambda c: pack_padded(c.x, c.mask.tolist()),
         Raises(TypeError, r"mask must be a torch\.Tensor")),
    Case("pack_padded.mask.3d", lambda c: pack_padded(c.x, c.mask[..., None]),
         Raises(ValueError, r"mask must be .*\[B, L\]")),
    Case("pack_padded.mask.shape", lambda c: pack_padded(c.x, c.mask[:, :4]),
         Raises(ValueError, r"mask has shape \(2, 4\) but x")),
    Case("pack_padded.mask.float", lambda c: pack_padded(c.x, c.mask.float()),
         Raises(TypeError, r"mask must be bool or integer")),
    Case("pack_padded.mask.value", lambda c: pack_padded(c.x, c.mask.long() * 2),
         Raises(ValueError, r"mask: sample 0, position 0 holds 2")),
    Case("pack_padded.mask.negative", lambda c: pack_padded(c.x, -c.mask.long()),
         Raises(ValueError, r"mask: sample 0, position 0 holds -1")),
    Case("pack_padded.mask.hole", lambda c: pack_padded(c.x, torch.tensor([[1, 0, 1, 0, 0], [1, 1, 1, 1, 1]])),
         Raises(ValueError, r"mask: sample 0 has a hole at position 1")),
    # ------------------------------------------------ unpack_to_padded(packed, cu_seqlens, length, side, fill)
    Case("unpack_to_padded.packed.list", lambda c: unpack_to_padded(c.packed.tolist(), c.cu, 5),
         Raises(TypeError, r"packed must be a torch\.Tensor")),
    Case("unpack_to_padded.packed.0d", lambda c: unpack_to_padded(torch.tensor(1.0), c.cu, 5),
         Raises(ValueError, r"packed must be .*\[T, \*\]")),
    Case("unpack_to_padded.packed.complex", lambda c: unpack_to_padded(c.packed.to(torch.complex64), c.cu, 5),
         Raises(TypeError, r"packed .*complex64")),
    Case("unpack_to_padded.cu.float", lambda c: unpack_to_padded(c.packed, c.cu.float(), 5),
         Raises(TypeError, r"cu_seqlens must be .*int")),
    Case("unpack_to_padded.cu.list", lambda c: unpack_to_padded(c.packed, c.cu.tolist(), 5),
         Raises(TypeError, r"cu_seqlens must be a torch\.Tensor")),
    Case("unpack_to_padded.cu.2d", lambda c: unpack_to_padded(c.packed, c.cu[None], 5),
         Raises(ValueError, r"cu_seqlens must be 1-D")),
    Case("unpack_to_padded.cu.empty", lambda c: unpack_to_padded(c.packed, c.cu[:0], 5),
         Raises(ValueError, r"cu_seqlens .*B\+1")),
    Case("unpack_to_padded.cu.int32_overflow", lambda c: unpack_to_padded(c.packed, torch.tensor([0, 3, 2**32 + 6]), 5),
         Raises(ValueError, r"cu_seqlens must run from 0 to the packed row count 6")),
    Case("unpack_to_padded.cu.start", lambda c: unpack_to_padded(c.packed, c.cu + 1, 5),
         Raises(ValueError, r"cu_seqlens must run from 0")),
    Case("unpack_to_padded.cu.decreasing", lambda c: unpack_to_padded(c.packed, torch.tensor([0, 4, 3, 6]), 5),
         Raises(ValueError, r"cu_seqlens decreases at sample 1")),
    Case("unpack_to_padded.length.negative", lambda c: unpack_to_padded(c.packed, c.cu, -1),
         Raises(ValueError, r"length=-1 is out of range")),
    Case("unpack_to_padded.length.bool", lambda c: unpack_to_padded(c.packed, c.cu, True),
         Raises(TypeError, r"length must be an int")),
    Case("unpack_to_padded.length.float", lambda c: unpack_to_padded(c.packed, c.cu, 5.0),
         Raises(TypeError, r"length must be an int")),
    Case("unpack_to_padded.length.short", lambda c: unpack_to_padded(c.packed, c.cu, 2),
         Raises(ValueError, r"sample 0 has 3 rows, more than the padded length 2")),
    Case("unpack_to_padded.padding.word", lambda c: unpack_to_padded(c.packed, c.cu, 5, "up"),
         Raises(ValueError, r"padding must be 'left', 'right'")),
    Case("unpack_to_padded.padding.none", lambda c: unpack_to_padded(c.packed, c.cu, 5, None),
         Raises(ValueError, r"padding must be 'left', 'right'")),
    Case("unpack_to_padded.padding.shape", lambda c: unpack_to_padded(c.packed, c.cu, 5, c.mask[:, :4]),
         Raises(ValueError, r"padding as a mask must have shape")),
    Case("unpack_to_padded.padding.float", lambda c: unpack_to_padded(c.packed, c.cu, 5, c.mask.float()),
         Raises(TypeError, r"padding .*bool or integer")),
    Case("unpack_to_padded.padding.hole",
         lambda c: unpack_to_padded(c.packed, c.cu, 5, torch.tensor([[1, 1, 0, 1, 0], [0, 0, 1, 1, 1]])),
         Raises(ValueError, r"padding: sample 0 has a hole at position 2")),
    Case("unpack_to_padded.padding.counts",
         lambda c: unpack_to_padded(c.packed, c.cu, 5, torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 1, 1]])),
         Raises(ValueError, r"padding: sample 1 has 2 set positions but cu_seqlens gives it 3")),
    Case("unpack_to_padded.fill.fraction", lambda c: unpack_to_padded(c.packed.long(), c.cu, 5, fill=0.5),
         Raises(ValueError, r"fill 0.5 is not a value of torch.int64")),
    Case("unpack_to_padded.fill.inf_int", lambda c: unpack_to_padded(c.packed.long(), c.cu, 5, fill=math.inf),
         Raises(ValueError, r"fill inf is not a value of torch.int64")),
    Case("unpack_to_padded.fill.nan_int", lambda c: unpack_to_padded(c.packed.long(), c.cu, 5, fill=math.nan),
         Raises(ValueError, r"fill nan is not a value of torch.int64")),
    Case("unpack_to_padded.fill.overflow", lambda c: unpack_to_padded(c.packed, c.cu, 5, fill=1e300),
         Raises(ValueError, r"fill 1e\+300 is not a value of torch.float32")),
    Case("unpack_to_padded.fill.uint8", lambda c: unpack_to_padded(c.packed.to(torch.uint8), c.cu, 5, fill=300),
         Raises(ValueError, r"fill 300 is not a value of torch.uint8")),
    Case("unpack_to_padded.fill.bool", lambda c: unpack_to_padded(c.packed > 0, c.cu, 5, fill=2),
         Raises(ValueError, r"fill 2 is not a value of torch.bool")),
    Case("unpack_to_padded.fill.str", lambda c: unpack_to_padded(c.packed, c.cu, 5, fill="0"),
         Raises(TypeError, r"fill must be an int or float")),
    Case("unpack_to_padded.fill.true", lambda c: unpack_to_padded(c.packed, c.cu, 5, fill=True),
         Raises(TypeError, r"fill must be an int or float")),
    # ------------------------------------------------ pack(batch, align, max_tokens_per_pack, pad_token_id)
    Case("pack.batch.tensor", lambda c: pack(torch.zeros(3)), Raises(TypeError, r"pack takes an RLBatch")),
    Case("pack.align.zero", lambda c: pack(c.batch, align=0), Raises(ValueError, r"align=0 is out of range")),
    Case("pack.align.bool", lambda c: pack(c.batch, align=True), Raises(TypeError, r"align must be an int, got bool")),
    Case("pack.align.float", lambda c: pack(c.batch, align=8.0), Raises(TypeError, r"align must be an int, got float")),
    Case("pack.pad.negative", lambda c: pack(c.batch, pad_token_id=-1),
         Raises(ValueError, r"pad_token_id=-1 is out of range")),
    Case("pack.pad.huge", lambda c: pack(c.batch, pad_token_id=2**63),
         Raises(ValueError, r"pad_token_id=\d+ is out of range")),
    Case("pack.pad.image", lambda c: pack(c.batch, align=8, pad_token_id=F.IMAGE_TOKEN_ID),
         Raises(ValueError, r"pad_token_id=151655 is the batch's image placeholder token \(image_token_id\).*pass the")),
    Case("pack.pad.video", lambda c: pack(c.image_batch, align=8, pad_token_id=F.VIDEO_TOKEN_ID),
         Raises(ValueError, r"pad_token_id=151656 is the batch's video placeholder token \(video_token_id\)")),
    Case("pack.pad.image.unaligned", lambda c: pack(c.batch, pad_token_id=F.IMAGE_TOKEN_ID),
         Raises(ValueError, r"pad_token_id=151655 is the batch's image placeholder")),
    Case("pack.max.zero", lambda c: pack(c.batch, max_tokens_per_pack=0),
         Raises(ValueError, r"max_tokens_per_pack=0 is out of range")),
    Case("pack.max.str", lambda c: pack(c.batch, max_tokens_per_pack="64"),
         Raises(TypeError, r"max_tokens_per_pack must be an int")),
    Case("pack.max.small", lambda c: pack(c.batch, max_tokens_per_pack=20),
         Raises(ValueError, r"sample 1 has 33 tokens, more than max_tokens_per_pack=20")),
    # ---------------------------------------------------------------- unpack(packed, values)
    Case("unpack.none", lambda c: unpack(None), Raises(TypeError, r"unpack takes a PackedBatch or a non-empty list")),
    Case("unpack.empty", lambda c: unpack([]), Raises(TypeError, r"unpack takes a PackedBatch or a non-empty list")),
    Case("unpack.str", lambda c: unpack("ab"), Raises(TypeError, r"unpack takes a PackedBatch or a non-empty list")),
    Case("unpack.missing_middle", lambda c: unpack([c.packs[0], c.packs[2]]),
         Raises(ValueError, r"the packs hold sample 1 0 times")),
    Case("unpack.missing_last", lambda c: unpack(c.packs[:2]), Raises(ValueError, r"the packs hold sample 2 0 times")),
    Case("unpack.missing_last.values", lambda c: unpack(c.packs[:2], c.values[:2]),
         Raises(ValueError, r"the packs hold sample 2 0 times")),
    Case("unpack.twice", lambda c: unpack([c.packs[0], c.packs[0], c.packs[1], c.packs[2]]),
         Raises(ValueError, r"the packs hold sample 0 2 times")),
    Case("unpack.two_batches", lambda c: unpack([c.packs[0], c.twin_packs[1], c.packs[2]]),
         Raises(ValueError, r"packs of different pack\(\) calls")),
    Case("unpack.two_batches.values", lambda c: unpack([c.packs[0], c.twin_packs[1], c.packs[2]], c.values),
         Raises(ValueError, r"packs of different pack\(\) calls")),
    Case("unpack.values.tensor", lambda c: unpack(c.packs, torch.zeros(4)),
         Raises(TypeError, r"values must be a list of tensors, one per pack")),
    Case("unpack.values.count", lambda c: unpack(c.packs, c.values[:1]),
         Raises(ValueError, r"unpack got 1 value tensors for 3 packs")),
    Case("unpack.values.dtypes", lambda c: unpack(c.packs, [c.values[0], c.values[1].long(), c.values[2]]),
         Raises(TypeError, r"values\[1\] is torch.int64 but values\[0\] is torch.float32")),
    Case("unpack.values.shapes",
         lambda c: unpack(c.packs, [c.values[0], c.values[1][:, None].expand(-1, 2), c.values[2]]),
         Raises(ValueError, r"values\[1\] has shape \(\d+, 2\) .* values\[0\]")),
    Case("unpack.values.length", lambda c: unpack(c.packs, [c.values[0], c.values[1][:-1], c.values[2]]),
         Raises(ValueError, r"values\[1\] must be \[T', \*\]")),
    Case("unpack.one.values.list", lambda c: unpack(c.packs[0], [c.values[0]]),
         Raises(TypeError, r"values must be a torch\.Tensor")),
    Case("unpack.one.values.length", lambda c: unpack(c.packs[0], torch.zeros(5)),
         Raises(ValueError, r"values must be \[T', \*\] with T' = 4")),
    Case("unpack.one.values.0d", lambda c: unpack(c.packs[0], torch.tensor(0.0)),
         Raises(ValueError, r"values must be .*\[T', \*\]")),
    # ---------------------------------------------------------------- PackedBatch methods
    Case("pack_tokens.values.list", lambda c: c.packs[0].pack_tokens([0.0] * 40),
         Raises(TypeError, r"values must be a torch\.Tensor")),
    Case("pack_tokens.values.length", lambda c: c.packs[0].pack_tokens(torch.zeros(4)),
         Raises(ValueError, r"values must be \[T, \*\] with T = 40")),
    Case("pack_tokens.values.0d", lambda c: c.packs[0].pack_tokens(torch.tensor(1.0)),
         Raises(ValueError, r"values must be .*\[T, \*\]")),
    Case("pack_tokens.fill.inf_int", lambda c: c.packs[0].pack_tokens(torch.zeros(40, dtype=torch.long), fill=math.inf),
         Raises(ValueError, r"fill inf is not a value of torch.int64")),
    Case("pack_tokens.fill.str", lambda c: c.packs[0].pack_tokens(torch.zeros(40), fill="x"),
         Raises(TypeError, r"fill must be an int or float")),
    Case("PackedBatch.to.word", lambda c: c.packs[0].to("gpu"), Raises(ValueError, r"device='gpu'")),
    Case("PackedBatch.to.missing", lambda c: c.packs[0].to("cuda:99"), Raises(ValueError, r"device='cuda:99'")),
]


GOOD = [
    Case("pack.pad.numpy", lambda c: pack(c.batch, align=8, pad_token_id=np.int64(F.ENDOFTEXT_TOKEN_ID)),
         Returns(lambda r, c: bool((r.input_ids[~r.valid] == F.ENDOFTEXT_TOKEN_ID).all()) or fail(r))),
    Case("pack_padded.non_finite",
         lambda c: pack_padded(torch.tensor([[math.nan, 1.0, 0.0], [0.0, math.inf, -math.inf]]),
                               torch.tensor([[1, 1, 0], [0, 1, 1]])), Returns(_check_nan_pack)),
    Case("pack_padded.empty_batch", lambda c: pack_padded(torch.zeros(0, 4, 2), torch.zeros(0, 4, dtype=torch.bool)),
         Returns(lambda r, c: r[0].shape == (0, 2) and r[1].tolist() == [0] or fail(r))),
    Case("pack_padded.no_valid", lambda c: pack_padded(c.x, torch.zeros(2, 5, dtype=torch.bool)),
         Returns(lambda r, c: r[0].shape == (0, 3) and r[1].tolist() == [0, 0, 0] or fail(r))),
    Case("pack_padded.non_contiguous", lambda c: pack_padded(c.x.transpose(0, 1).contiguous().transpose(0, 1), c.mask),
         Returns(same(lambda c: c.packed))),
    Case("unpack_to_padded.non_finite",
         lambda c: unpack_to_padded(torch.tensor([math.nan, math.inf]), torch.tensor([0, 2]), 3, "left",
                                    fill=-math.inf),
         Returns(lambda r, c: equal_nan(r, torch.tensor([[-math.inf, math.nan, math.inf]])) or fail(r))),
    Case("unpack_to_padded.empty_batch",
         lambda c: unpack_to_padded(torch.zeros(0, 2), torch.zeros(1, dtype=torch.int32), 3),
         Returns(lambda r, c: r.shape == (0, 3, 2) or fail(r))),
    Case("unpack_to_padded.int64_cu", lambda c: unpack_to_padded(c.packed, c.cu.long(), 5, c.mask),
         Returns(same(lambda c: torch.where(c.mask[..., None], c.x, 0)))),
    Case("unpack_to_padded.numpy_length", lambda c: unpack_to_padded(c.packed, c.cu, np.int64(5), c.mask),
         Returns(same(lambda c: torch.where(c.mask[..., None], c.x, 0)))),
    Case("pack.numpy_align", lambda c: pack(c.batch, align=np.int64(8)),
         Returns(lambda r, c: r.align == 8 and r.num_tokens == 56 or fail(r))),
    Case("unpack.shuffled_packs", lambda c: unpack([c.packs[2], c.packs[0], c.packs[1]]),
         Returns(lambda r, c: assert_batches_equal(r, c.batch))),
    Case("unpack.values.non_finite", lambda c: unpack(c.packs, [v * math.inf for v in c.values]),
         Returns(lambda r, c: equal_nan(r, torch.cat([v[p.valid] for p, v in zip(c.packs, c.values)]) * math.inf)
                 or fail(r))),
]


@pytest.mark.parametrize("case", BAD + GOOD, ids=lambda case: case.id)
def test_input(case, input_context):
    assert_well(case, input_context)


@settings(max_examples=40, **SETTINGS)
@given(st.integers(0, 4), st.integers(0, 6), st.data())
def test_pack_padded_refuses_every_broken_mask(B, L, data):
    """A mask of -1/0/1/2 entries: packed like the oracle when every row is one run of ones,
    else an error at the first value other than 0/1, or else at the first hole."""
    values = data.draw(st.lists(st.sampled_from([0, 0, 1, 1, 1, 2, -1]), min_size=B * L, max_size=B * L))
    mask = torch.tensor(values, dtype=torch.int64).reshape(B, L)
    x = torch.arange(B * L * 2, dtype=torch.float32).reshape(B, L, 2)
    odd = [(b, p) for b in range(B) for p in range(L) if mask[b, p] not in (0, 1)]
    holes = []
    for b in range(B):
        ones = [p for p in range(L) if mask[b, p] != 0]
        holes += [(b, p) for p in range(L) if ones and ones[0] <= p < ones[-1] and mask[b, p] == 0][:1]
    if odd:
        b, p = odd[0]
        with pytest.raises(ValueError, match=rf"mask: sample {b}, position {p} holds {int(mask[b, p])}"):
            pack_padded(x, mask)
    elif holes:
        with pytest.raises(ValueError, match=rf"mask: sample {holes[0][0]} has a hole at position {holes[0][1]}"):
            pack_padded(x, mask)
    else:
        packed, cu = pack_padded(x, mask)
        want, want_cu = ref.pack_padded(x, mask)
        assert torch.equal(packed, want) and torch.equal(cu, want_cu)


@settings(max_examples=40, **SETTINGS)
@given(st.integers(0, 4), st.integers(0, 5), st.data())
def test_unpack_to_padded_refuses_every_broken_cu_seqlens(B, L, data):
    """Random offsets: the oracle's result when they run from 0 to T without decreasing and
    no sample is longer than L, else the first broken rule, named."""
    T = data.draw(st.integers(0, 8))
    cu = [0] + data.draw(st.lists(st.integers(-1, T + 1), min_size=B, max_size=B))
    if data.draw(st.booleans()):  # often a valid one
        cu = [0] + sorted(data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
        cu[-1] = T if B else 0
    packed = torch.arange(T, dtype=torch.float32)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if cu[-1] != T:
        error = rf"cu_seqlens must run from 0 to the packed row count {T}"
    elif any(n < 0 for n in lengths):
        error = rf"cu_seqlens decreases at sample {next(i for i, n in enumerate(lengths) if n < 0)}"
    elif any(n > L for n in lengths):
        b = next(i for i, n in enumerate(lengths) if n > L)
        error = rf"cu_seqlens: sample {b} has {lengths[b]} rows, more than the padded length {L}"
    else:
        error = None
    side = data.draw(st.sampled_from(["left", "right"]))
    if error:
        with pytest.raises(ValueError, match=error):
            unpack_to_padded(packed, torch.tensor(cu), L, side, fill=-1)
    else:
        starts = [0 if side == "right" else L - n for n in lengths]
        got = unpack_to_padded(packed, torch.tensor(cu), L, side, fill=-1)
        assert torch.equal(got, ref.unpack_to_padded(packed, torch.tensor(cu, dtype=torch.int32), L, starts, fill=-1))


@settings(max_examples=40, **SETTINGS)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=5))
def test_unpack_needs_each_pack_of_one_call_once(input_context, picks):
    """Any selection of the 3 packs of one call (one sample each) and the first pack of
    another call: the batch back (and the values) when it is each pack of one call once, in
    any order, else an error naming the mix of calls or the first sample held other than once."""
    packs = [(input_context.packs + input_context.twin_packs[:1])[i] for i in picks]
    values = [torch.arange(p.num_tokens, dtype=torch.float32) for p in packs]
    counts = [sum(1 for i in picks if i % 3 == b) for b in range(3)]  # pick 3 holds the other call's sample 0
    if not picks:
        with pytest.raises(TypeError, match="non-empty list"):
            unpack(packs)
    elif 3 in picks and len(set(picks)) > 1:
        with pytest.raises(ValueError, match=r"packs of different pack\(\) calls"):
            unpack(packs, values)
    elif counts != [1, 1, 1]:
        first = next(b for b, k in enumerate(counts) if k != 1)
        with pytest.raises(ValueError, match=rf"the packs hold sample {first} {counts[first]} times"):
            unpack(packs)
    else:
        assert_batches_equal(unpack(packs), input_context.batch)
        assert torch.equal(unpack(packs, values),
                           unpack(input_context.packs, [values[picks.index(i)] for i in range(3)]))
