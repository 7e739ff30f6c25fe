"""Exactly on-policy rollouts of a supported Qwen-VL model (``rlk_mm.models.family``): ``generate_on_policy``.

The model decodes step by step with transformers' KV cache, under ``batch_invariant()`` by
default, and every token is drawn by ``ops.sample_from_hidden`` from the final hidden
state, so its log-prob is ``selected_logprob``'s by construction. Under the mode a
token's hidden state does not depend on the batch, the padding, the cache or the step at
which its neighbours stopped, so the returned log-probs are bitwise those of a training
forward (``forward_hidden`` + ``selected_logprob``, i.e. ``batch_logprobs``, packed or
padded) of the returned ``RLBatch`` under ``batch_invariant()``: the old-log-prob
recompute can be skipped, and importance ratios are exactly 1 at the first update.

One decode step is batched over the live rows (no loop over samples): a row that stops
leaves the batch (the cache keeps the others), a prompt repeated ``samples_per_prompt``
times is prefilled once and its cache repeated, and a row that draws a token no RLBatch can
score (a media placeholder, or a padded head's row past the tokenizer's vocabulary) stops and
is left out of the returned batch (``rejected``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..ops.invariant.mode import BACKENDS, active_backend, batch_invariant_active, within_batch_invariant
from ..ops.sampling import group_seeds, sample_from_hidden
from ..schema import Choice, RLBatch
from ..schema.checks import (
    INTEGER_DTYPES,
    bool_arg,
    float_arg,
    group_id_list,
    int_arg,
    sequence_arg,
    temperature_arg,
    tensor_arg,
)
from .decode import media_rows, prefill
from .family import check_processor_family, model_family
from .forward import cache_keyword, check_inputs, language_inputs
from .static_decode import decode_static
from .vision_cache import VisionCache

__all__ = ["DecodeLoop", "generate_on_policy", "Kernels", "OnPolicyRollout"]


class Kernels(Choice):
    """The kernels a rollout decodes with."""

    INVARIANT = "invariant"  # batch_invariant(): log-probs bitwise those of a training forward under the mode
    DEFAULT = "default"  # the model's own kernels (the control: rollout and training drift apart)


class DecodeLoop(Choice):
    """How a rollout's decode steps run (the tokens and log-probs are the same bits either way)."""

    AUTO = "auto"  # static on CUDA, eager on the CPU
    STATIC = "static"  # a static KV cache, every row to the end; on CUDA one CUDA graph replayed per token
    EAGER = "eager"  # transformers' dynamic cache; rows that stop leave the batch


@dataclass
class OnPolicyRollout:
    """What ``generate_on_policy`` returns; row ``r`` of the rollout is answer ``r %
    samples_per_prompt`` to prompt ``r // samples_per_prompt``.

    ``batch`` holds the kept rows (``rows``) as one training ``RLBatch``: prompt + response,
    the response scored (its loss span), the positions the model was fed, the media
    repeated per row (equal ``media_cache_keys``: ``VisionCache`` encodes each once) and
    ``group_ids`` (one group per prompt). ``log_probs`` (fp32, one per response token,
    under ``softmax(logits / temperature)``) are in the batch's loss-token order and equal
    the training log-probs of ``batch`` bitwise under the same kernels; ``sampled_log_probs``
    are under the truncated distribution each token was drawn from (top-k / top-p)."""

    batch: Optional[RLBatch]  # None when every row was rejected
    rows: list[int]  # the rollout row of each sample of ``batch``
    responses: list[torch.Tensor]  # int64 per kept row, the stop token included
    log_probs: list[torch.Tensor]  # fp32 per kept row
    sampled_log_probs: list[torch.Tensor]  # fp32 per kept row
    stopped: list[bool]  # per kept row: ended with a stop token (else max_new_tokens)
    rejected: list[int]  # rollout rows that drew a media placeholder or an id past the tokenizer's vocabulary
    seeds: torch.Tensor  # int64 [B * samples_per_prompt]: the sampling stream of every row
    kernels: Kernels
    steps: int  # decode steps run
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)

    @property
    def flat_log_probs(self) -> torch.Tensor:
        """All kept rows' log-probs, concatenated (the batch's loss-token order)."""
        return torch.cat(self.log_probs) if self.log_probs else torch.zeros(0)

    def texts(self, tokenizer, *, skip_special_tokens: bool = True) -> list[str]:
        """The kept rows' responses as text."""
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"tokenizer must have a decode method (the processor's tokenizer), got "
                            f"{type(tokenizer).__name__}")
        skip_special_tokens = bool_arg("skip_special_tokens", skip_special_tokens)
        return [tokenizer.decode(r.tolist(), skip_special_tokens=skip_special_tokens) for r in self.responses]

    def set_rewards(self, rewards) -> RLBatch:
        """Give ``batch`` one reward per sample (finite numbers; checked as every RLBatch field
        is); returns the new batch, also stored in ``batch``."""
        if self.batch is None:
            raise ValueError("set_rewards: every row was rejected, there is no batch to reward")
        if isinstance(rewards, torch.Tensor):
            tensor_arg("rewards", rewards, ndim=1)
            if not rewards.dtype.is_floating_point and rewards.dtype not in INTEGER_DTYPES:
                raise TypeError(f"rewards must be a float or integer tensor, got {rewards.dtype}")
            if rewards.is_meta:
                raise ValueError("rewards is on the meta device (no values); pass a CPU or CUDA tensor or a list")
            rewards = rewards.detach().to("cpu", torch.float64).tolist()
        if isinstance(rewards, (set, frozenset)):
            raise TypeError("rewards must be in row order (a list or tuple, one number per kept row), got a set")
        rewards = sequence_arg("rewards", rewards, "one number per sample")
        if len(rewards) != self.batch.num_samples:
            raise ValueError(f"rewards has {len(rewards)} entries but the batch has {self.batch.num_samples} samples: "
                             "one reward per kept row (rollout.rows)")
        rewards = [_reward(i, r) for i, r in enumerate(rewards)]
        fields = {name: getattr(self.batch, name) for name in type(self.batch).model_fields}
        fields["rewards"] = torch.tensor(rewards, dtype=torch.float32, device=self.batch.device)
        self.batch = RLBatch(**fields)
        return self.batch


# --------------------------------------------------------------------------- arguments
_MAX_NEW_TOKENS = 1 << 20  # a response buffer per row; larger asks are typos (an allocator error before)
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _reward(i: int, value) -> float:
    """``rewards[i]`` as a finite float that float32 (the batch's reward dtype) holds."""
    try:
        r = float_arg(f"rewards[{i}]", value)
    except OverflowError:
        r = math.inf
    if abs(r) > _FLOAT32_MAX:
        raise ValueError(f"rewards[{i}]={value!r:.40} is beyond float32's range (|r| <= {_FLOAT32_MAX:.4g}): rewards are "
                         "stored as float32; rescale them")
    return r


def _prompt_batch(prompts, processor) -> RLBatch:
    """The prompts as one prompt-only RLBatch (its positions are the ones fed)."""
    if isinstance(prompts, RLBatch):
        if prompts.loss_spans.starts.numel():
            raise ValueError("prompts is an RLBatch with loss spans (responses): pass the prompts only, e.g. "
                             "RLBatch.from_qwen_vl(processor_output, processor=processor)")
        return prompts
    if isinstance(prompts, Mapping):
        return RLBatch.from_qwen_vl(prompts, processor=processor)
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(c, (list, tuple)) for c in prompts):
        return RLBatch.from_messages(list(prompts), processor=processor)
    raise TypeError(f"prompts must be a processor output (a mapping with input_ids, attention_mask, pixel_values, "
                    "...), a "
                    f"list of chat conversations, or a prompt-only RLBatch; got {type(prompts).__name__}")


def _stop_ids(stop_token_ids, model, processor, vocab: int) -> list[int]:
    if stop_token_ids is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(model.config.text_config, "eos_token_id", None)
        if eos is None and processor is not None:
            eos = processor.tokenizer.eos_token_id
        stop_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if isinstance(stop_token_ids, int):
        stop_token_ids = [stop_token_ids]
    ids = list(sequence_arg("stop_token_ids", stop_token_ids, "token ids (ints)"))
    for i, t in enumerate(ids):
        int_arg(f"stop_token_ids[{i}]", t, min=0, max=vocab - 1)
    return [int(t) for t in ids]


def _row_seeds(seeds, seed, step, group_ids: list, rows: int) -> torch.Tensor:
    if (seeds is None) == (seed is None):
        raise ValueError("give one of seeds (an int64 tensor, one seed per rollout row: B * samples_per_prompt) or "
                         "seed "
                         "(an int: each row's stream is then ops.group_seeds(seed, group ids, step))")
    if seed is not None:
        return group_seeds(int_arg("seed", seed), group_ids, int_arg("step", step, min=0))
    tensor_arg("seeds", seeds, ndim=1, dtypes=INTEGER_DTYPES)
    if seeds.numel() != rows:
        raise ValueError(f"seeds has {seeds.numel()} entries but the rollout has {rows} rows (prompts x "
                         "samples_per_prompt): "
                         "one seed per row, e.g. ops.group_seeds(seed, group_ids, step)")
    return seeds.detach().to("cpu", torch.int64)


# --------------------------------------------------------------------------- the rollout
def generate_on_policy(
    model,
    prompts,
    *,
    processor,
    max_new_tokens: int,
    samples_per_prompt: int = 1,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seeds: Optional[torch.Tensor] = None,
    seed: Optional[int] = None,
    step: int = 0,
    stop_token_ids: Optional[Sequence[int]] = None,
    group_ids: Optional[Sequence] = None,
    kernels: Kernels | str = Kernels.INVARIANT,
    backend=None,
    vision_cache: Optional[VisionCache] = None,
    loop: DecodeLoop | str = DecodeLoop.AUTO,
) -> OnPolicyRollout:
    """Decode ``samples_per_prompt`` answers to each prompt with a KV cache, drawing every
    token with ``sample_from_hidden`` from the final hidden state, so the rollout's log-probs
    are bitwise the training log-probs of the returned batch under ``batch_invariant()``.

    Parameters
    ----------
    model : a supported Qwen-VL model (``rlk_mm.models.family``)
        The policy; not changed (runs under ``torch.no_grad()``).
    prompts : processor output, list of chat conversations, or RLBatch
        The model's processor output (either padding side), conversations in
        ``RLBatch.from_messages``' form, or a prompt-only ``RLBatch``.
    processor : the model's processor
        It builds the returned batch; a processor of another family is refused.
    max_new_tokens : int >= 1
        Tokens per answer at most.
    samples_per_prompt : int >= 1
        Answers per prompt (G); rows are prompt-major: row ``r`` answers prompt ``r // G``.
        Each prompt is prefilled once and its cache repeated.
    temperature, top_k, top_p : sampling settings
        ``temperature >= MIN_TEMPERATURE``; ``top_k >= 1``; ``top_p`` in (0, 1].
    seeds : int tensor ``[B * G]``, optional
        One sampling stream per row; each draw is a pure function of its row's seed and step.
    seed, step : int, optional
        Instead of ``seeds``: ``group_seeds(seed, group ids, step)``.
    stop_token_ids : ints, optional
        A row stops after one of them (default: the model's EOS ids).
    group_ids : one per prompt, optional
        The GRPO groups (default ``"0"``, ``"1"``, ...).
    kernels : "invariant" or "default"
        ``"invariant"``: ``batch_invariant(backend)`` (inside an active block, that block);
        ``"default"``: the model's own kernels (the control, which drifts).
    backend : None, "torch" or "triton"
        ``batch_invariant``'s backend; None with ``kernels="default"``.
    vision_cache : VisionCache, optional
        A ``VisionCache`` of ``model`` for the prompts' media (default: the vision tower on
        the prompts' pixels).
    loop : "auto", "static" or "eager"
        ``"static"``: a preallocated KV cache and every row decoded to the end, on CUDA one
        CUDA graph per step replayed per token (``rlk_mm.models.static_decode``); ``"eager"``:
        transformers' dynamic cache, rows that stop leave the batch; ``"auto"``: static on
        CUDA, eager on the CPU. Both give the same tokens and log-probs bitwise.

    Returns
    -------
    OnPolicyRollout
        Responses, log-probs (``batch``'s loss-token order) and the training ``RLBatch``.

    Raises
    ------
    TypeError, ValueError
        A bad argument, named (before any forward).
    """
    family = model_family(model)
    if processor is None or not callable(getattr(processor, "apply_chat_template", None)):
        raise TypeError(f"processor must be the model's {family.label} processor (it builds the returned RLBatch), "
                        f"got {type(processor).__name__}")
    check_processor_family(family, processor)
    kernels = Kernels.parse(kernels, "kernels")
    loop = DecodeLoop.parse(loop, "loop")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'torch' or 'triton' (batch_invariant's), got {backend!r}")
    if kernels is Kernels.DEFAULT and backend is not None:
        raise ValueError("backend picks the batch-invariant kernels; with kernels='default' leave it None")
    if batch_invariant_active():  # the mode is process-wide: inside it, only the invariant kernels can run
        if kernels is Kernels.DEFAULT:
            raise ValueError("kernels='default' inside an active batch_invariant() block: the block's invariant kernels "
                             "would run, not the model's own; call generate_on_policy outside the block for the "
                             "default-kernels control, or pass kernels='invariant'")
        if backend is not None and active_backend() is not None and str(backend) != active_backend():
            raise ValueError(f"backend={str(backend)!r} inside an active batch_invariant(backend={active_backend()!r}) "
                             "block: the block's backend would run; leave backend None inside the block, or call "
                             "generate_on_policy outside it")
    max_new_tokens = int_arg("max_new_tokens", max_new_tokens, min=1, max=_MAX_NEW_TOKENS)
    samples_per_prompt = int_arg("samples_per_prompt", samples_per_prompt, min=1)
    temperature = temperature_arg(temperature)
    top_k = None if top_k is None else int_arg("top_k", top_k, min=1)
    top_p = None if top_p is None else float_arg("top_p", top_p, min=0.0, max=1.0, min_open=True)
    if vision_cache is not None:
        if not isinstance(vision_cache, VisionCache):
            raise TypeError(f"vision_cache must be a VisionCache (or None), got {type(vision_cache).__name__}")
        if vision_cache.model is not model:
            raise ValueError("vision_cache runs another model: pass a VisionCache(model) of the model that decodes")
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0]
    stop = _stop_ids(stop_token_ids, model, processor, vocab)
    device = model.get_input_embeddings().weight.device
    prompt_batch = _prompt_batch(prompts, processor)
    if prompt_batch.device != device:
        prompt_batch = prompt_batch.to(device)
    check_inputs(model, prompt_batch)
    n_prompts = prompt_batch.num_samples
    if n_prompts == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    if group_ids is None:
        prompt_groups = [str(b) for b in range(n_prompts)]
    else:
        prompt_groups = group_id_list(group_ids)
        if len(prompt_groups) != n_prompts:
            raise ValueError(f"group_ids has {len(prompt_groups)} entries but there are {n_prompts} prompts: one per "
                             "prompt")
    rows = n_prompts * samples_per_prompt
    row_groups = [g for g in prompt_groups for _ in range(samples_per_prompt)]
    row_seeds = _row_seeds(seeds, seed, step, row_groups, rows)
    media_ids = {model.config.image_token_id, model.config.video_token_id}

    start = time.perf_counter()
    invariant = kernels is Kernels.INVARIANT
    # what runs: the invariant kernels' backend (the block's inside one; Triton on CUDA, torch elsewhere), else None
    block = active_backend() if active_backend() != "auto" else None  # "auto" picks by device, as below
    ran = (str(backend or block or ("triton" if device.type == "cuda" else "torch"))) if invariant else None
    static = loop is DecodeLoop.STATIC or (loop is DecodeLoop.AUTO and device.type == "cuda")
    with torch.no_grad(), (within_batch_invariant(backend) if invariant else contextlib.nullcontext()):
        tokens, logps, sampled, lengths, ended, steps = _decode(
            model, prompt_batch, samples_per_prompt, row_seeds.to(device), vision_cache, max_new_tokens, stop,
            sorted(media_ids), _tokenizer_vocab(processor, vocab), dict(temperature=temperature, top_k=top_k,
                                                                        top_p=top_p),
            static=static, invariant=invariant)
    seconds = time.perf_counter() - start
    return _assemble(processor, prompt_batch, samples_per_prompt, row_groups, tokens, logps, sampled, lengths, ended,
                     row_seeds, kernels, steps, seconds, media_ids,
                     dict(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
                          samples_per_prompt=samples_per_prompt, stop_token_ids=stop, step=step,
                          loop=str(DecodeLoop.STATIC if static else DecodeLoop.EAGER), backend=ran))


def _tokenizer_vocab(processor, head_rows: int) -> int:
    """The number of token ids an RLBatch accepts: the tokenizer's (a padded head has more rows)."""
    tokenizer = getattr(processor, "tokenizer", None)
    return min(head_rows, len(tokenizer)) if tokenizer is not None else head_rows


def _decode(model, prompt_batch: RLBatch, G: int, seeds: torch.Tensor, vision_cache, max_new_tokens: int,
            stop: list[int], media: list[int], vocab: int, sampling: dict, *, static: bool, invariant: bool):
    """The prefill, then the eager decode loop or (``static``) ``static_decode.decode_static``.
    Returns ([rows, steps] tokens, log-probs, sampled log-probs, per-row response lengths,
    per-row end reason (0 max tokens, 1 stop token, 2 an unscorable token: a media placeholder or
    an id >= ``vocab``), steps)."""

    lm = model.model.language_model
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    bias = getattr(head, "bias", None)
    device = embed.weight.device
    pad = getattr(model.config.text_config, "pad_token_id", None) or 0
    key = cache_keyword(lm)
    family = model_family(model)
    lm_inputs = language_inputs(model, prompt_batch, media_rows(model, family, prompt_batch, vision_cache), family=family)
    out, cache, mask, _, _ = prefill(lm, prompt_batch, lm_inputs, prompt_batch.seq_lengths().tolist())
    hidden = out[:, -1]  # left padding: every prompt's last token is the last column
    # the next text position of each prompt: one past its largest M-RoPE position
    sample = torch.repeat_interleave(torch.arange(prompt_batch.num_samples, device=device),
                                     prompt_batch.seq_lengths().to(device))
    top = torch.full((prompt_batch.num_samples,), -1, dtype=torch.int64, device=device)
    top = top.scatter_reduce(0, sample, prompt_batch.position_ids.amax(0), reduce="amax")
    if G > 1:  # each prompt prefilled once: its cache, last hidden state, mask and positions repeated per answer
        cache.batch_repeat_interleave(G)
        hidden, mask, top = (t.repeat_interleave(G, dim=0) for t in (hidden, mask, top))
    if static:
        return decode_static(model, hidden, cache, mask.sum(1), top, seeds, max_new_tokens, stop, media, vocab, sampling,
                             invariant=invariant, graphs=device.type == "cuda" and family.graph_capture)
    rows = hidden.shape[0]
    live = torch.arange(rows, device=device)
    tokens = torch.full((rows, max_new_tokens), pad, dtype=torch.int64, device=device)
    logps = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
    sampled = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.full((rows,), max_new_tokens, dtype=torch.int64, device=device)
    ended = torch.zeros((rows,), dtype=torch.int64, device=device)
    stop_t = torch.tensor(stop, dtype=torch.int64, device=device)
    media_t = torch.tensor(media, dtype=torch.int64, device=device)
    steps = 0
    for k in range(max_new_tokens):
        draw = sample_from_hidden(hidden, head.weight, bias=bias, seeds=seeds[live], step=k, **sampling)
        tokens[live, k], logps[live, k], sampled[live, k] = draw.tokens, draw.log_probs, draw.sampled_log_probs
        steps = k + 1
        is_stop = torch.isin(draw.tokens, stop_t)
        is_media = torch.isin(draw.tokens, media_t) | (draw.tokens >= vocab)  # no RLBatch can score these
        done = is_stop | is_media
        lengths[live[done]] = k + 1
        ended[live[done]] = torch.where(is_media[done], 2, 1)
        if k + 1 == max_new_tokens:
            break
        keep = torch.nonzero(~done).flatten()
        if keep.numel() == 0:
            break
        if keep.numel() < live.numel():  # rows that stopped leave the batch and the cache
            cache.batch_select_indices(keep)
            live, mask, top, fed = live[keep], mask[keep], top[keep], draw.tokens[keep]
        else:
            fed = draw.tokens
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        position = (top + 1 + k).view(1, -1, 1).expand(3, -1, 1)
        out = lm(inputs_embeds=embed(fed)[:, None], attention_mask=mask, position_ids=position, use_cache=True,
                 **{key: cache})
        hidden = out.last_hidden_state[:, -1]
    return tokens, logps, sampled, lengths, ended, steps


def _assemble(processor, prompt_batch: RLBatch, G: int, row_groups: list, tokens, logps, sampled, lengths, ended,
              seeds, kernels: Kernels, steps: int, seconds: float, media_ids: set, settings: dict) -> OnPolicyRollout:
    """The kept rows as one training RLBatch (positions as fed), and the per-row results."""
    tokens, logps, sampled = tokens.cpu(), logps.cpu(), sampled.cpu()
    lengths, ended = lengths.cpu().tolist(), ended.cpu().tolist()
    rows = len(lengths)
    kept = [r for r in range(rows) if ended[r] != 2]
    rejected = [r for r in range(rows) if ended[r] == 2]
    responses = [tokens[r, : lengths[r]] for r in kept]
    batch = None
    if kept:
        repeated = prompt_batch.select([r // G for r in kept])
        cu = repeated.cu_seqlens.long().tolist()
        prompt_ids = [repeated.input_ids[cu[i] : cu[i + 1]].cpu() for i in range(len(kept))]
        positions = []
        for i, response in enumerate(responses):
            prompt_pos = repeated.position_ids[:, cu[i] : cu[i + 1]].cpu()
            nxt = int(prompt_pos.max()) + 1
            positions.append(torch.cat([prompt_pos, torch.arange(nxt, nxt + response.numel()).expand(3, -1)], dim=1))
        batch = RLBatch.from_token_lists(
            [p.tolist() for p in prompt_ids], [r.tolist() for r in responses], processor=processor,
            image_grid_thw=repeated.image_grid_thw, pixel_values=repeated.pixel_values,
            video_grid_thw=repeated.video_grid_thw, pixel_values_videos=repeated.pixel_values_videos,
            second_per_grid_ts=repeated.second_per_grid_ts, position_ids=positions,
            group_ids=[row_groups[r] for r in kept], media_ids=list(repeated.media_ids) or None,
            media_cache_keys=list(repeated.media_cache_keys) or None,
        ).to(prompt_batch.device)
    return OnPolicyRollout(
        batch=batch, rows=kept, responses=responses, log_probs=[logps[r, : lengths[r]] for r in kept],
        sampled_log_probs=[sampled[r, : lengths[r]] for r in kept], stopped=[ended[r] == 1 for r in kept],
        rejected=rejected, seeds=seeds, kernels=kernels, steps=steps, seconds=seconds, settings=settings,
    )
