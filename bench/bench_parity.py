"""Layout-parity speed on CPU: 512 samples x 4,096 tokens with 2 images each.

Both batches are built once (from token lists, as a rollout engine returns them); the
timed part is ``check_layout_parity`` alone. Writes a ``parity`` result (card ``cpu``) under
``--out`` (default ``$OUT`` or ``.``).

    python -m bench.bench_parity [--samples 512] [--tokens 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from rlk_mm import RLBatch
from rlk_mm.fixtures import qwen_vl_processor
from rlk_mm.parity import check_layout_parity

from .common import add_output_args, write_result

IMAGE_PAD, VISION_START, VISION_END, EOS = 151655, 151652, 151653, 151645


def build(processor, samples: int, tokens: int) -> RLBatch:
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor([1, 32, 32])  # 256 tokens per image
    per_image = int(grid.prod()) // 4
    prompts, responses = [], []
    prompt_len = tokens // 2
    for _ in range(samples):
        text = torch.randint(0, 150000, (prompt_len,), generator=gen)
        ids = text.clone()
        for start in (16, 16 + per_image + 40):
            ids[start - 1] = VISION_START
            ids[start : start + per_image] = IMAGE_PAD
            ids[start + per_image] = VISION_END
        prompts.append(ids.tolist())
        resp = torch.randint(0, 150000, (tokens - prompt_len,), generator=gen)
        resp[-1] = EOS
        responses.append(resp.tolist())
    keys = [f"key-{i}" for i in range(2 * samples)]
    return RLBatch.from_token_lists(prompts, responses, processor=processor, image_grid_thw=grid.repeat(2 * samples, 1),
                                    media_cache_keys=keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    add_output_args(parser)
    args = parser.parse_args()
    processor = qwen_vl_processor()
    t0 = time.perf_counter()
    a = build(processor, args.samples, args.tokens)
    b = a.select(range(a.num_samples))
    build_s = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        report = check_layout_parity(a, b)
        times.append(time.perf_counter() - t)
    assert report.ok
    # a drift in the last sample must be found too, in the same time budget
    pos = b.position_ids.clone()
    pos[1, -10] += 1
    drifted = RLBatch(**{**{k: getattr(b, k) for k in type(b).model_fields}, "position_ids": pos})
    t = time.perf_counter()
    report = check_layout_parity(a, drifted)
    drift_s = time.perf_counter() - t
    assert not report.ok and report.first.sample == args.samples - 1
    result = {
        "benchmark": "check_layout_parity",
        "samples": args.samples,
        "tokens_per_sample": args.tokens,
        "images_per_sample": 2,
        "total_tokens": a.num_tokens,
        "median_s": statistics.median(times),
        "times_s": times,
        "with_one_drift_s": drift_s,
        "build_s_not_timed": build_s,
        "threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0],  # other work on the machine inflates the times
    }
    shapes = {"samples": args.samples, "tokens_per_sample": args.tokens, "images_per_sample": 2}
    write_result(args.out, "parity", result, shapes=shapes, label=args.label, card="cpu")
    print(f"check_layout_parity: {args.samples} x {args.tokens} tokens, 2 images each: "
          f"median {result['median_s']:.3f} s (one drift: {drift_s:.3f} s)")


if __name__ == "__main__":
    main()
