"""Adversarial inputs to packing, the model runners, the batch-invariant kernels, parity,
the layout picture and the CLI (issue 17), tried as a new user would.

Each public function and argument gets wrong types and shapes, wrong dtypes, empty and
non-finite values, out-of-range values, fields that disagree with each other and ambiguous
layouts (``BAD``: each must raise the named error, whose message names the argument and,
where it has them, the sample and the position), and unusual but valid inputs (``GOOD``:
each must give the right result). Every case is classified:

- ``well``: the expected error, or the right result;
- ``silent``: a result, but a wrong one (or one where an error was due); for the CLI, an
  exit code that says "mismatch" / "ok" for bad input;
- ``crash``: an error that no check of rlk_mm raised (a raw torch or Python error);
- ``unclear``: an error rlk_mm raised, but of another type or not naming the cause.

A case that does not behave well fails with its class first (``silent: ...``), so a run's
failures count the defects by class. Hypothesis properties at the end draw masks,
``cu_seqlens``, pack selections, attention segments and padded log-prob layouts, valid or
broken, and check the result against a reference or the error against the first broken rule.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import math
import os
import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oracles import pack as oracle
from rlk_mm import RLBatch, fixtures
from rlk_mm.cli import main as cli_main
from rlk_mm.models.qwen2_5_vl import VisionCache, batch_logprobs, forward_hidden, group_logprobs, layout_inputs
from rlk_mm.ops import batch_invariant
from rlk_mm.ops.invariant import attention as A
from rlk_mm.ops.invariant import matmul as M
from rlk_mm.ops.invariant import rmsnorm as N
from rlk_mm.ops.packed_batch import pack, unpack
from rlk_mm.ops.padded import pack_padded, unpack_to_padded
from rlk_mm.parity import check_layout_parity, compare_logprobs
from rlk_mm.parity.invariance import invariance_sweep
from rlk_mm.parity.invariance_report import InvarianceReport
from rlk_mm.viz import draw_layout

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "parity"
TRAINING = str(FIXTURES / "training.safetensors")
DRIFT = str(FIXTURES / "missing_mm_token_type_ids.rollout.safetensors")
PIXEL_DIM = 3 * 2 * 14 * 14  # channels x temporal patch x patch²: one vision-tower input row

pytestmark = pytest.mark.usefixtures("one_thread")


# ============================================================ the classifier
@dataclass(frozen=True)
class Raises:
    error: type | tuple
    words: str  # a regex the message must match


@dataclass(frozen=True)
class Returns:
    check: Callable  # check(result, ctx) asserts the result is right


@dataclass(frozen=True)
class Exits:
    code: int
    words: str = ""  # a regex stdout + stderr must match
    traceback: bool = False  # whether a traceback is expected (--debug)


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable  # call(ctx)
    expect: object


def _raised_by_rlk_mm(e: BaseException) -> bool:
    """Whether a ``raise`` statement of rlk_mm raised ``e`` (not torch, not Python itself)."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    return "/rlk_mm/" in last.filename and linecache.getline(last.filename, last.lineno).strip().startswith("raise")


def classify(case: Case, ctx) -> tuple[str, str]:
    """(class, detail) of one case; see the module docstring."""
    if isinstance(case.expect, Exits):
        return _classify_cli(case, ctx)
    try:
        result = case.call(ctx)
    except Exception as e:  # noqa: BLE001 (the point is to see every kind)
        expect = case.expect
        if isinstance(expect, Raises) and isinstance(e, expect.error) and re.search(expect.words, str(e)):
            return "well", ""
        return ("unclear" if _raised_by_rlk_mm(e) else "crash"), f"{type(e).__name__}: {str(e)[:300]}"
    if isinstance(case.expect, Raises):
        return "silent", f"returned {type(result).__name__} instead of raising {case.expect.error}"
    try:
        case.expect.check(result, ctx)
    except AssertionError as e:
        return "silent", f"wrong result: {e}"
    return "well", ""


def _classify_cli(case: Case, ctx) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = case.call(ctx)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    except Exception as e:  # noqa: BLE001
        return "crash", f"{type(e).__name__} escaped the command: {str(e)[:200]}"
    text = out.getvalue() + err.getvalue()
    want = case.expect
    if code != want.code:
        kind = "silent" if code in (0, 1) and want.code not in (0, 1) else "unclear"
        return kind, f"exit {code}, expected {want.code}: {text[-300:]}"
    if ("Traceback (most recent call last)" in text) != want.traceback:
        return "crash" if not want.traceback else "unclear", f"traceback {'printed' if not want.traceback else 'missing'}: {text[-300:]}"
    if not re.search(want.words, text):
        return ("silent" if want.code in (0, 1) else "unclear"), f"output does not match {want.words!r}: {text[-400:]}"
    return "well", ""


# ============================================================ shared inputs
class Ctx:
    """The real inputs the cases share (built once per module)."""


@pytest.fixture(scope="module")
def ctx(processor, tiny_model, own_tiny_model, tmp_path_factory):
    c = Ctx()
    c.processor, c.model, c.other_model = processor, tiny_model, own_tiny_model
    c.tmp = tmp_path_factory.mktemp("adversarial")
    c.batch = RLBatch.from_token_lists([[1, 2, 3], list(range(10, 41)), [4, 5]], [[6], [7, 8], [9]], processor=processor)
    c.twin = RLBatch.from_token_lists([[11, 12, 13], list(range(50, 81)), [14, 15]], [[16], [17, 18], [19]], processor=processor)
    c.packs = pack(c.batch, max_tokens_per_pack=33)
    c.twin_packs = pack(c.twin, max_tokens_per_pack=33)
    c.values = [torch.arange(p.num_tokens, dtype=torch.float32) for p in c.packs]
    c.x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0))
    c.mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    c.packed, c.cu = pack_padded(c.x, c.mask)
    samples = fixtures.synthetic_image_text(2, seed=0, max_images=1, sizes=((56, 56),))
    out = fixtures.processor_inputs(processor, samples)
    c.image_batch = RLBatch.from_qwen_vl(out, processor=processor, responses=[[5, 151645], [6, 7, 151645]], group_ids=["g", "h"])
    one = {"image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])}
    image_prompt = [fixtures.VISION_START_TOKEN_ID, fixtures.IMAGE_TOKEN_ID, fixtures.VISION_END_TOKEN_ID, 9]
    c.no_pixels = RLBatch.from_token_lists([image_prompt, image_prompt], [[5], [6]], processor=processor, media_cache_keys=["a", "b"], **one)
    g = torch.Generator().manual_seed(1)
    two_images = RLBatch.from_token_lists([image_prompt, image_prompt], [[5], [6]], processor=processor,
                                          pixel_values=torch.randn(8, PIXEL_DIM, generator=g), **one)
    # one key over two different images, as a framework with its own keys might write (the builders refuse it)
    c.same_key = RLBatch.model_construct(**{**dict(two_images), "media_cache_keys": ["k", "k"]})
    c.key_small = RLBatch.from_token_lists([image_prompt], [[5]], processor=processor, media_cache_keys=["k"],
                                           image_grid_thw=torch.tensor([[1, 2, 2]]), pixel_values=torch.randn(4, PIXEL_DIM, generator=g))
    big_prompt = [fixtures.VISION_START_TOKEN_ID] + [fixtures.IMAGE_TOKEN_ID] * 4 + [fixtures.VISION_END_TOKEN_ID, 9]
    c.key_big = RLBatch.from_token_lists([big_prompt], [[5]], processor=processor, media_cache_keys=["k"],
                                         image_grid_thw=torch.tensor([[1, 4, 4]]), pixel_values=torch.randn(16, PIXEL_DIM, generator=g))
    small = RLBatch.from_token_lists([[1, 2, 4]], [[3]], processor=processor)
    # an id beyond the model's vocabulary (a batch of another tokenizer; the builders check against their own)
    c.big_id = RLBatch.model_construct(**{**dict(small), "input_ids": torch.tensor([1, 2, 200_000, 3])})
    c.training = RLBatch.load(TRAINING)
    c.drift = RLBatch.load(DRIFT)
    c.n = int(c.training.loss_spans.lengths().sum())
    c.logp = -torch.rand(c.n, dtype=torch.float64, generator=g) * 3
    c.samples = fixtures.synthetic_image_text(2, seed=0, max_images=1, sizes=((56, 56),))
    c.text_samples = [s for s in fixtures.synthetic_image_text(24, seed=3, allow_text_only=True) if not s.images][:2]
    q = torch.randn(1, 2, 9, 8, generator=g)
    c.qkv = (q, q[:, :1], q[:, :1])
    c.segments = tuple(torch.tensor([v], dtype=torch.int32) for v in (0, 0, 9, 0, 9))
    c.report = {"meta": {}, "invariant": True, "results": [
        {"case": "packed", "detail": "right vs packed", "mode": "batch_invariant", "bitwise": True,
         "max_abs_diff": 0.0, "tokens": 4, "divergence": None}]}
    return c


def _seg(*rows):
    return tuple(torch.tensor(r, dtype=torch.int32) for r in rows)


def _report(**changes):
    def make(c):
        data = {**c.report, "results": [dict(c.report["results"][0])]}
        for key, value in changes.items():
            if value is _DROP:
                del data["results"][0][key]
            else:
                data["results"][0][key] = value
        return InvarianceReport.from_dict(data)

    return make


_DROP = object()


def _padded_logprobs(batch: RLBatch, flat: torch.Tensor, R: int, pad=float("nan")) -> torch.Tensor:
    """The [B, R] right-padded response layout of flat loss-token log-probs."""
    sample, pos, _ = batch.loss_spans.token_positions()
    out = torch.full((batch.num_samples, R), pad, dtype=flat.dtype)
    out[sample, pos - batch.prompt_lengths[sample]] = flat
    return out


def _sweep(c, **kw):
    args = dict(cases=["packed"], control=False, probe=False, response_length=2, group_size=1, backend="torch")
    return invariance_sweep(c.model, c.processor, c.samples, **{**args, **kw})


def _nan_at_final_norm(c):
    model = c.other_model
    handle = model.model.language_model.norm.register_forward_hook(lambda m, a, out: out * float("nan"))
    try:
        return invariance_sweep(model, c.processor, c.samples, cases=["packed"], control=False, probe=False,
                                response_length=2, backend="torch")
    finally:
        handle.remove()


def _cli(*argv):
    return lambda c: cli_main([str(a).replace("{tmp}", str(c.tmp)) for a in argv])


def _smoke(*argv):
    """``rlk-mm smoke`` with one GRPO step and no warm-up (short even where a bad value is not refused)."""
    return _cli("smoke", "--steps", "1", "--warmup-steps", "0", "--quiet", "--out", "{tmp}/smoke", *argv)


@contextlib.contextmanager
def _env(name: str, value: str):
    """``os.environ[name] = value`` inside the block, the old value (or none) after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _no_interpreter_matmul(c):
    with _env("TRITON_INTERPRET", "0"), batch_invariant(backend="triton"):
        return M.matmul(torch.ones(2, 3), torch.ones(3, 2))


def _env_backend(c):
    with _env("RLK_MM_BACKEND", "cuda"), batch_invariant():
        pass


def _internal_error(debug: bool):
    """A bug inside a sub-command (planted: the parity check itself raises)."""

    def run(c):
        from rlk_mm import parity

        real = parity.check_layout_parity
        parity.check_layout_parity = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("planted bug"))
        try:
            return cli_main(["parity", TRAINING, TRAINING] + (["--debug"] if debug else []))
        finally:
            parity.check_layout_parity = real

    return run


# ============================================================ the cases: bad inputs
BAD = [
    # ---------------------------------------------------------------- pack_padded(x, mask)
    Case("pack_padded.x.list", lambda c: pack_padded(c.x.tolist(), c.mask), Raises(TypeError, r"x must be a torch\.Tensor")),
    Case("pack_padded.x.1d", lambda c: pack_padded(torch.zeros(5), c.mask), Raises(ValueError, r"x must be .*\[B, L, \*\].*\(5,\)")),
    Case("pack_padded.x.complex", lambda c: pack_padded(c.x.to(torch.complex64), c.mask), Raises(TypeError, r"x .*complex64")),
    Case("pack_padded.mask.list", lambda c: pack_padded(c.x, c.mask.tolist()), Raises(TypeError, r"mask must be a torch\.Tensor")),
    Case("pack_padded.mask.3d", lambda c: pack_padded(c.x, c.mask[..., None]), Raises(ValueError, r"mask must be .*\[B, L\]")),
    Case("pack_padded.mask.shape", lambda c: pack_padded(c.x, c.mask[:, :4]), Raises(ValueError, r"mask has shape \(2, 4\) but x")),
    Case("pack_padded.mask.float", lambda c: pack_padded(c.x, c.mask.float()), Raises(TypeError, r"mask must be bool or integer")),
    Case("pack_padded.mask.value", lambda c: pack_padded(c.x, c.mask.long() * 2), Raises(ValueError, r"mask: sample 0, position 0 holds 2")),
    Case("pack_padded.mask.negative", lambda c: pack_padded(c.x, -c.mask.long()), Raises(ValueError, r"mask: sample 0, position 0 holds -1")),
    Case("pack_padded.mask.hole", lambda c: pack_padded(c.x, torch.tensor([[1, 0, 1, 0, 0], [1, 1, 1, 1, 1]])),
         Raises(ValueError, r"mask: sample 0 has a hole at position 1")),
    # ---------------------------------------------------------------- unpack_to_padded(packed, cu_seqlens, length, side, fill)
    Case("unpack_to_padded.packed.list", lambda c: unpack_to_padded(c.packed.tolist(), c.cu, 5), Raises(TypeError, r"packed must be a torch\.Tensor")),
    Case("unpack_to_padded.packed.0d", lambda c: unpack_to_padded(torch.tensor(1.0), c.cu, 5), Raises(ValueError, r"packed must be .*\[T, \*\]")),
    Case("unpack_to_padded.packed.complex", lambda c: unpack_to_padded(c.packed.to(torch.complex64), c.cu, 5), Raises(TypeError, r"packed .*complex64")),
    Case("unpack_to_padded.cu.float", lambda c: unpack_to_padded(c.packed, c.cu.float(), 5), Raises(TypeError, r"cu_seqlens must be .*int")),
    Case("unpack_to_padded.cu.list", lambda c: unpack_to_padded(c.packed, c.cu.tolist(), 5), Raises(TypeError, r"cu_seqlens must be a torch\.Tensor")),
    Case("unpack_to_padded.cu.2d", lambda c: unpack_to_padded(c.packed, c.cu[None], 5), Raises(ValueError, r"cu_seqlens must be 1-D")),
    Case("unpack_to_padded.cu.empty", lambda c: unpack_to_padded(c.packed, c.cu[:0], 5), Raises(ValueError, r"cu_seqlens .*B\+1")),
    Case("unpack_to_padded.cu.int32_overflow", lambda c: unpack_to_padded(c.packed, torch.tensor([0, 3, 2**32 + 6]), 5),
         Raises(ValueError, r"cu_seqlens must run from 0 to the packed row count 6")),
    Case("unpack_to_padded.cu.start", lambda c: unpack_to_padded(c.packed, c.cu + 1, 5), Raises(ValueError, r"cu_seqlens must run from 0")),
    Case("unpack_to_padded.cu.decreasing", lambda c: unpack_to_padded(c.packed, torch.tensor([0, 4, 3, 6]), 5),
         Raises(ValueError, r"cu_seqlens decreases at sample 1")),
    Case("unpack_to_padded.length.negative", lambda c: unpack_to_padded(c.packed, c.cu, -1), Raises(ValueError, r"length=-1 is out of range")),
    Case("unpack_to_padded.length.bool", lambda c: unpack_to_padded(c.packed, c.cu, True), Raises(TypeError, r"length must be an int")),
    Case("unpack_to_padded.length.float", lambda c: unpack_to_padded(c.packed, c.cu, 5.0), Raises(TypeError, r"length must be an int")),
    Case("unpack_to_padded.length.short", lambda c: unpack_to_padded(c.packed, c.cu, 2), Raises(ValueError, r"sample 0 has 3 rows, more than the padded length 2")),
    Case("unpack_to_padded.padding.word", lambda c: unpack_to_padded(c.packed, c.cu, 5, "up"), Raises(ValueError, r"padding must be 'left', 'right'")),
    Case("unpack_to_padded.padding.none", lambda c: unpack_to_padded(c.packed, c.cu, 5, None), Raises(ValueError, r"padding must be 'left', 'right'")),
    Case("unpack_to_padded.padding.shape", lambda c: unpack_to_padded(c.packed, c.cu, 5, c.mask[:, :4]), Raises(ValueError, r"padding as a mask must have shape")),
    Case("unpack_to_padded.padding.float", lambda c: unpack_to_padded(c.packed, c.cu, 5, c.mask.float()), Raises(TypeError, r"padding .*bool or integer")),
    Case("unpack_to_padded.padding.hole", lambda c: unpack_to_padded(c.packed, c.cu, 5, torch.tensor([[1, 1, 0, 1, 0], [0, 0, 1, 1, 1]])),
         Raises(ValueError, r"padding: sample 0 has a hole at position 2")),
    Case("unpack_to_padded.padding.counts", lambda c: unpack_to_padded(c.packed, c.cu, 5, torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 1, 1]])),
         Raises(ValueError, r"padding: sample 1 has 2 set positions but cu_seqlens gives it 3")),
    Case("unpack_to_padded.fill.fraction", lambda c: unpack_to_padded(c.packed.long(), c.cu, 5, fill=0.5), Raises(ValueError, r"fill 0.5 is not a value of torch.int64")),
    Case("unpack_to_padded.fill.inf_int", lambda c: unpack_to_padded(c.packed.long(), c.cu, 5, fill=math.inf), Raises(ValueError, r"fill inf is not a value of torch.int64")),
    Case("unpack_to_padded.fill.nan_int", lambda c: unpack_to_padded(c.packed.long(), c.cu, 5, fill=math.nan), Raises(ValueError, r"fill nan is not a value of torch.int64")),
    Case("unpack_to_padded.fill.overflow", lambda c: unpack_to_padded(c.packed, c.cu, 5, fill=1e300), Raises(ValueError, r"fill 1e\+300 is not a value of torch.float32")),
    Case("unpack_to_padded.fill.uint8", lambda c: unpack_to_padded(c.packed.to(torch.uint8), c.cu, 5, fill=300), Raises(ValueError, r"fill 300 is not a value of torch.uint8")),
    Case("unpack_to_padded.fill.bool", lambda c: unpack_to_padded(c.packed > 0, c.cu, 5, fill=2), Raises(ValueError, r"fill 2 is not a value of torch.bool")),
    Case("unpack_to_padded.fill.str", lambda c: unpack_to_padded(c.packed, c.cu, 5, fill="0"), Raises(TypeError, r"fill must be an int or float")),
    Case("unpack_to_padded.fill.true", lambda c: unpack_to_padded(c.packed, c.cu, 5, fill=True), Raises(TypeError, r"fill must be an int or float")),
    # ---------------------------------------------------------------- pack(batch, align, max_tokens_per_pack, pad_token_id)
    Case("pack.batch.tensor", lambda c: pack(torch.zeros(3)), Raises(TypeError, r"pack takes an RLBatch")),
    Case("pack.align.zero", lambda c: pack(c.batch, align=0), Raises(ValueError, r"align=0 is out of range")),
    Case("pack.align.bool", lambda c: pack(c.batch, align=True), Raises(TypeError, r"align must be an int, got bool")),
    Case("pack.align.float", lambda c: pack(c.batch, align=8.0), Raises(TypeError, r"align must be an int, got float")),
    Case("pack.pad.negative", lambda c: pack(c.batch, pad_token_id=-1), Raises(ValueError, r"pad_token_id=-1 is out of range")),
    Case("pack.pad.huge", lambda c: pack(c.batch, pad_token_id=2**63), Raises(ValueError, r"pad_token_id=\d+ is out of range")),
    Case("pack.max.zero", lambda c: pack(c.batch, max_tokens_per_pack=0), Raises(ValueError, r"max_tokens_per_pack=0 is out of range")),
    Case("pack.max.str", lambda c: pack(c.batch, max_tokens_per_pack="64"), Raises(TypeError, r"max_tokens_per_pack must be an int")),
    Case("pack.max.small", lambda c: pack(c.batch, max_tokens_per_pack=20), Raises(ValueError, r"sample 1 has 33 tokens, more than max_tokens_per_pack=20")),
    # ---------------------------------------------------------------- unpack(packed, values)
    Case("unpack.none", lambda c: unpack(None), Raises(TypeError, r"unpack takes a PackedBatch or a non-empty list")),
    Case("unpack.empty", lambda c: unpack([]), Raises(TypeError, r"unpack takes a PackedBatch or a non-empty list")),
    Case("unpack.str", lambda c: unpack("ab"), Raises(TypeError, r"unpack takes a PackedBatch or a non-empty list")),
    Case("unpack.missing_middle", lambda c: unpack([c.packs[0], c.packs[2]]), Raises(ValueError, r"the packs hold sample 1 0 times")),
    Case("unpack.missing_last", lambda c: unpack(c.packs[:2]), Raises(ValueError, r"the packs hold sample 2 0 times")),
    Case("unpack.missing_last.values", lambda c: unpack(c.packs[:2], c.values[:2]), Raises(ValueError, r"the packs hold sample 2 0 times")),
    Case("unpack.twice", lambda c: unpack([c.packs[0], c.packs[0], c.packs[1], c.packs[2]]), Raises(ValueError, r"the packs hold sample 0 2 times")),
    Case("unpack.two_batches", lambda c: unpack([c.packs[0], c.twin_packs[1], c.packs[2]]), Raises(ValueError, r"packs of different pack\(\) calls")),
    Case("unpack.two_batches.values", lambda c: unpack([c.packs[0], c.twin_packs[1], c.packs[2]], c.values),
         Raises(ValueError, r"packs of different pack\(\) calls")),
    Case("unpack.values.tensor", lambda c: unpack(c.packs, torch.zeros(4)), Raises(TypeError, r"values must be a list of tensors, one per pack")),
    Case("unpack.values.count", lambda c: unpack(c.packs, c.values[:1]), Raises(ValueError, r"unpack got 1 value tensors for 3 packs")),
    Case("unpack.values.dtypes", lambda c: unpack(c.packs, [c.values[0], c.values[1].long(), c.values[2]]),
         Raises(TypeError, r"values\[1\] is torch.int64 but values\[0\] is torch.float32")),
    Case("unpack.values.shapes", lambda c: unpack(c.packs, [c.values[0], c.values[1][:, None].expand(-1, 2), c.values[2]]),
         Raises(ValueError, r"values\[1\] has shape \(\d+, 2\) .* values\[0\]")),
    Case("unpack.values.length", lambda c: unpack(c.packs, [c.values[0], c.values[1][:-1], c.values[2]]), Raises(ValueError, r"values\[1\] must be \[T', \*\]")),
    Case("unpack.one.values.list", lambda c: unpack(c.packs[0], [c.values[0]]), Raises(TypeError, r"values must be a torch\.Tensor")),
    Case("unpack.one.values.length", lambda c: unpack(c.packs[0], torch.zeros(5)), Raises(ValueError, r"values must be \[T', \*\] with T' = 4")),
    Case("unpack.one.values.0d", lambda c: unpack(c.packs[0], torch.tensor(0.0)), Raises(ValueError, r"values must be .*\[T', \*\]")),
    # ---------------------------------------------------------------- PackedBatch methods
    Case("pack_tokens.values.list", lambda c: c.packs[0].pack_tokens([0.0] * 40), Raises(TypeError, r"values must be a torch\.Tensor")),
    Case("pack_tokens.values.length", lambda c: c.packs[0].pack_tokens(torch.zeros(4)), Raises(ValueError, r"values must be \[T, \*\] with T = 40")),
    Case("pack_tokens.values.0d", lambda c: c.packs[0].pack_tokens(torch.tensor(1.0)), Raises(ValueError, r"values must be .*\[T, \*\]")),
    Case("pack_tokens.fill.inf_int", lambda c: c.packs[0].pack_tokens(torch.zeros(40, dtype=torch.long), fill=math.inf),
         Raises(ValueError, r"fill inf is not a value of torch.int64")),
    Case("pack_tokens.fill.str", lambda c: c.packs[0].pack_tokens(torch.zeros(40), fill="x"), Raises(TypeError, r"fill must be an int or float")),
    Case("PackedBatch.to.word", lambda c: c.packs[0].to("gpu"), Raises(ValueError, r"device='gpu'")),
    Case("PackedBatch.to.missing", lambda c: c.packs[0].to("cuda:99"), Raises(ValueError, r"device='cuda:99'")),
    # ---------------------------------------------------------------- layout_inputs(batch, padding, pad_token_id)
    Case("layout_inputs.batch.list", lambda c: layout_inputs([c.batch]), Raises(TypeError, r"batch must be an RLBatch")),
    Case("layout_inputs.padding.word", lambda c: layout_inputs(c.batch, "middle"), Raises(ValueError, r"padding='middle': expected None \(packed")),
    Case("layout_inputs.padding.int", lambda c: layout_inputs(c.batch, 1), Raises(ValueError, r"padding=1: expected None")),
    Case("layout_inputs.pad.negative", lambda c: layout_inputs(c.batch, "right", -1), Raises(ValueError, r"pad_token_id=-1 is out of range")),
    Case("layout_inputs.pad.bool", lambda c: layout_inputs(c.batch, "right", True), Raises(TypeError, r"pad_token_id must be an int")),
    Case("layout_inputs.pad.float", lambda c: layout_inputs(c.batch, "right", 0.5), Raises(TypeError, r"pad_token_id must be an int")),
    # ---------------------------------------------------------------- forward_hidden / batch_logprobs
    Case("forward_hidden.model.none", lambda c: forward_hidden(None, c.image_batch), Raises(TypeError, r"model must be a transformers Qwen2\.5-VL")),
    Case("forward_hidden.model.linear", lambda c: forward_hidden(torch.nn.Linear(2, 2), c.image_batch), Raises(TypeError, r"model must be a transformers Qwen2\.5-VL")),
    Case("forward_hidden.batch.dict", lambda c: forward_hidden(c.model, {"input_ids": c.batch.input_ids}), Raises(TypeError, r"batch must be an RLBatch")),
    Case("forward_hidden.padding", lambda c: forward_hidden(c.model, c.image_batch, padding="packd"), Raises(ValueError, r"padding='packd'")),
    Case("forward_hidden.media_embeds.rows", lambda c: forward_hidden(c.model, c.image_batch, media_embeds=torch.zeros(3, 64)),
         Raises(ValueError, r"media_embeds has 3 rows; the batch's media items need 8")),
    Case("forward_hidden.media_embeds.width", lambda c: forward_hidden(c.model, c.image_batch, media_embeds=torch.zeros(8, 32)),
         Raises(ValueError, r"media_embeds must be \[8, 64\]")),
    Case("forward_hidden.media_embeds.int", lambda c: forward_hidden(c.model, c.image_batch, media_embeds=torch.zeros(8, 64, dtype=torch.long)),
         Raises(TypeError, r"media_embeds must be float")),
    Case("forward_hidden.media_embeds.list", lambda c: forward_hidden(c.model, c.image_batch, media_embeds=[[0.0] * 64] * 8),
         Raises(TypeError, r"media_embeds must be a torch\.Tensor")),
    Case("forward_hidden.token_beyond_vocab", lambda c: forward_hidden(c.model, c.big_id),
         Raises(ValueError, r"input_ids: sample 0, position 2 holds 200000.*vocabulary of 151669")),
    Case("forward_hidden.no_pixels", lambda c: forward_hidden(c.model, c.no_pixels),
         Raises(ValueError, r"media item 0 \(image\) has no pixel values.*media_embeds")),
    Case("forward_hidden.image_token_id", lambda c: forward_hidden(c.model, RLBatch.model_construct(**{**dict(c.image_batch), "image_token_id": 7})),
         Raises(ValueError, r"batch\.image_token_id=7 but the model's image_token_id is 151655")),
    Case("batch_logprobs.temperature.zero", lambda c: batch_logprobs(c.model, c.image_batch, temperature=0), Raises(ValueError, r"temperature must be a finite number >= 1e-05; got 0.0")),
    Case("batch_logprobs.temperature.nan", lambda c: batch_logprobs(c.model, c.image_batch, temperature=math.nan), Raises(ValueError, r"temperature must be a finite number >= 1e-05; got nan")),
    Case("batch_logprobs.temperature.str", lambda c: batch_logprobs(c.model, c.image_batch, temperature="1"), Raises(TypeError, r"temperature must be a number")),
    Case("batch_logprobs.temperature.bool", lambda c: batch_logprobs(c.model, c.image_batch, temperature=True), Raises(TypeError, r"temperature must be a number")),
    Case("batch_logprobs.model.none", lambda c: batch_logprobs(None, c.image_batch), Raises(TypeError, r"model must be a transformers Qwen2\.5-VL")),
    # ---------------------------------------------------------------- VisionCache
    Case("VisionCache.model.none", lambda c: VisionCache(None), Raises(TypeError, r"model must be a transformers Qwen2\.5-VL")),
    Case("VisionCache.keep.int", lambda c: VisionCache(c.model, keep=1), Raises(TypeError, r"keep must be True or False")),
    Case("VisionCache.batch.list", lambda c: VisionCache(c.model)([c.image_batch]), Raises(TypeError, r"batch must be an RLBatch")),
    Case("VisionCache.no_pixels", lambda c: VisionCache(c.model)(c.no_pixels), Raises(ValueError, r"media item 0 \(image\) has no pixel values")),
    Case("VisionCache.shared_key.pixels", lambda c: VisionCache(c.model)(c.same_key),
         Raises(ValueError, r"media_cache_keys: items 0 and 1 share key 'k' but their pixel values differ")),
    Case("VisionCache.kept_key.grid", lambda c: _kept_twice(c), Raises(ValueError, r"media_cache_keys: item 0's key 'k' is kept .*grid \[1, 2, 2\].*\[1, 4, 4\]")),
    # ---------------------------------------------------------------- group_logprobs / group_hidden
    Case("group_logprobs.cache.other_model", lambda c: group_logprobs(c.model, c.image_batch, vision_cache=VisionCache(c.other_model)),
         Raises(ValueError, r"vision_cache runs another model")),
    Case("group_logprobs.cache.type", lambda c: group_logprobs(c.model, c.image_batch, vision_cache={}), Raises(TypeError, r"vision_cache must be a VisionCache")),
    Case("group_logprobs.temperature", lambda c: group_logprobs(c.model, c.image_batch, temperature=-1.0), Raises(ValueError, r"temperature must be a finite number >= 1e-05; got -1.0")),
    Case("group_logprobs.batch.none", lambda c: group_logprobs(c.model, None), Raises(TypeError, r"batch must be an RLBatch")),
    Case("group_logprobs.model.none", lambda c: group_logprobs(None, c.image_batch), Raises(TypeError, r"model must be a transformers Qwen2\.5-VL")),
    # ---------------------------------------------------------------- batch_invariant(backend)
    Case("batch_invariant.backend.word", lambda c: batch_invariant(backend="cuda").__enter__(), Raises(ValueError, r"backend must be None, 'torch' or 'triton'")),
    Case("batch_invariant.backend.int", lambda c: batch_invariant(backend=1).__enter__(), Raises(ValueError, r"backend must be None, 'torch' or 'triton'")),
    Case("batch_invariant.backend.env", _env_backend, Raises(ValueError, r"RLK_MM_BACKEND='cuda'")),
    Case("batch_invariant.triton.no_interpreter", _no_interpreter_matmul, Raises((ValueError, RuntimeError), r"TRITON_INTERPRET=1")),
    # ---------------------------------------------------------------- matmul / shared_input_linears
    Case("matmul.a.list", lambda c: M.matmul([[1.0]], torch.ones(1, 1)), Raises(TypeError, r"a must be a torch\.Tensor")),
    Case("matmul.b.none", lambda c: M.matmul(torch.ones(1, 1), None), Raises(TypeError, r"b must be a torch\.Tensor")),
    Case("matmul.a.1d", lambda c: M.matmul(torch.ones(3), torch.ones(3, 2)), Raises(ValueError, r"matmul: expected two 2-D or two 3-D")),
    Case("matmul.shapes", lambda c: M.matmul(torch.ones(3, 4), torch.ones(5, 2)), Raises(ValueError, r"cannot be multiplied")),
    Case("matmul.dtypes", lambda c: M.matmul(torch.ones(3, 4), torch.ones(4, 2).double()), Raises(ValueError, r"one dtype")),
    Case("matmul.bool", lambda c: M.matmul(torch.ones(3, 4, dtype=torch.bool), torch.ones(4, 2, dtype=torch.bool)), Raises(TypeError, r"matmul: .*bool")),
    Case("matmul.bias.shape", lambda c: M.matmul(torch.ones(3, 4), torch.ones(4, 5), torch.ones(6)),
         Raises(ValueError, r"bias of shape \(6,\) does not broadcast to the output \(3, 5\)")),
    Case("matmul.bias.list", lambda c: M.matmul(torch.ones(3, 4), torch.ones(4, 5), [0.0] * 5), Raises(TypeError, r"bias must be a torch\.Tensor")),
    Case("matmul.bias.dtype", lambda c: M.matmul(torch.ones(3, 4), torch.ones(4, 5), torch.ones(5).double()),
         Raises(ValueError, r"bias is torch.float64 but a and b are torch.float32")),
    Case("matmul.alpha.nan", lambda c: M.matmul(torch.ones(3, 4), torch.ones(4, 5), alpha=math.nan), Raises(ValueError, r"alpha=nan must be a finite")),
    Case("matmul.beta.str", lambda c: M.matmul(torch.ones(3, 4), torch.ones(4, 5), beta="1"), Raises(TypeError, r"beta must be a number")),
    Case("shared_input_linears.x.list", lambda c: M.shared_input_linears([1.0], [torch.nn.Linear(1, 1)]), Raises(TypeError, r"x must be a torch\.Tensor")),
    Case("shared_input_linears.layers.empty", lambda c: M.shared_input_linears(torch.ones(2, 4), []), Raises(ValueError, r"layers must hold 1 to 3")),
    Case("shared_input_linears.layers.one", lambda c: M.shared_input_linears(torch.ones(2, 4), torch.nn.Linear(4, 2)), Raises(TypeError, r"layers must be a list")),
    Case("shared_input_linears.layers.conv", lambda c: M.shared_input_linears(torch.ones(2, 4), [torch.nn.Linear(4, 2), torch.nn.Conv1d(4, 2, 1)]),
         Raises(TypeError, r"layers\[1\] must be a torch\.nn\.Linear")),
    Case("shared_input_linears.features", lambda c: M.shared_input_linears(torch.ones(2, 4), [torch.nn.Linear(3, 2)]),
         Raises(ValueError, r"layers\[0\] takes 3 input features but x has 4")),
    # ---------------------------------------------------------------- rms_norm(x, weight, eps)
    Case("rms_norm.x.list", lambda c: N.rms_norm([1.0], torch.ones(1), 1e-6), Raises(TypeError, r"x must be a torch\.Tensor")),
    Case("rms_norm.x.0d", lambda c: N.rms_norm(torch.tensor(1.0), torch.ones(1), 1e-6), Raises(ValueError, r"x must be .*\[\.\.\., H\]")),
    Case("rms_norm.x.int", lambda c: N.rms_norm(torch.ones(2, 3, dtype=torch.long), torch.ones(3), 1e-6), Raises(TypeError, r"x must be float")),
    Case("rms_norm.weight.shape", lambda c: N.rms_norm(torch.ones(2, 3), torch.ones(4), 1e-6), Raises(ValueError, r"rms_norm: weight shape \(4,\)")),
    Case("rms_norm.weight.none", lambda c: N.rms_norm(torch.ones(2, 3), None, 1e-6), Raises(TypeError, r"weight must be a torch\.Tensor")),
    Case("rms_norm.eps.negative", lambda c: N.rms_norm(torch.ones(2, 3), torch.ones(3), -1.0), Raises(ValueError, r"eps=-1.0 is out of range")),
    Case("rms_norm.eps.nan", lambda c: N.rms_norm(torch.ones(2, 3), torch.ones(3), math.nan), Raises(ValueError, r"eps=nan must be a finite")),
    Case("rms_norm.eps.str", lambda c: N.rms_norm(torch.ones(2, 3), torch.ones(3), "1e-6"), Raises(TypeError, r"eps must be a number")),
    # ---------------------------------------------------------------- segment_attention / varlen_attention
    Case("segment_attention.q.3d", lambda c: A.segment_attention(c.qkv[0][0], *c.qkv[1:], c.segments, causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"q must be \[B, Hq, Lq, D\]")),
    Case("segment_attention.kv.shapes", lambda c: A.segment_attention(c.qkv[0], c.qkv[1], c.qkv[2][..., :4], c.segments, causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"k and v must have one shape")),
    Case("segment_attention.heads", lambda c: A.segment_attention(c.qkv[0][:, :1], c.qkv[0], c.qkv[0], c.segments, causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"1 query heads is not a multiple of 2 key/value heads")),
    Case("segment_attention.dtypes", lambda c: A.segment_attention(c.qkv[0], c.qkv[1].double(), c.qkv[2], c.segments, causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"q, k and v must share one dtype")),
    Case("segment_attention.segments.four", lambda c: A.segment_attention(*c.qkv, c.segments[:4], causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"segments must be 5 tensors")),
    Case("segment_attention.segments.float", lambda c: A.segment_attention(*c.qkv, (c.segments[0], c.segments[1].float(), *c.segments[2:]), causal=True, scale=1.0, max_q=9),
         Raises(TypeError, r"segments\[1\] must be int32")),
    Case("segment_attention.segments.lengths", lambda c: A.segment_attention(*c.qkv, _seg([0, 0], [0], [9], [0], [9]), causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"segments\[1\] has 1 entries but segments\[0\] has 2")),
    Case("segment_attention.segments.q_range", lambda c: A.segment_attention(*c.qkv, _seg([0], [0], [12], [0], [12]), causal=True, scale=1.0, max_q=12),
         Raises(ValueError, r"segment 0: queries \[0, 12\) .* Lq = 9")),
    Case("segment_attention.segments.batch", lambda c: A.segment_attention(*c.qkv, _seg([1], [0], [9], [0], [9]), causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"segment 0: batch row 1 .* B = 1")),
    Case("segment_attention.segments.negative", lambda c: A.segment_attention(*c.qkv, _seg([0], [0], [-2], [0], [9]), causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"segment 0: .*negative")),
    Case("segment_attention.segments.overlap", lambda c: A.segment_attention(*c.qkv, _seg([0, 0], [0, 3], [5, 6], [0, 0], [5, 9]), causal=False, scale=1.0, max_q=6),
         Raises(ValueError, r"segments 0 and 1 overlap")),
    Case("segment_attention.segments.no_keys", lambda c: A.segment_attention(*c.qkv, _seg([0], [0], [9], [0], [4]), causal=True, scale=1.0, max_q=9),
         Raises(ValueError, r"segment 0: 9 causal queries over 4 keys")),
    Case("segment_attention.max_q", lambda c: A.segment_attention(*c.qkv, c.segments, causal=True, scale=1.0, max_q=4),
         Raises(ValueError, r"max_q=4 is less than segment 0's 9 queries")),
    Case("segment_attention.scale.nan", lambda c: A.segment_attention(*c.qkv, c.segments, causal=True, scale=math.nan, max_q=9), Raises(ValueError, r"scale=nan must be a finite")),
    Case("segment_attention.scale.zero", lambda c: A.segment_attention(*c.qkv, c.segments, causal=True, scale=0.0, max_q=9), Raises(ValueError, r"scale=0.0 is out of range")),
    Case("segment_attention.causal.str", lambda c: A.segment_attention(*c.qkv, c.segments, causal="yes", scale=1.0, max_q=9), Raises(TypeError, r"causal must be True or False")),
    Case("varlen_attention.q.4d", lambda c: A.varlen_attention(c.qkv[0], c.qkv[0], c.qkv[0], torch.tensor([0, 2], dtype=torch.int32)),
         Raises(ValueError, r"q must be \[T, Hq, D\]")),
    Case("varlen_attention.cu.float", lambda c: A.varlen_attention(*(t[0].transpose(0, 1) for t in c.qkv), torch.tensor([0.0, 4.5, 9.0])),
         Raises(TypeError, r"cu_seqlens_q must be .*int")),
    Case("varlen_attention.cu.list", lambda c: A.varlen_attention(*(t[0].transpose(0, 1) for t in c.qkv), [0, 9]),
         Raises(TypeError, r"cu_seqlens_q must be a torch\.Tensor")),
    Case("varlen_attention.cu.end", lambda c: A.varlen_attention(*(t[0].transpose(0, 1) for t in c.qkv), torch.tensor([0, 3, 7], dtype=torch.int32)),
         Raises(ValueError, r"cu_seqlens_q ends at 7 but q has 9 rows")),
    Case("varlen_attention.cu.beyond", lambda c: A.varlen_attention(*(t[0].transpose(0, 1) for t in c.qkv), torch.tensor([0, 3, 12], dtype=torch.int32)),
         Raises(ValueError, r"cu_seqlens_q ends at 12 but q has 9 rows")),
    Case("varlen_attention.cu_k.missing", lambda c: A.varlen_attention(c.qkv[0][0].transpose(0, 1), *(t[0, :, :5].transpose(0, 1) for t in c.qkv[1:]),
                                                                          torch.tensor([0, 9], dtype=torch.int32)),
         Raises(ValueError, r"cu_seqlens_k ends at 9 but k has 5 rows")),
    Case("varlen_attention.cu.start", lambda c: A.varlen_attention(*(t[0].transpose(0, 1) for t in c.qkv), torch.tensor([1, 9], dtype=torch.int32)),
         Raises(ValueError, r"cu_seqlens_q must start at 0")),
    Case("varlen_attention.causal.few_keys", lambda c: A.varlen_attention(c.qkv[0][0].transpose(0, 1), *(t[0, :, :5].transpose(0, 1) for t in c.qkv[1:]),
                                                                            torch.tensor([0, 9], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)),
         Raises(ValueError, r"segment 0: 9 causal queries over 5 keys")),
    Case("varlen_attention.scale.nan", lambda c: A.varlen_attention(*(t[0].transpose(0, 1) for t in c.qkv), torch.tensor([0, 9], dtype=torch.int32), scale=math.nan),
         Raises(ValueError, r"scale=nan must be a finite")),
    # ---------------------------------------------------------------- check_layout_parity / compare_logprobs
    Case("check_layout_parity.rollout.none", lambda c: check_layout_parity(None, c.training), Raises(TypeError, r"rollout must be an RLBatch")),
    Case("check_layout_parity.training.dict", lambda c: check_layout_parity(c.training, {}), Raises(TypeError, r"training must be an RLBatch")),
    Case("check_layout_parity.tokenizer.str", lambda c: check_layout_parity(c.drift, c.training, tokenizer="qwen"), Raises(TypeError, r"tokenizer must have a decode")),
    Case("compare_logprobs.padded.no_prompt_lengths", lambda c: compare_logprobs(*[_padded_logprobs(c.training, c.logp, 8)] * 2, *[_without_prompt_lengths(c.training)] * 2),
         Raises(ValueError, r"rollout_logprobs: a \[B, R\] tensor needs the batch's prompt_lengths")),
    Case("compare_logprobs.padded.columns", lambda c: compare_logprobs(_padded_logprobs(c.training, c.logp, 8)[:, :2], c.logp, c.training, c.training),
         Raises(ValueError, r"rollout_logprobs has 2 response columns; loss tokens reach column 5")),
    Case("compare_logprobs.padded.rows", lambda c: compare_logprobs(_padded_logprobs(c.training, c.logp, 8)[:1], c.logp, c.training, c.training),
         Raises(ValueError, r"rollout_logprobs has 1 rows; the batch has 2 samples")),
    Case("compare_logprobs.int", lambda c: compare_logprobs(c.logp.long(), c.logp, c.training, c.training), Raises(TypeError, r"rollout_logprobs must be float")),
    Case("compare_logprobs.list", lambda c: compare_logprobs(c.logp.tolist(), c.logp, c.training, c.training), Raises(TypeError, r"rollout_logprobs must be a torch\.Tensor")),
    Case("compare_logprobs.count", lambda c: compare_logprobs(c.logp, c.logp[:5], c.training, c.training), Raises(ValueError, r"training_logprobs has 5 values; the batch has 9 loss tokens")),
    Case("compare_logprobs.3d", lambda c: compare_logprobs(c.logp[None, None], c.logp, c.training, c.training), Raises(ValueError, r"expected \[n loss tokens\] or \[B, R\]")),
    Case("compare_logprobs.nan", lambda c: compare_logprobs(c.logp, torch.where(torch.arange(c.n) == 2, math.nan, c.logp), c.training, c.training),
         Raises(ValueError, r"training_logprobs: sample 0, position 50 is nan")),
    Case("compare_logprobs.probabilities", lambda c: compare_logprobs(c.logp.exp(), c.logp, c.training, c.training),
         Raises(ValueError, r"rollout_logprobs: sample 0, position 48 is 0\.\d+ > 0.*log-probabilities")),
    Case("compare_logprobs.dtype.str", lambda c: compare_logprobs(c.logp, c.logp, c.training, c.training, dtype="float32"), Raises(TypeError, r"dtype must be a torch floating dtype")),
    Case("compare_logprobs.dtype.int", lambda c: compare_logprobs(c.logp, c.logp, c.training, c.training, dtype=torch.int64), Raises(TypeError, r"dtype must be a torch floating dtype")),
    Case("compare_logprobs.tolerance.negative", lambda c: compare_logprobs(c.logp, c.logp, c.training, c.training, tolerance=-1.0), Raises(ValueError, r"tolerance=-1.0 is out of range")),
    Case("compare_logprobs.tolerance.nan", lambda c: compare_logprobs(c.logp, c.logp, c.training, c.training, tolerance=math.nan), Raises(ValueError, r"tolerance=nan must be a finite")),
    Case("compare_logprobs.tolerance.str", lambda c: compare_logprobs(c.logp, c.logp, c.training, c.training, tolerance="0.1"), Raises(TypeError, r"tolerance must be a number")),
    Case("compare_logprobs.rollout.none", lambda c: compare_logprobs(c.logp, c.logp, None, c.training), Raises(TypeError, r"rollout must be an RLBatch")),
    # ---------------------------------------------------------------- invariance_sweep
    Case("invariance_sweep.cases.str", lambda c: _sweep(c, cases="packed"), Raises(TypeError, r"cases must be a list of case names")),
    Case("invariance_sweep.cases.empty", lambda c: _sweep(c, cases=[]), Raises(ValueError, r"cases is empty")),
    Case("invariance_sweep.response_length.zero", lambda c: _sweep(c, response_length=0), Raises(ValueError, r"response_length=0 is out of range")),
    Case("invariance_sweep.response_length.bool", lambda c: _sweep(c, response_length=True), Raises(TypeError, r"response_length must be an int")),
    Case("invariance_sweep.group_size.zero", lambda c: _sweep(c, cases=["group_cache"], group_size=0), Raises(ValueError, r"group_size=0 is out of range")),
    Case("invariance_sweep.samples.no_images", lambda c: invariance_sweep(c.model, c.processor, c.text_samples, cases=["neighbour_images"]),
         Raises(ValueError, r"neighbour_images needs samples with images")),
    Case("invariance_sweep.samples.str", lambda c: invariance_sweep(c.model, c.processor, "ab"), Raises(TypeError, r"samples must be a list")),
    Case("invariance_sweep.samples.dicts", lambda c: invariance_sweep(c.model, c.processor, [{}, {}]), Raises(TypeError, r"samples\[0\] .*messages")),
    Case("invariance_sweep.samples.one", lambda c: invariance_sweep(c.model, c.processor, c.samples[:1]), Raises(ValueError, r"at least 2 samples")),
    Case("invariance_sweep.backend", lambda c: _sweep(c, backend="cuda"), Raises(ValueError, r"backend must be None, 'torch' or 'triton'")),
    Case("invariance_sweep.control.str", lambda c: _sweep(c, control="no"), Raises(TypeError, r"control must be True or False")),
    Case("invariance_sweep.probe.int", lambda c: _sweep(c, probe=1), Raises(TypeError, r"probe must be True or False")),
    Case("invariance_sweep.seed.float", lambda c: _sweep(c, seed=1.5), Raises(TypeError, r"seed must be an int")),
    Case("invariance_sweep.score", lambda c: _sweep(c, score="logits"), Raises(ValueError, r"score must be 'logprob' or 'hidden', got 'logits'")),
    Case("invariance_sweep.model.none", lambda c: invariance_sweep(None, c.processor, c.samples), Raises(TypeError, r"model must be a transformers Qwen2\.5-VL")),
    Case("invariance_sweep.processor.none", lambda c: invariance_sweep(c.model, None, c.samples), Raises(TypeError, r"processor must be a Qwen2\.5-VL processor")),
    Case("invariance_sweep.non_finite_scores", _nan_at_final_norm, Raises(ValueError, r"run 'right'.* sample 0, .*not finite")),
    # ---------------------------------------------------------------- InvarianceReport
    Case("InvarianceReport.from_dict.list", lambda c: InvarianceReport.from_dict([]), Raises(TypeError, r"data must be a dict")),
    Case("InvarianceReport.from_dict.no_results", lambda c: InvarianceReport.from_dict({}), Raises(ValueError, r"data has no 'results' list")),
    Case("InvarianceReport.from_dict.empty", lambda c: InvarianceReport.from_dict({"results": []}), Raises(ValueError, r"data\['results'\] is empty")),
    Case("InvarianceReport.save_png.empty", lambda c: InvarianceReport([], {}).save_png(c.tmp / "empty_report.png"), Raises(ValueError, r"no results to draw")),
    Case("InvarianceReport.from_dict.missing", _report(mode=_DROP), Raises(ValueError, r"results\[0\] is missing 'mode'")),
    Case("InvarianceReport.from_dict.unknown", _report(colour="red"), Raises(ValueError, r"results\[0\] has unknown field 'colour'")),
    Case("InvarianceReport.from_dict.diff", _report(max_abs_diff="x"), Raises(TypeError, r"results\[0\]\.max_abs_diff must be a number")),
    Case("InvarianceReport.from_dict.diff_nan", _report(max_abs_diff=math.nan), Raises(ValueError, r"results\[0\]\.max_abs_diff=nan")),
    Case("InvarianceReport.from_dict.mode", _report(mode="fast"), Raises(ValueError, r"results\[0\]\.mode='fast'")),
    Case("InvarianceReport.from_dict.bitwise", _report(bitwise="yes"), Raises(TypeError, r"results\[0\]\.bitwise must be True or False")),
    Case("InvarianceReport.from_dict.tokens", _report(tokens=-1), Raises(ValueError, r"results\[0\]\.tokens=-1 is out of range")),
    Case("InvarianceReport.from_dict.divergence", _report(divergence={"module": "x"}), Raises(ValueError, r"results\[0\]\.divergence is missing 'sample'")),
    Case("InvarianceReport.save_json.dir", lambda c: InvarianceReport.from_dict(c.report).save_json(c.tmp / "no_such_dir" / "r.json"),
         Raises(FileNotFoundError, r"no_such_dir")),
    # ---------------------------------------------------------------- draw_layout
    Case("draw_layout.batch.list", lambda c: draw_layout([c.batch], c.tmp / "l.png"), Raises(TypeError, r"batch must be an RLBatch")),
    Case("draw_layout.samples.range", lambda c: draw_layout(c.batch, c.tmp / "l.png", samples=[5]), Raises(ValueError, r"samples\[0\]=5 is out of range")),
    Case("draw_layout.samples.negative", lambda c: draw_layout(c.batch, c.tmp / "l.png", samples=[0, -1]), Raises(ValueError, r"samples\[1\]=-1 is out of range")),
    Case("draw_layout.samples.bool", lambda c: draw_layout(c.batch, c.tmp / "l.png", samples=[True]), Raises(TypeError, r"samples\[0\] must be an int")),
    Case("draw_layout.samples.str", lambda c: draw_layout(c.batch, c.tmp / "l.png", samples="0"), Raises(TypeError, r"samples must be a list of sample indices")),
    Case("draw_layout.title.int", lambda c: draw_layout(c.batch, c.tmp / "l.png", title=5), Raises(TypeError, r"title must be a str")),
    Case("draw_layout.path.dir", lambda c: draw_layout(c.batch, c.tmp / "no_such_dir" / "l.png"), Raises(FileNotFoundError, r"no_such_dir")),
    # ---------------------------------------------------------------- the CLI (exit codes: 0 ok, 1 negative, 2 bad input, 3 internal)
    Case("cli.parity.missing_file", _cli("parity", "{tmp}/nope.safetensors", TRAINING), Exits(2, r"nope\.safetensors: no such file")),
    Case("cli.parity.model_path", _cli("parity", DRIFT, TRAINING, "--model-path", "{tmp}/no_model"), Exits(2, r"--model-path.*no_model")),
    Case("cli.parity.arguments", _cli("parity", TRAINING), Exits(2, r"the following arguments are required: training")),
    Case("cli.command", _cli("train"), Exits(2, r"invalid choice: 'train'")),
    Case("cli.internal_error", _internal_error(False), Exits(3, r"internal error: RuntimeError: planted bug.*--debug")),
    Case("cli.internal_error.debug", _internal_error(True), Exits(3, r"RuntimeError: planted bug", traceback=True)),
    Case("cli.inspect.png_dir", _cli("inspect", TRAINING, "--png", "{tmp}/no_such_dir/l.png"), Exits(2, r"--png.*no_such_dir")),
    Case("cli.inspect.max_rows", _cli("inspect", TRAINING, "--max-rows", "-1"), Exits(2, r"--max-rows: -1 is not an int >= 0")),
    Case("cli.invariance.samples", _cli("invariance", "--samples", "1"), Exits(2, r"--samples: 1 is not an int >= 2")),
    Case("cli.invariance.response_length", _cli("invariance", "--samples", "2", "--cases", "packed", "--no-control", "--backend", "torch",
                                                "--response-length", "0"), Exits(2, r"--response-length: 0 is not an int >= 1")),
    Case("cli.invariance.device", _cli("invariance", "--device", "tpu"), Exits(2, r"--device: 'tpu'")),
    Case("cli.invariance.json_dir", _cli("invariance", "--samples", "2", "--cases", "packed", "--no-control", "--backend", "torch",
                                         "--response-length", "2", "--json", "{tmp}/no_such_dir/r.json"), Exits(2, r"--json.*no_such_dir")),
    Case("cli.invariance.model_path", _cli("invariance", "--model-path", "{tmp}/no_model"), Exits(2, r"--model-path.*no_model")),
    Case("cli.smoke.steps", _smoke("--steps", "-1"), Exits(2, r"--steps: -1 is not an int >= 1")),
    Case("cli.smoke.prompts", _smoke("--prompts", "0"), Exits(2, r"--prompts: 0 is not an int >= 1")),
    Case("cli.smoke.temperature", _smoke("--temperature", "0"), Exits(2, r"--temperature: 0(\.0)? is not a number >= 1e-05")),
    Case("cli.smoke.lr", _smoke("--lr", "nan"), Exits(2, r"--lr: nan is not a number > 0")),
    Case("cli.smoke.data", _smoke("--data", "{tmp}/no_geo3k"), Exits(2, r"--data: .*no_geo3k")),
    Case("cli.smoke.device", _smoke("--device", "tpu"), Exits(2, r"--device: 'tpu'")),
    Case("cli.smoke.image_swap", _smoke("--break", "image-swap", "--prompts", "2"), Exits(2, r"--break image-swap needs --prompts >= 5")),
]


def _kept_twice(c):
    cache = VisionCache(c.model, keep=True)
    with torch.no_grad():
        cache(c.key_small)
        return cache(c.key_big)


def _without_prompt_lengths(batch: RLBatch) -> RLBatch:
    return RLBatch(**{**dict(batch), "prompt_lengths": None})


# ============================================================ the cases: unusual but valid inputs
def _same(want):
    def check(result, c):
        got = result if isinstance(result, torch.Tensor) else result[0]
        assert torch.equal(got, want(c) if callable(want) else want), f"{got} != expected"

    return check


def _equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _check_nan_pack(result, c):
    packed, cu = result
    assert _equal_nan(packed, torch.tensor([math.nan, 1.0, math.inf, -math.inf])), packed
    assert cu.tolist() == [0, 2, 4]


def _check_compare(expect_ok: bool, expect_max: float):
    def check(result, c):
        assert result.ok is expect_ok and result.max_abs == expect_max, str(result)

    return check


def _check_padded_compare(result, c):
    flat = compare_logprobs(c.logp, c.logp + 1e-3, c.training, c.training)
    assert result.to_dict() == flat.to_dict(), f"{result} != {flat}"


GOOD = [
    Case("pack_padded.non_finite", lambda c: pack_padded(torch.tensor([[math.nan, 1.0, 0.0], [0.0, math.inf, -math.inf]]),
                                                         torch.tensor([[1, 1, 0], [0, 1, 1]])), Returns(_check_nan_pack)),
    Case("pack_padded.empty_batch", lambda c: pack_padded(torch.zeros(0, 4, 2), torch.zeros(0, 4, dtype=torch.bool)),
         Returns(lambda r, c: r[0].shape == (0, 2) and r[1].tolist() == [0] or _fail(r))),
    Case("pack_padded.no_valid", lambda c: pack_padded(c.x, torch.zeros(2, 5, dtype=torch.bool)),
         Returns(lambda r, c: r[0].shape == (0, 3) and r[1].tolist() == [0, 0, 0] or _fail(r))),
    Case("pack_padded.non_contiguous", lambda c: pack_padded(c.x.transpose(0, 1).contiguous().transpose(0, 1), c.mask), Returns(_same(lambda c: c.packed))),
    Case("unpack_to_padded.non_finite", lambda c: unpack_to_padded(torch.tensor([math.nan, math.inf]), torch.tensor([0, 2]), 3, "left", fill=-math.inf),
         Returns(lambda r, c: _equal_nan(r, torch.tensor([[-math.inf, math.nan, math.inf]])) or _fail(r))),
    Case("unpack_to_padded.empty_batch", lambda c: unpack_to_padded(torch.zeros(0, 2), torch.zeros(1, dtype=torch.int32), 3),
         Returns(lambda r, c: r.shape == (0, 3, 2) or _fail(r))),
    Case("unpack_to_padded.int64_cu", lambda c: unpack_to_padded(c.packed, c.cu.long(), 5, c.mask), Returns(_same(lambda c: torch.where(c.mask[..., None], c.x, 0)))),
    Case("unpack_to_padded.numpy_length", lambda c: unpack_to_padded(c.packed, c.cu, np.int64(5), c.mask), Returns(_same(lambda c: torch.where(c.mask[..., None], c.x, 0)))),
    Case("pack.numpy_align", lambda c: pack(c.batch, align=np.int64(8)), Returns(lambda r, c: r.align == 8 and r.num_tokens == 56 or _fail(r))),
    Case("unpack.shuffled_packs", lambda c: unpack([c.packs[2], c.packs[0], c.packs[1]]), Returns(lambda r, c: _batches_equal(r, c.batch))),
    Case("unpack.values.non_finite", lambda c: unpack(c.packs, [v * math.inf for v in c.values]),
         Returns(lambda r, c: _equal_nan(r, torch.cat([v[p.valid] for p, v in zip(c.packs, c.values)]) * math.inf) or _fail(r))),
    Case("layout_inputs.empty_batch", lambda c: layout_inputs(c.batch.select([]), "left")[0]["input_ids"],
         Returns(lambda r, c: r.shape == (0, 0) or _fail(r))),
    Case("compare_logprobs.padded", lambda c: compare_logprobs(_padded_logprobs(c.training, c.logp, 8), _padded_logprobs(c.training, c.logp + 1e-3, 9),
                                                               c.training, c.training), Returns(_check_padded_compare)),
    Case("compare_logprobs.padded_vs_flat", lambda c: compare_logprobs(_padded_logprobs(c.training, c.logp, 6), c.logp, c.training, c.training),
         Returns(_check_compare(True, 0.0))),
    Case("compare_logprobs.both_minus_inf", lambda c: compare_logprobs(*[torch.where(torch.arange(c.n) == 3, -math.inf, c.logp)] * 2, c.training, c.training),
         Returns(_check_compare(True, 0.0))),
    Case("compare_logprobs.one_minus_inf", lambda c: compare_logprobs(torch.where(torch.arange(c.n) == 3, -math.inf, c.logp), c.logp, c.training, c.training),
         Returns(lambda r, c: (not r.ok and r.first_beyond["position"] == 51 and r.max_abs == math.inf) or _fail(r))),
    Case("matmul.empty_k", lambda c: M.matmul(torch.ones(3, 0), torch.ones(0, 2), torch.ones(2)), Returns(_same(torch.ones(3, 2)))),
    Case("matmul.nan_row", lambda c: M.matmul(torch.tensor([[math.nan, 1.0], [1.0, 2.0]]), torch.ones(2, 2)),
         Returns(lambda r, c: bool(r[0].isnan().all()) and r[1].tolist() == [3.0, 3.0] or _fail(r))),
    Case("segment_attention.uncovered_rows_zero", lambda c: A.segment_attention(*c.qkv, _seg([0], [2], [3], [0], [5]), causal=True, scale=1.0, max_q=3),
         Returns(lambda r, c: bool((r[0, :2] == 0).all() and (r[0, 5:] == 0).all()) or _fail(r))),
    Case("draw_layout.empty_batch", lambda c: draw_layout(c.batch.select([]), c.tmp / "empty.png"), Returns(lambda r, c: r.exists() or _fail(r))),
    Case("draw_layout.tensor_samples", lambda c: draw_layout(c.batch, c.tmp / "t.png", samples=torch.tensor([2, 0])), Returns(lambda r, c: r.exists() or _fail(r))),
    Case("InvarianceReport.empty.invariant", lambda c: InvarianceReport([], {}).invariant, Returns(lambda r, c: r is False or _fail(r))),
    Case("cli.parity.offline_decode", _cli("parity", DRIFT, TRAINING), Exits(1, r"'<\|vision_start\|>' '<\|image_pad\|>' \['<\|image_pad\|>'\]")),
    Case("cli.parity.debug_flag", _cli("parity", TRAINING, TRAINING, "--debug"), Exits(0, r"layout parity OK")),
]


def _fail(result):
    raise AssertionError(f"unexpected result {result!r:.200}")


def _batches_equal(a: RLBatch, b: RLBatch) -> bool:
    for name in RLBatch.model_fields:
        x, y = getattr(a, name), getattr(b, name)
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else (x.equal(y) if hasattr(x, "equal") else x == y)
        assert same, name
    return True


@pytest.mark.parametrize("case", BAD + GOOD, ids=lambda case: case.id)
def test_adversarial_input(case, ctx):
    kind, detail = classify(case, ctx)
    assert kind == "well", f"{kind}: {case.id}: {detail}"


# ============================================================ properties
SETTINGS = dict(deadline=None, max_examples=40)


@settings(**SETTINGS)
@given(st.integers(0, 4), st.integers(0, 6), st.data())
def test_pack_padded_refuses_every_broken_mask(B, L, data):
    """A mask of -1/0/1/2 entries: packed like the oracle when every row is one run of ones,
    else an error at the first value other than 0/1, or else at the first hole."""
    values = data.draw(st.lists(st.sampled_from([0, 0, 1, 1, 1, 2, -1]), min_size=B * L, max_size=B * L))
    mask = torch.tensor(values, dtype=torch.int64).reshape(B, L)
    x = torch.arange(B * L * 2, dtype=torch.float32).reshape(B, L, 2)
    odd = [(b, p) for b in range(B) for p in range(L) if mask[b, p] not in (0, 1)]
    holes = []
    for b in range(B):
        ones = [p for p in range(L) if mask[b, p] != 0]
        holes += [(b, p) for p in range(L) if ones and ones[0] <= p < ones[-1] and mask[b, p] == 0][:1]
    if odd:
        b, p = odd[0]
        with pytest.raises(ValueError, match=rf"mask: sample {b}, position {p} holds {int(mask[b, p])}"):
            pack_padded(x, mask)
    elif holes:
        with pytest.raises(ValueError, match=rf"mask: sample {holes[0][0]} has a hole at position {holes[0][1]}"):
            pack_padded(x, mask)
    else:
        packed, cu = pack_padded(x, mask)
        want, want_cu = oracle.pack_padded(x, mask)
        assert torch.equal(packed, want) and torch.equal(cu, want_cu)


@settings(**SETTINGS)
@given(st.integers(0, 4), st.integers(0, 5), st.data())
def test_unpack_to_padded_refuses_every_broken_cu_seqlens(B, L, data):
    """Random offsets: the oracle's result when they run from 0 to T without decreasing and
    no sample is longer than L, else the first broken rule, named."""
    T = data.draw(st.integers(0, 8))
    cu = [0] + data.draw(st.lists(st.integers(-1, T + 1), min_size=B, max_size=B))
    if data.draw(st.booleans()):  # often a valid one
        cu = [0] + sorted(data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
        cu[-1] = T if B else 0
    packed = torch.arange(T, dtype=torch.float32)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if cu[-1] != T:
        error = rf"cu_seqlens must run from 0 to the packed row count {T}"
    elif any(n < 0 for n in lengths):
        error = rf"cu_seqlens decreases at sample {next(i for i, n in enumerate(lengths) if n < 0)}"
    elif any(n > L for n in lengths):
        b = next(i for i, n in enumerate(lengths) if n > L)
        error = rf"cu_seqlens: sample {b} has {lengths[b]} rows, more than the padded length {L}"
    else:
        error = None
    side = data.draw(st.sampled_from(["left", "right"]))
    if error:
        with pytest.raises(ValueError, match=error):
            unpack_to_padded(packed, torch.tensor(cu), L, side, fill=-1)
    else:
        starts = [0 if side == "right" else L - n for n in lengths]
        got = unpack_to_padded(packed, torch.tensor(cu), L, side, fill=-1)
        assert torch.equal(got, oracle.unpack_to_padded(packed, torch.tensor(cu, dtype=torch.int32), L, starts, fill=-1))


@settings(**SETTINGS)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=5))
def test_unpack_needs_each_pack_of_one_call_once(ctx, picks):
    """Any selection of the 3 packs of one call (one sample each) and the first pack of
    another call: the batch back (and the values) when it is each pack of one call once, in
    any order, else an error naming the mix of calls or the first sample held other than once."""
    packs = [(ctx.packs + ctx.twin_packs[:1])[i] for i in picks]
    values = [torch.arange(p.num_tokens, dtype=torch.float32) for p in packs]
    counts = [sum(1 for i in picks if i % 3 == b) for b in range(3)]  # pick 3 holds the other call's sample 0
    if not picks:
        with pytest.raises(TypeError, match="non-empty list"):
            unpack(packs)
    elif 3 in picks and len(set(picks)) > 1:
        with pytest.raises(ValueError, match=r"packs of different pack\(\) calls"):
            unpack(packs, values)
    elif counts != [1, 1, 1]:
        first = next(b for b, k in enumerate(counts) if k != 1)
        with pytest.raises(ValueError, match=rf"the packs hold sample {first} {counts[first]} times"):
            unpack(packs)
    else:
        assert _batches_equal(unpack(packs), ctx.batch)
        assert torch.equal(unpack(packs, values), unpack(ctx.packs, [values[picks.index(i)] for i in range(3)]))


@settings(**SETTINGS)
@given(st.lists(st.tuples(st.integers(-1, 2), st.integers(-1, 9), st.integers(-1, 9), st.integers(-1, 9), st.integers(-1, 9)),
                min_size=1, max_size=3), st.booleans(), st.integers(0, 10))
def test_segment_attention_refuses_every_broken_segment(rows, causal, max_q):
    """Random segments over q [2, 2, 8, 8], k/v [2, 1, 8, 8]: refused exactly when a segment
    leaves q or k, is negative, exceeds max_q, lacks keys or overlaps another."""
    q = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    k = q[:, :1]
    b, q0, ql, k0, kl = (list(c) for c in zip(*rows))
    n = len(rows)
    covered = [(b[i], r) for i in range(n) if ql[i] > 0 for r in range(q0[i], q0[i] + ql[i])]
    broken = (any(min(r) < 0 for r in rows) or any(b[i] >= 2 or q0[i] + ql[i] > 8 or k0[i] + kl[i] > 8 or ql[i] > max_q for i in range(n))
              or any((kl[i] < ql[i]) if causal else (ql[i] > 0 and kl[i] == 0) for i in range(n))
              or len(covered) != len(set(covered)))
    segments = _seg(b, q0, ql, k0, kl)
    if broken:
        with pytest.raises(ValueError, match="segment"):
            A.segment_attention(q, k, k, segments, causal=causal, scale=0.3, max_q=max_q)
    else:
        out = A.segment_attention(q, k, k, segments, causal=causal, scale=0.3, max_q=max_q)
        assert bool(torch.isfinite(out).all())
        written = torch.zeros(2, 8, dtype=torch.bool)
        for bb, r in covered:
            written[bb, r] = True
        assert bool((out[~written] == 0).all())  # rows of no segment stay zero


@settings(**SETTINGS)
@given(st.integers(6, 9), st.sampled_from([0.0, math.nan, math.inf, -math.inf, 7.0]), st.data())
def test_compare_logprobs_reads_only_the_response_columns(ctx, R, pad, data):
    """Padded [B, R] log-probs give the flat comparison whatever the padding holds."""
    drift = torch.tensor(data.draw(st.lists(st.floats(-0.1, 0.0), min_size=ctx.n, max_size=ctx.n)), dtype=torch.float64)
    other = ctx.logp + drift
    padded = compare_logprobs(_padded_logprobs(ctx.training, ctx.logp, R, pad), _padded_logprobs(ctx.training, other, 9, pad),
                              ctx.training, ctx.training)
    assert padded.to_dict() == compare_logprobs(ctx.logp, other, ctx.training, ctx.training).to_dict()
