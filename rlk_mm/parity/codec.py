"""``codec_invariance``: do an audio codec's discrete codes depend on the batch they were encoded in?

A speech codec's reference encoder was reported to give different codes for the same
audio alone and in a batch (a 4-9 % mismatch): bf16 GEMMs of another shape sum in another
order, and the drift crosses the residual quantizer's boundaries before the tokens reach
the LM. The harness encodes every clip alone (batch = 1) and all clips together
(batch = N), under the default kernels and under ``rlk_mm.ops.batch_invariant()``, and
counts codes that differ (bitwise comparison, as the numerical contract asks). See
docs/rfc/continuous_latent_rl.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from ..ops import batch_invariant
from ..schema.checks import FLOAT_DTYPES, INTEGER_DTYPES, first_true, tensor_arg

__all__ = ["codec_invariance"]

#: the kernel modes the harness runs, in order
MODES = ("default", "batch_invariant")


@dataclass(frozen=True)
class CodecRun:
    """Codes of batch = 1 against batch = N under one kernel mode."""

    mode: str
    flip_rate: float  # flipped / codes
    flipped: int
    codes: int  # N * T * K
    stage_flip_rates: list[float]  # per quantizer stage
    clips_with_flips: int
    latent_max_abs_diff: float  # the encoder's drift that caused them


@dataclass(frozen=True)
class CodecInvariance:
    clips: int
    frames: int  # T per clip
    stages: int  # K
    runs: dict[str, CodecRun]

    def to_dict(self) -> dict:
        return asdict(self)


def codec_invariance(encoder, quantizer, clips: Tensor) -> CodecInvariance:
    """Code-flip rate between encoding each clip alone and all ``clips`` at once.

    ``encoder``: waveforms ``[n, S]`` -> latents float ``[n, T, D]``; ``quantizer``: latents
    -> codes integer ``[n, T, K]`` (callables, e.g. ``torch.nn.Module``; run under
    ``torch.no_grad()``). ``clips``: float ``[N, S]``, N >= 2, finite, on the encoder's
    device. Runs under the default kernels, then under ``batch_invariant()``."""
    if not callable(encoder) or not callable(quantizer):
        bad = "encoder" if not callable(encoder) else "quantizer"
        raise TypeError(f"{bad} must be callable (e.g. a torch.nn.Module), got {type(encoder if bad == 'encoder' else quantizer).__name__}")
    tensor_arg("clips", clips, ndim=2, dtypes=FLOAT_DTYPES)
    if clips.shape[0] < 2 or clips.shape[1] < 1:
        raise ValueError(f"clips must be [N, S] with N >= 2 clips (batch = N against batch = 1) and S >= 1 samples, got {tuple(clips.shape)}")
    finite = torch.isfinite(clips)
    if not bool(finite.all()):
        n, s = first_true(~finite)
        raise ValueError(f"clips: clip {n}, sample {s} is {float(clips[n, s])}; waveforms must be finite")
    runs = {}
    for mode in MODES:
        with torch.no_grad(), (batch_invariant() if mode == "batch_invariant" else contextlib.nullcontext()):
            alone = [_encode(encoder, quantizer, clips[i : i + 1], f"clip {i} alone") for i in range(clips.shape[0])]
            batched = _encode(encoder, quantizer, clips, f"all {clips.shape[0]} clips")
        runs[mode] = _compare(mode, alone, batched)
    _, T, K = batched[1].shape
    return CodecInvariance(clips=clips.shape[0], frames=T, stages=K, runs=runs)


def _encode(encoder, quantizer, clips: Tensor, what: str) -> tuple[Tensor, Tensor]:
    """(latents, codes) of ``clips``, checked: latents finite float ``[n, T, D]``, codes integer ``[n, T, K]``."""
    n = clips.shape[0]
    latents = encoder(clips)
    tensor_arg(f"encoder output ({what})", latents, ndim=3, dtypes=FLOAT_DTYPES)
    if latents.shape[0] != n:
        raise ValueError(f"encoder output ({what}) has {latents.shape[0]} rows for {n} clips: it must be [n, T, D]")
    if not bool(torch.isfinite(latents).all()):
        raise ValueError(f"encoder output ({what}) is not finite: the harness compares codes of finite latents")
    codes = quantizer(latents)
    tensor_arg(f"quantizer output ({what})", codes, ndim=3, dtypes=INTEGER_DTYPES)
    if codes.shape[:2] != latents.shape[:2]:
        raise ValueError(f"quantizer output ({what}) has shape {tuple(codes.shape)}; latents {tuple(latents.shape)} need [n, T, K] codes")
    return latents, codes


def _compare(mode: str, alone: list[tuple[Tensor, Tensor]], batched: tuple[Tensor, Tensor]) -> CodecRun:
    latents = torch.cat([lat for lat, _ in alone])
    codes = torch.cat([c for _, c in alone])
    if codes.shape != batched[1].shape:
        raise ValueError(f"codes of the clips alone have shape {tuple(codes.shape)}, of the batch {tuple(batched[1].shape)}: "
                         "the encoder must give each clip the same number of frames alone and in a batch")
    flips = codes != batched[1]
    return CodecRun(
        mode=mode,
        flip_rate=float(flips.float().mean()) if flips.numel() else 0.0,
        flipped=int(flips.sum()),
        codes=flips.numel(),
        stage_flip_rates=flips.float().mean((0, 1)).tolist() if flips.numel() else [],
        clips_with_flips=int(flips.flatten(1).any(1).sum()),
        latent_max_abs_diff=float((latents.float() - batched[0].float()).abs().max()) if latents.numel() else 0.0,
    )
