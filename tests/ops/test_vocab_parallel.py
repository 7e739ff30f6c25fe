"""Vocabulary-parallel ``selected_logprob``, ``linear_policy_loss`` and ``sample_from_hidden``
(``tp_group=``, DTensor heads) over gloo on CPU.

One ``torch.multiprocessing`` spawn for the module (4 ranks; groups of 1, 2, 3 and 4 ranks)
runs every case once, both backends (Triton under ``TRITON_INTERPRET=1``), fp32 and bf16, and
writes each rank's tensors (safetensors) and messages (JSON); the tests below read them. The
head has 677 rows (5 whole 128-row segments and 37 rows), split on the 128-row grid unevenly
(``SPLITS``: shards starting mid-way through a 256-column tile too), plus a 1,536-row head split
evenly; -inf bias on a whole segment, on a whole shard and on the tail. Checked: the forward
(log-probs, entropies, row log-sum-exps) bitwise equal for every group size and to the
single-process op; the sampler's tokens and log-probs bitwise the single process's, plain and
filtered; gradients and the loss within the numerical contract; bitwise run to run, on every
rank and per row regardless of the batch; an FSDP2 ``fully_shard`` tiny Qwen2.5-VL on 2 ranks,
one step of the smoke loss against one process; misaligned shards and other bad setups raising
clear errors on every rank; the profiler's collective bytes against ``comm_bytes_per_token``.
Plus, in this process, shards' partials concatenating to the single device's (hypothesis).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from rlk_mm.ops import linear_policy_loss, sample_from_hidden, selected_logprob
from rlk_mm.ops._torch import logprob as torch_logprob
from rlk_mm.ops._vocab_parallel.agree import agree
from rlk_mm.ops._vocab_parallel.comm import comm_bytes_per_token, partial_columns, profiled_sent_bytes
from rlk_mm.ops._vocab_parallel.logprob import shard_forward
from rlk_mm.parity.contract import ELEMENTWISE_LOSS_MAX_ABS, LOGPROB_GRAD_REL, LOGPROB_MAX_ABS, relative_error
from support.helpers import use_backend

WORLD = 4
GROUPS = (1, 2, 3, 4)
T, H, N = 40, 16, 24
V, V_EVEN = 677, 1536
#: 128-aligned uneven splits of the 677-row head (rank 1 of P = 4 holds the masked segment 1 alone)
SPLITS = {1: (677,), 2: (384, 293), 3: (256, 256, 165), 4: (128, 128, 256, 165)}
EVEN = {P: (V_EVEN // P,) * P for P in GROUPS}
TEMPERATURE = 0.7
CASES = [(b, d) for b in ("torch", "triton") for d in (torch.float32, torch.bfloat16)]
SUBSET = [9, 2, 20, 13, 5, 0]  # a batch of other rows, in another order
FILTERS = {"plain": {}, "top_k": {"top_k": 5}, "top_p": {"top_p": 0.8}, "min_p": {"min_p": 0.05},
           "top_k_top_p": {"top_k": 40, "top_p": 0.9, "temperature": 1.3}}
B = 6  # sampled rows
#: the interpreter is slow: its filtered draws (the same ``sample_logits`` on the gathered logits as
#: on one device) run for one filter and fp32, and its bf16 case runs once (no run-to-run repeat)
SAMPLED = {case: list(FILTERS) if case[0] == "torch" else ["plain", "min_p"] if case[1] == torch.float32 else ["plain"]
           for case in CASES}
REPEATS = {case: (1,) if case == ("triton", torch.bfloat16) else (1, 2) for case in CASES}


def _tag(backend, dtype, P, what):
    return f"{backend}.{str(dtype).replace('torch.', '')}.{'single' if P is None else f'P{P}'}.{what}"


def make_case(dtype, vocab=V):
    """Hidden states, head (bias -inf on segment 1 and on the tail: no targets there), rows (one repeated), targets."""
    g = torch.Generator().manual_seed(0)
    masked = torch.zeros(vocab, dtype=torch.bool)
    masked[128:256] = True
    masked[vocab - 40 :] = True
    c = {
        "hidden": torch.randn(T, H, generator=g).to(dtype),
        "weight": (torch.randn(vocab, H, generator=g) * 0.5).to(dtype),
        "bias": torch.where(masked, -math.inf, torch.randn(vocab, generator=g) * 0.3).to(dtype),
        "index": torch.cat([torch.randperm(T, generator=g)[: N - 1], torch.tensor([3])]),
        "targets": torch.nonzero(~masked).flatten()[torch.randint(0, int((~masked).sum()), (N,), generator=g)],
        "up_logp": torch.randn(N, generator=g),
        "up_entropy": torch.randn(N, generator=g),
        "old_log_probs": -torch.rand(N, generator=g) * 4,
        "advantages": torch.randn(N, generator=g),
        "ref_log_probs": -torch.rand(N, generator=g) * 4,
        "sample_index": torch.arange(N) // 8,
        "seeds": torch.randint(-(2**62), 2**62, (B,), generator=g),
    }
    return c


def bounds(sizes, rank):
    return sum(sizes[:rank]), sizes[rank]


def shard_of(c, sizes, rank):
    start, size = bounds(sizes, rank)
    return c["weight"][start : start + size], c["bias"][start : start + size]


# ------------------------------------------------------------------ the worker
def _logprob_run(c, weight, bias, group, index=None, targets=None):
    leaves = [t.clone().requires_grad_() for t in (c["hidden"], weight, bias)]
    index = c["index"] if index is None else index
    targets = c["targets"] if targets is None else targets
    logp, ent = selected_logprob(leaves[0], leaves[1], index=index, targets=targets, bias=leaves[2],
                                 temperature=TEMPERATURE, return_entropy=True, tp_group=group)
    n = index.numel()
    torch.autograd.backward([logp, ent], [c["up_logp"][:n], c["up_entropy"][:n]])
    return {"logp": logp, "entropy": ent, "d_hidden": leaves[0].grad, "d_weight": leaves[1].grad,
            "d_bias": leaves[2].grad}


def _loss_run(c, weight, bias, group):
    leaves = [t.clone().requires_grad_() for t in (c["hidden"], weight, bias)]
    out = linear_policy_loss(
        leaves[0], leaves[1], index=c["index"], targets=c["targets"], bias=leaves[2], temperature=TEMPERATURE,
        old_log_probs=c["old_log_probs"], advantages=c["advantages"], ref_log_probs=c["ref_log_probs"],
        sample_index=c["sample_index"], num_samples=3, kl_coef=0.1, entropy_coeff=0.01, tp_group=group)
    out.loss.backward()
    return {"loss": out.loss.detach().reshape(1), "logp": out.log_probs, "entropy": out.entropy,
            "d_hidden": leaves[0].grad, "d_weight": leaves[1].grad, "d_bias": leaves[2].grad}


def _stats(c, weight, bias, group):
    """(log-prob, entropy, row log-sum-exp) of the forward: the backend's own, or the group's."""
    h, rows, tgt = c["hidden"], c["index"], c["targets"]
    if group is None:
        if os.environ["RLK_MM_BACKEND"] == "triton":
            from rlk_mm.ops._triton import logprob as triton_logprob

            out = triton_logprob.forward(h, weight, rows, tgt, bias, TEMPERATURE, True, False)
        else:
            out = torch_logprob.selected_logprob_forward(h, weight, rows, tgt, bias, TEMPERATURE)
    else:
        shard, all_rows = agree(h, weight, rows, tgt, bias, TEMPERATURE, group, None, False, lambda: None)
        out = shard_forward(h, weight, rows, tgt, bias, TEMPERATURE, True, all_rows, shard)
    return dict(zip(("logp", "entropy", "lse"), out))


def _samples(c, weight, bias, group, names):
    out = {}
    for name in names:
        kw = FILTERS[name]
        r = sample_from_hidden(c["hidden"][:B], weight, bias=bias, seeds=c["seeds"], step=3, tp_group=group,
                               **{"temperature": TEMPERATURE, **kw})
        out.update({f"{name}.tokens": r.tokens, f"{name}.log_probs": r.log_probs,
                    f"{name}.sampled": r.sampled_log_probs})
    return out


def _small_chunks():
    """The Triton kernels cut into chunks of 16 rows: the fused loss's chunk logits (the
    largest shard's: a rank cutting its own chunks would desynchronise the per-chunk
    collective) and the forward's partials (the whole vocabulary's: 22 partials of 32
    columns, 3 fp32 each, local and gathered)."""
    from rlk_mm.ops._triton import linear_loss as triton_linear_loss
    from rlk_mm.ops._triton import logprob as triton_logprob

    original = triton_linear_loss.default_config
    budgets = {"linear_budget": 16 * 384 * 4 * 2 - 1, "partials_budget": 16 * 22 * 4 * 3 * 2}

    def config(dtype, device, rows=None):
        return type(original(dtype, device, rows=rows))(**{**original(dtype, device, rows=rows).__dict__, **budgets})

    triton_linear_loss.default_config = triton_logprob.default_config = config


@contextlib.contextmanager
def _wide_tiles():
    """The Triton forward with the CUDA bf16 tile width, 256 columns: two segments per tile."""
    from rlk_mm.ops._triton import logprob as triton_logprob

    original = triton_logprob.default_config
    triton_logprob.default_config = lambda dtype, device, rows=None: type(original(dtype, device, rows=rows))(
        **{**original(dtype, device, rows=rows).__dict__, "block_n": 256})
    try:
        yield
    finally:
        triton_logprob.default_config = original


def _cases_worker(rank, groups, results):
    _small_chunks()
    for backend, dtype in CASES:
        os.environ["RLK_MM_BACKEND"] = backend
        c, even = make_case(dtype), make_case(dtype, V_EVEN)
        if rank == 0:
            runs = {"logprob": _logprob_run(c, c["weight"], c["bias"], None),
                    "loss": _loss_run(c, c["weight"], c["bias"], None),
                    "stats": _stats(c, c["weight"], c["bias"], None),
                    "even": _stats(even, even["weight"], even["bias"], None),
                    "sample": _samples(c, c["weight"], c["bias"], None, SAMPLED[backend, dtype])}
            for name, run in runs.items():
                results.update({_tag(backend, dtype, None, f"{name}.{k}"): v for k, v in run.items()})
        for P in GROUPS:
            if rank >= P:
                continue
            w, b = shard_of(c, SPLITS[P], rank)
            for rep in REPEATS[backend, dtype]:
                for name, run in (("logprob", _logprob_run), ("loss", _loss_run)):
                    results.update({_tag(backend, dtype, P, f"{name}.run{rep}.{k}"): v
                                    for k, v in run(c, w, b, groups[P]).items()})
            results.update({_tag(backend, dtype, P, f"stats.{k}"): v for k, v in _stats(c, w, b, groups[P]).items()})
            results.update({_tag(backend, dtype, P, f"even.{k}"): v
                            for k, v in _stats(even, *shard_of(even, EVEN[P], rank), groups[P]).items()})
            samples = _samples(c, w, b, groups[P], SAMPLED[backend, dtype])
            results.update({_tag(backend, dtype, P, f"sample.{k}"): v for k, v in samples.items()})
            sub = torch.tensor(SUBSET)
            part = _logprob_run(c, w, b, groups[P], index=c["index"][sub], targets=c["targets"][sub])
            results[_tag(backend, dtype, P, "logprob.subset.logp")] = part["logp"]
        if backend == "triton" and dtype == torch.float32:
            with _wide_tiles():
                if rank == 0:
                    results.update({f"wide.single.{k}": v for k, v in _stats(c, c["weight"], c["bias"], None).items()})
                for P in GROUPS:
                    if rank < P:
                        stats = _stats(c, *shard_of(c, SPLITS[P], rank), groups[P])
                        results.update({f"wide.P{P}.{k}": v for k, v in stats.items()})
    os.environ["RLK_MM_BACKEND"] = "torch"  # a 130-row head over 3 ranks as 128 + 2 + 0 rows: an empty shard
    c = make_case(torch.float32, vocab=130)
    c["bias"] = torch.zeros(130)
    if rank == 0:
        results.update({f"empty_shard.single.{k}": v for k, v in _logprob_run(c, c["weight"], c["bias"], None).items()})
    if rank < 3:
        w, b = shard_of(c, (128, 2, 0), rank)
        results.update({f"empty_shard.tp.{k}": v for k, v in _logprob_run(c, w, b, groups[3]).items()})
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
    start, size = bounds(SPLITS[2], rank)
    w, b = shard_of(c, SPLITS[2], rank)
    common = dict(index=c["index"], targets=c["targets"], tp_group=group)

    def call(hidden=c["hidden"], weight=w, bias=b, **kw):
        return selected_logprob(hidden, weight, bias=bias, **{**common, **kw})

    broken = rank == 1
    _expect_error(messages, "vocab_start_index", lambda: call(vocab_start_index=start - 1 if broken else start))
    _expect_error(messages, "misaligned", lambda: call(weight=c["weight"][:300] if rank == 0 else c["weight"][300:],
                                                       bias=None))
    _expect_error(messages, "dtype", lambda: call(hidden=c["hidden"].bfloat16(), weight=w.bfloat16(), bias=b.bfloat16())
                  if broken else call())
    _expect_error(messages, "targets", lambda: call(targets=(c["targets"] + 1) if broken else c["targets"]))
    _expect_error(messages, "refused", lambda: call(weight=torch.zeros(size, H + 1)) if broken else call())
    _expect_error(messages, "out_of_range", lambda: call(targets=torch.full((N,), V)))
    masked = b.clone()
    if broken:  # rank 1 owns token 400: its bias masks it; targets[0] is 400 on every rank
        masked[400 - start] = -math.inf
    _expect_error(messages, "masked_target", lambda: call(bias=masked, targets=torch.full((N,), 400)))
    nan_bias = b.clone()
    if broken:
        nan_bias[2] = math.nan  # vocabulary row 384 + 2
    _expect_error(messages, "bias_nan", lambda: call(bias=nan_bias))
    perturbed = c["hidden"] + (1e-3 if broken else 0.0)
    os.environ["RLK_MM_TP_DEBUG"] = "1"
    _expect_error(messages, "hidden_debug", lambda: call(hidden=perturbed))
    os.environ.pop("RLK_MM_TP_DEBUG")
    _expect_error(messages, "loss_dtype", lambda: linear_policy_loss(
        c["hidden"].bfloat16() if broken else c["hidden"], w.bfloat16() if broken else w, index=c["index"],
        targets=c["targets"], old_log_probs=c["old_log_probs"], advantages=c["advantages"],
        sample_index=c["sample_index"], num_samples=3, tp_group=group))
    _expect_error(messages, "sample_seeds", lambda: sample_from_hidden(
        c["hidden"][:B], w, bias=b, seeds=c["seeds"] + int(broken), tp_group=group))
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh.from_group(group, "cpu")
    replicated = distribute_tensor(c["weight"], mesh, [Replicate()])
    _expect_error(messages, "dtensor_replicate",
                  lambda: selected_logprob(c["hidden"], replicated, index=c["index"], targets=c["targets"]))
    sharded = distribute_tensor(c["weight"], mesh, [Shard(0)])  # 339 + 338 rows: off the grid
    _expect_error(messages, "dtensor_misaligned",
                  lambda: selected_logprob(c["hidden"], sharded, index=c["index"], targets=c["targets"]))
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
    for P in (2, 3, 4):
        if rank >= P:
            continue
        w, b = shard_of(c, SPLITS[P], rank)
        sent = []
        for n in (6, 14):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                _logprob_run(c, w, b, groups[P], index=c["index"][:n], targets=c["targets"][:n])
            sent.append(sum(profiled_sent_bytes(prof.events(), P).values()))
        numbers[f"P{P}.measured"] = (sent[1] - sent[0]) / 8
        numbers[f"P{P}.documented"] = sum(comm_bytes_per_token(
            P, H, True, V, largest_shard=max(SPLITS[P]), partial_columns=partial_columns(w)).values())
    os.environ.pop("RLK_MM_BACKEND")


def _fsdp_worker(rank, group, numbers):
    """One smoke-loss step of an FSDP2 tiny Qwen2.5-VL on ranks 0 and 1 against one process. Its
    head has Qwen2.5-VL-7B's padded 152,064 rows: FSDP2's Shard(0) halves are on the 128-row grid."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from rlk_mm import fixtures
    from rlk_mm.models import forward_hidden
    from rlk_mm.schema import RLBatch

    processor = fixtures.qwen_vl_processor()
    samples = fixtures.synthetic_image_text(2, seed=0, max_images=1, sizes=((56, 56),))
    batches = [RLBatch.from_qwen_vl(fixtures.processor_inputs(processor, [s]), processor=processor,
                                    responses=[[5, 17, 151645]], group_ids=["g"]) for s in samples]
    both = RLBatch.from_qwen_vl(fixtures.processor_inputs(processor, samples), processor=processor,
                                responses=[[5, 17, 151645], [5, 17, 151645]], group_ids=["a", "b"])
    g = torch.Generator().manual_seed(1)
    inputs = {k: (-torch.rand(6, generator=g)) for k in ("old_log_probs", "ref_log_probs")}
    inputs["advantages"] = torch.randn(6, generator=g)

    def loss_of(model, batch, rows, **kw):
        hidden = forward_hidden(model, batch)
        return linear_policy_loss(hidden, model.lm_head.weight, batch, temperature=0.9, kl_type="low_var_kl",
                                  kl_coef=0.05, loss_agg_mode="token-mean", **{k: v[rows] for k, v in inputs.items()},
                                  **kw).loss

    def grads(model):
        return {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                for k, p in model.named_parameters() if p.grad is not None}

    base = fixtures.tiny_qwen2_5_vl(seed=0, vocab_size=152064)
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
    groups = {P: dist.new_group(list(range(P))) for P in GROUPS}
    results, messages, numbers = {}, {}, {}
    _cases_worker(rank, groups, results)
    if rank < 2:
        _bad_setups_worker(rank, groups[2], messages)
    _comm_worker(rank, groups, numbers)
    if rank < 2:
        _fsdp_worker(rank, groups[2], numbers)
    dist.barrier()
    save_file({k: v.detach().clone().contiguous() for k, v in results.items()},
              os.path.join(out_dir, f"rank{rank}.safetensors"))
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


def _case_id(case):
    return f"{case[0]}-{str(case[1]).replace('torch.', '')}"


# ------------------------------------------------------------------ bitwise: every group size, one device
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("layout", ["stats", "even"], ids=["uneven", "even"])
def test_forward_bitwise_equal_for_every_group_size_and_to_one_process(ranks, case, layout):
    single = ranks[0][0]
    for P in GROUPS:
        for r in range(P):
            for k in ("logp", "entropy", "lse"):
                got, want = ranks[r][0][_tag(*case, P, f"{layout}.{k}")], single[_tag(*case, None, f"{layout}.{k}")]
                assert torch.equal(got, want), (P, r, k, (got - want).abs().max().item())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("P", GROUPS)
def test_ops_log_probs_bitwise_the_single_process_selected_logprob(ranks, case, P):
    """``selected_logprob`` and ``linear_policy_loss`` with ``tp_group``: their log-probs and
    entropies are the single-process ``selected_logprob``'s, bitwise."""
    single = ranks[0][0]
    for r in range(P):
        for op in ("logprob", "loss"):
            for k in ("logp", "entropy"):
                got = ranks[r][0][_tag(*case, P, f"{op}.run1.{k}")]
                assert torch.equal(got, single[_tag(*case, None, f"logprob.{k}")]), (op, r, k)
        assert torch.equal(single[_tag(*case, None, "stats.logp")], single[_tag(*case, None, "logprob.logp")])


def test_two_segments_per_tile_bitwise_for_every_group_size(ranks):
    """The Triton forward with 256-column tiles (CUDA's bf16 width): a shard starting at row 128
    or 384 holds its segments in the other half of a tile than one device does."""
    for P in GROUPS:
        for r in range(P):
            for k in ("logp", "entropy", "lse"):
                assert torch.equal(ranks[r][0][f"wide.P{P}.{k}"], ranks[0][0][f"wide.single.{k}"]), (P, r, k)
    assert (ranks[0][0]["wide.single.logp"] - ranks[0][0]["triton.float32.single.stats.logp"]).abs().max() \
        <= LOGPROB_MAX_ABS.fp32


@pytest.mark.parametrize("case,name", [(case, name) for case in CASES for name in SAMPLED[case]],
                         ids=lambda v: _case_id(v) if isinstance(v, tuple) else v)
def test_sampler_bitwise_the_single_process_for_every_group_size(ranks, case, name):
    single = ranks[0][0]
    for P in GROUPS:
        for r in range(P):
            for k in ("tokens", "log_probs", "sampled"):
                key = f"sample.{name}.{k}"
                assert torch.equal(ranks[r][0][_tag(*case, P, key)], single[_tag(*case, None, key)]), (P, r, k)
    tokens = single[_tag(*case, None, f"sample.{name}.tokens")]
    c = make_case(case[1])
    with use_backend(case[0]):
        want = selected_logprob(c["hidden"][:B], c["weight"], index=torch.arange(B), targets=tokens, bias=c["bias"],
                                temperature=FILTERS[name].get("temperature", TEMPERATURE))
    assert torch.equal(single[_tag(*case, None, f"sample.{name}.log_probs")], want)


# ------------------------------------------------------------------ within the contract; deterministic
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("P", GROUPS)
@pytest.mark.parametrize("op", ["logprob", "loss"])
def test_gradients_and_loss_within_the_contract_of_one_process(ranks, case, P, op):
    dtype = case[1]
    single = {k: ranks[0][0][_tag(*case, None, f"{op}.{k}")] for k in ("d_hidden", "d_weight", "d_bias")}
    for r in range(P):
        got = {k: ranks[r][0][_tag(*case, P, f"{op}.run1.{k}")] for k in single}
        assert relative_error(got["d_hidden"], single["d_hidden"]) <= LOGPROB_GRAD_REL.for_dtype(dtype), r
        start, size = bounds(SPLITS[P], r)
        for k in ("d_weight", "d_bias"):  # every rank's shard of the head's gradient
            assert got[k].shape[0] == size
            assert relative_error(got[k], single[k][start : start + size]) <= LOGPROB_GRAD_REL.for_dtype(dtype), (r, k)
        if op == "loss":
            loss, ref = ranks[r][0][_tag(*case, P, "loss.run1.loss")], ranks[0][0][_tag(*case, None, "loss.loss")]
            assert (loss - ref).abs().item() <= ELEMENTWISE_LOSS_MAX_ABS.for_dtype(dtype)
        if P == 1:  # a group of one is the single-device op, bitwise
            for k in single:
                assert torch.equal(got[k], single[k]), k


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("P", GROUPS)
def test_bitwise_run_to_run_equal_on_every_rank_and_batch_invariant(ranks, case, P):
    res = [ranks[r][0] for r in range(P)]
    for op in ("logprob", "loss"):
        for r in range(P):
            for key in [k for k in res[r] if k.startswith(_tag(*case, P, f"{op}.run1."))]:
                if 2 in REPEATS[case]:
                    assert torch.equal(res[r][key], res[r][key.replace(".run1.", ".run2.")]), key
                if not key.endswith(("d_weight", "d_bias")):  # replicated outputs: the same bits on every rank
                    assert torch.equal(res[r][key], res[0][key]), (r, key)
    for r in range(P):
        full = res[r][_tag(*case, P, "logprob.run1.logp")]
        assert torch.equal(res[r][_tag(*case, P, "logprob.subset.logp")], full[torch.tensor(SUBSET)])


def test_an_empty_shard_adds_nothing(ranks):
    single = ranks[0][0]
    for r, (start, size) in enumerate([(0, 128), (128, 2), (130, 0)]):
        got = ranks[r][0]
        for k in ("logp", "entropy"):
            assert torch.equal(got[f"empty_shard.tp.{k}"], single[f"empty_shard.single.{k}"]), (r, k)
        assert relative_error(got["empty_shard.tp.d_hidden"],
                              single["empty_shard.single.d_hidden"]) <= LOGPROB_GRAD_REL.fp32
        assert got["empty_shard.tp.d_weight"].shape == (size, H)
        if size:
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


MISALIGNED = (r"tp rank 1's vocabulary shard starts at row {start}, not a multiple of 128 \(shard sizes {sizes}\).*"
              r"every shard but the last must hold a multiple of 128 rows\. Pad the vocabulary to a multiple of "
              r"128 x 2 = 256 .*pad_to_multiple_of=256")
BAD_SETUPS = {  # case: (rank 0's error, rank 1's error); rank 1's inputs are the broken ones
    "vocab_start_index": (r"tp rank 1 gives vocab_start_index=383 but the shards of ranks 0\.\.0 hold 384 rows",) * 2,
    "misaligned": (MISALIGNED.format(start=300, sizes=r"\[300, 377\]"),) * 2,
    "dtensor_misaligned": (MISALIGNED.format(start=339, sizes=r"\[339, 338\]") + r".*gather_weight=True",) * 2,
    "dtype": (r"tp ranks disagree on the dtype: rank 0 has torch\.float32, rank 1 has torch\.bfloat16",) * 2,
    "targets": (r"tp ranks disagree on the scored rows and targets",) * 2,
    "refused": (r"tp rank 1 refused its inputs", r"hidden size mismatch: hidden is \[T, 16\] but weight is \[V, 17\]"),
    "out_of_range": (r"targets\[0\] = 677 is out of range: there are 677 vocabulary entries",) * 2,
    "masked_target": (r"targets\[0\] = 400 is masked: bias\[400\] = -inf",) * 2,
    "hidden_debug": (r"tp ranks disagree on the scored hidden rows",) * 2,
    "bias_nan": (r"tp rank 1's bias shard is NaN or \+inf",
                 r"tp rank 1's bias shard: bias\[386\] = nan is NaN or \+inf"),
    "loss_dtype": (r"tp ranks disagree on the dtype",) * 2,
    "sample_seeds": (r"tp ranks disagree on the scored rows and targets",) * 2,
    "dtensor_replicate": (r"placed \(Replicate\(\),\) on a 1-D mesh; the head must be Shard\(0\)",) * 2,
    "dtensor_tp_group": (r"weight is a DTensor: its mesh gives the group; leave tp_group out",) * 2,
    "dtensor_start": (r"its placement gives the shard's start; leave vocab_start_index out",) * 2,
    "dtensor_plain_bias": (r"bias must be a Shard\(0\) DTensor on the same mesh",) * 2,
}


@pytest.mark.parametrize("case", sorted(BAD_SETUPS))
def test_bad_setups_raise_on_every_rank(ranks, case):
    for r in range(2):
        assert re.search(BAD_SETUPS[case][r], ranks[r][1][case]), (r, ranks[r][1][case])
    assert ranks[0][1]["still_works"] == ranks[1][1]["still_works"]


@pytest.mark.parametrize("P", [2, 3, 4])
def test_profiled_bytes_per_token_match_the_docstring(ranks, P):
    for r in range(P):
        numbers = ranks[r][2]
        assert numbers[f"P{P}.measured"] == numbers[f"P{P}.documented"] > 0


# ------------------------------------------------------------------ in this process
class _Capture:
    """An exchange for one shard alone (no collective): records the partials it is given."""

    def __init__(self):
        self.parts = []

    def __call__(self, parts, tgt_logit, start, cols):
        self.parts.append(parts.clone())
        return parts.contiguous(), tgt_logit


def _partials(forward, c, lo, hi):
    capture = _Capture()
    local = torch.where((c["targets"] >= lo) & (c["targets"] < hi), c["targets"] - lo, -1)
    forward(c["hidden"], c["weight"][lo:hi], c["index"], local, c["bias"][lo:hi], capture)
    return torch.cat(capture.parts, dim=2)  # [k, partials, rows]


@settings(max_examples=15, deadline=None)
@given(segments=st.integers(1, 6), tail=st.integers(0, 127), cuts=st.lists(st.integers(0, 6), max_size=3),
       seed=st.integers(0, 2**16))
def test_shard_partials_concatenate_to_the_single_device_partials(segments, tail, cuts, seed):
    """Any split on the 128-row grid: the shards' partials, in rank order, are the whole
    head's, bitwise (torch backend)."""
    vocab = segments * 128 + tail
    g = torch.Generator().manual_seed(seed)
    c = {"hidden": torch.randn(12, 8, generator=g), "weight": torch.randn(vocab, 8, generator=g),
         "bias": torch.randn(vocab, generator=g), "index": torch.arange(12),
         "targets": torch.randint(0, vocab, (12,), generator=g)}

    def forward(h, w, rows, tgt, b, exchange):
        return torch_logprob.selected_logprob_forward(h, w, rows, tgt, b, 0.8, exchange=exchange)

    bounds_ = sorted({0, vocab, *(min(128 * k, vocab) for k in cuts)})
    whole = _partials(forward, c, 0, vocab)
    shards = [_partials(forward, c, lo, hi) for lo, hi in zip(bounds_[:-1], bounds_[1:])]
    assert torch.equal(torch.cat(shards, dim=1), whole)


def test_triton_shard_partials_concatenate_to_the_single_device_partials():
    """The Triton forward's partials with 256-column tiles (two segments each), shards starting
    at rows 128 and 384 (mid-tile): bitwise the whole head's."""
    from rlk_mm.ops._triton import lm_head
    from rlk_mm.ops._triton import logprob as triton_logprob

    c = make_case(torch.float32)
    base = lm_head.default_config(torch.float32, torch.device("cpu"))
    wide = type(base)(**{**base.__dict__, "block_n": 256})

    def forward(h, w, rows, tgt, b, exchange):
        return triton_logprob.forward(h, w, rows, tgt, b, 0.8, True, False, config=wide, exchange=exchange)

    whole = _partials(forward, c, 0, V)
    shards = [_partials(forward, c, lo, hi) for lo, hi in ((0, 128), (128, 384), (384, V))]
    assert whole.shape[1] == math.ceil(V / 128) and torch.equal(torch.cat(shards, dim=1), whole)


def _plain():
    c = make_case(torch.float32)
    return c["hidden"], c["weight"], dict(index=c["index"], targets=c["targets"])


BAD_ARGS = [  # (call, error, message), without an initialized process group
    (lambda h, w, kw: selected_logprob(h, w, tp_group="world", **kw), RuntimeError,
     r"torch\.distributed is not initialized"),
    (lambda h, w, kw: selected_logprob(h, w, vocab_start_index=3, **kw), ValueError,
     r"vocab_start_index applies only with tp_group"),
    (lambda h, w, kw: selected_logprob(h, w, gather_weight=True, **kw), ValueError,
     r"gather_weight=True applies to a DTensor"),
    (lambda h, w, kw: selected_logprob(h, w, gather_weight=1, **kw), TypeError, r"gather_weight must be a bool"),
    (lambda h, w, kw: linear_policy_loss(h, w, vocab_start_index=0, old_log_probs=torch.zeros(N),
                                         advantages=torch.zeros(N), sample_index=torch.zeros(N, dtype=torch.long),
                                         num_samples=1, **kw),
     ValueError, r"vocab_start_index applies only with tp_group"),
    (lambda h, w, kw: sample_from_hidden(h[:2], w, seeds=torch.zeros(2, dtype=torch.long), tp_group="world"),
     RuntimeError, r"torch\.distributed is not initialized"),
    (lambda h, w, kw: profiled_sent_bytes([], 0), ValueError, r"group_size must be an int >= 1"),
]


@pytest.mark.parametrize("call,error,message", BAD_ARGS)
def test_bad_arguments(call, error, message):
    h, w, kw = _plain()
    with pytest.raises(error, match=message):
        call(h, w, kw)


def test_comm_bytes_formula():
    """Forward: (P-1)·4·(k·⌈L/G⌉ + 1); backward: 2·(P-1)·4·⌈H/P⌉ (the module docstring's numbers)."""
    assert comm_bytes_per_token(1, 3584, True, 152064) == {"forward": 0, "backward": 0}
    assert comm_bytes_per_token(2, 3584, True, 152064) == {"forward": 4 * (3 * 594 + 1), "backward": 14336}
    assert comm_bytes_per_token(4, 3584, True, 152064) == {"forward": 3 * 4 * (3 * 297 + 1), "backward": 21504}
    assert comm_bytes_per_token(2, 3584, False, 152064) == {"forward": 4 * (2 * 594 + 1), "backward": 14336}
    assert comm_bytes_per_token(3, 3584, True, 677, largest_shard=256, partial_columns=32) == \
        {"forward": 2 * 4 * (3 * 8 + 1), "backward": 2 * 2 * 4 * 1195}
