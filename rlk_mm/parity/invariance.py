"""Invariance sweep: the same samples scored every way a trainer batches, pads, packs or
caches them, or decodes them step by step; bitwise equal or not, by how much, and, where not, which layer drifts first.

``invariance_sweep(model, processor, samples)`` builds RLBatches with the real processor,
scores each sample's response tokens (selected log-probs, or the hidden states that feed
the LM head) under ``batch_invariant()`` and, as a control, under the model's default
kernels, and compares pairs of runs that must agree: each entry of ``CASES`` names the
runs it compares. When a pair differs, a probe re-runs both with forward hooks, keeps the
rows of the first differing sample at every vision and language module, and names the
first module (in execution order, so the innermost op) whose output differs.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..models.decode import decode_hidden
from ..models.family import check_processor_family, model_family
from ..models.forward import prompt_lengths
from ..ops.invariant.mode import BACKENDS, batch_invariant
from ..ops.logprob import selected_logprob
from ..schema import Choice, PaddingSide, RLBatch
from ..schema.checks import bool_arg, int_arg, sequence_arg
from ..schema.video import VideoLayout
from ._probe import Run, Views, first_divergence, forward_run, forward_views, group_run, vision_cache_run
from .invariance_report import CaseResult, InvarianceReport, Mode

__all__ = ["invariance_sweep"]


class Score(Choice):
    """What a sweep compares."""

    LOGPROB = "logprob"  # selected log-probs through the LM head
    HIDDEN = "hidden"  # the hidden states that feed the LM head


MODES = tuple(m.value for m in Mode)


# --------------------------------------------------------------------------- building batches


@dataclass(frozen=True)
class _Item:
    """A sample (anything with messages / images / videos, like fixtures.Sample) and its response."""

    sample: object
    response: tuple[int, ...]


def _batch(processor, items: list[_Item], device, *, padding_side: str = "right", group_ids=None) -> RLBatch:
    texts = [processor.apply_chat_template(it.sample.messages, tokenize=False, add_generation_prompt=True) for it in items]
    images = [im for it in items for im in getattr(it.sample, "images", [])]
    videos = [v for it in items for v in getattr(it.sample, "videos", [])]
    out = processor(text=texts, images=images or None, videos=videos or None, padding=True,
                    padding_side=padding_side, return_tensors="pt")
    batch = RLBatch.from_qwen_vl(out, processor=processor, responses=[list(it.response) for it in items],
                                 group_ids=group_ids)
    return batch.to(device)


@dataclass(frozen=True)
class _Neighbour:
    id: str
    messages: list
    images: list
    videos: tuple = ()


def _neighbour(samples, k: int, skip: int) -> _Neighbour:
    """A prompt with k images taken (cyclically) from the other samples' images."""
    pool = [im for i, s in enumerate(samples) if i != skip for im in s.images] or list(samples[skip].images)
    if not pool:
        raise ValueError("neighbour_images needs samples with images")
    images = [pool[j % len(pool)] for j in range(k)]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": f"Describe these {k} images."}]
    return _Neighbour(f"neighbour-{k}", [{"role": "user", "content": content}], images)


def _responses(n: int, length: int, seed: int, eos: int, vocab: int = 150000) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(0, vocab) for _ in range(max(0, length - 1))) + (eos,) for _ in range(n)]


# --------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class _RunRef:
    """A run by name (the memo key of its scores) and how to make it."""

    key: str
    make: Callable[[], Run]


#: one compared sample: (reference run, its sample, case run, its sample)
_Pair = tuple[_RunRef, int, _RunRef, int]


class _Runs:
    """The runs a sweep's cases compare, by name: the samples alone, batched, reversed, left
    padded, packed, next to neighbours, re-processed, cached, and one GRPO group."""

    def __init__(self, model, processor, device, samples, items: list[_Item], group_items: list[_Item]):
        self.model, self.samples, self.items, self.group_items = model, samples, items, group_items
        self.n, self.group_size = len(items), len(group_items)
        self.build = lambda case_items, **kw: _batch(processor, case_items, device, **kw)

    def forward(self, key: str, items: list[_Item], padding: PaddingSide | str | None, **build) -> _RunRef:
        return _RunRef(key, lambda: forward_run(self.model, self.build(items, **build), padding))

    def alone(self, i: int) -> _RunRef:
        return self.forward(f"alone{i}", [self.items[i]], "right")

    @property
    def batched(self) -> _RunRef:
        return self.forward("right", self.items, "right")

    def group(self, key: str, run: Callable) -> _RunRef:
        group_ids = ["g"] * self.group_size
        return _RunRef(key, lambda: run(self.model, self.build(self.group_items, group_ids=group_ids)))

    @property
    def group_full(self) -> _RunRef:
        return self.group("group_full", lambda model, batch: forward_run(model, batch, "right"))


def _each(ref: _RunRef, case: _RunRef, n: int, reverse: bool = False) -> list[_Pair]:
    return [(ref, i, case, n - 1 - i if reverse else i) for i in range(n)]


def _batch_size(r: _Runs):
    return [(f"1 vs {r.n}", [(r.alone(i), 0, r.batched, i) for i in range(r.n)])]


def _position(r: _Runs):
    return [(f"{r.n} reversed", _each(r.batched, r.forward("reversed", r.items[::-1], "right"), r.n, reverse=True))]


def _padding_side(r: _Runs):
    return [("right vs left", _each(r.batched, r.forward("left", r.items, "left", padding_side="left"), r.n))]


def _packed(r: _Runs):
    return [("right vs packed", _each(r.batched, r.forward("packed", r.items, None), r.n))]


def _neighbour_images(r: _Runs):
    out = []
    for k in (1, 2, 3):
        neighbour = _Item(_neighbour(r.samples, k, 0), r.items[1].response)
        pair = r.forward(f"nb{k}", [r.items[0], neighbour], "right")
        out.append((f"{k} image{'s' if k > 1 else ''}", [(r.alone(0), 0, pair, 0)]))
    return out


def _processor_cache(r: _Runs):
    return [("cached vs re-run", _each(r.batched, r.forward("fresh", r.items, "right"), r.n))]


def _vision_cache(r: _Runs):
    return [(f"G={r.group_size}", _each(r.group_full, r.group("group_vc", vision_cache_run), r.group_size))]


def _prefix_cache(r: _Runs):
    pairs = [(r.alone(i), 0, _RunRef(f"prefix{i}", lambda i=i: group_run(r.model, r.build([r.items[i]]))), 0)
             for i in range(r.n)]
    return [("off vs on", pairs)]


def _group_cache(r: _Runs):
    return [(f"G={r.group_size}", _each(r.group_full, r.group("group_cached", group_run), r.group_size))]


def _frames_run(model, batch: RLBatch) -> Run:
    """Videos through the tower frame by frame: ``VideoLayout.frame_batch`` into ``VisionCache``."""
    return vision_cache_run(model, batch, media=VideoLayout(batch).frame_batch())


def _video_frames(r: _Runs):
    items = [it for it in r.items if getattr(it.sample, "videos", None)]
    whole = _RunRef("video_whole", lambda: vision_cache_run(r.model, r.build(items)))
    frames = _RunRef("video_frames", lambda: _frames_run(r.model, r.build(items)))
    return [(f"{len(items)} with video", _each(whole, frames, len(items)))]


def _decode_run(model, batch: RLBatch) -> Run:
    """``decode_hidden``: the prompts prefilled into a KV cache, then one token a step."""
    rows, _ = batch.loss_token_index()
    prompt = prompt_lengths(batch)
    cu = batch.cu_seqlens.long().tolist()
    tail = [cu[b + 1] - cu[b] - p for b, p in enumerate(prompt)]
    width, n = max(prompt), batch.num_samples

    def views(s):
        whole = forward_views(batch, None, s)
        text = [(n, width, s * width + width - prompt[s] + torch.arange(prompt[s]))]
        for j in range(tail[s]):  # the calls after the sample's last token are not looked at
            live = [b for b in range(n) if tail[b] > j]
            text.append((len(live), 1, torch.tensor([live.index(s)])))
        return Views(whole.vision, text, whole.merge)

    return Run(batch, lambda: decode_hidden(model, batch)[rows], views)


def _decode(r: _Runs):
    """Responses of different lengths (rows leave the decode at different steps)."""
    items = [_Item(it.sample, it.response[min(i, len(it.response) - 1):]) for i, it in enumerate(r.items)]
    one_pass = r.forward("decode_one_pass", items, "right")
    decoded = _RunRef("decode_steps", lambda: _decode_run(r.model, r.build(items)))
    return [("one pass vs KV-cache decode", _each(one_pass, decoded, r.n))]


@dataclass(frozen=True)
class Case:
    """An invariance case: what it compares, and the pairs of runs it compares (by detail)."""

    description: str
    comparisons: Callable[[_Runs], list[tuple[str, list[_Pair]]]]


CASES = {
    "batch_size": Case("each sample alone vs all samples in one batch (right padding)", _batch_size),
    "position": Case("batch in order vs reversed", _position),
    "padding_side": Case("right padding vs left padding", _padding_side),
    "packed": Case("right padding vs packed (one row, block-diagonal attention)", _packed),
    "neighbour_images": Case("first sample alone vs next to a neighbour with 1, 2, 3 images", _neighbour_images),
    "processor_cache": Case("pixel values from the first processor call vs re-computed", _processor_cache),
    "vision_cache": Case("vision tower inside the forward vs VisionCache (one pass per media key)", _vision_cache),
    "prefix_cache": Case("one forward vs prompt prefilled into a KV cache, then the response", _prefix_cache),
    "group_cache": Case("a GRPO group scored in full vs media-prefix cache (vision once, prompt KV once)", _group_cache),
    "decode": Case("one forward vs KV-cache decode (prompts of different lengths prefilled left-padded, then one "
                   "token a step, rows leaving as their responses end)", _decode),
    "video_frames": Case("videos through the vision tower whole vs frame by frame (VideoLayout.frame_batch, each distinct "
                         "frame once)", _video_frames),
}
VIDEO_CASES = ("video_frames",)
"""Cases that need samples with videos (left out of a sweep of all cases when none has one)."""


# --------------------------------------------------------------------------- the sweep


def _cases_arg(cases, samples) -> list[str]:
    """The cases to run, in registry order (None: all that apply to the samples)."""
    has_videos = any(getattr(s, "videos", None) for s in samples)
    if cases is None:
        return [c for c in CASES if has_videos or c not in VIDEO_CASES]
    cases = sequence_arg("cases", cases, "case names (e.g. ['packed'])")
    if not cases:
        raise ValueError(f"cases is empty: name at least one of {list(CASES)} (or None for all)")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"unknown invariance cases {unknown}; choose from {list(CASES)}")
    if "neighbour_images" in cases and not any(getattr(s, "images", None) for s in samples):
        raise ValueError("neighbour_images needs samples with images (it puts other samples' images next to the first)")
    if not has_videos and any(c in VIDEO_CASES for c in cases):
        raise ValueError(f"{[c for c in cases if c in VIDEO_CASES]} need samples with videos (e.g. fixtures.synthetic_video_text)")
    return [c for c in CASES if c in cases]


def _finite(scores: list[torch.Tensor], run: str, mode: Mode) -> list[torch.Tensor]:
    """``scores`` (per sample), after checking that they are finite."""
    for b, values in enumerate(scores):
        bad = ~torch.isfinite(values)
        if bool(bad.any()):
            k = int(torch.nonzero(bad)[0][0])
            raise ValueError(f"run {run!r} ({mode.value} kernels): sample {b}, loss token {k}: the model's scores are not finite "
                             f"({float(values[bad][0])}); check the model's weights and dtype")
    return scores


def invariance_sweep(
    model,
    processor,
    samples,
    *,
    cases=None,
    control: bool = True,
    backend: Optional[str] = None,
    score: str = "logprob",
    response_length: int = 8,
    group_size: int = 4,
    probe: bool = True,
    seed: int = 0,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> InvarianceReport:
    """Score ``samples`` (objects with ``messages``, ``images``, ``videos``, like
    ``fixtures.Sample``) under every case of ``CASES`` (or those named in ``cases``), under
    ``batch_invariant(backend)`` and, with ``control``, under the model's default kernels.

    Responses are seeded random token ids of ``response_length`` (>= 1) ending with EOS (the
    sweep is about numerics, not text). ``score``: ``"logprob"`` (selected log-probs through
    the LM head) or ``"hidden"`` (the hidden states that feed it). A case is bitwise when
    every compared sample's scores are ``torch.equal``. Every argument is checked before the
    first forward; a run whose scores are not finite raises (naming the run, sample and
    token): a drift between NaNs would be no measurement. ``progress``, if given, is called as
    ``progress(done, total, what)`` after each case of each mode (``rlk-mm invariance`` draws its bar so).
    """
    family = model_family(model)
    if not callable(getattr(processor, "apply_chat_template", None)) or not callable(processor):
        raise TypeError(f"processor must be the model's {family.label} processor (e.g. its AutoProcessor), got "
                        f"{type(processor).__name__}")
    check_processor_family(family, processor)
    samples = sequence_arg("samples", samples, "samples (objects with messages, images and videos, like fixtures.Sample)")
    for i, sample in enumerate(samples):
        if not hasattr(sample, "messages"):
            raise TypeError(f"samples[{i}] is a {type(sample).__name__} with no messages: samples are objects with messages, "
                            "images and videos, like rlk_mm.fixtures.Sample")
    if len(samples) < 2:
        raise ValueError("invariance_sweep needs at least 2 samples")
    cases = _cases_arg(cases, samples)
    try:
        score = Score(score)
    except ValueError:
        raise ValueError(f"score must be 'logprob' or 'hidden', got {score!r}") from None
    control, probe = bool_arg("control", control), bool_arg("probe", probe)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'torch' or 'triton', got {backend!r}")
    response_length = int_arg("response_length", response_length, min=1)
    group_size = int_arg("group_size", group_size, min=1)
    seed = int_arg("seed", seed)
    device = next(model.parameters()).device
    eos = int(getattr(model.config.text_config, "eos_token_id", None) or 0)
    items = [_Item(s, r) for s, r in zip(samples, _responses(len(samples), response_length, seed, eos))]
    group_items = [_Item(samples[0], r) for r in _responses(group_size, response_length, seed + 1, eos)]
    head = model.get_output_embeddings()

    def scores(run: Run) -> list[torch.Tensor]:
        hidden = run.execute()
        _, targets = run.batch.loss_token_index()
        if score is Score.LOGPROB:
            values = selected_logprob(hidden, head.weight, index=torch.arange(targets.numel(), device=hidden.device),
                                      targets=targets, bias=getattr(head, "bias", None))
        else:
            values = hidden
        owner = run.batch.loss_token_sample()
        return [values[owner == b].detach().float().cpu() for b in range(run.batch.num_samples)]

    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable (done, total, what) or None, got {type(progress).__name__}")
    results: list[CaseResult] = []
    runs = _Runs(model, processor, device, samples, items, group_items)
    modes = [Mode.BATCH_INVARIANT] + ([Mode.DEFAULT] if control else [])
    done = 0
    for mode in modes:
        ctx = batch_invariant(backend) if mode is Mode.BATCH_INVARIANT else contextlib.nullcontext()
        with ctx, torch.no_grad():
            memo: dict[str, tuple[Run, list[torch.Tensor]]] = {}

            def get(ref: _RunRef):
                if ref.key not in memo:
                    run = ref.make()
                    memo[ref.key] = (run, _finite(scores(run), ref.key, mode))
                return memo[ref.key]

            for case in cases:
                for detail, pairs in CASES[case].comparisons(runs):
                    worst, tokens, first_bad = 0.0, 0, None
                    for ref, ref_sample, other, other_sample in pairs:
                        ref_run, ref_scores = get(ref)
                        case_run, case_scores = get(other)
                        x, y = ref_scores[ref_sample], case_scores[other_sample]
                        tokens += x.shape[0]
                        if x.shape != y.shape:
                            raise RuntimeError(f"{case}: sample {ref_sample} scored {x.numel()} vs {y.numel()} tokens")
                        if not torch.equal(x, y):
                            diff = float((x - y).abs().max())
                            worst = max(worst, diff)
                            if first_bad is None:
                                first_bad = (ref_run, case_run, ref_sample, other_sample, diff)
                    divergence = first_divergence(model, *first_bad) if first_bad is not None and probe else None
                    results.append(CaseResult(case, detail, mode.value, first_bad is None, worst, tokens, divergence))
                done += 1
                if progress is not None:
                    progress(done, len(modes) * len(cases), f"{mode.value} {case}")
    meta = {
        "model": type(model).__name__,
        "config": {"hidden_size": model.config.text_config.hidden_size, "layers": model.config.text_config.num_hidden_layers,
                   "vision_depth": model.config.vision_config.depth},
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "backend": backend or "auto",
        "score": score.value,
        "samples": len(samples),
        "response_length": response_length,
        "group_size": group_size,
        "torch": torch.__version__,
        "module_order": [n for n, _ in model.named_modules()],
    }
    return InvarianceReport(results, meta)
