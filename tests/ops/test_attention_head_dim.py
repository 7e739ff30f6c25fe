"""The invariant attention's head dim: up to 256 it runs (Qwen3.5's full-attention layers use
256), bitwise batch-invariant and within the contract of an fp64 reference, on both backends;
above it both backends refuse before any work; the Triton tiles of every supported head dim
fit Hopper's shared memory."""

import json
import os
import subprocess
import sys

import pytest
import torch
import triton

from rlk_mm.ops import batch_invariant
from rlk_mm.ops._triton import attention as triton_attention
from rlk_mm.ops._triton._common import dot_precision
from rlk_mm.ops._triton.attention import SHARED_MEMORY_LIMIT, default_config, shared_memory_bytes
from rlk_mm.ops.invariant.attention import MAX_HEAD_DIM, attention_interface, segment_attention, varlen_attention
from rlk_mm.parity.contract import LOGPROB_GRAD_REL, LOGPROB_MAX_ABS, relative_error

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
@pytest.mark.parametrize(("head_dim", "dtype"), [(80, torch.float32), (192, torch.float32), (256, torch.float32),
                                                 (256, torch.bfloat16)])
def test_wide_heads_run_exact_and_batch_invariant(backend, head_dim, dtype):
    q, k, v, cu = _packed(head_dim, dtype=dtype)
    with batch_invariant(backend=backend):
        packed = varlen_attention(q, k, v, cu, causal=True)
        alone = varlen_attention(q[5:8], k[5:8], v[5:8], torch.tensor([0, 3], dtype=torch.int32), causal=True)
    assert packed.dtype == dtype
    assert torch.equal(alone, packed[5:8])
    reference = _reference(q, k, v, cu)
    if dtype == torch.float32:
        assert (packed.double() - reference).abs().max() <= LOGPROB_MAX_ABS.fp32
    else:  # the output is rounded to bf16 once: a relative bound, as tests/ops/test_batch_invariant.py's
        assert relative_error(packed, reference) <= LOGPROB_GRAD_REL.low_precision


def _through_varlen(q, k, v):
    return varlen_attention(q, k, v, torch.tensor([0, q.shape[0]], dtype=torch.int32))


def _through_segments(q, k, v):
    rows = [torch.tensor([x], dtype=torch.int32) for x in (0, 0, q.shape[0], 0, q.shape[0])]
    return segment_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), rows, causal=True, scale=1.0,
                             max_q=q.shape[0])


def _through_transformers(q, k, v):
    return attention_interface(None, *(t.transpose(0, 1)[None] for t in (q, k, v)), None)


REFUSED = [(257, "above the largest the invariant attention runs, 256 "), (320, "above the largest"),
           (512, "above the largest"), (0, "no features")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", [_through_varlen, _through_segments, _through_transformers], ids=lambda f: f.__name__)
@pytest.mark.parametrize(("head_dim", "why"), REFUSED)
def test_unsupported_head_dims_are_refused_on_every_backend_and_entry(backend, entry, head_dim, why):
    q, k, v, _ = _packed(head_dim, lengths=(2,), heads=1)
    message = rf"^batch_invariant\(\): attention head_dim {head_dim}\b.*{why}.*head dims 1 to 256 are supported"
    with batch_invariant(backend=backend), pytest.raises(ValueError, match=message):
        entry(q, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_supported_head_dim_fits_hopper_shared_memory(dtype):
    """Every head dim 1..256 (powers of two or not: 80, 96, 112, 192 ...), by the kernel's estimate."""
    needs = {d: shared_memory_bytes(default_config(d, dtype), dtype) for d in range(1, MAX_HEAD_DIM + 1)}
    assert MAX_HEAD_DIM == 256
    assert max(needs.values()) <= SHARED_MEMORY_LIMIT
    assert needs[256] == (163840 if dtype != torch.float32 else 167936)


def test_the_estimate_is_what_triton_reported_at_head_dim_512():
    """Triton's "out of resource: shared memory, Required: 458752" on an H200 at bf16, head dim 512
    (the three-stage tiles the kernel had then; head dims above 128 now take two stages)."""
    config = default_config(128, torch.bfloat16)
    assert config.num_stages == 3
    wide = type(config)(config.block_m, config.block_n, 512, config.num_warps, config.num_stages)
    assert shared_memory_bytes(wide, torch.bfloat16) == 458752


HOPPER_CASES = [(16, "float32"), (256, "float32"), (128, "bfloat16"), (256, "float16")]


def _hopper_shared_memory(head_dim: int, dtype: torch.dtype, tokens: int = 470, heads: int = 4) -> int:
    """Shared memory Triton itself allocates for the kernel compiled for sm_90 (no GPU needed: the
    compiler runs here), specialised as a ``varlen_attention`` launch is: pointers and the strides
    that are multiples of 16 marked so (which lets the loads pipeline), unit strides constant.
    Runs only where TRITON_INTERPRET is off (``_allocations`` starts a process for it)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, config = triton_attention._attention_kernel, default_config(head_dim, dtype)
    qkv_strides = (tokens * heads * head_dim, head_dim, heads * head_dim, 1)
    out_strides = (tokens * heads * head_dim, heads * head_dim, head_dim, 1)
    ints = {f"s_{t}{x}": n for t in "qkv" for x, n in zip(("b", "h", "m" if t == "q" else "n", "d"), qkv_strides)}
    ints |= {f"s_o{x}": n for x, n in zip("bmhd", out_strides)} | {"group": 1, "D": head_dim}
    constants = {"CAUSAL": True, "UPCAST": False, "PRECISION": dot_precision(dtype, False),
                 "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_D": config.block_d}
    element = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = f"*{element}" if name[0] in "qkvo" else "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "max_q"):
            signature[name] = "fp32" if name == "qk_scale" else "i32"
        elif ints[name] == 1:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.metadata.shared


@pytest.fixture(scope="module")
def hopper_allocations():
    """``_hopper_shared_memory`` of every case, from a process without TRITON_INTERPRET (under the
    interpreter, ``triton.jit`` gives interpreted functions, which the compiler cannot take)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import json, sys, torch; sys.path.insert(0, {here!r}); import test_attention_head_dim as t; "
            "print(json.dumps([t._hopper_shared_memory(d, getattr(torch, n)) for d, n in t.HOPPER_CASES]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(HOPPER_CASES, json.loads(done.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize("case", HOPPER_CASES)
def test_the_estimate_bounds_what_triton_allocates_for_hopper(hopper_allocations, case):
    """The estimate is no guess: Triton's own allocation for sm_90 is at most it (equal to it for
    16-bit inputs, whose loads pipeline at these head dims), so the table above proves the fit."""
    head_dim, dtype = case[0], getattr(torch, case[1])
    estimate = shared_memory_bytes(default_config(head_dim, dtype), dtype)
    assert hopper_allocations[case] <= estimate <= SHARED_MEMORY_LIMIT
    if dtype != torch.float32:
        assert hopper_allocations[case] == estimate


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [192, 256])
def test_wide_heads_on_cuda_are_batch_invariant_and_512_is_refused(head_dim, dtype):
    """At a real shape on the GPU (the compiled kernel, its Hopper tiles): the last of three packed
    sequences equals it alone, bitwise; within the contract of fp64; head dim 512 refused by name."""
    q, k, v, cu = (t.cuda() for t in _packed(head_dim, lengths=(300, 300, 170), heads=4, dtype=dtype))
    with batch_invariant(backend="triton"):
        packed = varlen_attention(q, k, v, cu, causal=True)
        alone = varlen_attention(q[600:], k[600:], v[600:], torch.tensor([0, 170], dtype=torch.int32, device="cuda"))
        with pytest.raises(ValueError, match="head_dim 512 is above the largest"):
            varlen_attention(*(torch.zeros(4, 1, 512, device="cuda", dtype=dtype) for _ in range(3)),
                             torch.tensor([0, 4], dtype=torch.int32, device="cuda"))
    assert torch.equal(alone, packed[600:])
    reference = _reference(q.cpu(), k.cpu(), v.cpu(), cu.cpu())
    if dtype == torch.float32:
        assert (packed.cpu().double() - reference).abs().max() <= LOGPROB_MAX_ABS.fp32
    else:
        assert relative_error(packed.cpu(), reference) <= LOGPROB_GRAD_REL.low_precision


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_stages_give_the_bits_of_three_at_head_dim_256(dtype):
    """The stage count only schedules the loads: at head dim 256 the two-stage tiles the kernel now
    takes give bitwise what three stages (which also fit, barely) give."""
    q, k, v = (torch.randn(1, 4, 700, 256, generator=torch.Generator().manual_seed(i)).to("cuda", dtype) for i in range(3))
    segments = [torch.tensor([x], dtype=torch.int32, device="cuda") for x in (0, 0, 700, 0, 700)]
    two = default_config(256, dtype)
    three = type(two)(two.block_m, two.block_n, two.block_d, two.num_warps, 3)
    assert two.num_stages == 2
    outs = [triton_attention.segment_attention(q, k, v, segments, causal=True, scale=256 ** -0.5, max_q=700, config=c)
            for c in (two, three)]
    assert torch.equal(*outs)
