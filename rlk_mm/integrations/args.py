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
    ids = np.asarray(index).reshape(-1).tolist()
    if len(ids) != token_level_rewards.shape[0]:
        raise ValueError(
            f"index has {len(ids)} entries but token_level_rewards has {token_level_rewards.shape[0]} rows: "
            "give one group id per response"
        )
    return ids
