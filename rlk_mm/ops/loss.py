"""Policy losses over loss tokens: the clipped PPO/GSPO objective, KL penalties, aggregation.

Two layouts, one semantics:

* **padded** — tensors ``[B, R]`` (verl's and EasyR1's response layout) with an optional
  ``mask`` ``[B, R]`` (bool or 0/1; a float mask weights tokens); row ``b`` is sequence ``b``.
* **compact** — tensors ``[n]`` in loss-token order (what ``selected_logprob`` returns)
  with ``sample_index`` int64 ``[n]`` (``RLBatch.loss_token_sample()``: non-decreasing,
  in ``[0, num_samples)``) and ``num_samples``; ``mask`` ``[n]`` is optional.

Aggregation is ``scale * sum_t mask_t * c[seq(t)] * loss_t``: per-sequence weights ``c``
(the seq modes) and an outer factor (dp_size over token or sequence counts) from the mode —
verl 0.9.1's ``agg_loss`` formulas, plus EasyR1's ``token`` and ``seq``. ``policy_loss``
runs one fused pass over the tokens (Triton on CUDA, the same math in torch elsewhere) for
the forward and one for the backward; the per-block partial sums are added in a fixed
order, so results are deterministic.
``old_log_probs``, ``advantages``, ``rollout_is_weights`` and ``ref_log_probs`` are
constants (no gradient flows to them), as in PPO.

Deliberate differences from verl: a fully masked batch gives loss 0 (verl divides 0 by 0);
masked positions never leak NaN/inf into a sum (verl's seq-mean modes multiply by the mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from rlk_mm.ops._backend import use_triton

AGG_MODES = (
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",  # verl
    "token", "seq",  # EasyR1
)
#: KL estimator name -> kernel code (verl's and EasyR1's names; a trailing "+" = k2's gradient)
KL_KINDS = {"kl": 1, "k1": 1, "abs": 2, "mse": 3, "k2": 3, "low_var_kl": 4, "k3": 4}
#: "token": PPO ratio per token; "gspo_token": GSPO's sequence ratio with the gradient of
#: each token's own log-prob (verl's "gspo", EasyR1's "gspo_token"); "gspo": GSPO with the
#: gradient through the sequence mean (EasyR1's "gspo")
RATIOS = ("token", "gspo_token", "gspo")
#: the fused kernel's per-block partial sums, in row order
PARTIALS = ("pg_loss", "kl_loss", "entropy_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "mask_sum")
_BLOCK = 1024  # tokens per block of partial sums, both backends (the Triton kernel's program size)


# ----------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class _Layout:
    """Where each token's sequence is: row of a padded [B, R] tensor, or sample_index[t]."""

    shape: torch.Size
    device: torch.device
    num_seqs: int
    row_length: int  # R for padded tensors, 0 for compact ones
    sample_index: Optional[Tensor]

    @property
    def padded(self) -> bool:
        return self.row_length > 0

    def token_seq(self) -> Tensor:
        """int64 [N]: the sequence of each token."""
        if self.padded:
            return torch.arange(self.num_seqs * self.row_length, device=self.device) // self.row_length
        return self.sample_index

    def seq_sum(self, values: Tensor) -> Tensor:
        """Per-sequence sums of a flat per-token tensor, deterministic (no atomics)."""
        if self.padded:
            return values.reshape(self.num_seqs, self.row_length).sum(-1)
        offsets = torch.searchsorted(self.sample_index, torch.arange(self.num_seqs + 1, device=values.device))
        return torch.segment_reduce(values, "sum", offsets=offsets, unsafe=True)


def _layout(name: str, ref: Tensor, sample_index: Optional[Tensor], num_samples: Optional[int]) -> _Layout:
    if sample_index is None:
        if ref.ndim != 2:
            raise ValueError(
                f"{name} has shape {tuple(ref.shape)}: padded inputs are [B, R]; for compact [n] inputs pass "
                "sample_index (RLBatch.loss_token_sample()) and num_samples"
            )
        return _Layout(ref.shape, ref.device, ref.shape[0], ref.shape[1], None)
    if ref.ndim != 1:
        raise ValueError(f"{name} has shape {tuple(ref.shape)}: with sample_index, inputs are compact [n]")
    if num_samples is None:
        raise ValueError("num_samples is required with sample_index (the batch size B)")
    if sample_index.dtype not in (torch.int64, torch.int32) or sample_index.shape != ref.shape:
        raise ValueError(
            f"sample_index must be an int64 (or int32) tensor of shape {tuple(ref.shape)} (one sample per token), "
            f"got {sample_index.dtype} {tuple(sample_index.shape)}"
        )
    if sample_index.device != ref.device:
        raise ValueError(f"sample_index is on {sample_index.device}, {name} on {ref.device}")
    idx = sample_index.long()
    if idx.numel():
        # one host read validates order and range together
        bad = (idx[1:] < idx[:-1]).any() | (idx[0] < 0) | (idx[-1] >= num_samples)
        if bool(bad):
            down = torch.nonzero(idx[1:] < idx[:-1])
            if down.numel():
                t = int(down[0]) + 1
                raise ValueError(
                    f"sample_index[{t}] = {int(idx[t])} follows {int(idx[t - 1])}: loss tokens must be grouped by "
                    "sample in non-decreasing order (loss-span order, as RLBatch.loss_token_sample() returns)"
                )
            t = 0 if int(idx[0]) < 0 else idx.numel() - 1
            raise ValueError(f"sample_index[{t}] = {int(idx[t])} is outside [0, num_samples={num_samples})")
    return _Layout(ref.shape, ref.device, int(num_samples), 0, idx)


def _check_like(layout: _Layout, **tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None and t.shape != layout.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(layout.shape)} like log_probs")


def _mask_f32(mask: Optional[Tensor], n: int, device) -> Tensor:
    return torch.ones(n, device=device) if mask is None else mask.reshape(-1).to(torch.float32)


# ----------------------------------------------------------------------------- aggregation
def _aggregation(
    layout: _Layout, mask: Optional[Tensor], mode: str, *, dp_size=1, batch_num_tokens=None, global_batch_size=None,
    loss_scale_factor=None,
):
    """How ``mode`` aggregates: ``(coef, scale)`` with ``loss = scale(mask_sum) * sum_t mask_t * coef[seq(t)] * loss_t``.

    ``coef`` is float32 ``[S]``, or None for the token modes (weight = mask); ``scale`` maps the
    batch's total mask sum (a 0-d tensor, known only after the token pass) to the outer factor.
    Divisions by a zero count give 0, not NaN.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r}: expected one of {', '.join(AGG_MODES)}")
    if mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("batch_num_tokens (the global token count) is required when dp_size > 1")
            return None, lambda total: _safe_div(dp_size, total)
        return None, lambda total: _safe_div(dp_size, batch_num_tokens)
    if mode == "token-sum":
        return None, lambda total: dp_size
    if mode == "token":
        return None, lambda total: 1.0 / (total + 1e-8)
    S = layout.num_seqs
    counts = layout.seq_sum(_mask_f32(mask, layout.shape.numel(), layout.device))
    if mode == "seq":
        return 1.0 / (counts + 1e-8), lambda total: 1.0 / S
    present = (counts > 0).to(torch.float32)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        global_batch_size = present.sum()
    norm = 1.0
    if mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            if not layout.padded:
                raise ValueError(
                    "loss_scale_factor is required for seq-mean-token-sum-norm on compact inputs "
                    "(verl's default is the padded response length)"
                )
            loss_scale_factor = layout.row_length
        norm = loss_scale_factor
    coef = present / (counts + 1e-8) if mode == "seq-mean-token-mean" else present
    return coef, lambda total: _safe_div(dp_size, global_batch_size) / norm


def _safe_div(num, den):
    """num / den for a count den >= 0; a zero count only ever multiplies a zero sum, so it is
    clamped to the smallest normal float (0 * finite = 0, where num / 0 would give NaN)."""
    if isinstance(den, Tensor):
        return num / den.to(torch.float32).clamp(min=torch.finfo(torch.float32).tiny)
    return num / den if den else 0.0


def agg_loss(
    loss_mat: Tensor,
    mask: Optional[Tensor] = None,
    loss_agg_mode: str = "token-mean",
    *,
    sample_index: Optional[Tensor] = None,
    num_samples: Optional[int] = None,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> Tensor:
    """Aggregate per-token losses to a scalar: verl 0.9.1's ``agg_loss`` modes and EasyR1's ``token``/``seq``.

    ``token-mean``: sum / batch_num_tokens * dp_size; ``token-sum``: sum * dp_size;
    ``seq-mean-token-sum``: sum over sequences of their token sums / global_batch_size * dp_size
    (``-norm``: further / loss_scale_factor, default R); ``seq-mean-token-mean``: the same over
    per-sequence token means. Sequences with no token are left out of the default
    global_batch_size. EasyR1 ``token``: masked mean (eps 1e-8); ``seq``: mean over all rows
    of per-row masked means.
    """
    layout = _layout("loss_mat", loss_mat, sample_index, num_samples)
    _check_like(layout, mask=mask)
    coef, scale = _aggregation(
        layout, mask, loss_agg_mode, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor,
    )
    m = _mask_f32(mask, loss_mat.numel(), loss_mat.device)
    w = m if coef is None else m * coef[layout.token_seq()]
    values = loss_mat.reshape(-1)
    total = torch.where(m != 0, values * w, torch.zeros((), dtype=values.dtype, device=values.device)).sum()
    return scale(m.sum()) * total


# ----------------------------------------------------------------------------- KL
def _kl_code(kind: str) -> tuple[int, bool]:
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_KINDS:
        raise ValueError(f"kl type {kind!r}: expected one of {', '.join(KL_KINDS)} (optionally with a trailing '+')")
    return KL_KINDS[base], kind.endswith("+") and KL_KINDS[base] != 3


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token KL estimate of the policy to a reference (verl's ``kl_penalty``; EasyR1's ``compute_kl``).

    ``k1``/``kl``: x = logp - ref; ``abs``: |x|; ``k2``/``mse``: x^2 / 2;
    ``k3``/``low_var_kl``: exp(k) - k - 1 with k = clamp(-x, ±20), clamped to ±10.
    A trailing ``+`` (e.g. ``k3+``) keeps the value and takes k2's gradient (straight-through).
    """
    code, straight_through = _kl_code(kind)
    x = log_probs - ref_log_probs
    if code == 1:
        value = x
    elif code == 2:
        value = x.abs()
    elif code == 3:
        value = 0.5 * x.square()
    else:
        k = torch.clamp(-x, min=-20.0, max=20.0)
        value = torch.clamp(torch.exp(k) - k - 1.0, min=-10.0, max=10.0)
    if straight_through:
        k2 = 0.5 * x.square()
        return k2 - k2.detach() + value.detach()
    return value


# ----------------------------------------------------------------------------- fused op (torch backend)
def _token_terms(
    log_probs, old_log_probs, advantages, seq_coef, mask, seq, seq_log_ratio, rollout_weights, ref_log_probs,
    clip_low, clip_high, clip_c, log_ratio_min, log_ratio_max, kl_kind, kl_straight_through,
):
    """Per-token values and d/d log-prob of each loss term: the kernel's math, in torch."""
    logp = log_probs.float()
    adv = advantages.float()
    m = torch.ones_like(logp) if mask is None else mask.to(torch.float32)
    valid = m != 0
    w = m if seq_coef is None else m * seq_coef[seq]
    tok_lr = logp - old_log_probs.float()
    lr_raw = seq_log_ratio[seq] if seq_log_ratio is not None else tok_lr
    lr_pass = (lr_raw >= log_ratio_min) & (lr_raw <= log_ratio_max)
    lr = torch.clamp(lr_raw, log_ratio_min, log_ratio_max)
    ratio = torch.exp(lr)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    m1 = torch.maximum(pg1, pg2)
    dpg = torch.where(pg1 >= pg2, -adv * ratio, 0.0)
    if math.isinf(clip_c):
        lower = torch.zeros_like(valid)
        pg = m1
    else:
        pg3 = -adv * clip_c
        neg = adv < 0
        lower = neg & (m1 > pg3)
        pg = torch.where(neg, torch.minimum(m1, pg3), m1)
        dpg = torch.where(lower, 0.0, dpg)
    dpg = torch.where(lr_pass, dpg, 0.0)
    if rollout_weights is not None:
        isw = rollout_weights.float()
        pg, dpg = pg * isw, dpg * isw
    kl = dkl = None
    if kl_kind:
        x = logp - ref_log_probs.float()
        if kl_kind == 1:
            kl, dkl = x, torch.ones_like(x)
        elif kl_kind == 2:
            kl, dkl = x.abs(), torch.sign(x)
        elif kl_kind == 3:
            kl, dkl = 0.5 * x * x, x
        else:
            klc = torch.clamp(-x, -20.0, 20.0)
            r = torch.exp(klc)
            kld = r - klc - 1.0
            kl = torch.clamp(kld, -10.0, 10.0)
            keep = (-x >= -20.0) & (-x <= 20.0) & (kld >= -10.0) & (kld <= 10.0)
            dkl = torch.where(keep, 1.0 - r, 0.0)
        if kl_straight_through:
            dkl = x
    kl_old = -tok_lr if seq_log_ratio is not None else -lr
    return dict(m=m, valid=valid, w=w, pg=pg, dpg=dpg, kl=kl, dkl=dkl, clipped=(pg2 > pg1) & valid, lower=lower & valid, kl_old=kl_old)


def _block_sums(values: Tensor, num_blocks: int) -> Tensor:
    padded = torch.nn.functional.pad(values, (0, num_blocks * _BLOCK - values.numel()))
    return padded.view(num_blocks, _BLOCK).sum(-1)


def _num_blocks(n: int) -> int:
    return -(-n // _BLOCK)


def _torch_partials(args: dict) -> Tensor:
    n = args["log_probs"].numel()
    nb = _num_blocks(n)
    t = _token_terms(**_term_args(args))
    zero = torch.zeros((), device=t["m"].device)

    def masked(x):
        return torch.where(t["valid"], x, zero)

    rows = [
        masked(t["w"] * t["pg"]),
        masked(t["w"] * t["kl"]) if t["kl"] is not None else torch.zeros_like(t["m"]),
        masked(t["w"] * args["entropy"].float()) if args["entropy"] is not None else torch.zeros_like(t["m"]),
        torch.where(t["clipped"], t["m"], zero),
        torch.where(t["lower"], t["m"], zero),
        masked(t["m"] * t["kl_old"]),
        t["m"],
    ]
    return torch.stack([_block_sums(r, nb) for r in rows])


def _torch_partials_backward(grad_partials: Tensor, args: dict) -> tuple[Tensor, Tensor]:
    n = args["log_probs"].numel()
    t = _token_terms(**_term_args(args))
    block = torch.arange(n, device=t["m"].device) // _BLOCK
    grad = grad_partials[0][block] * t["dpg"]
    if t["dkl"] is not None:
        grad = grad + grad_partials[1][block] * t["dkl"]
    zero = torch.zeros((), device=t["m"].device)
    grad_logp = torch.where(t["valid"], t["w"] * grad, zero).to(args["log_probs"].dtype)
    if args["entropy"] is None:
        return grad_logp, grad_logp.new_empty(0)
    grad_ent = torch.where(t["valid"], t["w"] * grad_partials[2][block], zero).to(args["entropy"].dtype)
    return grad_logp, grad_ent


def _term_args(args: dict) -> dict:
    n = args["log_probs"].numel()
    R = args["row_length"]
    seq = (
        torch.arange(n, device=args["log_probs"].device) // R if R > 0 else args["sample_index"]
    )
    return dict(
        log_probs=args["log_probs"], old_log_probs=args["old_log_probs"], advantages=args["advantages"],
        seq_coef=args["seq_coef"], mask=args["mask"], seq=seq, seq_log_ratio=args["seq_log_ratio"],
        rollout_weights=args["rollout_weights"], ref_log_probs=args["ref_log_probs"],
        clip_low=args["clip_low"], clip_high=args["clip_high"], clip_c=args["clip_c"],
        log_ratio_min=args["log_ratio_min"], log_ratio_max=args["log_ratio_max"],
        kl_kind=args["kl_kind"], kl_straight_through=args["kl_straight_through"],
    )


# ----------------------------------------------------------------------------- fused op (registration)
# The op takes its constant inputs packed in three lists (names below): torch's custom-op
# autograd re-binds every argument on each call at a cost that grows with the square of
# the argument count, and 20 separate arguments cost ~0.3 ms a call.
_OP_TENSORS = (
    "old_log_probs", "advantages", "seq_coef", "mask", "sample_index", "seq_log_ratio", "rollout_weights",
    "ref_log_probs",
)
_OP_FLOATS = ("clip_low", "clip_high", "clip_c", "log_ratio_min", "log_ratio_max")
_OP_INTS = ("num_seqs", "row_length", "kl_kind", "kl_straight_through", "sequence_mean_grad")


def _unpack(log_probs, entropy, tensors, floats, ints) -> dict:
    args = dict(zip(_OP_TENSORS, tensors), log_probs=log_probs, entropy=entropy)
    args.update(zip(_OP_FLOATS, floats))
    args.update(zip(_OP_INTS, ints))
    return args


@torch.library.custom_op("rlk_mm::policy_loss_partials", mutates_args=())
def _policy_loss_partials(
    log_probs: Tensor, entropy: Optional[Tensor], tensors: list[Optional[Tensor]], floats: list[float], ints: list[int]
) -> Tensor:
    """float32 [len(PARTIALS), num_blocks]: per-block partial sums of the loss terms and metrics."""
    args = _unpack(log_probs, entropy, tensors, floats, ints)
    if not use_triton(log_probs):
        return _torch_partials(args)
    from rlk_mm.ops._triton import loss as kernels

    partials = torch.empty(len(PARTIALS), _num_blocks(log_probs.numel()), dtype=torch.float32, device=log_probs.device)
    kernels.launch(backward=False, block=_BLOCK, partials=partials, **_launch_args(args))
    return partials


@_policy_loss_partials.register_fake
def _(log_probs, entropy, tensors, floats, ints):
    return log_probs.new_empty((len(PARTIALS), _num_blocks(log_probs.numel())), dtype=torch.float32)


@torch.library.custom_op("rlk_mm::policy_loss_partials_backward", mutates_args=())
def _policy_loss_partials_backward(
    grad_partials: Tensor, log_probs: Tensor, entropy: Optional[Tensor], tensors: list[Optional[Tensor]],
    floats: list[float], ints: list[int],
) -> tuple[Tensor, Tensor]:
    """(d/d log_probs, d/d entropy — empty when entropy is None) from the partials' gradient."""
    args = _unpack(log_probs, entropy, tensors, floats, ints)
    grad_partials = grad_partials.float().contiguous()
    if not use_triton(log_probs):
        grad_logp, grad_ent = _torch_partials_backward(grad_partials, args)
    else:
        from rlk_mm.ops._triton import loss as kernels

        grad_logp = torch.empty_like(log_probs)
        grad_ent = torch.empty_like(entropy) if entropy is not None else log_probs.new_empty(0)
        kernels.launch(
            backward=True, block=_BLOCK, grad_partials=grad_partials, grad_log_probs=grad_logp,
            grad_entropy=grad_ent if entropy is not None else None, **_launch_args(args),
        )
    if args["sequence_mean_grad"]:
        grad_logp = _spread_over_sequence(grad_logp, args)
    return grad_logp, grad_ent


@_policy_loss_partials_backward.register_fake
def _(grad_partials, log_probs, entropy, tensors, floats, ints):
    return torch.empty_like(log_probs), (torch.empty_like(entropy) if entropy is not None else log_probs.new_empty(0))


def _launch_args(args: dict) -> dict:
    skip = ("sequence_mean_grad", "num_seqs")
    return {k: v for k, v in args.items() if k not in skip}


def _setup_context(ctx, inputs, output):
    log_probs, entropy, tensors, floats, ints = inputs
    ctx.save_for_backward(log_probs, entropy, *tensors)
    ctx.floats, ctx.ints = floats, ints


def _backward(ctx, grad_partials):
    log_probs, entropy, *tensors = ctx.saved_tensors
    grad_logp, grad_ent = _policy_loss_partials_backward(grad_partials, log_probs, entropy, tensors, ctx.floats, ctx.ints)
    return grad_logp, (grad_ent if entropy is not None else None), None, None, None


def _spread_over_sequence(grad_logp: Tensor, args: dict) -> Tensor:
    """GSPO's gradient through the sequence mean: each token gets mask_u / |y| of its sequence's sum."""
    n, R = grad_logp.numel(), args["row_length"]
    layout = _Layout(grad_logp.shape, grad_logp.device, args["num_seqs"], R, None if R > 0 else args["sample_index"])
    m = _mask_f32(args["mask"], n, grad_logp.device)
    total = layout.seq_sum(grad_logp.float())
    counts = layout.seq_sum(m).clamp(min=1.0)
    return (m * (total / counts)[layout.token_seq()]).to(grad_logp.dtype)


torch.library.register_autograd("rlk_mm::policy_loss_partials", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public op
def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Optional[Tensor] = None,
    *,
    sample_index: Optional[Tensor] = None,
    num_samples: Optional[int] = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = 3.0,
    ratio: str = "token",
    log_ratio_clamp: tuple[Optional[float], Optional[float]] = (-20.0, 20.0),
    rollout_is_weights: Optional[Tensor] = None,
    ref_log_probs: Optional[Tensor] = None,
    kl_type: str = "low_var_kl",
    kl_coef: float = 0.0,
    entropy: Optional[Tensor] = None,
    entropy_coeff: float = 0.0,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss (PPO / dual-clip / GSPO) + KL and entropy terms, fused.

    Per token: ``r = exp(clamp(logp - old, *log_ratio_clamp))``;
    ``l = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``; for ``A < 0`` the
    dual clip ``min(l, -A c)`` (``clip_ratio_c=None`` turns it off); times
    ``rollout_is_weights``. ``ratio="gspo_token"``/``"gspo"`` replace ``logp - old`` by the
    sequence's mean log-ratio (see ``RATIOS``). Total:
    ``agg(l) + kl_coef * agg(kl_penalty(logp, ref, kl_type)) - entropy_coeff * agg(entropy)``
    with ``agg`` = ``agg_loss(..., loss_agg_mode, ...)``.

    Returns ``(loss, metrics)``: a float32 scalar, and 0-d float32 tensors named as verl
    names them — ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` (mask means),
    plus ``kl_loss`` / ``entropy_loss`` when those inputs are given. No host synchronisation
    except one read validating ``sample_index`` (compact inputs).
    """
    layout = _layout("log_probs", log_probs, sample_index, num_samples)
    _check_like(
        layout, old_log_probs=old_log_probs, advantages=advantages, mask=mask,
        rollout_is_weights=rollout_is_weights, ref_log_probs=ref_log_probs, entropy=entropy,
    )
    if not log_probs.is_floating_point():
        raise ValueError(f"log_probs must be floating point, got {log_probs.dtype}")
    if ratio not in RATIOS:
        raise ValueError(f"ratio={ratio!r}: expected one of {', '.join(RATIOS)}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c}: the dual-clip bound must be > 1 (or None to turn it off)")
    if (kl_coef != 0.0) and ref_log_probs is None:
        raise ValueError("kl_coef is set but ref_log_probs is None")
    if (entropy_coeff != 0.0) and entropy is None:
        raise ValueError("entropy_coeff is set but entropy is None")
    kl_kind, kl_st = _kl_code(kl_type) if ref_log_probs is not None else (0, False)
    lo, hi = log_ratio_clamp
    lo = -math.inf if lo is None else float(lo)
    hi = math.inf if hi is None else float(hi)

    device = log_probs.device
    flat = lambda t: None if t is None else t.detach().reshape(-1).contiguous()  # noqa: E731
    coef, scale = _aggregation(
        layout, mask, loss_agg_mode, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor,
    )
    seq_lr = None
    if ratio != "token":
        m = _mask_f32(mask, log_probs.numel(), device)
        tok_lr = log_probs.detach().reshape(-1).float() - old_log_probs.detach().reshape(-1).float()
        tok_lr = torch.where(m != 0, tok_lr * m, torch.zeros((), device=device))
        seq_lr = (layout.seq_sum(tok_lr) / layout.seq_sum(m).clamp(min=1.0)).contiguous()

    partials = _policy_loss_partials(
        log_probs.reshape(-1).contiguous(),
        None if entropy is None else entropy.reshape(-1).contiguous(),
        [flat(old_log_probs), flat(advantages), None if coef is None else coef.contiguous(), flat(mask),
         layout.sample_index, seq_lr, flat(rollout_is_weights), flat(ref_log_probs)],  # _OP_TENSORS
        [float(clip_ratio_low), float(clip_ratio_high), math.inf if clip_ratio_c is None else float(clip_ratio_c),
         lo, hi],  # _OP_FLOATS
        [layout.num_seqs, layout.row_length, kl_kind, int(kl_st), int(ratio == "gspo")],  # _OP_INTS
    )
    sums = partials.sum(-1)
    mask_sum = sums[6].detach()
    terms = sums[:3] * scale(mask_sum)  # aggregated pg, kl and entropy losses
    rates = sums[3:6].detach() / (mask_sum + 1e-8)
    loss = terms[0]
    metrics = {"pg_loss": terms[0].detach(), "pg_clipfrac": rates[0], "pg_clipfrac_lower": rates[1], "ppo_kl": rates[2]}
    if ref_log_probs is not None:
        loss = loss + kl_coef * terms[1]
        metrics["kl_loss"] = terms[1].detach()
    if entropy is not None:
        loss = loss - entropy_coeff * terms[2]
        metrics["entropy_loss"] = terms[2].detach()
    return loss, metrics
