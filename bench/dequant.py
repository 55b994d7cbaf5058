"""Dequantization throughput of app.engine.kernels.quants on a 1024x4096 weight.

Run from the repository root: ``python -m bench.dequant [--rows 1024] [--cols 4096] [--repeat 20]
[--no-gguf] [--gpu]``. For each type it prints the median (and min) time of
``dequantize(raw, t, out=out)`` (a preallocated output, as a matmul's just-in-time path uses it),
GB/s from the median counted as bytes read plus bytes written, and for comparison the median time
of gguf.quants.dequantize on the CPU. On a busy machine the min is the steadier number.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from app.engine.kernels import quants as Q

# Byte offsets of the fp16 scale fields in each block type; random bytes there could be NaN/Inf.
_F16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
               Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def random_weight(t: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw rows of type t: random quant bytes, finite fp16 scales. (rows, row_bytes) uint8."""
    nbytes = Q.row_bytes(t, cols)
    if t == Q.F32:
        return rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint8)
    if t in (Q.F16, Q.BF16):
        return rng.standard_normal((rows, cols), dtype=np.float32).astype(np.float16).view(np.uint8)
    raw = rng.integers(0, 256, (rows, nbytes), dtype=np.uint8)
    blocks = raw.reshape(-1, Q.BLOCK_SIZES[t][1])                         # (n_blocks, block_bytes)
    for pos in _F16_FIELDS[t]:
        scale = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)  # (n_blocks,)
        blocks[:, pos:pos + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw


def times_ms(fn, repeat: int, sync=lambda: None) -> list[float]:
    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--no-gguf", action="store_true", help="skip the gguf.quants comparison")
    ap.add_argument("--gpu", action="store_true", help="run on CuPy (needs a GPU)")
    args = ap.parse_args()

    xp, sync, device = np, (lambda: None), "CPU (NumPy)"
    if args.gpu:
        import cupy  # noqa: PLC0415 - optional
        xp, sync, device = cupy, cupy.cuda.Device().synchronize, "GPU (CuPy)"
    gguf = None
    if not args.no_gguf:
        import gguf  # noqa: PLC0415 - bench-only oracle, not used by app

    rng = np.random.default_rng(0)
    print(f"dequantize {args.rows}x{args.cols} on {device}, median of {args.repeat}")
    print(f"{'type':<6} {'MiB in':>7} {'ms':>8} {'min ms':>8} {'GB/s':>7}"
          + ("" if gguf is None else f" {'gguf ms':>9} {'speedup':>8}"))
    out = xp.empty((args.rows, args.cols), dtype=xp.float32)
    for t in Q.BLOCK_SIZES:
        host = random_weight(t, args.rows, args.cols, rng)
        raw = xp.asarray(host)
        times = times_ms(lambda: Q.dequantize(raw, t, out=out), args.repeat, sync)
        ms = statistics.median(times)
        gbs = (raw.nbytes + out.nbytes) / (ms * 1e-3) / 1e9
        line = f"{Q.TYPE_NAMES[t]:<6} {raw.nbytes / 2**20:7.2f} {ms:8.2f} {min(times):8.2f} {gbs:7.2f}"
        if gguf is not None:
            qt = gguf.GGMLQuantizationType(t)
            ref_ms = statistics.median(times_ms(lambda: gguf.quants.dequantize(host, qt), max(3, args.repeat // 4)))
            # gguf returns F32 as a view of the bytes (no copy), so there is no ratio to show.
            line += f" {ref_ms:9.2f} " + (f"{ref_ms / ms:7.1f}x" if ref_ms >= 0.05 else f"{'view':>8}")
        print(line)


if __name__ == "__main__":
    main()
