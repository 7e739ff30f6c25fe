"""The four gates checked before the first update, each printed PASS/FAIL: (a) layout
parity, (b) log-prob consistency, (c) loss masking, (d) the on-policy ratio."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..counts import plural
from ..models.forward import layout_inputs
from ..parity import LOGPROB_MAX_ABS, check_layout_parity, compare_logprobs
from ..parity.layout import LayoutParityError
from ..schema import Modality, RLBatch
from .policy import Policy
from .rollout import Rollout

__all__: list[str] = []


@dataclass
class Gate:
    """One check before the first update: its verdict, a one-line detail and data for the report."""

    name: str
    ok: bool
    detail: str
    data: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"  [{'PASS' if self.ok else 'FAIL'}] {self.name}: {self.detail}"


def gate_layout(policy: Policy, rb: RLBatch, tb: RLBatch) -> Gate:
    report = check_layout_parity(rb, tb, tokenizer=policy.tokenizer)
    if report.ok:
        return Gate("(a) layout parity", True, f"{plural(tb.num_samples, 'sample')}, {plural(tb.num_tokens, 'token')}, "
                    f"{plural(tb.num_media, 'media item')} agree")
    first = report.first
    return Gate("(a) layout parity", False, f"{plural(len(report.mismatches), 'mismatch')}; first: {first.describe()}", report.to_dict())


def gate_logprobs(rollout_lp: Tensor, training_lp: Tensor, rb: RLBatch, tb: RLBatch, dtype, tokenizer, *,
                  bitwise: bool = False) -> Gate:
    """Rollout vs training log-probs: ``torch.equal`` when ``bitwise`` (the invariant kernels),
    else within the numerical contract (the default-kernels control)."""
    name = "(b) log-prob consistency"
    try:
        cmp = compare_logprobs(rollout_lp, training_lp, rb, tb, dtype=dtype, tokenizer=tokenizer)
    except LayoutParityError as error:
        return Gate(name, False, f"refused: the layouts differ ({error.report.first.field})")
    except ValueError as error:
        return Gate(name, False, str(error))
    if bitwise:
        same = torch.equal(rollout_lp, training_lp)
        detail = f"{plural(cmp.num_tokens, 'token')}, max |Δ| {cmp.max_abs:.2e} ({'bitwise equal' if same else 'NOT bitwise equal'})"
        return Gate(name, same, detail, {**cmp.to_dict(), "bitwise": same})
    detail = f"{plural(cmp.num_tokens, 'token')}, max |Δ| {cmp.max_abs:.2e} (contract {cmp.tolerance:g})"
    if not cmp.ok:
        f = cmp.first_beyond
        detail += f"; first beyond: sample {f['sample']}, position {f['position']}: {f['rollout']:.5f} vs {f['training']:.5f}"
    return Gate(name, cmp.ok, detail, cmp.to_dict())


def gate_masking(policy: Policy, ro: Rollout, tb: RLBatch, hidden: Tensor, loss_fn, seed: int) -> Gate:
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
        loss = loss_fn(h, w, batch)
        results.append((loss.detach(), *torch.autograd.grad(loss, (h, w))))
    same = all(torch.equal(a, b) for a, b in zip(*results))
    ok = in_prompt == 0 and in_media == 0 and padding == 0 and same
    detail = (
        f"{plural(sample.numel(), 'scored target')}: {in_prompt} prompt, {in_media} media, {padding} padding; "
        f"{int(changed.sum())} unscored target ids randomized: loss and grads {'bitwise equal' if same else 'CHANGED'}"
    )
    return Gate(name, ok, detail, dict(prompt=in_prompt, image=in_media, padding=padding, bitwise_equal=same))


def gate_ratio(logp: Tensor, old: Tensor, dtype) -> Gate:
    tol = math.expm1(LOGPROB_MAX_ABS.for_dtype(dtype))
    name = "(d) on-policy ratio"
    if logp.shape != old.shape:
        return Gate(name, False, f"{plural(logp.numel(), 'training log-prob')} for {plural(old.numel(), 'rollout token')}")
    dev = float((logp.detach().float().cpu() - old).exp().sub(1).abs().max()) if logp.numel() else 0.0
    ok = dev <= tol
    return Gate(name, ok, f"max |exp(logp - old) - 1| = {dev:.2e} at the first update (contract {tol:.1e})", dict(max_dev=dev, tolerance=tol))
