"""rlk_mm.ops.packed_batch and rlk_mm.ops.padded: RLBatch ↔ PackedBatch and [B, L, *] ↔ [T, *], bitwise, against the
sample-by-sample references in oracles/pack.py; the Triton gather under
TRITON_INTERPRET=1 at tiny shapes (forward and backward); clear errors."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import use_backend
from oracles import pack as ref
from rlk_mm import fixtures as F
from rlk_mm.ops.packed_batch import PackedBatch, pack, unpack
from rlk_mm.ops.padded import pack_padded, unpack_to_padded
from rlk_mm.schema import RLBatch, Span, media_token_counts
from rlk_mm.schema.spans import SpanTable

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
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
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
        prompt = [F.IM_START_TOKEN_ID] + draw(text)
        for _ in range(draw(st.integers(0, 2))):
            video = draw(st.integers(0, 4)) == 0
            t, h, w = (draw(st.integers(1, 2)) if video else 1), draw(st.integers(1, 3)), draw(st.integers(1, 3))
            (videos if video else images).append([t, 2 * h, 2 * w])
            pad = F.VIDEO_TOKEN_ID if video else F.IMAGE_TOKEN_ID
            prompt += [F.VISION_START_TOKEN_ID] + [pad] * (t * h * w) + [F.VISION_END_TOKEN_ID] + draw(text)
        prompts.append(prompt)
        responses.append(draw(st.lists(st.integers(0, 151642), min_size=0, max_size=5)))
    groups = draw(st.one_of(st.none(), st.lists(st.sampled_from("abc"), min_size=B, max_size=B)))
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
        inputs, processor=processor, responses=responses, group_ids=["g0", "g0", "g1", "g1", "g2"],
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
    with pytest.raises(ValueError, match=r"sample 1 has 33 tokens \(40 aligned to 8\), more than max_tokens_per_pack=32"):
        pack(batch, align=8, max_tokens_per_pack=32)
    with pytest.raises(ValueError, match=r"sample 1 has 33 tokens, more than max_tokens_per_pack=20.*never split"):
        pack(batch, max_tokens_per_pack=20)
    for kwargs, name in (({"align": 0}, "align"), ({"pad_token_id": -1}, "pad_token_id"), ({"max_tokens_per_pack": 0}, "max_tokens_per_pack")):
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
    batch = RLBatch.from_qwen_vl(F.processor_inputs(processor, samples), processor=processor, responses=[[1, 2], [3], [4, 5, 6], [7]])
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
