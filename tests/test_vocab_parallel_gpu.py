"""GPU checks of the vocabulary-parallel ops over NCCL (issue #24), one process per GPU:

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node N -m pytest -q -m gpu tests/test_vocab_parallel_gpu.py

Every rank runs the same tests in the same order, so their collectives line up; under plain
pytest the group has one rank. Checked per dtype, for ``selected_logprob`` and
``linear_policy_loss`` on the Triton kernels: equal to the single-GPU op within the
numerical contract (log-probs, entropies, loss, d hidden, every rank's d weight shard),
the same bits on every rank, bitwise run to run, and bitwise batch-invariant per row.
The vocabulary (32,003 rows) does not divide by 2, 4 or 8: uneven shards.
"""

import os

import pytest
import torch
import torch.distributed as dist

from rlk_mm.ops import linear_policy_loss, selected_logprob
from rlk_mm.parity.contract import ELEMENTWISE_LOSS_MAX_ABS, LOGPROB_GRAD_REL, LOGPROB_MAX_ABS, relative_error

pytestmark = pytest.mark.gpu

T, N, H, V = 3000, 2048, 512, 32003
SUBSET = slice(700, 1100)


@pytest.fixture(scope="module")
def group():
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:  # plain pytest: a group of one
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29513", RANK="0", WORLD_SIZE="1")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    return dist.group.WORLD


def _case(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    c = {
        "hidden": torch.randn(T, H, device="cuda", generator=g).to(dtype),
        "weight": (torch.randn(V, H, device="cuda", generator=g) * 0.05).to(dtype),
        "index": torch.randperm(T, device="cuda", generator=g)[:N],
        "targets": torch.randint(0, V, (N,), device="cuda", generator=g),
        "up": torch.randn(N, device="cuda", generator=g),
        "up_entropy": torch.randn(N, device="cuda", generator=g),
        "old": -torch.rand(N, device="cuda", generator=g) * 4,
        "adv": torch.randn(N, device="cuda", generator=g),
        "sample": torch.arange(N, device="cuda") // 256,
    }
    P, rank = dist.get_world_size(), dist.get_rank()
    sizes = [V // P + (r < V % P) for r in range(P)]
    c["lo"], c["hi"] = sum(sizes[:rank]), sum(sizes[: rank + 1])
    return c


def _logprob(c, weight, group, rows=slice(None)):
    h, w = c["hidden"].clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = selected_logprob(h, w, index=c["index"][rows], targets=c["targets"][rows], temperature=0.8,
                                 return_entropy=True, tp_group=group)
    torch.autograd.backward([logp, ent], [c["up"][rows], c["up_entropy"][rows]])
    return {"logp": logp, "entropy": ent, "d_hidden": h.grad, "d_weight": w.grad}


def _loss(c, weight, group):
    h, w = c["hidden"].clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_policy_loss(h, w, index=c["index"], targets=c["targets"], temperature=0.8, old_log_probs=c["old"],
                             advantages=c["adv"], sample_index=c["sample"], num_samples=N // 256, entropy_coeff=0.01,
                             tp_group=group)
    out.loss.backward()
    return {"loss": out.loss.detach().reshape(1), "logp": out.log_probs, "entropy": out.entropy,
            "d_hidden": h.grad, "d_weight": w.grad}


def _same_on_every_rank(t):
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t.contiguous())
    return all(torch.equal(t, o) for o in everyone)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("run", [_logprob, _loss], ids=["selected_logprob", "linear_policy_loss"])
def test_equal_to_single_gpu_op_and_deterministic(group, dtype, run):
    c = _case(dtype)
    shard = c["weight"][c["lo"] : c["hi"]]
    single, ours, again = run(c, c["weight"], None), run(c, shard, group), run(c, shard, group)
    for k in ("logp", "entropy"):
        assert (ours[k] - single[k]).abs().max().item() <= LOGPROB_MAX_ABS.for_dtype(dtype), k
    if "loss" in ours:
        assert (ours["loss"] - single["loss"]).abs().item() <= ELEMENTWISE_LOSS_MAX_ABS.for_dtype(dtype)
    assert relative_error(ours["d_hidden"], single["d_hidden"]) <= LOGPROB_GRAD_REL.for_dtype(dtype)
    assert relative_error(ours["d_weight"], single["d_weight"][c["lo"] : c["hi"]]) <= LOGPROB_GRAD_REL.for_dtype(dtype)
    for k in ours:
        assert torch.equal(ours[k], again[k]), k
        if k != "d_weight":
            assert _same_on_every_rank(ours[k]), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_bitwise_batch_invariant(group, dtype):
    c = _case(dtype)
    shard = c["weight"][c["lo"] : c["hi"]]
    full, part = _logprob(c, shard, group), _logprob(c, shard, group, rows=SUBSET)
    assert torch.equal(part["logp"], full["logp"][SUBSET])
    assert torch.equal(part["entropy"], full["entropy"][SUBSET])
