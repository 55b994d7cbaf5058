"""``python -m bench bf16-gemm [--reps-gflop N] [--mkl PATH]``: the candidates for the bf16
products of issue 30, measured side by side (docs/PERFORMANCE.md, "bf16 products").

For each bench shape (M x K x N: (256|1024) x 512 x 1536, 2048^3, the Gemma 3 head's
512 x 640 x 32768) it prints GFLOP/s of
- fp32: NumPy's OpenBLAS float32, as the engine runs it (one BLAS thread per engine thread,
  row blocks on the engine's threads: app.engine.runtime.parallel);
- onednn: oneDNN's matmul through its C API (app.engine.runtime.onednn, the `onednn-cpu-gomp`
  wheel: bf16 inputs, float32 output) the same way, as the engine runs it (one thread inside
  each engine piece), where installed;
- torch: PyTorch's bf16 matmul (its own oneDNN; bf16 output: no CPU op of PyTorch 2.13 writes
  float32 from bf16 inputs) on its own OpenMP threads, one call, where torch is installed (the
  candidate of the first implementation);
- mkl: MKL's cblas_gemm_bf16bf16f32 through ctypes (libmkl_rt from `pip install mkl`, found in
  sys.prefix/lib or at --mkl), on its own threads with OpenBLAS held at one, where installed;
- emul: the NumPy emulation (what a CPU without the unit runs under --precision bf16).
Then each library's install size and import time, and the bf16 unit this CPU has. Medians of
--rounds rounds, taking turns, each round about --reps-gflop GFLOP of work per candidate.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from app.engine.runtime import bf16, onednn
from app.engine.runtime.parallel import parallel_map, product_row_blocks, thread_count

SHAPES = [(256, 512, 1536), (1024, 512, 1536), (2048, 2048, 2048), (512, 640, 32768)]


def engine_rows(fn, m: int, k: int, n: int) -> None:
    """fn(rows) over the engine's row blocks of an (m, k) @ (k, n) product, as a linear layer
    runs (app.engine.kernels.linear)."""
    parallel_map(fn, product_row_blocks(m, k, n), np)


def find_mkl(path: str | None):
    candidates = [path] if path else sorted(glob.glob(os.path.join(sys.prefix, "lib",
                                                                   "libmkl_rt.so*")))
    for candidate in candidates:
        try:
            lib = ctypes.CDLL(candidate)
        except OSError:
            continue
        lib.cblas_gemm_bf16bf16f32.argtypes = ([ctypes.c_int] * 6 + [ctypes.c_float]
                                               + [ctypes.c_void_p, ctypes.c_int] * 2
                                               + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int])
        lib.MKL_Set_Num_Threads.argtypes = [ctypes.c_int]
        lib.MKL_Set_Num_Threads(thread_count())
        return lib, candidate
    return None, None


def candidates(m: int, k: int, n: int, mkl):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)                    # (out, in)
    out = np.empty((m, n), np.float32)
    runs = {"fp32": lambda: engine_rows(lambda r: np.matmul(x[r], w.T, out=out[r]), m, k, n)}
    if bf16.library_available():
        packed = bf16.pack(w, "onednn")
        runs["onednn"] = lambda: engine_rows(
            lambda r: bf16.matmul(x[r], packed, True, out=out[r]), m, k, n)
    if importlib.util.find_spec("torch") is not None:
        import torch
        torch.set_num_threads(thread_count())
        w_bf16 = torch.from_numpy(w).to(torch.bfloat16)
        runs["torch"] = lambda: torch.mm(torch.from_numpy(x).to(torch.bfloat16), w_bf16.t())
    if mkl is not None:
        xb, wb = bf16.round_bits(x), bf16.round_bits(w)
        runs["mkl"] = lambda: mkl.cblas_gemm_bf16bf16f32(
            101, 111, 112, m, n, k, 1.0, xb.ctypes.data, k, wb.ctypes.data, k, 0.0,
            out.ctypes.data, n)
    if m * n * k <= 1024 * 512 * 1536:
        emul = bf16.pack(w)
        runs["emul"] = lambda: engine_rows(
            lambda r: bf16.matmul(x[r], emul, True, out=out[r]), m, k, n)
    return runs


def gflops(fn, flop: float, budget: float) -> float:
    fn()
    reps = max(2, int(budget * 1e9 / flop))
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return flop * reps / (time.perf_counter() - t0) / 1e9


def import_seconds(statement: str) -> float | None:
    """Seconds `statement` (an import, a load) takes in a fresh interpreter."""
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return float(done.stdout) if done.returncode == 0 else None


def tree_mb(paths) -> float:
    total = 0
    for path in paths:
        for root, _, files in os.walk(path):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files
                         if not os.path.islink(os.path.join(root, f)))
    return total / 2**20


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench bf16-gemm")
    parser.add_argument("--reps-gflop", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mkl", help="path of libmkl_rt.so (default: sys.prefix/lib)")
    args = parser.parse_args(argv)
    from threadpoolctl import threadpool_limits
    threadpool_limits(1, user_api="blas")          # as the engine runs (parallel.py)
    mkl, mkl_path = find_mkl(args.mkl)
    device = bf16.detect()
    print(f"CPU bf16 unit: {device.unit or 'none'}; engine threads: {thread_count()}; "
          f"precision auto -> {bf16.choose('auto', device).reason}")
    names = ["fp32", "onednn", "torch", "mkl", "emul"]
    print(f"{'shape (MxKxN)':>18} " + " ".join(f"{n:>10}" for n in names)
          + "   GFLOP/s, medians of rounds; x = ratio to fp32")
    for m, k, n in SHAPES:
        runs = candidates(m, k, n, mkl)
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                rates[name].append(gflops(fn, 2.0 * m * k * n, args.reps_gflop))
        med = {name: statistics.median(r) for name, r in rates.items()}
        cells = [f"{med[name]:>10.0f}" if name in med else f"{'-':>10}" for name in names]
        ratios = " ".join(f"{name} {med[name] / med['fp32']:.2f}x" for name in med
                          if name != "fp32")
        print(f"{f'{m}x{k}x{n}':>18} " + " ".join(cells) + f"   {ratios}")
    print()
    path = onednn.library_path()
    if path is None:
        print(f"{onednn.DISTRIBUTION}: not installed (pip install -e '.[bf16]')")
    else:
        size = sum(os.path.getsize(p) for p in glob.glob(str(Path(path).parent / "libdnnl.so*"))
                   if not os.path.islink(p)) / 2**20
        load = import_seconds("from app.engine.runtime import onednn; onednn.load()")
        print(f"{onednn.DISTRIBUTION} ({path}): {size:.0f} MB installed (the wheel writes "
              f"libdnnl.so three times), load {load:.2f} s")
    for module, label in (("numpy", "numpy (OpenBLAS)"), ("torch", "torch (oneDNN)")):
        spec = importlib.util.find_spec(module)
        if spec is None:
            print(f"{label}: not installed")
            continue
        size = tree_mb(spec.submodule_search_locations or [])
        seconds = import_seconds(f"import {module}")
        print(f"{label}: {size:.0f} MB installed, import {seconds:.2f} s")
    if mkl_path:
        libdir = Path(mkl_path).parent
        size = sum(os.path.getsize(p) for p in glob.glob(str(libdir / "lib*"))
                                 if not os.path.islink(p)) / 2**20
        print(f"mkl ({mkl_path}): {size:.0f} MB of libraries in {libdir} (with its OpenMP, TBB)")
    else:
        print("mkl: not found (pip install mkl, or --mkl PATH/libmkl_rt.so.3)")
