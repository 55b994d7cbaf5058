"""AdamW step throughput of app.engine.training.optimizers against a naive-expression AdamW.

Run from the repository root: ``python -m bench.optim [--params 10_000_000] [--tensors 4]
[--repeat 5] [--gpu]``. The parameters (float32, split into ``--tensors`` equal tensors) are
updated with fixed random gradients; each row is the median over ``--repeat`` timed steps after
one warm-up round, in M parameters/s (and the best of the repeats). The variants run
interleaved, one step of each per round, so background load affects them alike.

Rows: ``naive`` writes the formula as NumPy expressions (a new array per operation);
``in-place, whole arrays`` is optim.AdamW's NumPy update (WORKBENCH_KERNELS=numpy) with chunking
disabled (in-place ufuncs over whole tensors); ``in-place, chunks`` the NumPy update as it runs
(in-place ufuncs over cache-sized chunks); ``compiled`` the default, one Numba pass per chunk
(app.engine.kernels.compiled_adamw); then weight decay and both clippings on each path, and SGD.
The optim rows include the global-norm / NaN check that the naive version does not do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from app.engine.kernels import jit
from app.engine.training import optimizers as optim


def naive_adamw(params, grads, m, v, t, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, xp=np):
    """The update rule as plain expressions (the ~2x slower way ARCHITECTURE warns about)."""
    b1h, b2h = 1.0 / (1.0 - b1 ** t), 1.0 / (1.0 - b2 ** t)
    for k, g in grads.items():
        m[k] = b1 * m[k] + (1 - b1) * g
        v[k] = b2 * v[k] + (1 - b2) * g * g
        params[k] = params[k] * (1 - lr * wd) - lr * (m[k] * b1h) / (xp.sqrt(v[k] * b2h) + eps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--gpu", action="store_true", help="run on CuPy (needs a GPU)")
    args = ap.parse_args()

    xp, sync, device = np, (lambda: None), "CPU (NumPy)"
    if args.gpu:
        import cupy  # noqa: PLC0415 - optional
        xp, sync, device = cupy, cupy.cuda.Device().synchronize, "GPU (CuPy)"

    rng = np.random.default_rng(0)
    size = args.params // args.tensors
    n = size * args.tensors

    def fresh():
        return {f"w{i}": xp.asarray(rng.standard_normal(size, dtype=np.float32))
                for i in range(args.tensors)}

    grads = {k: g * 1e-2 for k, g in fresh().items()}

    def naive_variant():
        params = fresh()
        m = {k: xp.zeros_like(p) for k, p in params.items()}
        v = {k: xp.zeros_like(p) for k, p in params.items()}
        step = [0]

        def run():
            step[0] += 1
            naive_adamw(params, grads, m, v, step[0], xp=xp)
        return run

    def optim_variant(make, chunk_bytes=None, kernels="numpy"):
        opt = make(fresh())

        def run():
            saved = optim._CHUNK_BYTES, os.environ.get(jit.ENV_VAR)
            if chunk_bytes is not None:
                optim._CHUNK_BYTES = chunk_bytes
            os.environ[jit.ENV_VAR] = kernels
            try:
                opt.step(grads)
            finally:
                optim._CHUNK_BYTES = saved[0]
                os.environ.pop(jit.ENV_VAR)
                if saved[1] is not None:
                    os.environ[jit.ENV_VAR] = saved[1]
        return run

    clipped = lambda p: optim.AdamW(p, weight_decay=0.01, gclip=0.02, max_grad_norm=1.0)

    variants = [
        ("naive expressions", naive_variant()),
        ("AdamW in-place, whole arrays", optim_variant(optim.AdamW, chunk_bytes=2**62)),
        (f"AdamW in-place, {optim._CHUNK_BYTES // 1024} KiB chunks", optim_variant(optim.AdamW)),
        ("  + weight_decay, gclip, max_grad_norm", optim_variant(clipped)),
        ("AdamW compiled, one pass", optim_variant(optim.AdamW, kernels="compiled")),
        ("  + the same clippings, compiled", optim_variant(clipped, kernels="compiled")),
        ("SGD (+ weight_decay)", optim_variant(lambda p: optim.SGD(p, lr=1e-3, weight_decay=0.01))),
    ]
    # Interleave the variants (one timed step of each per round) so that load from other
    # processes hits them all alike; the first round is a warm-up (allocations, page faults).
    times: dict[str, list[float]] = {label: [] for label, _ in variants}
    for round_ in range(args.repeat + 1):
        for label, fn in variants:
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if round_:
                times[label].append(time.perf_counter() - t0)

    print(f"optimizer step on {n / 1e6:g} M float32 params in {args.tensors} tensors, {device}, "
          f"median (and best) of {args.repeat}, variants interleaved")
    base = statistics.median(times[variants[0][0]])
    print(f"{'variant':<40} {'ms/step':>8} {'M params/s':>11} {'best':>7} {'vs naive':>9}")
    for label, ts in times.items():
        sec = statistics.median(ts)
        print(f"{label:<40} {sec * 1e3:8.1f} {n / sec / 1e6:11.1f} {n / min(ts) / 1e6:7.1f} "
              f"{base / sec:8.2f}x")

if __name__ == "__main__":
    main()
