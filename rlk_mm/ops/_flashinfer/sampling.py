"""``sample(..., backend="flashinfer")``: the draw by ``flashinfer.sampling``.

FlashInfer draws with its own Philox stream from one ``torch.Generator`` per call; here it
is seeded from a hash of every row's seed and step, so the same batch gives the same tokens,
but a row's token depends on the rest of the batch (FlashInfer makes no batch-invariance
claim; ``bench/bench_sampling.py`` and ``tests/ops/test_sampling_gpu.py`` measure it). The
log-probs of its tokens are scored by rlk_mm's own kernel under rlk_mm's filter rules: where
FlashInfer's rules keep a token that ours drop, its ``sampled_log_probs`` is -inf.
"""

from __future__ import annotations

import importlib

import torch

from .._torch import sampling as _ref

__all__ = ["batch_generator", "draw", "flashinfer_sampling"]

Tensor = torch.Tensor


def flashinfer_sampling():
    """``flashinfer.sampling``, or an ImportError saying how to install it."""
    try:
        return importlib.import_module("flashinfer.sampling")
    except ImportError as error:
        raise ImportError(
            "backend='flashinfer' needs FlashInfer (flashinfer-python): pip install rlk-mm[gpu]; "
            f"importing flashinfer.sampling failed: {error}"
        ) from error


def batch_generator(seeds: Tensor, steps: Tensor) -> torch.Generator:
    """A generator on the seeds' device, seeded from every row's (seed, step)."""
    ka, kb = _ref.row_keys(seeds, steps, _ref.SALT_TOKEN)
    mixed = _ref.mix32((ka * 31 + kb + torch.arange(seeds.numel(), device=seeds.device)) & _ref.MASK32)
    seed = int(((mixed * 0x9E3779B1) & _ref.MASK32).sum()) & 0x7FFFFFFFFFFFFFFF
    return torch.Generator(device=seeds.device).manual_seed(seed)


def draw(logits: Tensor, inv_t: float, filters: _ref.Filters, seeds: Tensor, steps: Tensor) -> Tensor:
    """int64 tokens ``[B]`` from FlashInfer's sampler of CUDA ``logits [B, V]``."""
    if not logits.is_cuda:
        raise ValueError("backend='flashinfer' needs CUDA tensors; on the CPU use backend='torch'")
    if filters.min_p_log is not None and (filters.top_k is not None or filters.top_p is not None):
        raise ValueError("backend='flashinfer' takes min_p alone, not with top_k or top_p: use backend='triton'")
    fs = flashinfer_sampling()
    z = logits.float() * inv_t
    gen = batch_generator(seeds, steps)
    V = z.shape[1]
    if filters.min_p_log is not None:
        min_p = float(torch.tensor(filters.min_p_log).exp())
        tokens = fs.min_p_sampling_from_probs(torch.softmax(z, -1), min_p, generator=gen)
    elif filters.top_k is not None or filters.top_p is not None:
        tokens = fs.top_k_top_p_sampling_from_logits(
            z, filters.top_k or V, filters.top_p or 1.0, filter_apply_order="top_k_first", generator=gen,
        )
    else:
        tokens = fs.sampling_from_logits(z, generator=gen)
    return tokens.to(torch.int64)
