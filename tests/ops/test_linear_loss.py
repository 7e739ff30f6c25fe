"""linear_policy_loss on CPU, both backends (Triton under TRITON_INTERPRET=1): against
``policy_loss(selected_logprob(...))`` and an fp64 oracle (full logits, autograd) within the
numerical contract, for every aggregation mode, KL kind, the entropy bonus, dual clip, IS
weights, GSPO, temperature, a -inf bias, empty selections, a frozen head or hidden states,
several chunks; log-probs bitwise invariant to batch composition and row order; gradients
bitwise run to run; the RLBatch path; bad inputs. tests/ops/test_linear_loss_gpu.py holds the
GPU checks."""

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oracles import loss as ref
from rlk_mm.ops import linear_policy_loss, policy_loss, selected_logprob
from rlk_mm.ops._triton import linear_loss as triton_linear_loss
from rlk_mm.ops._triton import lm_head
from rlk_mm.ops._triton import logprob as triton_logprob
from rlk_mm.ops.options import AggMode
from rlk_mm.parity.contract import ELEMENTWISE_LOSS_MAX_ABS, LOGPROB_GRAD_REL, LOGPROB_MAX_ABS, relative_error
from rlk_mm.schema import RLBatch
from rlk_mm.schema.spans import Span, SpanTable
from support.helpers import GRAD_SCALES, same_bits, scaled_pair

B, R, H, V = 4, 9, 48, 160  # n = B * R scored rows of T hidden rows
T = 45


def make_case(dtype=torch.float32, seed=0, bias=False):
    """Hidden states, head, scored rows (B samples of R tokens each, in sample order), and
    the per-token loss inputs, compact [n]; a ragged mask with one sample fully masked."""
    g = torch.Generator().manual_seed(seed)
    n = B * R
    c = {
        "hidden": torch.randn(T, H, generator=g).to(dtype),
        "weight": (torch.randn(V, H, generator=g) * 0.3).to(dtype),
        "bias": (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None,
        "index": torch.randperm(T, generator=g)[:n],
        "targets": torch.randint(0, V, (n,), generator=g),
        "sample_index": torch.arange(B).repeat_interleave(R),
        "advantages": torch.randn(n, generator=g),
        "ref_log_probs": -torch.rand(n, generator=g) * 6,
        "rollout_is_weights": torch.rand(n, generator=g) * 2,
    }
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    mask = (torch.arange(R)[None, :] < lengths[:, None])
    mask[1] = False
    c["mask"] = mask.reshape(-1)
    c["old_log_probs"] = -torch.rand(n, generator=g) * 6
    return c


def run_fused(c, requires=(True, True, True), **knobs):
    """linear_policy_loss and its gradients (None where not required)."""
    leaves = [None if t is None else t.clone().requires_grad_(r)
              for t, r in zip((c["hidden"], c["weight"], c["bias"]), requires)]
    out = linear_policy_loss(
        leaves[0], leaves[1], index=c["index"], targets=c["targets"], bias=leaves[2],
        old_log_probs=c["old_log_probs"], advantages=c["advantages"], mask=c["mask"],
        sample_index=c["sample_index"], num_samples=B, **knobs,
    )
    if out.loss.requires_grad:
        out.loss.backward()
    return out, [None if t is None else t.grad for t in leaves]


def run_composed(c, temperature=1.0, **knobs):
    """policy_loss(selected_logprob(...)): the four-product path."""
    leaves = [None if t is None else t.clone().requires_grad_() for t in (c["hidden"], c["weight"], c["bias"])]
    logp, ent = selected_logprob(leaves[0], leaves[1], index=c["index"], targets=c["targets"], bias=leaves[2],
                                 temperature=temperature, return_entropy=True)
    loss, metrics = policy_loss(logp, c["old_log_probs"], c["advantages"], c["mask"], sample_index=c["sample_index"],
                                num_samples=B, entropy=ent, **knobs)
    loss.backward()
    return loss, metrics, logp.detach(), ent.detach(), [None if t is None else t.grad for t in leaves]


def run_oracle(c, temperature=1.0, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, ratio="token",
               rollout_is_weights=None, ref_log_probs=None,
               kl_type="low_var_kl", kl_coef=0.0, entropy_coeff=0.0, loss_agg_mode="token-mean", **agg_kw):
    """fp64 full logits, the padded-layout reference losses, autograd."""
    leaves = [None if t is None else t.double().requires_grad_() for t in (c["hidden"], c["weight"], c["bias"])]
    z = leaves[0][c["index"]] @ leaves[1].T
    if leaves[2] is not None:
        z = z + leaves[2]
    logp_all = (z / temperature).log_softmax(-1)
    logp = logp_all.gather(1, c["targets"][:, None]).squeeze(1)
    ent = -torch.where(logp_all.exp() > 0, logp_all.exp() * logp_all, torch.zeros((), dtype=torch.float64)).sum(-1)
    pad = lambda t: None if t is None else t.double().reshape(B, R)  # noqa: E731
    mask = c["mask"].reshape(B, R)
    agg_kw = {k: v for k, v in agg_kw.items() if v is not None}
    pg, metrics = ref.ppo_loss(pad(logp), pad(c["old_log_probs"]), pad(c["advantages"]), mask, clip_low=clip_ratio_low,
                               clip_high=clip_ratio_high, clip_c=clip_ratio_c,
                               rollout_is_weights=pad(rollout_is_weights), mode=loss_agg_mode, ratio=ratio, **agg_kw)
    loss = pg
    metrics["pg_loss"] = pg
    if ref_log_probs is not None:
        kl = ref.agg(ref.kl(pad(logp), pad(ref_log_probs), kl_type), mask, loss_agg_mode, **agg_kw)
        loss = loss + kl_coef * kl
        metrics["kl_loss"] = kl
    entropy_loss = ref.agg(pad(ent), mask, loss_agg_mode, **agg_kw)
    metrics["entropy_loss"] = entropy_loss
    loss = loss - entropy_coeff * entropy_loss
    loss.backward()
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, logp.detach(), ent.detach(), [
        None if t is None else t.grad for t in leaves]


def check_against(out, grads, expected, dtype, grad_tol=None):
    """Loss, metrics, log-probs, entropies and gradients within the contract of ``expected``."""
    loss, metrics, logp, ent, e_grads = expected
    tol = LOGPROB_MAX_ABS.for_dtype(dtype)
    loss_tol = max(ELEMENTWISE_LOSS_MAX_ABS.for_dtype(dtype), tol)
    gtol = grad_tol or LOGPROB_GRAD_REL.for_dtype(dtype)
    assert (out.log_probs.double() - logp.double()).abs().max() <= tol
    assert (out.entropy.double() - ent.double()).abs().max() <= tol
    assert abs(out.loss.item() - loss.item()) <= loss_tol * max(1.0, abs(loss.item()))
    for k, v in metrics.items():
        assert k in out.metrics, k
        assert abs(out.metrics[k].item() - v.item()) <= loss_tol * max(1.0, abs(v.item())), k
    for name, a, e in zip(("hidden", "weight", "bias"), grads, e_grads):
        assert (a is None) == (e is None), name
        if a is not None:
            assert relative_error(a, e) <= gtol, name


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("mode", [m.value for m in AggMode])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_aggregation_mode_matches_composition_and_oracle(backend, mode, dtype):
    c = make_case(dtype, seed=1, bias=True)
    knobs = dict(loss_agg_mode=mode, ref_log_probs=c["ref_log_probs"], kl_coef=0.1, entropy_coeff=0.01)
    if mode.startswith("seq-mean"):
        knobs.update(dp_size=2, global_batch_size=8)
    if mode == "seq-mean-token-sum-norm":
        knobs.update(loss_scale_factor=R)
    out, grads = run_fused(c, temperature=0.9, **knobs)
    check_against(out, grads, run_composed(c, temperature=0.9, **knobs), dtype)
    check_against(out, grads, run_oracle(c, temperature=0.9, **knobs), dtype)
    assert out.log_probs.dtype == out.entropy.dtype == out.loss.dtype == torch.float32
    assert not out.log_probs.requires_grad and not out.entropy.requires_grad


@pytest.mark.parametrize("kl_type", ["k1", "abs", "k2", "low_var_kl", "k3+"])
def test_every_kl_kind(backend, kl_type):
    c = make_case(seed=2)
    knobs = dict(ref_log_probs=c["ref_log_probs"], kl_type=kl_type, kl_coef=0.3)
    out, grads = run_fused(c, **knobs)
    check_against(out, grads, run_oracle(c, **knobs), torch.float32)
    check_against(out, grads, run_composed(c, **knobs), torch.float32)


@pytest.mark.parametrize("knobs", [
    {"clip_ratio_c": None},
    {"clip_ratio_c": 1.5, "clip_ratio_high": 0.28},
    {"rollout_is_weights": "case"},
    {"entropy_coeff": 0.2, "temperature": 0.35},
    {"temperature": 2.5, "loss_agg_mode": "token-sum", "dp_size": 3},
    {"loss_agg_mode": "token-mean", "batch_num_tokens": 50},
], ids=["no-dual-clip", "dual-clip", "is-weights", "entropy-low-temperature", "high-temperature", "global-tokens"])
def test_knobs_match_oracle(backend, knobs):
    c = make_case(seed=3, bias=True)
    knobs = {k: (c[k] if v == "case" else v) for k, v in knobs.items()}
    out, grads = run_fused(c, **knobs)
    check_against(out, grads, run_oracle(c, **knobs), torch.float32)


@pytest.mark.parametrize("ratio", ["gspo_token", "gspo"])
def test_sequence_ratios_run_the_four_product_path(backend, ratio):
    """GSPO needs a sequence's every log-prob before any gradient: the same results as the composition."""
    c = make_case(seed=4)
    out, grads = run_fused(c, ratio=ratio, entropy_coeff=0.05)
    composed = run_composed(c, ratio=ratio, entropy_coeff=0.05)
    check_against(out, grads, composed, torch.float32)
    check_against(out, grads, run_oracle(c, ratio=ratio, entropy_coeff=0.05), torch.float32)


def test_minus_inf_bias_masks_vocabulary(backend):
    """Masked entries: probability 0, gradient 0, never NaN; targets only where finite."""
    c = make_case(seed=5, bias=True)
    c["bias"][:40] = -math.inf
    c["bias"][100:103] = -math.inf
    c["targets"] = 40 + c["targets"] % 60
    knobs = dict(entropy_coeff=0.1, ref_log_probs=c["ref_log_probs"], kl_coef=0.2)
    out, grads = run_fused(c, **knobs)
    keep = torch.isfinite(c["bias"])
    masked = dict(c, weight=c["weight"][keep], bias=c["bias"][keep], targets=c["targets"] - 40)
    expected = run_oracle(masked, **knobs)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.count_nonzero(grads[1][~keep]) == 0 and torch.count_nonzero(grads[2][~keep]) == 0
    check_against(out, [grads[0], grads[1][keep], grads[2][keep]], expected, torch.float32)


def test_empty_selection(backend):
    c = make_case()
    empty = dict(c, index=c["index"][:0], targets=c["targets"][:0], sample_index=c["sample_index"][:0],
                 old_log_probs=c["old_log_probs"][:0], advantages=c["advantages"][:0], mask=c["mask"][:0])
    out, grads = run_fused(empty, entropy_coeff=0.1)
    assert out.loss.item() == 0.0 and out.log_probs.shape == (0,) and out.entropy.shape == (0,)
    assert all(torch.count_nonzero(g) == 0 for g in grads[:2])


@pytest.mark.parametrize("requires", [(True, False, False), (False, True, True)], ids=["frozen-head", "frozen-hidden"])
def test_frozen_inputs_skip_their_product(backend, requires, monkeypatch):
    c = make_case(seed=6, bias=True)
    asked = []
    for module in (triton_linear_loss, __import__("rlk_mm.ops._torch.linear_loss", fromlist=["x"])):
        original = module.loss_grads

        def spy(*args, original=original, **kwargs):
            asked.append(args[-3:])
            return original(*args, **kwargs)

        monkeypatch.setattr(module, "loss_grads", spy)
    out, grads = run_fused(c, requires=requires, entropy_coeff=0.1)
    assert asked == [requires]
    expected = run_oracle(c, entropy_coeff=0.1)
    check_against(out, grads, expected[:4] + ([e if r else None for e, r in zip(expected[4], requires)],),
                  torch.float32)


def test_no_grad_gives_the_loss_only(backend):
    c = make_case(seed=7)
    with torch.no_grad():
        out, grads = run_fused(c)
    assert not out.loss.requires_grad and grads == [None, None, None]
    check_against(out, [None] * 3, run_oracle(c)[:4] + ([None] * 3,), torch.float32)


def test_backward_scales_by_the_incoming_gradient_and_runs_once(backend):
    c = make_case(seed=8)
    _, grads = run_fused(c)
    h, w = c["hidden"].clone().requires_grad_(), c["weight"].clone().requires_grad_()
    out = linear_policy_loss(h, w, index=c["index"], targets=c["targets"], old_log_probs=c["old_log_probs"],
                             advantages=c["advantages"], mask=c["mask"], sample_index=c["sample_index"], num_samples=B)
    (out.loss * -2.5).backward(retain_graph=True)
    torch.testing.assert_close(h.grad, grads[0] * -2.5)
    torch.testing.assert_close(w.grad, grads[1] * -2.5)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.loss.backward()


@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, s) for s in GRAD_SCALES]
                         + [(torch.bfloat16, 1.0), (torch.float16, 1.0)])
def test_triton_gradient_scale_is_torch_mul_bitwise(dtype, scale):
    """The backward's in-place scale (``_triton.linear_loss.scale_``) is torch's ``mul_`` bit
    for bit: fp32 at every scale, every dtype at scale 1 (nothing is written). 16-bit
    products at other scales are checked on the card (``test_linear_loss_gpu.py``): the
    interpreter rounds fp32 to 16 bits towards zero, a GPU (and torch) to nearest."""
    assert same_bits(*scaled_pair(dtype, scale))


# ----------------------------------------------------------------------------- chunks, invariance, determinism
@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 16 rows (the interpreter's row tile) on the Triton path: several per call."""
    original = triton_logprob.default_config

    def config(dtype, device, rows=None):
        cfg = original(dtype, device, rows=rows)
        return type(cfg)(**{**cfg.__dict__, "linear_budget": 16 * V * torch.finfo(dtype).bits // 8})

    monkeypatch.setattr(triton_linear_loss, "default_config", config)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 20_000), V=st.integers(1, 300_000), H=st.integers(1, 16_384),
       budget_mib=st.integers(1, 2048), block_m=st.sampled_from([16, 64, 128]))
def test_chunk_rows_are_the_fewest_equal_chunks_within_the_budget(n, V, H, budget_mib, block_m):
    cfg = replace(lm_head.default_config(torch.bfloat16, torch.device("cpu")), block_m=block_m,
                  linear_budget=budget_mib << 20)
    rows = triton_linear_loss.chunk_rows(n, V, H, torch.bfloat16, cfg)
    per_row = 2 * V + 4 * H + 12 * -(-V // lm_head.partial_columns(cfg))
    assert rows % block_m == 0 and rows >= block_m
    assert rows == block_m or rows * per_row <= cfg.linear_budget  # one tile of rows may exceed a tiny budget
    chunks = -(-n // rows)
    fewest = -(-n // max(block_m, cfg.linear_budget // per_row // block_m * block_m))
    assert chunks == fewest
    last = n - (chunks - 1) * rows
    assert 0 < last <= rows and rows - last < chunks * block_m


def test_several_chunks_give_one_chunks_results(small_chunks):
    from support.helpers import use_backend

    c = make_case(torch.bfloat16, seed=9, bias=True)
    knobs = dict(ref_log_probs=c["ref_log_probs"], kl_coef=0.1, entropy_coeff=0.01, loss_agg_mode="seq-mean-token-mean")
    with use_backend("triton"):
        assert triton_linear_loss.chunk_rows(B * R, V, H, torch.bfloat16, triton_linear_loss.default_config(
            torch.bfloat16, torch.device("cpu"))) == 16
        out, grads = run_fused(c, **knobs)
        check_against(out, grads, run_composed(c, **knobs), torch.bfloat16)
    check_against(out, grads, run_oracle(c, **knobs), torch.bfloat16)


@pytest.mark.parametrize("ratio", ["token", "gspo"])
def test_on_policy_old_log_probs_are_this_calls_own(backend, small_chunks, ratio):
    """old_log_probs=None: the composition with old = the detached log-probs (ratio 1), over
    several chunks (Triton) and without gradients (where no chunk's upstream runs)."""
    c = make_case(seed=12, bias=True)
    with torch.no_grad():
        own = selected_logprob(c["hidden"], c["weight"], index=c["index"], targets=c["targets"], bias=c["bias"],
                               temperature=0.8)
    knobs = dict(ref_log_probs=c["ref_log_probs"], kl_coef=0.1, entropy_coeff=0.01, ratio=ratio)
    out, grads = run_fused({**c, "old_log_probs": None}, temperature=0.8, **knobs)
    check_against(out, grads, run_composed({**c, "old_log_probs": own}, temperature=0.8, **knobs), torch.float32)
    assert out.metrics["pg_clipfrac"].item() == 0.0 and out.metrics["ppo_kl"].item() == 0.0
    with torch.no_grad():
        plain = linear_policy_loss(c["hidden"], c["weight"], index=c["index"], targets=c["targets"], bias=c["bias"],
                                   old_log_probs=None, advantages=c["advantages"], mask=c["mask"], temperature=0.8,
                                   sample_index=c["sample_index"], num_samples=B, **knobs)
    assert plain.loss.item() == out.loss.item()


def test_log_probs_bitwise_invariant_to_batch_composition_and_order(backend, small_chunks):
    c = make_case(torch.bfloat16, seed=10)
    n = B * R

    def fused(rows):
        sub = dict(c, index=c["index"][rows], targets=c["targets"][rows],
                   sample_index=torch.zeros(len(rows), dtype=torch.long),
                   old_log_probs=c["old_log_probs"][rows], advantages=c["advantages"][rows], mask=c["mask"][rows])
        out = linear_policy_loss(sub["hidden"], sub["weight"], index=sub["index"], targets=sub["targets"],
                                 old_log_probs=sub["old_log_probs"], advantages=sub["advantages"],
                                 sample_index=sub["sample_index"], num_samples=1)
        return out.log_probs, out.entropy

    full = fused(torch.arange(n))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    shuffled = fused(perm)
    alone = fused(torch.tensor([7]))
    assert torch.equal(shuffled[0], full[0][perm]) and torch.equal(shuffled[1], full[1][perm])
    assert torch.equal(alone[0], full[0][7:8]) and torch.equal(alone[1], full[1][7:8])


def test_gradients_bitwise_run_to_run(backend, small_chunks):
    c = make_case(torch.bfloat16, seed=11, bias=True)
    knobs = dict(ref_log_probs=c["ref_log_probs"], kl_coef=0.1, entropy_coeff=0.01)
    (a, ga), (b, gb) = run_fused(c, **knobs), run_fused(c, **knobs)
    assert torch.equal(a.loss, b.loss) and all(torch.equal(x, y) for x, y in zip(ga, gb))


# ----------------------------------------------------------------------------- the batch path
def _batch():
    """Two text samples; loss spans [3, 5) + [6, 7) and [2, 5): 6 scored tokens."""
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(12))
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
    g = torch.Generator().manual_seed(13)
    h, w = torch.randn(12, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    old, adv = -torch.rand(6, generator=g) * 5, torch.randn(6, generator=g)
    rows, tgts = batch.loss_token_index()
    expected = linear_policy_loss(h, w, index=rows, targets=tgts, old_log_probs=old, advantages=adv,
                                  sample_index=batch.loss_token_sample(), num_samples=2,
                                  loss_agg_mode="seq-mean-token-mean")
    packed = linear_policy_loss(h, w, batch, old_log_probs=old, advantages=adv, loss_agg_mode="seq-mean-token-mean")
    right, left = torch.zeros(2, 8, H), torch.zeros(2, 8, H)
    right[0, :7], right[1, :5] = h[:7], h[7:]
    left[0, 1:], left[1, 3:] = h[:7], h[7:]
    for out in (packed,
                linear_policy_loss(right, w, batch, padding="right", old_log_probs=old, advantages=adv,
                                   loss_agg_mode="seq-mean-token-mean"),
                linear_policy_loss(left, w, batch, padding="left", old_log_probs=old, advantages=adv,
                                   loss_agg_mode="seq-mean-token-mean")):
        assert torch.equal(out.loss, expected.loss) and torch.equal(out.log_probs, expected.log_probs)
    padded = right
    with pytest.raises(ValueError, match="padding side is ambiguous"):
        linear_policy_loss(padded, w, batch, old_log_probs=old, advantages=adv)
    with pytest.raises(ValueError, match="leave sample_index and num_samples out"):
        linear_policy_loss(h, w, batch, old_log_probs=old, advantages=adv, sample_index=batch.loss_token_sample(),
                           num_samples=2)


def test_out_of_vocabulary_batch_token_named_by_sample_and_position(backend):
    batch = _batch()
    batch.input_ids[9] = V + 3  # sample 1, position 2: a loss token
    with pytest.raises(ValueError, match=r"sample 1, position 2 holds token 163"):
        linear_policy_loss(torch.randn(12, H), torch.randn(V, H), batch, old_log_probs=torch.zeros(6),
                           advantages=torch.zeros(6))


# ----------------------------------------------------------------------------- bad inputs
def _call(c, **change):
    args = dict(hidden=c["hidden"], weight=c["weight"], index=c["index"], targets=c["targets"],
                old_log_probs=c["old_log_probs"], advantages=c["advantages"], mask=c["mask"],
                sample_index=c["sample_index"], num_samples=B)
    args.update(change)
    return linear_policy_loss(args.pop("hidden"), args.pop("weight"), **args)


_C = make_case()
_NAN_ADV = _C["advantages"].clone()
_NAN_ADV[R * 2] = math.nan  # sample 2, position 0: scored
_BAD = [
    ({"old_log_probs": _C["old_log_probs"][:-1]}, ValueError,
     r"old_log_probs has shape \(35,\) but 36 tokens are scored"),
    ({"old_log_probs": _C["old_log_probs"].tolist()}, TypeError, "old_log_probs must be a torch.Tensor"),
    ({"advantages": _NAN_ADV}, ValueError, r"advantages\[18\] \(sample 2\)"),
    ({"advantages": _C["advantages"][:5]}, ValueError, "advantages"),
    ({"targets": _C["targets"].clone().index_fill_(0, torch.tensor([3]), V)}, ValueError,
     r"targets\[3\] = 160 is out of range"),
    ({"targets": _C["targets"].clone().index_fill_(0, torch.tensor([4]), -100)}, ValueError, "ignore index"),
    ({"index": _C["index"].clone().index_fill_(0, torch.tensor([2]), T)}, ValueError,
     r"index\[2\] = 45 is out of range"),
    ({"index": _C["index"].float()}, TypeError, "index must be an integer tensor"),
    ({"hidden": _C["hidden"][None, None]}, ValueError, r"hidden must be \[T, H\] \(packed\) or \[B, L, H\]"),
    ({"hidden": _C["hidden"].double()}, TypeError, "hidden and weight must share one of"),
    ({"weight": _C["weight"][:, :-1]}, ValueError, "hidden size mismatch"),
    ({"temperature": 0.0}, ValueError, "temperature must be a finite number"),
    ({"temperature": "1"}, TypeError, "temperature must be a number"),
    ({"bias": torch.full((V,), math.nan)}, ValueError, r"bias\[0\] = nan"),
    ({"sample_index": None}, ValueError, "pass sample_index"),
    ({"num_samples": None}, ValueError, "num_samples is required"),
    ({"sample_index": _C["sample_index"].flip(0)}, ValueError, "non-decreasing"),
    ({"mask": _C["mask"].float() * 2 - 1.5}, ValueError, "mask"),
    ({"clip_ratio_low": 1.5}, ValueError, "clip_ratio_low"),
    ({"clip_ratio_c": 0.5}, ValueError, "clip_ratio_c"),
    ({"ratio": "seq"}, ValueError, "ratio"),
    ({"kl_type": "k9", "ref_log_probs": _C["ref_log_probs"]}, ValueError, "kl_type"),
    ({"entropy_coeff": -0.1}, ValueError, "entropy_coeff"),
    ({"loss_agg_mode": "mean"}, ValueError, "loss_agg_mode"),
    ({"dp_size": 0}, ValueError, "dp_size"),
    ({"padding": "right"}, ValueError, "no padding side"),
    ({"batch": "batch", "index": None, "targets": None}, TypeError, "batch must be an RLBatch"),
]


@pytest.mark.parametrize("change,error,match", _BAD, ids=[f"{i}-{next(iter(c))}" for i, (c, _, _) in enumerate(_BAD)])
def test_bad_input_is_refused_before_any_work(backend, change, error, match, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("a kernel ran before the arguments were checked")

    monkeypatch.setattr(triton_linear_loss, "loss_grads", no_work)
    monkeypatch.setattr(__import__("rlk_mm.ops._torch.linear_loss", fromlist=["x"]), "loss_grads", no_work)
    with pytest.raises(error, match=match):
        _call(_C, **change)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    mode=st.sampled_from([m.value for m in AggMode]),
    clip_c=st.sampled_from([None, 2.0, 3.0]),
    temperature=st.floats(0.3, 3.0),
    entropy_coeff=st.sampled_from([0.0, 0.05]),
    seed=st.integers(0, 2**16),
)
def test_random_batches_match_the_composition(lengths, mode, clip_c, temperature, entropy_coeff, seed):
    """Torch backend: ragged samples (some empty), random masks and knobs."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    c = {
        "hidden": torch.randn(T, H, generator=g), "weight": torch.randn(V, H, generator=g) * 0.3, "bias": None,
        "index": torch.randint(0, T, (n,), generator=g), "targets": torch.randint(0, V, (n,), generator=g),
        "sample_index": torch.arange(len(lengths)).repeat_interleave(torch.tensor(lengths)),
        "old_log_probs": -torch.rand(n, generator=g) * 6, "advantages": torch.randn(n, generator=g),
        "mask": torch.rand(n, generator=g) > 0.3,
    }
    knobs = dict(loss_agg_mode=mode, clip_ratio_c=clip_c, entropy_coeff=entropy_coeff)
    if mode == "seq-mean-token-sum-norm":
        knobs.update(loss_scale_factor=6)
    leaves = [c["hidden"].clone().requires_grad_(), c["weight"].clone().requires_grad_()]
    out = linear_policy_loss(*leaves, index=c["index"], targets=c["targets"], temperature=temperature,
                             old_log_probs=c["old_log_probs"], advantages=c["advantages"], mask=c["mask"],
                             sample_index=c["sample_index"], num_samples=len(lengths), **knobs)
    if out.loss.requires_grad:
        out.loss.backward()
    e_leaves = [c["hidden"].clone().requires_grad_(), c["weight"].clone().requires_grad_()]
    logp, ent = selected_logprob(*e_leaves, index=c["index"], targets=c["targets"], temperature=temperature,
                                 return_entropy=True)
    loss, metrics = policy_loss(logp, c["old_log_probs"], c["advantages"], c["mask"], sample_index=c["sample_index"],
                                num_samples=len(lengths), entropy=ent, **knobs)
    if loss.requires_grad:
        loss.backward()
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-6, atol=1e-6)
    for k, v in metrics.items():
        torch.testing.assert_close(out.metrics[k], v, rtol=1e-6, atol=1e-6)
    for a, e in zip(leaves, e_leaves):
        if e.grad is None:
            assert a.grad is None or torch.count_nonzero(a.grad) == 0
        else:
            assert relative_error(a.grad, e.grad) <= LOGPROB_GRAD_REL.fp32
