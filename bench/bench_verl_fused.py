"""GPU benchmark: verl 0.9.1's ``FusedLinearForPPO`` (torch backend, 512-row chunks)
against rlk_mm's drop-in, both in one process, at the Qwen2.5-VL-7B head shape (bf16,
``configs/lm_heads.json``).

Inputs are laid out as verl's FSDP engine passes them (``[1, T, H]`` packed hidden
states, rolled labels); 16 samples of 1024 tokens. Measured: forward (no grad),
forward+backward through log-probs and entropy (per-token upstream weights), and ours
with 30% of each sample in the response (``rlk_mm.integrations.verl.scoring``, as the engine wrapper
sets it); backward through both outputs (an entropy bonus) and through the log-probs
only (verl's default ``entropy_coeff=0``). Each case is timed round-robin (verl's class,
ours, ours on the response rows, one call each per round): the H100 runs these products
at its power cap, so its clock depends on what ran just before. Median CUDA-event times
after warm-up; extra = peak memory above what was held before the call, gradients
included. Writes a ``verl_fused`` result under ``--out``.

    python -m bench.bench_verl_fused [--reps 5]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from .common import GIB, add_output_args, install_ray_stand_in, load_config, measure_interleaved, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(ap)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    install_ray_stand_in()
    from verl.utils.experimental.torch_functional import FusedLinearForPPO as VerlClass

    from rlk_mm.integrations.verl import FusedLinearForPPO, scoring
    from rlk_mm.parity.contract import LOGPROB_GRAD_REL, LOGPROB_MAX_ABS, relative_error

    head = load_config("lm_heads")["7b"]
    B, L, H, V = 16, 1024, head["hidden"], head["vocab"]
    T = B * L
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(1, T, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16()
    labels = torch.randint(0, V, (1, T), device="cuda", generator=g)
    up_logp, up_ent = torch.randn(1, T, device="cuda", generator=g), torch.randn(1, T, device="cuda", generator=g)
    cu = torch.arange(0, T + 1, L, device="cuda")
    response = int(0.3 * L)  # the last 30% of each sample is response; log-probs read one row earlier
    rows = (cu[:-1, None] + torch.arange(L - response - 1, L - 1, device="cuda")).reshape(-1)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    temperature = 0.9

    def fwd(cls):
        with torch.no_grad():
            return cls()(h, w, labels, temperature=temperature)

    def fwd_bwd(cls, entropy_grad=True):
        hg.grad = wg.grad = None
        logp, ent = cls()(hg, wg, labels, temperature=temperature)
        if entropy_grad:  # PPO with an entropy bonus
            torch.autograd.backward([logp, ent], [up_logp, up_ent.to(ent.dtype)])
        else:  # entropy only logged (verl's default entropy_coeff = 0)
            logp.backward(up_logp)

    def response_only(step):
        def run():
            with scoring(rows, cu):
                return step(FusedLinearForPPO)
        return run

    def free_grads():
        hg.grad = wg.grad = None

    def logprob_grad_only(cls):
        fwd_bwd(cls, entropy_grad=False)

    t = {}
    for case, step in (("fwd", fwd), ("fwd_bwd", fwd_bwd), ("fwd_bwd_logprob_grad_only", logprob_grad_only)):
        # round-robin: verl's class and ours share the GPU's power and clock history
        calls = {f"verl_{case}": functools.partial(step, VerlClass),
                 f"rlk_mm_{case}": functools.partial(step, FusedLinearForPPO),
                 f"rlk_mm_{case}_30pct_response": response_only(step)}
        for name, r in measure_interleaved(calls, args.reps, before=free_grads).items():
            t[name] = r
            print(name, r["ms"], "ms", r["extra_gib"], "GiB", flush=True)
        torch.cuda.empty_cache()

    # correctness on a slice: ours (bf16) vs verl's class on the same inputs upcast to fp32
    n = 1024
    hs, ws = h[:, :n].float().requires_grad_(), w.float().requires_grad_()
    r_logp, r_ent = VerlClass()(hs, ws, labels[:, :n], temperature=temperature)
    torch.autograd.backward([r_logp, r_ent], [up_logp[:, :n], up_ent[:, :n]])
    ho, wo = h[:, :n].clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = FusedLinearForPPO()(ho, wo, labels[:, :n], temperature=temperature)
    torch.autograd.backward([logp, ent], [up_logp[:, :n], up_ent[:, :n].bfloat16()])
    check = {
        "rows": n,
        "logprob_max_abs": (logp - r_logp).abs().max().item(),
        "entropy_max_abs_bf16_output": (ent.float() - r_ent).abs().max().item(),
        "grad_hidden_rel": relative_error(ho.grad, hs.grad),
        "grad_weight_rel": relative_error(wo.grad, ws.grad),
    }
    check["ok"] = bool(check["logprob_max_abs"] <= LOGPROB_MAX_ABS.low_precision
                       and check["grad_hidden_rel"] <= LOGPROB_GRAD_REL.low_precision
                       and check["grad_weight_rel"] <= LOGPROB_GRAD_REL.low_precision)
    ms = {k: v["ms"] for k, v in t.items()}
    result = {
        "shape": {"B": B, "L": L, "T": T, "H": H, "V": V, "dtype": "bfloat16", "temperature": temperature,
                  "response_fraction": response / L},
        "grads_gib": round((h.numel() + w.numel()) * 2 / GIB, 4),
        "timings": t,
        "speedup": {
            "fwd": round(ms["verl_fwd"] / ms["rlk_mm_fwd"], 2),
            "fwd_bwd": round(ms["verl_fwd_bwd"] / ms["rlk_mm_fwd_bwd"], 2),
            "fwd_bwd_30pct_response": round(ms["verl_fwd_bwd"] / ms["rlk_mm_fwd_bwd_30pct_response"], 2),
            "fwd_bwd_logprob_grad_only": round(
                ms["verl_fwd_bwd_logprob_grad_only"] / ms["rlk_mm_fwd_bwd_logprob_grad_only"], 2),
            "fwd_bwd_logprob_grad_only_30pct_response": round(
                ms["verl_fwd_bwd_logprob_grad_only"] / ms["rlk_mm_fwd_bwd_logprob_grad_only_30pct_response"], 2),
        },
        "correctness": check,
    }
    print(json.dumps({"speedup": result["speedup"], "correctness": check}, indent=1))
    write_result(args.out, "verl_fused", result, shapes=result["shape"], label=args.label)


if __name__ == "__main__":
    main()
