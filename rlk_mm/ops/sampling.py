"""Rollout sampling with seeded, batch-invariant streams and the log-probs training reproduces.

``sample`` draws one token per row of ``logits [B, V]``; ``sample_from_hidden`` fuses the LM
head with the draw (no ``[B, V]`` logits for plain temperature; filters read back logits
written a row chunk at a time, a second pass). Both return a ``SampleResult``: the tokens,
their log-probs under the plain temperature distribution (what training's
``selected_logprob`` computes; for ``sample_from_hidden`` bitwise its value) and under the
truncated, renormalized distribution they were drawn from (rollout importance correction
needs both).

Randomness is counter-based: a pure function of (the row's seed, its step, the vocabulary
index), so a row's token never depends on the batch, its position in it or the batch size,
and the same seeds give the same tokens on every run and device. ``group_seeds`` gives every
member of a GRPO group its own stream. What is drawn, exactly, is written in
``_torch/sampling.py``. Backends: Triton (CUDA, the default there), torch (CPU), and
``"flashinfer"`` (``flashinfer.sampling``; its own Philox stream, seeded from the batch:
reproducible, not batch-invariant).

No host sync on the default path: arguments are checked on the host before any launch; what
needs the device's data (a NaN or +inf logit, a row masked everywhere, a device ``step``
tensor's range) is looked for only with ``check=True``, which reads the rows' status back and
raises for the first bad row. By default a bad row is marked by NaN log-probs. The Triton
path from logits is two launches, three or four with filters (``_triton/sampling/logits.py`` has the
design and the roofline), and can be captured in a CUDA graph, ``step`` a device tensor
advanced between replays.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch

from ..schema.checks import (
    INTEGER_DTYPES,
    KERNEL_FLOAT_DTYPES,
    bool_arg,
    first_true,
    float_arg,
    group_id_list,
    int_arg,
    temperature_arg,
    tensor_arg,
)
from ._backend import backend_arg, readable_args, resolve_backend
from ._head_inputs import check_bias, check_head, contiguous_rows
from ._torch import sampling as _ref
from .logprob import sharded_head
from .options import Backend

__all__ = ["group_seeds", "sample", "sample_from_hidden", "SampleResult"]

Tensor = torch.Tensor

if TYPE_CHECKING:  # annotations only: torch.distributed is not imported at run time here
    from torch.distributed import ProcessGroup

#: the values of ``sample(backend=...)`` (``sample_from_hidden`` takes all but flashinfer)
BACKENDS = (None, Backend.TORCH, Backend.TRITON, Backend.FLASHINFER)
#: the integer masses (units of 2^-40 of the top token's) are summed in int64: V < 2^23
MAX_VOCAB = 1 << 23


class SampleResult(NamedTuple):
    """One drawn token per row, and its log-probs (fp32, detached: a draw keeps no autograd graph)."""

    tokens: Tensor  # int64 [B]
    log_probs: Tensor  # fp32 [B]: under softmax(logits / temperature)
    sampled_log_probs: Tensor  # fp32 [B]: under the filtered, renormalized distribution drawn from


def sample(
    logits: Tensor, *, temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
    min_p: Optional[float] = None, seeds: Tensor, step: int | Tensor = 0, backend: Backend | str | None = None, check: bool = False,
) -> SampleResult:
    """Draw one token per row of ``logits [B, V]`` (fp32/bf16/fp16; -inf masks an entry).

    Filters apply in this order on the tempered logits: ``top_k``, then ``top_p`` on the
    survivors, then ``min_p``. The default path reads nothing back from the device (no host
    sync) and can be captured in a CUDA graph (pass ``step`` as a device tensor and update
    it in place between replays).

    Parameters
    ----------
    logits : Tensor
        ``[B, V]`` float32, bfloat16 or float16.
    temperature : float
        > 0; divides the logits (for greedy decoding take ``argmax``).
    top_k : int, optional
        >= 1: keep the k largest (ties at the boundary kept).
    top_p : float, optional
        In (0, 1]: keep the smallest top set holding that share of the survivors' mass.
    min_p : float, optional
        In [0, 1]: keep tokens with probability >= min_p x the top one's.
    seeds : Tensor
        One integer seed per row, ``[B]`` (``group_seeds``); on the logits' device for no copy.
    step : int or Tensor
        The decoding step: an int in [0, 2^32), or an integer tensor ``[]`` or ``[B]`` (a
        device tensor is used modulo 2^32 and range-checked only with ``check=True``).
    backend : Backend or str, optional
        None (Triton on CUDA, torch elsewhere; ``RLK_MM_BACKEND`` forces one), "torch",
        "triton" or "flashinfer".
    check : bool
        False (default): a bad row (a NaN or +inf logit, every entry -inf, or an overflow
        after the temperature) is reported by NaN ``log_probs`` and ``sampled_log_probs``
        and token 0, on every backend and under every filter; nothing is read back. True:
        read the rows' status (a host sync) and raise for the first bad row, and
        range-check a device ``step`` tensor.

    Returns
    -------
    SampleResult
        ``tokens`` int64 ``[B]``, ``log_probs`` and ``sampled_log_probs`` fp32 ``[B]``.

    Raises
    ------
    ValueError, TypeError
        Bad arguments (always, before any launch); bad rows only with ``check=True``.
    """
    tensor_arg("logits", logits)
    readable_args("sample", logits=logits, seeds=seeds, step=step)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V] (one row per sample); got shape {tuple(logits.shape)}")
    if logits.dtype not in KERNEL_FLOAT_DTYPES:
        raise TypeError(f"logits must be float32, bfloat16 or float16; got {logits.dtype}")
    B, V = logits.shape
    inv_t, filters = _settings(temperature, top_k, top_p, min_p, V)
    check = bool_arg("check", check)
    seeds, step = _seeds_and_steps(seeds, step, B, logits.device, check)
    backend = backend_arg(backend, "backend", BACKENDS[1:])
    logits = (logits if logits.stride(-1) == 1 else logits.contiguous()).detach()  # no graph on any backend
    if backend is Backend.FLASHINFER:
        from ._flashinfer import sampling as _fi

        steps = _step_rows(step, B, logits.device)
        tokens = _fi.draw(logits, inv_t, filters, seeds, steps)
        out = _score(logits, inv_t, filters, seeds, steps, tokens)
    elif resolve_backend(backend, on_cuda=logits.is_cuda) is Backend.TRITON:
        from ._triton import sampling as _tri

        out = _tri.sample_logits(logits, inv_t, filters, seeds, step)
    else:
        out = _ref.sample_rows(logits, inv_t, filters, seeds, _step_rows(step, B, logits.device))
    return _result(out, lambda r, _: _logits_problem(logits, r, inv_t, temperature), check)


def sample_from_hidden(
    hidden: Tensor, weight: Tensor, *, bias: Optional[Tensor] = None, temperature: float = 1.0,
    top_k: Optional[int] = None, top_p: Optional[float] = None, min_p: Optional[float] = None,
    seeds: Tensor, step: int | Tensor = 0, backend: Backend | str | None = None,
    tp_group: Optional[ProcessGroup] = None, check: bool = False,
) -> SampleResult:
    """``sample`` of the logits ``(hidden · weightᵀ + bias) / temperature``, the LM head fused
    with the draw: ``hidden [B, H]``, ``weight [V, H]``, ``bias [V]`` (finite, or -inf to mask
    a token), one dtype. ``log_probs`` equal ``selected_logprob(hidden, weight, index=rows,
    targets=tokens, temperature=..., bias=...)`` bitwise on the same backend (under
    ``batch_invariant()`` too). Plain temperature never writes ``[B, V]`` logits (Triton);
    filters take a second pass over logits written a row chunk at a time. Backends as
    ``sample``, without "flashinfer" (it samples from logits only).

    Vocabulary-parallel heads (``_vocab_parallel``): with ``tp_group`` (or a ``Shard(0)``
    DTensor head) ``weight``/``bias`` are this rank's contiguous shard, starting on the
    128-row grid, every rank passing the same hidden rows, seeds and settings; every rank
    gets the single device's tokens and log-probs, bitwise, for plain temperature and for
    every filter (filters gather the rows' logits: they need the whole row).

    ``step`` and ``check`` as in ``sample``: by default nothing is read back (a row whose
    logits hold NaN or +inf, from hidden, weight or bias, or are -inf everywhere, gets token 0
    and NaN log-probs on every backend; a NaN or +inf bias entry or a bias masking every
    token is not looked for); ``check=True`` reads back and raises, naming the row or the
    bias entry. The vocabulary-parallel path always checks (its ranks agree on the
    inputs over the group first).

    Raises
    ------
    ValueError, TypeError
        Bad arguments (shapes, dtypes, devices, settings); bad rows or bias only with ``check=True``.
    """
    tensor_arg("hidden", hidden)
    readable_args("sample_from_hidden", hidden=hidden, seeds=seeds, step=step)  # (weight and bias: on its device)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [B, H] (one hidden state per sample); got shape {tuple(hidden.shape)}")
    B = hidden.shape[0]
    rows = torch.arange(B, device=hidden.device)
    weight, bias, tp_group = sharded_head(weight, bias, tp_group, None, False)
    tensor_arg("weight", weight)
    check_head(hidden, weight, rows, rows, bias, 1.0, shard=tp_group is not None)  # shapes, dtypes, devices
    V = weight.shape[0]  # a shard's: the group's vocabulary settles top-k and the size check (_vocab_parallel)
    inv_t, filters = _settings(temperature, top_k, top_p, min_p, V if tp_group is None else MAX_VOCAB)
    temperature = float(temperature)
    check = bool_arg("check", check)
    seeds, step = _seeds_and_steps(seeds, step, B, hidden.device, check)
    steps = _step_rows(step, B, hidden.device)
    backend = backend_arg(backend, "backend", BACKENDS[1:])
    if backend is Backend.FLASHINFER:
        raise ValueError("backend='flashinfer' samples from logits only: use sample(logits, ...), or backend=None")
    # a draw keeps no autograd graph, on any backend (the head's graph would outlive the step)
    hidden, weight, bias = hidden.detach(), weight.detach(), None if bias is None else bias.detach()
    if tp_group is not None:
        from ._vocab_parallel import sampling as vocab_parallel

        triton = resolve_backend(backend, on_cuda=hidden.is_cuda) is Backend.TRITON
        out = vocab_parallel.sample_from_hidden(hidden, weight, bias, temperature, filters, seeds, steps, triton,
                                                tp_group, MAX_VOCAB)
        return _result(out, _hidden_problem, True)
    if bias is not None and check:
        check_bias(bias, rows[:0], float(bias.amax()), 0.0)
    hidden, weight = contiguous_rows(hidden), contiguous_rows(weight)
    if resolve_backend(backend, on_cuda=hidden.is_cuda) is Backend.TRITON:
        from ._triton.sampling import hidden as _tri_hidden

        out = _tri_hidden.sample_hidden(hidden, weight, bias, temperature, filters, seeds, steps)
    else:
        out = _ref.sample_hidden_rows(hidden, weight, bias, temperature, filters, seeds, steps)
    return _result(out, _hidden_problem, check)


def group_seeds(seed: int, group_ids, step: int) -> Tensor:
    """One int64 seed per sample (CPU ``[B]``), distinct for every member of a group.

    ``group_ids``: the samples' group ids, all str or all int (verl's ``uid``; mixed types are refused:
    ``1`` and ``"1"`` would be two groups that print alike); members of a group are
    numbered in order of appearance. ``seed``: the run's seed; ``step``: the training step
    (any counter that changes between rollouts), so a prompt drawn again gets new streams.
    Each seed is a BLAKE2b hash of (seed, step, group id, member number): stable across
    processes, machines and Python versions."""
    seed = int_arg("seed", seed)
    step = int_arg("step", step, min=0)
    ids = group_id_list(group_ids)
    members: dict = {}
    out = []
    for g in ids:
        j = members.get(g, 0)
        members[g] = j + 1
        text = f"rlk_mm.group_seeds:{seed}:{step}:{type(g).__name__}:{g}:{j}".encode()
        out.append(int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True))
    return torch.tensor(out, dtype=torch.int64)


# ------------------------------------------------------------------ arguments
def _settings(temperature, top_k, top_p, min_p, V: int) -> tuple[float, _ref.Filters]:
    """(fp32 1 / temperature, the filters; None where one keeps every token), all checked."""
    if V < 1:
        raise ValueError("the vocabulary is empty: logits [B, V] (weight [V, H]) has V = 0 entries; sampling needs one")
    if V > MAX_VOCAB:
        raise ValueError(f"the vocabulary has {V} entries; sampling supports up to {MAX_VOCAB}")
    temperature = temperature_arg(temperature)
    inv_t = _ref.fp32(1.0 / temperature)
    if top_k is not None:
        top_k = int_arg("top_k", top_k)
        if top_k < 1:
            raise ValueError(f"top_k={top_k} is out of range: it must be >= 1 (the tokens kept); None turns top-k off "
                             "(where other libraries take 0 or -1)")
    if top_p is not None:
        top_p = float_arg("top_p", top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p} is out of range: it must be in (0, 1] (a share of the mass, not a "
                             "percentage); 1 or None turns top-p off")
    min_p_log = None
    if min_p is not None:
        min_p = float_arg("min_p", min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p={min_p} is out of range: it must be in [0, 1] (a share of the top token's "
                             "probability); 0 or None turns min-p off")
        min_p_log = _ref.fp32(math.log(min_p)) if min_p > 0 else None
    filters = _ref.Filters(
        top_k if top_k is not None and top_k < V else None,
        top_p if top_p is not None and top_p < 1.0 else None,
        min_p_log,
    )
    return inv_t, filters


def _seeds_and_steps(seeds, step, B: int, device: torch.device, check: bool) -> tuple[Tensor, int | Tensor]:
    """int64 ``[B]`` seeds on ``device``, and the step: an int, or an int64 tensor ``[]``/``[B]``
    on ``device``. A step tensor on the CPU is range-checked always (no device read), one on
    ``device`` only with ``check``."""
    if not isinstance(seeds, Tensor):
        raise TypeError(f"seeds must be an integer tensor [B] (one seed per row; group_seeds(...) derives them), "
                        f"got {type(seeds).__name__}")
    if seeds.dtype not in INTEGER_DTYPES or seeds.dim() != 1:
        raise TypeError(f"seeds must be a 1-D integer tensor [B]; got {seeds.dtype} of shape {tuple(seeds.shape)}")
    if seeds.numel() != B:
        raise ValueError(f"seeds has {seeds.numel()} entries but there are {B} rows: pass one seed per row "
                         "(group_seeds(seed, group_ids, step) gives one per sample)")
    seeds = seeds.to(device=device, dtype=torch.int64)
    if not isinstance(step, Tensor):
        return seeds, int_arg("step", step, min=0, max=2**32 - 1)
    if step.dtype not in INTEGER_DTYPES or step.dim() > 1:
        raise TypeError(f"step must be an int or an integer tensor [] or [B]; got {step.dtype} of shape "
                        f"{tuple(step.shape)}")
    if step.dim() == 1 and step.numel() != B:
        raise ValueError(f"step has {step.numel()} entries but there are {B} rows: pass one step per row, "
                         "or one for all")
    step_rows = step.to(dtype=torch.int64)  # int64 first: a narrower dtype would wrap 2^32 in the comparison
    if check or step.device.type == "cpu":
        bad = ((step_rows < 0) | (step_rows >= 2**32)).reshape(-1)
        if bool(bad.any()):
            i = first_true(bad)[0]
            at = f"step[{i}]" if step.dim() else "step"
            raise ValueError(f"{at} = {int(step_rows.reshape(-1)[i])} is out of range: steps must be in [0, 2^32)")
    return seeds, step_rows.to(device=device)


def _step_rows(step, B: int, device: torch.device) -> Tensor:
    """The step of every row, int64 ``[B]`` on ``device`` (for the backends that take one per row)."""
    if isinstance(step, Tensor):
        return step.expand(B).contiguous() if step.dim() == 0 else step
    return torch.full((B,), step, dtype=torch.int64, device=device)


def _score(logits, inv_t, filters, seeds, steps, tokens):
    """Log-probs of given ``tokens`` (the flashinfer backend's draws), with our filters."""
    if logits.is_cuda:
        from ._triton import sampling as _tri

        return _tri.sample_logits(logits, inv_t, filters, seeds, steps, given=tokens)
    return _ref.sample_rows(logits, inv_t, filters, seeds, steps, given=tokens)


# ------------------------------------------------------------------ results and errors
def _result(out, problem, check: bool) -> SampleResult:
    """The backend's output as a ``SampleResult``; with ``check``, the first row with a bad status
    raises ``problem(row, status)`` (a read of the status: a host sync)."""
    tokens, log_probs, sampled, status = out
    if check and status.numel() and bool((status != _ref.OK).any()):
        r = first_true(status != _ref.OK)[0]
        raise ValueError(problem(r, int(status[r])))
    return SampleResult(tokens, log_probs, sampled)


def _hidden_problem(r: int, status: int) -> str:
    if status == _ref.ALL_MASKED:
        return (f"hidden row {r} gives -inf logits at every entry (the bias masks every token, or the logits overflow "
                f"to -inf): nothing can be drawn; check hidden[{r}], weight and bias")
    return f"hidden row {r} gives NaN or +inf logits: check hidden[{r}], weight and bias"


def _logits_problem(logits: Tensor, r: int, inv_t: float, temperature: float) -> str:
    row = logits[r]
    if bool(torch.isnan(row).any()):
        return f"logits[{r}, {first_true(torch.isnan(row))[0]}] is NaN: sample only finite logits (-inf masks a token)"
    if bool((row == math.inf).any()):
        return f"logits[{r}, {first_true(row == math.inf)[0]}] is +inf: sample only finite logits (-inf masks a token)"
    if bool((row == -math.inf).all()):
        return f"logits row {r} is -inf at every entry: every token is masked, so nothing can be drawn"
    z = row.float() * inv_t
    return (f"logits[{r}, {first_true(torch.isinf(z))[0]}] / temperature={temperature} overflows float32: "
            "use a larger temperature")
