"""Frozen base weights: memory-mapped in their GGUF type, dequantized when used.

Quantized tensors are dequantized on demand into float32 and kept in a bounded LRU cache, so a
model larger than the budget still runs (it just dequantizes again). F32 tensors are copied out
of the mapping into the same cache, not used as views of it: a view would be read throughout a
step, and a page of a mapping whose file was truncated meanwhile kills the process (SIGBUS),
whereas a copy is read once, right after the file is checked (`GGUFFile.raw`:
ModelFileChanged). In quantized models they are the small tensors (norms, biases). Experts are cached one expert at a time, and embedding lookups dequantize
only the rows they read. An expert the cache cannot keep is dequantized into a buffer that each
engine thread reuses (`expert_tile`), so a step without the cache allocates no float32 expert.

On a GPU (`xp` = cupy) the quantized bytes are copied to the device and dequantized there, and
the cache (F32 tensors too) lives in device memory, budgeted against the GPU's memory.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from math import prod

import numpy as np

from app.engine.runtime import bf16
from app.engine.runtime.backend import device_memory
from app.engine.io.gguf import GGUFFile, dequantize


PACK_BLOCK = 1 << 22   # values dequantized and rounded at a time by WeightStore.packed (16 MB)


def default_cache_budget(xp=np) -> int:
    """40% of the device's memory (host RAM on the CPU): dequantized float32 copies are 2-8x
    larger than Q8/Q4 weights."""
    try:
        return int(device_memory(xp)[1] * 0.4)
    except (ValueError, OSError, AttributeError):
        return 4 << 30


class WeightStore:
    def __init__(self, gguf: GGUFFile, cache_budget: int | None = None, xp=np):
        self.gguf, self.xp = gguf, xp
        self.budget = default_cache_budget(xp) if cache_budget is None else cache_budget
        self._cache: OrderedDict = OrderedDict()
        self._cached_bytes = 0
        self.dequant_seconds = 0.0  # time spent dequantizing, for the benchmarks' phase split
        self._lock = threading.Lock()  # the engine's threads read experts concurrently
        self._tiles = threading.local()  # per thread: {(slot, shape): reused float32 buffer}

    def _dequantize(self, raw, ggml_type: int, out=None) -> np.ndarray:
        t0 = time.perf_counter()
        out = dequantize(raw if self.xp is np else self.xp.asarray(raw), ggml_type, out=out)
        with self._lock:
            self.dequant_seconds += time.perf_counter() - t0
        return out

    def __contains__(self, name: str) -> bool:
        return name in self.gguf.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.gguf.tensors[name].shape

    def _cached(self, key, make):
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        value = make()                      # outside the lock: threads dequantize side by side
        with self._lock:
            if value.nbytes <= self.budget and key not in self._cache:
                self._cache[key] = value
                self._cached_bytes += value.nbytes
                while self._cached_bytes > self.budget:
                    _, old = self._cache.popitem(last=False)
                    self._cached_bytes -= old.nbytes
        return value

    def get(self, name: str) -> np.ndarray:
        """The whole tensor as float32 (NumPy shape)."""
        info = self.gguf.tensors[name]
        if info.ggml_type == 0:   # a copy, not a view of the mapping (see the module docstring)
            return self._cached(name, lambda: self.xp.array(self.gguf.array(name)))
        return self._cached(name, lambda: self._dequantize(self.gguf.raw(name),
                                                           info.ggml_type).reshape(info.shape))

    def _packed_rows(self, name: str, backend: str) -> "bf16.Bf16Weight":
        """A 2-D tensor rounded to bf16 in blocks of rows of about PACK_BLOCK values, each
        dequantized (or copied) and rounded in turn, so that packing a large matrix (Gemma 3's
        262,144 x 640 head) never holds it whole in float32, nor the rounding's temporaries."""
        info = self.gguf.tensors[name]
        n_rows, n_cols = info.shape
        bits = np.empty((n_rows, n_cols), np.uint16)
        step = max(1, PACK_BLOCK // n_cols)
        for lo in range(0, n_rows, step):
            hi = min(lo + step, n_rows)
            if info.ggml_type == 0:   # read once, right away, by the rounding
                block = self.gguf.array(name)[lo:hi]
            else:
                block = self._dequantize(self.gguf.raw(name)[lo:hi], info.ggml_type)
            bits[lo:hi] = bf16.round_bits(block)
        return bf16.Bf16Weight(bits, backend)

    def packed(self, name: str, backend: str) -> "bf16.Bf16Weight":
        """A frozen 2-D weight in bf16 for the base's products (app.engine.runtime.bf16):
        what the cache holds under --precision bf16, half the float32 bytes. Its float32
        dequantization is not kept."""
        return self._cached((name, "bf16", backend), lambda: self._packed_rows(name, backend))

    def packed_expert(self, name: str, e: int, backend: str) -> "bf16.Bf16Weight":
        """Expert e of a 3-D (E, out, in) tensor in bf16 (out, in), cached one expert at a
        time as `expert` is."""
        info = self.gguf.tensors[name]

        def make():
            if info.ggml_type == 0:
                return bf16.pack(self.gguf.array(name)[e], backend)
            return bf16.pack(self._dequantize(self.gguf.raw(name)[e], info.ggml_type), backend)
        return self._cached((name, e, "bf16", backend), make)

    def rows(self, name: str, index: np.ndarray) -> np.ndarray:
        """Rows `index` of a 2-D tensor as float32: (len(index), n_cols)."""
        info = self.gguf.tensors[name]
        whole = self._cache.get(name)
        if whole is not None:
            return whole[self.xp.asarray(index)]
        raw = self.gguf.raw(name)[index]                              # (N, row_bytes)
        if info.ggml_type == 0:
            return self.xp.asarray(raw.view(np.float32))
        return self._dequantize(raw, info.ggml_type)

    def row_view(self, name: str):
        """The 2-D tensor for row-sliced reading: the float32 array when it fits the cache
        budget, else a view that dequantizes only the rows asked for (the output head of a
        large-vocabulary model is never materialised in full then)."""
        info = self.gguf.tensors[name]
        if info.ggml_type == 0 or info.n_elements * 4 <= self.budget:
            return self.get(name)
        return RowView(self, name)

    def experts(self, name: str) -> "ExpertView":
        return ExpertView(self, name)

    def expert(self, name: str, e: int) -> np.ndarray:
        """Expert e of a 3-D (E, out, in) tensor as float32 (out, in)."""
        info = self.gguf.tensors[name]
        if info.ggml_type == 0:
            return self.get(name)[e]
        whole = self._cache.get(name)
        if whole is not None:
            return whole[e]
        return self._cached((name, e), lambda: self._dequantize(self.gguf.raw(name)[e],
                                                                info.ggml_type))

    def expert_tile(self, name: str, e: int, slot: int) -> np.ndarray:
        """Expert e as `expert` gives it when it is (or may be) cached; otherwise dequantized
        into this thread's reused buffer number `slot` (out, in), which stays valid until the
        same thread asks for the same slot again. Callers use one slot per operand they hold."""
        info = self.gguf.tensors[name]
        shape = tuple(info.shape[1:])
        if info.ggml_type == 0 or name in self._cache or 4 * prod(shape) <= self.budget:
            return self.expert(name, e)
        with self._lock:
            hit = self._cache.get((name, e))
        if hit is not None:
            return hit
        tiles = self._tiles.__dict__.setdefault("buffers", {})
        buffer = tiles.get((slot, shape))
        if buffer is None:
            buffer = tiles[(slot, shape)] = self.xp.empty(shape, self.xp.float32)
        return self._dequantize(self.gguf.raw(name)[e], info.ggml_type, out=buffer)


class ExpertView:
    """Indexable by expert like an (E, out, in) array, dequantizing one expert at a time."""

    def __init__(self, store: WeightStore, name: str):
        self.store, self.name = store, name
        self.shape = store.shape(name)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e: int) -> np.ndarray:
        return self.store.expert(self.name, int(e))

    def tile(self, e: int, slot: int) -> np.ndarray:
        """Expert e, possibly in this thread's reused buffer `slot` (WeightStore.expert_tile)."""
        return self.store.expert_tile(self.name, int(e), slot)


class PackedExperts:
    """ExpertView's bf16 twin: experts as Bf16Weight (WeightStore.packed_expert); `tile` gives
    the same (a packed expert is half a float32 one, so the cache keeps it whenever
    budgeted)."""

    def __init__(self, store: WeightStore, name: str, backend: str):
        self.store, self.name, self.backend = store, name, backend
        self.shape = store.shape(name)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e: int):
        return self.store.packed_expert(self.name, int(e), self.backend)

    def tile(self, e: int, slot: int):
        return self[e]


class RowView:
    """Sliceable by rows like a (rows, cols) float32 array, dequantizing each slice on demand."""

    def __init__(self, store: WeightStore, name: str):
        self.store, self.name = store, name
        self.shape = store.shape(name)
        self.ggml_type = store.gguf.tensors[name].ggml_type

    def __getitem__(self, rows: slice) -> np.ndarray:
        return self.store._dequantize(self.store.gguf.raw(self.name)[rows], self.ggml_type)
