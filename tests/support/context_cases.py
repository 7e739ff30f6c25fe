"""The input tables whose calls take a context of real inputs (packing, the model runners, the
batch-invariant kernels, parity, the layout picture and the command line: tests/ops/test_pack.py and
tests/*/test_*_inputs.py), tried as a new user would.

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
failures count the defects by class. ``make_context`` builds the inputs the cases share
(conftest.py's module-scoped ``input_context`` fixture).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from rlk_mm import RLBatch, fixtures
from rlk_mm.ops.packed_batch import pack
from rlk_mm.ops.padded import pack_padded
from support.helpers import raised_by_rlk_mm

__all__ = [
    "DRIFT", "PIXEL_DIM", "TRAINING", "Case", "Ctx", "Exits", "Raises", "Returns", "assert_well", "classify",
    "equal_nan", "fail", "make_context", "make_schema_context", "rewritten", "same", "tally",
]

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "parity"
TRAINING = str(FIXTURES / "training.safetensors")
DRIFT = str(FIXTURES / "missing_mm_token_type_ids.rollout.safetensors")
PIXEL_DIM = 3 * 2 * 14 * 14  # channels x temporal patch x patch²: one vision-tower input row


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
        return ("unclear" if raised_by_rlk_mm(e) else "crash"), f"{type(e).__name__}: {str(e)[:300]}"
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
        seen = "printed" if not want.traceback else "missing"
        return "crash" if not want.traceback else "unclear", f"traceback {seen}: {text[-300:]}"
    if not re.search(want.words, text):
        return ("silent" if want.code in (0, 1) else "unclear"), f"output does not match {want.words!r}: {text[-400:]}"
    return "well", ""


# ============================================================ shared inputs
class Ctx:
    """The real inputs the cases share (built once per module)."""


def make_context(processor, model, other_model, tmp: Path) -> Ctx:
    """The shared inputs: ``model`` must stay unchanged, ``other_model`` may be changed (hooks),
    ``tmp`` is a folder for the files the cases write."""
    c = Ctx()
    c.processor, c.model, c.other_model = processor, model, other_model
    c.tmp = tmp
    c.batch = RLBatch.from_token_lists([[1, 2, 3], list(range(10, 41)), [4, 5]], [[6], [7, 8], [9]],
                                       processor=processor)
    c.twin = RLBatch.from_token_lists([[11, 12, 13], list(range(50, 81)), [14, 15]], [[16], [17, 18], [19]],
                                      processor=processor)
    c.packs = pack(c.batch, max_tokens_per_pack=33)
    c.twin_packs = pack(c.twin, max_tokens_per_pack=33)
    c.values = [torch.arange(p.num_tokens, dtype=torch.float32) for p in c.packs]
    c.x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0))
    c.mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    c.packed, c.cu = pack_padded(c.x, c.mask)
    samples = fixtures.synthetic_image_text(2, seed=0, max_images=1, sizes=((56, 56),))
    out = fixtures.processor_inputs(processor, samples)
    c.image_batch = RLBatch.from_qwen_vl(out, processor=processor, responses=[[5, 151645], [6, 7, 151645]],
                                         group_ids=["g", "h"])
    one = {"image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])}
    image_prompt = [fixtures.VISION_START_TOKEN_ID, fixtures.IMAGE_TOKEN_ID, fixtures.VISION_END_TOKEN_ID, 9]
    c.no_pixels = RLBatch.from_token_lists([image_prompt, image_prompt], [[5], [6]], processor=processor,
                                           media_cache_keys=["a", "b"], **one)
    g = torch.Generator().manual_seed(1)
    two_images = RLBatch.from_token_lists([image_prompt, image_prompt], [[5], [6]], processor=processor,
                                          pixel_values=torch.randn(8, PIXEL_DIM, generator=g), **one)
    # one key over two different images, as a framework with its own keys might write (the builders refuse it)
    c.same_key = RLBatch.model_construct(**{**dict(two_images), "media_cache_keys": ["k", "k"]})
    c.key_small = RLBatch.from_token_lists([image_prompt], [[5]], processor=processor, media_cache_keys=["k"],
                                           image_grid_thw=torch.tensor([[1, 2, 2]]),
                                           pixel_values=torch.randn(4, PIXEL_DIM, generator=g))
    big_prompt = [fixtures.VISION_START_TOKEN_ID] + [fixtures.IMAGE_TOKEN_ID] * 4 + [fixtures.VISION_END_TOKEN_ID, 9]
    c.key_big = RLBatch.from_token_lists([big_prompt], [[5]], processor=processor, media_cache_keys=["k"],
                                         image_grid_thw=torch.tensor([[1, 4, 4]]),
                                         pixel_values=torch.randn(16, PIXEL_DIM, generator=g))
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


def make_schema_context(processor, tmp: Path) -> Ctx:
    """The inputs of the schema and grounding tables (tests/schema, tests/grounding), built from the
    real processor alone: ``batch``, a GRPO batch of three image samples (samples 0 and 1 answer one
    prompt and share its 56x56 image and cache key; sample 2 has an 84x56 image of grid [1, 4, 6]) with
    groups, rewards and costs, saved at ``path`` (``out``: the processor's output, ``prompts``: its
    unpadded prompts); ``verl``, verl's tensors of two text samples (a
    left-padded prompt, a right-padded response) for ``RLBatch.from_verl``."""
    from rlk_mm.fixtures import IM_END_TOKEN_ID, processor_inputs, synthetic_image_text

    c = Ctx()
    c.processor, c.tmp = processor, tmp
    square = synthetic_image_text(1, seed=11, max_images=1, sizes=((56, 56),))[0]
    wide = synthetic_image_text(1, seed=12, max_images=1, sizes=((84, 56),))[0]
    c.out = processor_inputs(processor, [square, square, wide])
    c.responses = [[5, IM_END_TOKEN_ID], [6, 7, IM_END_TOKEN_ID], [8, IM_END_TOKEN_ID]]
    c.batch = RLBatch.from_qwen_vl(c.out, processor=processor, responses=c.responses, group_ids=["g", "g", "h"],
                                   rewards=[1.0, 0.0, 0.5], costs=[0.25, 0.0, 1.5])
    c.path = c.batch.save(tmp / "batch.safetensors")
    c.prompts = [c.out["input_ids"][b][c.out["attention_mask"][b].bool()].tolist() for b in range(3)]
    pad = processor.tokenizer.pad_token_id
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, IM_END_TOKEN_ID], [7]]
    ids = torch.full((2, 5), pad)
    attention = torch.zeros(2, 5, dtype=torch.int64)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, 3 - len(p) : 3], ids[b, 3 : 3 + len(r)] = torch.tensor(p), torch.tensor(r)
        attention[b, 3 - len(p) : 3 + len(r)] = 1
    c.verl = dict(input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0),
                  responses=ids[:, 3:], processor=processor)
    c.verl_lists = (prompts, responses)
    return c


def rewritten(c, name: str, fields=None, identity=None, tensors=None, drop: tuple = (), source=None) -> Path:
    """A copy ``name`` of the saved batch file ``source`` (default ``c.path``) edited in place by
    ``fields(values)`` (its JSON fields), ``identity(record)`` (its identity record) and
    ``tensors(tensors)``, with the metadata entries ``drop`` left out: a file changed after
    ``RLBatch.save``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(source or c.path), framework="pt") as f:
        meta, values = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    for key, edit in (("fields", fields), ("identity", identity)):
        if edit is not None:
            record = json.loads(meta[key])
            edit(record)
            meta[key] = json.dumps(record)
    if tensors is not None:
        tensors(values)
    path = c.tmp / name
    save_file(values, str(path), metadata={k: v for k, v in meta.items() if k not in drop})
    return path


def tally(cases, ctx) -> dict[str, int]:
    """How many of ``cases`` behave well, silently wrong, crash or unclear (``classify``)."""
    counts = {"well": 0, "silent": 0, "crash": 0, "unclear": 0}
    for case in cases:
        counts[classify(case, ctx)[0]] += 1
    return counts


def assert_well(case: Case, ctx) -> None:
    """The case behaves well; else it fails with its class first."""
    kind, detail = classify(case, ctx)
    assert kind == "well", f"{kind}: {case.id}: {detail}"


def same(want):
    def check(result, c):
        got = result if isinstance(result, torch.Tensor) else result[0]
        assert torch.equal(got, want(c) if callable(want) else want), f"{got} != expected"

    return check


def equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def fail(result):
    raise AssertionError(f"unexpected result {result!r:.200}")
