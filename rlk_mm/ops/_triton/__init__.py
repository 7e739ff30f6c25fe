"""The Triton kernels, one module per family (each with its frozen config dataclass), and
``lm_head``: the LM-head tile code the log-prob, fused-loss and sampling kernels share."""

__all__: list[str] = []
