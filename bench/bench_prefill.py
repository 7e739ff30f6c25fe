"""Batch-invariant prefill on a Qwen2.5-VL-3B-shaped random-weight model (bf16, built from a
config, nothing downloaded), on the GPU:

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
* the invariance sweep (``rlk_mm.parity.invariance``) on the same model with small images,
  under ``batch_invariant()`` and the default kernels.

Medians of CUDA-event timings after warm-up; peak memory is ``max_memory_allocated`` after
``reset_peak_memory_stats`` minus the memory held before the call (model and inputs).
Writes ``prefill.json``, ``invariance_gpu.json`` and ``invariance_gpu.png`` to ``--out``
(default ``$OUT`` or ``.``).

    python bench/bench_prefill.py [--layers 36] [--reps 5] [--skip-sweep]
    python bench/bench_prefill.py --smoke   # the tiny model and small images, CPU or GPU (a dry run)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import GIB, peak_extra_bytes, time_ms  # noqa: E402

from rlk_mm import fixtures  # noqa: E402
from rlk_mm.ops import prefill as P  # noqa: E402
from rlk_mm.ops.cache import VisionCache, group_logprobs  # noqa: E402
from rlk_mm.ops.logprob import selected_logprob  # noqa: E402
from rlk_mm.parity.invariance import invariance_sweep  # noqa: E402
from rlk_mm.schema.batch import RLBatch  # noqa: E402

EOS = fixtures.IM_END_TOKEN_ID


class Setup:
    """What --smoke shrinks: image side (896 px = 32 x 32 = 1,024 visual tokens), response length, device."""

    image_side = 32 * 28
    response = 300
    device = "cuda"


def config_3b(layers: int):
    from transformers import Qwen2_5_VLConfig

    half = 64  # head_dim 128
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": layers,
            "num_attention_heads": 16, "num_key_value_heads": 2, "max_position_embeddings": 128000,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, half - 40]},
            "bos_token_id": fixtures.ENDOFTEXT_TOKEN_ID, "eos_token_id": EOS, "pad_token_id": fixtures.ENDOFTEXT_TOKEN_ID,
        },
        vision_config={
            "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 2048,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        },
        image_token_id=fixtures.IMAGE_TOKEN_ID, video_token_id=fixtures.VIDEO_TOKEN_ID,
        vision_start_token_id=fixtures.VISION_START_TOKEN_ID, vision_end_token_id=fixtures.VISION_END_TOKEN_ID,
        tie_word_embeddings=True,
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
        {"type": "text", "text": f"Describe {'this image' if n_images == 1 else 'these images'} in detail, then answer: "
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
    with P.batch_invariant():
        y = P.matmul(a, w.t(), bias)
        alone = P.matmul(a[17:18], w.t(), bias)
        shifted = P.matmul(torch.cat([a[:3], a[:100]]), w.t(), bias)[3:]
    out["matmul_rel_err_vs_fp32"] = relative_error(y, a.float() @ w.float().t() + bias.float())
    out["matmul_row_alone_bitwise"] = bool(torch.equal(alone, y[17:18]))
    out["matmul_rows_shifted_bitwise"] = bool(torch.equal(shifted, y[:100]))
    norm = Qwen2_5_VLRMSNorm(hidden).to(dev, torch.bfloat16)
    x = rnd(3000, hidden)
    with torch.no_grad():
        ref = norm(x)
        with P.batch_invariant():
            got = norm(x)
    out["rmsnorm_rel_err_vs_torch"] = relative_error(got, ref)
    n = 1500 if dev == "cuda" else 40
    q, k, v = rnd(1, 16, n, 128), rnd(1, 2, n, 128), rnd(1, 2, n, 128)
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(8, 1), v.float().repeat_interleave(8, 1), is_causal=True)
    with P.batch_invariant():
        att, _ = P._attention_interface(None, q, k, v, torch.ones(1, 1, n, n, dtype=torch.bool, device=dev).tril())
    out["attention_rel_err_vs_fp32"] = relative_error(att, expect.transpose(1, 2))
    out["ok"] = (out["matmul_row_alone_bitwise"] and out["matmul_rows_shifted_bitwise"]
                 and out["matmul_rel_err_vs_fp32"] < 1e-2 and out["rmsnorm_rel_err_vs_torch"] < 1e-2
                 and out["attention_rel_err_vs_fp32"] < 1e-2)
    return out


MM_CANDIDATES = {
    "128x256x64 w8 s3": dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3),
    "128x128x64 w8 s3": dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=3),
    "128x128x64 w4 s4": dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=4, num_stages=4),
    "256x128x64 w8 s3": dict(BM=256, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=3),
    "128x256x64 w8 s4": dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=4),
    "128x256x128 w8 s2": dict(BM=128, BN=256, BK=128, GROUP_M=8, num_warps=8, num_stages=2),
}
ATTN_CANDIDATES = {
    "128x64 w8 s2": dict(BM=128, BN=64, num_warps=8, num_stages=2),
    "128x128 w8 s2": dict(BM=128, BN=128, num_warps=8, num_stages=2),
    "128x64 w4 s3": dict(BM=128, BN=64, num_warps=4, num_stages=3),
    "64x64 w4 s3": dict(BM=64, BN=64, num_warps=4, num_stages=3),
}


def tiles() -> dict:
    """Candidate tiles of the Triton kernels vs cuBLAS / sdpa at this model's shapes (TFLOP/s), to
    choose mm_config / attention_config (the chosen tiles must depend on N, K / head dim only)."""
    from triton.testing import do_bench

    from rlk_mm.ops._triton import attention as TA
    from rlk_mm.ops._triton import matmul as TM

    ms = lambda fn: do_bench(fn, warmup=10, rep=40, return_mode="median")  # noqa: E731
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    m = 16384
    shapes = {"q/o_proj": (2048, 2048), "k/v_proj": (256, 2048), "gate/up": (11008, 2048), "down": (2048, 11008),
              "vision qkv": (3840, 1280), "vision proj": (1280, 1280), "vision up": (3420, 1280),
              "vision down": (1280, 3420), "merger": (5120, 5120)}
    out = {"matmul_M": m, "matmul": {}, "attention": {}}
    for name, (n, k) in shapes.items():
        a, w = rnd(m, k), rnd(n, k)
        flops = 2 * m * n * k
        row = {"cublas": round(flops / ms(lambda: a @ w.t()) / 1e9, 1), "chosen": str(TM.mm_config(n, k, torch.bfloat16))}
        for label, cfg in MM_CANDIDATES.items():
            row[label] = round(flops / ms(lambda: TM.bmm(a[None], w.t()[None], config=cfg)) / 1e9, 1)
        out["matmul"][f"{name} N={n} K={k}"] = row
    cases = {  # (batch rows, segment length, heads, kv heads, head dim, causal)
        "text causal 8x1400 d128": (8, 1400, 16, 2, 128, True),
        "vision windows 768x64 d80": (768, 64, 16, 16, 80, False),
        "vision full 12x4096 d80": (12, 4096, 16, 16, 80, False),
    }
    for name, (bsz, length, hq, hkv, d, causal) in cases.items():
        q, kk, vv = rnd(bsz, hq, length, d), rnd(bsz, hkv, length, d), rnd(bsz, hkv, length, d)
        seg = [torch.arange(bsz, dtype=torch.int32, device="cuda"), torch.zeros(bsz, dtype=torch.int32, device="cuda"),
               torch.full((bsz,), length, dtype=torch.int32, device="cuda"), torch.zeros(bsz, dtype=torch.int32, device="cuda"),
               torch.full((bsz,), length, dtype=torch.int32, device="cuda")]
        flops = 4 * bsz * hq * length * length * d / (2 if causal else 1)
        rep_k, rep_v = kk.repeat_interleave(hq // hkv, 1), vv.repeat_interleave(hq // hkv, 1)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, rep_k, rep_v, is_causal=causal)  # noqa: E731
        row = {"sdpa (one call, no mask)": round(flops / ms(sdpa) / 1e9, 1), "chosen": str(TA.attention_config(d, torch.bfloat16))}
        for label, cfg in ATTN_CANDIDATES.items():
            cfg = dict(cfg, BD=max(16, 1 << (d - 1).bit_length()))
            fn = lambda: TA.segment_attention(q, kk, vv, seg, causal=causal, scale=d**-0.5, max_q=length, config=cfg)  # noqa: E731
            row[label] = round(flops / ms(fn) / 1e9, 1)
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
        return P.batch_logprobs(model, batch, layout="right")

    def language():
        hidden = P.forward_hidden(model, batch, layout="right", media_embeds=media)[rows]
        return selected_logprob(hidden, head, index=index, targets=targets)

    def vision():
        return model.model.visual(batch.pixel_values, grid_thw=batch.image_grid_thw).pooler_output

    res = {"shape": {"samples": batch.num_samples, "images": images, "vision_patches": patches,
                     "visual_tokens": patches // 4, "tokens": batch.num_tokens, "scored_tokens": int(rows.numel()),
                     "padded_length": int(batch.seq_lengths().max()), "layout": "right-padded"}}
    outs = {}
    for mode in ("default", "batch_invariant"):
        ctx = P.batch_invariant() if mode == "batch_invariant" else contextlib.nullcontext()
        with ctx, torch.no_grad():
            outs[mode] = full()
            res[mode] = {"full": timed(full, reps), "language_model": timed(language, reps), "vision_tower": timed(vision, reps),
                         "full_peak_extra_gib": peak_extra_gib(full)}
    for part in ("full", "language_model", "vision_tower"):
        res[f"overhead_{part}"] = round(res["batch_invariant"][part]["ms"] / res["default"][part]["ms"] - 1, 4)
    res["logprob_max_abs_diff_vs_default"] = float((outs["default"] - outs["batch_invariant"]).abs().max())
    res["target_overhead"] = 0.10
    return res


def group(model, processor, reps: int, n_images: int, g: int = 8) -> dict:
    prompt = sample(n_images, 7 + n_images)
    batch = make_batch(processor, [prompt] * g, responses(g, 2 + n_images), group_ids=["group"] * g)
    res = {"shape": {"group_size": g, "images": n_images, "visual_tokens": int(batch.image_grid_thw.prod(-1).sum()) // 4,
                     "prompt_tokens": int(batch.prompt_lengths[0]), "response_tokens": Setup.response, "layout": "right-padded"}}

    def full():
        return P.batch_logprobs(model, batch, layout="right")

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

    with P.batch_invariant(), torch.no_grad():
        a, b = full(), cached()
        res["batch_invariant"] = {"full": timed(full, reps), "cached": timed(cached, reps),
                                  "full_peak_extra_gib": peak_extra_gib(full), "cached_peak_extra_gib": peak_extra_gib(cached),
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
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.smoke:
        Setup.image_side, Setup.response = 56, 8
        Setup.device = "cuda" if torch.cuda.is_available() else "cpu"
        args.reps = 1
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import transformers
    import triton

    result = {
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if Setup.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "model": {"shape": "Qwen2.5-VL-3B", "text_layers": args.layers, "hidden": 2048, "heads": 16, "kv_heads": 2,
                  "intermediate": 11008, "vision_depth": 32, "vision_hidden": 1280, "dtype": "bfloat16",
                  "weights": "random (seed 0)", "attn_implementation": "sdpa"},
    }
    path = out_dir / "prefill.json"

    def save():
        path.write_text(json.dumps(result, indent=1) + "\n")

    t0 = time.time()
    if args.smoke:
        model = fixtures.tiny_qwen2_5_vl().to(Setup.device)
        result["model"] = {"shape": "tiny (smoke run)", "dtype": "float32"}
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
            report.meta["command"] = result["command"]
            report.meta["wall_s"] = round(time.time() - t, 1)
            report.save_json(out_dir / "invariance_gpu.json")
            report.save_png(out_dir / "invariance_gpu.png")
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
