"""The engine's CPU threads: it splits its own work across the cores; BLAS runs single-threaded.

The first time the engine computes (in parallel or not: `WORKBENCH_THREADS=1` means one thread
in all) it sets BLAS to one thread for the rest of the process (and has the C allocator keep
freed arrays for reuse: app.engine.runtime.allocator), and from then on it decides what runs
side by side:
* `matmul` splits one large GEMM into one block of output columns per thread (the loss head;
  a linear layer's weight gradients come in the same blocks, `product_column_blocks`); a linear
  layer splits its rows (`product_row_blocks`), so that its LoRA branch runs in the same
  pieces;
* `parallel_map` runs independent pieces: the experts of an MoE layer, the kv-head groups of
  attention, the chunks of the optimizer update, and blocks of rows (`row_blocks`) of
  element-wise work (RMSNorm, the gated activations, the loss head's softmax).
Pieces are taken one at a time from a shared counter by the pool's threads and by the calling
thread itself, so a thread that the OS has taken off its core for another process delays only
the piece it holds: the others go on with the rest. NumPy releases the GIL in matmul and in ufunc
loops, so the threads do run at once.

Why not BLAS's own threads: OpenBLAS splits each GEMM statically between its threads, so when
another process takes one of the cores every GEMM waits for the thread that lost it. Measured on
the 2-core development machine, bench-dense LoRA r=16 step at context 256 with one busy-loop
process beside it: OpenBLAS on 2 threads 1035 ms, one thread 196 ms. Quiet, the engine's threads
lose a little to OpenBLAS on large dense GEMMs and win on everything else (docs/PERFORMANCE.md).

`WORKBENCH_THREADS` sets the thread count (default: the CPUs this process may run on). CuPy
arrays never take these paths: the GPU is fed serially.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

import numpy as np

from app.engine.runtime.allocator import keep_freed_memory
from app.engine.runtime.backend import get_array_module

T = TypeVar("T")
R = TypeVar("R")

# A GEMM of fewer multiply-adds than this is not split (about 0.1 ms on one core), nor into
# blocks narrower than MIN_BLOCK_COLUMNS: one block per thread. Measured on the dev machine,
# (256 x 512) @ (512 x N) on 2 threads: N = 1536 246 GFLOP/s, N = 512 190, N = 256 in two
# 128-column blocks 125, against 147 on one thread; four blocks per GEMM instead of two lost
# 10-35% on every shape.
MIN_SPLIT_WORK = 1 << 23
MIN_BLOCK_COLUMNS = 256

# Element-wise pieces hold at least this many values: about 50 us of a compiled kernel's work
# (RMSNorm: 54 us for 256 x 512 values on one thread). Each parallel section costs the engine's
# other thread a wake-up of about 50 us on the development VM (medians, bench-dense at context
# 256), so smaller work finishes sooner on the calling thread alone.
MIN_PIECE_VALUES = 1 << 17

_pool: ThreadPoolExecutor | None = None
_process_set_up = False
_setup = threading.Lock()
_inside = threading.local()  # set while a thread runs pieces: nested calls run serially


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
    """The pool (the caller is one of the threads, so it has thread_count() - 1 workers), made on
    first use."""
    global _pool
    with _setup:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(thread_count() - 1, 1),
                                       thread_name_prefix="workbench-engine")
    return _pool


def _set_up_process() -> None:
    """The first time the engine computes on NumPy: BLAS on one thread, for good (with one
    engine thread too, the serial path makes the same BLAS calls as each piece of the parallel
    one, and WORKBENCH_THREADS=1 uses one core), and the C allocator keeping freed arrays for
    the next step (app.engine.runtime.allocator)."""
    global _process_set_up
    if not _process_set_up:
        with _setup:
            if not _process_set_up:
                from threadpoolctl import threadpool_limits
                threadpool_limits(limits=1, user_api="blas")
                keep_freed_memory()
                _process_set_up = True


def _serial(xp, n_items: int) -> bool:
    return (xp is not np or n_items < 2 or thread_count() < 2
            or getattr(_inside, "active", False))


def parallel_map(fn: Callable[[T], R], items: Iterable[T], xp=np) -> list[R]:
    """[fn(item) for item in items], on the engine's threads when that can help.

    Put the largest items first. `fn` must only write to places no other item writes to.
    Serial for CuPy (`xp`), for one thread, for a single item, and inside another call.
    """
    items = list(items)
    if xp is np:
        _set_up_process()
    if _serial(xp, len(items)):
        return [fn(item) for item in items]
    pool = _engine_pool()
    results: list = [None] * len(items)
    taken = itertools.count()          # next() is atomic under the GIL
    failures: list[BaseException] = []

    def take_pieces() -> None:
        _inside.active = True
        try:
            for i in iter(taken.__next__, None):
                if i >= len(items) or failures:
                    return
                try:
                    results[i] = fn(items[i])
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                    failures.append(exc)
                    return
        finally:
            _inside.active = False

    helpers = [pool.submit(take_pieces) for _ in range(min(thread_count(), len(items)) - 1)]
    take_pieces()
    for helper in helpers:
        helper.result()
    if failures:
        raise failures[0]
    return results


def matmul(a, b, out=None):
    """a (M, K) @ b (K, N) -> (M, N) (into `out` if given), blocks of output columns on the
    engine's threads.

    Each block reads its own columns of b (the weight, usually the larger operand) and writes
    its own columns of the result. Small products, CuPy and nested calls: one plain matmul.
    """
    xp = get_array_module(a, b)
    if xp is np:
        _set_up_process()
    parts = product_column_blocks(a.shape[0], a.shape[1], b.shape[1], xp)
    if len(parts) == 1:
        return xp.matmul(a, b, out=out)
    if out is None:
        out = np.empty((a.shape[0], b.shape[1]), np.result_type(a.dtype, b.dtype))
    parallel_map(lambda cols: np.matmul(a, b[:, cols], out=out[:, cols]), parts)
    return out


def product_column_blocks(m: int, k: int, n: int, xp=np) -> list[slice]:
    """The output columns of an (M, K) @ (K, N) product in matmul's blocks: one per thread, at
    least MIN_BLOCK_COLUMNS wide and whole SIMD widths; all columns in one block for products
    under MIN_SPLIT_WORK, on CuPy, on one thread and inside a piece."""
    blocks = min(thread_count(), n // MIN_BLOCK_COLUMNS)
    if m * k * n < MIN_SPLIT_WORK or _serial(xp, blocks):
        return [slice(0, n)]
    return _blocks_of_16(n, blocks)


def product_row_blocks(m: int, k: int, n: int, xp=np) -> list[slice]:
    """Row ranges of an (M, K) @ (K, N) product split across the engine's threads, one per
    thread, for work that follows the rows (a linear layer with its LoRA branch): all rows in
    one block for products under MIN_SPLIT_WORK, on CuPy, on one thread and inside a piece.
    Blocks hold whole multiples of 16 rows. On the AMD development VM (2 threads, one BLAS
    thread each), 256 x 512 @ 512 x N in two row blocks ran at 138-159 GFLOP/s against 138-169
    for two column blocks and 89-94 for one GEMM; at 1024 rows the row blocks were ahead."""
    blocks = min(thread_count(), m // 16)
    if m * k * n < MIN_SPLIT_WORK or _serial(xp, blocks):
        return [slice(0, m)]
    return _blocks_of_16(m, blocks)


def _blocks_of_16(n: int, blocks: int) -> list[slice]:
    """0..n in `blocks` ranges or fewer, each a whole multiple of 16 (SIMD widths) but the
    last."""
    step = -(-n // blocks)
    step += -step % 16
    return [slice(lo, min(lo + step, n)) for lo in range(0, n, step)]


def array_row_blocks(a) -> list[slice]:
    """row_blocks of an array's first axis, with its values per row (element-wise work)."""
    return row_blocks(len(a), row_values=a.size // max(len(a), 1))


def row_blocks(n_rows: int, min_rows: int = 16, row_values: int = 0) -> list[slice]:
    """Row ranges for element-wise work split across the engine's threads (two per thread, so
    a thread that loses its core holds back little), none shorter than min_rows; with
    row_values (values per row) given, none holding fewer than MIN_PIECE_VALUES values."""
    parts = max(1, min(2 * thread_count(), n_rows // max(min_rows, 1)))
    if row_values:
        parts = max(1, min(parts, n_rows * row_values // MIN_PIECE_VALUES))
    step = max(1, -(-n_rows // parts))
    return [slice(lo, min(lo + step, n_rows)) for lo in range(0, n_rows, step)]
