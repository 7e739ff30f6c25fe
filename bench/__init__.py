"""GPU benchmarks, one module per op (``common``: timing, memory, results); run from the
repository root as ``python -m bench.<script> [--help]``. Results: ``bench/results/``."""
