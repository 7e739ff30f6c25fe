"""Adapters to RL frameworks, one package per framework: ``verl``, ``easyr1`` and ``trl``, each
split into modules by concept; ``args`` and ``micro_batch`` hold the checks they share."""

__all__: list[str] = []
