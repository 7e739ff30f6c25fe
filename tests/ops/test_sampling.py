"""Rollout sampling (``rlk_mm.ops.sample``, ``sample_from_hidden``, ``group_seeds``): the draws
follow the filtered distributions (chi-square), the streams are counter-based (bitwise batch
invariance, distinct group members, the same tokens on every run), the torch and Triton
backends agree bitwise, ``sample_from_hidden``'s log-probs are ``selected_logprob``'s, and bad
input is refused with errors that say what to change. Triton runs under its interpreter at
small V (``conftest.py``); ``test_sampling_gpu.py`` repeats the key checks on a GPU."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlk_mm.ops import batch_invariant, group_seeds, sample, sample_from_hidden, selected_logprob
from rlk_mm.ops._flashinfer import sampling as _fi
from rlk_mm.ops._torch import sampling as ref
from support.helpers import use_backend

FILTERS = [
    {},
    {"temperature": 0.7},
    {"top_k": 4},
    {"top_p": 0.6},
    {"min_p": 0.15},
    {"top_k": 6, "top_p": 0.8, "temperature": 1.3},
    {"top_k": 5, "top_p": 0.9, "min_p": 0.05, "temperature": 0.8},
]


def _expected(logits: torch.Tensor, temperature=1.0, top_k=None, top_p=None, min_p=None) -> np.ndarray:
    """The filtered, renormalized distribution of one row, in float64 (the test's oracle)."""
    z = (logits.float() * torch.tensor(1 / temperature, dtype=torch.float32)).double().numpy()
    keep = np.isfinite(z)
    if top_k is not None and top_k < keep.sum():
        keep &= z >= np.sort(z[keep])[-top_k]
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    if top_p is not None:
        order = np.argsort(-z, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        keep_sorted = before < top_p * p.sum()
        keep &= np.isin(np.arange(z.size), order[keep_sorted])
    if min_p is not None:
        keep &= z - z[keep].max() >= math.log(min_p)
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile at p = 1e-4 (Wilson-Hilferty; z the normal quantile)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


# ------------------------------------------------------------------ the distributions
@pytest.mark.parametrize("kw", FILTERS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_draws_follow_the_filtered_distribution(kw):
    torch.manual_seed(1)
    V, N = 40, 4000  # V > one noise block: the plain draw's block stage is exercised
    row = torch.randn(V) * 1.5
    row[7] = -math.inf  # a masked entry is never drawn
    expected = _expected(row, **kw)
    seeds = torch.arange(N) * 7919 + 13
    out = sample(row.expand(N, V), seeds=seeds, backend="torch", **kw)
    counts = np.bincount(out.tokens.numpy(), minlength=V)
    assert counts[expected == 0].sum() == 0, "a token the filters drop was drawn"
    support = expected > 0
    want = expected[support] * N
    chi2 = float(((counts[support] - want) ** 2 / want).sum())
    assert chi2 < _chi2_critical(max(int(support.sum()) - 1, 1)), (chi2, int(support.sum()))
    # the two log-probs: plain temperature and the renormalized filtered distribution
    plain = torch.log_softmax(row.float() / kw.get("temperature", 1.0), -1).double()
    torch.testing.assert_close(out.log_probs.double(), plain[out.tokens], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.sampled_log_probs.double(), torch.from_numpy(np.log(expected))[out.tokens],
                               rtol=0, atol=1e-5)


def test_top_p_keeps_or_drops_ties_together_and_keeps_the_top_token():
    row = torch.tensor([2.0, 1.0, 1.0, 1.0, -3.0])
    p = torch.softmax(row, 0)
    out = sample(row.expand(400, 5), top_p=float(p[0]) + 1e-3, seeds=torch.arange(400), backend="torch")
    assert set(out.tokens.tolist()) == {0, 1, 2, 3}  # the tie at 1.0 is kept whole
    out = sample(row.expand(50, 5), top_p=1e-6, seeds=torch.arange(50), backend="torch")
    assert set(out.tokens.tolist()) == {0} and bool((out.sampled_log_probs == 0).all())


# ------------------------------------------------------------------ the streams
def test_same_seeds_same_tokens_and_batch_invariance_bitwise():
    torch.manual_seed(2)
    V = 1500
    logits = torch.randn(72, V) * 2
    seeds = group_seeds(5, [f"g{i // 4}" for i in range(72)], 3)
    for kw in ({}, {"top_k": 50, "top_p": 0.9, "temperature": 0.8}):
        r = 11
        alone = sample(logits[r : r + 1], seeds=seeds[r : r + 1], step=4, backend="torch", **kw)
        in_64 = sample(logits[:64], seeds=seeds[:64], step=4, backend="torch", **kw)
        order = torch.randperm(72)
        shuffled = sample(logits[order], seeds=seeds[order], step=4, backend="torch", **kw)
        at = int((order == r).nonzero())
        again = sample(logits[:64], seeds=seeds[:64], step=4, backend="torch", **kw)
        for name, res, i in (("in 64", in_64, r), ("elsewhere, B=72", shuffled, at), ("again", again, r)):
            for field, a, b in zip(alone._fields, alone, res):
                assert torch.equal(a[0], b[i]), (name, field, kw)


def test_group_members_and_steps_get_distinct_streams():
    groups = ["p0"] * 8 + ["p1"] * 8
    seeds = group_seeds(0, groups, 1)
    assert seeds.dtype == torch.int64 and len(set(seeds.tolist())) == 16
    assert not set(seeds.tolist()) & set(group_seeds(0, groups, 2).tolist())  # another training step
    assert not set(seeds.tolist()) & set(group_seeds(1, groups, 1).tolist())  # another run seed
    assert torch.equal(seeds, group_seeds(0, groups, 1))  # stable
    assert int(group_seeds(0, ["p0"], 1)[0]) == int(seeds[0])  # a member's seed: its group and number only
    flat = torch.zeros(16, 5000)  # every member sees the same uniform logits
    toks = [sample(flat, seeds=seeds, step=s, backend="torch").tokens for s in range(3)]
    assert len(set(toks[0][:8].tolist())) >= 7  # a group does not collapse to one answer
    assert not torch.equal(toks[0], toks[1]) and not torch.equal(toks[1], toks[2])  # steps differ


def test_rng_matches_a_uint32_reference():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, size=1000, dtype=np.uint64).astype(np.uint32)

    def mix(v):
        v = v ^ (v >> np.uint32(16))
        v = v * np.uint32(ref.MIX1)
        v = v ^ (v >> np.uint32(15))
        v = v * np.uint32(ref.MIX2)
        return v ^ (v >> np.uint32(16))

    with np.errstate(over="ignore"):
        want = mix(x)
    assert np.array_equal(ref.mix32(torch.from_numpy(x.astype(np.int64))).numpy().astype(np.uint32), want)
    g = ref.gumbel(torch.arange(100_000), torch.tensor(123), torch.tensor(456))
    assert g.dtype == torch.float64 and bool(torch.isfinite(g).all())
    assert abs(float(g.mean()) - 0.5772) < 0.02 and abs(float(g.var()) - math.pi**2 / 6) < 0.05


# ------------------------------------------------------------------ Triton (interpreter) = torch
def _small_batch(B=5, V=100, seed=3):
    torch.manual_seed(seed)
    logits = torch.randn(B, V) * 2
    logits[1, 10:60] = -math.inf
    logits[2, :] = logits[2, :].round()  # ties
    if B > 4:
        logits[4] = 0.0  # more top-k candidates than the interpreter's cap: the Triton kernel's bisection
    return logits, group_seeds(seed, ["a", "a", "b", "b", "c"][:B], 0)


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7},
                                {"top_k": 5, "top_p": 0.8, "min_p": 0.02, "temperature": 1.3}],
                         ids=["plain", "temperature", "all-filters"])
def test_triton_matches_torch_bitwise(kw):
    logits, seeds = _small_batch()
    a, b = (sample(logits.to(torch.bfloat16), seeds=seeds, step=2, backend=be, **kw) for be in ("torch", "triton"))
    for x, y in zip(a, b):
        assert torch.equal(x, y), (kw, a, b)


def test_triton_single_filters_match_torch():
    logits, seeds = _small_batch(B=3, V=70)
    for kw in ({"top_k": 3}, {"top_k": 20}, {"top_p": 0.5}, {"min_p": 0.3}):  # top_k 20: 40 slots > the interpreter's 16: the bisection
        a, b = (sample(logits, seeds=seeds, backend=be, **kw) for be in ("torch", "triton"))
        assert all(torch.equal(x, y) for x, y in zip(a, b)), kw


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    V=st.integers(1, 100),
    top_k=st.none() | st.integers(1, 8),
    top_p=st.none() | st.floats(0.05, 1.0),
    min_p=st.none() | st.floats(0.0, 0.5),
    temperature=st.sampled_from([1.0, 0.7, 1.3]),
)
def test_triton_candidates_match_torch_on_any_row(data, V, top_k, top_p, min_p, temperature):
    """The sorted candidates' thresholds and draw against the torch backend, bit for bit, on
    rows drawn from a few values (ties at the k-th largest and at the top-p boundary, across
    blocks), from wide floats and with masked entries; top-p without top-k lists the bucket
    where its threshold lies (the interpreter's 8 slots hold it in some rows and not in
    others: then the bisection)."""
    value = st.sampled_from([-2.0, 0.0, 0.5, 1.0, 3.0, -math.inf]) | st.floats(-20, 20)
    rows = [data.draw(st.lists(value, min_size=V, max_size=V)) for _ in range(2)]
    x = torch.tensor(rows, dtype=torch.float32)
    x[:, 0] = torch.where(torch.isinf(x[:, 0]), 0.0, x[:, 0])  # a finite entry in every row
    seeds = torch.tensor([data.draw(st.integers(0, 2**62)) for _ in range(2)])
    kw = dict(top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
    a, b = (sample(x, seeds=seeds, step=5, backend=be, **kw) for be in ("torch", "triton"))
    assert all(torch.equal(p, q) for p, q in zip(a, b)), (kw, a, b)


@pytest.mark.parametrize("kw", [{"top_p": 0.9}, {"top_p": 0.5}, {"min_p": 0.01}, {"min_p": 0.3},
                                {"top_p": 0.8, "min_p": 0.05}], ids=str)
def test_triton_filters_without_top_k_match_torch(kw):
    """Top-p without top-k finds the bucket of its threshold from the rows' mass histograms
    (the interpreter's: half a logit each) and lists its entries: peaked rows (a few in the
    bucket), flat rows (more than the interpreter's 8 slots: the bisection), one row of each
    kind per batch; min-p alone keeps every entry above its cut without a list."""
    g = torch.Generator().manual_seed(5)
    spread = torch.tensor([0.3, 6.0, 0.3, 9.0, 1.0, 4.0])[:, None]
    x = torch.randn(6, 90, generator=g) * spread
    seeds = torch.arange(6) + 17
    a, b = (sample(x, seeds=seeds, step=1, backend=be, **kw) for be in ("torch", "triton"))
    assert all(torch.equal(p, q) for p, q in zip(a, b)), (kw, a, b)


@pytest.mark.parametrize("top_k", [1, 2, 7])
def test_triton_top_k_candidates_match_torch_with_ties(top_k):
    """The Triton kernel lists every entry at or above a bound (interpreter: blocks of 32, 16
    candidate slots) and sorts them; more than fit (ties at the bound) send the row to the
    bisection. Rows with ties inside and across blocks, masked entries and fewer finite
    entries than k."""
    torch.manual_seed(top_k)
    x = torch.randn(6, 100) * 2
    x[0] = x[0].round()
    x[1] = (x[1] * 0.4).round()  # a few values, each in many blocks
    x[2, ::3] = -math.inf
    x[3, 5:] = -math.inf  # 5 finite entries
    x[4, 40:50] = x[4].max() + 1  # 10 equal top entries across two blocks
    x[5, [3, 35, 70]] = x[5].max() + 1
    seeds = torch.arange(6) + 100 * top_k
    for kw in ({}, {"top_p": 0.7, "temperature": 0.7}, {"top_p": 0.9, "min_p": 0.1}):
        a, b = (sample(x, seeds=seeds, step=top_k, top_k=top_k, backend=be, **kw) for be in ("torch", "triton"))
        assert all(torch.equal(p, q) for p, q in zip(a, b)), (kw, a, b)


def test_scoring_given_tokens_matches_between_backends():
    """The flashinfer backend's tokens are scored this way (a dropped token: sampled log-prob -inf)."""
    from rlk_mm.ops._triton import sampling as tri

    logits, seeds = _small_batch(B=3, V=70)
    steps = torch.zeros(3, dtype=torch.long)
    filters = ref.Filters(top_k=3)
    given = torch.tensor([int(logits[0].argmax()), int(logits[1].argmin()), 5])
    a = ref.sample_rows(logits, 1.0, filters, seeds, steps, given=given)
    b = tri.sample_logits(logits, 1.0, filters, seeds, steps, given=given)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(a[0], given) and a[2][1] == -math.inf and a[2][0] > -math.inf


@pytest.mark.parametrize("kw", [{"top_p": 0.9}, {"top_p": 1.0}, {"min_p_log": math.log(0.02)},
                                {"top_p": 0.8, "min_p_log": math.log(0.05)}], ids=str)
def test_top_p_buckets_and_their_bisection_match_torch(kw):
    """Without top-k, the crossing bucket's list and the bisection it falls back to give the
    torch backend's tokens and log-probs, bit for bit, drawn or scoring given tokens: slots for
    every bucket's entries (fine buckets, many slots), for none (2 slots) and coarse buckets;
    rows peaked, flat, with masked entries and with ties."""
    from rlk_mm.ops._triton import sampling as tri

    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 150, generator=g) * torch.tensor([0.3, 6.0, 0.3, 9.0, 1.0, 4.0, 2.0, 0.0])[:, None]
    x[6, ::7] = -math.inf
    x[7] = (torch.randn(150, generator=g) * 2).round()
    seeds, steps = torch.arange(8) + 17, torch.ones(8, dtype=torch.long)
    tokens = torch.tensor([0, 5, 149, 3, 7, 9, 14, 100])
    filters = ref.Filters(**kw)
    base = tri.default_config(torch.device("cpu"))
    configs = [replace(base, bucket_lanes=256, mass_buckets=4096, buckets_per_unit=64), replace(base, bucket_lanes=2),
               replace(base, mass_buckets=16, buckets_per_unit=1, bucket_lanes=64)]
    for inv_t in (1 / 0.7,):
        drawn = ref.sample_rows(x, inv_t, filters, seeds, steps)
        scored = ref.sample_rows(x, inv_t, filters, seeds, steps, given=tokens)
        assert not torch.equal(scored[2], drawn[2])  # some given tokens dropped or scored apart
        for cfg in configs:
            for want, got in ((drawn, tri.sample_logits(x, inv_t, filters, seeds, steps, config=cfg)),
                              (scored, tri.sample_logits(x, inv_t, filters, seeds, steps, given=tokens, config=cfg))):
                assert all(torch.equal(a, b) for a, b in zip(want, got)), (kw, inv_t, cfg, want, got)


def test_triton_batch_invariance_bitwise():
    logits, seeds = _small_batch(B=5, V=100)
    for kw in ({}, {"top_k": 4, "top_p": 0.9}):
        alone = sample(logits[3:4], seeds=seeds[3:4], backend="triton", **kw)
        batch = sample(logits[[0, 3, 4]], seeds=seeds[[0, 3, 4]], backend="triton", **kw)
        assert all(torch.equal(x[0], y[1]) for x, y in zip(alone, batch)), kw


# ------------------------------------------------------------------ rollout log-probs = training log-probs
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("be", ["torch", "triton"])
def test_sample_from_hidden_log_probs_are_selected_logprob_bitwise(temperature, be):
    torch.manual_seed(4)
    B, H, V = 4, 24, 100
    h, w, bias = torch.randn(B, H), torch.randn(V, H) * 0.5, torch.randn(V)
    bias[5] = -math.inf
    seeds = torch.arange(B) + 100
    for kw in ({}, {"top_k": 8, "top_p": 0.9}):
        with batch_invariant(backend=be), use_backend(be):
            out = sample_from_hidden(h, w, bias=bias, temperature=temperature, seeds=seeds, backend=be, **kw)
            train = selected_logprob(h, w, index=torch.arange(B), targets=out.tokens, bias=bias,
                                     temperature=temperature)
        assert torch.equal(out.log_probs, train), (kw, out.log_probs - train)
        assert not bool((out.tokens == 5).any())
        if not kw:
            assert torch.equal(out.sampled_log_probs, out.log_probs)
        # the draw is the one sample() makes from the same logits (formed by the same backend)
        z = torch.log_softmax((h @ w.T + bias) / temperature, -1)
        torch.testing.assert_close(out.log_probs, z.gather(1, out.tokens[:, None])[:, 0], rtol=0, atol=1e-5)


def test_sample_from_hidden_rows_do_not_depend_on_the_batch():
    torch.manual_seed(5)
    h, w = torch.randn(40, 16), torch.randn(70, 16)
    seeds = torch.arange(40)
    for be in ("torch", "triton"):
        full = sample_from_hidden(h, w, seeds=seeds, temperature=0.9, backend=be)
        part = sample_from_hidden(h[[7, 30]], w, seeds=seeds[[7, 30]], temperature=0.9, backend=be)
        assert all(torch.equal(x[[7, 30]], y) for x, y in zip(full, part)), be


@pytest.mark.parametrize("kw", [{}, {"top_k": 8, "top_p": 0.9}])
def test_sample_from_hidden_bad_row_leaves_the_others_scored_as_training(kw):
    """A row with NaN logits gets NaN log-probs; the other rows keep selected_logprob's bits
    (the torch backend scores only the drawn rows that are OK)."""
    torch.manual_seed(6)
    h, w = torch.randn(5, 16), torch.randn(70, 16)
    h[2, 3] = math.nan
    seeds = torch.arange(5) + 7
    out = sample_from_hidden(h, w, seeds=seeds, temperature=0.8, backend="torch", **kw)
    assert out.log_probs[2].isnan() and out.sampled_log_probs[2].isnan()
    ok = torch.tensor([0, 1, 3, 4])
    train = selected_logprob(h, w, index=ok, targets=out.tokens[ok], temperature=0.8)
    assert torch.equal(out.log_probs[ok], train)
    clean = sample_from_hidden(h[ok], w, seeds=seeds[ok], temperature=0.8, backend="torch", **kw)
    assert all(torch.equal(x[ok], y) for x, y in zip(out, clean))
    with pytest.raises(ValueError, match="hidden row 2"):
        sample_from_hidden(h, w, seeds=seeds, temperature=0.8, backend="torch", check=True, **kw)


def test_sample_from_hidden_shares_only_bitwise_equal_rows():
    """Equal hidden rows share one logits row; rows that differ only in a zero's sign do not
    (compared bit for bit), and every row's result is the one it gets alone."""
    torch.manual_seed(7)
    h, w = torch.randn(2, 16), torch.randn(70, 16)
    h[:, 5] = 0.0
    rows = torch.stack([h[0], h[0], h[0].clone().index_fill_(0, torch.tensor([5]), -0.0), h[1]])
    seeds = torch.tensor([3, 4, 5, 6])
    out = sample_from_hidden(rows, w, seeds=seeds, temperature=0.9, backend="torch")
    for r in range(4):
        alone = sample_from_hidden(rows[r : r + 1], w, seeds=seeds[r : r + 1], temperature=0.9, backend="torch")
        assert all(torch.equal(x[r : r + 1], y) for x, y in zip(out, alone)), r


def test_tiny_qwen_rollout_log_probs_equal_training(tiny_model, processor):
    ids = processor.tokenizer(["The colour of the square is", "Answer with one word:"], return_tensors="pt",
                              padding=True).input_ids
    with torch.no_grad():
        hidden = tiny_model.model.language_model(input_ids=ids).last_hidden_state[:, -1]
    weight = tiny_model.lm_head.weight.detach()
    seeds = group_seeds(0, ["q", "q"], 0)
    # the full Qwen vocabulary; outside batch_invariant() (its CPU matmul is slow at V = 151k: the
    # small test above covers the mode), the equality holds on the same backend all the same
    with use_backend("torch"):
        out = sample_from_hidden(hidden, weight, temperature=0.8, seeds=seeds)
        train = selected_logprob(hidden, weight, index=torch.arange(2), targets=out.tokens, temperature=0.8)
    assert torch.equal(out.log_probs, train)


# ------------------------------------------------------------------ bad input
_L = torch.randn(3, 10)
_S = torch.arange(3)


def _nan_row():
    x = _L.clone()
    x[1, 4] = math.nan
    return x


def _inf_row():
    x = _L.clone()
    x[2, 6] = math.inf
    return x


def _masked_row():
    x = _L.clone()
    x[0] = -math.inf
    return x


BAD = [
    (lambda: sample(_L, seeds=_S, temperature=0.0), ValueError, "greedy"),
    (lambda: sample(_L, seeds=_S, temperature=-1.0), ValueError, "argmax"),
    (lambda: sample(_L, seeds=_S, temperature=math.nan), ValueError, "temperature"),
    (lambda: sample(_L, seeds=_S, temperature=math.inf), ValueError, "temperature"),
    (lambda: sample(_L, seeds=_S, temperature="1"), TypeError, "temperature"),
    (lambda: sample(_L, seeds=_S, temperature=True), TypeError, "temperature"),
    (lambda: sample(_L, seeds=_S, top_p=0.0), ValueError, "top_p"),
    (lambda: sample(_L, seeds=_S, top_p=1.5), ValueError, "top_p"),
    (lambda: sample(_L, seeds=_S, top_p=math.nan), ValueError, "top_p"),
    (lambda: sample(_L, seeds=_S, top_k=0), ValueError, "top_k"),
    (lambda: sample(_L, seeds=_S, top_k=-3), ValueError, "top_k"),
    (lambda: sample(_L, seeds=_S, top_k=2.5), TypeError, "top_k"),
    (lambda: sample(_L, seeds=_S, top_k=True), TypeError, "top_k"),
    (lambda: sample(_L, seeds=_S, min_p=-0.1), ValueError, "min_p"),
    (lambda: sample(_L, seeds=_S, min_p=1.5), ValueError, "min_p"),
    (lambda: sample(_nan_row(), seeds=_S, check=True), ValueError, r"logits\[1, 4\] is NaN"),
    (lambda: sample(_inf_row(), seeds=_S, check=True), ValueError, r"logits\[2, 6\] is \+inf"),
    (lambda: sample(_masked_row(), seeds=_S, check=True), ValueError, "row 0 is -inf at every entry"),
    (lambda: sample(_L * 1e34, seeds=_S, temperature=1e-5, check=True), ValueError, "overflows float32"),
    (lambda: sample(_L, seeds=_S, check=1), TypeError, "check must be True or False"),
    (lambda: sample(_L, seeds=_S, check=None), TypeError, "check"),
    (lambda: sample(_L, seeds=torch.arange(2)), ValueError, "seeds has 2 entries but there are 3 rows"),
    (lambda: sample(_L, seeds=torch.zeros(3)), TypeError, "seeds must be a 1-D integer tensor"),
    (lambda: sample(_L, seeds=[1, 2, 3]), TypeError, "group_seeds"),
    (lambda: sample(_L, seeds=torch.zeros(3, 1, dtype=torch.long)), TypeError, "seeds"),
    (lambda: sample(_L, seeds=_S, step=-1), ValueError, "step"),
    (lambda: sample(_L, seeds=_S, step=2**32), ValueError, "step"),
    (lambda: sample(_L, seeds=_S, step=torch.arange(2)), ValueError, "step has 2 entries"),
    (lambda: sample(_L, seeds=_S, step=torch.tensor([0, -1, 0])), ValueError, r"step\[1\]"),
    (lambda: sample(_L, seeds=_S, step=1.0), TypeError, "step"),
    (lambda: sample(_L, seeds=_S, step=torch.tensor(-2)), ValueError, r"step = -2 is out of range"),
    (lambda: sample(_L, seeds=_S, step=torch.tensor(2**32), check=True), ValueError, "step = 4294967296"),
    (lambda: sample(_L, seeds=_S, step=torch.zeros(3, 1, dtype=torch.long)), TypeError, r"\[\] or \[B\]"),
    (lambda: sample(_L, seeds=_S, step=torch.tensor(1.0)), TypeError, "step must be an int or an integer tensor"),
    (lambda: sample(_L[0], seeds=_S), ValueError, r"\[B, V\]"),
    (lambda: sample(_L.double(), seeds=_S), TypeError, "float32, bfloat16 or float16"),
    (lambda: sample(_L.long(), seeds=_S), TypeError, "logits"),
    (lambda: sample(_L.numpy(), seeds=_S), TypeError, "logits"),
    (lambda: sample(_L, seeds=_S, backend="cuda"), ValueError, "backend"),
    (lambda: sample(_L, seeds=_S, backend="flashinfer"), (ValueError, ImportError), "CUDA|rlk-mm\\[gpu\\]"),
    (lambda: sample_from_hidden(torch.randn(3, 8), torch.randn(10, 7), seeds=_S), ValueError, "hidden size"),
    (lambda: sample_from_hidden(torch.randn(3, 8), torch.randn(10, 8).double(), seeds=_S), TypeError, "dtype|float32"),
    (lambda: sample_from_hidden(torch.randn(3, 8), torch.randn(10, 8), seeds=_S[:2]), ValueError, "seeds has 2"),
    (lambda: sample_from_hidden(torch.randn(3, 2, 8), torch.randn(10, 8), seeds=_S), ValueError, r"\[B, H\]"),
    (lambda: sample_from_hidden(torch.randn(3, 8), torch.randn(10, 8), bias=torch.full((10,), -math.inf), seeds=_S,
                                check=True), ValueError, "every vocabulary entry"),
    (lambda: sample_from_hidden(torch.randn(3, 8), torch.randn(10, 8), bias=torch.full((10,), math.nan), seeds=_S,
                                check=True), ValueError, r"bias\[0\]"),
    (lambda: sample_from_hidden(torch.randn(3, 8), torch.randn(10, 8), seeds=_S, check="yes"), TypeError, "check"),
    (lambda: sample_from_hidden(torch.randn(3, 8), torch.randn(10, 8), seeds=_S, step=torch.arange(2)), ValueError,
     "step has 2 entries"),
    (lambda: sample_from_hidden(torch.randn(3, 8), torch.randn(10, 8), bias=torch.randn(9), seeds=_S), ValueError,
     "bias"),
    (lambda: sample_from_hidden(torch.full((3, 8), math.nan), torch.randn(10, 8), seeds=_S, backend="torch",
                                check=True), ValueError, "hidden row 0"),
    (lambda: sample_from_hidden(torch.randn(3, 8), torch.randn(10, 8), seeds=_S, temperature=0), ValueError, "greedy"),
    (lambda: sample_from_hidden(torch.randn(3, 8), torch.randn(10, 8), seeds=_S, backend="flashinfer"),
     ValueError, "logits only"),
    (lambda: group_seeds(0, ["a", None], 0), (TypeError, ValueError), "group_ids"),
    (lambda: group_seeds(0, "ab", 0), (TypeError, ValueError), "group_ids"),
    (lambda: group_seeds(1.5, ["a"], 0), TypeError, "seed"),
    (lambda: group_seeds(0, ["a"], -1), ValueError, "step"),
]


@pytest.mark.parametrize("call, error, match", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_is_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_bad_rows_are_refused_by_each_backend_when_checked(be):
    with pytest.raises(ValueError, match=r"logits\[1, 4\] is NaN"):
        sample(_nan_row(), seeds=_S, backend=be, top_k=3, check=True)
    with pytest.raises(ValueError, match="row 0 is -inf at every entry"):
        sample(_masked_row(), seeds=_S, backend=be, check=True)
    hidden = torch.randn(3, 8)
    hidden[1, 2] = math.nan
    for kw in ({}, {"top_k": 2}):
        with pytest.raises(ValueError, match="hidden row 1 gives NaN"):
            sample_from_hidden(hidden, torch.randn(40, 8), seeds=_S, backend=be, check=True, **kw)


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_bad_rows_give_nan_log_probs_by_default(be):
    """The default path reads nothing back: a bad row's log-probs are NaN, the others are
    exactly what they are in a batch of good rows."""
    filters = ({"top_k": 3}, {"top_p": 0.9}, {"min_p": 0.1}, {"top_p": 0.8, "min_p": 0.05})
    good = [sample(_L, seeds=_S, backend=be, **kw) for kw in filters]
    for bad, r in ((_nan_row(), 1), (_inf_row(), 2), (_masked_row(), 0)):
        for kw, want in zip(({}, *filters), (None, *good)):
            out = sample(bad, seeds=_S, backend=be, **kw)
            assert bool(out.log_probs[r].isnan()) and bool(out.sampled_log_probs[r].isnan()), (r, kw)
            ok = torch.arange(3) != r
            if want is not None:
                assert all(torch.equal(x[ok], y[ok]) for x, y in zip(out, want)), (r, kw)
    hidden = torch.randn(3, 8)
    hidden[1, 2] = math.nan
    for kw in ({}, {"top_k": 2}):
        out = sample_from_hidden(hidden, torch.randn(40, 8), seeds=_S, backend=be, **kw)
        assert bool(out.log_probs[1].isnan()) and bool(torch.isfinite(out.log_probs[[0, 2]]).all()), kw


_BAD_KINDS = ("nan", "+inf", "-inf everywhere", "nan among -inf", "overflow once tempered", "-inf once tempered",
              "one finite entry", "hidden nan", "hidden +inf", "bias -inf everywhere", "bias +inf")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), kind=st.sampled_from(_BAD_KINDS), V=st.integers(2, 70),
       filters=st.sampled_from([{}, {"top_k": 3}, {"top_p": 0.6}, {"min_p": 0.2}, {"top_k": 4, "top_p": 0.9}]))
def test_a_bad_row_gets_one_status_token_and_log_probs_on_every_backend(data, kind, V, filters):
    """Whatever makes a row bad (a NaN or +inf logit, -inf everywhere, an overflow once tempered;
    in the logits, the hidden state or the bias), under any filter, the torch and Triton backends
    give it the same status, token and log-probs, the documented ones (token 0, NaN log-probs;
    status 2 where every logit is -inf, else 1), and the other rows what they get in a good batch."""
    from rlk_mm.ops._triton.sampling import sample_hidden, sample_logits

    g = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    B, H = 3, 8
    r, j = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, V - 1))
    seeds, steps = torch.arange(B) * 7 + 1, torch.full((B,), 4)
    inv_t = ref.fp32(1 / 0.5)
    f = ref.Filters(filters.get("top_k") if filters.get("top_k", V) < V else None, filters.get("top_p"),
                    ref.fp32(math.log(filters["min_p"])) if "min_p" in filters else None)
    if kind.startswith(("hidden", "bias")):
        hidden, weight, bias = torch.randn(B, H, generator=g), torch.randn(V, H, generator=g), torch.zeros(V)
        clean = ref.sample_hidden_rows(hidden, weight, bias, 0.5, f, seeds, steps)
        if kind.startswith("hidden"):
            hidden[r, j % H] = math.nan if kind == "hidden nan" else math.inf
        elif kind == "bias +inf":
            bias[j] = math.inf
        else:
            bias[:] = -math.inf
        want = ref.ALL_MASKED if kind == "bias -inf everywhere" else ref.NOT_FINITE
        bad_rows = [r] if kind.startswith("hidden") else list(range(B))
        outs = [ref.sample_hidden_rows(hidden, weight, bias, 0.5, f, seeds, steps),
                sample_hidden(hidden, weight, bias, 0.5, f, seeds, steps)]
    else:
        x = torch.randn(B, V, generator=g)
        clean = ref.sample_rows(x, inv_t, f, seeds, steps)
        if kind == "nan":
            x[r, j] = math.nan
        elif kind == "+inf":
            x[r, j] = math.inf
        elif kind == "overflow once tempered":
            x[r, j] = 3e38
        elif kind == "-inf once tempered":
            x[r] = -3e38
        else:
            x[r] = -math.inf
            x[r, j] = {"nan among -inf": math.nan, "one finite entry": 0.25}.get(kind, -math.inf)
        want = (ref.OK if kind == "one finite entry" else
                ref.ALL_MASKED if kind in ("-inf everywhere", "-inf once tempered") else ref.NOT_FINITE)
        bad_rows = [r]
        outs = [ref.sample_rows(x, inv_t, f, seeds, steps), sample_logits(x, inv_t, f, seeds, 4)]
    good = [row for row in range(B) if row not in bad_rows]
    # the logits of the two backends' LM heads agree to the contract, not bitwise: compare their good rows
    # only from logits (from hidden states, each backend's good rows are finite)
    compared = list(range(B)) if kind[0] not in "hb" else bad_rows
    for out in outs:
        tok, lp, slp, status = out
        assert torch.equal(status[bad_rows], torch.full((len(bad_rows),), want, dtype=torch.int8)), (kind, outs)
        assert torch.equal(status[good], torch.zeros(len(good), dtype=torch.int8)), (kind, outs)
        if want == ref.OK:  # the one finite entry
            assert int(tok[r]) == j and lp[r] == 0.0 and slp[r] == 0.0, (kind, outs)
        else:
            assert (tok[bad_rows] == 0).all() and lp[bad_rows].isnan().all() and slp[bad_rows].isnan().all(), outs
        assert torch.isfinite(lp[good]).all() and torch.isfinite(slp[good]).all(), (kind, outs)
    for a, b in zip(*outs):
        a, b = a[compared], b[compared]
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]), (kind, outs)
    assert all(torch.equal(o[good], c[good]) for o, c in zip(outs[0], clean)), (kind, outs, clean)


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_step_as_a_tensor_draws_as_the_int(be):
    """A 0-d or per-row step tensor (what a CUDA graph replays) draws what the int step draws."""
    logits, seeds = _small_batch(B=3, V=70)
    for kw in ({}, {"top_k": 4, "top_p": 0.8}):
        want = sample(logits, seeds=seeds, step=5, backend=be, **kw)
        for step in (torch.tensor(5), torch.tensor(5, dtype=torch.int32), torch.full((3,), 5)):
            got = sample(logits, seeds=seeds, step=step, backend=be, **kw)
            assert all(torch.equal(x, y) for x, y in zip(want, got)), (step, kw)
        rows = sample(logits, seeds=seeds, step=torch.tensor([5, 6, 5]), backend=be, **kw)
        assert torch.equal(rows.tokens[[0, 2]], want.tokens[[0, 2]])
        one = sample(logits[1:2], seeds=seeds[1:2], step=6, backend=be, **kw)
        assert all(torch.equal(x[1:2], y) for x, y in zip(rows, one))
    h, w = torch.randn(3, 16), torch.randn(70, 16)
    a = sample_from_hidden(h, w, seeds=seeds, step=3, backend=be)
    b = sample_from_hidden(h, w, seeds=seeds, step=torch.tensor(3), backend=be)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=st.integers(0, 2**32 - 1), seed=st.integers(-(2**63), 2**63 - 1), per_row=st.booleans(),
       top_k=st.none() | st.integers(1, 12))
def test_any_step_tensor_equals_its_int(step, seed, per_row, top_k):
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(seed % 1000))
    seeds = torch.tensor([seed, seed ^ 1])
    t = torch.full((2,), step) if per_row else torch.tensor(step)
    a = sample(logits, seeds=seeds, step=step, top_k=top_k, backend="torch")
    b = sample(logits, seeds=seeds, step=t, top_k=top_k, backend="torch", check=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_flashinfer_missing_names_the_install_command():
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install rlk-mm\[gpu\]"):
            _fi.flashinfer_sampling()
    else:
        assert _fi.flashinfer_sampling().__name__ == "flashinfer.sampling"


def test_empty_batch():
    out = sample(torch.zeros(0, 10), seeds=torch.zeros(0, dtype=torch.long))
    assert out.tokens.shape == (0,) and out.tokens.dtype == torch.int64 and out.log_probs.dtype == torch.float32


# ------------------------------------------------------------------ the benchmark's CPU mode
def test_bench_sampling_dry_run(tmp_path):
    """``bench/bench_sampling.py --dry-run``: every section runs on the CPU and the JSON has the
    fields the GPU run fills (host syncs: None without CUDA)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-m", "bench.bench_sampling", "--dry-run", "--out", str(tmp_path)], cwd=root,
                   check=True, timeout=600, capture_output=True)
    result = json.loads((tmp_path / "sampling.json").read_text())
    for section in ("from_logits", "from_hidden", "invariance", "verdict"):
        assert "error" not in result[section], result[section]
    assert result["invariance"]["ours_bitwise"] is True
    assert set(result["from_logits"][0]["host_syncs"]) >= {"ours", "ours_plain", "torch_topk_topp"}


# ------------------------------------------------------------------ properties
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    V=st.integers(1, 80),
    temperature=st.floats(0.05, 5.0),
    top_k=st.none() | st.integers(1, 100),
    top_p=st.none() | st.floats(0.01, 1.0),
    min_p=st.none() | st.floats(0.0, 1.0),
    seed=st.integers(-(2**63), 2**63 - 1),
)
def test_any_valid_input_gives_a_kept_token_and_consistent_log_probs(data, V, temperature, top_k, top_p, min_p, seed):
    values = data.draw(st.lists(st.floats(-30, 30) | st.just(-math.inf), min_size=V, max_size=V))
    if all(v == -math.inf for v in values):
        values[data.draw(st.integers(0, V - 1))] = 0.0
    row = torch.tensor(values, dtype=torch.float32)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    step = data.draw(st.integers(0, 2**32 - 1))
    out = sample(row[None], seeds=torch.tensor([seed]), step=step, backend="torch", **kw)
    tok = int(out.tokens[0])
    assert 0 <= tok < V and row[tok] > -math.inf
    assert float(out.sampled_log_probs[0]) >= float(out.log_probs[0]) - 1e-6 and float(out.sampled_log_probs[0]) <= 1e-6
    z = row * torch.tensor(1 / temperature, dtype=torch.float32)
    if top_k is not None:  # the token is among the top k (ties at the boundary kept)
        assert int((z > z[tok]).sum()) < top_k
    if min_p is not None and min_p > 0:
        assert float(z[tok] - z.max()) >= math.log(min_p) - 1e-6
    plain = torch.log_softmax(z.double(), -1)[tok]
    assert abs(float(out.log_probs[0]) - float(plain)) <= 1e-5 * max(1.0, abs(float(plain)))
    again = sample(row[None], seeds=torch.tensor([seed]), step=0, backend="torch", **kw)
    same = sample(row[None], seeds=torch.tensor([seed]), step=0, backend="torch", **kw)
    assert torch.equal(again.tokens, same.tokens)
