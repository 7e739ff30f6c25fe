"""``from_messages``' frame sampling with ``nframes``: the frames qwen-vl-utils' video readers keep,
an odd ``nframes`` included, checked against a re-statement of their rule (not their code), and the
counts they refuse refused by name."""

import math
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from rlk_mm import RLBatch
from rlk_mm.schema import key_settings
from support.context_cases import Case, Raises, Returns, assert_well, fail

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def qwen_vl_utils_frames(nframes: int, total: int):
    """The readers' rule, restated: ``nframes`` to the nearest multiple of 2 (a half to even, as Python's
    ``round``), which must lie in [2, total]; then that many indices spread evenly over
    [0, total - 1], each rounded to the nearest int (never a tie: the step's denominator is odd).
    None where qwen-vl-utils refuses the count."""
    count = 2 * round(Fraction(nframes, 2))
    if not 2 <= count <= total:
        return None
    return tuple(math.floor(Fraction(i * (total - 1), count - 1) + Fraction(1, 2)) for i in range(count))


def frames(total: int) -> list:
    """``total`` 56x56 frames, each one shade (so every frame is a different input)."""
    return [Image.new("RGB", (56, 56), (5 * f, 255 - 5 * f, 40)) for f in range(total)]


def sampled(processor, total: int, nframes):
    conv = [{"role": "user", "content": [{"type": "video", "video": frames(total), "nframes": nframes},
                                         {"type": "text", "text": "?"}]}]
    return RLBatch.from_messages([conv], processor=processor)


def kept(indices):
    return Returns(lambda b, c: key_settings(b.media_cache_keys[0]).frames == indices
                   and b.video_grid_thw[0, 0].item() == len(indices) // 2 or fail(key_settings(b.media_cache_keys[0])))


CASES = [
    Case("nframes.3_of_5", lambda c: sampled(c, 5, 3), kept((0, 1, 3, 4))),  # 3 rounds to 4, never [0, 2, 4] + [4]
    Case("nframes.5_of_5", lambda c: sampled(c, 5, 5), kept((0, 1, 3, 4))),  # 5 rounds to 4 (2.5 to even)
    Case("nframes.7_of_9", lambda c: sampled(c, 9, 7), kept((0, 1, 2, 3, 5, 6, 7, 8))),  # 7 rounds to 8
    Case("nframes.4_of_6", lambda c: sampled(c, 6, 4), kept((0, 2, 3, 5))),
    Case("nframes.2_of_2", lambda c: sampled(c, 2, 2), kept((0, 1))),
    Case("nframes.7_of_7", lambda c: sampled(c, 7, 7),
         Raises(ValueError, r"conversation 0, video #0: nframes 7 rounds to 8 frames \(qwen-vl-utils takes the nearest "
                            r"multiple of 2, a half rounding to even\), outside \[2, 7\] for the 7 frames given: give "
                            r"nframes between 2 and 6, or more frames")),
    Case("nframes.3_of_3", lambda c: sampled(c, 3, 3), Raises(ValueError, r"nframes 3 rounds to 4 frames.*outside \[2, 3\]")),
    Case("nframes.1", lambda c: sampled(c, 4, 1), Raises(ValueError, r"nframes 1 rounds to 0 frames.*outside \[2, 4\]")),
    Case("nframes.0", lambda c: sampled(c, 4, 0), Raises(ValueError, r"video #0: nframes must be an int >= 1, got 0")),
    Case("nframes.bool", lambda c: sampled(c, 4, True), Raises(ValueError, r"nframes must be an int >= 1, got True")),
    Case("nframes.float", lambda c: sampled(c, 4, 2.0), Raises(ValueError, r"nframes must be an int >= 1, got 2.0")),
    Case("nframes.str", lambda c: sampled(c, 4, "2"), Raises(ValueError, r"nframes must be an int >= 1, got '2'")),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_input(case, processor):
    assert_well(case, processor)


@settings(max_examples=12, **SETTINGS)
@given(st.integers(2, 9), st.integers(1, 11))
def test_nframes_keeps_the_frames_qwen_vl_utils_keeps(processor, total, nframes):
    """Any frame count and nframes: the frames kept (recorded in the item's key settings, and the
    video's temporal patches) are those of the restated rule, or the count is refused naming nframes."""
    want = qwen_vl_utils_frames(nframes, total)
    if want is None:
        with pytest.raises(ValueError, match=rf"video #0: nframes {nframes} rounds to \d+ frames .* outside \[2, {total}\]"):
            sampled(processor, total, nframes)
        return
    batch = sampled(processor, total, nframes)
    assert key_settings(batch.media_cache_keys[0]).frames == want
    assert batch.video_grid_thw[0].tolist()[0] == len(want) // 2


def test_the_restated_rule_is_qwen_vl_utils_own():
    """Where qwen-vl-utils' ``smart_nframes`` runs (its readers' count), it gives the restated count
    and refuses what the restatement refuses (importing it needs torchvision; the stand-in suffices)."""
    from rlk_mm.schema.messages import vision_process

    vp = vision_process()
    for total in range(1, 12):
        for nframes in range(1, 14):
            want = qwen_vl_utils_frames(nframes, total)
            try:
                count = vp.smart_nframes({"nframes": nframes}, total_frames=total, video_fps=2.0)
            except ValueError:
                count = None
            assert count == (None if want is None else len(want)), (total, nframes)
