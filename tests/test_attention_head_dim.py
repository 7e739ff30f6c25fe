"""The invariant attention's head dim: up to 256 it runs (Qwen3.5's full-attention layers use
256), bitwise batch-invariant and within the contract of an fp64 reference, on both backends;
above it both backends refuse before any work; the Triton tiles of every supported head dim
fit Hopper's shared memory."""

import pytest
import torch

from helpers import use_backend
from rlk_mm.ops._triton.attention import SHARED_MEMORY_LIMIT, default_config, shared_memory_bytes
from rlk_mm.ops.invariant.attention import MAX_HEAD_DIM, varlen_attention
from rlk_mm.parity.contract import LOGPROB_MAX_ABS

pytestmark = pytest.mark.usefixtures("one_thread")

BACKENDS = ["torch", "triton"]


def _packed(head_dim: int, lengths=(5, 3, 7), heads=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, generator=g).to(dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def _reference(q, k, v, cu):
    """fp64 causal attention per sequence."""
    out = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qq, kk, vv = (t[a:b].double().transpose(0, 1) for t in (q, k, v))
        scores = qq @ kk.transpose(1, 2) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        out.append((scores.softmax(-1) @ vv).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [80, 192, 256])
def test_wide_heads_run_exact_and_batch_invariant(backend, head_dim):
    q, k, v, cu = _packed(head_dim)
    with use_backend(backend):
        packed = varlen_attention(q, k, v, cu, causal=True)
        alone = varlen_attention(q[5:8], k[5:8], v[5:8], torch.tensor([0, 3], dtype=torch.int32), causal=True)
    assert torch.equal(alone, packed[5:8])
    assert (packed.double() - _reference(q, k, v, cu)).abs().max() <= LOGPROB_MAX_ABS.fp32


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [257, 320, 512])
def test_head_dims_above_256_are_refused_on_every_backend(backend, head_dim):
    q, k, v, cu = _packed(head_dim, lengths=(2,), heads=1)
    with use_backend(backend), pytest.raises(ValueError, match=rf"head_dim {head_dim} is above the largest .* 256"):
        varlen_attention(q, k, v, cu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [8, 16, 32, 64, 80, 96, 112, 128, 160, 192, 256])
def test_every_supported_head_dim_fits_hopper_shared_memory(dtype, head_dim):
    assert head_dim <= MAX_HEAD_DIM
    assert shared_memory_bytes(default_config(head_dim, dtype), dtype) <= SHARED_MEMORY_LIMIT


def test_the_estimate_is_what_triton_reported_at_head_dim_512():
    """Triton's "out of resource: shared memory, Required: 458752" on an H200 at bf16, head dim 512
    (the three-stage tiles the kernel had then; head dims above 128 now take two stages)."""
    config = default_config(128, torch.bfloat16)
    assert config.num_stages == 3
    wide = type(config)(config.block_m, config.block_n, 512, config.num_warps, config.num_stages)
    assert shared_memory_bytes(wide, torch.bfloat16) == 458752


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_dim_256_on_cuda_is_batch_invariant(dtype):
    q, k, v, cu = (t.cuda() for t in _packed(256, lengths=(300, 170), heads=4, dtype=dtype))
    packed = varlen_attention(q, k, v, cu, causal=True)
    alone = varlen_attention(q[300:], k[300:], v[300:], torch.tensor([0, 170], dtype=torch.int32, device="cuda"))
    assert torch.equal(alone, packed[300:])
    with pytest.raises(ValueError, match="head_dim 512"):
        varlen_attention(*(torch.zeros(4, 1, 512, device="cuda", dtype=dtype) for _ in range(3)),
                         torch.tensor([0, 4], dtype=torch.int32, device="cuda"))
