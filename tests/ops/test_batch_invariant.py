"""Batch-invariant prefill kernels and batch_invariant(): the Triton kernels (under
TRITON_INTERPRET=1 on CPU) and the torch references against fp64 oracles within the
numerical contract; bitwise row/sequence invariance of both; mask -> segments; exact
restore of every override; autograd; VisionCache's gather and group scoring errors."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from rlk_mm import fixtures
from rlk_mm.models import VisionCache, batch_logprobs, group_logprobs
from rlk_mm.models.vision_cache import _GatherRows
from rlk_mm.ops import batch_invariant
from rlk_mm.ops._torch import invariant as R
from rlk_mm.ops.invariant import attention as A
from rlk_mm.ops.invariant import matmul as M
from rlk_mm.ops.invariant import rmsnorm as N
from rlk_mm.ops.invariant.mode import batch_invariant_active, stock_kernels
from rlk_mm.parity.contract import LOGPROB_GRAD_REL, relative_error
from rlk_mm.schema import RLBatch

BACKENDS = ["torch", "triton"]  # batch_invariant(backend=...), not RLK_MM_BACKEND
DTYPES = [torch.float32, torch.bfloat16]

#: the torch reference matmul is many small fixed-shape products: one thread is fastest
pytestmark = pytest.mark.usefixtures("one_thread")


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_(requires_grad)


def _rel_bound(dtype):
    # bf16 outputs are rounded once (the Triton interpreter rounds toward zero: up to 1 ulp)
    return LOGPROB_GRAD_REL.for_dtype(dtype)


# --------------------------------------------------------------------------- matmul


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_matches_fp64_and_is_row_invariant(backend, dtype):
    a = _randn(70, 48, dtype=dtype)
    w = _randn(40, 48, dtype=dtype, seed=1)
    bias = _randn(40, dtype=dtype, seed=2)
    with batch_invariant(backend=backend):
        out = M.matmul(a, w.t(), bias)
        alone = [M.matmul(a[i : i + 1], w.t(), bias) for i in (0, 33, 69)]
        shifted = M.matmul(torch.cat([a[5:9], a]), w.t(), bias)[4:]
        scaled = M.matmul(a, w.t(), bias, alpha=0.5, beta=2.0)
    exact = a.double() @ w.double().t() + bias.double()
    assert out.dtype == dtype
    assert relative_error(out, exact) < _rel_bound(dtype)
    assert relative_error(scaled, 0.5 * (a.double() @ w.double().t()) + 2 * bias.double()) < _rel_bound(dtype)
    for i, row in zip((0, 33, 69), alone):
        assert torch.equal(row, out[i : i + 1])
    assert torch.equal(shifted, out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_aten_overrides_route_linear_bmm_and_patch_conv(backend):
    x = _randn(2, 9, 24)
    lin = torch.nn.Linear(24, 20)
    b1, b2 = _randn(3, 5, 7, seed=3), _randn(3, 7, 6, seed=4)
    conv = torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4), bias=False)
    patches = _randn(11, 3, 2, 4, 4, seed=5)
    with torch.no_grad():
        expect = (lin(x), torch.bmm(b1, b2), conv(patches))
        with batch_invariant(backend=backend):
            got = (lin(x), torch.bmm(b1, b2), conv(patches))
            assert torch.equal(lin(x[:1, 3:4]), got[0][:1, 3:4])  # one token alone
            with pytest.raises(NotImplementedError, match="patch embedding"):
                torch.nn.functional.conv2d(_randn(1, 3, 8, 8), _randn(4, 3, 3, 3))
    for g, e in zip(got, expect):
        assert g.shape == e.shape and relative_error(g, e) < 1e-5


def test_matmul_rejects_mismatched_operands():
    with pytest.raises(ValueError, match="one dtype"):
        M.matmul(_randn(3, 4), _randn(4, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cannot be multiplied"):
        M.matmul(_randn(3, 4), _randn(5, 5))


# --------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_transformers_and_is_row_invariant(backend, dtype):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    norm = Qwen2_5_VLRMSNorm(40, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(40, seed=7).to(dtype))
        x = _randn(3, 11, 40, dtype=dtype)
        expect = norm(x)
        with batch_invariant(backend=backend):
            got = norm(x)
            one = norm(x[1:2, 4:5])
    assert got.dtype == expect.dtype
    assert relative_error(got, expect) < _rel_bound(dtype)
    assert torch.equal(one[0, 0], got[1, 4])


# --------------------------------------------------------------------------- attention


def _sdpa_oracle(q, k, v, causal):
    """fp64 attention of one sequence: q [Lq, Hq, D], k/v [Lk, Hkv, D], bottom-right causal."""
    group = q.shape[1] // k.shape[1]
    qq, kk, vv = (t.double().transpose(0, 1) for t in (q, k, v))
    kk, vv = kk.repeat_interleave(group, 0), vv.repeat_interleave(group, 0)
    mask = None
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask).transpose(0, 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_attention_matches_sdpa_and_ignores_neighbours(backend, dtype, causal):
    lens = [37, 5, 70]
    total = sum(lens)
    q, k, v = (_randn(total, h, 16, dtype=dtype, seed=s) for s, h in ((0, 4), (1, 2), (2, 2)))
    cu = torch.tensor([0, 37, 42, 112], dtype=torch.int32)
    with batch_invariant(backend=backend):
        out = A.varlen_attention(q, k, v, cu, causal=causal)
        alone = A.varlen_attention(q[42:], k[42:], v[42:], torch.tensor([0, 70], dtype=torch.int32), causal=causal)
        reordered = A.varlen_attention(torch.cat([q[42:], q[:42]]), torch.cat([k[42:], k[:42]]), torch.cat([v[42:], v[:42]]),
                                       torch.tensor([0, 70, 107, 112], dtype=torch.int32), causal=causal)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert relative_error(out[s:e], _sdpa_oracle(q[s:e], k[s:e], v[s:e], causal)) < _rel_bound(dtype)
    assert torch.equal(alone, out[42:])
    assert torch.equal(reordered[:70], out[42:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_cached_queries_equal_the_full_prefill(backend):
    """Queries of a response scored against a cached prompt (q_len < k_len) are bitwise the
    last rows of the one-pass prefill."""
    q, k, v = (_randn(1, h, 50, 16, seed=s) for s, h in ((0, 4), (1, 2), (2, 2)))
    full_mask = torch.ones(1, 1, 50, 50, dtype=torch.bool).tril()
    with batch_invariant(backend=backend):
        full, _ = A.attention_interface(None, q, k, v, full_mask)
        tail, _ = A.attention_interface(None, q[:, :, 41:], k, v, full_mask[:, :, 41:])
    assert torch.equal(tail, full[:, 41:])


def test_segments_from_mask_padding_packing_and_errors():
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    right = causal.clone()
    right[:, 4:] = False  # sample of 4 tokens, right-padded to 6
    left = torch.zeros(6, 6, dtype=torch.bool)
    left[2:, 2:] = causal[:4, :4]  # 4 tokens, left-padded
    packed = torch.zeros(6, 6, dtype=torch.bool)
    packed[:2, :2], packed[2:, 2:] = causal[:2, :2], causal[:4, :4]
    mask = torch.stack([right, left, packed])[:, None]
    segs, max_q, is_causal = A.segments_from_mask(mask, 3, 6, 6)
    assert is_causal and max_q == 4
    assert [t.tolist() for t in segs] == [[0, 1, 2, 2], [0, 2, 0, 2], [4, 4, 2, 4], [0, 2, 0, 2], [4, 4, 2, 4]]
    holes = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    holes[0, 0, 2, 1] = False
    with pytest.raises(NotImplementedError, match=r"batch 0, query 2\) attends a non-contiguous key set"):
        A.segments_from_mask(holes, 1, 3, 3)


def test_attention_interface_rejects_unsupported_options():
    q = _randn(1, 2, 4, 16)
    with batch_invariant(backend="torch"):
        with pytest.raises(NotImplementedError, match="dropout"):
            A.attention_interface(None, q, q, q, None, dropout=0.1)
        with pytest.raises(NotImplementedError, match="sliding_window"):
            A.attention_interface(None, q, q, q, None, sliding_window=2)


def test_custom_ops_trace_under_torch_compile():
    x, w = _randn(5, 16), _randn(16, seed=1)
    q, k = _randn(1, 4, 9, 16, seed=2), _randn(1, 2, 9, 16, seed=3)
    segs = tuple(torch.tensor([v], dtype=torch.int32) for v in (0, 0, 9, 0, 9))
    with batch_invariant(backend="torch"):
        norm = torch.compile(lambda x, w: N.rms_norm(x, w, 1e-6), backend="eager", fullgraph=True)
        attn = torch.compile(lambda q, k: A.segment_attention(q, k, k, segs, causal=True, scale=0.25, max_q=9),
                             backend="eager", fullgraph=True)
        assert torch.equal(norm(x, w), N.rms_norm(x, w, 1e-6))
        assert torch.equal(attn(q, k), A.segment_attention(q, k, k, segs, causal=True, scale=0.25, max_q=9))


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernels_match_the_torch_references(dtype):
    from rlk_mm.ops._triton import attention as TA
    from rlk_mm.ops._triton import matmul as TM
    from rlk_mm.ops._triton import rmsnorm as TR

    a, w, bias = _randn(33, 40, dtype=dtype), _randn(24, 40, dtype=dtype, seed=1), _randn(24, dtype=dtype, seed=2)
    assert relative_error(TM.bmm(a[None], w.t()[None], bias[None, None])[0], R.matmul(a, w.t(), bias)) < _rel_bound(dtype)
    x, g = _randn(9, 40, dtype=dtype, seed=3), _randn(40, dtype=dtype, seed=4)
    assert relative_error(TR.rms_norm(x, g, 1e-6), R.rms_norm(x, g, 1e-6)) < _rel_bound(dtype)
    q, k, v = (_randn(2, h, 30, 16, dtype=dtype, seed=s) for s, h in ((5, 4), (6, 2), (7, 2)))
    segs = [torch.tensor(t, dtype=torch.int32) for t in ([0, 1, 1], [0, 0, 12], [30, 12, 18], [0, 0, 12], [30, 12, 18])]
    got = TA.segment_attention(q, k, v, segs, causal=True, scale=0.25, max_q=30)
    assert relative_error(got, R.segment_attention(q, k, v, segs, causal=True, scale=0.25)) < _rel_bound(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_input_linears_are_bitwise_one_launch_each(dtype):
    from rlk_mm.ops._triton import matmul as TM

    widths = (64, 64, 96) if dtype == torch.float32 else (256, 256, 512)  # one tile config per dtype
    torch.manual_seed(0)
    layers = [torch.nn.Linear(40, n, bias=bias, dtype=dtype) for n, bias in zip(widths, (True, True, True))]
    x = _randn(3, 5, 40, dtype=dtype, seed=9)
    seen = []
    layers[1].register_forward_hook(lambda module, args, out: seen.append(out))
    with torch.no_grad(), batch_invariant(backend="triton"):
        one_by_one = [layer(x) for layer in layers]
        assert TM.linears(x.reshape(-1, 40), [l.weight for l in layers], [l.bias for l in layers]) is not None
        together = M.shared_input_linears(x, layers)
        for a, b in zip(together, one_by_one):
            assert a.shape == b.shape and torch.equal(a, b)
        two = M.shared_input_linears(x, layers[:2])
        assert all(torch.equal(a, b) for a, b in zip(two, one_by_one))
        # tiles that differ (a 32-wide weight next to a 64-wide one): no single launch, same values
        narrow = torch.nn.Linear(40, 32 if dtype == torch.float32 else 128, dtype=dtype)
        assert TM.linears(x.reshape(-1, 40), [layers[0].weight, narrow.weight], [layers[0].bias, narrow.bias]) is None
        assert torch.equal(M.shared_input_linears(x, [layers[0], narrow])[1], narrow(x))
    assert len(seen) == 1  # shared_input_linears itself runs no module hooks
    with batch_invariant(backend="triton"):  # with autograd: one by one, gradients flow
        out = M.shared_input_linears(x, layers)
        out[0].float().sum().backward()
    assert layers[0].weight.grad is not None and torch.equal(out[0].detach(), one_by_one[0])


# --------------------------------------------------------------------------- the context manager


def _dispatch_state():
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    return (
        [torch._C._dispatch_dump(f"aten::{op}") for op in M.ATEN_OVERRIDES],
        dict(AttentionInterface._global_mapping),
        dict(AttentionMaskInterface._global_mapping),
        m.Qwen2_5_VLRMSNorm.__dict__["forward"],
        m.Qwen2_5_VLVisionAttention.__dict__["forward"],
        m.Qwen2_5_VLAttention.__dict__["forward"],
        m.Qwen2MLP.__dict__["forward"],
        m.Qwen2_5_VLMLP.__dict__["forward"],
    )


def test_batch_invariant_restores_everything_exactly():
    a, b = _randn(1, 64), _randn(64, 33, seed=1)
    before_state, before_out = _dispatch_state(), a @ b
    with batch_invariant(backend="torch"):
        inside = _dispatch_state()
        with pytest.raises(RuntimeError, match="not re-entrant"):
            with batch_invariant():
                pass
    assert inside[0] != before_state[0] and inside[3] is not before_state[3]
    assert _dispatch_state() == before_state
    assert torch.equal(a @ b, before_out)
    with pytest.raises(KeyError):  # an error inside the block restores too
        with batch_invariant(backend="torch"):
            raise KeyError("boom")
    assert _dispatch_state() == before_state
    with pytest.raises(ValueError, match="backend must be"):
        with batch_invariant(backend="cuda"):
            pass


def _group_batch(processor, samples, responses, group_ids):
    out = fixtures.processor_inputs(processor, samples, padding_side="left")
    return RLBatch.from_qwen_vl(out, processor=processor, responses=responses, group_ids=group_ids)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_under_the_mode_are_within_the_contract_and_keep_the_forward_bits(processor, dtype):
    """Only the forward is pinned: the backward takes stock kernels (cuBLAS/MKL products, fused
    SDPA backward), so a training step's gradients under the mode are within the numerical
    contract of default-kernel gradients, and the forward's bits are those of a no-grad
    forward (whatever the layout)."""
    model = fixtures.tiny_qwen2_5_vl(seed=0).eval().to(dtype)
    samples = fixtures.synthetic_image_text(2, seed=5, max_images=2)
    batch = _group_batch(processor, samples, [[11, 12, 13, 151645], [14, 15, 151645]], None)

    def step(ctx, padding):
        model.zero_grad()
        with ctx:
            lp = batch_logprobs(model, batch, padding=padding)
            lp.sum().backward()
        return lp.detach(), torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])

    _, expect = step(contextlib.nullcontext(), "right")
    with torch.no_grad(), batch_invariant(backend="torch"):
        forward_only = batch_logprobs(model, batch)
    for padding in (None, "left", "right"):
        lp, got = step(batch_invariant(backend="torch"), padding)
        assert torch.equal(lp, forward_only), padding
        assert relative_error(got, expect) < LOGPROB_GRAD_REL.for_dtype(dtype), padding


def test_backward_products_take_the_stock_kernels():
    """Inside the mode a product the autograd engine issues in a backward, or one inside
    stock_kernels(), is the stock one (bitwise the product outside the mode)."""
    a, w = _randn(5, 24, requires_grad=True), _randn(24, 12, seed=1, requires_grad=True)
    grad = _randn(5, 12, seed=2)
    seen = []

    def probe(g):
        seen.append(M.in_backward())
        return g

    with batch_invariant(backend="torch"):
        assert batch_invariant_active() and not M.in_backward()
        out = a @ w
        out.register_hook(probe)
        out.backward(grad)
        with stock_kernels(), stock_kernels():
            stock = a.detach() @ w.detach()
        assert torch.equal(out.detach(), M.matmul(a.detach(), w.detach()))
    assert not batch_invariant_active() and seen == [True]
    assert torch.equal(stock, a.detach() @ w.detach())
    assert torch.equal(a.grad, grad @ w.detach().t()) and torch.equal(w.grad, a.detach().t() @ grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_direct_matmul_is_differentiable_with_the_forward_bits(dtype):
    a, w, bias = (_randn(*s, dtype=dtype, seed=i).requires_grad_() for i, s in enumerate([(9, 20), (20, 7), (7,)]))
    grad = _randn(9, 7, dtype=dtype, seed=5)
    with batch_invariant(backend="torch"):
        out = M.matmul(a, w, bias, alpha=0.5, beta=2.0)
        with torch.no_grad():
            plain = M.matmul(a, w, bias, alpha=0.5, beta=2.0)
    out.backward(grad)
    assert torch.equal(out.detach(), plain)
    g = grad.double()
    for got, exact in ((a.grad, 0.5 * g @ w.detach().double().t()), (w.grad, 0.5 * a.detach().double().t() @ g),
                       (bias.grad, 2.0 * g.sum(0))):
        assert relative_error(got, exact) < _rel_bound(dtype)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_attention_backward_matches_the_reference(causal, dtype):
    """The SDPA-bucketed backward against the per-segment fp32 reference and fp64 autograd:
    segments of different lengths, a KV-cache segment (fewer queries than keys), an empty one,
    grouped-query heads."""
    q, k, v = (_randn(2, h, 40, 16, dtype=dtype, seed=s) for s, h in ((0, 4), (1, 2), (2, 2)))
    grad = _randn(2, 40, 4, 16, dtype=dtype, seed=3)
    # (batch row, query start, query count, key start, key count)
    rows = [(0, 0, 17, 0, 17), (0, 37, 3, 20, 20), (1, 0, 0, 0, 0), (1, 3, 30, 3, 30)]
    segments = [torch.tensor(field) for field in zip(*rows)]
    fused = R.segment_attention_backward(q, k, v, grad, segments, causal=causal, scale=0.25)
    ref = R.segment_attention_backward_reference(q, k, v, grad, segments, causal=causal, scale=0.25)
    exact = _attention_grads_fp64(q, k, v, grad, segments, causal)
    for f, r, e in zip(fused, ref, exact):
        assert f.dtype == dtype
        assert relative_error(f, e) < _rel_bound(dtype) and relative_error(r, e) < _rel_bound(dtype)


def _attention_grads_fp64(q, k, v, grad, segments, causal):
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    total = 0
    for b, q0, ql, k0, kl in zip(*(s.tolist() for s in segments)):
        if ql == 0:
            continue
        qs = leaves[0][b, :, q0 : q0 + ql].transpose(0, 1)
        ks, vs = (t[b, :, k0 : k0 + kl].transpose(0, 1) for t in leaves[1:])
        out = _sdpa_oracle(qs, ks, vs, causal)  # [ql, H, D]
        total = total + (out * grad[b, q0 : q0 + ql].double()).sum()
    return torch.autograd.grad(total, leaves)


def test_gather_backward_sums_users_in_item_order():
    table = _randn(3, 4).requires_grad_()
    index = torch.tensor([0, 1, 2, 0, 1, 0])
    ranks = [(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2])), (torch.tensor([0, 1]), torch.tensor([3, 4])),
             (torch.tensor([0]), torch.tensor([5]))]
    out = _GatherRows.apply(table, index, ranks)
    assert torch.equal(out, table.detach()[index])
    grad = _randn(6, 4, seed=9)
    out.backward(grad)
    assert torch.equal(table.grad[0], (grad[0] + grad[3]) + grad[5])
    assert torch.equal(table.grad[1], grad[1] + grad[4])
    assert torch.equal(table.grad[2], grad[2])


def test_vision_cache_encodes_each_key_once_and_keeps_gradients(tiny_model, processor):
    model = tiny_model
    sample = fixtures.synthetic_image_text(1, seed=2, max_images=2)[0]
    batch = _group_batch(processor, [sample] * 3, [[5, 151645], [6, 7, 151645], [8, 151645]], ["g"] * 3)
    cache = VisionCache(model)
    with batch_invariant(backend="torch"):
        rows = cache(batch)
        direct = model.model.visual(batch.pixel_values, grid_thw=batch.image_grid_thw).pooler_output
    assert cache.items_encoded == len(sample.images) and cache.items_requested == 3 * len(sample.images)
    assert torch.equal(rows, direct)  # bitwise: the tower's rows of an item do not depend on the others
    weight = model.model.visual.merger.mlp[2].weight
    (g1,) = torch.autograd.grad((rows * _randn(*rows.shape, seed=1)).sum(), weight)
    (g2,) = torch.autograd.grad((direct * _randn(*rows.shape, seed=1)).sum(), weight)
    assert relative_error(g1, g2) < 1e-5
    with torch.no_grad():
        kept = VisionCache(model, keep=True)
        kept(batch)
        kept(batch)
    assert kept.items_encoded == len(sample.images)
    with pytest.raises(RuntimeError, match="no_grad"):
        VisionCache(model, keep=True)(batch)


def test_group_logprobs_requires_a_shared_prompt(tiny_model, processor):
    model = tiny_model
    samples = fixtures.synthetic_image_text(2, seed=4, max_images=1)
    # refused by group_logprobs, or already by the batch's own group check where it has one
    with pytest.raises(ValueError, match="group 'g'.*sample 1 does not share sample 0's prompt|sample 1 is in group 'g'"):
        group_logprobs(model, _group_batch(processor, samples, [[5, 151645], [6, 151645]], ["g", "g"]))


@pytest.mark.gpu
def test_gpu_kernels_are_row_invariant_and_accurate():
    """On the GPU: a K whose row stride is not 16-byte aligned (Qwen2.5-VL's vision MLP,
    K = 3420) goes through the K-padded path; rows alone / shifted are bitwise; attention
    of a sequence alone equals it inside a pack."""
    a, w = _randn(3000, 3420, dtype=torch.bfloat16).cuda(), _randn(1280, 3420, dtype=torch.bfloat16, seed=1).cuda()
    with batch_invariant():
        out = M.matmul(a, w.t())
        one = M.matmul(a[7:8], w.t())
        shifted = M.matmul(torch.cat([a[:5], a[:200]]), w.t())[5:]
        q, k, v = (_randn(900, h, 128, dtype=torch.bfloat16, seed=s).cuda() for s, h in ((0, 16), (1, 2), (2, 2)))
        cu = torch.tensor([0, 300, 900], dtype=torch.int32, device="cuda")
        packed = A.varlen_attention(q, k, v, cu)
        alone = A.varlen_attention(q[300:], k[300:], v[300:], torch.tensor([0, 600], dtype=torch.int32, device="cuda"))
    assert relative_error(out, a.double() @ w.double().t()) < _rel_bound(torch.bfloat16)
    assert torch.equal(one, out[7:8]) and torch.equal(shifted, out[:200])
    assert torch.equal(alone, packed[300:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_lm_head_ops_give_the_same_bits_inside_and_outside_the_mode(backend, monkeypatch):
    """selected_logprob, linear_policy_loss and sample_from_hidden fix their own product order:
    called inside batch_invariant() without stock_kernels() (as TRL's or a user's loss calls
    them), they give the bits of the same call outside the mode (log-probs, loss, gradients,
    draws)."""
    from rlk_mm.ops import linear_policy_loss, sample_from_hidden, selected_logprob

    monkeypatch.setenv("RLK_MM_BACKEND", backend)
    hidden, weight = _randn(40, 96, scale=2.0), _randn(300, 96, seed=1, scale=0.3)
    index, targets = torch.arange(3, 40, 2), torch.randint(0, 300, (19,), generator=torch.Generator().manual_seed(2))
    advantages = _randn(19, seed=3)

    def run():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp = selected_logprob(h, w, index=index, targets=targets, temperature=0.7)
        logp.sum().backward()
        h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = linear_policy_loss(h2, w2, index=index, targets=targets, temperature=0.7, advantages=advantages,
                                 old_log_probs=None, sample_index=torch.zeros(19, dtype=torch.long), num_samples=1)
        out.loss.backward()
        draw = sample_from_hidden(hidden, weight, temperature=0.7, seeds=torch.arange(40), step=3)
        return [logp.detach(), h.grad, w.grad, out.loss.detach(), out.log_probs, h2.grad, w2.grad, draw.tokens,
                draw.log_probs]

    outside = run()
    with batch_invariant(backend=backend):
        inside = run()
    for i, (a, b) in enumerate(zip(outside, inside)):
        assert torch.equal(a, b), i
