"""The compiled kernels (issue 22) against their NumPy twins, and what compiling costs.

    python -m bench.kernels [--ctx 256] [--rounds 7]     per-kernel time, twin vs compiled
    python -m bench.kernels --compile-cost                first step with an empty Numba cache,
                                                          then warm, then the twins

Per-kernel rows: bench-dense's shapes (C 512, 8 heads / 4 kv heads of 64, FFN 1536) at --ctx
tokens, GeGLU at Gemma 3 270M's (512 tokens, FFN 2048), and AdamW over bench-dense's 12.85 M parameters (full fine-tuning). Each figure is the
median over --rounds rounds of the CPU time of one call on one engine thread (thread_time, so
another process on a shared machine slows it less than wall time would); the twin and the
compiled kernel take turns within each round.

--compile-cost runs `python -m bench train` (bench-dense full and bench-moe LoRA, ctx 256) in
fresh processes: with NUMBA_CACHE_DIR pointing at an empty folder (the first run after an
install: every kernel compiles), again with that folder (a warm start: kernels load from the
disk cache), and with WORKBENCH_KERNELS=numpy. It reports each one's process wall time and its
first (warm-up) step; the difference is the compile cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def kernel_cases(ctx: int) -> dict:
    from app.engine.kernels.activations import (geglu_backward, geglu_forward, swiglu_backward,
                                                swiglu_forward)
    from app.engine.kernels.attention import attention_backward, attention_forward, attention_mask
    from app.engine.kernels.norm import rmsnorm_backward, rmsnorm_forward
    from app.engine.kernels.rope import NORM, rope_angles, rope_backward, rope_forward
    from app.engine.training.optimizers import AdamW

    rng, f = np.random.default_rng(0), np.float32
    x, w = rng.standard_normal((ctx, 512)).astype(f), rng.standard_normal(512).astype(f)
    q = rng.standard_normal((ctx, 8, 64)).astype(f)
    k, v = (rng.standard_normal((ctx, 4, 64)).astype(f) for _ in range(2))
    cos, sin = rope_angles(np, np.arange(ctx), 64, 10000.0, 1.0, f)
    g, u = (rng.standard_normal((ctx, 1536)).astype(f) for _ in range(2))
    mask = attention_mask(np, np.arange(ctx), np.arange(ctx))
    _, norm_cache = rmsnorm_forward(x, w, 1e-5)
    _, rope_cache = rope_forward(q, cos, sin, 64, NORM)
    _, glu_cache = swiglu_forward(g, u)
    gg, gu = (rng.standard_normal((512, 2048)).astype(f) for _ in range(2))
    _, geglu_cache = geglu_forward(gg, gu, exact=True)
    attn_out, attn_cache = attention_forward(q, k, v, 0.125, mask)
    layer = [512 * 512, 256 * 512, 256 * 512, 512 * 512, 1536 * 512, 1536 * 512, 512 * 1536,
             512, 512]                                    # bench-dense: q k v o, FFN, norms
    sizes = [259 * 512, 259 * 512, 512] + layer * 4
    params = {f"p{i}": rng.standard_normal(n).astype(f) for i, n in enumerate(sizes)}
    grads = {name: p * f(1e-2) for name, p in params.items()}
    opt = AdamW(params, lr=1e-4, max_grad_norm=1.0)
    return {
        "rmsnorm forward (T, 512)": lambda: rmsnorm_forward(x, w, 1e-5),
        "rmsnorm backward": lambda: rmsnorm_backward(x, norm_cache),
        "rope forward q (T, 8, 64)": lambda: rope_forward(q, cos, sin, 64, NORM),
        "rope backward q": lambda: rope_backward(q, rope_cache),
        "swiglu forward (T, 1536)": lambda: swiglu_forward(g, u),
        "swiglu backward": lambda: swiglu_backward(g, glu_cache),
        "geglu forward (512, 2048: Gemma 3)": lambda: geglu_forward(gg, gu, exact=True),
        "geglu backward": lambda: geglu_backward(gg, geglu_cache),
        "attention forward (one layer)": lambda: attention_forward(q, k, v, 0.125, mask),
        "attention backward": lambda: attention_backward(attn_out, attn_cache),
        f"AdamW step, {sum(sizes) / 1e6:.2f} M params": lambda: opt.step(grads),
    }


def per_kernel(ctx: int, rounds: int) -> dict:
    from app.engine.kernels import jit

    os.environ["WORKBENCH_THREADS"] = "1"
    cases = kernel_cases(ctx)
    times = {name: {"numpy": [], "compiled": []} for name in cases}
    for _ in range(rounds):
        for impl in ("numpy", "compiled"):
            if impl == "numpy":
                os.environ[jit.ENV_VAR] = "numpy"
            else:
                os.environ.pop(jit.ENV_VAR, None)
            for name, fn in cases.items():
                fn()                                          # warm: compiled, caches filled
                calls = 2 if name.startswith("AdamW") else 10
                t0 = time.thread_time()
                for _ in range(calls):
                    fn()
                times[name][impl].append((time.thread_time() - t0) / calls * 1e3)
    print(f"ctx {ctx}, one engine thread, CPU ms per call, median of {rounds} alternating rounds")
    print(f"{'kernel':<34} {'NumPy twin':>10} {'compiled':>9} {'speed-up':>9}")
    medians = {}
    for name, t in times.items():
        a, b = statistics.median(t["numpy"]), statistics.median(t["compiled"])
        medians[name] = {"numpy_ms": a, "compiled_ms": b}
        print(f"{name:<34} {a:10.3f} {b:9.3f} {a / b:8.2f}x")
    return medians


def train_once(model: str, mode: str, targets: str, env: dict) -> dict:
    """One `python -m bench train` process: its wall time and first step (ms)."""
    cmd = [sys.executable, "-m", "bench", "train", "--model", model, "--mode", mode,
           "--targets", targets, "--ctx", "256", "--steps", "2", "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, check=True)
    wall = time.perf_counter() - t0
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"process_s": wall, "first_step_ms": row["warmup_ms"][0], "step_ms": row["step_ms"]}


def compile_cost() -> dict:
    out = {}
    for model, mode, targets in (("bench-dense", "full", ""),
                                 ("bench-moe", "lora", "attention,experts")):
        with tempfile.TemporaryDirectory() as cache:
            runs = {"cold (empty cache)": train_once(model, mode, targets, {"NUMBA_CACHE_DIR": cache}),
                    "warm (disk cache)": train_once(model, mode, targets, {"NUMBA_CACHE_DIR": cache}),
                    "NumPy twins": train_once(model, mode, targets, {"WORKBENCH_KERNELS": "numpy"})}
        out[f"{model} {mode}"] = runs
        for label, r in runs.items():
            print(f"{model} {mode:<5} {label:<19} process {r['process_s']:5.1f} s, first step "
                  f"{r['first_step_ms']:7.0f} ms, median step {r['step_ms']:6.0f} ms")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compile-cost", action="store_true")
    args = parser.parse_args(argv)
    if args.compile_cost:
        compile_cost()
    else:
        per_kernel(args.ctx, args.rounds)


if __name__ == "__main__":
    main()
