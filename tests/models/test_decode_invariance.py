"""decode_hidden, the KV-cache decode twin of forward_hidden: under batch_invariant() every
token's hidden state is bitwise the training forward's (packed, left, right), for prompts of
different lengths with several images, a video prompt, responses ending at different steps,
media from VisionCache, fp32 and bf16; the default kernels as the control; bad inputs."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlk_mm import fixtures
from rlk_mm.models import VisionCache, forward_hidden
from rlk_mm.models.decode import decode_hidden
from rlk_mm.ops import batch_invariant
from rlk_mm.schema import RLBatch

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 151645


def _batch(processor, samples, responses):
    out = fixtures.processor_inputs(processor, samples, padding_side="right")
    return RLBatch.from_qwen_vl(out, processor=processor, responses=responses)


def _assert_decode_is_the_forward(model, batch, media_embeds=None):
    with torch.no_grad(), batch_invariant(backend="torch"):
        decoded = decode_hidden(model, batch, media_embeds=media_embeds)
        for padding in (None, "left", "right"):
            one_pass = forward_hidden(model, batch, padding=padding, media_embeds=media_embeds)
            assert torch.equal(decoded, one_pass), padding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_the_forward_for_images_and_ragged_responses(processor, dtype):
    model = fixtures.tiny_qwen2_5_vl(seed=0).eval().to(dtype)
    samples = fixtures.synthetic_image_text(3, seed=1, max_images=3)
    responses = [[11, 12, 13, EOS], [14, EOS], [5, 6, 7, 8, 9, EOS]]
    _assert_decode_is_the_forward(model, _batch(processor, samples, responses))


def test_decode_equals_the_forward_for_video_and_vision_cache(tiny_model, processor):
    samples = fixtures.synthetic_video_text(2, seed=3, with_image=True)
    batch = _batch(processor, samples, [[21, 22, EOS], [23, EOS]])
    _assert_decode_is_the_forward(tiny_model, batch)
    with torch.no_grad(), batch_invariant(backend="torch"):
        media = VisionCache(tiny_model)(batch)
    _assert_decode_is_the_forward(tiny_model, batch, media)


def test_default_kernels_are_close_not_pinned(tiny_model, processor):
    batch = _batch(processor, fixtures.synthetic_image_text(2, seed=2, max_images=1), [[1, 2, EOS], [3, EOS]])
    with torch.no_grad():
        gap = (decode_hidden(tiny_model, batch) - forward_hidden(tiny_model, batch)).abs().max()
    assert gap < 1e-4


def test_bad_inputs(tiny_model, processor):
    batch = _batch(processor, fixtures.synthetic_image_text(2, seed=2, max_images=1), [[1, 2, EOS], [3, EOS]])
    with pytest.raises(TypeError):
        decode_hidden(tiny_model, "batch")
    with pytest.raises(ValueError, match="media_embeds"):
        decode_hidden(tiny_model, batch, media_embeds=torch.zeros(3, 7))
    with pytest.raises(ValueError, match="media_embeds has 3 rows"):
        decode_hidden(tiny_model, batch, media_embeds=torch.zeros(3, 64))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 5), min_size=2, max_size=3), seed=st.integers(0, 1000))
def test_property_any_response_lengths(tiny_model, processor, lengths, seed):
    samples = fixtures.synthetic_image_text(len(lengths), seed=seed, max_images=2)
    responses = [[(seed * 7 + 13 * i + j) % 150000 for j in range(n - 1)] + [EOS] for i, n in enumerate(lengths)]
    _assert_decode_is_the_forward(tiny_model, _batch(processor, samples, responses))
