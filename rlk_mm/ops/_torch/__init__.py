"""The CPU backends of the ops: plain torch, the same semantics as the Triton kernels."""
