"""``codec_invariance``: the code-flip rate between batch = 1 and batch = N of a bf16 encoder
followed by a residual quantizer, under the default kernels and under ``batch_invariant()``.

On the CPU the default bf16 GEMM happens to be batch-invariant at these shapes, so both
modes give zero flips here (bench/bench_codec.py measures the GPU, where the default
flips). That the harness does see batch dependence is checked with ``SplitKEncoder``, a
test oracle that sums the first layer's K in two halves when the batch has more than one
clip, as a split-K GEMM does.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm.fixtures.codec import FrameEncoder, ResidualQuantizer, synthetic_clips, tiny_codec
from rlk_mm.parity import codec_invariance
from rlk_mm.parity.codec import MODES

FRAME = 32


@functools.lru_cache(maxsize=1)
def codec():
    return tiny_codec(frame=FRAME, hidden=64, dim=8, stages=3, codebook_size=32, calibration_clips=8,
                      calibration_samples=2048)


class SplitKEncoder(torch.nn.Module):
    """The tiny encoder, but with more than one clip its first layer sums K in two bf16 halves."""

    def __init__(self, encoder: FrameEncoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, clips):
        e = self.encoder
        n, s = clips.shape
        frames = clips.reshape(n, s // e.frame, e.frame).to(torch.bfloat16)
        if n == 1:
            inner = e.inner(frames)
        else:
            half = e.frame // 2
            w = e.inner.weight
            inner = (frames[..., :half] @ w[:, :half].T + frames[..., half:] @ w[:, half:].T) + e.inner.bias
        return e.outer(torch.nn.functional.gelu(inner)).float()


def check_consistent(report, n: int, frames: int, stages: int) -> None:
    assert (report.clips, report.frames, report.stages) == (n, frames, stages)
    assert list(report.runs) == list(MODES)
    for run in report.runs.values():
        assert run.codes == n * frames * stages
        assert run.flip_rate == pytest.approx(run.flipped / run.codes)
        assert sum(run.stage_flip_rates) / stages == pytest.approx(run.flip_rate)
        assert (run.flipped == 0) == (run.clips_with_flips == 0)


def test_zero_flips_under_batch_invariant_and_the_cpu_default():
    encoder, quantizer = codec()
    clips = synthetic_clips(6, FRAME * 40, seed=3)
    report = codec_invariance(encoder, quantizer, clips)
    check_consistent(report, 6, 40, 3)
    assert report.runs["batch_invariant"].flipped == 0 and report.runs["batch_invariant"].latent_max_abs_diff == 0.0
    # the CPU default (oneDNN/OpenBLAS bf16 GEMM at these shapes) is row-invariant too: measured, not assumed
    assert report.runs["default"].flipped == 0


def test_the_harness_counts_the_flips_of_a_batch_dependent_encoder():
    encoder, quantizer = codec()
    oracle = SplitKEncoder(encoder)
    clips = synthetic_clips(8, FRAME * 64, seed=4)
    report = codec_invariance(oracle, quantizer, clips)
    check_consistent(report, 8, 64, 3)
    with torch.no_grad():
        alone = torch.cat([quantizer(oracle(c[None])) for c in clips])
        together = quantizer(oracle(clips))
    expected = int((alone != together).sum())
    assert expected > 0, "the split-K oracle should move some latents across a codeword boundary"
    for run in report.runs.values():  # the split is in Python, so batch_invariant() cannot remove it
        assert run.flipped == expected and run.latent_max_abs_diff > 0


def test_each_mode_encodes_every_clip_alone_and_all_together_under_its_kernels():
    """The calls the harness makes: per mode, N single clips then the batch, with batch_invariant()
    active only in its mode."""
    from rlk_mm.ops.invariant._dispatch import STATE

    encoder, quantizer = codec()
    calls = []

    def recording(clips):
        calls.append((clips.shape[0], STATE.active, torch.is_grad_enabled()))
        return encoder(clips)

    codec_invariance(recording, quantizer, synthetic_clips(3, FRAME * 4, seed=6))
    assert calls == [(1, False, False)] * 3 + [(3, False, False)] + [(1, True, False)] * 3 + [(3, True, False)]


def test_quantizer_picks_the_nearest_codeword_at_every_stage():
    encoder, quantizer = codec()
    with torch.no_grad():
        latents = encoder(synthetic_clips(2, FRAME * 16, seed=5))
        codes = quantizer(latents)
    residual = latents.double().reshape(-1, latents.shape[-1])
    for k, book in enumerate(quantizer.codebooks.double()):
        distance = torch.cdist(residual, book)
        chosen = codes.reshape(-1, codes.shape[-1])[:, k]
        assert torch.allclose(distance.gather(1, chosen[:, None])[:, 0], distance.min(1).values, rtol=0, atol=1e-5)
        residual = residual - book[chosen]


@settings(max_examples=4, deadline=None)
@given(n=st.integers(2, 5), frames=st.integers(1, 24), seed=st.integers(0, 1000))
def test_batch_invariant_gives_zero_flips_for_any_clips(n, frames, seed):
    encoder, quantizer = codec()
    report = codec_invariance(encoder, quantizer, synthetic_clips(n, FRAME * frames, seed=seed))
    check_consistent(report, n, frames, 3)
    assert report.runs["batch_invariant"].flipped == 0


def _bad_encoder_shape(clips):
    return torch.zeros(clips.shape[0] + 1, 2, 8)


def _nan_encoder(clips):
    return torch.full((clips.shape[0], 2, 8), float("nan"))


def _frames_by_batch(clips):  # one frame alone, two in a batch
    return torch.zeros(clips.shape[0], 1 if clips.shape[0] == 1 else 2, 8)


def _float_codes(latents):
    return latents[..., :2]


def _wrong_code_shape(latents):
    return torch.zeros(latents.shape[0], latents.shape[1] + 1, 2, dtype=torch.int64)


def _zero_codes(latents):
    return torch.zeros(*latents.shape[:2], 2, dtype=torch.int64)


GOOD = torch.zeros(2, FRAME * 2)
NAN_CLIPS = GOOD.clone()
NAN_CLIPS[1, 5] = float("inf")
BAD = [
    ("encoder not callable", lambda e, q: ("encoder", q, GOOD), TypeError, "encoder must be callable"),
    ("quantizer not callable", lambda e, q: (e, 3, GOOD), TypeError, "quantizer must be callable .* got int"),
    ("clips not a tensor", lambda e, q: (e, q, [[0.0] * 64] * 2), TypeError, "clips must be a torch.Tensor"),
    ("clips int", lambda e, q: (e, q, GOOD.long()), TypeError, "clips must be float64/float32/float16/bfloat16"),
    ("clips 1-D", lambda e, q: (e, q, GOOD[0]), ValueError, "clips must be 2-D"),
    ("one clip", lambda e, q: (e, q, GOOD[:1]), ValueError, r"N >= 2 clips .* got \(1, 64\)"),
    ("inf sample", lambda e, q: (e, q, NAN_CLIPS), ValueError, "clips: clip 1, sample 5 is inf"),
    ("encoder rows", lambda e, q: (_bad_encoder_shape, q, GOOD), ValueError,
     r"encoder output \(clip 0 alone\) has 2 rows for 1 clips"),
    ("encoder nan", lambda e, q: (_nan_encoder, q, GOOD), ValueError, r"encoder output \(clip 0 alone\) is not finite"),
    ("frames differ", lambda e, q: (_frames_by_batch, _zero_codes, GOOD), ValueError,
     "same number of frames alone and in a batch"),
    ("float codes", lambda e, q: (e, _float_codes, GOOD), TypeError,
     r"quantizer output \(clip 0 alone\) must be int64"),
    ("code shape", lambda e, q: (e, _wrong_code_shape, GOOD), ValueError,
     r"quantizer output \(clip 0 alone\) has shape"),
]


@pytest.mark.parametrize("label, args, error, match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused(label, args, error, match):
    encoder, quantizer = codec()
    with pytest.raises(error, match=match):
        codec_invariance(*args(encoder, quantizer))


def test_fixture_arguments_are_checked():
    with pytest.raises(ValueError, match="codebooks must be 3-D"):
        ResidualQuantizer(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="codebook_size=10000 needs at least as many calibration frames"):
        tiny_codec(frame=32, codebook_size=10_000, calibration_clips=2, calibration_samples=1024)
    with pytest.raises(ValueError, match=r"n=0 is out of range"):
        synthetic_clips(0, 100)
