"""Batch-invariant kernels and the mode that routes a transformers forward through them.

``mode.batch_invariant`` (also ``rlk_mm.ops.batch_invariant``) is the context manager;
``matmul``, ``rmsnorm`` and ``attention`` hold the kernels' checked entry points.
The package is not named ``batch_invariant``: ``rlk_mm.ops.batch_invariant`` is the
context manager, and a subpackage of that name would replace it on ``rlk_mm.ops``.
"""

__all__: list[str] = []
