"""What exactly on-policy rollouts cost: ``generate_on_policy`` and a GRPO training step under
``batch_invariant()`` against the default kernels, in one process, on random-weight models
of the Qwen2.5-VL-3B and -7B dimensions (bf16, ``--layers`` decoder layers and
``--vision-depth`` vision blocks of the real width; nothing downloaded).

Per model and variant (``invariant`` and ``default``: ``generate_on_policy``'s static-cache
loop, its step one CUDA graph, under ``batch_invariant()`` and under the model's own kernels;
``hf_generate``: transformers' ``generate`` with sampling, what a user runs today):

* ``prefill``: one no-grad forward over the 8 image prompts, tokens/s;
* ``decode``: ms per decode step at batch 1/16/64/256 (one prompt, its cache repeated), the
  slope between two rollout lengths (the prefill and the capture cancel), against the floor:
  the text weights streamed once from HBM at the card's bandwidth;
* ``rl_step``: a rollout of G = 8 answers to each of 8 image prompts (``--new-tokens``, no
  stop token, so every row runs the full length; the random head's rows of ids that a
  rollout rejects, media placeholders and ids past the tokenizer, are zeroed and the draw
  runs at ``--temperature`` 0.1, so no row is rejected and both kernels score the same
  tokens: equal work), then the old-log-prob recompute (a
  no-grad forward, which a framework can skip when the rollout's log-probs are the
  training's) and the training forward + backward (``batch_logprobs``, packed, in
  micro-batches of ``--micro-batch`` samples with gradient accumulation, as frameworks train);
  the backward's own time too. ``hf_generate`` trains as ``default`` does (the same kernels and
  shapes): its step is its rollout plus ``default``'s old-log-prob and training times.

The tax: invariant over default, with the old-log-prob forward counted in both (``tax``) and
with it skipped under the invariant kernels (``tax_skipping_old_logprob``); ``vs_hf_generate``:
the invariant step over today's ``hf_generate`` step. ``--layers`` defaults to each model's
real depth (36 for 3B, 28 for 7B). ``--profile``
adds, per kernels, the top ops of one training step (device time) and of a 32-token
rollout at batch 1 (host and device time: decode is host-bound, and each step reads the
sampled tokens back). Medians of CUDA-event timings
after a warm-up round. Writes an ``on_policy`` result (with a top-level ``headline`` list for
the README table: the RL step and a decode step in ms, invariant against default kernels) under
``--out`` (default ``$OUT`` or ``.``).

    python -m bench.bench_on_policy --label full-depth --out $OUT    # both models at their real depth
    python -m bench.bench_on_policy --models 3b --reps 2 --out $OUT  # quicker
    python -m bench.bench_on_policy --dry-run --out /tmp/op          # CPU, tiny model and shapes (every path)
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from rlk_mm import fixtures
from rlk_mm.models import batch_logprobs, generate_on_policy
from rlk_mm.ops import batch_invariant

from .common import add_output_args, load_config, time_ms, write_result

BASE = load_config("qwen2_5_vl_3b")
#: the text towers of the two models (vision towers are the same, output width = hidden)
TEXT = {
    "3b": BASE["text_config"],
    "7b": {**BASE["text_config"], "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
           "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4},
}
TIED = {"3b": True, "7b": False}
#: peak HBM bandwidth, bytes/s, of the cards the benchmarks run on (the decode floor)
HBM_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}
VARIANTS = ("default", "invariant", "hf_generate")
#: vLLM's and SGLang's published batch-invariant throughput cost (the peers of the tax)
PEER_TAX = "published batch-invariant modes cost vLLM 22-31 % and SGLang ~34 % of their throughput"


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(ap)
    ap.add_argument("--models", nargs="+", default=["3b", "7b"], choices=list(TEXT))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: each model's real depth)")
    ap.add_argument("--vision-depth", type=int, default=4, help="vision blocks (default 4, the last full attention)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8, help="answers per prompt, G")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--image-side", type=int, default=448, help="image side in pixels (448: 256 visual tokens)")
    ap.add_argument("--temperature", type=float, default=0.1,
                    help="rollout temperature (default 0.1: with the zeroed head rows, no row is rejected)")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--micro-batch", type=int, default=16, help="samples per training micro-batch")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="the top ops of a training step and of a decode")
    ap.add_argument("--dry-run", action="store_true", help="CPU, the tiny fixture model, tiny shapes")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.models, args.prompts, args.samples, args.new_tokens = ["tiny"], 1, 2, 3
        args.decode_batches, args.reps, args.image_side, args.profile = [2], 1, 56, False
        args.micro_batch = 1
    return args


def build_model(name: str, layers: int, vision_depth: int, device: str):
    """A random-weight bf16 Qwen2.5-VL of ``name``'s dimensions (``tiny``: the test fixture, fp32)."""
    if name == "tiny":
        return fixtures.tiny_qwen2_5_vl(seed=0).eval().to(device)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    special = {"bos_token_id": fixtures.ENDOFTEXT_TOKEN_ID, "eos_token_id": fixtures.IM_END_TOKEN_ID,
               "pad_token_id": fixtures.ENDOFTEXT_TOKEN_ID}
    text = {**TEXT[name], "num_hidden_layers": layers, **special}
    vision = {**BASE["vision_config"], "depth": vision_depth, "fullatt_block_indexes": [vision_depth - 1],
              "out_hidden_size": text["hidden_size"]}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=fixtures.IMAGE_TOKEN_ID,
                              video_token_id=fixtures.VIDEO_TOKEN_ID,
                              vision_start_token_id=fixtures.VISION_START_TOKEN_ID,
                              vision_end_token_id=fixtures.VISION_END_TOKEN_ID, tie_word_embeddings=TIED[name])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def only_scorable_draws(model, processor) -> None:
    """Zero the head rows of the ids a rollout rejects (media placeholders, ids past the
    tokenizer): a random head puts their logits among the others', and a rejected row ends
    early, so the two kernels' steps would do different work."""
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head[len(processor.tokenizer):] = 0
        head[[model.config.image_token_id, model.config.video_token_id]] = 0


def _kernels(name: str):
    return batch_invariant() if name == "invariant" else contextlib.nullcontext()


def weights_floor_ms(model, device: str) -> float | None:
    """The text weights (decoder layers, final norm and head) read once from HBM at the
    card's peak bandwidth: a decode step's floor, in ms (None off a known card)."""
    name = torch.cuda.get_device_name() if device == "cuda" else ""
    bandwidth = next((bw for card, bw in HBM_BANDWIDTH.items() if card in name), None)
    if bandwidth is None:
        return None
    lm, head = model.model.language_model, model.get_output_embeddings()
    tensors = {id(p): p for p in (*lm.layers.parameters(), *lm.norm.parameters(), *head.parameters())}
    return round(sum(p.numel() * p.element_size() for p in tensors.values()) / bandwidth * 1e3, 4)


def hf_generate(model, inputs, samples: int, new_tokens: int, temperature: float):
    """transformers' sampling generate, every row to ``new_tokens`` (no stop token)."""
    with torch.no_grad():
        return model.generate(**inputs, do_sample=True, temperature=temperature, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, num_return_sequences=samples, top_k=0, top_p=1.0)


def _measure(model, processor, args, device: str) -> dict:
    size = (args.image_side, args.image_side)
    prompts = fixtures.processor_inputs(processor, fixtures.synthetic_image_text(args.prompts, seed=0, max_images=1,
                                                                                 sizes=[size]))
    one = fixtures.processor_inputs(processor, fixtures.synthetic_image_text(1, seed=1, max_images=1, sizes=[size]))
    warmup = 0 if args.dry_run else 1
    timed = lambda fn: time_ms(fn, args.reps, warmup=warmup, device=device)["ms"]  # noqa: E731
    out: dict = {}
    device_inputs = {k: v.to(device) if hasattr(v, "to") else v for k, v in prompts.items()}
    one_inputs = {k: v.to(device) if hasattr(v, "to") else v for k, v in one.items()}
    for kernels in ("default", "invariant"):
        rollout = lambda p=prompts, g=args.samples, n=args.new_tokens: generate_on_policy(  # noqa: E731
            model, p, processor=processor, max_new_tokens=n, samples_per_prompt=g, seed=0, stop_token_ids=[],
            temperature=args.temperature, kernels=kernels)
        ro = rollout()
        batch = ro.batch
        prompt_batch = generate_on_policy(model, prompts, processor=processor, max_new_tokens=1, seed=0,
                                          stop_token_ids=[], kernels=kernels).batch

        def prefill():
            with torch.no_grad(), _kernels(kernels):
                batch_logprobs(model, prompt_batch)

        def old_logprobs():
            with torch.no_grad(), _kernels(kernels):
                batch_logprobs(model, batch)

        micro = [batch.select(list(range(s, min(s + args.micro_batch, batch.num_samples))))
                 for s in range(0, batch.num_samples, args.micro_batch)]
        advs = [torch.randn(m.loss_token_index()[0].numel(), device=device) for m in micro]

        def forward():
            with _kernels(kernels):
                return -(batch_logprobs(model, micro[0]) * advs[0]).mean()

        def train():
            model.zero_grad(set_to_none=True)
            for m, a in zip(micro, advs):
                with _kernels(kernels):
                    (-(batch_logprobs(model, m) * a).mean() / len(micro)).backward()

        decode = {}
        short, long_ = max(2, args.new_tokens // 8), args.new_tokens
        for b in args.decode_batches:
            t_short = timed(lambda b=b: rollout(one, b, short))
            t_long = timed(lambda b=b: rollout(one, b, long_))
            decode[str(b)] = round((t_long - t_short) / (long_ - short), 4)
        prefill_ms = timed(prefill)
        step = {"rollout_ms": timed(rollout), "old_logprob_ms": timed(old_logprobs), "train_ms": timed(train),
                "forward_ms": timed(forward)}
        step["backward_ms"] = round(step["train_ms"] - step["forward_ms"] * len(micro), 4)
        out[kernels] = {
            "prefill_tokens_per_s": round(prompt_batch.num_tokens / prefill_ms * 1e3, 1), "prefill_ms": prefill_ms,
            "decode_ms_per_step": decode, "rl_step": step, "scored_tokens": batch.loss_token_index()[0].numel(),
            "tokens": batch.num_tokens, "rejected_rows": len(ro.rejected), "micro_batches": len(micro),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
        }
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if args.profile:
            out[kernels]["profile"] = {
                "train_step": _profile(train, "device_time_total"),
                "decode_32_tokens_batch_1": {
                    sort: _profile(lambda: rollout(one, 1, 32), sort) for sort in ("self_cpu_time_total", "device_time_total")
                },
            }
    d, i = out["default"]["rl_step"], out["invariant"]["rl_step"]
    if not args.dry_run:  # transformers' generate with sampling: what a user runs today
        hf = lambda p=device_inputs, g=args.samples, n=args.new_tokens: hf_generate(  # noqa: E731
            model, p, g, n, args.temperature)
        decode = {}
        for b in args.decode_batches:
            short, long_ = max(2, args.new_tokens // 8), args.new_tokens
            decode[str(b)] = round((timed(lambda b=b: hf(one_inputs, b, long_)) - timed(lambda b=b: hf(one_inputs, b, short)))
                                   / (long_ - short), 4)
        step = {"rollout_ms": timed(hf), "old_logprob_ms": d["old_logprob_ms"], "train_ms": d["train_ms"]}
        out["hf_generate"] = {"decode_ms_per_step": decode, "rl_step": step}
    base = d["rollout_ms"] + d["old_logprob_ms"] + d["train_ms"]
    out["tax"] = round((i["rollout_ms"] + i["old_logprob_ms"] + i["train_ms"]) / base - 1, 4)
    out["tax_skipping_old_logprob"] = round((i["rollout_ms"] + i["train_ms"]) / base - 1, 4)
    if "hf_generate" in out:
        h = out["hf_generate"]["rl_step"]
        out["vs_hf_generate"] = round((i["rollout_ms"] + i["old_logprob_ms"] + i["train_ms"])
                                      / (h["rollout_ms"] + h["old_logprob_ms"] + h["train_ms"]) - 1, 4)
    out["decode_floor_ms"] = weights_floor_ms(model, device)
    out["backward_ratio"] = round(i["backward_ms"] / max(d["backward_ms"], 1e-9), 4)
    out["equal_work"] = out["default"]["scored_tokens"] == out["invariant"]["scored_tokens"]
    return out


def _profile(fn, sort: str) -> list[dict]:
    """The top 15 ops of one call of ``fn`` by ``sort`` (an attribute of torch's profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, sort), reverse=True)[:15]
    return [{"op": e.key, "device_ms": round(e.device_time_total / 1e3, 3),
             "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3), "calls": e.count} for e in rows]


def headline_rows(results: dict) -> list[dict]:
    """The README's rows: per model, the RL step (rollout, old-log-prob forward, training
    step) and the step without the old-log-prob forward under the invariant kernels, each
    against the whole step under the default kernels, and a decode step at the largest batch;
    ``ours`` is the invariant kernels' time and ``peer`` the default kernels', in ms (their ratio
    says which is faster)."""
    rows = []
    for name, r in results.items():
        label = f"Qwen2.5-VL-{name.upper()} dims, {r['layers']} layers"
        inv, ref = r["invariant"]["rl_step"], r["default"]["rl_step"]
        default_step = ref["rollout_ms"] + ref["old_logprob_ms"] + ref["train_ms"]
        if r["equal_work"]:  # else the two steps did different work: no RL-step row
            rows.append({"metric": f"RL step, invariant vs default kernels ({label})",
                         "ours": round(inv["rollout_ms"] + inv["old_logprob_ms"] + inv["train_ms"], 1),
                         "peer": round(default_step, 1), "unit": "ms", "note": PEER_TAX})
            rows.append({"metric": f"RL step without the old-log-prob forward, invariant vs default kernels ({label})",
                         "ours": round(inv["rollout_ms"] + inv["train_ms"], 1), "peer": round(default_step, 1),
                         "unit": "ms", "note": PEER_TAX})
        b = max(r["invariant"]["decode_ms_per_step"], key=int)  # the largest decode batch (the others: the guide)
        rows.append({"metric": f"decode step at batch {b}, invariant vs default kernels ({label})",
                     "ours": r["invariant"]["decode_ms_per_step"][b], "peer": r["default"]["decode_ms_per_step"][b],
                     "unit": "ms"})
        if "hf_generate" in r:
            hf = r["hf_generate"]["rl_step"]
            rows.append({"metric": f"RL step, invariant fast loop vs transformers' generate ({label})",
                         "ours": round(inv["rollout_ms"] + inv["old_logprob_ms"] + inv["train_ms"], 1),
                         "peer": round(hf["rollout_ms"] + hf["old_logprob_ms"] + hf["train_ms"], 1), "unit": "ms"})
    return rows


REAL_DEPTH = {"3b": 36, "7b": 28, "tiny": None}


def main(argv=None) -> dict:
    args = _parse(argv)
    device = "cpu" if args.dry_run else "cuda"
    processor = fixtures.qwen_vl_processor()
    results = {}
    for name in args.models:
        layers = args.layers or REAL_DEPTH[name]
        model = build_model(name, layers, args.vision_depth, device)
        if name != "tiny":
            only_scorable_draws(model, processor)
        results[name] = {**_measure(model, processor, args, device), "layers": layers}
        print(f"{name}: equal work {results[name]['equal_work']}, tax {results[name]['tax']:.3f}, skipping the old-log-prob forward "
              f"{results[name]['tax_skipping_old_logprob']:.3f}", flush=True)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    data = {
        "headline": headline_rows(results), "results": results,
        "setup": {"layers": {name: r["layers"] for name, r in results.items()}, "vision_depth": args.vision_depth, "prompts": args.prompts,
                  "samples_per_prompt": args.samples, "new_tokens": args.new_tokens, "image_side": args.image_side,
                  "temperature": args.temperature,
                  "dtype": "float32" if args.dry_run else "bfloat16", "dry_run": args.dry_run, "reps": args.reps},
    }
    write_result(args.out, "on_policy", data, shapes={"models": args.models, **data["setup"]}, label=args.label,
                 dry_run=args.dry_run)
    return data


if __name__ == "__main__":
    main()
