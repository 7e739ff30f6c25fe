"""The rollout: G answers per prompt from ``generate_on_policy``, with each token's
log-prob and the positions it was fed, and the two batches the gates compare (the
rollout's record and the trainer's, with the `loss-shift` bug)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from ..fixtures import Sample, processor_inputs
from ..models.rollout import generate_on_policy
from ..ops.sampling import group_seeds
from ..schema import RLBatch, SpanTable
from .policy import Policy
from .tasks import Task

__all__: list[str] = []


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


def rollout(policy: Policy, task: Task, prompts: list[Sample], G: int, *, temperature: float, generator, step: int,
            kernels: str = "invariant") -> Rollout:
    """G answers per prompt from ``generate_on_policy`` (KV cache; under ``batch_invariant()``
    unless ``kernels="default"``), each token's log-prob and the positions it was fed."""
    start = time.perf_counter()
    groups = [f"{step}:{s.id}" for s in prompts]
    inputs = processor_inputs(policy.processor, prompts, padding_side="left")
    # one stream per answer: the run's generator gives the step's seed, group_seeds one per group member
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    seeds = group_seeds(seed, [g for g in groups for _ in range(G)], step)
    out = generate_on_policy(policy.model, inputs, processor=policy.processor, max_new_tokens=task.max_new_tokens,
                             samples_per_prompt=G, temperature=temperature, seeds=seeds, stop_token_ids=policy.eos_ids,
                             group_ids=groups, kernels=kernels)
    rows = [r // G for r in out.rows]
    kept = [prompts[b] for b in rows]
    texts = out.texts(policy.tokenizer)
    batch = out.batch
    cu = batch.cu_seqlens.long().tolist() if batch is not None else [0]
    prompt_ids = [batch.input_ids[cu[i] : cu[i + 1] - len(r)].cpu() for i, r in enumerate(out.responses)]
    positions = [batch.position_ids[:, cu[i] : cu[i + 1]].cpu() for i in range(len(out.responses))]
    return Rollout(
        samples=kept,
        group_ids=[groups[b] for b in rows],
        inputs=_take_rows(inputs, prompts, rows),
        prompt_ids=prompt_ids,
        responses=out.responses,
        logprobs=out.log_probs,
        positions=positions,
        texts=texts,
        rewards=[task.reward(t, s) for t, s in zip(texts, kept)],
        rejected=len(out.rejected),
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
