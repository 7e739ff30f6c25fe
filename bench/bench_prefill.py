"""Batch-invariant prefill on a Qwen2.5-VL-3B-shaped random-weight model (bf16, built from
``configs/qwen2_5_vl_3b.json``, nothing downloaded), on the GPU:

* ``checks``: the Triton kernels against torch in fp32 (matmul, RMSNorm, attention) and a
  matmul row alone / in 4,096 rows / shifted, bitwise;
* ``overhead`` (a): one training micro-batch (8 samples, half with 1 and half with 2 images
  of 1,024 visual tokens, responses of 300 tokens, right-padded), selected log-probs of
  the response tokens, forward only: default transformers kernels (sdpa, cuBLAS) vs
  ``batch_invariant()``; also the vision tower alone and the language model alone (vision
  rows given), because transformers' sdpa path runs the vision tower's window attention as
  a Python loop over windows (one sdpa call per window) while ``batch_invariant()`` runs it
  in one launch;
* ``group`` (b): a GRPO group of G = 8 responses (300 tokens) to one prompt with 1 or 2
  images: scoring all G samples in full (one right-padded batch) vs ``group_logprobs``
  (vision once, prompt KV once), both under ``batch_invariant()`` and checked bitwise
  equal; time and peak memory;
* ``tiles`` (with ``--tiles``): candidate ``MatmulConfig`` / ``AttentionConfig`` tiles against
  cuBLAS / sdpa at the model's shapes, TFLOP/s;
* the invariance sweep (``rlk_mm.parity.invariance``) on the same model with small images,
  under ``batch_invariant()`` and the default kernels.

Medians of CUDA-event timings after warm-up; peak memory is ``max_memory_allocated`` after
``reset_peak_memory_stats`` minus the memory held before the call (model and inputs).
Writes a ``prefill`` result and an ``invariance`` result (with its picture beside it, the same
name as a ``.png``) under ``--out`` (default ``$OUT`` or ``.``); ``--smoke`` writes them as dry runs.

    python -m bench.bench_prefill [--layers 36] [--reps 5] [--skip-sweep] [--tiles]
    python -m bench.bench_prefill --smoke   # the tiny model and small images, CPU or GPU (a dry run)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from rlk_mm import fixtures
from rlk_mm.models import VisionCache, batch_logprobs, forward_hidden, group_logprobs
from rlk_mm.ops._triton import attention as TA
from rlk_mm.ops._triton import matmul as TM
from rlk_mm.ops.invariant.attention import attention_interface
from rlk_mm.ops.invariant.matmul import matmul
from rlk_mm.ops.invariant.mode import batch_invariant
from rlk_mm.ops.logprob import selected_logprob
from rlk_mm.parity.invariance import invariance_sweep
from rlk_mm.schema.batch import RLBatch

from .common import GIB, add_output_args, command_line, load_config, peak_extra_bytes, time_ms, write_result

EOS = fixtures.IM_END_TOKEN_ID
MODEL = load_config("qwen2_5_vl_3b")


class Setup:
    """What --smoke shrinks: image side (896 px = 32 x 32 = 1,024 visual tokens), response length, device."""

    image_side = 32 * 28
    response = 300
    device = "cuda"


def config_3b(layers: int):
    """``configs/qwen2_5_vl_3b.json`` with ``layers`` text layers and the Qwen token ids."""
    from transformers import Qwen2_5_VLConfig

    special = {"bos_token_id": fixtures.ENDOFTEXT_TOKEN_ID, "eos_token_id": EOS,
               "pad_token_id": fixtures.ENDOFTEXT_TOKEN_ID}
    config = Qwen2_5_VLConfig(
        text_config={**MODEL["text_config"], "num_hidden_layers": layers, **special},
        vision_config=MODEL["vision_config"],
        image_token_id=fixtures.IMAGE_TOKEN_ID, video_token_id=fixtures.VIDEO_TOKEN_ID,
        vision_start_token_id=fixtures.VISION_START_TOKEN_ID, vision_end_token_id=fixtures.VISION_END_TOKEN_ID,
        tie_word_embeddings=MODEL["tie_word_embeddings"],
    )
    config._attn_implementation = "sdpa"
    return config


def build_model(layers: int):
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Qwen2_5_VLForConditionalGeneration(config_3b(layers))
    finally:
        torch.set_default_dtype(default)
    return model.to(torch.bfloat16).eval()


def timed(fn, reps: int, warmup: int = 1) -> dict:
    return time_ms(fn, reps, warmup, device=Setup.device)


def sync():
    if Setup.device == "cuda":
        torch.cuda.synchronize()


def peak_extra_gib(fn) -> float | None:
    if Setup.device != "cuda":
        fn()
        return None
    return round(peak_extra_bytes(fn) / GIB, 3)


def image(seed: int) -> Image.Image:
    """A seeded picture (smooth gradients plus noise), 896 x 896."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:Setup.image_side, 0:Setup.image_side] / Setup.image_side
    base = np.stack([np.sin(6 * xx + seed), np.cos(5 * yy - seed), xx * yy], -1)
    pixels = (127 + 100 * base + rng.normal(0, 12, base.shape)).clip(0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def sample(n_images: int, seed: int) -> fixtures.Sample:
    images = [image(seed * 10 + i) for i in range(n_images)]
    content = [{"type": "image"} for _ in images] + [
        {"type": "text",
         "text": f"Describe {'this image' if n_images == 1 else 'these images'} in detail, then answer: "
                                 "which region is brightest and why? Think step by step."}]
    return fixtures.Sample(f"bench-{seed}", [{"role": "user", "content": content}], images=images)


def responses(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 150000, (Setup.response - 1,), generator=g).tolist() + [EOS] for _ in range(n)]


def make_batch(processor, samples, resp, group_ids=None) -> RLBatch:
    out = fixtures.processor_inputs(processor, samples, padding_side="right")
    return RLBatch.from_qwen_vl(out, processor=processor, responses=resp, group_ids=group_ids).to(Setup.device)


def checks() -> dict:
    """Kernels vs torch in fp32 on the GPU, and matmul row invariance."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    from rlk_mm.parity.contract import relative_error

    dev = Setup.device
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=g, dtype=torch.bfloat16)  # noqa: E731
    out = {}
    rows, hidden, inner = (4096, 2048, 11008) if dev == "cuda" else (64, 64, 96)
    a, w, bias = rnd(rows, hidden), rnd(inner, hidden), rnd(inner)
    with batch_invariant():
        y = matmul(a, w.t(), bias)
        alone = matmul(a[17:18], w.t(), bias)
        shifted = matmul(torch.cat([a[:3], a[:100]]), w.t(), bias)[3:]
    out["matmul_rel_err_vs_fp32"] = relative_error(y, a.float() @ w.float().t() + bias.float())
    out["matmul_row_alone_bitwise"] = bool(torch.equal(alone, y[17:18]))
    out["matmul_rows_shifted_bitwise"] = bool(torch.equal(shifted, y[:100]))
    norm = Qwen2_5_VLRMSNorm(hidden).to(dev, torch.bfloat16)
    x = rnd(3000, hidden)
    with torch.no_grad():
        ref = norm(x)
        with batch_invariant():
            got = norm(x)
    out["rmsnorm_rel_err_vs_torch"] = relative_error(got, ref)
    n = 1500 if dev == "cuda" else 40
    q, k, v = rnd(1, 16, n, 128), rnd(1, 2, n, 128), rnd(1, 2, n, 128)
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(8, 1), v.float().repeat_interleave(8, 1), is_causal=True)
    with batch_invariant():
        att, _ = attention_interface(None, q, k, v, torch.ones(1, 1, n, n, dtype=torch.bool, device=dev).tril())
    out["attention_rel_err_vs_fp32"] = relative_error(att, expect.transpose(1, 2))
    out["ok"] = (out["matmul_row_alone_bitwise"] and out["matmul_rows_shifted_bitwise"]
                 and out["matmul_rel_err_vs_fp32"] < 1e-2 and out["rmsnorm_rel_err_vs_torch"] < 1e-2
                 and out["attention_rel_err_vs_fp32"] < 1e-2)
    return out


MM_CANDIDATES = [  # block_m, block_n, block_k, group_m, num_warps, num_stages
    TM.MatmulConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
    TM.MatmulConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
    TM.MatmulConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4),
    TM.MatmulConfig(block_m=256, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
    TM.MatmulConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4),
    TM.MatmulConfig(block_m=128, block_n=256, block_k=128, group_m=8, num_warps=8, num_stages=2),
]
ATTN_CANDIDATES = [  # block_m, block_n, num_warps, num_stages (block_d: the head dim's)
    (128, 64, 8, 2),
    (128, 128, 8, 2),
    (128, 64, 4, 3),
    (64, 64, 4, 3),
]


def linear_shapes() -> dict:
    """(N, K) of the model's linear layers (text and vision)."""
    t, v = MODEL["text_config"], MODEL["vision_config"]
    h, inner = t["hidden_size"], t["intermediate_size"]
    kv = t["num_key_value_heads"] * h // t["num_attention_heads"]
    vh, v_inner, merged = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
    return {"q/o_proj": (h, h), "k/v_proj": (kv, h), "gate/up": (inner, h), "down": (h, inner),
            "vision qkv": (3 * vh, vh), "vision proj": (vh, vh), "vision up": (v_inner, vh),
            "vision down": (vh, v_inner), "merger": (merged, merged)}


def tiles() -> dict:
    """Candidate tiles of the Triton kernels vs cuBLAS / sdpa at this model's shapes (TFLOP/s), to
    choose the matmul's and the attention's ``default_config`` (tiles that depend on N, K / the
    head dim only)."""
    from triton.testing import do_bench

    ms = lambda fn: do_bench(fn, warmup=10, rep=40, return_mode="median")  # noqa: E731
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    m = 16384
    out = {"matmul_M": m, "matmul": {}, "attention": {}}
    for name, (n, k) in linear_shapes().items():
        a, w = rnd(m, k), rnd(n, k)
        flops = 2 * m * n * k
        row = {"cublas": round(flops / ms(lambda: a @ w.t()) / 1e9, 1),
               "chosen": str(TM.default_config(n, k, torch.bfloat16))}
        for cfg in MM_CANDIDATES:
            label = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
            row[label] = round(flops / ms(lambda: TM.bmm(a[None], w.t()[None], config=cfg)) / 1e9, 1)
        out["matmul"][f"{name} N={n} K={k}"] = row
    t, v = MODEL["text_config"], MODEL["vision_config"]
    text = (t["num_attention_heads"], t["num_key_value_heads"], t["hidden_size"] // t["num_attention_heads"])
    vision = (v["num_heads"], v["num_heads"], v["hidden_size"] // v["num_heads"])
    window = (v["window_size"] // v["patch_size"]) ** 2
    cases = {  # (batch rows, segment length, (heads, kv heads, head dim), causal)
        f"text causal 8x1400 d{text[2]}": (8, 1400, text, True),
        f"vision windows 768x{window} d{vision[2]}": (768, window, vision, False),
        f"vision full 12x4096 d{vision[2]}": (12, 4096, vision, False),
    }
    for name, (bsz, length, (hq, hkv, d), causal) in cases.items():
        q, kk, vv = rnd(bsz, hq, length, d), rnd(bsz, hkv, length, d), rnd(bsz, hkv, length, d)
        seg = [torch.arange(bsz, dtype=torch.int32, device="cuda"), torch.zeros(bsz, dtype=torch.int32, device="cuda"),
               torch.full((bsz,), length, dtype=torch.int32,
                          device="cuda"), torch.zeros(bsz, dtype=torch.int32, device="cuda"),
               torch.full((bsz,), length, dtype=torch.int32, device="cuda")]
        flops = 4 * bsz * hq * length * length * d / (2 if causal else 1)
        rep_k, rep_v = kk.repeat_interleave(hq // hkv, 1), vv.repeat_interleave(hq // hkv, 1)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, rep_k, rep_v, is_causal=causal)  # noqa: E731
        chosen = TA.default_config(d, torch.bfloat16)
        row = {"sdpa (one call, no mask)": round(flops / ms(sdpa) / 1e9, 1), "chosen": str(chosen)}
        for bm, bn, warps, stages in ATTN_CANDIDATES:
            cfg = replace(chosen, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
            fn = lambda: TA.segment_attention(q, kk, vv, seg, causal=causal, scale=d**-0.5,  # noqa: E731
                                              max_q=length, config=cfg)
            row[f"{bm}x{bn} w{warps} s{stages}"] = round(flops / ms(fn) / 1e9, 1)
        out["attention"][name] = row
    out["unit"] = "TFLOP/s"
    return out


def overhead(model, processor, reps: int) -> dict:
    samples = [sample(1 + i % 2, 100 + i) for i in range(8)]
    batch = make_batch(processor, samples, responses(8, 1))
    head = model.get_output_embeddings().weight
    rows, targets = batch.loss_token_index()
    index = torch.arange(rows.numel(), device=Setup.device)
    with torch.no_grad():
        media = VisionCache(model)(batch)
    images = int(batch.image_grid_thw.shape[0])
    patches = int(batch.image_grid_thw.prod(-1).sum())

    def full():
        return batch_logprobs(model, batch, layout="right")

    def language():
        hidden = forward_hidden(model, batch, layout="right", media_embeds=media)[rows]
        return selected_logprob(hidden, head, index=index, targets=targets)

    def vision():
        return model.model.visual(batch.pixel_values, grid_thw=batch.image_grid_thw).pooler_output

    res = {"shape": {"samples": batch.num_samples, "images": images, "vision_patches": patches,
                     "visual_tokens": patches // 4, "tokens": batch.num_tokens, "scored_tokens": int(rows.numel()),
                     "padded_length": int(batch.seq_lengths().max()), "layout": "right-padded"}}
    outs = {}
    for mode in ("default", "batch_invariant"):
        ctx = batch_invariant() if mode == "batch_invariant" else contextlib.nullcontext()
        with ctx, torch.no_grad():
            outs[mode] = full()
            res[mode] = {"full": timed(full, reps), "language_model": timed(language, reps),
                         "vision_tower": timed(vision, reps),
                         "full_peak_extra_gib": peak_extra_gib(full)}
    for part in ("full", "language_model", "vision_tower"):
        res[f"overhead_{part}"] = round(res["batch_invariant"][part]["ms"] / res["default"][part]["ms"] - 1, 4)
    res["logprob_max_abs_diff_vs_default"] = float((outs["default"] - outs["batch_invariant"]).abs().max())
    res["target_overhead"] = 0.10
    return res


def group(model, processor, reps: int, n_images: int, g: int = 8) -> dict:
    prompt = sample(n_images, 7 + n_images)
    batch = make_batch(processor, [prompt] * g, responses(g, 2 + n_images), group_ids=["group"] * g)
    res = {"shape": {"group_size": g, "images": n_images,
                     "visual_tokens": int(batch.image_grid_thw.prod(-1).sum()) // 4,
                     "prompt_tokens": int(batch.prompt_lengths[0]), "response_tokens": Setup.response,
                     "layout": "right-padded"}}

    def full():
        return batch_logprobs(model, batch, layout="right")

    def cached():
        return group_logprobs(model, batch)

    def host_ms(fn) -> float:
        """Host time to issue fn (no sync at its end): close to the total when launch-bound."""
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            sync()
        return round(statistics.median(times), 3)

    with batch_invariant(), torch.no_grad():
        a, b = full(), cached()
        res["batch_invariant"] = {"full": timed(full, reps), "cached": timed(cached, reps),
                                  "full_peak_extra_gib": peak_extra_gib(full),
                                  "cached_peak_extra_gib": peak_extra_gib(cached),
                                  "bitwise_equal": bool(torch.equal(a, b)), "max_abs_diff": float((a - b).abs().max()),
                                  "full_host_issue_ms": host_ms(full), "cached_host_issue_ms": host_ms(cached),
                                  "cached_part_vision_cache_ms": timed(lambda: VisionCache(model)(batch), reps)["ms"]}
    bi = res["batch_invariant"]
    bi["speedup"] = round(bi["full"]["ms"] / bi["cached"]["ms"], 3)
    res["target_speedup"] = 3.0
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--tiles", action="store_true", help="also time candidate kernel tiles against cuBLAS / sdpa")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 56 px images, 8-token responses (a dry run)")
    add_output_args(parser)
    args = parser.parse_args()
    if args.smoke:
        Setup.image_side, Setup.response = 56, 8
        Setup.device = "cuda" if torch.cuda.is_available() else "cpu"
        args.reps = 1
    out_dir = Path(args.out)
    result = {
        "device": Setup.device,
        "model": {"name": MODEL["name"], "config": "bench/configs/qwen2_5_vl_3b.json", "text_layers": args.layers,
                  "dtype": "bfloat16", "weights": "random (seed 0)", "attn_implementation": "sdpa"},
    }

    def shapes():
        return {**result["model"], "image_side": Setup.image_side, "response": Setup.response}

    def save():
        write_result(out_dir, "prefill", result, shapes=shapes(), label=args.label, dry_run=args.smoke)

    t0 = time.time()
    if args.smoke:
        model = fixtures.tiny_qwen2_5_vl().to(Setup.device)
        result["model"] = {"name": "tiny (smoke run)", "dtype": "float32"}
    else:
        model = build_model(args.layers)
    processor = fixtures.qwen_vl_processor(max_pixels=Setup.image_side * Setup.image_side)
    result["build_s"] = round(time.time() - t0, 1)
    parts = [("checks", checks)] + ([("tiles", tiles)] if Setup.device == "cuda" and args.tiles else [])
    parts += [("overhead", lambda: overhead(model, processor, args.reps)),
              ("group_1_image", lambda: group(model, processor, args.reps, 1)),
              ("group_2_images", lambda: group(model, processor, args.reps, 2))]
    for name, fn in parts:
        t = time.time()
        try:
            result[name] = fn()
        except Exception:  # keep what the other parts measured
            result[name] = {"error": traceback.format_exc()}
        result[name]["wall_s"] = round(time.time() - t, 1)
        save()
        print(name, json.dumps(result[name])[:1500], flush=True)
    if not args.skip_sweep:
        t = time.time()
        try:
            small = fixtures.qwen_vl_processor()
            samples = fixtures.synthetic_image_text(4, seed=0)
            report = invariance_sweep(model, small, samples, group_size=4, response_length=32)
            report.meta["command"] = command_line()
            report.meta["wall_s"] = round(time.time() - t, 1)
            sweep_shapes = {**report.meta.get("config", {}), "samples": 4, "group_size": 4, "response_length": 32}
            path = write_result(out_dir, "invariance", report.to_dict(), shapes=sweep_shapes, label=args.label,
                                dry_run=args.smoke)
            report.save_png(path.with_suffix(".png"))
            print(report.table(), flush=True)
            result["invariance"] = {"invariant": report.invariant,
                                    "control_drifting_cases": sorted({r.case for r in report.results
                                                                      if r.mode == "default" and not r.bitwise}),
                                    "wall_s": report.meta["wall_s"]}
        except Exception:
            result["invariance"] = {"error": traceback.format_exc()}
            print(result["invariance"]["error"], flush=True)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
