"""Audio-codec batch invariance: code flips between batch = 1 and batch = N of a bf16 encoder
followed by a residual quantizer (``rlk_mm.parity.codec_invariance``), under the default
kernels and under ``batch_invariant()``, plus the batched encode's time in each mode.

The codec is ``rlk_mm.fixtures.codec.tiny_codec`` at speech-codec-like sizes: 20 ms frames
at 16 kHz (320 samples), a 1024-wide bf16 MLP to 128-d latents, 8 residual stages of 1024
codewords drawn from the encoder's latents. Expected on a GPU: flips under the default
(cuBLAS picks another GEMM for another row count), none under ``batch_invariant()``.

    python -m bench.bench_codec --out $OUT            # GPU, about a minute
    python -m bench.bench_codec --dry-run --out /tmp   # CPU, tiny shapes, every code path
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from rlk_mm.fixtures.codec import synthetic_clips, tiny_codec
from rlk_mm.ops import batch_invariant
from rlk_mm.parity.codec import MODES, codec_invariance

from .common import add_output_args, time_ms, write_result

#: name -> codec sizes and clips (N clips of `seconds` at 16 kHz)
CONFIGS = {
    "speech_8x4s": dict(frame=320, hidden=1024, dim=128, stages=8, codebook_size=1024, clips=8, seconds=4.0),
    "speech_64x4s": dict(frame=320, hidden=1024, dim=128, stages=8, codebook_size=1024, clips=64, seconds=4.0),
    "speech_64x4s_wide": dict(frame=320, hidden=2048, dim=256, stages=8, codebook_size=1024, clips=64, seconds=4.0),
    # few frames per clip (small GEMM rows alone) and wide layers: where cuBLAS picks split-K kernels
    "short_clips_wide": dict(frame=320, hidden=4096, dim=256, stages=8, codebook_size=1024, clips=64, seconds=0.2),
    "long_frames_wide": dict(frame=1600, hidden=4096, dim=256, stages=8, codebook_size=1024, clips=64, seconds=1.0),
}
DRY_RUN = {"dry_run_tiny": dict(frame=32, hidden=64, dim=8, stages=3, codebook_size=32, clips=4, seconds=0.08)}
RATE = 16_000


def run_config(name: str, cfg: dict, device: torch.device, seeds: list[int], reps: int) -> dict:
    samples = int(cfg["seconds"] * RATE) // cfg["frame"] * cfg["frame"]
    out = {"config": name, **cfg, "samples_per_clip": samples, "frames_per_clip": samples // cfg["frame"], "seeds": []}
    for seed in seeds:
        encoder, quantizer = tiny_codec(frame=cfg["frame"], hidden=cfg["hidden"], dim=cfg["dim"], stages=cfg["stages"],
                                        codebook_size=cfg["codebook_size"], seed=seed, calibration_clips=32,
                                        calibration_samples=max(samples, cfg["frame"] * 64))
        encoder, quantizer = encoder.to(device), quantizer.to(device)
        clips = synthetic_clips(cfg["clips"], samples, seed=seed + 100).to(device)
        report = codec_invariance(encoder, quantizer, clips)
        entry = {"seed": seed, **{mode: vars(run) for mode, run in report.runs.items()}}
        for mode in MODES:
            with torch.no_grad(), (batch_invariant() if mode == "batch_invariant" else contextlib.nullcontext()):
                entry[mode]["batched_encode"] = time_ms(lambda: quantizer(encoder(clips)), reps, device=device.type)
        out["seeds"].append(entry)
        print(f"{name} seed {seed}: " + ", ".join(
            f"{mode} {entry[mode]['flip_rate']:.2%} flips ({entry[mode]['flipped']}/{entry[mode]['codes']}, "
            f"latent drift {entry[mode]['latent_max_abs_diff']:.3g}, "
            f"encode {entry[mode]['batched_encode']['ms']:.2f} ms)"
            for mode in MODES), flush=True)
    for mode in MODES:
        flipped = sum(s[mode]["flipped"] for s in out["seeds"])
        codes = sum(s[mode]["codes"] for s in out["seeds"])
        out[f"{mode}_flip_rate"] = flipped / codes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU: exercises every code path, writes the JSON")
    ap.add_argument("--seeds", type=int, default=3, help="codecs (and clip sets) per config (default 3)")
    ap.add_argument("--reps", type=int, default=10, help="timed batched encodes per mode (default 10)")
    add_output_args(ap)
    args = ap.parse_args()
    if args.dry_run:
        device, configs, seeds, reps = torch.device("cpu"), DRY_RUN, list(range(min(args.seeds, 2))), 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_codec.py measures a GPU: run it on a CUDA machine, or pass --dry-run")
        device, configs, seeds, reps = torch.device("cuda"), CONFIGS, list(range(args.seeds)), args.reps
    torch.backends.cuda.matmul.allow_tf32 = False  # the quantizer's fp32 distances stay fp32
    results = [run_config(name, cfg, device, seeds, reps) for name, cfg in configs.items()]
    result = {
        "benchmark": "codec_invariance", "dry_run": args.dry_run, "device": str(device),
        "what": "code-flip rate of each clip encoded alone (batch = 1) against all clips at once (batch = N); "
                "bitwise code comparison; flip_rate = flipped codes / (N * frames * stages)",
        "timing": "batched_encode: encoder + quantizer on all N clips, median after 2 warm-up calls",
        "configs": results,
    }
    write_result(args.out, "codec", result, shapes=configs, label=args.label, dry_run=args.dry_run)
    print(json.dumps({r["config"]: {m: round(r[f"{m}_flip_rate"], 5) for m in MODES} for r in results}))


if __name__ == "__main__":
    main()
