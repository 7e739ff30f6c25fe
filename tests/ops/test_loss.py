"""Policy loss, KL penalty and aggregation: against real verl 0.9.1 and the references.

Both backends are run on every parity check: torch, and the Triton kernel (under
TRITON_INTERPRET=1 on a machine without CUDA, as conftest sets up). Only the checks against
verl need it (``core_algos``): the rest run without verl.
"""

import importlib
import math

import pytest
import torch

from oracles import loss as ref
from rlk_mm.ops.loss.op import agg_loss, kl_penalty, policy_loss
from rlk_mm.ops.options import AggMode
from rlk_mm.parity.contract import ELEMENTWISE_LOSS_MAX_ABS, LOGPROB_GRAD_REL, relative_error
from support.helpers import close, use_backend

TOL = ELEMENTWISE_LOSS_MAX_ABS.fp32
VERL_MODES = [m.value for m in AggMode if m not in (AggMode.TOKEN, AggMode.SEQ)]


@pytest.fixture
def core_algos(requires_verl):
    """verl's ``verl.trainer.ppo.core_algos`` (skipped without verl; an import error errors)."""
    return importlib.import_module("verl.trainer.ppo.core_algos")


def inputs(seed, B=6, R=23, spread=0.4):
    """Random padded inputs: ragged mask, one all-masked row, some large log-ratios."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(B, R, generator=g) * 0.5 - 1.0
    old = logp + torch.randn(B, R, generator=g) * spread
    old[0, :3] = logp[0, :3] + torch.tensor([25.0, -25.0, 1.5])  # hit the ±20 clamp and the dual clip
    adv = torch.randn(B, R, generator=g)
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    mask = torch.arange(R)[None, :] < lengths[:, None]
    mask[min(2, B - 1)] = False
    return logp.requires_grad_(), old, adv, mask


def actor_config(**kw):
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **kw)


def compact(t, mask):
    return t[mask]


# ----------------------------------------------------------------------------- aggregation, KL
@pytest.mark.parametrize("mode", VERL_MODES)
@pytest.mark.parametrize("global_info",
                         [{},
                          {"dp_size": 4, "batch_num_tokens": 200, "global_batch_size": 24, "loss_scale_factor": 64}])
def test_agg_loss_matches_verl(core_algos, mode, global_info):
    logp, _, _, mask = inputs(1)
    loss_mat = (logp * 1.3).detach().requires_grad_()
    expected = core_algos.agg_loss(loss_mat, mask, mode, **global_info)
    (g_expected,) = torch.autograd.grad(expected, loss_mat)
    actual = agg_loss(loss_mat, mask, mode, **global_info)
    (g_actual,) = torch.autograd.grad(actual, loss_mat)
    close(actual, expected)
    close(g_actual, g_expected)


@pytest.mark.parametrize("mode", ["token", "seq"])
def test_agg_loss_easyr1_modes(mode):
    logp, _, _, mask = inputs(2)
    close(agg_loss(logp, mask, mode), ref.agg(logp, mask, mode))


def test_agg_loss_compact_equals_padded():
    logp, _, _, mask = inputs(3)
    sample = torch.arange(mask.shape[0])[:, None].expand_as(mask)[mask]
    for mode in AggMode:
        kw = {"loss_scale_factor": mask.shape[1]} if mode == "seq-mean-token-sum-norm" else {}
        padded = agg_loss(logp, mask, mode, **kw)
        flat = agg_loss(logp[mask], None, mode, sample_index=sample, num_samples=mask.shape[0], **kw)
        close(flat, padded)


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "abs+", "k2+", "k3+"])
def test_kl_penalty_matches_verl(core_algos, kind):
    logp, old, _, _ = inputs(4, spread=2.0)
    old = old.clone()
    old[1, :4] = logp[1, :4].detach() + torch.tensor([30.0, -30.0, 12.0, 0.0])  # both clamps, and x = 0
    expected = core_algos.kl_penalty(logp, old, kind)
    (g_expected,) = torch.autograd.grad(expected.sum(), logp)
    actual = kl_penalty(logp, old, kind)
    (g_actual,) = torch.autograd.grad(actual.sum(), logp)
    close(actual, expected)
    close(g_actual, g_expected)


# ----------------------------------------------------------------------------- policy loss vs verl
@pytest.mark.parametrize("mode", VERL_MODES)
def test_policy_loss_matches_verl_vanilla(core_algos, backend, mode):
    logp, old, adv, mask = inputs(5)
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(9)) + 0.5
    cfg = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=2.5)
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=90, global_batch_size=11)
    expected, m_expected = core_algos.compute_policy_loss_vanilla(old, logp, adv, mask, mode, cfg, weights)
    (g_expected,) = torch.autograd.grad(expected, logp)
    actual, metrics = policy_loss(
        logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=2.5,
        rollout_is_weights=weights, loss_agg_mode=mode, **cfg.global_batch_info,
    )
    (g_actual,) = torch.autograd.grad(actual, logp)
    close(actual, expected)
    close(g_actual, g_expected)
    assert g_actual.dtype == logp.dtype
    for name in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        assert metrics[name].item() == pytest.approx(m_expected[f"actor/{name}"], abs=TOL)
    assert m_expected["actor/pg_clipfrac_lower"] > 0 and m_expected["actor/pg_clipfrac"] > 0


def test_gspo_matches_verl(core_algos, backend):
    logp, old, adv, mask = inputs(6, spread=0.1)
    old = old.clone()
    old[3] = old[3] - 12.0  # sequence log-ratio above verl's clamp at 10: no gradient there
    cfg = actor_config(clip_ratio_low=0.1, clip_ratio_high=0.15)
    expected, m_expected = core_algos.compute_policy_loss_gspo(old, logp, adv, mask, "seq-mean-token-mean", cfg)
    (g_expected,) = torch.autograd.grad(expected, logp)
    actual, metrics = policy_loss(
        logp, old, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=None,
        ratio="gspo_token", log_ratio_clamp=(None, 10.0), loss_agg_mode="seq-mean-token-mean",
    )
    (g_actual,) = torch.autograd.grad(actual, logp)
    close(actual, expected)
    close(g_actual, g_expected)
    assert g_actual[3].abs().sum() == 0
    for name in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        assert metrics[name].item() == pytest.approx(m_expected[f"actor/{name}"], abs=TOL)


# ----------------------------------------------------------------------------- layouts, terms
@pytest.mark.parametrize("ratio", ["token", "gspo_token", "gspo"])
def test_compact_equals_padded(backend, ratio):
    logp, old, adv, mask = inputs(7)
    B, R = mask.shape
    sample = torch.arange(B)[:, None].expand(B, R)[mask]
    flat_logp = logp.detach()[mask].requires_grad_()
    for mode in AggMode:
        kw = dict(ratio=ratio, loss_agg_mode=mode, loss_scale_factor=R if mode == "seq-mean-token-sum-norm" else None)
        padded, m_padded = policy_loss(logp, old, adv, mask, **kw)
        (g_padded,) = torch.autograd.grad(padded, logp)
        flat, m_flat = policy_loss(flat_logp, old[mask], adv[mask], sample_index=sample, num_samples=B, **kw)
        (g_flat,) = torch.autograd.grad(flat, flat_logp)
        close(flat, padded)
        close(g_flat, g_padded[mask])
        for k in m_padded:
            close(m_flat[k], m_padded[k])


@pytest.mark.parametrize("kl_type", ["low_var_kl", "k1+", "abs"])
def test_kl_and_entropy_terms_match_reference(backend, kl_type):
    logp, old, adv, mask = inputs(8)
    g = torch.Generator().manual_seed(3)
    ref_logp = logp.detach() + torch.randn(mask.shape, generator=g) * 0.3
    entropy = (torch.rand(mask.shape, generator=g) * 2).requires_grad_()
    mode = "seq-mean-token-mean"
    actual, metrics = policy_loss(
        logp, old, adv, mask, ref_log_probs=ref_logp, kl_type=kl_type, kl_coef=0.05,
        entropy=entropy, entropy_coeff=0.01, loss_agg_mode=mode,
    )
    g_actual = torch.autograd.grad(actual, (logp, entropy))
    pg, _ = ref.ppo_loss(logp, old, adv, mask, mode=mode)
    kl = ref.agg(ref.kl(logp, ref_logp, kl_type), mask, mode)
    ent = ref.agg(entropy, mask, mode)
    expected = pg + 0.05 * kl - 0.01 * ent
    g_expected = torch.autograd.grad(expected, (logp, entropy))
    close(actual, expected)
    close(metrics["kl_loss"], kl.detach())
    close(metrics["entropy_loss"], ent.detach())
    for a, e in zip(g_actual, g_expected):
        close(a, e)


def _reference_loss(logp, old, adv, mask, *, ratio, mode, ref_logp, weights, kl_coef=0.1, kl_type="k3",
                    loss_scale_factor=None):
    """fp64 autograd of the documented formula: PPO/GSPO policy term + kl_coef * agg(KL)."""
    d = lambda t: None if t is None else t.detach().double()  # noqa: E731
    up = d(logp).requires_grad_()
    agg_kw = {"loss_scale_factor": loss_scale_factor} if loss_scale_factor is not None else {}
    pg, _ = ref.ppo_loss(up, d(old), d(adv), mask, ratio=ratio, mode=mode, rollout_is_weights=d(weights), **agg_kw)
    loss = pg if ref_logp is None else pg + kl_coef * ref.agg(ref.kl(up, d(ref_logp), kl_type), mask, mode, **agg_kw)
    (grad,) = torch.autograd.grad(loss, up)
    return loss.detach(), grad


@pytest.mark.parametrize("ratio", ["token", "gspo_token", "gspo"])
def test_every_combination_runs_backward_and_matches_fp64(backend, ratio):
    """Every (mode, layout, KL, IS) combination of a ratio runs its
    backward (all eight constant slots of the op filled used to crash it: a tensor list's
    gradient of the wrong structure), and loss and gradient equal fp64 autograd (with
    ``ratio="gspo"`` the KL gradient is per token, not spread over the sequence)."""
    logp, old, adv, mask = inputs(21, B=5, R=9, spread=0.3)
    B, R = mask.shape
    g = torch.Generator().manual_seed(22)
    ref_logp = logp.detach() + 0.4 * torch.randn(B, R, generator=g)
    weights = torch.rand(B, R, generator=g) + 0.5
    sample = torch.arange(B)[:, None].expand(B, R)[mask]
    for mode in AggMode:
        for with_kl, with_is in ((True, True), (True, False), (False, True)):
            kw = dict(ratio=ratio, loss_agg_mode=mode,
                      loss_scale_factor=R if mode == "seq-mean-token-sum-norm" else None)
            refs = dict(ref_logp=ref_logp if with_kl else None, weights=weights if with_is else None)
            expected, g_expected = _reference_loss(logp, old, adv, mask, ratio=ratio, mode=mode,
                                                   loss_scale_factor=kw["loss_scale_factor"], **refs)
            extra = dict(ref_log_probs=refs["ref_logp"], kl_coef=0.1 if with_kl else 0.0,
                         rollout_is_weights=refs["weights"])
            where = f"{mode} kl={with_kl} is={with_is}"
            padded = logp.detach().clone().requires_grad_()
            loss, _ = policy_loss(padded, old, adv, mask, **kw, **extra)
            loss.backward()
            assert abs(loss.item() - expected.item()) <= TOL * max(1.0, abs(expected.item())), where
            assert relative_error(padded.grad, g_expected) <= LOGPROB_GRAD_REL.fp32, where
            flat = logp.detach()[mask].requires_grad_()
            compact = {k: (v[mask] if isinstance(v, torch.Tensor) else v) for k, v in extra.items()}
            loss, _ = policy_loss(flat, old[mask], adv[mask], mask[mask], sample_index=sample, num_samples=B,
                                  **kw, **compact)
            loss.backward()  # the compact layout with a mask fills all eight constant slots
            assert abs(loss.item() - expected.item()) <= TOL * max(1.0, abs(expected.item())), where
            assert relative_error(flat.grad, g_expected[mask]) <= LOGPROB_GRAD_REL.fp32, where


@pytest.mark.parametrize("ratio", ["gspo_token", "gspo"])
def test_linear_policy_loss_gspo_with_kl_matches_fp64(backend, ratio):
    """Every ratio mode through the fused LM-head loss (which runs this op for sequence ratios):
    with a mask, KL and IS weights in a seq mode it runs backward, and d hidden / d weight equal
    fp64 autograd of logits -> log_softmax -> the reference loss (it was 15-19% off with "gspo")."""
    from rlk_mm.ops import linear_policy_loss

    g = torch.Generator().manual_seed(23)
    T, H, V, B = 20, 16, 40, 3
    hidden, weight = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    rows, targets = torch.arange(2, 17), torch.randint(0, V, (15,), generator=g)
    sample = torch.tensor([0] * 4 + [1] * 6 + [2] * 5)
    mask = torch.ones(15, dtype=torch.bool)
    mask[5] = False
    old = -torch.rand(15, generator=g) * 4 - 1.5
    adv, ref_logp = torch.randn(15, generator=g), -torch.rand(15, generator=g) * 5
    weights = torch.rand(15, generator=g) + 0.5
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_policy_loss(h, w, index=rows, targets=targets, old_log_probs=old, advantages=adv, mask=mask,
                             sample_index=sample, num_samples=B, ratio=ratio, ref_log_probs=ref_logp, kl_coef=0.1,
                             rollout_is_weights=weights, loss_agg_mode="seq-mean-token-mean")
    grads = torch.autograd.grad(out.loss, (h, w))
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp = (h64 @ w64.T).log_softmax(-1)[rows, targets]
    col = torch.cat([torch.arange(int((sample == b).sum())) for b in range(B)])
    pad = lambda x, fill=0.0: torch.full((B, 6), fill, dtype=x.dtype).index_put((sample, col), x)  # noqa: E731
    m = pad(mask, False)
    pg, _ = ref.ppo_loss(pad(logp), pad(old.double()), pad(adv.double()), m, ratio=ratio, mode="seq-mean-token-mean",
                         rollout_is_weights=pad(weights.double()))
    expected = pg + 0.1 * ref.agg(ref.kl(pad(logp), pad(ref_logp.double()), "low_var_kl"), m, "seq-mean-token-mean")
    g_expected = torch.autograd.grad(expected, (h64, w64))
    assert abs(out.loss.item() - expected.item()) <= TOL
    for a, e in zip(grads, g_expected):
        assert relative_error(a, e) <= LOGPROB_GRAD_REL.fp32


def test_deterministic_and_backends_agree(backend):
    logp, old, adv, mask = inputs(9, B=5, R=300)  # several kernel blocks
    runs = []
    for be in (backend, backend, "torch"):
        with use_backend(be):
            loss, metrics = policy_loss(logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
            (grad,) = torch.autograd.grad(loss, logp)
        runs.append((loss, grad, metrics["pg_clipfrac"]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))  # bitwise run to run
    close(runs[0][0], runs[2][0])
    assert relative_error(runs[0][1], runs[2][1]) < LOGPROB_GRAD_REL.fp32


def test_bf16_inputs(backend):
    logp, old, adv, mask = inputs(10)
    low = logp.detach().bfloat16().requires_grad_()
    loss, _ = policy_loss(low, old.bfloat16(), adv.bfloat16(), mask)
    (grad,) = torch.autograd.grad(loss, low)
    up = low.detach().float().requires_grad_()
    expected, _ = ref.ppo_loss(up, old.bfloat16().float(), adv.bfloat16().float(), mask)
    (g_expected,) = torch.autograd.grad(expected, up)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    tol = ELEMENTWISE_LOSS_MAX_ABS.for_dtype(torch.bfloat16)
    assert abs(loss.item() - expected.item()) < tol
    assert relative_error(grad, g_expected) < LOGPROB_GRAD_REL.for_dtype(torch.bfloat16)


def test_empty_and_fully_masked():
    logp, old, adv, mask = inputs(11)
    loss, metrics = policy_loss(logp, old, adv, torch.zeros_like(mask))
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == 0 and not grad.any() and metrics["pg_clipfrac"].item() == 0
    empty = torch.zeros(0, requires_grad=True)
    idx = torch.zeros(0, dtype=torch.int64)
    loss, _ = policy_loss(empty, empty.detach(), empty.detach(), sample_index=idx, num_samples=3)
    loss.backward()
    assert loss.item() == 0 and empty.grad.shape == (0,)


# ----------------------------------------------------------------------------- global counts
def _nine_tokens():
    """3 x 3 inputs, every token scored: 9 tokens in 3 sequences."""
    g = torch.Generator().manual_seed(31)
    logp = torch.randn(3, 3, generator=g).requires_grad_()
    return logp, logp.detach() + 0.1, torch.randn(3, 3, generator=g)


@pytest.mark.parametrize("counts, message", [
    (dict(batch_num_tokens=0), r"batch_num_tokens is 0(\.0)? but this batch alone scores 9(\.0)? tokens"),
    (dict(batch_num_tokens=1), r"batch_num_tokens is 1(\.0)? but this batch alone scores 9"),
    (dict(batch_num_tokens=4.5), r"batch_num_tokens is 4\.5 but this batch alone scores 9"),
    (dict(batch_num_tokens=torch.tensor(0)), r"batch_num_tokens is 0(\.0)? but this batch alone scores 9"),
    (dict(batch_num_tokens=torch.tensor(8.0), dp_size=2), r"batch_num_tokens is 8\.0 but this batch alone scores 9"),
    (dict(loss_agg_mode="seq-mean-token-sum", global_batch_size=0),
     r"global_batch_size is 0(\.0)? but this batch alone has 3"),
    (dict(loss_agg_mode="seq-mean-token-mean", global_batch_size=1),
     r"global_batch_size is 1(\.0)? but this batch alone has 3"),
    (dict(loss_agg_mode="seq-mean-token-sum", global_batch_size=torch.tensor(0.0)), r"global_batch_size is 0\.0 but"),
    (dict(loss_agg_mode="seq-mean-token-sum-norm", global_batch_size=3.5),
     r"global_batch_size=3\.5: a count of sequences"),
    (dict(loss_agg_mode="seq-mean-token-mean", global_batch_size=torch.tensor(4.5)),
     r"global_batch_size is 4\.5: a count of"),
])
def test_a_global_count_below_the_data_is_refused(backend, counts, message):
    """A global count is at least what this batch shows (before the dp_size factor); a count of
    sequences is an integer. Such counts gave 0 (no gradient), 9x the mean or 1.6e38."""
    logp, old, adv = _nine_tokens()
    with pytest.raises(ValueError, match=message):
        policy_loss(logp, old, adv, **counts)


def test_a_global_count_at_or_above_the_data_is_accepted(backend):
    logp, old, adv = _nine_tokens()
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[2] = False  # 6 tokens in 2 sequences
    base = policy_loss(logp, old, adv, mask)[0]
    assert torch.equal(policy_loss(logp, old, adv, mask, batch_num_tokens=6)[0], base)
    assert torch.equal(policy_loss(logp, old, adv, mask, batch_num_tokens=torch.tensor(6))[0], base)
    close(policy_loss(logp, old, adv, mask, batch_num_tokens=12, dp_size=2)[0], base)
    close(policy_loss(logp, old, adv, mask, batch_num_tokens=60.5)[0], base * 6 / 60.5)  # fractional: allowed
    seq = dict(loss_agg_mode="seq-mean-token-mean")
    close(policy_loss(logp, old, adv, mask, global_batch_size=2, **seq)[0], policy_loss(logp, old, adv, mask, **seq)[0])
    weights = torch.full((3, 3), 0.5)  # a float mask: its weighted sum (4.5) is the data's count
    close(policy_loss(logp, old, adv, weights, batch_num_tokens=4.5)[0], policy_loss(logp, old, adv, weights)[0])
    with pytest.raises(ValueError, match=r"batch_num_tokens is 4\.0 but this batch alone scores 4\.5"):
        policy_loss(logp, old, adv, weights, batch_num_tokens=4.0)
    empty = torch.zeros(3, 3, dtype=torch.bool)  # nothing scored: a zero count is what the data shows
    assert policy_loss(logp, old, adv, empty, batch_num_tokens=0)[0].item() == 0


def test_agg_loss_global_counts():
    """``agg_loss`` refuses a contradicted count in the host read it makes anyway (a non-bool
    mask, a tensor count); where it makes none (a bool mask, number counts) the result is NaN."""
    logp, _, _ = _nine_tokens()
    full = torch.ones(3, 3, dtype=torch.bool)
    assert agg_loss(logp, full, "token-mean", batch_num_tokens=0).isnan()
    assert agg_loss(logp, full, "seq-mean-token-mean", global_batch_size=2).isnan()
    assert agg_loss(logp, None, "token-mean", batch_num_tokens=8).isnan()
    with pytest.raises(ValueError, match=r"batch_num_tokens is 0(\.0)? but this batch alone scores 9"):
        agg_loss(logp, full.long(), "token-mean", batch_num_tokens=0)
    with pytest.raises(ValueError, match=r"global_batch_size is 0\.0 but this batch alone has 3"):
        agg_loss(logp, full, "seq-mean-token-sum", global_batch_size=torch.tensor(0.0))
    close(agg_loss(logp, full, "token-mean", batch_num_tokens=9), agg_loss(logp, full, "token-mean"))


def test_custom_op_registration():
    logp, old, adv, mask = inputs(12, B=2, R=5)
    coef = torch.full((2,), 0.1)
    entropy = torch.rand(10, requires_grad=True)
    for c, ent in ((coef, None), (None, entropy)):
        args = (logp.detach().reshape(-1).requires_grad_(), ent,
                [old.reshape(-1), adv.reshape(-1), c, mask.reshape(-1), None, None, None, None],
                [0.2, 0.2, 3.0, -20.0, 20.0], [2, 5, 0, 0, 0])
        torch.library.opcheck(torch.ops.rlk_mm.policy_loss_partials.default, args)


def test_errors_name_the_field():
    logp, old, adv, mask = inputs(13)
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(logp, old, adv[:, :3], mask)
    with pytest.raises(ValueError, match="loss_agg_mode='mean'"):
        policy_loss(logp, old, adv, mask, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="dual-clip bound must be > 1"):
        policy_loss(logp, old, adv, mask, clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        policy_loss(logp, old, adv, mask, dp_size=2)
    flat = logp.detach()[mask]
    sample = torch.arange(mask.shape[0])[:, None].expand_as(mask)[mask]
    with pytest.raises(ValueError, match="num_samples is required"):
        policy_loss(flat, flat, flat, sample_index=sample)
    with pytest.raises(ValueError, match=r"sample_index\[\d+\] = \d+ follows \d+"):
        policy_loss(flat, flat, flat, sample_index=sample.flip(0), num_samples=6)
    with pytest.raises(ValueError, match="outside"):
        policy_loss(flat, flat, flat, sample_index=sample, num_samples=2)
    with pytest.raises(ValueError, match="loss_scale_factor is required"):
        policy_loss(flat, flat, flat, sample_index=sample, num_samples=6, loss_agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="kl type 'k4'"):
        kl_penalty(flat, flat, "k4")
    assert math.isfinite(policy_loss(logp, old, adv, mask)[0].item())


def test_selected_logprob_then_policy_loss():
    """The combined path: log-probs of the loss tokens straight from hidden states and the LM
    head, into the compact policy loss; grads to hidden and weight match logits -> log_softmax."""
    from rlk_mm.ops import selected_logprob
    from rlk_mm.schema import RLBatch
    from rlk_mm.schema.spans import Span, SpanTable

    g = torch.Generator().manual_seed(15)
    lengths, H, V = [9, 6, 11], 16, 40
    T = sum(lengths)
    cu = torch.tensor([0, 9, 15, 26], dtype=torch.int32)
    loss_spans = [[Span(4, 9)], [Span(2, 3), Span(4, 6)], [Span(6, 11)]]
    batch = RLBatch(
        input_ids=torch.randint(0, V, (T,), generator=g), cu_seqlens=cu,
        position_ids=torch.cat([torch.arange(n) for n in lengths]).expand(3, T).clone(),
        modality_spans=SpanTable.from_lists([[Span(0, n)] for n in lengths]),
        loss_spans=SpanTable.from_lists(loss_spans), processor_fingerprint="test",
    )
    hidden = torch.randn(T, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    sample = batch.loss_token_sample()
    n = sample.numel()
    old = torch.randn(n, generator=g) * 0.1 - 3.5
    seq_adv = torch.randn(3, generator=g)
    logp = selected_logprob(hidden, weight, batch)
    loss, _ = policy_loss(logp, old, seq_adv[sample], sample_index=sample, num_samples=3,
                          loss_agg_mode="seq-mean-token-mean")
    grads = torch.autograd.grad(loss, (hidden, weight))

    rows, targets = batch.loss_token_index()
    full = (hidden @ weight.T).log_softmax(-1)[rows, targets]
    Rmax = 5
    mask = torch.zeros(3, Rmax, dtype=torch.bool)
    col = torch.cat([torch.arange(int((sample == b).sum())) for b in range(3)])
    mask[sample, col] = True
    pad = lambda x: torch.zeros(3, Rmax, dtype=x.dtype).index_put((sample, col), x)  # noqa: E731
    expected, _ = ref.ppo_loss(pad(full), pad(old), pad(seq_adv[sample]), mask, mode="seq-mean-token-mean")
    g_expected = torch.autograd.grad(expected, (hidden, weight))
    close(loss, expected)
    for a, e in zip(grads, g_expected):
        assert relative_error(a, e) < LOGPROB_GRAD_REL.fp32


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("mode", VERL_MODES)
def test_triton_on_gpu_matches_verl_and_torch(core_algos, mode):
    """Compiled Triton (not the interpreter) at a size with many blocks, vs verl and our torch backend."""
    torch.manual_seed(0)
    B, R = 64, 1500
    logp, old, adv, mask = (t.cuda() for t in inputs(14, B=B, R=R))
    logp = logp.detach().requires_grad_()
    ref_logp = logp.detach() + 0.2 * torch.randn_like(logp)
    entropy = torch.rand_like(logp).requires_grad_()
    cfg = actor_config(clip_ratio_high=0.28)
    expected, m_expected = core_algos.compute_policy_loss_vanilla(old, logp, adv, mask, mode, cfg)
    (g_expected,) = torch.autograd.grad(expected, logp)
    results = []
    for backend in ("triton", "triton", "torch"):
        with use_backend(backend):
            loss, metrics = policy_loss(logp, old, adv, mask, clip_ratio_high=0.28, loss_agg_mode=mode)
            (grad,) = torch.autograd.grad(loss, logp)
            full, _ = policy_loss(logp, old, adv, mask, ref_log_probs=ref_logp, kl_coef=0.1, entropy=entropy,
                                  entropy_coeff=0.01, loss_agg_mode=mode, loss_scale_factor=R)
            results.append((loss, grad, torch.autograd.grad(full, (logp, entropy))))
        close(loss, expected)
        close(grad, g_expected)
        for name in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
            assert metrics[name].item() == pytest.approx(m_expected[f"actor/{name}"], abs=TOL)
    (l0, g0, f0), (l1, g1, f1), (_, _, ft) = results
    assert torch.equal(l0, l1) and torch.equal(g0, g1) and all(torch.equal(a, b) for a, b in zip(f0, f1))
    for a, b in zip(f0, ft):
        assert relative_error(a, b) < LOGPROB_GRAD_REL.fp32
    sample = torch.arange(B, device="cuda")[:, None].expand(B, R)[mask]
    flat = logp.detach()[mask].requires_grad_()
    kw = dict(loss_agg_mode=mode, loss_scale_factor=R, clip_ratio_high=0.28)
    with use_backend("torch"):  # as before: the loop's last backend
        compact, _ = policy_loss(flat, old[mask], adv[mask], sample_index=sample, num_samples=B, **kw)
        close(compact, policy_loss(logp, old, adv, mask, **kw)[0])


@pytest.mark.gpu
def test_host_syncs_gpu():
    """policy_loss reads the device once a call (its value checks), its backward never;
    group_advantages never reads it. (``count_syncs`` counts the syncs of calls on this thread.)"""
    from rlk_mm.ops import group_advantages
    from support.helpers import count_syncs

    logp, old, adv, mask = (t.cuda() for t in inputs(16, B=8, R=300))
    logp = logp.detach().requires_grad_()
    sample = torch.arange(8, device="cuda")[:, None].expand(8, 300)[mask]
    flat, flat_old, flat_adv = logp.detach()[mask].requires_grad_(), old[mask], adv[mask]
    out = {}
    assert count_syncs(lambda: out.setdefault("padded", policy_loss(logp, old, adv, mask))) == 1
    compact = dict(sample_index=sample, num_samples=8)
    assert count_syncs(lambda: out.setdefault("compact", policy_loss(flat, flat_old, flat_adv, **compact))) == 1
    torch.cuda.set_sync_debug_mode("error")  # the backward runs on autograd's device thread: a sync there raises
    try:
        out["padded"][0].backward()
        out["compact"][0].backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert logp.grad.abs().sum() > 0 and flat.grad.abs().sum() > 0
    scores, groups = torch.randn(64, device="cuda"), torch.arange(64, device="cuda") // 4
    assert count_syncs(lambda: group_advantages(scores, groups)) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["triton", "torch"])
def test_nan_log_prob_propagates_gpu(backend_name):
    """Documented: a NaN log-prob where the mask is set gives a NaN loss on both backends
    (compiled Triton's min/max drop a NaN unless told to keep it, as torch's do)."""
    logp, old, adv, mask = (t.cuda() for t in inputs(17))
    logp = logp.detach().clone()
    logp[1, 0] = math.nan  # mask[1, 0] is set
    with use_backend(backend_name):
        assert policy_loss(logp, old, adv, mask)[0].isnan()
        assert policy_loss(logp, old, adv, mask, ref_log_probs=old, kl_coef=0.1, ratio="gspo")[0].isnan()
