"""Adapters to RL frameworks: ``verl`` (a package, one module a concept), ``easyr1`` and ``trl``;
``args`` and ``micro_batch`` hold the checks they share."""

__all__: list[str] = []
