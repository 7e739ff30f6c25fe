"""Vocabulary-parallel selected log-prob, fused policy loss and sampling over ``torch.distributed``.

A private package, one module per concept: ``shard`` (this rank's place in the group and the
collectives), ``agree`` (the one all-gather that checks a call on every rank), ``logprob``
(``selected_logprob`` on a shard, its autograd, and the fused loss's ``loss_grads``), ``sampling``
(``sample_from_hidden`` on a shard) and ``comm`` (the bytes each rank sends, computed and
profiled). The public ops (``rlk_mm.ops.logprob``, ``rlk_mm.ops.sampling``,
``rlk_mm.ops.loss.fused``) resolve their arguments, then call in here when given ``tp_group``.

Layout (Megatron's ``VocabParallelEmbedding``, verl's tensor-parallel LM head, FSDP2's
``Shard(0)``): each rank holds a contiguous slice of the head's rows, ``weight[start_r :
start_r + V_r]`` (and of the bias), in rank order with no gap, and the *same* scored hidden
rows and targets (global token ids). Every non-empty shard starts on the ``VOCAB_ALIGN`` =
128-row segment grid: every shard but the last holds a multiple of 128 rows (the last may
end anywhere; shards may be uneven, and on the CPU backend empty). Megatron pads the
vocabulary to a multiple of 128 x the group size (Qwen2.5's 152,064 = 1,188 x 128 head rows),
so its shards qualify; a misaligned shard is refused on every rank, naming the alignment
and how to pad. Padding rows are scored like any row, as on one device: give them a bias
of -inf. ``vocab_start_index`` (Megatron's and verl's name), when given, must equal the sum
of the lower ranks' shard sizes.

The guarantee: forward results -- the log-probs, entropies and row log-sum-exps of
``selected_logprob`` and ``linear_policy_loss``, ``sample_from_hidden``'s tokens and
log-probs -- are bitwise the same for every group size and split (even or uneven), and
bitwise the single-device op's (same backend and dtype). The single-device op reduces each
128-column segment's logits to per-row partials and folds them in vocabulary order
(``_triton/lm_head/``, ``_torch/logprob.py``); here each rank computes its own segments'
partials (the same numbers: its shard starts on the grid), they are all-gathered, and every
rank folds them in that order. The loss, d hidden (summed over the group) and each rank's
d weight / d bias shard are within the numerical contract of the single-device op, bitwise
run to run for a group size, and per row independent of the other rows.

Collectives per call (group size P > 1, ``n`` rows, hidden size ``H``, largest shard ``L``,
``G`` columns per partial: 128 for bf16/fp16 on CUDA and the torch backend; fp32 on CUDA 64
and Triton's interpreter 32, tiles narrower than a segment):

1. ``agree``: one ``all_gather`` of a few int64 per rank (shard sizes, dtypes, ``n``, value
   checks, fingerprints of rows and targets, and with ``RLK_MM_TP_DEBUG=1`` of the hidden
   rows): a bad setup raises on *every* rank, naming the rank, instead of hanging;
2. forward, ``Exchange``: per chunk of rows one ``all_gather`` of each rank's partials, ``k``
   fp32 per row and partial (max, Σ exp, and with entropy the entropy sum: k = 3, else 2),
   ``⌈L/G⌉`` partials per rank (smaller shards pad), plus the row's target logit;
3. backward, ``sum_rows``: the shards' fp32 d hidden ``[n, H]`` summed in rank order (an
   ``all_to_all`` of column blocks, rank r adds block r in rank order, an ``all_gather``:
   a sum order of ours, not NCCL's all-reduce, whose ring or tree follows the message
   size). Weight and bias gradients stay local.

Bytes each rank sends per scored token (``comm_bytes_per_token``): forward
``(P-1)·4·(k·⌈L/G⌉ + 1)``, backward ``2·(P-1)·4·⌈H/P⌉``. The 7B head (H = 3584, V = 152,064,
bf16, even shards), with entropy: P = 2, 7,132 B forward and 14,336 B backward; P = 4, 10,704
B and 21,504 B: about 12·V/128 B per row over the group, never a vocabulary-sized row
(``bench/bench_tp.py`` and ``tests/ops/test_vocab_parallel.py`` check it against the profiler).
``sample_from_hidden``: plain temperature gathers each rank's best noise block per row (144 B)
and the partials; top-k, top-p and min-p gather the fp32 logits. DTensor heads: a ``Shard(0)``
weight on a 1-D mesh runs on its local shard over the mesh's group (its gradient lands as the
``Shard(0)`` gradient); ``gather_weight=True`` all-gathers the head instead, for data-parallel
ranks scoring *different* rows, and reduce-scatters its gradient, averaged over the mesh as FSDP2
averages. Under ``torch.compile`` the call is a graph break; the compiled graph sees a DTensor
head's ``to_local()`` or its redistribution.
"""

from __future__ import annotations

__all__: list[str] = []
