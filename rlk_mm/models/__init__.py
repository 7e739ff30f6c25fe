"""Model-specific runners and patches; ops never import a model.

``qwen2_5_vl``: Qwen2.5-VL on an RLBatch (layouts, forward, ``VisionCache``, group scoring)
and the module patches ``batch_invariant()`` applies to its classes.
"""

from . import qwen2_5_vl
from .qwen2_5_vl import Layout, VisionCache, batch_logprobs, forward_hidden, group_logprobs, layout_inputs

__all__ = ["Layout", "VisionCache", "batch_logprobs", "forward_hidden", "group_logprobs", "layout_inputs", "qwen2_5_vl"]
