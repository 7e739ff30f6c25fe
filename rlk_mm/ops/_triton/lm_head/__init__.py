"""The LM-head code the Triton kernels share: logits tiles that never reach memory.

The selected log-prob (``logprob.py``), the fused policy loss (``linear_loss.py``) and
sampling from hidden states (``sampling/hidden.py``) all form logits the same way, so a
token's log-prob is bitwise the same in each:

* ``config``: ``LMHeadConfig`` / ``default_config``, every tile, launch setting and budget of
  the LM-head kernels, a function of dtype and device (and for a decode batch of the rows,
  with the same per-row arithmetic);
* ``tiles``: ``logits_tile``, one ``[BLOCK_M, BLOCK_N]`` tile of tempered logits,
  ``(h[rows] · Wᵀ + b) / T`` in an fp32 accumulator (``mma``: the dot product at the precision
  ``ieee`` picks), ``tile_logits`` (a launch's tile of them), and ``forward_tiles_kernel`` /
  ``store_partials``: each tile reduced at once to per-(row, segment) partials (max,
  Σ exp(z - max), Σ exp(z - max)·(z - max)) and the target logit (optionally also storing the
  tile, relative to its segments' maxima);
* ``combine``: ``combine_kernel``, each row's partials folded over the segments: lanes of
  interleaved partials in vocabulary order, then the lanes in a fixed tree (elementwise steps
  only, no cross-thread reduction whose tree would follow the launch);
  ``exchange_and_combine`` (a shard's partials gathered first) and ``forward_chunk`` (the
  forward of a chunk of scored rows);
* ``operands``: ``Operands``, how kernels read hidden rows and W (tensor descriptors where
  alignment allows, else pointers with the row gather in the kernel); ``bias_arg``,
  ``accumulate_mm``.

Reduction order: the vocabulary is cut on one global grid, segments of ``VOCAB_ALIGN`` = 128
columns from column 0 (``partial_columns``: a tile narrower than a segment, fp32's 64 and the
interpreter's 32, makes partials of its own width, which divide the segment). A partial is
reduced from its own columns only (a 256-column tile as two 128-column halves), so it does
not depend on where its segment sits in a tile; every logit is one dot product over H in
the same order; the combine folds a row's partials in an order fixed by their global index
(lane ``j % LANES`` in order, then the lanes' tree).
So a row's log-prob, entropy and log-sum-exp are the same whatever else is in the batch,
wherever the row stands, and whichever ranks hold the vocabulary: a vocabulary shard that
starts on the grid computes exactly its segments' partials, and the group folds the
gathered partials in the same order (``_vocab_parallel``), bitwise the single device's.
"""

from .combine import combine_kernel, exchange_and_combine, forward_chunk
from .config import VOCAB_ALIGN, Exchange, LMHeadConfig, default_config, partial_columns
from .operands import Operands, accumulate_mm, bias_arg, ieee, tma_ok
from .tiles import forward_tiles_kernel, logits_tile, mma, store_partials, tile_logits

__all__ = [
    "Exchange", "LMHeadConfig", "Operands", "accumulate_mm", "bias_arg", "combine_kernel", "default_config",
    "exchange_and_combine", "forward_chunk", "forward_tiles_kernel", "ieee", "logits_tile", "mma", "partial_columns",
    "store_partials", "tile_logits", "tma_ok", "VOCAB_ALIGN",
]
