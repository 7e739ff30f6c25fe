"""The fast decode loop of ``generate_on_policy``: a static KV cache, and on CUDA one CUDA graph per step.

Every row stays in the batch to the end (a row that stopped keeps decoding into columns no one
reads), so every step has the same shapes and needs no host read: each layer's keys and values
sit in one preallocated ``[rows, kv heads, capacity, head dim]`` buffer, step ``k`` writes
column ``width + k``, and the attention reads row ``b``'s keys ``[first_key[b], first_key[b] +
keys[b])``. Under ``batch_invariant()`` those ranges are ``DecodeSegments`` (device lengths), the
same segments the eager loop's masks give, so the same bits: a token's hidden state, draw and
log-prob equal the eager loop's and the training forward's. With the model's own kernels (the
control) the ranges become a boolean mask.

On CUDA the step (every layer, ``sample_from_hidden``, the stop checks and the writes) is
captured once per rollout, after ``WARMUP_STEPS`` eager steps (which compile the kernels), and
replayed per token; the loop reads the device once every ``CHECK_EVERY`` steps to end early. On
the CPU the same step runs eagerly.
"""

from __future__ import annotations

import contextlib

import torch

from ..ops.invariant.attention import DecodeSegments
from ..ops.sampling import sample_from_hidden
from .forward import cache_keyword

__all__: list[str] = []

#: eager steps before the capture: the first compiles the kernels, the second runs them warm
WARMUP_STEPS = 2
#: replays between the loop's reads of "has every row stopped?" (its only host reads)
CHECK_EVERY = 16


class StaticKV:
    """transformers' KV-cache interface (``update``) over preallocated per-layer buffers: a
    step's key and value go to column ``column`` (an int64 device tensor ``[1]`` the loop
    sets), and the attention gets the whole buffer with the ranges of the step's mask."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], column: torch.Tensor, width: int):
        self.keys, self.values, self.column, self.width = keys, values, column, width  # width: the prefill's columns

    @classmethod
    def from_prefill(cls, cache, capacity: int) -> "StaticKV":
        """The prefill's ``DynamicCache`` copied into buffers of ``capacity`` columns."""
        layers = getattr(cache, "layers", None)
        pairs = ([(layer.keys, layer.values) for layer in layers] if layers is not None
                 else list(zip(cache.key_cache, cache.value_cache)))
        keys, values = [], []
        for k, v in pairs:
            width = k.shape[2]
            if width > capacity:
                raise ValueError(f"the prefill holds {width} columns, more than the cache's capacity of {capacity}")
            for source, out in ((k, keys), (v, values)):
                buffer = source.new_zeros((*source.shape[:2], capacity, source.shape[3]))
                buffer[:, :, :width] = source
                out.append(buffer)
        return cls(keys, values, torch.zeros(1, dtype=torch.int64, device=keys[0].device), pairs[0][0].shape[2])

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx].index_copy_(2, self.column, key)
        self.values[layer_idx].index_copy_(2, self.column, value)
        return self.keys[layer_idx], self.values[layer_idx]


def language_step(lm, embeds: torch.Tensor, positions: torch.Tensor, masks: list, cache: StaticKV,
                  keyword: str) -> torch.Tensor:
    """One token per row through the language model, as its own forward runs a decode step
    (rotary embeddings of ``positions``, every decoder layer against ``cache``, passed by
    ``keyword``, the final norm), with ``masks[i]`` layer ``i``'s mask. No DeepStack: decoded
    tokens are text. Returns the last hidden states ``[rows, H]``."""
    position_embeddings = lm.rotary_emb(embeds, positions)
    hidden = embeds
    for layer, mask in zip(lm.layers, masks):
        out = layer(hidden, attention_mask=mask, position_ids=None, position_embeddings=position_embeddings,
                    **{keyword: cache})
        hidden = out[0] if isinstance(out, tuple) else out
    return lm.norm(hidden)[:, -1]


def decode_static(model, hidden: torch.Tensor, cache, prompt: torch.Tensor, top: torch.Tensor, seeds: torch.Tensor,
                  max_new_tokens: int, stop: list[int], media: list[int], vocab: int, sampling: dict, *,
                  invariant: bool, graphs: bool):
    """The decode after the prefill. ``hidden`` ``[rows, H]``: each row's last prompt state;
    ``cache``: the prefill's KV (left-padded to one width, rows already repeated per answer);
    ``prompt``: each row's prompt length; ``top``: each row's largest prompt position. Returns
    what ``rollout._decode`` returns: ([rows, max_new_tokens] tokens, log-probs, sampled
    log-probs, response lengths, end reasons (0 max tokens, 1 stop, 2 unscorable), steps)."""
    lm = model.model.language_model
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    bias = getattr(head, "bias", None)
    device, rows = hidden.device, hidden.shape[0]
    kv = StaticKV.from_prefill(cache, _prefill_width(cache) + max_new_tokens)
    width, capacity = kv.width, kv.keys[0].shape[2]
    first_key = (width - prompt).to(torch.int32)
    keys = prompt.to(torch.int32).clone()
    columns = torch.arange(capacity, device=device)
    if invariant:
        mask = DecodeSegments(first_key, keys, steps=max_new_tokens, capacity=capacity)
    else:
        mask = torch.zeros((rows, 1, 1, capacity), dtype=torch.bool, device=device)
    masks = [mask] * len(lm.layers)  # every supported family's layers attend in full (no sliding window)
    keyword = cache_keyword(lm.layers[0])  # read once, not per step
    step = torch.zeros((), dtype=torch.int64, device=device)
    state = hidden.clone()
    tokens = torch.zeros((rows, max_new_tokens), dtype=torch.int64, device=device)
    logps = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
    sampled = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.full((rows,), max_new_tokens, dtype=torch.int64, device=device)
    ended = torch.zeros((rows,), dtype=torch.int64, device=device)
    done = torch.zeros((rows,), dtype=torch.bool, device=device)
    stop_t = torch.tensor(stop, dtype=torch.int64, device=device)
    media_t = torch.tensor(media, dtype=torch.int64, device=device)

    def one_step():
        draw = sample_from_hidden(state, head.weight, bias=bias, seeds=seeds, step=step, **sampling)
        at = step.view(1)
        tokens.index_copy_(1, at, draw.tokens[:, None])
        logps.index_copy_(1, at, draw.log_probs[:, None])
        sampled.index_copy_(1, at, draw.sampled_log_probs[:, None])
        is_media = torch.isin(draw.tokens, media_t) | (draw.tokens >= vocab)  # no RLBatch can score these
        newly = (torch.isin(draw.tokens, stop_t) | is_media) & ~done
        lengths.copy_(torch.where(newly, step + 1, lengths))
        ended.copy_(torch.where(newly, torch.where(is_media, 2, 1), ended))
        done.logical_or_(newly)
        keys.add_(1)
        kv.column.copy_(at + width)
        if not invariant:
            start = first_key.long()[:, None]
            mask.copy_(((columns >= start) & (columns < start + keys.long()[:, None]))[:, None, None, :])
        positions = (top + 1 + step).view(1, -1, 1).expand(3, -1, 1)
        state.copy_(language_step(lm, embed(draw.tokens)[:, None], positions, masks, kv, keyword))
        step.add_(1)

    run = 0
    eager = max_new_tokens if not graphs else min(WARMUP_STEPS, max_new_tokens)
    every = CHECK_EVERY if graphs else 1  # without graphs a read per step costs nothing worth saving
    side = torch.cuda.Stream() if graphs else None
    if graphs:  # warm up on a side stream, as a capture wants; it first waits for the buffers' writes
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side) if graphs else contextlib.nullcontext():
        while run < eager:
            one_step()
            run += 1
            if run % every == 0 and bool(done.all()):
                break
    if graphs and run < max_new_tokens and not bool(done.all()):
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one_step()
        while run < max_new_tokens:
            graph.replay()
            run += 1
            if run % CHECK_EVERY == 0 and bool(done.all()):
                break
    steps = int(lengths.max()) if rows else 0
    return tokens, logps, sampled, lengths, ended, steps


def _prefill_width(cache) -> int:
    layers = getattr(cache, "layers", None)
    return (layers[0].keys if layers is not None else cache.key_cache[0]).shape[2]

