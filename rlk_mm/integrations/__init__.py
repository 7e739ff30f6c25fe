"""Adapters to RL frameworks: ``verl`` and ``easyr1`` (packages, one module a concept) and ``trl``;
``args`` and ``micro_batch`` hold the checks they share."""

__all__: list[str] = []
