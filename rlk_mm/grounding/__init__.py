"""Grounding: a model's boxes and points read from its own tokens, in its own convention
(``parse``), and the rewards that score them (``rewards``). Sits above ``ops`` (region
rewards are ``SpanReward``s for ``scatter_rewards``)."""

from .parse import (
    CONVENTION_SYSTEM,
    Convention,
    Found,
    Grounding,
    ImageSize,
    ParseFailure,
    Region,
    check_values,
    find_regions,
    parse_grounding,
    token_bytes,
)
from .rewards import (
    ACTIONS,
    GroundingMetric,
    GroundingRewards,
    action_match,
    box_giou,
    box_iou,
    grounding_rewards,
    parse_action,
    point_in_box,
)

__all__ = [
    "ACTIONS", "CONVENTION_SYSTEM", "Convention", "Found", "Grounding", "GroundingMetric", "GroundingRewards", "ImageSize",
    "ParseFailure",
    "Region", "action_match", "box_giou", "box_iou", "check_values", "find_regions", "grounding_rewards", "parse_action",
    "parse_grounding", "point_in_box", "token_bytes",
]
