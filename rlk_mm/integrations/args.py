"""Argument checks the adapters share (verl's and EasyR1's), under the argument names of the
framework they mirror: padded ``[B, R]`` tensors, and the inputs of an outcome-advantage
estimator. Values are checked by the ops they call; verl's actor config is read by
``verl.config``, the one reader of its keys.

Helpers, not API: ``__all__`` is empty.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..schema.checks import FLOAT_DTYPES, tensor_arg

__all__: list[str] = []


def padded_inputs(tensors: dict[str, Optional[torch.Tensor]], mask: str) -> None:
    """Float ``[B, R]`` tensors (the first sets the shape; None: not given), and the one named ``mask`` of any dtype."""
    (first, ref), *rest = tensors.items()
    shape = tuple(tensor_arg(first, ref, ndim=2, dtypes=FLOAT_DTYPES).shape)
    for name, t in rest:
        if t is not None:
            tensor_arg(name, t, shape=shape, dtypes=None if name == mask else FLOAT_DTYPES)


def outcome_inputs(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index) -> list:
    """Checks an outcome-advantage call; returns its group ids (``index``) as a list, one per row."""
    tensor_arg("token_level_rewards", token_level_rewards, ndim=2, dtypes=FLOAT_DTYPES)
    tensor_arg("response_mask", response_mask, shape=tuple(token_level_rewards.shape))
    for name, t in (("token_level_rewards", token_level_rewards), ("response_mask", response_mask)):
        if t.is_meta:
            raise ValueError(f"{name} is on the meta device (no values); pass it on the CPU or a GPU")
    if isinstance(index, (set, frozenset, dict)):
        raise TypeError(f"index must be in row order (a list, tuple or array, one group id per response), "
                        f"got a {type(index).__name__}")
    bad = ~torch.isfinite(token_level_rewards)
    if bool(bad.any()):
        row, col = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"token_level_rewards: row {row}, column {col} is {float(token_level_rewards[row, col])}: "
                         "rewards must be finite (fix the reward function, or score a failed response with a number)")
    ids = np.asarray(index).reshape(-1).tolist()
    if len(ids) != token_level_rewards.shape[0]:
        raise ValueError(
            f"index has {len(ids)} entries but token_level_rewards has {token_level_rewards.shape[0]} rows: "
            "give one group id per response"
        )
    return ids
