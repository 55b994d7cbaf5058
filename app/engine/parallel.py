"""The engine's CPU threads: independent pieces of one kernel run side by side.

Large dense GEMMs (the linear layers, the loss head) are left to BLAS's own threads, which split
one GEMM well. Many small independent pieces are not: the experts of an MoE layer (about 64 rows
each), the kv-head groups of attention (small batched GEMMs and a softmax that NumPy runs on one
core), the chunks of the optimizer update. `parallel_map` runs such pieces on a small thread pool
with BLAS held to one thread inside, so each core runs whole pieces, and hands them out one at a
time as threads free up. NumPy releases the GIL in matmul and in ufunc loops, so the threads do
run at once.

An OpenBLAS thread busy-waits for a while after each GEMM and then fights the pool's threads for
the core (measured: 8 expert GEMMs after a dense GEMM took 5.5 ms instead of 3.0 ms). `app`
therefore sets OPENBLAS_THREAD_TIMEOUT=4 (sleep almost at once) before NumPy is loaded; it
changes nothing else (dense GEMMs: 4.1 vs 4.2 ms). Measurements: docs/PERFORMANCE.md.

`WORKBENCH_THREADS` sets the thread count (default: the CPUs this process may run on). CuPy
arrays never take this path: the GPU is fed serially.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

import numpy as np

T = TypeVar("T")
R = TypeVar("R")

_pool: ThreadPoolExecutor | None = None
_blas = None                                 # threadpoolctl controller, made with the pool
_setup = threading.Lock()
_limit = {"users": 0, "handle": None}        # BLAS held to one thread while any map runs
_inside = threading.local()                  # set in pool threads: nested maps run serially


def thread_count() -> int:
    """Engine threads: WORKBENCH_THREADS, else the CPUs this process may use."""
    env = os.environ.get("WORKBENCH_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _engine_pool() -> ThreadPoolExecutor:
    global _pool, _blas
    with _setup:
        if _pool is None:
            from threadpoolctl import ThreadpoolController
            _blas = ThreadpoolController()
            _pool = ThreadPoolExecutor(thread_count(), thread_name_prefix="workbench-engine",
                                       initializer=lambda: setattr(_inside, "active", True))
    return _pool


def parallel_map(fn: Callable[[T], R], items: Iterable[T], xp=np) -> list[R]:
    """[fn(item) for item in items], on the engine's threads when that can help.

    Items are handed out one at a time as threads free up, so put the largest first. `fn` must
    only write to places no other item writes to. Serial for CuPy (`xp`), for one thread, for
    a single item, and inside another parallel_map.
    """
    items = list(items)
    if (xp is not np or len(items) < 2 or thread_count() < 2
            or getattr(_inside, "active", False)):
        return [fn(item) for item in items]
    pool = _engine_pool()
    with _setup:
        if _limit["users"] == 0:
            _limit["handle"] = _blas.limit(limits=1, user_api="blas")
        _limit["users"] += 1
    try:
        return list(pool.map(fn, items))
    finally:
        with _setup:
            _limit["users"] -= 1
            if _limit["users"] == 0:
                _limit["handle"].restore_original_limits()

