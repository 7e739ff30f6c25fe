"""What the Triton kernels share: the SM count, the grouped tile schedule of persistent
launches, the dot-product precision (including the interpreter's), and ``TileConfig``, the
tile fields of every matmul-shaped family's config (the matmul's, the LM head's)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "dot_precision", "equal_chunks", "grouped_tile_ids", "interpreted", "INTERPRETER_PROGRAMS", "num_sms",
    "persistent_programs", "TileConfig",
]

#: programs of a persistent launch in Triton's interpreter: more than one, so that the
#: tests run every persistent loop over tiles too
INTERPRETER_PROGRAMS = 2


@dataclass(frozen=True)
class TileConfig:
    """A matmul-shaped kernel's tile: ``block_m x block_n`` outputs per program, ``block_k`` of
    the reduction per step, ``group_m`` row tiles per group of the schedule
    (``grouped_tile_ids``), and the launch's warps and pipeline stages. A family's frozen config
    extends it with its own settings."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(tiles: int, device: torch.device) -> int:
    """Programs of a persistent launch over ``tiles``: one per SM on CUDA."""
    return max(1, min(tiles, num_sms(device.index or 0) if device.type == "cuda" else INTERPRETER_PROGRAMS))


@triton.jit
def grouped_tile_ids(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of a persistent program's `tile`: runs of GROUP_M row tiles
    share column tiles (L2 reuse). Only the schedule, never a tile's arithmetic."""
    group = tile // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % (GROUP_M * num_n)) % group_rows
    pid_n = (tile % (GROUP_M * num_n)) // group_rows
    return pid_m, pid_n


def equal_chunks(n: int, most: int, tile: int) -> int:
    """Rows per chunk, whole tiles: the fewest chunks of at most ``most`` rows (at least one
    tile), all of one size but the last (shorter by less than a tile per chunk), so no chunk
    is a short remainder and buffers are no larger than the chunks need."""
    most = max(tile, most // tile * tile)
    chunks = max(1, triton.cdiv(n, most))
    return triton.cdiv(triton.cdiv(n, chunks), tile) * tile


def interpreted(t: torch.Tensor) -> bool:
    """The kernel runs on ``t`` in Triton's CPU interpreter (its 16-bit dot products are
    wrong, so kernels upcast their operands there: products of 16-bit values are exact in fp32)."""
    return not t.is_cuda


def dot_precision(dtype: torch.dtype, interpreting: bool) -> str | None:
    """fp32 operands: full fp32 ("ieee") unless torch allows TF32 matmuls; 16-bit: Triton's default."""
    if interpreting:
        return "ieee"
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return None
