"""Invariance sweep: the same samples scored every way a trainer batches, pads, packs or
caches them; bitwise equal or not, by how much, and, where not, which layer drifts first.

``invariance_sweep(model, processor, samples)`` builds RLBatches with the real processor,
scores each sample's response tokens (selected log-probs, or the hidden states that feed
the LM head) under ``batch_invariant()`` and, as a control, under the model's default
kernels, and compares pairs of runs that must agree (see ``CASES``). When a pair differs,
a probe re-runs both with forward hooks, keeps the rows of the first differing sample at
every vision and language module, and names the first module (in execution order, so the
innermost op) whose output differs.
"""

from __future__ import annotations

import contextlib
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from ..models.qwen2_5_vl import VisionCache, forward_hidden, group_hidden, layout_inputs, prompt_lengths
from ..ops.invariant.mode import batch_invariant
from ..ops.logprob import selected_logprob
from ..schema import RLBatch

CASES = {
    "batch_size": "each sample alone vs all samples in one batch (right padding)",
    "position": "batch in order vs reversed",
    "padding_side": "right padding vs left padding",
    "packed": "right padding vs packed (one row, block-diagonal attention)",
    "neighbour_images": "first sample alone vs next to a neighbour with 1, 2, 3 images",
    "processor_cache": "pixel values from the first processor call vs re-computed",
    "vision_cache": "vision tower inside the forward vs VisionCache (one pass per media key)",
    "prefix_cache": "one forward vs prompt prefilled into a KV cache, then the response",
    "group_cache": "a GRPO group scored in full vs media-prefix cache (vision once, prompt KV once)",
}
MODES = ("batch_invariant", "default")


@dataclass
class Divergence:
    """Where two runs first differ for one sample."""

    sample: int
    module: str  # e.g. "model.language_model.layers.0.self_attn.q_proj"; "lm_head" when only scores differ
    op: str  # the module's class, e.g. "Linear"
    max_abs_diff: float
    order: int  # index of the module in model.named_modules() (len of it for the LM head)
    modules_compared: int


@dataclass
class CaseResult:
    case: str
    detail: str
    mode: str  # "batch_invariant" or "default"
    bitwise: bool
    max_abs_diff: float
    tokens: int
    divergence: Optional[Divergence] = None


@dataclass
class InvarianceReport:
    results: list[CaseResult]
    meta: dict = field(default_factory=dict)

    @property
    def invariant(self) -> bool:
        """True when every case under batch_invariant() was bitwise equal."""
        return all(r.bitwise for r in self.results if r.mode == "batch_invariant")

    def to_dict(self) -> dict:
        return {"meta": self.meta, "invariant": self.invariant, "results": [asdict(r) for r in self.results]}

    @classmethod
    def from_dict(cls, data: dict) -> "InvarianceReport":
        """The report ``to_dict`` wrote (e.g. to re-draw a saved run's chart)."""
        results = []
        for r in data["results"]:
            r = dict(r)
            r["divergence"] = Divergence(**r["divergence"]) if r.get("divergence") else None
            results.append(CaseResult(**r))
        return cls(results, data.get("meta", {}))

    def save_json(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def table(self) -> str:
        head = f"{'case':<18} {'detail':<22} {'mode':<16} {'bitwise':<8} {'max |diff|':>11} {'tokens':>6}  drift starts at"
        lines = [head, "-" * len(head)]
        for r in self.results:
            where = "" if r.divergence is None else f"{r.divergence.module} ({r.divergence.op})"
            lines.append(f"{r.case:<18} {r.detail:<22} {r.mode:<16} {'yes' if r.bitwise else 'NO':<8} "
                         f"{r.max_abs_diff:>11.3e} {r.tokens:>6}  {where}")
        return "\n".join(lines)

    def save_png(self, path) -> Path:
        """Two panels: max |diff| per case and mode; and for drifting cases, the module where drift starts."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = sorted({(r.case, r.detail) for r in self.results}, key=lambda x: (list(CASES).index(x[0]), x[1]))
        names = [f"{c} {d}".strip() for c, d in labels]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 0.45 * len(labels) + 2.2), sharey=True)
        y = range(len(labels))
        floor = 1e-12
        for k, (mode, colour) in enumerate((("batch_invariant", "tab:green"), ("default", "tab:red"))):
            vals = []
            for key in labels:
                hit = [r for r in self.results if (r.case, r.detail) == key and r.mode == mode]
                vals.append(max(hit[0].max_abs_diff, floor) if hit else float("nan"))
            ax1.barh([i + (0.2 if k else -0.2) for i in y], vals, height=0.4, color=colour, label=mode, log=True)
        ax1.axvline(floor, color="grey", lw=0.8)
        ax1.set_yticks(list(y), names)
        ax1.invert_yaxis()
        ax1.set_xlabel(f"max |Δ| vs reference (bars at {floor:g} = bitwise equal)")
        ax1.legend(loc="lower right")
        stages = self.meta.get("module_order", [])
        for i, key in enumerate(labels):
            for r in self.results:
                if (r.case, r.detail) == key and r.divergence is not None:
                    colour = "tab:green" if r.mode == "batch_invariant" else "tab:red"
                    ax2.scatter([r.divergence.order], [i], color=colour, s=40)
                    ax2.annotate(r.divergence.module.replace("model.", ""), (r.divergence.order, i),
                                 fontsize=7, xytext=(4, 3), textcoords="offset points")
        if stages:
            starts = [j for j in range(len(stages)) if _stage(stages[j]) and (j == 0 or _stage(stages[j]) != _stage(stages[j - 1]))]
            every = max(1, len(starts) // 16)
            ticks = starts[::every] + [len(stages)]
            ax2.set_xticks(ticks, [_stage(stages[j]) for j in ticks[:-1]] + ["LM head"], rotation=45, ha="right", fontsize=7)
            ax2.set_xlim(-1, len(stages) + 2)
        ax2.set_xlabel("first module whose output differs (execution order)")
        ax2.set_title("where drift starts")
        fig.suptitle(f"invariance sweep: {self.meta.get('model', '')} {self.meta.get('device', '')} "
                     f"{self.meta.get('dtype', '')}, score={self.meta.get('score', '')}")
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _stage(name: str) -> str:
    """A coarse label of where a module sits (vision block k, merger, LM layer k), or ''."""
    parts = name.split(".")
    for key, label in (("blocks", "vision block "), ("layers", "LM layer ")):
        if key in parts and parts.index(key) + 1 < len(parts):
            return label + parts[parts.index(key) + 1]
    return "merger" if "merger" in parts else ""


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


# --------------------------------------------------------------------------- runs and the probe


@dataclass
class _Views:
    """Where one sample's rows are in each tower call of a run (for the probe).

    vision: per vision-tower call, (patch rows, merged rows) of the sample's items;
    text: per language-model call, (batch, length, rows of the flattened output)."""

    vision: list[tuple[int, torch.Tensor, torch.Tensor]]
    text: list[tuple[int, int, torch.Tensor]]
    merge: int  # vision patches per merged row


@dataclass
class _Run:
    """One way of scoring a batch: ``execute()`` gives the hidden states scoring each loss token."""

    batch: RLBatch
    execute: Callable[[], torch.Tensor]
    views: Callable[[int], _Views]


def _item_rows(batch: RLBatch, items: list[int], sample: int, merge: int):
    """Patch / merged rows of ``sample``'s items when ``items`` go through the tower in this order."""
    grids = batch.media_grid_thw.long()
    patch, merged, p0 = [], [], 0
    mine = [] if batch.media_sample is None else [int(batch.media_sample[i]) == sample for i in range(batch.num_media)]
    for i in items:
        n = int(grids[i].prod())
        if mine[i]:
            patch.append(torch.arange(p0, p0 + n))
            merged.append(torch.arange(p0 // merge, (p0 + n) // merge))
        p0 += n
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)  # noqa: E731
    return p0, cat(patch), cat(merged)


def _forward_views(batch: RLBatch, layout: str, sample: int) -> _Views:
    inputs, rows = layout_inputs(batch, layout)
    shape = inputs["input_ids"].shape
    cu = batch.cu_seqlens.long().tolist()
    merge = batch.spatial_merge_size**2
    vision = []
    for kind in (1, 2):  # images, then videos: one tower call each
        items = [] if batch.media_modality is None else [i for i in range(batch.num_media) if int(batch.media_modality[i]) == kind]
        if items:
            vision.append(_item_rows(batch, items, sample, merge))
    return _Views(vision, [(shape[0], shape[1], rows[cu[sample] : cu[sample + 1]].cpu())], merge)


def _cached_views(batch: RLBatch, sample: int) -> _Views:
    """Views of ``group_hidden``: VisionCache tower calls on unique items, then per group the
    prompt call and the responses call."""
    merge = batch.spatial_merge_size**2
    vision = []
    first: dict[str, int] = {}
    for i, key in enumerate(batch.media_cache_keys):
        first.setdefault(key, i)
    for kind in (1, 2):
        uniq = [i for i in first.values() if int(batch.media_modality[i]) == kind]
        if uniq:
            total, _, _ = _item_rows(batch, uniq, sample, merge)
            mine = [i for i in range(batch.num_media) if int(batch.media_sample[i]) == sample
                    and int(batch.media_modality[i]) == kind]
            grids = batch.media_grid_thw.long()
            offsets = {}
            p0 = 0
            for i in uniq:
                offsets[i] = p0
                p0 += int(grids[i].prod())
            patch = [torch.arange(offsets[first[batch.media_cache_keys[i]]],
                                  offsets[first[batch.media_cache_keys[i]]] + int(grids[i].prod())) for i in mine]
            patch = torch.cat(patch) if patch else torch.zeros(0, dtype=torch.int64)
            merged = torch.unique_consecutive(patch // merge)
            vision.append((total, patch, merged))
    text = []
    cu = batch.cu_seqlens.long().tolist()
    group = batch.group_index().tolist()
    prompt = prompt_lengths(batch)
    for g in range(max(group) + 1):
        members = [b for b, x in enumerate(group) if x == g]
        p = prompt[members[0]]
        text.append((1, p, torch.arange(p) if sample in members else torch.zeros(0, dtype=torch.int64)))
        lengths = [cu[b + 1] - cu[b] - p for b in members]
        width = max(lengths)
        if width:
            rows = torch.zeros(0, dtype=torch.int64)
            if sample in members:
                j = members.index(sample)
                rows = j * width + torch.arange(lengths[j])
            text.append((len(members), width, rows))
    return _Views(vision, text, merge)


def _forward_run(model, batch: RLBatch, layout: str) -> _Run:
    rows, _ = batch.loss_token_index()
    return _Run(batch, lambda: forward_hidden(model, batch, layout=layout)[rows],
                lambda s: _forward_views(batch, layout, s))


def _vision_cache_run(model, batch: RLBatch) -> _Run:
    rows, _ = batch.loss_token_index()

    def execute():
        return forward_hidden(model, batch, layout="packed", media_embeds=VisionCache(model)(batch))[rows]

    def views(s):
        cached = _cached_views(batch, s)
        return _Views(cached.vision, _forward_views(batch, "packed", s).text, cached.merge)

    return _Run(batch, execute, views)


def _group_run(model, batch: RLBatch) -> _Run:
    return _Run(batch, lambda: group_hidden(model, batch), lambda s: _cached_views(batch, s))


class _Recorder:
    """Forward hooks on every module inside the vision tower and the language model, keeping
    only one sample's rows (so the probe's memory is one sample's activations)."""

    def __init__(self, model, views: _Views):
        self.views = views
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self.ops: dict[str, str] = {}
        self.calls = {"vision": -1, "text": -1}
        self.handles = []
        towers = {"vision": model.model.visual, "text": model.model.language_model}
        for tower, root in towers.items():
            self.handles.append(root.register_forward_pre_hook(self._count(tower)))
            prefix = "model.visual." if tower == "vision" else "model.language_model."
            for name, module in root.named_modules():
                if name:
                    self.handles.append(module.register_forward_hook(self._keep(tower, prefix + name)))

    def _count(self, tower):
        def hook(module, args):
            self.calls[tower] += 1
        return hook

    def _keep(self, tower, name):
        def hook(module, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if not torch.is_tensor(out):
                return
            rows = self._rows(tower, out)
            if rows is not None:
                self.outputs.setdefault(name, []).append(rows.detach().float().cpu())
                self.ops[name] = type(module).__name__
        return hook

    def _rows(self, tower, out):
        c = self.calls[tower]
        if tower == "vision":
            if c >= len(self.views.vision) or out.dim() < 1:
                return None
            total, patch, merged = self.views.vision[c]
            if out.shape[0] == total:
                return out[patch.to(out.device)]
            if out.shape[0] * self.views.merge == total:
                return out[merged.to(out.device)]
            return None
        if c >= len(self.views.text) or out.dim() < 2:
            return None
        b, length, rows = self.views.text[c]
        if tuple(out.shape[:2]) != (b, length):
            return None
        return out.reshape(b * length, *out.shape[2:])[rows.to(out.device)]

    def close(self):
        for h in self.handles:
            h.remove()

    def merged(self) -> dict[str, torch.Tensor]:
        return {k: torch.cat([v.reshape(v.shape[0], -1) for v in vs]) for k, vs in self.outputs.items()}


def _probe(model, ref: _Run, case: _Run, ref_sample: int, case_sample: int, score_diff: float) -> Divergence:
    """Re-run both with hooks; the first module (reference execution order) whose rows for the sample differ."""
    recorded = []
    for run, s in ((ref, ref_sample), (case, case_sample)):
        rec = _Recorder(model, run.views(s))
        try:
            with torch.no_grad():
                run.execute()
        finally:
            rec.close()
        recorded.append(rec)
    a, b = recorded[0].merged(), recorded[1].merged()
    index = {name: k for k, (name, _) in enumerate(model.named_modules())}
    for name in a:
        if name not in b:
            continue
        if a[name].shape != b[name].shape:
            return Divergence(ref_sample, name, recorded[0].ops[name], float("nan"), index[name], len(a))
        if not torch.equal(a[name], b[name]):
            diff = float((a[name] - b[name]).abs().max())
            return Divergence(ref_sample, name, recorded[0].ops[name], diff, index[name], len(a))
    return Divergence(ref_sample, "lm_head", "selected_logprob", score_diff, len(index), len(a))


# --------------------------------------------------------------------------- the sweep


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
) -> InvarianceReport:
    """Score ``samples`` (objects with ``messages``, ``images``, ``videos``, like
    ``fixtures.Sample``) under every case of ``CASES`` (or those named in ``cases``), under
    ``batch_invariant(backend)`` and, with ``control``, under the model's default kernels.

    Responses are seeded random token ids of ``response_length`` ending with EOS (the
    sweep is about numerics, not text). ``score``: ``"logprob"`` (selected log-probs through
    the LM head) or ``"hidden"`` (the hidden states that feed it). A case is bitwise when
    every compared sample's scores are ``torch.equal``.
    """
    cases = list(CASES) if cases is None else list(cases)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"unknown invariance cases {unknown}; choose from {list(CASES)}")
    if score not in ("logprob", "hidden"):
        raise ValueError(f"score must be 'logprob' or 'hidden', got {score!r}")
    if len(samples) < 2:
        raise ValueError("invariance_sweep needs at least 2 samples")
    device = next(model.parameters()).device
    eos = int(getattr(model.config.text_config, "eos_token_id", None) or 0)
    items = [_Item(s, r) for s, r in zip(samples, _responses(len(samples), response_length, seed, eos))]
    group_items = [_Item(samples[0], r) for r in _responses(group_size, response_length, seed + 1, eos)]
    head = model.get_output_embeddings()

    def scores(run: _Run) -> list[torch.Tensor]:
        hidden = run.execute()
        _, targets = run.batch.loss_token_index()
        if score == "logprob":
            values = selected_logprob(hidden, head.weight, index=torch.arange(targets.numel(), device=hidden.device),
                                      targets=targets, bias=getattr(head, "bias", None))
        else:
            values = hidden
        owner = run.batch.loss_token_sample()
        return [values[owner == b].detach().float().cpu() for b in range(run.batch.num_samples)]

    def build(case_items, **kw):
        return _batch(processor, case_items, device, **kw)

    results: list[CaseResult] = []
    modes = ["batch_invariant"] + (["default"] if control else [])
    for mode in modes:
        ctx = batch_invariant(backend) if mode == "batch_invariant" else contextlib.nullcontext()
        with ctx, torch.no_grad():
            memo: dict[str, tuple[_Run, list[torch.Tensor]]] = {}

            def get(key: str, make: Callable[[], _Run]):
                if key not in memo:
                    run = make()
                    memo[key] = (run, scores(run))
                return memo[key]

            def compare(case: str, detail: str, pairs):
                """pairs: (ref key, ref maker, ref sample, case key, case maker, case sample) per compared sample."""
                worst, tokens, first_bad = 0.0, 0, None
                for rk, rmake, rs, ck, cmake, cs in pairs:
                    ref_run, ref_scores = get(rk, rmake)
                    case_run, case_scores = get(ck, cmake)
                    x, y = ref_scores[rs], case_scores[cs]
                    tokens += x.shape[0]
                    if x.shape != y.shape:
                        raise RuntimeError(f"{case}: sample {rs} scored {x.numel()} vs {y.numel()} tokens")
                    if not torch.equal(x, y):
                        diff = float((x - y).abs().max())
                        worst = max(worst, diff)
                        if first_bad is None:
                            first_bad = (ref_run, case_run, rs, cs, diff)
                divergence = None
                if first_bad is not None and probe:
                    divergence = _probe(model, *first_bad)
                results.append(CaseResult(case, detail, mode, first_bad is None, worst, tokens, divergence))

            n = len(items)
            alone = lambda i: (f"alone{i}", lambda: _forward_run(model, build([items[i]]), "right"))  # noqa: E731
            batched = ("right", lambda: _forward_run(model, build(items), "right"))
            if "batch_size" in cases:
                compare("batch_size", f"1 vs {n}", [(*alone(i), 0, *batched, i) for i in range(n)])
            if "position" in cases:
                rev = ("reversed", lambda: _forward_run(model, build(items[::-1]), "right"))
                compare("position", f"{n} reversed", [(*batched, i, *rev, n - 1 - i) for i in range(n)])
            if "padding_side" in cases:
                left = ("left", lambda: _forward_run(model, build(items, padding_side="left"), "left"))
                compare("padding_side", "right vs left", [(*batched, i, *left, i) for i in range(n)])
            if "packed" in cases:
                packed = ("packed", lambda: _forward_run(model, build(items), "packed"))
                compare("packed", "right vs packed", [(*batched, i, *packed, i) for i in range(n)])
            if "neighbour_images" in cases:
                for k in (1, 2, 3):
                    nb = _Item(_neighbour(samples, k, 0), items[1].response)
                    pair = (f"nb{k}", lambda nb=nb: _forward_run(model, build([items[0], nb]), "right"))
                    compare("neighbour_images", f"{k} image{'s' if k > 1 else ''}", [(*alone(0), 0, *pair, 0)])
            if "processor_cache" in cases:
                fresh = ("fresh", lambda: _forward_run(model, build(items), "right"))
                compare("processor_cache", "cached vs re-run", [(*batched, i, *fresh, i) for i in range(n)])
            group = ("group_full", lambda: _forward_run(model, build(group_items, group_ids=["g"] * group_size), "right"))
            if "vision_cache" in cases:
                vc = ("group_vc", lambda: _vision_cache_run(model, build(group_items, group_ids=["g"] * group_size)))
                compare("vision_cache", f"G={group_size}", [(*group, i, *vc, i) for i in range(group_size)])
            if "prefix_cache" in cases:
                pairs = [(*alone(i), 0, f"prefix{i}", lambda i=i: _group_run(model, build([items[i]])), 0) for i in range(n)]
                compare("prefix_cache", "off vs on", pairs)
            if "group_cache" in cases:
                gc = ("group_cached", lambda: _group_run(model, build(group_items, group_ids=["g"] * group_size)))
                compare("group_cache", f"G={group_size}", [(*group, i, *gc, i) for i in range(group_size)])
    meta = {
        "model": type(model).__name__,
        "config": {"hidden_size": model.config.text_config.hidden_size, "layers": model.config.text_config.num_hidden_layers,
                   "vision_depth": model.config.vision_config.depth},
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "backend": backend or "auto",
        "score": score,
        "samples": len(samples),
        "response_length": response_length,
        "group_size": group_size,
        "torch": torch.__version__,
        "module_order": [n for n, _ in model.named_modules()],
    }
    return InvarianceReport(results, meta)
