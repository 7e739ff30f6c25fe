"""GPU checks of the fused LM-head policy loss (Triton): the contract at the 7B hidden size
against the fp32 plain-torch path and the four-product composition, several chunks, bitwise
log-prob invariance and bitwise gradients run to run. Run on the GPU machine:
``pytest -m gpu tests/ops/test_linear_loss_gpu.py``."""

import pytest
import torch

from rlk_mm.ops import linear_policy_loss, policy_loss, selected_logprob
from rlk_mm.ops._triton import linear_loss as triton_linear_loss
from rlk_mm.parity.contract import LOGPROB_GRAD_REL, LOGPROB_MAX_ABS, relative_error
from support.helpers import GRAD_SCALES, same_bits, scaled_pair, use_backend

pytestmark = pytest.mark.gpu  # without CUDA: fails at setup with a clear message (conftest.py)

N, H, V, S = 1200, 3584, 20011, 6  # V not a multiple of any tile


def _case(dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    c = dict(
        hidden=torch.randn(N + 100, H, device="cuda", generator=g).to(dtype),
        weight=(torch.randn(V, H, device="cuda", generator=g) * 0.02).to(dtype),
        bias=(torch.randn(V, device="cuda", generator=g) * 0.1).to(dtype),
        index=torch.randperm(N + 100, device="cuda", generator=g)[:N],
        targets=torch.randint(0, V, (N,), device="cuda", generator=g),
        sample_index=torch.arange(S, device="cuda").repeat_interleave(N // S),
        old_log_probs=-torch.rand(N, device="cuda", generator=g) * 12,
        advantages=torch.randn(N, device="cuda", generator=g),
        ref_log_probs=-torch.rand(N, device="cuda", generator=g) * 12,
        mask=torch.rand(N, device="cuda", generator=g) > 0.1,
    )
    return c


KNOBS = dict(temperature=0.7, kl_type="low_var_kl", kl_coef=0.05, entropy_coeff=0.01,
             loss_agg_mode="seq-mean-token-mean")


def _fused(c, hidden=None, weight=None, bias=None, **over):
    kw = dict(KNOBS, **over)
    h, w, b = (c[k].clone().requires_grad_() if t is None else t
               for k, t in (("hidden", hidden), ("weight", weight), ("bias", bias)))
    out = linear_policy_loss(h, w, index=c["index"], targets=c["targets"], bias=b, old_log_probs=c["old_log_probs"],
                             advantages=c["advantages"], mask=c["mask"], sample_index=c["sample_index"], num_samples=S,
                             ref_log_probs=c["ref_log_probs"], **kw)
    out.loss.backward()
    return out, (h.grad, w.grad, b.grad)


def _composed(c, dtype=None):
    """policy_loss(selected_logprob(...)); with ``dtype``, on inputs upcast to it."""
    leaves = [c[k].to(dtype or c[k].dtype).clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    kw = dict(KNOBS)
    temperature = kw.pop("temperature")
    lp, ent = selected_logprob(leaves[0], leaves[1], index=c["index"], targets=c["targets"], bias=leaves[2],
                               temperature=temperature, return_entropy=True)
    loss, metrics = policy_loss(lp, c["old_log_probs"], c["advantages"], c["mask"], sample_index=c["sample_index"],
                                num_samples=S, ref_log_probs=c["ref_log_probs"], entropy=ent, **kw)
    loss.backward()
    return loss.detach(), metrics, lp.detach(), ent.detach(), [t.grad for t in leaves]


def _within(out, grads, expected, dtype):
    loss, metrics, lp, ent, e_grads = expected
    tol, gtol = LOGPROB_MAX_ABS.for_dtype(dtype), LOGPROB_GRAD_REL.for_dtype(dtype)
    assert (out.log_probs.double() - lp.double()).abs().max().item() <= tol
    assert (out.entropy.double() - ent.double()).abs().max().item() <= tol
    assert abs(out.loss.item() - loss.item()) <= tol * max(1.0, abs(loss.item()))
    for k, v in metrics.items():
        assert abs(out.metrics[k].item() - v.item()) <= tol * max(1.0, abs(v.item())), k
    for name, a, e in zip(("hidden", "weight", "bias"), grads, e_grads):
        assert relative_error(a, e) <= gtol, name


def test_contract_at_7b_hidden_size_gpu():
    c = _case()
    out, grads = _fused(c)
    with use_backend("torch"):  # fp32 plain torch (TF32 off) on the same bf16 inputs upcast
        reference = _composed(c, dtype=torch.float32)
    _within(out, grads, reference, torch.bfloat16)
    composed = _composed(c)
    _within(out, grads, composed, torch.bfloat16)
    # the same tiles and segment partials: the fused loss's log-probs are selected_logprob's, bitwise
    assert torch.equal(out.log_probs, composed[2]) and torch.equal(out.entropy, composed[3])


def test_several_chunks_and_bitwise_log_probs_gpu(monkeypatch):
    """Chunks of 256 rows against one chunk: the same log-probs bitwise, gradients within the
    contract; a row's log-prob alone, among others and at another place: bitwise."""
    c = _case(seed=1)
    one, g_one = _fused(c)
    cfg = triton_linear_loss.default_config(torch.bfloat16, torch.device("cuda"))
    small = type(cfg)(**{**cfg.__dict__, "linear_budget": 256 * V * 2})
    monkeypatch.setattr(triton_linear_loss, "default_config", lambda dtype, device: small)
    many, g_many = _fused(c)
    assert torch.equal(one.log_probs, many.log_probs) and torch.equal(one.entropy, many.entropy)
    for a, b in zip(g_one, g_many):
        assert relative_error(a, b) <= LOGPROB_GRAD_REL.low_precision
    sub = dict(c, index=c["index"][700:701].flip(0), targets=c["targets"][700:701],
               sample_index=c["sample_index"][:1] * 0, old_log_probs=c["old_log_probs"][700:701],
               advantages=c["advantages"][700:701], mask=c["mask"][700:701], ref_log_probs=c["ref_log_probs"][700:701])
    alone = linear_policy_loss(c["hidden"], c["weight"], index=sub["index"], targets=sub["targets"], bias=c["bias"],
                               old_log_probs=sub["old_log_probs"], advantages=sub["advantages"],
                               sample_index=sub["sample_index"], num_samples=1, temperature=KNOBS["temperature"])
    assert torch.equal(alone.log_probs, one.log_probs[700:701]) and torch.equal(alone.entropy, one.entropy[700:701])


def test_gradients_bitwise_run_to_run_and_frozen_head_gpu():
    c = _case(seed=2)
    (a, ga), (b, gb) = _fused(c), _fused(c)
    assert torch.equal(a.loss, b.loss) and all(torch.equal(x, y) for x, y in zip(ga, gb))
    frozen, g_frozen = _fused(c, weight=c["weight"], bias=c["bias"])
    assert g_frozen[1] is None and g_frozen[2] is None
    assert relative_error(g_frozen[0], ga[0]) <= LOGPROB_GRAD_REL.low_precision


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", GRAD_SCALES)
def test_gradient_scale_is_torch_mul_bitwise_gpu(dtype, scale):
    """The backward's in-place scale against torch's CUDA ``mul_``, bit for bit (NaN payloads aside)."""
    assert same_bits(*scaled_pair(dtype, scale, device="cuda"))
