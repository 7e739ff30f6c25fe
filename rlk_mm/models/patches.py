"""The batch-invariant module patches the Qwen-VL families share (``batch_invariant()`` applies
them while active; each family module registers its classes with ``family_patches``).

- RMSNorm (text layers and, in Qwen3-VL, the per-head q/k norms): one fixed reduction tree per row.
- Vision attention: one segment attention over every window / frame / image of the call.
- Projections that share an input (q/k/v, gate/up): one launch in no-grad calls.
- Mixture-of-experts blocks: each expert's rows through the mode's products, added to each
  token in ascending expert order (a token's sum never depends on which other tokens chose
  the same experts).
"""

from __future__ import annotations

import importlib
import sys

import torch

from ..ops.invariant.attention import varlen_attention
from ..ops.invariant.matmul import shared_input_patch
from ..ops.invariant.rmsnorm import rms_norm

__all__: list[str] = []


def _rms_norm_forward(self, hidden_states):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _vision_attention_forward(self, hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
    """Qwen-VL vision attention with one segment attention over all windows / frames / images."""
    seq = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(seq, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    if position_embeddings is None:
        raise ValueError(f"batch_invariant(): {type(self).__name__} needs position_embeddings (cos, sin)")
    rotate = sys.modules[type(self).__module__].apply_rotary_pos_emb_vision
    q, k = rotate(q, k, *position_embeddings)
    out = varlen_attention(q, k, v, cu_seqlens, causal=False, scale=self.scaling)
    return self.proj(out.reshape(seq, -1))


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Routed experts (weights ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``): each
    chosen expert's tokens in one product per projection, their outputs added in ascending
    expert order, one expert at a time (no two additions to a token in one call). The chosen
    experts are read once (one host read a layer, not one per expert)."""
    out = torch.zeros_like(hidden_states)
    for expert in torch.unique(top_k_index).tolist():  # ascending
        token, slot = torch.nonzero(top_k_index == expert, as_tuple=True)
        gate, up = torch.nn.functional.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
        rows = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert])
        out.index_add_(0, token, (rows * top_k_weights[token, slot, None]).to(out.dtype))
    return out


def family_patches(module: str, *, rms_norms=(), vision_attentions=(), shared_inputs=(), experts=()) -> list:
    """The (class, "forward", replacement) patches of one transformers modeling ``module``:
    ``rms_norms`` / ``vision_attentions`` / ``experts`` are class names, ``shared_inputs``
    ``(class, projection names, input argument)`` triples. Empty when the module is absent
    (an older transformers); a class the module lacks is skipped."""
    try:
        m = importlib.import_module(module)
    except ImportError:
        return []
    patches = [(getattr(m, cls), "forward", fn)
               for names, fn in ((rms_norms, _rms_norm_forward), (vision_attentions, _vision_attention_forward),
                                 (experts, _experts_forward))
               for cls in names if hasattr(m, cls)]
    patches += [(getattr(m, cls), "forward", shared_input_patch(getattr(m, cls).forward, names, arg))
                for cls, names, arg in shared_inputs if hasattr(m, cls)]
    return patches
