"""GPU checks of the vocabulary-parallel ops over NCCL (issue #32), one process per GPU:

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node N -m pytest -q -m gpu tests/ops/test_vocab_parallel_gpu.py

Every rank runs the same tests in the same order, so their collectives line up; under plain
pytest the group has one rank. At the Qwen2.5-VL-7B head (H = 3584, V = 152,064 rows, a bias
of -inf on the rows past the tokenizer's 151,665 as a padded head has), on the Triton kernels,
bf16 and fp32, the head split evenly (Megatron's 128 x tp padding) and unevenly (whole
128-row segments, the last shard 37 rows short of the grid): the forward of
``selected_logprob`` and ``linear_policy_loss`` (log-probs, entropies, row log-sum-exps) bitwise
the single-GPU op's on every rank; the loss and gradients within the numerical contract,
bitwise run to run and the same on every rank; a row bitwise the same in any batch;
``sample_from_hidden``'s tokens and log-probs bitwise the single GPU's (plain and filtered);
a misaligned shard refused on every rank; one FSDP2 ``fully_shard`` step of the tiny
Qwen2.5-VL on 2 GPUs (NCCL) equal to one process within the contract.
"""

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist

from rlk_mm.ops import linear_policy_loss, sample_from_hidden, selected_logprob
from rlk_mm.ops._triton import logprob as triton_logprob
from rlk_mm.ops._vocab_parallel.agree import agree
from rlk_mm.ops._vocab_parallel.logprob import shard_forward
from rlk_mm.parity.contract import ELEMENTWISE_LOSS_MAX_ABS, LOGPROB_GRAD_REL, relative_error

pytestmark = pytest.mark.gpu

T, N, H, V, REAL_VOCAB = 2304, 2048, 3584, 152064, 151665
B = 64  # sampled rows
SUBSET = slice(700, 1100)
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def group():
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:  # plain pytest: a group of one
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29513", RANK="0", WORLD_SIZE="1")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    return dist.group.WORLD


@pytest.fixture(scope="module")
def pair(group):
    """The group of ranks 0 and 1 (rank 0 alone under plain pytest); None on the other ranks."""
    ranks = list(range(min(2, dist.get_world_size())))
    sub = dist.new_group(ranks)  # every rank creates it
    return sub if dist.get_rank() in ranks else None


def sizes_of(P, vocab=V, even=True):
    """Shard sizes: whole 128-row segments split evenly (or one more segment on every rank but
    the last), the last shard ending at ``vocab``."""
    segments = math.ceil(vocab / 128)
    per = [segments // P + (r < segments % P) for r in range(P)]
    if not even and P > 1:
        per = [segments // P + 1] * (P - 1) + [segments - (segments // P + 1) * (P - 1)]
    sizes = [p * 128 for p in per]
    sizes[-1] = vocab - sum(sizes[:-1])
    return sizes


def _case(dtype, even=True):
    vocab = V if even else V - 37
    g = torch.Generator(device="cuda").manual_seed(0)
    c = {
        "hidden": torch.randn(T, H, device="cuda", generator=g).to(dtype),
        "weight": (torch.randn(vocab, H, device="cuda", generator=g) * 0.02).to(dtype),
        "bias": torch.zeros(vocab, device="cuda").to(dtype),
        "index": torch.randperm(T, device="cuda", generator=g)[:N],
        "targets": torch.randint(0, REAL_VOCAB, (N,), device="cuda", generator=g),
        "up": torch.randn(N, device="cuda", generator=g),
        "up_entropy": torch.randn(N, device="cuda", generator=g),
        "old": -torch.rand(N, device="cuda", generator=g) * 4,
        "adv": torch.randn(N, device="cuda", generator=g),
        "sample": torch.arange(N, device="cuda") // 256,
        "seeds": torch.randint(-(2**62), 2**62, (B,), device="cuda", generator=g),
    }
    c["bias"][REAL_VOCAB:] = -math.inf  # the padded rows: never drawn, never a target
    P, rank = dist.get_world_size(), dist.get_rank()
    sizes = sizes_of(P, vocab, even)
    c["lo"], c["hi"] = sum(sizes[:rank]), sum(sizes[: rank + 1])
    c["shard"], c["shard_bias"] = c["weight"][c["lo"] : c["hi"]], c["bias"][c["lo"] : c["hi"]]
    return c


def _logprob(c, weight, bias, group, rows=slice(None)):
    h, w = c["hidden"].clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = selected_logprob(h, w, index=c["index"][rows], targets=c["targets"][rows], bias=bias,
                                 temperature=TEMPERATURE, return_entropy=True, tp_group=group)
    torch.autograd.backward([logp, ent], [c["up"][rows], c["up_entropy"][rows]])
    return {"logp": logp, "entropy": ent, "d_hidden": h.grad, "d_weight": w.grad}


def _loss(c, weight, bias, group):
    h, w = c["hidden"].clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_policy_loss(h, w, index=c["index"], targets=c["targets"], bias=bias, temperature=TEMPERATURE,
                             old_log_probs=c["old"], advantages=c["adv"], sample_index=c["sample"],
                             num_samples=N // 256, entropy_coeff=0.01, tp_group=group)
    out.loss.backward()
    return {"loss": out.loss.detach().reshape(1), "logp": out.log_probs, "entropy": out.entropy,
            "d_hidden": h.grad, "d_weight": w.grad}


def _stats(c, group):
    """(log-prob, entropy, row log-sum-exp): the single GPU's forward, or the group's."""
    h, rows, tgt = c["hidden"], c["index"], c["targets"]
    with torch.no_grad():
        if group is None:
            out = triton_logprob.forward(h, c["weight"], rows, tgt, c["bias"], TEMPERATURE, True, False)
        else:
            shard, all_rows = agree(h, c["shard"], rows, tgt, c["shard_bias"], TEMPERATURE, group, None, False,
                                       lambda: None)
            out = shard_forward(h, c["shard"], rows, tgt, c["shard_bias"], TEMPERATURE, True, all_rows, shard)
    return dict(zip(("logp", "entropy", "lse"), out))


def _same_on_every_rank(t):
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t.contiguous())
    return all(torch.equal(t, o) for o in everyone)


def _differ(a, b):
    return (a.float() - b.float()).abs().max().item()


# ------------------------------------------------------------------ bitwise
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("even", [True, False], ids=["even", "uneven"])
def test_forward_bitwise_the_single_gpu_op_gpu(group, dtype, even):
    c = _case(dtype, even)
    single, ours = _stats(c, None), _stats(c, group)
    for k in ("logp", "entropy", "lse"):
        assert torch.equal(ours[k], single[k]), (k, _differ(ours[k], single[k]))
        assert _same_on_every_rank(ours[k]), k
    with torch.no_grad():
        logp, ent = selected_logprob(c["hidden"], c["shard"], index=c["index"], targets=c["targets"],
                                     bias=c["shard_bias"],
                                     temperature=TEMPERATURE, return_entropy=True, tp_group=group)
    assert torch.equal(logp, single["logp"]) and torch.equal(ent, single["entropy"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("run", [_logprob, _loss], ids=["selected_logprob", "linear_policy_loss"])
def test_log_probs_bitwise_gradients_within_contract_deterministic_gpu(group, dtype, run):
    c = _case(dtype, even=False)
    single_logp = _logprob(c, c["weight"], c["bias"], None)
    single, ours, again = run(c, c["weight"], c["bias"], None), run(c, c["shard"], c["shard_bias"], group), \
        run(c, c["shard"], c["shard_bias"], group)
    for k in ("logp", "entropy"):  # the fused loss's too: selected_logprob's, bitwise
        assert torch.equal(ours[k], single_logp[k]), (k, _differ(ours[k], single_logp[k]))
    if "loss" in ours:
        assert (ours["loss"] - single["loss"]).abs().item() <= ELEMENTWISE_LOSS_MAX_ABS.for_dtype(dtype)
    assert relative_error(ours["d_hidden"], single["d_hidden"]) <= LOGPROB_GRAD_REL.for_dtype(dtype)
    assert relative_error(ours["d_weight"], single["d_weight"][c["lo"] : c["hi"]]) <= LOGPROB_GRAD_REL.for_dtype(dtype)
    for k in ours:
        assert torch.equal(ours[k], again[k]), k
        if k != "d_weight":
            assert _same_on_every_rank(ours[k]), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_bitwise_batch_invariant_gpu(group, dtype):
    c = _case(dtype, even=False)
    full, part = _logprob(c, c["shard"], c["shard_bias"],
                          group), _logprob(c, c["shard"], c["shard_bias"], group, SUBSET)
    assert torch.equal(part["logp"], full["logp"][SUBSET])
    assert torch.equal(part["entropy"], full["entropy"][SUBSET])


@pytest.mark.parametrize("kw", [{}, {"top_k": 50, "top_p": 0.9}, {"min_p": 0.05, "temperature": 1.2}],
                         ids=["plain", "top_k_top_p", "min_p"])
def test_sampler_bitwise_the_single_gpu_sampler_gpu(group, kw):
    c = _case(torch.bfloat16, even=False)
    h = c["hidden"][:B]
    kw = {"temperature": TEMPERATURE, **kw}
    single = sample_from_hidden(h, c["weight"], bias=c["bias"], seeds=c["seeds"], step=5, **kw)
    ours = sample_from_hidden(h, c["shard"], bias=c["shard_bias"], seeds=c["seeds"], step=5, tp_group=group, **kw)
    for a, b in zip(ours, single):
        assert torch.equal(a, b)
        assert _same_on_every_rank(a)
    assert int(single.tokens.max()) < REAL_VOCAB  # the padded rows are never drawn
    want = selected_logprob(h, c["weight"], index=torch.arange(B, device="cuda"), targets=single.tokens, bias=c["bias"],
                            temperature=kw["temperature"])
    assert torch.equal(single.log_probs, want)


def test_misaligned_shard_refused_on_every_rank_gpu(group):
    P, rank = dist.get_world_size(), dist.get_rank()
    if P == 1:
        pytest.skip("one rank: no shard boundary to misalign (run under torchrun --nproc-per-node 2+)")
    c = _case(torch.bfloat16)
    sizes = sizes_of(P)
    sizes[0] -= 64
    sizes[1] += 64
    lo = sum(sizes[:rank])
    with pytest.raises(ValueError, match=r"tp rank 1's vocabulary shard starts at row \d+, not a multiple of 128"):
        selected_logprob(c["hidden"], c["weight"][lo : lo + sizes[rank]], index=c["index"], targets=c["targets"],
                         tp_group=group)
    assert selected_logprob(c["hidden"], c["shard"], index=c["index"][:8], targets=c["targets"][:8],
                            tp_group=group).shape == (8,)  # the group still works


# ------------------------------------------------------------------ FSDP2 over NCCL
def test_fsdp2_tiny_qwen_step_equals_one_process_gpu(pair):
    """One smoke-loss step of an FSDP2 tiny Qwen2.5-VL (head of 152,064 rows, Shard(0) on ranks 0
    and 1) against the same step in this process: loss, every gradient and the parameters after
    an SGD step within the contract."""
    if pair is None:
        return  # ranks 2 and up take no part
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from rlk_mm import fixtures
    from rlk_mm.models import forward_hidden
    from rlk_mm.schema import RLBatch

    processor = fixtures.qwen_vl_processor()
    samples = fixtures.synthetic_image_text(2, seed=0, max_images=1, sizes=((56, 56),))
    both = RLBatch.from_qwen_vl(fixtures.processor_inputs(processor, samples), processor=processor,
                                responses=[[5, 17, 151645], [5, 17, 151645]], group_ids=["a", "b"])
    g = torch.Generator().manual_seed(1)
    inputs = {k: (-torch.rand(6, generator=g)).cuda() for k in ("old_log_probs", "ref_log_probs")}
    inputs["advantages"] = torch.randn(6, generator=g).cuda()

    def loss_of(model):
        hidden = forward_hidden(model, both)
        return linear_policy_loss(hidden, model.lm_head.weight, both, temperature=0.9, kl_type="low_var_kl",
                                  kl_coef=0.05, loss_agg_mode="token-mean", **inputs).loss

    def grads(model):
        return {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                for k, p in model.named_parameters() if p.grad is not None}

    base = fixtures.tiny_qwen2_5_vl(seed=0, vocab_size=152064).cuda()
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_loss = loss_of(reference)
    ref_loss.backward()
    mesh = DeviceMesh.from_group(pair, "cuda")
    fully_shard(model.model, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)
    assert type(model.lm_head.weight).__name__ == "DTensor"
    loss = loss_of(model)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= ELEMENTWISE_LOSS_MAX_ABS.fp32 * max(1.0, abs(ref_loss.item()))
    ours, theirs = grads(model), grads(reference)
    assert sorted(ours) == sorted(theirs) and "lm_head.weight" in ours and len(ours) > 10
    worst = max(((k, relative_error(ours[k], theirs[k])) for k in theirs), key=lambda kv: kv[1])
    assert worst[1] <= LOGPROB_GRAD_REL.fp32, worst
    for m in (model, reference):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    after = {k: p.full_tensor() if hasattr(p, "full_tensor") else p for k, p in model.named_parameters()}
    assert max(relative_error(after[k], p) for k, p in reference.named_parameters()) <= LOGPROB_GRAD_REL.fp32
