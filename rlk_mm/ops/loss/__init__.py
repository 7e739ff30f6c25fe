"""The policy loss, in one package: ``op`` (``policy_loss``, ``kl_penalty``, ``agg_loss``),
``config`` (``PolicyLossConfig`` and the result type ``PolicyLoss``), ``checks`` (its tensor
arguments), ``terms`` (named constants the op, the kernels and the CPU backend share),
``custom_op`` (the fused loss's ``torch.library`` ops) and ``fused`` (``linear_policy_loss``:
the LM head fused with the loss, and its result ``PolicyLossOutput``).

Names are imported on first use, as ``rlk_mm.ops``' are: the kernels' modules import
``terms`` alone, without loading the op."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy_exports

if TYPE_CHECKING:  # what the lazy names below are, for IDEs and type checkers
    from .config import PolicyLoss, PolicyLossConfig  # noqa: F401
    from .fused import PolicyLossOutput, linear_policy_loss  # noqa: F401
    from .op import agg_loss, kl_penalty, policy_loss  # noqa: F401

_EXPORTS = {
    "policy_loss": "op", "kl_penalty": "op", "agg_loss": "op", "PolicyLoss": "config", "PolicyLossConfig": "config",
    "linear_policy_loss": "fused", "PolicyLossOutput": "fused",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, listed=__all__)
