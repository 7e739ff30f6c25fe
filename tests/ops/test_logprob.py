"""selected_logprob on CPU: the torch backend and the Triton kernels (under
TRITON_INTERPRET=1) against an fp64 oracle, within the numerical contract; batch
invariance bitwise; the RLBatch path (packed, right and left padded); bad input; empty
selection; torch.compile. tests/ops/test_logprob_inputs.py holds the full table of bad inputs."""

import pytest
import torch

from rlk_mm.ops import selected_logprob
from rlk_mm.ops._torch import logprob as reference_logprob
from rlk_mm.parity.contract import LOGPROB_GRAD_REL, LOGPROB_MAX_ABS, relative_error
from rlk_mm.schema import RLBatch
from rlk_mm.schema.spans import Span, SpanTable
from support.helpers import use_backend


def _inputs(T, H, V, dtype, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    return h, w, b


def _oracle(h, w, rows, targets, temperature, bias, g_logp, g_ent):
    """fp64 log-probs, entropies and gradients from full logits, by autograd."""
    hh, ww = h.double().requires_grad_(), w.double().requires_grad_()
    bb = None if bias is None else bias.double().requires_grad_()
    z = hh[rows] @ ww.T
    if bb is not None:
        z = z + bb
    logp_all = (z / temperature).log_softmax(-1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    (logp * g_logp.double() + ent * g_ent.double()).sum().backward()
    return logp.detach(), ent.detach(), hh.grad, ww.grad, None if bb is None else bb.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [48, 50])  # 48: tiles read by tensor descriptors; 50: by pointers
def test_matches_fp64_oracle_within_contract(backend, dtype, H):
    T, V, n = 40, 300, 30
    h, w, b = _inputs(T, H, V, dtype, bias=True)
    g = torch.Generator().manual_seed(1)
    rows = torch.randperm(T, generator=g)[:n]
    targets = torch.randint(0, V, (n,), generator=g)
    g_logp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)  # per-token weights
    hg, wg, bg = (t.clone().requires_grad_() for t in (h, w, b))
    logp, ent = selected_logprob(hg, wg, index=rows, targets=targets, temperature=0.7, bias=bg, return_entropy=True)
    torch.autograd.backward([logp, ent], [g_logp, g_ent])
    r_logp, r_ent, r_dh, r_dw, r_db = _oracle(h, w, rows, targets, 0.7, b, g_logp, g_ent)
    assert logp.dtype == ent.dtype == torch.float32
    tol, gtol = LOGPROB_MAX_ABS.for_dtype(dtype), LOGPROB_GRAD_REL.for_dtype(dtype)
    assert (logp.double() - r_logp).abs().max() <= tol
    assert (ent.double() - r_ent).abs().max() <= tol
    assert hg.grad.dtype == dtype and wg.grad.dtype == dtype and bg.grad.dtype == dtype
    assert relative_error(hg.grad, r_dh) <= gtol
    assert relative_error(wg.grad, r_dw) <= gtol
    assert relative_error(bg.grad, r_db) <= gtol
    unscored = torch.ones(T, dtype=torch.bool)
    unscored[rows] = False
    assert torch.count_nonzero(hg.grad[unscored]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_in_passes_of_rows_and_chunks_of_vocabulary(monkeypatch, dtype):
    """The Triton backward with a d-logits budget of one 32-column tile (ten vocabulary chunks,
    the last partial; the first writes d hidden, whose buffer is not zero-filled) and, for 16-bit
    hidden states, fp32 d hidden rows for one 16-row tile at a time (two passes over the
    vocabulary, whose d weight and d bias add up). Gradients within the contract of the fp64
    oracle, with scattered and repeated rows."""
    from rlk_mm.ops._triton import logprob as triton_logprob

    original = triton_logprob.default_config

    def small(dtype, device, rows=None):
        cfg = original(dtype, device, rows=rows)
        return type(cfg)(**{**cfg.__dict__, "dz_budget": cfg.block_n * 16 * 2, "hidden_budget": 16 * 32 * 4})

    monkeypatch.setattr(triton_logprob, "default_config", small)
    T, H, V = 30, 32, 300
    h, w, b = _inputs(T, H, V, dtype, seed=4, bias=True)
    g = torch.Generator().manual_seed(4)
    rows = torch.cat([torch.arange(2, 22), torch.tensor([5, 5, 9, 0])])  # 24 scored rows, some repeated
    targets = torch.randint(0, V, (24,), generator=g)
    cfg = small(dtype, torch.device("cpu"))
    pass_rows = 24 if dtype == torch.float32 else 16  # fp32 rows: one pass
    assert triton_logprob.dz_chunk_columns(pass_rows, V, dtype, cfg) == cfg.block_n < V
    up, up_ent = torch.linspace(-1, 2, 24), torch.randn(24, generator=g)
    hg, wg, bg = (t.clone().requires_grad_() for t in (h, w, b))
    with use_backend("triton"):
        logp, ent = selected_logprob(hg, wg, index=rows, targets=targets, temperature=0.9, bias=bg,
                                     return_entropy=True)
        torch.autograd.backward([logp, ent], [up, up_ent])
    _, _, r_dh, r_dw, r_db = _oracle(h, w, rows, targets, 0.9, b, up, up_ent)
    tol = LOGPROB_GRAD_REL.for_dtype(dtype)
    assert hg.grad.dtype == wg.grad.dtype == dtype
    assert relative_error(hg.grad, r_dh) <= tol and relative_error(wg.grad, r_dw) <= tol
    assert relative_error(bg.grad, r_db) <= tol


def test_gradient_through_one_output_only(backend):
    """Log-prob alone (no entropy asked), and entropy alone (log-prob unused)."""
    T, H, V = 24, 32, 200
    h, w, _ = _inputs(T, H, V, torch.float32, seed=3)
    rows, targets = torch.arange(3, 20), torch.randint(0, V, (17,))
    up = torch.linspace(-1, 2, 17)
    zeros = torch.zeros(17)
    tol = LOGPROB_GRAD_REL.fp32
    for use_entropy in (False, True):
        hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
        if use_entropy:
            _, ent = selected_logprob(hg, wg, index=rows, targets=targets, temperature=1.3, return_entropy=True)
            ent.backward(up)
            _, _, r_dh, r_dw, _ = _oracle(h, w, rows, targets, 1.3, None, zeros, up)
        else:
            selected_logprob(hg, wg, index=rows, targets=targets, temperature=1.3).backward(up)
            _, _, r_dh, r_dw, _ = _oracle(h, w, rows, targets, 1.3, None, up, zeros)
        assert relative_error(hg.grad, r_dh) <= tol and relative_error(wg.grad, r_dw) <= tol


def test_gradient_to_one_input_only(backend):
    """A frozen LM head (RL fine-tuning often freezes it) or frozen hidden states, with a bias
    that needs no gradient: only the inputs that require grad get one."""
    T, H, V = 16, 32, 120
    h, w, b = _inputs(T, H, V, torch.float32, seed=5, bias=True)
    rows, targets = torch.arange(1, 12), torch.randint(0, V, (11,))
    up = torch.linspace(-1, 1, 11)
    _, _, r_dh, r_dw, _ = _oracle(h, w, rows, targets, 0.8, b, up, torch.zeros(11))
    tol = LOGPROB_GRAD_REL.fp32
    hg = h.clone().requires_grad_()
    selected_logprob(hg, w, index=rows, targets=targets, temperature=0.8, bias=b).backward(up)
    assert relative_error(hg.grad, r_dh) <= tol
    wg = w.clone().requires_grad_()
    selected_logprob(h, wg, index=rows, targets=targets, temperature=0.8, bias=b).backward(up)
    assert relative_error(wg.grad, r_dw) <= tol


def test_minus_inf_bias_masks_vocabulary(backend, monkeypatch):
    """A bias of -inf masks vocabulary entries (a padded vocabulary, banned tokens): results
    and gradients are those of the unmasked vocabulary, never NaN; masked rows of W and
    entries of the bias get zero gradient. The mask covers whole vocabulary tiles (4 of the
    interpreter's 32-column tiles, 2 of the reference's tiles shrunk to 64) and part of one."""
    monkeypatch.setattr(reference_logprob, "VOCAB_TILE", 64)
    T, H, V = 12, 32, 300
    h, w, b = _inputs(T, H, V, torch.float32, seed=6, bias=True)
    b[:128] = -float("inf")
    b[200:210] = -float("inf")
    keep = torch.isfinite(b)
    kept = torch.nonzero(keep).flatten()
    g = torch.Generator().manual_seed(7)
    rows = torch.arange(1, 11)
    pick = torch.randint(0, kept.numel(), (10,), generator=g)
    g_logp, g_ent = torch.randn(10, generator=g), torch.randn(10, generator=g)
    hg, wg, bg = (t.clone().requires_grad_() for t in (h, w, b))
    logp, ent = selected_logprob(hg, wg, index=rows, targets=kept[pick], temperature=0.9, bias=bg, return_entropy=True)
    torch.autograd.backward([logp, ent], [g_logp, g_ent])
    r_logp, r_ent, r_dh, r_dw, r_db = _oracle(h, w[keep], rows, pick, 0.9, b[keep], g_logp, g_ent)
    tol, gtol = LOGPROB_MAX_ABS.fp32, LOGPROB_GRAD_REL.fp32
    assert (logp.double() - r_logp).abs().max() <= tol
    assert (ent.double() - r_ent).abs().max() <= tol
    assert relative_error(hg.grad, r_dh) <= gtol
    assert relative_error(wg.grad[keep], r_dw) <= gtol and torch.count_nonzero(wg.grad[~keep]) == 0
    assert relative_error(bg.grad[keep], r_db) <= gtol and torch.count_nonzero(bg.grad[~keep]) == 0


def test_repeated_rows_sum_and_padded_hidden(backend):
    """[B, L, H] hidden; a row scored twice (two candidate targets) gets both gradients."""
    B, L, H, V = 3, 8, 32, 150
    h, w, _ = _inputs(B * L, H, V, torch.float32, seed=4)
    rows = torch.tensor([1, 9, 9, 17, 23])
    targets = torch.tensor([4, 7, 99, 0, 149])
    hg = h.view(B, L, H).clone().requires_grad_()
    wg = w.clone().requires_grad_()
    logp = selected_logprob(hg, wg, index=rows, targets=targets)
    logp.sum().backward()
    r_logp, _, r_dh, r_dw, _ = _oracle(h, w, rows, targets, 1.0, None, torch.ones(5), torch.zeros(5))
    assert hg.grad.shape == (B, L, H)
    assert (logp.double() - r_logp).abs().max() <= LOGPROB_MAX_ABS.fp32
    assert relative_error(hg.grad.view(-1, H), r_dh) <= LOGPROB_GRAD_REL.fp32
    assert relative_error(wg.grad, r_dw) <= LOGPROB_GRAD_REL.fp32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance_bitwise(backend, dtype):
    """A row's log-prob and entropy: alone, 37th of 64, and at another place in another
    hidden tensor - bitwise equal."""
    T, H, V = 80, 48, 300
    h, w, _ = _inputs(T, H, V, dtype, seed=5)
    targets = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(6))
    r = 5
    alone = selected_logprob(h, w, index=torch.tensor([r]), targets=targets[[r]], temperature=0.9, return_entropy=True)
    rows = torch.randperm(T, generator=torch.Generator().manual_seed(7))
    rows = torch.cat([rows[rows != r][:37], torch.tensor([r]), rows[rows != r][37:63]])
    in_64 = selected_logprob(h, w, index=rows, targets=targets[rows], temperature=0.9, return_entropy=True)
    other = torch.cat([torch.randn(11, H).to(dtype), h])
    moved = selected_logprob(other, w, index=torch.tensor([3, r + 11, 7]),
                             targets=torch.tensor([0, int(targets[r]), 9]), temperature=0.9, return_entropy=True)
    for got, at in ((in_64, 37), (moved, 1)):
        assert torch.equal(got[0][at : at + 1], alone[0])
        assert torch.equal(got[1][at : at + 1], alone[1])


def _batch():
    """Two text samples; loss spans [3, 5) + [6, 7) and [2, 5)."""
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 100, (12,), generator=g)
    return RLBatch(
        input_ids=ids,
        cu_seqlens=torch.tensor([0, 7, 12], dtype=torch.int32),
        position_ids=torch.cat([torch.arange(7), torch.arange(5)]).expand(3, -1).clone(),
        modality_spans=SpanTable.from_lists([[Span(0, 7)], [Span(0, 5)]]),
        loss_spans=SpanTable.from_lists([[Span(3, 5), Span(6, 7)], [Span(2, 5)]]),
        processor_fingerprint="test",
    )


def test_batch_path_packed_and_padded(backend):
    batch = _batch()
    H, V = 32, 100
    packed, w, _ = _inputs(12, H, V, torch.float32, seed=9)
    padded = torch.zeros(2, 8, H)
    padded[0, :7], padded[1, :5] = packed[:7], packed[7:]
    left = torch.zeros(2, 8, H)
    left[0, 1:], left[1, 3:] = packed[:7], packed[7:]
    a = selected_logprob(packed, w, batch)
    b = selected_logprob(padded, w, batch, padding="right")
    # target t of sample b scored from hidden row t-1 of that sample
    rows, targets = torch.tensor([2, 3, 5, 8, 9, 10]), batch.input_ids[[3, 4, 6, 9, 10, 11]]
    c = selected_logprob(packed, w, index=rows, targets=targets)
    assert torch.equal(a, c) and torch.equal(b, c)
    assert torch.equal(selected_logprob(left, w, batch, padding="left"), c)
    with pytest.raises(ValueError, match="padding side is ambiguous: pass padding='right'"):
        selected_logprob(left, w, batch)  # [B, L, H] without a padding side: refused, never guessed
    with pytest.raises(ValueError, match="batch has 12 tokens"):
        selected_logprob(packed[:11], w, batch)
    with pytest.raises(ValueError, match="batch has 2 samples"):
        selected_logprob(padded[:1], w, batch)
    with pytest.raises(ValueError, match=r"sample 1, position 3 holds token"):
        selected_logprob(packed, w[:int(batch.input_ids[10])], batch)  # token at sample 1, position 3


def test_empty_selection(backend):
    h, w, b = _inputs(10, 32, 50, torch.bfloat16, bias=True)
    hg, wg, bg = (t.clone().requires_grad_() for t in (h, w, b))
    none = torch.empty(0, dtype=torch.int64)
    logp, ent = selected_logprob(hg, wg, index=none, targets=none, bias=bg, return_entropy=True)
    assert logp.shape == ent.shape == (0,) and logp.dtype == torch.float32
    (logp.sum() + ent.sum()).backward()
    for t, grad in ((hg, hg.grad), (wg, wg.grad), (bg, bg.grad)):
        assert grad.shape == t.shape and torch.count_nonzero(grad) == 0


def _bad_cases():
    h, w, b = _inputs(10, 16, 30, torch.float32, bias=True)
    i, t = torch.tensor([0, 3]), torch.tensor([1, 2])
    return [
        (dict(hidden=h, weight=w, index=torch.tensor([0, 10]), targets=t), ValueError,
         r"index\[1\] = 10 is out of range: there are 10 rows"),
        (dict(hidden=h, weight=w, index=torch.tensor([-1, 2]), targets=t), ValueError, r"index\[0\] = -1"),
        (dict(hidden=h, weight=w, index=i, targets=torch.tensor([1, 30])), ValueError,
         r"targets\[1\] = 30 is out of range: there are 30 vocabulary"),
        (dict(hidden=h, weight=w.double(), index=i, targets=t), TypeError, "share one of"),
        (dict(hidden=h.bfloat16(), weight=w, index=i, targets=t), TypeError, "share one of"),
        (dict(hidden=h, weight=w[:, :8], index=i, targets=t), ValueError, "hidden size mismatch"),
        (dict(hidden=h, weight=w, index=i, targets=t, bias=b[:5]), ValueError, "bias must be"),
        (dict(hidden=h, weight=w, index=i, targets=t, bias=b.bfloat16()), TypeError, "bias dtype"),
        (dict(hidden=h, weight=w, index=i, targets=t[:1]), ValueError, "index has 2 rows but targets has 1"),
        (dict(hidden=h, weight=w, index=i.float(), targets=t), TypeError, "index must be an integer tensor"),
        (dict(hidden=h, weight=w, index=i.to("meta"), targets=t), ValueError, "index is on meta but hidden is on cpu"),
        (dict(hidden=h, weight=w, index=i, targets=t, temperature=0.0), ValueError, "temperature must be"),
        (dict(hidden=h, weight=w, index=i, targets=t, temperature=-2.0), ValueError, "temperature must be"),
        (dict(hidden=h, weight=w, index=i, targets=t, temperature=float("nan")), ValueError, "temperature must be"),
        (dict(hidden=h, weight=w, index=i), ValueError, "both index"),
        (dict(hidden=h[0], weight=w, index=i, targets=t), ValueError, r"hidden must be \[T, H\]"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_raises_clear_error(backend, case):
    kwargs, exc, match = _bad_cases()[case]
    with pytest.raises(exc, match=match):
        selected_logprob(**kwargs)


def test_torch_compile_matches_eager():
    h, w, _ = _inputs(20, 16, 50, torch.float32, seed=10)
    rows, targets = torch.arange(0, 20, 2), torch.randint(0, 50, (10,))

    def loss(h, w):
        logp, ent = selected_logprob(h, w, index=rows, targets=targets, temperature=0.9, return_entropy=True)
        return (2 * logp + ent).sum()

    results = []
    with use_backend("torch"):
        for fn in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
            hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
            out = fn(hg, wg)
            out.backward()
            results.append((out.detach(), hg.grad, wg.grad))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_custom_op_registration():
    h, w, _ = _inputs(12, 16, 40, torch.float32, seed=11)
    args = (h.requires_grad_(), w.requires_grad_(), torch.tensor([1, 5, 7]), torch.tensor([0, 9, 39]), None, 0.8, True)
    torch.library.opcheck(torch.ops.rlk_mm.selected_logprob.default, args)


def test_forward_reports_all_rows_on_cpu(backend):
    """The op's 4th output says (as a CPU bool) whether the rows are every row of hidden in
    order: the backward reads hidden and writes d hidden by it, with no device sync."""
    h, w, _ = _inputs(6, 8, 20, torch.float32, seed=12)
    targets = torch.randint(0, 20, (6,))
    cases = [
        (torch.arange(6), True),
        (torch.tensor([1, 0, 2, 3, 4, 5]), False),  # all rows, out of order
        (torch.tensor([0, 1, 2, 3, 4, 4]), False),  # T rows, one repeated
        (torch.arange(5), False),  # a prefix
    ]
    for rows, expected in cases:
        *_, all_rows = torch.ops.rlk_mm.selected_logprob(h, w, rows, targets[: rows.numel()], None, 1.0, False)
        assert all_rows.device.type == "cpu" and all_rows.dtype == torch.bool
        assert bool(all_rows) is expected, rows
        hg = h.clone().requires_grad_()
        up = torch.randn(rows.numel())
        selected_logprob(hg, w, index=rows, targets=targets[: rows.numel()]).backward(up)
        _, _, d_h, _, _ = _oracle(h, w, rows, targets[: rows.numel()], 1.0, None, up, torch.zeros(rows.numel()))
        assert relative_error(hg.grad, d_h) <= LOGPROB_GRAD_REL.for_dtype(torch.float32)
