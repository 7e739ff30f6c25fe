"""Adapters to RL frameworks: ``verl`` (with ``verl_fused``), ``easyr1`` and ``trl``."""

__all__: list[str] = []
