"""rlk_mm's drop-in for verl's ``FusedLinearForPPO``: the LM head's log-probs and entropies.

verl 0.9.1 (``actor_rollout_ref.model.use_fused_kernels=True``, backend ``torch``) computes
log-probs and entropies with ``verl.utils.experimental.torch_functional.FusedLinearForPPO``,
a 512-row chunked torch loop. This class has its constructor and call and computes them with
``rlk_mm.ops.selected_logprob(..., return_entropy=True)``: inside ``scoring`` (``verl.rows``)
only the rows verl's losses read, zeros elsewhere; under a fused-loss plan (``verl.fused_loss``)
the whole actor loss, with ``linear_policy_loss``. ``verl.fused`` puts it where verl looks it up.
"""

from __future__ import annotations

import torch

from ...ops.logprob import TargetError, selected_logprob
from ...schema.checks import INTEGER_DTYPES, int_arg, tensor_arg
from .fused_loss import active_plan
from .rows import scored_rows

__all__ = ["FusedLinearForPPO"]

Tensor = torch.Tensor


class FusedLinearForPPO(torch.nn.Module):
    """verl's ``FusedLinearForPPO`` (same constructor and call), computed by rlk_mm.

    Under a fused-loss plan (``update_actor`` with ``loss_mode=rlk_mm``) it computes the actor loss
    with ``linear_policy_loss`` and returns the log-probs and entropies detached.

    Parameters
    ----------
    chunk_size, impl_backend : int, str
        Accepted for compatibility (rlk_mm tiles the vocabulary itself).

    Raises
    ------
    ValueError
        For a backend verl does not know.
    """

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"Unsupported FusedLinearForPPO backend: {impl_backend}. Choose 'torch' or 'liger'.")
        self.chunk_size = int_arg("chunk_size", chunk_size, min=1)
        self.impl_backend = impl_backend

    def forward(self, hidden_states: Tensor, vocab_weights: Tensor, input_ids: Tensor, temperature: float = 1.0):
        """Log-probs and entropies of ``input_ids``, with gradients through both.

        Parameters
        ----------
        hidden_states, vocab_weights, input_ids : Tensor
            ``[B, L, H]`` or ``[T, H]``; ``[V, H]``; ``[B, L]`` or ``[T]``.
        temperature : float

        Returns
        -------
        tuple of Tensor
            ``(log_probs fp32, entropy in hidden_states' dtype)`` shaped like ``input_ids``. Logits are
            formed in autocast's dtype when autocast is on.

        Raises
        ------
        ValueError, TypeError
            For other shapes or dtypes, or a token id outside the vocabulary (naming its place).
        """
        tensor_arg("hidden_states", hidden_states)
        tensor_arg("vocab_weights", vocab_weights)
        tensor_arg("input_ids", input_ids)
        if hidden_states.dim() not in (2, 3):
            raise ValueError(f"hidden_states must be 2D or 3D, got shape {tuple(hidden_states.shape)}")
        if input_ids.dtype not in INTEGER_DTYPES:
            raise TypeError(f"input_ids must be an integer tensor of token ids, got {input_ids.dtype}")
        if tuple(input_ids.shape) != tuple(hidden_states.shape[:-1]):
            raise ValueError(
                f"input_ids shape {tuple(input_ids.shape)} must match hidden_states shape {tuple(hidden_states.shape[:-1])}"
            )
        dtype = _logits_dtype(hidden_states, vocab_weights)
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1]).to(dtype)
        weight = vocab_weights.to(dtype)
        ids = input_ids.reshape(-1).to(torch.int64)
        rows = scored_rows(input_ids.shape, ids.device)
        scored, targets = (torch.arange(ids.numel(), device=ids.device), ids) if rows is None else (rows, ids[rows])
        loss_plan = active_plan()
        try:
            if loss_plan is not None and rows is not None and torch.is_grad_enabled():
                logp, ent = loss_plan.compute(hidden, weight, rows, targets, temperature)
            else:
                logp, ent = selected_logprob(hidden, weight, index=scored, targets=targets, temperature=temperature,
                                             return_entropy=True)
        except TargetError as e:
            place = ", ".join(str(int(i)) for i in torch.unravel_index(scored[e.at].cpu(), tuple(input_ids.shape)))
            raise ValueError(f"input_ids[{place}] = {e.token} {e.problem}") from None
        if rows is not None:  # zeros where nothing is read
            logp = logp.new_zeros(ids.numel()).index_copy(0, rows, logp)
            ent = ent.new_zeros(ids.numel()).index_copy(0, rows, ent)
        return logp.view(input_ids.shape), ent.to(hidden_states.dtype).view(input_ids.shape)


def _logits_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype verl's ``hidden_states @ vocab_weights.t()`` would produce: autocast's
    when it is on, else the (common) input dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden_states is {hidden.dtype} but vocab_weights is {weight.dtype} (and autocast is off)")
    return hidden.dtype
