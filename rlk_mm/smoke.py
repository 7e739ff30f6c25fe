"""`rlk-mm smoke`: an image-text GRPO run that proves the pipeline before it trains.

What a VLM RL engineer runs first. With no download it:

1. draws seeded images in which one of four colours dominates (distractor shapes, varying
   sizes, sometimes two images) and asks "Which colour dominates the image? Answer with
   one word." (reward 1 for the right colour word); `--data DIR` runs on a Geo3K folder
   with a Geo3K-style reward instead;
2. builds the real Qwen2.5-VL processor and a tiny random-weight
   `Qwen2_5_VLForConditionalGeneration` (or loads `--model-path`);
3. warms the policy up on the answer format with shuffled labels, so it answers with a
   colour word but at chance: it has not learned to look at the image;
4. samples G answers per prompt with the model's own `generate` (KV cache, temperature
   sampling) and records the tokens, the positions the model was fed and the log-probs;
5. checks four gates before the first update, each printed PASS/FAIL: (a) layout parity
   of the rollout-side and training-side `RLBatch`; (b) rollout log-probs vs the training
   path (`selected_logprob`) within the numerical contract; (c) loss masking: no prompt,
   image or padding token is scored, and changing every target id outside the loss spans
   leaves loss and gradients bitwise unchanged; (d) the importance ratio exp(logp - old)
   at the first update is 1 within the contract;
6. trains with GRPO through rlk_mm ops only: rewards -> `scatter_rewards` ->
   `group_advantages` -> `policy_loss` (k3 KL to the warm-up reference) -> Adam step,
   with a live per-step table;
7. writes `smoke_report.json`, `smoke_curves.png` and `smoke_layout.png` (one group) to
   `--out`, and exits non-zero when a gate or the learning check fails.

`--break {loss-shift,adv-sign,image-swap}` injects a known bug so one can see what
catches it: loss spans one token early (gates a-d), negated advantages (learning check),
image embeddings swapped between two prompts of the same image size (gates b and d).

Speed notes (2 CPU cores): the sampler is a logits processor handed to `generate`
(inverse-CDF sampling, ~7x faster than `torch.multinomial` over 151k columns, and it
records each token's log-prob from the same logits); the vision tower encodes each distinct
image once and the LM head computes each distinct row once (a group repeats its prompt G
times); the token embeddings and LM head are frozen during
GRPO (Adam would otherwise move every unsampled row of the 151k-row head at once, and the
answer format collapses). glibc returning the big logits buffers to the OS on every step
costs ~30%: `keep_freed_memory` tells it (mallopt) to keep them, at the start of every run.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import math
import os
import platform
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from PIL import Image, ImageDraw

from .fixtures import Sample, load_geo3k, processor_inputs, qwen_vl_processor, tiny_qwen2_5_vl
from .models.qwen2_5_vl import forward_hidden, layout_inputs
from .ops import group_advantages, policy_loss, scatter_rewards, selected_logprob
from .parity import LOGPROB_MAX_ABS, check_layout_parity, compare_logprobs
from .parity.layout import LayoutParityError
from .schema import Modality, RLBatch, SpanTable

Tensor = torch.Tensor

# ----------------------------------------------------------------------------- settings
BREAKS = ("loss-shift", "adv-sign", "image-swap")
MALLOPT = {"M_MMAP_MAX": (-4, 0), "M_TRIM_THRESHOLD": (-1, 2**31 - 1), "M_TOP_PAD": (-2, 256 << 20)}
"""glibc mallopt (parameter, value) pairs: big buffers come from the heap, and freed logits
buffers stay there for the next step instead of being unmapped."""

TINY_MODEL = dict(hidden_size=128, num_layers=2, vision_depth=1, vision_hidden_size=64)
"""The default policy: text hidden 128 (64 stalls near 0.7 reward), one vision block of
width 64 (32 learned slower and less surely)."""

LR_FLOOR = 0.1
"""The learning rate decays (cosine) to this fraction of `--lr` at the last GRPO step."""

LEARNING_MIN_STEPS = 100
"""Runs at least this long must show learning: start <= `LEARNING_MAX_START`, last 10
steps >= `LEARNING_MIN_FINAL` (colour task only)."""
LEARNING_MAX_START = 0.4
LEARNING_MIN_FINAL = 0.8
LEARNING_WINDOW = 10


# ----------------------------------------------------------------------------- the colour task
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
DISTRACTOR_COLOURS = {**COLOURS, "purple": (140, 60, 170), "orange": (240, 130, 30)}
PROMPT = "Which colour dominates the image? Answer with one word."
PROMPT_TWO = "Which colour dominates the images? Answer with one word."
IMAGE_SIZES = ((112, 112), (112, 84), (84, 112), (84, 84))
"""(width, height): 9 to 16 image tokens each at the processor's default pixel limits."""
SECOND_IMAGE_SIZES = ((56, 56), (84, 56), (56, 84))
TWO_IMAGE_RATE = 0.25
BACKGROUND_RATE = 0.7
"""How often the dominant colour is the background (else a large shape on a light one)."""


def _draw_colour_image(rng: random.Random, size, colour: str) -> Image.Image:
    """`colour` as the background or as one large shape on a light background, and 1-3
    smaller distractor shapes of other colours."""
    width, height = size
    on_background = rng.random() < BACKGROUND_RATE
    background = COLOURS[colour] if on_background else tuple(rng.randrange(200, 256) for _ in range(3))
    image = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(image)

    def shape(fill, frac_lo, frac_hi):
        w = max(4, int(width * rng.uniform(frac_lo, frac_hi)))
        h = max(4, int(height * rng.uniform(frac_lo, frac_hi)))
        x, y = rng.randrange(0, width - w + 1), rng.randrange(0, height - h + 1)
        box = (x, y, x + w - 1, y + h - 1)
        kind = rng.choice(("rectangle", "ellipse", "triangle"))
        if kind == "rectangle":
            draw.rectangle(box, fill=fill)
        elif kind == "ellipse":
            draw.ellipse(box, fill=fill)
        else:
            draw.polygon([(x + w // 2, y), (x, y + h - 1), (x + w - 1, y + h - 1)], fill=fill)

    if not on_background:
        shape(COLOURS[colour], 0.75, 0.95)
    others = [c for c in DISTRACTOR_COLOURS if c != colour]
    for _ in range(rng.randint(1, 3)):
        shape(DISTRACTOR_COLOURS[rng.choice(others)], 0.15, 0.4)
    return image


def _colour_pixels(images) -> dict[str, int]:
    """Pixels of exactly each of the four colours, over all images (RGB packed in one int)."""
    counts = dict.fromkeys(COLOURS, 0)
    for image in images:
        rgb = np.asarray(image, dtype=np.int32).reshape(-1, 3)
        values, freq = np.unique((rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2], return_counts=True)
        packed = dict(zip(values.tolist(), freq.tolist()))
        for name, (r, g, b) in COLOURS.items():
            counts[name] += packed.get((r << 16) | (g << 8) | b, 0)
    return counts


def colour_sample(rng: random.Random, sample_id: str) -> Sample:
    """One prompt of the colour task; the dominant colour covers >= 1.5x the pixels of any
    other of the four colours (images are redrawn until it does)."""
    colour = rng.choice(list(COLOURS))
    while True:
        images = [_draw_colour_image(rng, rng.choice(IMAGE_SIZES), colour)]
        if rng.random() < TWO_IMAGE_RATE:
            images.append(_draw_colour_image(rng, rng.choice(SECOND_IMAGE_SIZES), colour))
        counts = _colour_pixels(images)
        runner_up = max(v for k, v in counts.items() if k != colour)
        if counts[colour] >= 1.5 * max(runner_up, 1):
            break
    content = [{"type": "image"} for _ in images]
    content.append({"type": "text", "text": PROMPT if len(images) == 1 else PROMPT_TWO})
    return Sample(sample_id, [{"role": "user", "content": content}], images=images, answer=colour, meta={"pixels": counts})


def colour_reward(text: str, sample: Sample) -> float:
    """1 when the answer, stripped of spaces, case and a final full stop, is the colour word."""
    return float(text.strip().rstrip(".").strip().lower() == sample.answer)


# ----------------------------------------------------------------------------- Geo3K
GEO3K_INSTRUCTION = " Give the final answer in \\boxed{}."
GEO3K_FORMAT_WEIGHT = 0.1


def _last_boxed(text: str) -> Optional[str]:
    """The content of the last `\\boxed{...}` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _normalize_answer(text: str) -> str:
    return re.sub(r"\s+|\$|\\[,;!]|\\left|\\right", "", text).lower()


def geo3k_reward(text: str, sample: Sample) -> float:
    """Geo3K-style: 0.9 x accuracy (the last `\\boxed{}` equals the answer as a number, or
    as a string up to spaces and case) + 0.1 x format (a `\\boxed{}` is present)."""
    boxed = _last_boxed(text)
    if boxed is None:
        return 0.0
    got, want = _normalize_answer(boxed), _normalize_answer(sample.answer)
    try:
        correct = math.isclose(float(got), float(want), rel_tol=1e-4, abs_tol=1e-6)
    except ValueError:
        correct = got == want
    return (1 - GEO3K_FORMAT_WEIGHT) * float(correct) + GEO3K_FORMAT_WEIGHT


def _geo3k_prompt(sample: Sample) -> Sample:
    content = list(sample.messages[0]["content"])
    content.append({"type": "text", "text": GEO3K_INSTRUCTION})
    return Sample(sample.id, [{"role": "user", "content": content}], images=sample.images, answer=sample.answer, meta=sample.meta)


@dataclass
class Task:
    """Prompts, reward, warm-up answers and response length of one smoke task."""

    name: str
    draw: Callable[[random.Random, int, str], list[Sample]]  # (rng, n, stream) -> prompts
    reward: Callable[[str, Sample], float]
    answer_text: Callable[[str], str]  # a label -> the warm-up answer text
    max_new_tokens: int

    def batch(self, rng: random.Random, n: int, stream: str) -> list[Sample]:
        return self.draw(rng, n, stream)


def colour_task() -> Task:
    counter = {"n": 0}

    def draw(rng, n, stream):
        out = []
        for _ in range(n):
            out.append(colour_sample(rng, f"colour-{stream}-{counter['n']}"))
            counter["n"] += 1
        return out

    # one word and <|im_end|>: two tokens, so a step's 64 answers fill one 128-row chunk of the CPU head
    return Task("colour", draw, colour_reward, lambda label: label, max_new_tokens=2)


def geo3k_task(path) -> Task:
    problems = [_geo3k_prompt(s) for s in load_geo3k(path)]
    return Task(
        "geo3k",
        lambda rng, n, stream: [rng.choice(problems) for _ in range(n)],
        geo3k_reward,
        lambda label: f"\\boxed{{{label}}}",
        max_new_tokens=24,
    )


# ----------------------------------------------------------------------------- model
@dataclass
class Policy:
    model: torch.nn.Module
    processor: object
    device: torch.device
    dtype: torch.dtype

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def eos_ids(self) -> list[int]:
        return [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def head(self) -> Tensor:
        return self.model.lm_head.weight


def load_policy(model_path, seed: int, device: torch.device, dtype: torch.dtype) -> Policy:
    """The real Qwen2.5-VL processor and the tiny random policy, or a local checkpoint."""
    if model_path:
        from transformers import Qwen2_5_VLForConditionalGeneration

        processor = qwen_vl_processor(model_path)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_path, dtype=dtype, local_files_only=True)
    else:
        processor = qwen_vl_processor()
        model = tiny_qwen2_5_vl(seed, **TINY_MODEL).to(dtype)
    model.to(device).eval()
    distinct = _DistinctImages(model.config.vision_config.spatial_merge_size)
    model.model.visual.register_forward_pre_hook(distinct.before, with_kwargs=True)
    model.model.visual.register_forward_hook(distinct.after, with_kwargs=True)
    shared = _DistinctRows()
    model.lm_head.register_forward_pre_hook(shared.before)
    model.lm_head.register_forward_hook(shared.after)
    return Policy(model, processor, device, dtype)


class _DistinctRows:
    """Hooks on the LM head (which only `generate` calls here): each distinct input row goes
    through the head once and is copied to its repeats. A GRPO group's G rows are equal at
    the prefill (one prompt) and often at the next step (one first token), and the
    [rows, V] product is the rollout's biggest on a CPU. The rows handed on are contiguous
    (`generate` slices the prefill's last position: a strided [B, 1, H] would make the head
    a slow batched matmul). Stateless between calls."""

    def __init__(self):
        self.inverse: Optional[Tensor] = None
        self.shape: tuple = ()

    def before(self, module, args):
        x = args[0]
        self.shape = tuple(x.shape[:-1])
        distinct, self.inverse = torch.unique(x.reshape(-1, x.shape[-1]), dim=0, return_inverse=True)
        return (distinct,) + tuple(args[1:])

    def after(self, module, args, output):
        inverse, self.inverse = self.inverse, None
        return output.index_select(0, inverse).view(*self.shape, output.shape[-1])


class _DistinctImages:
    """Hooks on the vision tower: encode each distinct image of a call once (a GRPO group
    repeats its prompt's images G times) and give every copy its rows. Each image is
    encoded on its own (per-image attention), so the values are those of encoding all
    copies; the copies' gradients add up on the shared rows. Stateless between calls."""

    def __init__(self, merge: int):
        self.merge = merge
        self.rows: Optional[Tensor] = None

    def before(self, module, args, kwargs):
        if "grid_thw" not in kwargs:  # called positionally: (pixels, grid_thw)
            kwargs = {**kwargs, "grid_thw": args[1]}
            args = args[:1]
        pixels, grid = args[0], kwargs["grid_thw"]
        sizes = grid.prod(-1).tolist()
        chunks = torch.split(pixels, sizes)
        # candidates share their grid and pixel sum (one reduction for all items); torch.equal decides
        item = torch.repeat_interleave(torch.arange(len(sizes), device=pixels.device), grid.prod(-1).to(pixels.device))
        sums = torch.zeros(len(sizes), dtype=torch.float64, device=pixels.device).index_add_(0, item, pixels.double().sum(-1))
        candidates: dict[tuple, list[int]] = {}
        distinct: list[int] = []
        owner = []
        for i, key in enumerate(zip(map(tuple, grid.tolist()), sums.tolist())):
            same = candidates.setdefault(key, [])
            match = next((u for u in same if torch.equal(chunks[u], chunks[i])), None)
            if match is None:
                same.append(i)
                distinct.append(i)
            owner.append(distinct.index(i if match is None else match))
        tokens = (grid.prod(-1) // self.merge**2).tolist()
        kept = [tokens[i] for i in distinct]
        first = np.cumsum([0] + kept)[:-1]
        self.rows = torch.cat([torch.arange(first[u], first[u] + kept[u]) for u in owner]).to(pixels.device)
        return (torch.cat([chunks[i] for i in distinct]),) + tuple(args[1:]), {**kwargs, "grid_thw": grid[distinct]}

    def after(self, module, args, kwargs, output):
        rows, self.rows = self.rows, None
        if isinstance(output, Tensor):  # transformers versions whose tower returns the merged rows
            return output[rows]
        output.pooler_output = output.pooler_output[rows]
        return output


def freeze_embeddings_and_head(model) -> list[Tensor]:
    """The GRPO trainable parameters: all but the token embeddings and the LM head.

    Every one of the head's 151k rows gets a softmax gradient (-p_v h per token): tiny for
    rows never sampled but, under negative advantages, one-signed, and Adam's
    per-coordinate normalisation turns it into full-size steps that lift all those rows
    together until the answer format collapses (SGD on the head instead learns the answers'
    marginal and drowns the image-conditional signal)."""
    model.get_input_embeddings().weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    return [p for p in model.parameters() if p.requires_grad]


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """The GRPO learning-rate multiplier at 0-based `step`: a linear ramp over `warmup`
    steps (Adam's first steps are sign-like, ~lr on every weight at once: without the ramp
    the first update alone moves the tiny policy by a KL of ~2 and the answer format
    breaks), then a cosine decay to `LR_FLOOR` at the last step (Adam keeps its step size
    as the reward signal thins out, so a constant rate lets noise undo a learned policy)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(steps - 1 - warmup, 1)
    return LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


# ----------------------------------------------------------------------------- training forward
def hidden_states(model, batch: RLBatch, *, swap_images: Optional[tuple[int, int]] = None) -> Tensor:
    """Last hidden states [T, H] of the batch's tokens from a right-padded forward (no logits).

    `swap_images=(i, j)`: the `image-swap` bug: items i and j (same grid) trade their
    vision-tower input, so each sample attends to the other's image embeddings."""
    if swap_images is not None and batch.pixel_values is not None:
        swapped = _swap_image_rows(batch.pixel_values, batch.image_grid_thw, *swap_images)
        batch = batch.model_copy(update={"pixel_values": swapped})
    return forward_hidden(model, batch, layout="right")


def _swap_image_rows(pixels: Tensor, grid: Tensor, i: int, j: int) -> Tensor:
    rows = grid.prod(-1)
    start = torch.cumsum(rows, 0) - rows
    out = pixels.clone()
    si, sj, n = int(start[i]), int(start[j]), int(rows[i])
    out[si : si + n], out[sj : sj + n] = pixels[sj : sj + n], pixels[si : si + n]
    return out


def swap_pair(batch: RLBatch) -> Optional[tuple[int, int]]:
    """Two images of the same grid from different groups (for `--break image-swap`)."""
    if batch.image_grid_thw is None:
        return None
    owner = batch.media_sample[batch.media_modality == int(Modality.IMAGE)].tolist()
    groups = batch.group_ids or [str(b) for b in range(batch.num_samples)]
    grids = batch.image_grid_thw.tolist()
    for i in range(len(grids)):
        for j in range(i + 1, len(grids)):
            if grids[i] == grids[j] and groups[owner[i]] != groups[owner[j]]:
                return i, j
    return None


def policy_logprobs(policy: Policy, model, batch: RLBatch, temperature: float, swap=None) -> Tensor:
    """fp32 log-probs [n] of the batch's loss tokens: hidden states -> `selected_logprob`."""
    hidden = hidden_states(model, batch, swap_images=swap)
    return selected_logprob(hidden, model.lm_head.weight, batch, temperature=temperature)


# ----------------------------------------------------------------------------- warm-up
def warm_up(policy: Policy, task: Task, rng: random.Random, *, steps: int, prompts: int, lr: float, log) -> list[float]:
    """Supervised steps on the answer format with shuffled labels: the policy learns to
    answer with a label word and stop, but not which label fits the image."""
    model = policy.model
    model.requires_grad_(True)
    model.get_input_embeddings().weight.requires_grad_(False)  # the answer format needs the head, not the embeddings
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    losses = []
    for step in range(steps):
        samples = task.batch(rng, prompts, "warmup")
        labels = [s.answer for s in samples]
        rng.shuffle(labels)
        responses = [policy.tokenizer.encode(task.answer_text(label)) + policy.eos_ids for label in labels]
        inputs = processor_inputs(policy.processor, samples, padding_side="left")
        batch = RLBatch.from_qwen_vl(inputs, processor=policy.processor, responses=responses)
        logp = policy_logprobs(policy, model, batch, 1.0)
        loss = -logp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % 10 == 0 or step == steps - 1:
            log(f"  warm-up step {step + 1:>3}/{steps}: loss {losses[-1]:.3f}")
    return losses


# ----------------------------------------------------------------------------- rollout
class _Sampler:
    """A logits processor that samples (inverse CDF at `temperature`) and records the
    sampled token's log-prob; it returns scores whose argmax is the sample, so greedy
    `generate` keeps its KV cache, stopping rules and bookkeeping."""

    def __init__(self, temperature: float, generator: torch.Generator):
        self.temperature = temperature
        self.generator = generator
        self.logprobs: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        z = scores.float()  # fp32 scores: z is scores, overwritten below anyway
        if self.temperature != 1.0:  # dividing by 1 is exact: skip a pass over the [rows, V] scores
            z = z.div_(self.temperature)
        top = z.amax(-1, keepdim=True)
        cdf = (z - top).exp_().cumsum_(-1)
        total = cdf[:, -1:]
        u = torch.rand(total.shape, generator=self.generator, device=z.device, dtype=z.dtype) * total
        # right=True never picks a zero-probability token; the clamp only catches u rounding up to the total
        token = torch.searchsorted(cdf, u, right=True).clamp_(max=z.shape[-1] - 1)
        self.logprobs.append((z.gather(1, token) - top - total.log()).squeeze(1))
        return scores.fill_(-math.inf).scatter_(1, token, 0.0)


class _PositionRecorder:
    """Records the M-RoPE positions `generate` feeds the language model at every step."""

    def __init__(self, language_model):
        self.steps: list[Tensor] = []
        self.handle = language_model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        pos = kwargs.get("position_ids")
        if pos is None:
            raise RuntimeError("generate did not pass position_ids to the language model; cannot record the rollout's positions")
        self.steps.append(pos[-3:].detach().cpu())  # [4, B, n] (text row first) or [3, B, n]


@dataclass
class Rollout:
    """What the rollout produced, one row per sampled answer (prompts repeated G times)."""

    samples: list[Sample]
    group_ids: list[str]
    inputs: dict  # the left-padded processor output of the rows (pixels repeated per row)
    prompt_ids: list[Tensor]
    responses: list[Tensor]
    logprobs: list[Tensor]  # fp32, one per response token
    positions: list[Tensor]  # (3, P + R) as generate fed them
    texts: list[str]
    rewards: list[float]
    rejected: int = 0
    seconds: float = 0.0


def _repeat_rows(inputs, samples: list[Sample], G: int) -> dict:
    """The processor output with each prompt repeated G times (pixel rows included)."""
    out = {k: inputs[k].repeat_interleave(G, 0) for k in ("input_ids", "attention_mask", "mm_token_type_ids") if k in inputs}
    if inputs.get("image_grid_thw") is not None:
        grid = inputs["image_grid_thw"]
        chunks = torch.split(inputs["pixel_values"], grid.prod(-1).tolist())
        owner = [b for b, s in enumerate(samples) for _ in s.images]
        order = [k for b in range(len(samples)) for _ in range(G) for k in range(len(owner)) if owner[k] == b]
        out["pixel_values"] = torch.cat([chunks[k] for k in order])
        out["image_grid_thw"] = grid[order]
    return out


def _select_rows(inputs: dict, samples: list[Sample], keep: list[int]) -> dict:
    """Rows `keep` of a processor output (with their images' pixel rows)."""
    out = {k: inputs[k][keep] for k in ("input_ids", "attention_mask", "mm_token_type_ids") if k in inputs}
    if inputs.get("image_grid_thw") is not None:
        grid = inputs["image_grid_thw"]
        chunks = torch.split(inputs["pixel_values"], grid.prod(-1).tolist())
        owner = [b for b, s in enumerate(samples) for _ in s.images]
        order = [k for b in keep for k in range(len(owner)) if owner[k] == b]
        out["pixel_values"] = torch.cat([chunks[k] for k in order])
        out["image_grid_thw"] = grid[order]
    return out


@torch.no_grad()
def rollout(policy: Policy, task: Task, prompts: list[Sample], G: int, *, temperature: float, generator, step: int) -> Rollout:
    """G answers per prompt with the model's own `generate` (KV cache, temperature sampling)."""
    from transformers import GenerationConfig, LogitsProcessorList

    start = time.perf_counter()
    model, tok = policy.model, policy.tokenizer
    rows = [s for s in prompts for _ in range(G)]
    groups = [f"{step}:{s.id}" for s in rows]
    inputs = _repeat_rows(processor_inputs(policy.processor, prompts, padding_side="left"), prompts, G)
    sampler = _Sampler(temperature, generator)
    recorder = _PositionRecorder(model.model.language_model)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=task.max_new_tokens, eos_token_id=policy.eos_ids, pad_token_id=policy.pad_id,
        use_cache=True,
    )
    try:
        out = model.generate(
            **{k: v.to(policy.device) for k, v in inputs.items()},
            generation_config=config,
            logits_processor=LogitsProcessorList([sampler]),
        )
    finally:
        recorder.handle.remove()
    P = inputs["input_ids"].shape[1]
    sequences = out[:, P:].cpu() if not hasattr(out, "sequences") else out.sequences[:, P:].cpu()
    logps = torch.stack(sampler.logprobs, 1).cpu()  # [rows, steps]
    fed = torch.cat(recorder.steps, dim=-1)  # [3, rows, P + steps fed]
    eos = torch.tensor(policy.eos_ids)
    media = torch.tensor([model.config.image_token_id, model.config.video_token_id])
    keep, data = [], []
    for r in range(len(rows)):
        seq = sequences[r]
        stop = torch.nonzero(torch.isin(seq, eos)).flatten()
        n = int(stop[0]) + 1 if stop.numel() else seq.numel()
        response = seq[:n]
        if bool(torch.isin(response, media).any()):
            continue  # a generated media placeholder cannot be scored: reject the answer (RLBatch would refuse it)
        mask = inputs["attention_mask"][r].bool()
        prompt = inputs["input_ids"][r][mask]
        # positions as fed: the prompt at prefill, response token k at decode step k + 1; generate
        # never feeds its last token, whose position continues the text (previous + 1, as M-RoPE does)
        fed_pos = torch.cat([fed[:, r, :P][:, mask], fed[:, r, P : P + n - 1]], dim=1)
        pos = torch.cat([fed_pos, fed_pos[:, -1:] + 1], dim=1)
        text = tok.decode(response, skip_special_tokens=True)
        keep.append(r)
        data.append((prompt, response, logps[r, :n].float(), pos, text, task.reward(text, rows[r])))
    kept_rows = [rows[r] for r in keep]
    return Rollout(
        samples=kept_rows,
        group_ids=[groups[r] for r in keep],
        inputs=_select_rows(inputs, rows, keep),
        prompt_ids=[d[0] for d in data],
        responses=[d[1] for d in data],
        logprobs=[d[2] for d in data],
        positions=[d[3] for d in data],
        texts=[d[4] for d in data],
        rewards=[d[5] for d in data],
        rejected=len(rows) - len(keep),
        seconds=time.perf_counter() - start,
    )


def _media_ids(samples: list[Sample]) -> list[str]:
    return [m for s in samples for m in s.media_ids]


def rollout_batch(policy: Policy, ro: Rollout) -> RLBatch:
    """The rollout's own record: its tokens and the positions `generate` fed the model."""
    return RLBatch.from_token_lists(
        [p.tolist() for p in ro.prompt_ids],
        [r.tolist() for r in ro.responses],
        processor=policy.processor,
        image_grid_thw=ro.inputs.get("image_grid_thw"),
        pixel_values=ro.inputs.get("pixel_values"),
        position_ids=ro.positions,
        group_ids=ro.group_ids,
        rewards=ro.rewards,
        media_ids=_media_ids(ro.samples),
    )


def training_batch(policy: Policy, ro: Rollout, *, loss_shift: bool = False) -> RLBatch:
    """The trainer's batch: built from the processor output and the responses, positions
    computed by rlk_mm. `loss_shift`: the `loss-shift` bug (every loss span one token early)."""
    batch = RLBatch.from_qwen_vl(
        ro.inputs,
        processor=policy.processor,
        responses=ro.responses,
        group_ids=ro.group_ids,
        rewards=ro.rewards,
        media_ids=_media_ids(ro.samples),
    )
    if loss_shift:
        ls = batch.loss_spans
        shifted = SpanTable(ls.starts - 1, ls.ends - 1, ls.sample_ptr, ls.modality, ls.media_index)
        batch = batch.model_copy(update={"loss_spans": shifted})  # the bug skips validation, as a hand-built mask would
    return batch


# ----------------------------------------------------------------------------- gates
@dataclass
class Gate:
    name: str
    ok: bool
    detail: str
    data: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"  [{'PASS' if self.ok else 'FAIL'}] {self.name}: {self.detail}"


def gate_layout(policy: Policy, rb: RLBatch, tb: RLBatch) -> Gate:
    report = check_layout_parity(rb, tb, tokenizer=policy.tokenizer)
    if report.ok:
        return Gate("(a) layout parity", True, f"{tb.num_samples} samples, {tb.num_tokens} tokens, {tb.num_media} images agree")
    first = report.first
    return Gate("(a) layout parity", False, f"{len(report.mismatches)} mismatches; first: {first.describe()}", report.to_dict())


def gate_logprobs(rollout_lp: Tensor, training_lp: Tensor, rb: RLBatch, tb: RLBatch, dtype, tokenizer) -> Gate:
    name = "(b) log-prob consistency"
    try:
        cmp = compare_logprobs(rollout_lp, training_lp, rb, tb, dtype=dtype, tokenizer=tokenizer)
    except LayoutParityError as error:
        return Gate(name, False, f"refused: the layouts differ ({error.report.first.field})")
    except ValueError as error:
        return Gate(name, False, str(error))
    detail = f"{cmp.num_tokens} tokens, max |Δ| {cmp.max_abs:.2e} (contract {cmp.tolerance:g})"
    if not cmp.ok:
        f = cmp.first_beyond
        detail += f"; first beyond: sample {f['sample']}, position {f['position']}: {f['rollout']:.5f} vs {f['training']:.5f}"
    return Gate(name, cmp.ok, detail, cmp.to_dict())


def gate_masking(policy: Policy, ro: Rollout, tb: RLBatch, hidden: Tensor, loss_fn, temperature: float, seed: int) -> Gate:
    """No prompt/image/padding token is a scored target, and target ids outside the loss
    spans do not reach the loss or its gradients (bitwise)."""
    name = "(c) loss masking"
    sample, pos, _ = tb.loss_spans.token_positions()
    prompt_len = torch.tensor([p.numel() for p in ro.prompt_ids])
    lengths = tb.seq_lengths()
    flat = tb.cu_seqlens.long()[sample] + pos
    in_prompt = int((pos < prompt_len[sample]).sum())
    in_media = int((tb.token_modality()[flat.clamp(max=tb.num_tokens - 1)] != int(Modality.TEXT)).sum())
    mask = layout_inputs(tb, "right", policy.pad_id)[0]["attention_mask"]
    real = (pos >= 1) & (pos < lengths[sample])
    padding = int((~real).sum()) + int((mask[sample[real], pos[real]] == 0).sum())
    # the intended targets: generated tokens; everything else gets random ids
    scored = tb.loss_mask()
    response = torch.zeros_like(scored)
    for b in range(tb.num_samples):
        lo = int(tb.cu_seqlens[b])
        response[lo + int(prompt_len[b]) : int(tb.cu_seqlens[b + 1])] = True
    changed = ~(scored & response)
    g = torch.Generator().manual_seed(seed)
    ids = tb.input_ids.clone()
    ids[changed] = torch.randint(0, policy.head.shape[0], (int(changed.sum()),), generator=g)
    perturbed = tb.model_copy(update={"input_ids": ids})
    h = hidden.detach().requires_grad_(True)
    w = policy.head.detach().clone().requires_grad_(True)
    results = []
    for batch in (tb, perturbed):
        logp = selected_logprob(h, w, batch, temperature=temperature)
        loss = loss_fn(logp)
        results.append((loss.detach(), *torch.autograd.grad(loss, (h, w))))
    same = all(torch.equal(a, b) for a, b in zip(*results))
    ok = in_prompt == 0 and in_media == 0 and padding == 0 and same
    detail = (
        f"{sample.numel()} scored targets: {in_prompt} prompt, {in_media} image, {padding} padding; "
        f"{int(changed.sum())} unscored target ids randomized: loss and grads {'bitwise equal' if same else 'CHANGED'}"
    )
    return Gate(name, ok, detail, dict(prompt=in_prompt, image=in_media, padding=padding, bitwise_equal=same))


def gate_ratio(logp: Tensor, old: Tensor, dtype) -> Gate:
    tol = math.expm1(LOGPROB_MAX_ABS.for_dtype(dtype))
    name = "(d) on-policy ratio"
    if logp.shape != old.shape:
        return Gate(name, False, f"{logp.numel()} training log-probs for {old.numel()} rollout tokens")
    dev = float((logp.detach().float().cpu() - old).exp().sub(1).abs().max()) if logp.numel() else 0.0
    ok = dev <= tol
    return Gate(name, ok, f"max |exp(logp - old) - 1| = {dev:.2e} at the first update (contract {tol:.1e})", dict(max_dev=dev, tolerance=tol))


# ----------------------------------------------------------------------------- training
def _grpo_advantages(tb: RLBatch, negate: bool) -> tuple[Tensor, Tensor]:
    """Per-loss-token rewards -> per-sample scores -> GRPO advantages per loss token."""
    token_rewards = scatter_rewards(tb)  # the sequence reward on each answer's last token
    sample = tb.loss_token_sample()
    scores = torch.zeros(tb.num_samples, dtype=torch.float32).index_add_(0, sample, token_rewards)
    adv = group_advantages(scores, tb.group_index())
    if negate:
        adv = -adv  # the adv-sign bug
    return adv[sample], scores


def _direction(tb: RLBatch, before: Tensor, after: Tensor) -> Optional[float]:
    """Mean over loss tokens of (reward - group mean reward) x (logp after - before): > 0
    when the update made above-average answers more likely. Plain torch from the rewards,
    independent of the advantage and loss code it checks. None without reward spread."""
    r = tb.rewards.double()
    g = tb.group_index()
    mean = torch.zeros(int(g.max()) + 1, dtype=torch.float64).index_add_(0, g, r) / torch.bincount(g).double()
    centred = (r - mean[g])[tb.loss_token_sample()]
    if not bool((centred != 0).any()):
        return None
    return float((centred * (after.double() - before.double())).mean())


def _versions() -> dict:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    from . import __version__

    out["rlk_mm"] = __version__
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def _bar(done: int, total: int, width: int = 12) -> str:
    filled = int(round(width * done / max(total, 1)))
    return "█" * filled + "·" * (width - filled)


HEADER = f"{'step':>9} {'progress':<12} {'reward':>11} {'loss':>8} {'KL':>8} {'clip':>5} {'|r-1|max':>8} {'tok/s':>6} {'s':>5}"


def _row(m: dict, steps: int) -> str:
    return (
        f"{m['step']:>4}/{steps:<4} {_bar(m['step'], steps)} {m['reward_mean']:>5.2f}±{m['reward_std']:<4.2f} "
        f"{m['loss']:>8.4f} {m['kl']:>8.5f} {m['clip_frac']:>5.2f} {m['max_ratio_dev']:>8.1e} "
        f"{m['tokens_per_s']:>6.0f} {m['seconds']:>5.2f}"
    )


def run_smoke(args) -> int:
    """Run the smoke test with parsed `args` (see `add_smoke_parser`); the exit code."""
    t_start = time.perf_counter()
    keep_freed_memory()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    log = print if not args.quiet else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    rng_warm, rng_train = random.Random(f"{args.seed}:warmup"), random.Random(f"{args.seed}:train")
    generator = torch.Generator(device=device).manual_seed(args.seed)
    task = geo3k_task(args.data) if args.data else colour_task()
    report: dict = {
        "command": "rlk-mm smoke " + " ".join(_to_argv(args)),
        "task": task.name, "seed": args.seed, "device": _device_name(device), "dtype": args.dtype,
        "break": args.break_mode, "versions": _versions(),
        "config": {k: v for k, v in vars(args).items() if k != "func"},
    }
    timings: dict = {}
    report["timings"] = timings

    log(f"rlk-mm smoke: task {task.name}, {args.steps} steps of {args.prompts} prompts x {args.samples} answers, "
        f"seed {args.seed}, device {report['device']}" + (f", BREAK {args.break_mode}" if args.break_mode else ""))
    t = time.perf_counter()
    policy = load_policy(args.model_path, args.seed, device, dtype)
    timings["setup_s"] = time.perf_counter() - t
    log(f"policy: {'local checkpoint ' + str(args.model_path) if args.model_path else 'tiny random Qwen2.5-VL'} "
        f"({sum(p.numel() for p in policy.model.parameters()) / 1e6:.1f}M parameters, {timings['setup_s']:.1f}s)")

    t = time.perf_counter()
    log(f"warm-up: {args.warmup_steps} steps on the answer format with shuffled labels")
    report["warmup_loss"] = warm_up(policy, task, rng_warm, steps=args.warmup_steps, prompts=args.prompts, lr=args.warmup_lr, log=log)
    timings["warmup_s"] = time.perf_counter() - t
    reference = copy.deepcopy(policy.model).requires_grad_(False)
    opt = torch.optim.Adam(freeze_embeddings_and_head(policy.model), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, args.lr_warmup_steps, args.steps))

    def loss_fn_for(tb: RLBatch, old: Tensor, adv: Tensor, ref_lp: Tensor):
        sample = tb.loss_token_sample().to(device)

        def fn(logp: Tensor):
            loss, metrics = policy_loss(
                logp, old.to(device), adv.to(device), sample_index=sample, num_samples=tb.num_samples,
                ref_log_probs=ref_lp.to(device), kl_type="low_var_kl", kl_coef=args.kl_coef, loss_agg_mode="token-mean",
            )
            fn.metrics = metrics
            return loss

        return fn

    steps_out: list[dict] = []
    report["steps"] = steps_out
    report["gates"] = []
    exit_code = 0
    t_train = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        ro = rollout(policy, task, task.batch(rng_train, args.prompts, "train"), args.samples,
                     temperature=args.temperature, generator=generator, step=step)
        tb = training_batch(policy, ro, loss_shift=args.break_mode == "loss-shift")
        old = torch.cat(ro.logprobs)
        swap = swap_pair(tb) if args.break_mode == "image-swap" else None
        if args.break_mode == "image-swap" and swap is None:
            raise ValueError(
                f"--break image-swap found no two images of the same size in different groups at step {step}; "
                "use more --prompts (with 5 or more, the 4 first-image sizes force a pair)"
            )
        t1 = time.perf_counter()
        with torch.no_grad():
            ref_lp = policy_logprobs(policy, reference, tb, args.temperature).cpu()
        adv, scores = _grpo_advantages(tb, negate=args.break_mode == "adv-sign")
        loss_fn = loss_fn_for(tb, old, adv, ref_lp)
        t2 = time.perf_counter()
        hidden = hidden_states(policy.model, tb, swap_images=swap)
        logp = selected_logprob(hidden, policy.head, tb, temperature=args.temperature)
        t3 = time.perf_counter()
        if step == 1:
            t_gates = time.perf_counter()
            rb = rollout_batch(policy, ro)
            with torch.no_grad():
                train_lp = policy_logprobs(policy, policy.model, tb, args.temperature, swap=swap)
            gates = [
                gate_layout(policy, rb, tb),
                gate_logprobs(old, train_lp.cpu(), rb, tb, dtype, policy.tokenizer),
                gate_masking(policy, ro, tb, hidden, loss_fn, args.temperature, args.seed),
                gate_ratio(logp, old, dtype),
            ]
            from .viz import draw_layout

            first_group = [b for b, g in enumerate(tb.group_ids) if g == tb.group_ids[0]]
            draw_layout(tb, out_dir / "smoke_layout.png", samples=first_group,
                        title=f"smoke: one group of the first step ({task.name}; text grey, image blue, scored targets red)")
            report["gates"] = [dict(name=g.name, ok=g.ok, detail=g.detail, data=g.data) for g in gates]
            timings["gates_s"] = time.perf_counter() - t_gates
            log("gates (before the first update):")
            for g in gates:
                log(g.line())
            if not all(g.ok for g in gates):
                log("a gate failed: no update was made")
                exit_code = 1
                break
            log(HEADER)
        t3b = time.perf_counter()
        loss = loss_fn(logp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        t4 = time.perf_counter()
        if step == 1:
            with torch.no_grad():
                after = policy_logprobs(policy, policy.model, tb, args.temperature, swap=swap).cpu()
            report["first_update_direction"] = _direction(tb, logp.detach().cpu(), after)
        m = loss_fn.metrics
        r = torch.tensor(ro.rewards)
        seconds = time.perf_counter() - t0
        metrics = dict(
            step=step, reward_mean=float(r.mean()), reward_std=float(r.std()) if r.numel() > 1 else 0.0,
            loss=float(loss.detach()), pg_loss=float(m["pg_loss"]), kl=float(m["kl_loss"]) if "kl_loss" in m else 0.0,
            clip_frac=float(m["pg_clipfrac"]), ppo_kl=float(m["ppo_kl"]),
            max_ratio_dev=float((logp.detach().cpu() - old).exp().sub(1).abs().max()),
            response_tokens=float(sum(x.numel() for x in ro.responses) / max(len(ro.responses), 1)),
            rejected=ro.rejected, tokens=tb.num_tokens, tokens_per_s=tb.num_tokens / seconds,
            rollout_s=ro.seconds, batch_s=t1 - t0 - ro.seconds, reference_s=t2 - t1, forward_s=t3 - t2,
            backward_s=t4 - t3b, seconds=seconds,
        )
        steps_out.append(metrics)
        log(_row(metrics, args.steps))
    timings["train_s"] = time.perf_counter() - t_train

    learning = _learning_check(task, args, steps_out, report.get("first_update_direction"))
    report["learning"] = learning
    if steps_out:
        log("learning: " + learning["detail"])
        if not learning["ok"]:
            exit_code = 1
        _draw_curves(steps_out, out_dir / "smoke_curves.png", task.name, args)
    timings["total_s"] = time.perf_counter() - t_start
    report["exit_code"] = exit_code
    (out_dir / "smoke_report.json").write_text(json.dumps(report, indent=2, default=str))
    log(f"{'PASSED' if exit_code == 0 else 'FAILED'} in {timings['total_s']:.0f}s; wrote {out_dir}/smoke_report.json"
        + (", smoke_curves.png" if steps_out else "") + ", smoke_layout.png")
    return exit_code


def _learning_check(task: Task, args, steps: list[dict], direction: Optional[float]) -> dict:
    """The update direction at step 1 (always, when rewards differ within a group), and
    the reward thresholds for colour runs of at least `LEARNING_MIN_STEPS` steps."""
    checks, ok = [], True
    if direction is None:
        checks.append("first-update direction: n/a (no reward spread within any group)")
    else:
        good = direction > 0
        ok &= good
        checks.append(f"first update {'raised' if good else 'LOWERED'} the log-probs of above-average answers "
                      f"(mean centred-reward x Δlogp = {direction:+.2e})")
    result = dict(direction=direction)
    if task.name == "colour" and len(steps) >= LEARNING_MIN_STEPS:
        start = steps[0]["reward_mean"]
        final = float(np.mean([s["reward_mean"] for s in steps[-LEARNING_WINDOW:]]))
        good = start <= LEARNING_MAX_START and final >= LEARNING_MIN_FINAL
        ok &= good
        checks.append(f"reward {start:.3f} at step 1 (need <= {LEARNING_MAX_START}) -> {final:.3f} over the last "
                      f"{LEARNING_WINDOW} steps (need >= {LEARNING_MIN_FINAL})")
        result.update(start_reward=start, final_reward=final)
    elif steps:
        checks.append(f"reward thresholds not applied ({task.name} task, {len(steps)} steps; they need the colour task and "
                      f">= {LEARNING_MIN_STEPS} steps)")
    result.update(ok=ok, detail="; ".join(checks) + (" -> OK" if ok else " -> FAILED"))
    return result


def _draw_curves(steps: list[dict], path: Path, task: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["step"] for s in steps]
    mean = np.array([s["reward_mean"] for s in steps])
    std = np.array([s["reward_std"] for s in steps])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    ax1.fill_between(x, mean - std, mean + std, alpha=0.2, color="#2c7fb8", linewidth=0)
    ax1.plot(x, mean, color="#2c7fb8", linewidth=1, label="mean reward")
    if len(x) >= LEARNING_WINDOW:
        smooth = np.convolve(mean, np.ones(LEARNING_WINDOW) / LEARNING_WINDOW, mode="valid")
        ax1.plot(x[LEARNING_WINDOW - 1 :], smooth, color="#08306b", linewidth=2, label=f"{LEARNING_WINDOW}-step mean")
    if task == "colour":
        ax1.axhline(0.25, color="grey", linestyle=":", linewidth=1, label="chance")
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_xlabel("GRPO step")
    ax1.set_ylabel("reward")
    ax1.legend(fontsize=8, loc="lower right")
    ax1.set_title(f"reward ({args.prompts} prompts x {args.samples} answers per step)", fontsize=10)
    ax2.plot(x, [s["kl"] for s in steps], color="#d95f0e", linewidth=1.5)
    ax2.set_xlabel("GRPO step")
    ax2.set_ylabel("k3 KL to the warm-up policy")
    ax2.set_title("KL", fontsize=10)
    fig.suptitle(f"rlk-mm smoke ({task}, seed {args.seed}" + (f", --break {args.break_mode}" if args.break_mode else "") + ")", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- command line
def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="a Geo3K folder (problems.jsonl + images), e.g. ../shared/geo3k; default: the colour task")
    p.add_argument("--model-path", help="a local Qwen2.5-VL checkpoint directory; default: a tiny random Qwen2.5-VL")
    p.add_argument("--steps", type=int, default=250, help="GRPO steps (default 250)")
    p.add_argument("--seed", type=int, default=0, help="seed of data, weights and sampling (default 0)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (Triton kernels on cuda; default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="model dtype (default float32)")
    p.add_argument("--out", default="smoke_out", help="output directory (default smoke_out/)")
    p.add_argument("--break", dest="break_mode", choices=BREAKS, help="inject a known bug to see the gates or the learning check catch it")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (default 16)")
    p.add_argument("--samples", type=int, default=4, help="answers per prompt, the GRPO group size (default 4)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts, also used to score them (default 1.0)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak Adam learning rate of the GRPO steps (default 3e-3; see --lr-warmup-steps and LR_FLOOR)")
    p.add_argument("--lr-warmup-steps", type=int, default=40, help="GRPO steps over which the learning rate ramps up linearly (default 40)")
    p.add_argument("--kl-coef", type=float, default=0.01, help="weight of the k3 KL to the warm-up policy (default 0.01)")
    p.add_argument("--warmup-steps", type=int, default=40, help="supervised warm-up steps with shuffled labels (default 40)")
    p.add_argument("--warmup-lr", type=float, default=2e-3, help="Adam learning rate of the warm-up (default 2e-3)")
    p.add_argument("--quiet", action="store_true", help="print nothing (the report is still written)")


def add_smoke_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `smoke` sub-command to an argparse sub-parser set."""
    p = subparsers.add_parser(
        "smoke",
        help="image-text GRPO smoke test: gates (layout, log-probs, masking, ratio) then training",
        description="Prove layout and log-prob parity and loss masking, then train a tiny Qwen2.5-VL with GRPO and check it learns.",
    )
    _add_arguments(p)
    p.set_defaults(func=run_smoke)
    return p


def _to_argv(args) -> list[str]:
    """The smoke options of `args` as command-line words (for the report and re-execution)."""
    words = []
    defaults = vars(parse_args([]))
    for key, value in vars(args).items():
        if key == "func" or key not in defaults or value == defaults[key]:
            continue
        flag = "--break" if key == "break_mode" else "--" + key.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    return words


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlk-mm smoke")
    _add_arguments(p)
    return p.parse_args(argv)


def keep_freed_memory() -> bool:
    """Ask glibc to serve big buffers from the heap and keep freed memory (mmap/munmap of
    the [rows, V] logits buffers on every step costs ~30% on 2 cores). Whether it took."""
    try:
        libc = ctypes.CDLL(None)
        return all(libc.mallopt(param, value) == 1 for param, value in MALLOPT.values())
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False


if __name__ == "__main__":
    sys.exit(run_smoke(parse_args()))
