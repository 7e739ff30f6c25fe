"""The CPU backends of the ops: plain torch, the same semantics as the Triton kernels."""

__all__: list[str] = []
