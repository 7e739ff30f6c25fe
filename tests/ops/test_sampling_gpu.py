"""GPU checks of rollout sampling at the Qwen2.5-VL vocabulary (V = 152,064): the Triton
kernels' bitwise batch invariance, their agreement with the torch backend on the CPU (same
seeds), ``sample_from_hidden``'s log-probs equal to ``selected_logprob``'s under
``batch_invariant()``, and the FlashInfer backend where FlashInfer is installed (its batch
invariance measured and printed). Run on the GPU machine: ``pytest -m gpu tests/ops/test_sampling_gpu.py -s``."""

import pytest
import torch

from rlk_mm.ops import batch_invariant, group_seeds, sample, sample_from_hidden, selected_logprob

pytestmark = pytest.mark.gpu  # without CUDA: fails at setup with a clear message (conftest.py)

V = 152064
FILTERS = [{"temperature": 0.8}, {"temperature": 0.8, "top_k": 50, "top_p": 0.9}, {"top_p": 0.95}, {"min_p": 0.05}]


def _logits(B, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(B, V, device="cuda", generator=g) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", FILTERS, ids=str)
def test_triton_batch_invariance_bitwise_gpu(dtype, kw):
    logits = _logits(100, dtype)
    seeds = group_seeds(0, [i // 4 for i in range(100)], 0).cuda()
    r = 37
    alone = sample(logits[r : r + 1], seeds=seeds[r : r + 1], step=3, **kw)
    in_64 = sample(logits[:64], seeds=seeds[:64], step=3, **kw)
    order = torch.arange(99, -1, -1, device="cuda")
    moved = sample(logits[order], seeds=seeds[order], step=3, **kw)
    for name, res, at in (("in 64", in_64, r), ("reversed, B=100", moved, 99 - r)):
        for field, a, b in zip(alone._fields, alone, res):
            assert torch.equal(a[0], b[at]), (name, field, kw)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("kw", FILTERS, ids=str)
def test_triton_agrees_with_the_cpu_backend(kw, ties):
    """``ties``: bf16-rounded logits, so top-k's boundary value often repeats across vocabulary
    blocks (the Triton kernel then takes its bisection)."""
    logits = _logits(64, seed=1)
    if ties:
        logits = logits.bfloat16().float()
    seeds = group_seeds(1, [i // 8 for i in range(64)], 0)
    gpu = sample(logits, seeds=seeds.cuda(), step=2, backend="triton", **kw)
    cpu = sample(logits.cpu(), seeds=seeds, step=2, backend="torch", **kw)
    same = (gpu.tokens.cpu() == cpu.tokens).double().mean().item()
    lp_same = (gpu.log_probs.cpu() == cpu.log_probs).double().mean().item()
    print(f"{kw}: tokens equal {same:.4f}, log_probs bitwise equal {lp_same:.4f}")
    assert same >= 0.98, same  # bench_sampling.py measures the rate over more draws
    agree = gpu.tokens.cpu() == cpu.tokens
    torch.testing.assert_close(gpu.log_probs.cpu()[agree], cpu.log_probs[agree], rtol=0, atol=2e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("kw", [{}, {"top_k": 50, "top_p": 0.9}], ids=str)
def test_from_hidden_log_probs_equal_selected_logprob_gpu(temperature, kw):
    g = torch.Generator(device="cuda").manual_seed(2)
    B, H = 96, 1024
    h = torch.randn(B, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.05).bfloat16()
    seeds = torch.arange(B, device="cuda")
    with batch_invariant():
        out = sample_from_hidden(h, w, temperature=temperature, seeds=seeds, **kw)
        train = selected_logprob(h, w, index=torch.arange(B, device="cuda"), targets=out.tokens,
                                 temperature=temperature)
        part = sample_from_hidden(h[[5, 70]], w, temperature=temperature, seeds=seeds[[5, 70]], **kw)
    assert torch.equal(out.log_probs, train)
    assert all(torch.equal(a[[5, 70]], b) for a, b in zip(out, part))


def test_flashinfer_backend_where_installed():
    pytest.importorskip("flashinfer", reason="FlashInfer not installed (pip install rlk-mm[gpu])")
    logits = _logits(128, seed=3)
    seeds = torch.arange(128, device="cuda")
    kw = dict(temperature=0.8, top_k=50, top_p=0.9, backend="flashinfer")
    a = sample(logits, seeds=seeds, **kw)
    b = sample(logits, seeds=seeds, **kw)
    assert torch.equal(a.tokens, b.tokens)  # the same batch and seeds: the same tokens
    assert bool(torch.isfinite(a.log_probs).all())
    kept = torch.isfinite(a.sampled_log_probs).double().mean().item()
    half = sample(logits[:64], seeds=seeds[:64], **kw)
    invariant = (half.tokens == a.tokens[:64]).double().mean().item()
    print(f"flashinfer: tokens kept by rlk_mm's filters {kept:.4f}; "
          f"rows unchanged when the batch halves {invariant:.4f}")
    assert kept >= 0.99


@pytest.mark.parametrize("kw", [{}, *FILTERS], ids=str)
def test_default_path_has_no_host_sync(kw):
    """``sample``'s default path reads nothing back (torch's sync debug mode raises on a sync)."""
    logits = _logits(64, seed=5)
    seeds = torch.arange(64, device="cuda")
    step = torch.tensor(3, device="cuda")
    sample(logits, seeds=seeds, step=step, **kw)  # compiled before the check
    sample(logits, seeds=seeds, step=3, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits, seeds=seeds, step=step, **kw)
        sample(logits, seeds=seeds, step=3, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("kw", [{"temperature": 0.8}, {"temperature": 0.8, "top_k": 50, "top_p": 0.9}, {"top_p": 0.95}],
                         ids=str)
def test_sample_replays_in_a_cuda_graph(kw):
    """Captured once with static logits and a step tensor; replayed with new logits and a new
    step, the graph draws what eager calls draw."""
    B = 64
    static = _logits(B, seed=6)
    seeds = group_seeds(0, [i // 4 for i in range(B)], 0).cuda()
    step = torch.zeros((), dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile, warm the allocator
            sample(static, seeds=seeds, step=step, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample(static, seeds=seeds, step=step, **kw)
    for i in range(3):
        static.copy_(_logits(B, seed=10 + i))
        step.fill_(5 + i)
        graph.replay()
        eager = sample(static, seeds=seeds, step=5 + i, **kw)
        for field, a, b in zip(eager._fields, out, eager):
            assert torch.equal(a, b), (i, field, kw)
    assert not torch.equal(out.tokens, sample(static, seeds=seeds, step=0, **kw).tokens)  # the step moved


def test_sample_from_hidden_plain_has_no_host_sync():
    g = torch.Generator(device="cuda").manual_seed(7)
    h = torch.randn(64, 1024, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, 1024, device="cuda", generator=g) * 0.05).bfloat16()
    seeds = torch.arange(64, device="cuda")
    step = torch.tensor(1, device="cuda")
    sample_from_hidden(h, w, temperature=0.8, seeds=seeds, step=step)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample_from_hidden(h, w, temperature=0.8, seeds=seeds, step=step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
