"""The policy: a tiny Qwen2.5-VL or Qwen3-VL (or a checkpoint) with the real processor, the hooks that
encode a GRPO group's repeated images once, the training-side forward and
log-probs (with the `image-swap` bug), and the supervised warm-up on the answer format."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np
import torch
from torch import Tensor

from .. import fixtures
from ..fixtures import processor_inputs
from ..models.forward import forward_hidden
from ..ops import selected_logprob
from ..progress import eta
from ..schema import Modality, RLBatch
from .tasks import Task

__all__: list[str] = []

TINY_MODEL = dict(hidden_size=128, num_layers=2, vision_depth=1, vision_hidden_size=64)
"""The default policy: text hidden 128 (64 stalls near 0.7 reward), one vision block of
width 64 (32 learned slower and less surely)."""


@dataclass
class Policy:
    """The model under training, its processor, and where and in which dtype it runs."""

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


#: the smoke test's model families (``--model``): the fixtures' processor and tiny policy, and the
#: transformers class a ``--model-path`` checkpoint loads with
SMOKE_MODELS = {
    "qwen2.5-vl": ("qwen_vl_processor", "tiny_qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3-vl": ("qwen3_vl_processor", "tiny_qwen3_vl", "Qwen3VLForConditionalGeneration"),
}


def load_policy(model_path, seed: int, device: torch.device, dtype: torch.dtype, tiny: Optional[Mapping] = None,
                model: str = "qwen2.5-vl") -> Policy:
    """The real processor of the ``model`` family (a ``SMOKE_MODELS`` key) and its tiny random
    policy (``tiny``: its sizes, default ``TINY_MODEL``), or a local checkpoint of that family."""
    if model not in SMOKE_MODELS:
        raise ValueError(f"model={model!r}: expected one of {', '.join(SMOKE_MODELS)}")
    make_processor, make_tiny, checkpoint_class = SMOKE_MODELS[model]
    if model_path:
        import transformers

        processor = getattr(fixtures, make_processor)(model_path)
        policy_model = getattr(transformers, checkpoint_class).from_pretrained(model_path, dtype=dtype, local_files_only=True)
    else:
        processor = getattr(fixtures, make_processor)()
        policy_model = getattr(fixtures, make_tiny)(seed, **(TINY_MODEL if tiny is None else tiny)).to(dtype)
    model = policy_model.to(device).eval()
    distinct = _DistinctImages(model.config.vision_config.spatial_merge_size)
    model.model.visual.register_forward_pre_hook(distinct.before, with_kwargs=True)
    model.model.visual.register_forward_hook(distinct.after, with_kwargs=True)
    return Policy(model, processor, device, dtype)


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
        if getattr(output, "deepstack_features", None) is not None:  # Qwen3-VL: each DeepStack level's rows too
            output.deepstack_features = [feature[rows] for feature in output.deepstack_features]
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


def hidden_states(model, batch: RLBatch, *, swap_images: Optional[tuple[int, int]] = None) -> Tensor:
    """Last hidden states [T, H] of the batch's tokens from a right-padded forward (no logits).

    `swap_images=(i, j)`: the `image-swap` bug: items i and j (same grid) trade their
    vision-tower input, so each sample attends to the other's image embeddings."""
    if swap_images is not None and batch.pixel_values is not None:
        swapped = _swap_image_rows(batch.pixel_values, batch.image_grid_thw, *swap_images)
        batch = batch.model_copy(update={"pixel_values": swapped})
    return forward_hidden(model, batch, padding="right")


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


def warm_up(policy: Policy, task: Task, rng: random.Random, *, steps: int, prompts: int, lr: float, log) -> list[float]:
    """Supervised steps on the answer format with shuffled labels: the policy learns to
    answer with a label word and stop, but not which label fits the image."""
    model = policy.model
    model.requires_grad_(True)
    model.get_input_embeddings().weight.requires_grad_(False)  # the answer format needs the head, not the embeddings
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    losses, times = [], []
    start = time.perf_counter()
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
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        if step % 10 == 0 or step == steps - 1:
            log(f"  warm-up step {step + 1:>3}/{steps}: loss {losses[-1]:.3f}, ETA {eta(times, steps - step - 1)}")
    return losses
