"""The sampling kernels: one token per row, the torch backend's draw bit for bit.

One package for the family, a module per concept: ``config`` (``SamplingConfig``, the
family's one frozen config), ``noise`` (the counter-based RNG, the integer masses and the
order-preserving keys the torch backend computes alike), ``rows`` (per-row pieces: loads,
arrival counts, candidate lists, the bisection), ``top_p`` (top-p and min-p without top-k,
from a histogram of masses), ``logits`` (``sample_logits``: the launches over a ``[B, V]``
logits tensor) and ``hidden`` (``sample_hidden``: the LM head's tiles fused with the draw).
The entry points are re-exported here.
"""

from .config import SamplingConfig, default_config
from .hidden import sample_hidden
from .logits import sample_logits

__all__ = ["default_config", "sample_hidden", "sample_logits", "SamplingConfig"]
