"""The bundled codec fixture checks its inputs: errors name the argument and
what to change, before torch reshapes or multiplies anything."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_mm.fixtures.codec import tiny_codec


@pytest.fixture(scope="module")
def codec():
    return tiny_codec(frame=8, hidden=16, dim=4, stages=2, codebook_size=4, calibration_clips=2, calibration_samples=64)


@pytest.mark.parametrize("clips, error, match", [
    (torch.randn(1, 100), ValueError,
     r"clips has 100 samples per clip, not a multiple of the frame \(8\): trim or pad .* 96 or 104"),
    (torch.randn(128), ValueError, r"clips must be 2-D"),
    (torch.zeros(1, 16, dtype=torch.int64), TypeError, r"clips must be float64/float32/float16/bfloat16"),
    ([[0.0] * 16], TypeError, r"clips must be a torch.Tensor"),
])
def test_encoder_refuses_bad_clips(codec, clips, error, match):
    with pytest.raises(error, match=match):
        codec[0](clips)


@pytest.mark.parametrize("latents, error, match", [
    (torch.randn(1, 2, 3), ValueError,
     r"latents has shape \(1, 2, 3\); its last dimension must be the codebooks' width 4"),
    (torch.tensor(1.0), ValueError, r"last dimension must be"),
    (torch.zeros(1, 2, 4, dtype=torch.int64), TypeError, r"latents must be"),
])
def test_quantizer_refuses_bad_latents(codec, latents, error, match):
    with pytest.raises(error, match=match):
        codec[1](latents)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3), frames=st.integers(1, 6), extra=st.integers(0, 7))
def test_accepted_exactly_at_whole_frames(codec, n, frames, extra):
    """Property: a clip length is accepted exactly when it is a whole number of frames."""
    encoder, quantizer = codec
    clips = torch.randn(n, frames * 8 + extra)
    if extra:
        with pytest.raises(ValueError, match="not a multiple of the frame"):
            encoder(clips)
    else:
        codes = quantizer(encoder(clips))
        assert codes.shape == (n, frames, 2) and codes.dtype == torch.int64
