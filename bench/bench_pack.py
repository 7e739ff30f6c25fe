"""GPU benchmark of pack/unpad ``[B, L, H] ↔ [T, H]`` against device-to-device copy and torch.

Default shape: B=16, L=4096, H=3584 bf16 (Qwen2.5-VL-7B hidden states, ``configs/lm_heads.json``),
about 70% of the positions valid (left padding, lengths drawn uniformly in [0.4 L, L]).
Measured, each a median of CUDA-event timings after warm-up:

- ``copy``: ``dst.copy_(src)`` of the packed bytes ``[T, H]`` (and of ``[B*L, H]``): the
  device-to-device bandwidth a gather can at best reach (bytes read + bytes written);
- pack: ``pack_padded`` (public op, Triton; mask checks and index included), the Triton
  gather alone (index precomputed), torch ``x[mask]`` and ``index_select``;
- unpad: ``unpack_to_padded`` (public, Triton), the Triton gather alone, torch
  ``out[mask] = packed`` and ``index_copy_``;
- forward + backward of ``pack_padded`` (the backward is the unpad kernel), both backends;
- a sweep of the gather's tile shapes, and a per-token ``[B, L]`` fp32 tensor (H = 1).

``fraction_of_copy`` is achieved bandwidth over the copy bandwidth measured on the same
number of bytes. Correctness (bitwise) is checked before timing. Writes a ``pack`` result
under ``--out`` (default ``$OUT`` or ``.``).

    python -m bench.bench_pack [--B 16 --L 4096 --H 3584] [--reps 20]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, astuple

import torch

from rlk_mm.ops import padded as P
from rlk_mm.ops._triton import pack as tri
from rlk_mm.schema.checks import DeviceChecks

from .common import add_output_args, forced_backend, load_config, measure, write_result

DEVICE = "cuda"
SWEEP = [
    tri.GatherConfig(block_r=r, block_f=f, num_warps=w)
    for r, f, w in ((8, 512, 4), (4, 512, 4), (16, 512, 8), (32, 512, 8),
                    (4, 1024, 4), (8, 1024, 8), (2, 2048, 8), (1, 4096, 8))
]


def rate(entry: dict, nbytes: int, copy_gbps: float) -> dict:
    gbps = nbytes / (entry["ms"] * 1e-3) / 1e9
    return {**entry, "bytes": nbytes, "GBps": round(gbps, 1), "fraction_of_copy": round(gbps / copy_gbps, 3)}


def left_padded_mask(B: int, L: int, g: torch.Generator) -> torch.Tensor:
    lengths = (torch.rand(B, generator=g, device=DEVICE) * 0.6 + 0.4) * L
    j = torch.arange(L, device=DEVICE)
    return j[None, :] >= (L - lengths.long())[:, None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--H", type=int, default=load_config("lm_heads")["7b"]["hidden"])
    ap.add_argument("--reps", type=int, default=20)
    add_output_args(ap)
    args = ap.parse_args()
    B, L, H, reps = args.B, args.L, args.H, args.reps
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device=DEVICE).manual_seed(0)
    mask = left_padded_mask(B, L, g)
    x = torch.randn(B, L, H, device=DEVICE, generator=g).bfloat16()
    T = int(mask.sum())
    elt = x.element_size()
    starts, lengths = P.mask_runs(x, mask, DeviceChecks())
    cu = P.cu_seqlens_of(lengths)
    rows = P.packed_source_rows(starts, cu, L, T)
    inverse = P.padded_source_rows(starts, cu, L)
    flat = x.reshape(B * L, H)
    zero = x.new_zeros(1)
    result = {
        "benchmark": "pack_unpad", "dtype": "bfloat16",
        "shape": {"B": B, "L": L, "H": H, "T": T, "valid_fraction": round(T / (B * L), 4)},
        "reps": reps, "timing": "median of CUDA-event timings after 3 warm-up calls",
    }

    # ---------------------------------------------------------------- correctness (bitwise)
    want = x[mask]
    packed, cu_pub = P.pack_padded(x, mask)
    with forced_backend("torch"):
        packed_torch, _ = P.pack_padded(x, mask)
        padded_torch = P.unpack_to_padded(want, cu, L, "left")
    padded = P.unpack_to_padded(want, cu, L, "left")
    want_padded = torch.zeros_like(x)
    want_padded[mask] = want
    checks = {
        "pack_triton_equals_x_mask": torch.equal(packed, want),
        "pack_torch_equals_x_mask": torch.equal(packed_torch, want),
        "cu_seqlens": torch.equal(cu_pub, cu),
        "unpad_triton_equals_masked_assign": torch.equal(padded, want_padded),
        "unpad_torch_equals_masked_assign": torch.equal(padded_torch, want_padded),
    }
    grads = {}
    for name in ("triton", "torch"):
        with forced_backend(name):
            xs = x[:2].clone().requires_grad_()
            out, _ = P.pack_padded(xs, mask[:2])
            gy = torch.randn(out.shape, device=DEVICE, generator=g).bfloat16()
            out.backward(gy)
            grads[name] = (xs.grad, gy)
    gy = grads["triton"][1]
    ref_grad = torch.zeros_like(x[:2])
    ref_grad[mask[:2]] = gy
    checks["backward_triton_is_scatter"] = torch.equal(grads["triton"][0], ref_grad)
    for cfg in SWEEP:
        gathered = torch.equal(tri.gather_rows(flat, rows, zero, config=cfg), want)
        checks[f"gather_config_{astuple(cfg)}"] = gathered and torch.equal(
            tri.gather_rows(want, inverse, zero, config=cfg).reshape(B, L, H), want_padded
        )
    result["checks"] = checks
    del packed, packed_torch, padded, padded_torch, want_padded, grads, ref_grad, xs, out

    # ---------------------------------------------------------------- copy ceiling
    src = torch.randn(T, H, device=DEVICE, generator=g).bfloat16()
    dst = torch.empty_like(src)
    big_dst = torch.empty_like(flat)
    # the lambdas run here; the del below frees the buffers (pyflakes sees the del as undefining them)
    copy_packed = measure(lambda: dst.copy_(src), reps)  # noqa: F821
    copy_padded = measure(lambda: big_dst.copy_(flat), reps)  # noqa: F821
    pack_bytes = 2 * T * H * elt
    unpad_bytes = (T + B * L) * H * elt
    copy_gbps = pack_bytes / (copy_packed["ms"] * 1e-3) / 1e9
    copy_big_gbps = 2 * B * L * H * elt / (copy_padded["ms"] * 1e-3) / 1e9
    result["copy"] = {
        "packed_bytes": rate(copy_packed, pack_bytes, copy_gbps),
        "padded_bytes": rate(copy_padded, 2 * B * L * H * elt, copy_big_gbps),
    }
    del src, dst, big_dst

    # ---------------------------------------------------------------- pack [B, L, H] → [T, H]
    with forced_backend("torch"):
        torch_public = measure(lambda: P.pack_padded(x, mask), reps)
    result["pack"] = {
        "triton_pack_padded": rate(measure(lambda: P.pack_padded(x, mask), reps), pack_bytes, copy_gbps),
        "triton_gather_only": rate(measure(lambda: tri.gather_rows(flat, rows, zero), reps), pack_bytes, copy_gbps),
        "torch_backend_pack_padded": rate(torch_public, pack_bytes, copy_gbps),
        "torch_x_mask": rate(measure(lambda: x[mask], reps), pack_bytes, copy_gbps),
        "torch_index_select": rate(measure(lambda: flat.index_select(0, rows), reps), pack_bytes, copy_gbps),
    }

    # ---------------------------------------------------------------- unpad [T, H] → [B, L, H]
    packed = x[mask]
    unpad_copy_gbps = max(copy_gbps, copy_big_gbps)

    def torch_masked_assign():
        out = torch.zeros_like(x)
        out[mask] = packed
        return out

    def torch_index_copy():
        return flat.new_zeros(B * L, H).index_copy_(0, rows, packed)

    with forced_backend("torch"):
        torch_public = measure(lambda: P.unpack_to_padded(packed, cu, L, "left"), reps)
    result["unpad"] = {
        "triton_unpack_to_padded": rate(measure(lambda: P.unpack_to_padded(packed, cu, L, "left"), reps), unpad_bytes,
                                        unpad_copy_gbps),
        "triton_gather_only": rate(measure(lambda: tri.gather_rows(packed, inverse, zero), reps), unpad_bytes,
                                   unpad_copy_gbps),
        "torch_backend_unpack_to_padded": rate(torch_public, unpad_bytes, unpad_copy_gbps),
        "torch_masked_assign": rate(measure(torch_masked_assign, reps), unpad_bytes, unpad_copy_gbps),
        "torch_index_copy": rate(measure(torch_index_copy, reps), unpad_bytes, unpad_copy_gbps),
    }

    # ---------------------------------------------------------------- forward + backward
    xg = x.detach().requires_grad_()
    gy = torch.randn(T, H, device=DEVICE, generator=g).bfloat16()

    def fwd_bwd():  # runs before the del of xg and gy below
        out, _ = P.pack_padded(xg, mask)  # noqa: F821
        out.backward(gy)  # noqa: F821
        xg.grad = None  # noqa: F821

    fb = {}
    for name in ("triton", "torch"):
        with forced_backend(name):
            fb[name] = rate(measure(fwd_bwd, reps), pack_bytes + unpad_bytes, unpad_copy_gbps)
    result["pack_forward_backward"] = fb
    del xg, gy

    # ---------------------------------------------------------------- tile sweep (gather alone)
    sweep = []
    for cfg in SWEEP:
        p_ms = measure(lambda: tri.gather_rows(flat, rows, zero, config=cfg), reps)["ms"]
        u_ms = measure(lambda: tri.gather_rows(packed, inverse, zero, config=cfg), reps)["ms"]
        sweep.append({
            **asdict(cfg), "pack_ms": p_ms, "unpad_ms": u_ms,
            "pack_fraction_of_copy": round(pack_bytes / (p_ms * 1e-3) / 1e9 / copy_gbps, 3),
            "unpad_fraction_of_copy": round(unpad_bytes / (u_ms * 1e-3) / 1e9 / unpad_copy_gbps, 3),
        })
    result["tile_sweep"] = {"default": asdict(tri.default_config(H, x.device)), "configs": sweep}

    # ---------------------------------------------------------------- per-token [B, L] fp32 (H = 1)
    v = torch.randn(B, L, device=DEVICE, generator=g)
    with forced_backend("torch"):
        small_torch = measure(lambda: P.pack_padded(v, mask), reps)
    result["per_token_fp32"] = {
        "triton_pack_padded": measure(lambda: P.pack_padded(v, mask), reps),
        "torch_backend_pack_padded": small_torch,
        "torch_v_mask": measure(lambda: v[mask], reps),
    }

    write_result(args.out, "pack", result, shapes={**result["shape"], "dtype": "bfloat16"}, label=args.label)
    print(json.dumps(result["checks"]))
    print(f"{torch.cuda.get_device_name()}  B={B} L={L} H={H} T={T} ({T / (B * L):.0%} valid) bf16")
    print(f"copy [T,H]: {copy_packed['ms']:.3f} ms = {copy_gbps:.0f} GB/s;  "
          f"copy [B*L,H]: {copy_padded['ms']:.3f} ms = {copy_big_gbps:.0f} GB/s")
    for section in ("pack", "unpad", "pack_forward_backward"):
        for name, e in result[section].items():
            print(f"{section:>22} {name:<32} {e['ms']:8.3f} ms {e['GBps']:7.0f} GB/s "
                  f"{e['fraction_of_copy']:6.1%} of copy  +{e['extra_gib']:.3f} GiB")
    for s in sweep:
        print(f"  tile {s['block_r']:>3}x{s['block_f']:<5} w{s['num_warps']}: "
              f"pack {s['pack_ms']:.3f} ms ({s['pack_fraction_of_copy']:.1%}), "
              f"unpad {s['unpad_ms']:.3f} ms ({s['unpad_fraction_of_copy']:.1%})")
    for name, e in result["per_token_fp32"].items():
        print(f"  per-token fp32 [B, L] {name:<28} {e['ms']:.4f} ms")
    if not all(checks.values()):
        raise SystemExit(f"correctness checks failed: {[k for k, ok in checks.items() if not ok]}")


if __name__ == "__main__":
    main()
