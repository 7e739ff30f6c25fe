"""The run: setup, warm-up, then GRPO steps (gates before the first update), the learning
check and the report; the learning-rate schedule and the malloc tuning it uses."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import math
import random
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from ..counts import plural
from ..ops import batch_invariant, group_advantages, linear_policy_loss, scatter_rewards
from ..schema import RLBatch
from .gates import gate_layout, gate_logprobs, gate_masking, gate_ratio
from .learning import learning_check, update_direction
from .options import LR_FLOOR, task_name, to_argv
from .policy import freeze_embeddings_and_head, hidden_states, load_policy, policy_logprobs, swap_pair, warm_up
from .report import HEADER, device_name, draw_curves, estimate, progress_row, versions
from .rollout import rollout, rollout_batch, training_batch
from .tasks import TASKS
from .tuning import SmokeTuning

__all__ = ["run_smoke"]

MALLOPT = {"M_MMAP_MAX": (-4, 0), "M_TRIM_THRESHOLD": (-1, 2**31 - 1), "M_TOP_PAD": (-2, 256 << 20)}
"""glibc mallopt (parameter, value) pairs: big buffers come from the heap, and freed logits
buffers stay there for the next step instead of being unmapped."""


def keep_freed_memory() -> bool:
    """Ask glibc to serve big buffers from the heap and keep freed memory (no mmap/munmap
    of the [rows, V] logits buffers on every step). Whether it took."""
    try:
        libc = ctypes.CDLL(None)
        return all(libc.mallopt(param, value) == 1 for param, value in MALLOPT.values())
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False


def lr_factor(step: int, warmup: int, steps: int, floor: float = LR_FLOOR) -> float:
    """The GRPO learning-rate multiplier at 0-based `step`: a linear ramp over `warmup`
    steps (Adam's first steps are sign-like, ~lr on every weight at once: without the ramp
    the first update alone moves the tiny policy by a KL of ~2 and the answer format
    breaks), then a cosine decay to `floor` (default `LR_FLOOR`) at the last step (Adam
    keeps its step size as the reward signal thins out, so a constant rate lets noise undo a
    learned policy)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(steps - 1 - warmup, 1)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _grpo_advantages(tb: RLBatch, negate: bool) -> tuple[Tensor, Tensor]:
    """Per-loss-token rewards -> per-sample scores -> GRPO advantages per loss token."""
    token_rewards = scatter_rewards(tb)  # the sequence reward on each answer's last token
    sample = tb.loss_token_sample()
    scores = torch.zeros(tb.num_samples, dtype=torch.float32).index_add_(0, sample, token_rewards)
    adv = group_advantages(scores, batch=tb)
    if negate:
        adv = -adv  # the adv-sign bug
    return adv[sample], scores


def run_smoke(args, *, tuning: Optional[SmokeTuning] = None, on_step: Optional[Callable[[dict], None]] = None) -> int:
    """Run the smoke test with parsed `args` (see `add_smoke_parser`); the exit code.
    ``tuning``: the settings the command line does not offer (default ``SmokeTuning()``);
    ``on_step``: called with each GRPO step's metrics (the report's ``steps`` rows) as it ends."""
    tuning = SmokeTuning() if tuning is None else tuning
    if not isinstance(tuning, SmokeTuning):
        raise TypeError(f"tuning must be a SmokeTuning (or None), got {type(tuning).__name__}")
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
    task = TASKS[task_name(args)](args.data, tuning)
    report: dict = {
        "command": "rlk-mm smoke " + " ".join(to_argv(args)),
        "task": task.name, "seed": args.seed, "device": device_name(device), "dtype": args.dtype,
        "break": args.break_mode, "versions": versions(),
        "config": {k: v for k, v in vars(args).items() if k != "func"}, "tuning": tuning.as_dict(),
    }
    timings: dict = {}
    report["timings"] = timings

    log(f"rlk-mm smoke: task {task.name}, {plural(args.steps, 'step')} of {plural(args.prompts, 'prompt')} x "
        f"{plural(args.samples, 'answer')}, "
        f"seed {args.seed}, device {report['device']}" + (f", BREAK {args.break_mode}" if args.break_mode else ""))
    t = time.perf_counter()
    policy = load_policy(args.model_path, args.seed, device, dtype, tiny=tuning.tiny_model, model=args.model)
    timings["setup_s"] = time.perf_counter() - t
    log(f"policy: {'local checkpoint ' + str(args.model_path) if args.model_path else 'tiny random ' + args.model} "
        f"({sum(p.numel() for p in policy.model.parameters()) / 1e6:.1f}M parameters, {timings['setup_s']:.1f}s)")

    t = time.perf_counter()
    log(f"warm-up: {plural(args.warmup_steps, 'step')} on the answer format with shuffled labels")
    report["warmup_loss"] = warm_up(policy, task, rng_warm, steps=args.warmup_steps, prompts=args.prompts, lr=args.warmup_lr, log=log)
    timings["warmup_s"] = time.perf_counter() - t
    reference = copy.deepcopy(policy.model).requires_grad_(False) if args.kl_coef > 0 else None
    opt = torch.optim.Adam(freeze_embeddings_and_head(policy.model), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, args.lr_warmup_steps, args.steps, args.lr_floor))

    def loss_fn_for(tb: RLBatch, old: Tensor, adv: Tensor, ref_lp: Optional[Tensor]):
        """The step's loss: the LM head fused with the policy loss (gradients formed in the
        forward); the call's metrics and log-probs are kept on the function."""

        def fn(hidden: Tensor, head: Tensor, batch: RLBatch) -> Tensor:
            out = linear_policy_loss(
                hidden, head, batch, temperature=args.temperature, old_log_probs=old.to(device),
                advantages=adv.to(device), ref_log_probs=None if ref_lp is None else ref_lp.to(device),
                kl_type="low_var_kl", kl_coef=args.kl_coef, loss_agg_mode="token-mean",
            )
            fn.metrics, fn.log_probs = out.metrics, out.log_probs
            return out.loss

        return fn

    invariant = args.kernels == "invariant"

    def kernels():
        """The training forward's kernels: those the rollout decoded with."""
        return batch_invariant() if invariant else contextlib.nullcontext()

    steps_out: list[dict] = []
    step_times: list[float] = []  # seconds of each step, the gates left out: the ETA's
    report["steps"] = steps_out
    report["gates"] = []
    exit_code = 0
    t_train = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        ro = rollout(policy, task, task.batch(rng_train, args.prompts, "train"), args.samples,
                     temperature=args.temperature, generator=generator, step=step, kernels=args.kernels)
        tb = training_batch(policy, ro, loss_shift=args.break_mode == "loss-shift")
        old = torch.cat(ro.logprobs)
        swap = swap_pair(tb) if args.break_mode == "image-swap" else None
        if args.break_mode == "image-swap" and swap is None:
            raise ValueError(
                f"--break image-swap found no two images of the same size in different groups at step {step}; "
                "use more --prompts (with 5 or more, the 4 first-image sizes force a pair)"
            )
        t1 = time.perf_counter()
        # the reference enters only the KL penalty (nothing compares it bitwise): the default kernels
        ref_lp = None
        if args.kl_coef > 0:
            with torch.no_grad():
                ref_lp = policy_logprobs(policy, reference, tb, args.temperature).cpu()
        adv, scores = _grpo_advantages(tb, negate=args.break_mode == "adv-sign")
        loss_fn = loss_fn_for(tb, old, adv, ref_lp)
        t2 = time.perf_counter()
        with kernels():
            hidden = hidden_states(policy.model, tb, swap_images=swap)
            loss = loss_fn(hidden, policy.head, tb)
        logp = loss_fn.log_probs
        t3 = time.perf_counter()
        if step == 1:
            t_gates = time.perf_counter()
            rb = rollout_batch(policy, ro)
            with torch.no_grad(), kernels():
                train_lp = policy_logprobs(policy, policy.model, tb, args.temperature, swap=swap)
            gates = [
                gate_layout(policy, rb, tb),
                gate_logprobs(old, train_lp.cpu(), rb, tb, dtype, policy.tokenizer, bitwise=invariant),
                gate_masking(policy, ro, tb, hidden, loss_fn, args.seed),
                gate_ratio(logp, old, dtype),
            ]
            from ..viz import draw_layout

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
        t3b = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        t4 = time.perf_counter()
        if step == 1:
            with torch.no_grad():
                after = policy_logprobs(policy, policy.model, tb, args.temperature, swap=swap).cpu()
            report["first_update_direction"] = update_direction(tb, logp.cpu(), after)
        m = loss_fn.metrics
        r = torch.tensor(ro.rewards)
        delta = (logp.detach().cpu() - old).abs()  # rollout vs training, before the update (same policy)
        seconds = time.perf_counter() - t0
        metrics = dict(
            step=step, reward_mean=float(r.mean()), reward_std=float(r.std()) if r.numel() > 1 else 0.0,
            loss=float(loss.detach()), pg_loss=float(m["pg_loss"]), kl=float(m["kl_loss"]) if "kl_loss" in m else 0.0,
            clip_frac=float(m["pg_clipfrac"]), ppo_kl=float(m["ppo_kl"]),
            max_ratio_dev=float((logp.detach().cpu() - old).exp().sub(1).abs().max()),
            max_abs_delta=float(delta.max()) if delta.numel() else 0.0,
            tokens_differing=int((logp.detach().cpu() != old).sum()),
            adv_std=float(adv.std()) if adv.numel() > 1 else 0.0,
            response_tokens=float(sum(x.numel() for x in ro.responses) / max(len(ro.responses), 1)),
            rejected=ro.rejected, tokens=tb.num_tokens, tokens_per_s=tb.num_tokens / seconds,
            rollout_s=ro.seconds, batch_s=t1 - t0 - ro.seconds, reference_s=t2 - t1, forward_s=t3 - t2,
            backward_s=t4 - t3b, seconds=seconds,
        )
        metrics.update({f"task_{k}": v for k, v in task.diagnostics(ro.texts, ro.rewards, ro.samples).items()})
        steps_out.append(metrics)
        step_times.append(seconds - timings.get("gates_s", 0.0) if step == 1 else seconds)
        if step == 1:
            log(estimate(args.steps, step_times[0]))
            log(HEADER)
        log(progress_row(metrics, args.steps, step_times))
        if on_step is not None:
            on_step(metrics)
    timings["train_s"] = time.perf_counter() - t_train

    learning = learning_check(task, args, steps_out, report.get("first_update_direction"))
    report["learning"] = learning
    if steps_out:
        log("learning: " + learning["detail"])
        if not learning["ok"]:
            exit_code = 1
        control = json.loads(Path(args.control).read_text())["steps"] if args.control else None
        draw_curves(steps_out, out_dir / "smoke_curves.png", task.name, args, control)
    timings["total_s"] = time.perf_counter() - t_start
    report["exit_code"] = exit_code
    (out_dir / "smoke_report.json").write_text(json.dumps(report, indent=2, default=str))
    log(f"{'PASSED' if exit_code == 0 else 'FAILED'} in {timings['total_s']:.0f}s; wrote {out_dir}/smoke_report.json"
        + (", smoke_curves.png" if steps_out else "") + ", smoke_layout.png")
    return exit_code
