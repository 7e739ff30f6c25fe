"""Argument checks the adapters share, under the argument names of the framework they
mirror (verl's, EasyR1's). Values are checked by the ops they call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import numpy as np
import torch

from ..schema.checks import FLOAT_DTYPES, tensor_arg

__all__ = ["actor_config", "clip_ratios", "outcome_inputs", "padded_inputs", "setting"]


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


def actor_config(config):
    """verl's actor ``config``: an ``ActorConfig`` (or an object with its fields) or a mapping of
    its fields (a dict, an OmegaConf ``DictConfig``); None and other values are refused."""
    if config is None:
        raise ValueError("config (verl's ActorConfig) is required: it holds the clip ratios")
    if not isinstance(config, Mapping) and not hasattr(config, "clip_ratio"):
        raise TypeError(f"config must be verl's ActorConfig (or a mapping of its fields), got {type(config).__name__} "
                        f"{config!r}"[:300])
    return config


def setting(config, name: str, default=None):
    """Field ``name`` of verl's actor ``config`` (``actor_config``), ``default`` where it has none."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def clip_ratios(config) -> tuple[float, float]:
    """The clip ratios (low, high) of verl's actor config: ``clip_ratio_low``/``_high``, else ``clip_ratio``."""
    config = actor_config(config)
    ratios = []
    for side in ("low", "high"):
        value = setting(config, f"clip_ratio_{side}")
        value = setting(config, "clip_ratio") if value is None else value
        if value is None:
            raise ValueError(f"config.clip_ratio_{side} and config.clip_ratio are both None: set one of them")
        ratios.append(value)
    return tuple(ratios)
