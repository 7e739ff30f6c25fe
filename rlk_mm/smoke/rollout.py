"""The rollout: G answers per prompt from the model's own `generate`, with each token's
log-prob and the positions it was fed, and the two batches the gates compare (the
rollout's record and the trainer's, with the `loss-shift` bug)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from ..fixtures import Sample, processor_inputs
from ..schema import RLBatch, SpanTable
from .policy import Policy
from .tasks import Task


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
