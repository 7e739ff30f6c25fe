"""Vocabulary-parallel ``selected_logprob`` and ``linear_policy_loss`` (``tp_group=``, DTensor
heads) over gloo on CPU.

One ``torch.multiprocessing`` spawn for the module (3 ranks; groups of 1, 2 and 3 ranks, the
vocabulary 37 rows: uneven shards) runs every case once, both backends (Triton under
``TRITON_INTERPRET=1``), and writes each rank's tensors (safetensors) and messages (JSON);
the tests below read them. Checked: equal to the single-process op within the numerical
contract (bitwise at group size 1), bitwise run to run, bitwise batch-invariant per row,
the same on every rank, gradients of hidden and of every weight and bias shard; an FSDP2
``fully_shard`` tiny Qwen2.5-VL on 2 ranks, one step of the smoke loss against the
single-process step (the vocabulary-parallel DTensor head, and ``gather_weight`` with
different rows per rank); bad setups raising clear errors on every rank; the profiler's
collective bytes against ``comm_bytes_per_token``. Plus the rank-order merge as a property
(hypothesis) and a bad-argument table, in this process.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from rlk_mm.ops import linear_policy_loss, selected_logprob
from rlk_mm.ops import vocab_parallel as vp
from rlk_mm.ops._torch import logprob as torch_logprob
from rlk_mm.parity.contract import ELEMENTWISE_LOSS_MAX_ABS, LOGPROB_GRAD_REL, LOGPROB_MAX_ABS, relative_error

WORLD = 3
T, H, V, N = 48, 16, 37, 36  # V = 37: shards 19/18 and 13/12/12
TEMPERATURE = 0.7
CASES = [("torch", torch.float32), ("torch", torch.bfloat16), ("triton", torch.float32)]
GROUPS = (1, 2, 3)
SUBSET = [9, 2, 33, 13, 5, 0]  # a batch of other rows, in another order
#: bytes of the fused loss's chunk logits on the Triton path: 16 rows of the largest shard, but 32 or 48
#: of the smaller ones (a rank cutting its own chunks would desynchronise the per-chunk collective)
CHUNK_BUDGET = 16 * 19 * 4 * 2 - 1


def _tag(backend, dtype, P, what):
    return f"{backend}.{str(dtype).replace('torch.', '')}.P{P}.{what}"


def make_case(dtype):
    """Hidden states, head (a -inf bias entry that is no target), scored rows (one repeated), targets, upstreams."""
    g = torch.Generator().manual_seed(0)
    c = {
        "hidden": torch.randn(T, H, generator=g).to(dtype),
        "weight": (torch.randn(V, H, generator=g) * 0.5).to(dtype),
        "bias": (torch.randn(V, generator=g) * 0.3).to(dtype),
        "index": torch.cat([torch.randperm(T, generator=g)[: N - 1], torch.tensor([3])]),
        "targets": torch.randint(0, V - 1, (N,), generator=g),
        "up_logp": torch.randn(N, generator=g),
        "up_entropy": torch.randn(N, generator=g),
        "old_log_probs": -torch.rand(N, generator=g) * 4,
        "advantages": torch.randn(N, generator=g),
        "ref_log_probs": -torch.rand(N, generator=g) * 4,
        "sample_index": torch.arange(N) // 12,
    }
    c["bias"][V - 1] = -math.inf  # never a target (targets < V - 1)
    return c


def shard_bounds(P, rank, vocab=V):
    sizes = [len(s) for s in torch.arange(vocab).tensor_split(P)]
    return sum(sizes[:rank]), sizes[rank]


# ------------------------------------------------------------------ the worker
def _logprob_run(c, weight, bias, group, index=None, targets=None):
    leaves = [t.clone().requires_grad_() for t in (c["hidden"], weight, bias)]
    index = c["index"] if index is None else index
    targets = c["targets"] if targets is None else targets
    logp, ent = selected_logprob(leaves[0], leaves[1], index=index, targets=targets, bias=leaves[2],
                                 temperature=TEMPERATURE, return_entropy=True, tp_group=group)
    n = index.numel()
    torch.autograd.backward([logp, ent], [c["up_logp"][:n], c["up_entropy"][:n]])
    return {"logp": logp, "entropy": ent, "d_hidden": leaves[0].grad, "d_weight": leaves[1].grad, "d_bias": leaves[2].grad}


def _loss_run(c, weight, bias, group):
    leaves = [t.clone().requires_grad_() for t in (c["hidden"], weight, bias)]
    out = linear_policy_loss(
        leaves[0], leaves[1], index=c["index"], targets=c["targets"], bias=leaves[2], temperature=TEMPERATURE,
        old_log_probs=c["old_log_probs"], advantages=c["advantages"], ref_log_probs=c["ref_log_probs"],
        sample_index=c["sample_index"], num_samples=3, kl_coef=0.1, entropy_coeff=0.01, tp_group=group)
    out.loss.backward()
    return {"loss": out.loss.detach().reshape(1), "logp": out.log_probs, "entropy": out.entropy,
            "d_hidden": leaves[0].grad, "d_weight": leaves[1].grad, "d_bias": leaves[2].grad}


def _small_chunks():
    """The Triton fused loss cut into chunks of a few rows (``CHUNK_BUDGET``)."""
    from rlk_mm.ops._triton import linear_loss as triton_linear_loss

    original = triton_linear_loss.default_config

    def config(dtype, device):
        return type(original(dtype, device))(**{**original(dtype, device).__dict__, "linear_budget": CHUNK_BUDGET})

    triton_linear_loss.default_config = config


def _cases_worker(rank, groups, results):
    _small_chunks()
    for backend, dtype in CASES:
        os.environ["RLK_MM_BACKEND"] = backend
        c = make_case(dtype)
        single = {"logprob": _logprob_run(c, c["weight"], c["bias"], None), "loss": _loss_run(c, c["weight"], c["bias"], None)}
        for P in GROUPS:
            if rank >= P:
                continue
            start, size = shard_bounds(P, rank)
            w, b = c["weight"][start : start + size], c["bias"][start : start + size]
            for name, run in (("logprob", _logprob_run), ("loss", _loss_run)):
                for k, v in single[name].items():
                    results[_tag(backend, dtype, P, f"{name}.single.{k}")] = v
                for rep in (1, 2):
                    for k, v in run(c, w, b, groups[P]).items():
                        results[_tag(backend, dtype, P, f"{name}.run{rep}.{k}")] = v
            sub = torch.tensor(SUBSET)
            part = _logprob_run(c, w, b, groups[P], index=c["index"][sub], targets=c["targets"][sub])
            results[_tag(backend, dtype, P, "logprob.subset.logp")] = part["logp"]
    os.environ["RLK_MM_BACKEND"] = "torch"  # a 2-row head over 3 ranks: rank 2's shard is empty (Shard(0)'s split)
    c = {**make_case(torch.float32), "targets": torch.arange(N) % 2}
    c["weight"], c["bias"] = c["weight"][:2], c["bias"][:2]
    for name, group, (start, size) in (("single", None, (0, 2)), ("tp", groups[3], [(0, 1), (1, 1), (2, 0)][rank])):
        for k, v in _logprob_run(c, c["weight"][start : start + size], c["bias"][start : start + size], group).items():
            results[f"empty_shard.{name}.{k}"] = v
    os.environ.pop("RLK_MM_BACKEND")


def _expect_error(messages, name, fn):
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        messages[name] = f"{type(e).__name__}: {e}"
    else:
        messages[name] = "no error"


def _bad_setups_worker(rank, group, messages):
    """Group of ranks 0 and 1: each case breaks rank 1's inputs; every rank must raise."""
    c = make_case(torch.float32)
    start, size = shard_bounds(2, rank)
    w, b = c["weight"][start : start + size], c["bias"][start : start + size]
    common = dict(index=c["index"], targets=c["targets"], tp_group=group)

    def call(hidden=c["hidden"], weight=w, bias=b, **kw):
        return selected_logprob(hidden, weight, bias=bias, **{**common, **kw})

    broken = rank == 1
    _expect_error(messages, "vocab_start_index", lambda: call(vocab_start_index=start - 1 if broken else start))
    _expect_error(messages, "dtype", lambda: call(hidden=c["hidden"].bfloat16(), weight=w.bfloat16(), bias=b.bfloat16())
                  if broken else call())
    _expect_error(messages, "targets", lambda: call(targets=(c["targets"] + 1) if broken else c["targets"]))
    _expect_error(messages, "refused", lambda: call(weight=torch.zeros(size, H + 1)) if broken else call())
    _expect_error(messages, "out_of_range", lambda: call(targets=torch.full((N,), V)))
    masked = b.clone()
    if broken:  # rank 1 owns token 30: its bias masks it; targets[0] is 30 on every rank
        masked[30 - start] = -math.inf
    _expect_error(messages, "masked_target", lambda: call(bias=masked, targets=torch.full((N,), 30)))
    nan_bias = b.clone()
    if broken:
        nan_bias[2] = math.nan  # vocabulary row 19 + 2
    _expect_error(messages, "bias_nan", lambda: call(bias=nan_bias))
    perturbed = c["hidden"] + (1e-3 if broken else 0.0)
    os.environ["RLK_MM_TP_DEBUG"] = "1"
    _expect_error(messages, "hidden_debug", lambda: call(hidden=perturbed))
    os.environ.pop("RLK_MM_TP_DEBUG")
    _expect_error(messages, "loss_dtype", lambda: linear_policy_loss(
        c["hidden"].bfloat16() if broken else c["hidden"], w.bfloat16() if broken else w, index=c["index"],
        targets=c["targets"], old_log_probs=c["old_log_probs"], advantages=c["advantages"],
        sample_index=c["sample_index"], num_samples=3, tp_group=group))
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh.from_group(group, "cpu")
    replicated = distribute_tensor(c["weight"], mesh, [Replicate()])
    _expect_error(messages, "dtensor_replicate", lambda: selected_logprob(c["hidden"], replicated, index=c["index"],
                                                                          targets=c["targets"]))
    sharded = distribute_tensor(c["weight"], mesh, [Shard(0)])
    for name, kw in (("dtensor_tp_group", dict(tp_group=group)), ("dtensor_start", dict(vocab_start_index=0)),
                     ("dtensor_plain_bias", dict(bias=c["bias"]))):
        _expect_error(messages, name, lambda: selected_logprob(c["hidden"], sharded, index=c["index"],
                                                               targets=c["targets"], **kw))
    # after every refusal the group still works: the same call succeeds on every rank
    messages["still_works"] = float(call()[0])


def _comm_worker(rank, groups, numbers):
    """Profiled collective bytes of one forward+backward, at two row counts: the difference is per token."""
    c = make_case(torch.float32)
    os.environ["RLK_MM_BACKEND"] = "torch"
    for P in (2, 3):
        if rank >= P:
            continue
        start, size = shard_bounds(P, rank)
        sent = []
        for n in (6, 14):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                _logprob_run(c, c["weight"][start : start + size], c["bias"][start : start + size], groups[P],
                             index=c["index"][:n], targets=c["targets"][:n])
            sent.append(sum(vp.profiled_sent_bytes(prof.events(), P).values()))
        numbers[f"P{P}.measured"] = (sent[1] - sent[0]) / 8
        numbers[f"P{P}.documented"] = sum(vp.comm_bytes_per_token(P, H, with_entropy=True).values())
    os.environ.pop("RLK_MM_BACKEND")


def _fsdp_worker(rank, group, numbers):
    """One smoke-loss step of an FSDP2 tiny Qwen2.5-VL on ranks 0 and 1 against one process."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from rlk_mm import fixtures
    from rlk_mm.models.qwen2_5_vl import forward_hidden
    from rlk_mm.schema import RLBatch

    processor = fixtures.qwen_vl_processor()
    samples = fixtures.synthetic_image_text(2, seed=0, max_images=1, sizes=((56, 56),))
    batches = [RLBatch.from_qwen_vl(fixtures.processor_inputs(processor, [s]), processor=processor,
                                    responses=[[5, 17, 151645]], group_ids=["g"]) for s in samples]
    both = RLBatch.from_qwen_vl(fixtures.processor_inputs(processor, samples), processor=processor,
                                responses=[[5, 17, 151645], [5, 17, 151645]], group_ids=["g", "g"])
    g = torch.Generator().manual_seed(1)
    inputs = {k: (-torch.rand(6, generator=g)) for k in ("old_log_probs", "ref_log_probs")}
    inputs["advantages"] = torch.randn(6, generator=g)

    def loss_of(model, batch, rows, **kw):
        hidden = forward_hidden(model, batch)
        return linear_policy_loss(hidden, model.lm_head.weight, batch, temperature=0.9, kl_type="low_var_kl",
                                  kl_coef=0.05, loss_agg_mode="token-mean",
                                  **{k: v[rows] for k, v in inputs.items()}, **kw).loss

    def grads(model):
        return {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                for k, p in model.named_parameters() if p.grad is not None}

    base = fixtures.tiny_qwen2_5_vl(seed=0)
    mesh = DeviceMesh.from_group(group, "cpu")
    for mode in ("vocab_parallel", "gather_weight"):
        reference, model = copy.deepcopy(base), copy.deepcopy(base)
        if mode == "vocab_parallel":  # both ranks score the same rows (a tensor-parallel-like use of the mesh)
            ref_loss = loss_of(reference, both, slice(0, 6))
        else:  # data parallel: rank r scores sample r; the reference is the mean of the two losses
            ref_loss = (loss_of(reference, batches[0], slice(0, 3)) + loss_of(reference, batches[1], slice(3, 6))) / 2
        ref_loss.backward()
        fully_shard(model.model, mesh=mesh)
        fully_shard(model.lm_head, mesh=mesh)
        numbers[f"{mode}.head_is_dtensor"] = type(model.lm_head.weight).__name__
        if mode == "vocab_parallel":
            loss = loss_of(model, both, slice(0, 6))
        else:
            loss = loss_of(model, batches[rank], slice(3 * rank, 3 * rank + 3), gather_weight=True)
        loss.backward()
        ours, theirs = grads(model), grads(reference)
        mean_loss = loss.detach().clone()
        if mode == "gather_weight":  # each rank's loss is its sample's: compare their mean
            dist.all_reduce(mean_loss, group=group)
            mean_loss /= 2
        numbers[f"{mode}.loss"] = [mean_loss.item(), ref_loss.item()]
        numbers[f"{mode}.grad_names"] = sorted(ours) == sorted(theirs) and len(ours)
        numbers[f"{mode}.grad_rel"] = {k: relative_error(ours[k], theirs[k]) for k in theirs}
        for m in (model, reference):
            torch.optim.SGD(m.parameters(), lr=0.5).step()
        after = {k: p.full_tensor() if hasattr(p, "full_tensor") else p for k, p in model.named_parameters()}
        numbers[f"{mode}.param_rel"] = max(relative_error(after[k], p) for k, p in reference.named_parameters())
        numbers[f"{mode}.head_moved"] = (after["lm_head.weight"] - base.lm_head.weight).abs().max().item()


def _worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import conftest  # noqa: F401  (the interpreter's row-independent dot, as in the parent)

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: dist.group.WORLD}
    results, messages, numbers = {}, {}, {}
    _cases_worker(rank, groups, results)
    if rank < 2:
        _bad_setups_worker(rank, groups[2], messages)
    _comm_worker(rank, groups, numbers)
    if rank < 2:
        _fsdp_worker(rank, groups[2], numbers)
    dist.barrier()
    save_file({k: v.detach().clone().contiguous() for k, v in results.items()}, os.path.join(out_dir, f"rank{rank}.safetensors"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"messages": messages, "numbers": numbers}, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every rank's results: ``[(tensors, messages, numbers)]`` by rank, from one spawn."""
    out = tmp_path_factory.mktemp("vocab_parallel")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD)
    runs = []
    for r in range(WORLD):
        with open(out / f"rank{r}.json") as f:
            meta = json.load(f)
        runs.append((load_file(str(out / f"rank{r}.safetensors")), meta["messages"], meta["numbers"]))
    return runs


# ------------------------------------------------------------------ against one process
@pytest.mark.parametrize("backend,dtype", CASES)
@pytest.mark.parametrize("P", GROUPS)
@pytest.mark.parametrize("op", ["logprob", "loss"])
def test_equal_to_single_process_within_contract(ranks, backend, dtype, P, op):
    res = [ranks[r][0] for r in range(P)]
    single = {k: res[0][_tag(backend, dtype, P, f"{op}.single.{k}")] for k in ("logp", "entropy", "d_hidden", "d_weight", "d_bias")}
    for r in range(P):
        got = {k: res[r][_tag(backend, dtype, P, f"{op}.run1.{k}")] for k in single}
        for k in ("logp", "entropy"):
            assert (got[k] - single[k]).abs().max().item() <= LOGPROB_MAX_ABS.for_dtype(dtype), (r, k)
        assert relative_error(got["d_hidden"], single["d_hidden"]) <= LOGPROB_GRAD_REL.for_dtype(dtype), r
        start, size = shard_bounds(P, r)
        for k in ("d_weight", "d_bias"):  # every rank's shard of the head's gradient
            assert got[k].shape[0] == size
            assert relative_error(got[k], single[k][start : start + size]) <= LOGPROB_GRAD_REL.for_dtype(dtype), (r, k)
        if op == "loss":
            loss, ref = res[r][_tag(backend, dtype, P, "loss.run1.loss")], res[0][_tag(backend, dtype, P, "loss.single.loss")]
            assert (loss - ref).abs().item() <= ELEMENTWISE_LOSS_MAX_ABS.for_dtype(dtype)
        if P == 1:  # a group of one is the single-device op, bitwise
            for k in single:
                assert torch.equal(got[k], single[k]), k


@pytest.mark.parametrize("backend,dtype", CASES)
@pytest.mark.parametrize("P", GROUPS)
def test_bitwise_run_to_run_equal_on_every_rank_and_batch_invariant(ranks, backend, dtype, P):
    res = [ranks[r][0] for r in range(P)]
    for op in ("logprob", "loss"):
        for r in range(P):
            for key in [k for k in res[r] if k.startswith(_tag(backend, dtype, P, f"{op}.run1."))]:
                assert torch.equal(res[r][key], res[r][key.replace(".run1.", ".run2.")]), key
                if not key.endswith(("d_weight", "d_bias")):  # replicated outputs: the same bits on every rank
                    assert torch.equal(res[r][key], res[0][key]), (r, key)
    for r in range(P):
        full = res[r][_tag(backend, dtype, P, "logprob.run1.logp")]
        assert torch.equal(res[r][_tag(backend, dtype, P, "logprob.subset.logp")], full[torch.tensor(SUBSET)])


def test_an_empty_shard_adds_nothing(ranks):
    single = ranks[0][0]
    for r, (start, size) in enumerate([(0, 1), (1, 1), (2, 0)]):
        got = ranks[r][0]
        for k in ("logp", "entropy"):
            assert (got[f"empty_shard.tp.{k}"] - single[f"empty_shard.single.{k}"]).abs().max() <= LOGPROB_MAX_ABS.fp32
        assert relative_error(got["empty_shard.tp.d_hidden"], single["empty_shard.single.d_hidden"]) <= LOGPROB_GRAD_REL.fp32
        assert got["empty_shard.tp.d_weight"].shape == (size, H)
        assert relative_error(got["empty_shard.tp.d_weight"],
                              single["empty_shard.single.d_weight"][start : start + size]) <= LOGPROB_GRAD_REL.fp32


# ------------------------------------------------------------------ FSDP2, bad setups, traffic
@pytest.mark.parametrize("mode", ["vocab_parallel", "gather_weight"])
def test_fsdp2_tiny_qwen_step_equals_single_process(ranks, mode):
    for r in range(2):
        numbers = ranks[r][2]
        assert numbers[f"{mode}.head_is_dtensor"] == "DTensor"
        loss, ref = numbers[f"{mode}.loss"]
        assert abs(loss - ref) <= ELEMENTWISE_LOSS_MAX_ABS.fp32 * max(1.0, abs(ref))
        assert numbers[f"{mode}.grad_names"] > 10  # every parameter, the head's shard included
        worst = max(numbers[f"{mode}.grad_rel"].items(), key=lambda kv: kv[1])
        assert worst[1] <= LOGPROB_GRAD_REL.fp32, worst
        assert numbers[f"{mode}.param_rel"] <= LOGPROB_GRAD_REL.fp32
        assert "lm_head.weight" in numbers[f"{mode}.grad_rel"] and numbers[f"{mode}.head_moved"] > 0  # the head trained


BAD_SETUPS = {  # case: (rank 0's error, rank 1's error); rank 1's inputs are the broken ones
    "vocab_start_index": (r"tp rank 1 gives vocab_start_index=18 but the shards of ranks 0\.\.0 hold 19 rows",) * 2,
    "dtype": (r"tp ranks disagree on the dtype: rank 0 has torch\.float32, rank 1 has torch\.bfloat16",) * 2,
    "targets": (r"tp ranks disagree on the scored rows and targets",) * 2,
    "refused": (r"tp rank 1 refused its inputs", r"hidden size mismatch: hidden is \[T, 16\] but weight is \[V, 17\]"),
    "out_of_range": (r"targets\[0\] = 37 is out of range: there are 37 vocabulary entries",) * 2,
    "masked_target": (r"targets\[0\] = 30 is masked: bias\[30\] = -inf",) * 2,
    "hidden_debug": (r"tp ranks disagree on the scored hidden rows",) * 2,
    "bias_nan": (r"tp rank 1's bias shard is NaN or \+inf", r"tp rank 1's bias shard: bias\[21\] = nan is NaN or \+inf"),
    "loss_dtype": (r"tp ranks disagree on the dtype",) * 2,
    "dtensor_replicate": (r"placed \(Replicate\(\),\) on a 1-D mesh; the head must be Shard\(0\)",) * 2,
    "dtensor_tp_group": (r"weight is a DTensor: its mesh gives the group; leave tp_group out",) * 2,
    "dtensor_start": (r"its placement gives the shard's start; leave vocab_start_index out",) * 2,
    "dtensor_plain_bias": (r"bias must be a Shard\(0\) DTensor on the same mesh",) * 2,
}


@pytest.mark.parametrize("case", sorted(BAD_SETUPS))
def test_bad_setups_raise_on_every_rank(ranks, case):
    import re

    for r in range(2):
        assert re.search(BAD_SETUPS[case][r], ranks[r][1][case]), (r, ranks[r][1][case])
    assert ranks[0][1]["still_works"] == ranks[1][1]["still_works"]


@pytest.mark.parametrize("P", [2, 3])
def test_profiled_bytes_per_token_match_the_docstring(ranks, P):
    for r in range(P):
        numbers = ranks[r][2]
        assert numbers[f"P{P}.measured"] == numbers[f"P{P}.documented"] > 0


# ------------------------------------------------------------------ in this process
@settings(max_examples=25, deadline=None)
@given(vocab=st.integers(1, 40), cuts=st.lists(st.integers(0, 40), max_size=4), seed=st.integers(0, 2**16),
       masked=st.booleans())
def test_merged_shard_stats_equal_the_whole_vocabulary(vocab, cuts, seed, masked):
    """Any contiguous split (empty shards included) merges to the whole head's result."""
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(5, 8, generator=g), torch.randn(vocab, 8, generator=g)
    rows, targets = torch.arange(5), torch.randint(0, vocab, (5,), generator=g)
    bias = None
    if masked and vocab > 1:  # mask one non-target entry
        bias = torch.zeros(vocab)
        free = [v for v in range(vocab) if v not in targets.tolist()]
        if free:
            bias[free[0]] = -math.inf
    bounds = sorted([0, vocab, *(min(c, vocab) for c in cuts)])  # repeated cuts: empty shards
    stats = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        shard = vp.VocabShard(None, 0, 1, lo, hi - lo, vocab, hi - lo)
        b = None if bias is None else bias[lo:hi]
        raw, ent, lse = torch_logprob.selected_logprob_forward(hidden, weight[lo:hi], rows, shard.local_targets(targets), b,
                                                               0.8, raw_target=True)
        stats.append(torch.stack([lse, raw, ent]))
    logp, ent, lse = vp.merge_stats(torch.stack(stats))
    ref_logp, ref_ent, ref_lse = torch_logprob.selected_logprob_forward(hidden, weight, rows, targets, bias, 0.8)
    assert (logp - ref_logp).abs().max() <= LOGPROB_MAX_ABS.fp32
    assert (ent - ref_ent).abs().max() <= LOGPROB_MAX_ABS.fp32
    if len(stats) == 1:
        assert torch.equal(logp, ref_logp) and torch.equal(ent, ref_ent) and torch.equal(lse, ref_lse)


def _plain():
    c = make_case(torch.float32)
    return c["hidden"], c["weight"], dict(index=c["index"], targets=c["targets"])


BAD_ARGS = [  # (call, error, message), without an initialized process group
    (lambda h, w, kw: selected_logprob(h, w, tp_group="world", **kw), RuntimeError, r"torch\.distributed is not initialized"),
    (lambda h, w, kw: selected_logprob(h, w, vocab_start_index=3, **kw), ValueError, r"vocab_start_index applies only with tp_group"),
    (lambda h, w, kw: selected_logprob(h, w, gather_weight=True, **kw), ValueError, r"gather_weight=True applies to a DTensor"),
    (lambda h, w, kw: selected_logprob(h, w, gather_weight=1, **kw), TypeError, r"gather_weight must be a bool"),
    (lambda h, w, kw: linear_policy_loss(h, w, vocab_start_index=0, old_log_probs=torch.zeros(N), advantages=torch.zeros(N),
                                         sample_index=torch.zeros(N, dtype=torch.long), num_samples=1, **kw),
     ValueError, r"vocab_start_index applies only with tp_group"),
    (lambda h, w, kw: vp.merge_stats(torch.zeros(2, 4, 3)), ValueError, r"stats must be fp32 \[P, 2 or 3, n\]"),
    (lambda h, w, kw: vp.profiled_sent_bytes([], 0), ValueError, r"group_size must be an int >= 1"),
]


@pytest.mark.parametrize("call,error,message", BAD_ARGS)
def test_bad_arguments(call, error, message):
    h, w, kw = _plain()
    with pytest.raises(error, match=message):
        call(h, w, kw)


def test_comm_bytes_formula():
    assert vp.comm_bytes_per_token(1, 3584, True) == {"forward": 0, "backward": 0}
    assert vp.comm_bytes_per_token(2, 3584, False) == {"forward": 8, "backward": 14336}
    assert vp.comm_bytes_per_token(3, 3584, True) == {"forward": 24, "backward": 2 * 2 * 4 * 1195}
