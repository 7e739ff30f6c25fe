"""GPU checks of the Triton selected log-prob: bitwise batch invariance, the contract at a
realistic hidden size, and its host syncs. Run on the GPU machine:
``pytest -m gpu tests/ops/test_logprob_gpu.py``."""


import pytest
import torch

from rlk_mm.ops import selected_logprob
from rlk_mm.ops._torch import logprob as ref
from rlk_mm.ops._triton import logprob as triton_logprob
from rlk_mm.parity.contract import LOGPROB_GRAD_REL, LOGPROB_MAX_ABS, relative_error
from support.helpers import count_syncs

pytestmark = pytest.mark.gpu  # without CUDA: fails at setup with a clear message (conftest.py)


def _inputs(T, H, V, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.05).to(dtype)
    tg = torch.randint(0, V, (T,), device="cuda", generator=g)
    return h, w, tg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariance_bitwise_gpu(dtype):
    T, H, V = 1500, 1024, 32011  # V not a multiple of any tile
    h, w, tg = _inputs(T, H, V, dtype)
    r = 777

    def score(rows):
        rows = torch.as_tensor(rows, device="cuda")
        return selected_logprob(h, w, index=rows, targets=tg[rows], temperature=0.8, return_entropy=True)

    alone = score([r])
    others = [i for i in range(0, T, 23) if i != r][:63]
    in_64 = score(others[:40] + [r] + others[40:])
    elsewhere = score([r] + list(range(T - 1000, T)))
    everything = score(list(range(T)))
    for name, (lp, ent), at in (("in 64", in_64, 40), ("elsewhere", elsewhere, 0), ("all", everything, r)):
        assert torch.equal(lp[at : at + 1], alone[0]), f"log-prob {name}: {lp[at].item()!r} vs {alone[0].item()!r}"
        assert torch.equal(ent[at : at + 1], alone[1]), f"entropy {name}: {ent[at].item()!r} vs {alone[1].item()!r}"


# bf16 at the 7B hidden size; fp32 at H=512: an fp32 dot product over H=3584 alone is
# off by ~1e-5 at logits of a few units (any fp32 order), the whole fp32 budget
@pytest.mark.parametrize("dtype,H", [(torch.bfloat16, 3584), (torch.float32, 512)])
def test_contract_at_realistic_hidden_size_gpu(dtype, H):
    T, V = 700, 20000
    h, w, tg = _inputs(T, H, V, dtype, seed=1)
    bias = (torch.randn(V, device="cuda") * 0.1).to(dtype)
    rows = torch.randperm(T, device="cuda")[:300]
    hg, wg, bg = (t.clone().requires_grad_() for t in (h, w, bias))
    lp, ent = selected_logprob(hg, wg, index=rows, targets=tg[rows], temperature=0.6, bias=bg, return_entropy=True)
    g, ge = torch.randn(300, device="cuda"), torch.randn(300, device="cuda")
    torch.autograd.backward([lp, ent], [g, ge])
    f64 = torch.float64
    r_lp, r_ent, r_lse = ref.selected_logprob_forward(h, w, rows, tg[rows], bias, 0.6, compute_dtype=f64)
    d_h, d_w, d_b = ref.selected_logprob_backward(g, ge, h, w, rows, tg[rows], bias, r_lse, r_ent, 0.6,
                                                  compute_dtype=f64)
    tol, gtol = LOGPROB_MAX_ABS.for_dtype(dtype), LOGPROB_GRAD_REL.for_dtype(dtype)
    assert (lp.double() - r_lp).abs().max().item() <= tol
    assert (ent.double() - r_ent).abs().max().item() <= tol
    assert relative_error(hg.grad, d_h) <= gtol
    assert relative_error(wg.grad, d_w) <= gtol
    assert relative_error(bg.grad, d_b) <= gtol
    untouched = torch.ones(T, dtype=torch.bool, device="cuda")
    untouched[rows] = False
    assert hg.grad[untouched].abs().max().item() == 0


def test_gradients_deterministic_gpu():
    h, w, tg = _inputs(2000, 1024, 30000, torch.bfloat16, seed=2)
    up = torch.randn(2000, device="cuda")
    grads = []
    for _ in range(2):
        hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
        selected_logprob(hg, wg, index=torch.arange(2000, device="cuda"), targets=tg).backward(up)
        grads.append((hg.grad, wg.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("every_row,with_bias", [(True, False), (False, False), (False, True)])
def test_host_syncs_gpu(every_row, with_bias):
    """One sync in the forward (index/target ranges, the bias values and the all-rows test
    read together), through the op and through selected_logprob; none in the backward: a
    sync there would idle the GPU while the host queues work."""
    T = 1024
    h, w, tg = _inputs(T, 256, 5000, torch.bfloat16, seed=3)
    bias = torch.randn(5000, device="cuda").to(torch.bfloat16) if with_bias else None
    rows = torch.arange(T, device="cuda") if every_row else torch.arange(0, T, 3, device="cuda")
    up = torch.randn(rows.numel(), device="cuda")
    out = {}
    forward = torch.ops.rlk_mm.selected_logprob
    assert count_syncs(lambda: out.setdefault("fwd", forward(h, w, rows, tg[rows], bias, 0.9, True))) == 1
    assert count_syncs(lambda: selected_logprob(h, w, index=rows, targets=tg[rows], bias=bias, temperature=0.9)) == 1
    _, entropy, lse, all_rows = out["fwd"]
    assert bool(all_rows) is every_row
    backward = torch.ops.rlk_mm.selected_logprob_backward
    args = (up, up, h, w, rows, tg[rows], bias, lse, entropy, all_rows, 0.9, True, True, with_bias)
    assert count_syncs(lambda: out.setdefault("bwd", backward(*args))) == 0
    d_h, d_w, _ = out["bwd"]
    assert d_h.shape == h.shape and d_w.shape == w.shape and d_w.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shard_partials_are_the_whole_heads_partials_gpu(dtype):
    """What makes vocabulary-parallel results bitwise the single GPU's (``_vocab_parallel``), on
    one GPU: the per-segment partials a 128-aligned shard of the 7B head computes (starting at
    rows 76,160 and 114,048: mid-way through a 256-column bf16 tile) are bitwise the whole
    head's partials of those segments."""
    T, H, V = 512, 3584, 152064
    h, w, tg = _inputs(T, H, V, dtype, seed=4)
    rows = torch.arange(T, device="cuda")

    def partials(lo, hi):
        got = []

        def capture(parts, tgt_logit, start, cols):
            got.append(parts.clone())
            return parts.contiguous(), tgt_logit

        local = torch.where((tg >= lo) & (tg < hi), tg - lo, -1)
        out = triton_logprob.forward(h, w[lo:hi], rows, local, None, 0.8, True, True, exchange=capture)
        return torch.cat(got, dim=2), out

    whole, single = partials(0, V)
    shards = [partials(lo, hi)[0] for lo, hi in ((0, 76160), (76160, 114048), (114048, V))]
    assert torch.equal(torch.cat(shards, dim=1), whole)
    logp, ent, lse = triton_logprob.forward(h, w, rows, tg, None, 0.8, True, True)
    assert all(torch.equal(a, b) for a, b in zip(single, (logp, ent, lse)))  # a pass-through exchange changes nothing
