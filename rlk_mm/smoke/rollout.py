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
from ..ops.sampling import group_seeds, sample
from ..schema import RLBatch, SpanTable
from .policy import Policy
from .tasks import Task

__all__ = ["Rollout", "rollout", "rollout_batch", "SeededSampler", "training_batch"]


class SeededSampler:
    """A logits processor that draws each row's token with `rlk_mm.ops.sample` (the row's own
    seeded stream, decoding step by step) and records its log-prob; it returns scores whose
    argmax is the draw, so greedy `generate` keeps its KV cache, stopping rules and bookkeeping."""

    def __init__(self, temperature: float, seeds: Tensor):
        self.temperature = temperature
        self.seeds = seeds
        self.logprobs: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        drawn = sample(scores, temperature=self.temperature, seeds=self.seeds, step=len(self.logprobs))
        self.logprobs.append(drawn.log_probs)
        return scores.fill_(-math.inf).scatter_(1, drawn.tokens[:, None], 0.0)


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


_MEDIA_INPUTS = (("pixel_values", "image_grid_thw", "images"), ("pixel_values_videos", "video_grid_thw", "videos"))
"""(pixel rows, grids, the `Sample` attribute) of each media kind in a processor output."""


def _take_rows(inputs: dict, samples: list[Sample], rows: list[int]) -> dict:
    """Rows `rows` (indices into `samples`, repeats allowed) of a processor output, with
    their images' and videos' pixel rows, grids and seconds per temporal patch."""
    out = {k: inputs[k][rows] for k in ("input_ids", "attention_mask", "mm_token_type_ids") if k in inputs}
    for pixels, grids, kind in _MEDIA_INPUTS:
        if inputs.get(grids) is None:
            continue
        grid = inputs[grids]
        chunks = torch.split(inputs[pixels], grid.prod(-1).tolist())
        owner = [b for b, s in enumerate(samples) for _ in getattr(s, kind)]
        order = [k for b in rows for k in range(len(owner)) if owner[k] == b]
        out[pixels] = torch.cat([chunks[k] for k in order])
        out[grids] = grid[order]
        if kind == "videos" and inputs.get("second_per_grid_ts") is not None:
            out["second_per_grid_ts"] = inputs["second_per_grid_ts"][order]
    return out


@torch.no_grad()
def rollout(policy: Policy, task: Task, prompts: list[Sample], G: int, *, temperature: float, generator, step: int) -> Rollout:
    """G answers per prompt with the model's own `generate` (KV cache, temperature sampling)."""
    from transformers import GenerationConfig, LogitsProcessorList

    start = time.perf_counter()
    model, tok = policy.model, policy.tokenizer
    rows = [s for s in prompts for _ in range(G)]
    groups = [f"{step}:{s.id}" for s in rows]
    inputs = _take_rows(processor_inputs(policy.processor, prompts, padding_side="left"), prompts, [b for b in range(len(prompts)) for _ in range(G)])
    # one stream per answer: the run's generator gives the step's seed, group_seeds one per group member
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    sampler = SeededSampler(temperature, group_seeds(seed, groups, step).to(policy.device))
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
        inputs=_take_rows(inputs, rows, keep),
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
        video_grid_thw=ro.inputs.get("video_grid_thw"),
        pixel_values_videos=ro.inputs.get("pixel_values_videos"),
        second_per_grid_ts=ro.inputs.get("second_per_grid_ts"),
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
