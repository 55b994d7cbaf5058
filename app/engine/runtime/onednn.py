"""oneDNN's matmul and reorder through its C API (ctypes): bf16 inputs, float32 accumulation,
float32 output. The one place the engine talks to the library of its bf16 products
(app.engine.runtime.bf16 decides when; docs/PERFORMANCE.md, "bf16 products", says why this one).

The library is libdnnl.so.3 of the `onednn-cpu-gomp` wheel (oneDNN 3.2 built with GNU OpenMP:
`pip install -e '.[bf16]'`). It picks its kernels by the CPU (AMX-BF16 tiles, AVX512-BF16's
dot products), and asks the kernel for AMX's tile state itself.

- `load()` opens it once (OSError, with the loader's message, where it is missing or broken);
  `check()` runs one tiny product and compares it (OneDNNError where it cannot run here).
- `to_bf16(x)` rounds a float32 array to bf16 bits (uint16) with the library's reorder, to
  nearest even (tests check it is app.engine.runtime.bf16.round_bits bit for bit).
- `matmul(x, w_bits, transpose, out)`: x (M, K) float32; w_bits (N, K) bf16 bits (transpose:
  x @ w^T) or (K, N) (x @ w); out (M, N) float32; each read or written through its own strides
  (non-negative; others are copied first). x is rounded to bf16 first (a reorder), the product
  is accumulated in float32 and written in float32: each output is within 2u sum |x||w|
  (u = 2^-8) of the float32 inputs' exact product, plus the float32 summation term.

Threads: the engine splits the products into row blocks on its own threads
(app.engine.runtime.parallel) and calls the library inside each piece; each calling thread sets
its OpenMP team to one thread (omp_set_num_threads(1), once per thread), so the library runs on
the thread that called it, as BLAS does, and ctypes lets go of the GIL during the call. A stream
per thread; the scratchpad is ours (user mode), one growing buffer per thread. Primitives are
made once per shape (about 0.3 ms) and kept, under a lock, for the process's life; an MoE
layer's experts meet a new number of rows at almost every step, and each matmul primitive holds
about 127 KB here (a reorder's 15 KB), so a product's rows are padded with zeros to a multiple
of PAD_ROWS (a few shapes per weight in a whole run) and the padded rows' results dropped.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import threading

import numpy as np

DISTRIBUTION = "onednn-cpu-gomp"
SONAME = "libdnnl.so.3"

# dnnl_types.h / dnnl_common_types.h (oneDNN 3.2)
_CPU = 1                                  # dnnl_cpu
_BF16, _F32 = 2, 3                        # dnnl_bf16, dnnl_f32
_IN_ORDER = 1                             # dnnl_stream_in_order
_SCRATCHPAD_USER = 1                      # dnnl_scratchpad_mode_user
_QUERY_EXEC_ARG_MD = 255                  # dnnl_query_exec_arg_md
ARG_SRC, ARG_DST, ARG_WEIGHTS, ARG_SCRATCHPAD = 1, 17, 33, 80
_MAX_NDIMS = 12

PAD_ROWS = 32                             # see the module docstring

_P = ctypes.c_void_p
_Dims = ctypes.c_int64 * _MAX_NDIMS


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _P)]


class OneDNNError(RuntimeError):
    """A oneDNN call returned an error status."""


def library_path() -> str | None:
    """Where the wheel put libdnnl.so.3 (its data files: <prefix>/lib), or None when it is
    not installed. Found from the wheel's file list, without loading anything."""
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == SONAME:
            path = str(f.locate())
            return path if os.path.exists(path) else None
    return None


class _Library:
    """The opened library: its engine, its primitives by shape, and each thread's stream and
    scratchpad."""

    def __init__(self, path: str):
        self.lib = lib = ctypes.CDLL(path)
        # libdnnl.so.3 links libgomp.so.1: this opens the same one (by its soname)
        self.gomp = ctypes.CDLL("libgomp.so.1")
        lib.dnnl_primitive_desc_query_md.restype = _P
        lib.dnnl_primitive_desc_query_md.argtypes = [_P, ctypes.c_int, ctypes.c_int]
        lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        lib.dnnl_memory_desc_get_size.argtypes = [_P]
        self.engine = _P()
        self.expect_ok(lib.dnnl_engine_create(ctypes.byref(self.engine), _CPU,
                                              ctypes.c_size_t(0)), "engine_create")
        self.attr = _P()
        self.expect_ok(lib.dnnl_primitive_attr_create(ctypes.byref(self.attr)), "attr_create")
        self.expect_ok(lib.dnnl_primitive_attr_set_scratchpad_mode(self.attr, _SCRATCHPAD_USER),
                   "set_scratchpad_mode")
        self.primitives: dict[tuple, _Primitive] = {}
        self.lock = threading.Lock()
        self.local = threading.local()

    @staticmethod
    def expect_ok(status: int, what: str) -> None:
        if status != 0:
            raise OneDNNError(f"oneDNN {what} failed (dnnl_status_t {status})")

    # --- descriptors and primitives (made once per shape) ------------------------------------

    def desc(self, dims: tuple[int, ...], data_type: int, strides: tuple[int, ...]) -> _P:
        md = _P()
        self.expect_ok(self.lib.dnnl_memory_desc_create_with_strides(
            ctypes.byref(md), len(dims), _Dims(*dims), data_type, _Dims(*strides)), "memory_desc")
        return md

    def primitive(self, key: tuple, build) -> "_Primitive":
        """The primitive of `key`, made once: build() -> (the descriptors by ARG_*, a function
        that fills a primitive descriptor pointer from them)."""
        found = self.primitives.get(key)
        if found is None:
            with self.lock:
                found = self.primitives.get(key)
                if found is None:
                    descs, make = build()
                    pd = _P()
                    self.expect_ok(make(ctypes.byref(pd)), f"primitive_desc {key}")
                    prim = _P()
                    self.expect_ok(self.lib.dnnl_primitive_create(ctypes.byref(prim), pd),
                               f"primitive_create {key}")
                    scratch = self.lib.dnnl_primitive_desc_query_md(pd, _QUERY_EXEC_ARG_MD,
                                                                   ARG_SCRATCHPAD)
                    found = _Primitive(prim, descs, _P(scratch) if scratch else None,
                                       self.lib.dnnl_memory_desc_get_size(_P(scratch))
                                       if scratch else 0)
                    self.primitives[key] = found
        return found

    # --- execution ------------------------------------------------------------------------------

    def stream(self) -> _P:
        stream = getattr(self.local, "stream", None)
        if stream is None:
            self.gomp.omp_set_num_threads(1)          # this thread's team: itself (see above)
            stream = _P()
            self.expect_ok(self.lib.dnnl_stream_create(ctypes.byref(stream), self.engine,
                                                   ctypes.c_uint(_IN_ORDER)), "stream_create")
            self.local.stream = stream
            self.local.scratch = np.empty(0, np.uint8)
        return stream

    def execute(self, primitive: "_Primitive", addresses: dict[int, int]) -> None:
        """Run a primitive on this thread on the arrays at `addresses` (by ARG_*)."""
        stream = self.stream()
        args = [(arg, primitive.descs[arg], address) for arg, address in addresses.items()]
        if primitive.scratch is not None:
            if self.local.scratch.nbytes < primitive.scratch_bytes:
                self.local.scratch = np.empty(primitive.scratch_bytes, np.uint8)
            args.append((ARG_SCRATCHPAD, primitive.scratch, self.local.scratch.ctypes.data))
        memories = []
        try:
            for _, md, address in args:
                mem = _P()
                self.expect_ok(self.lib.dnnl_memory_create(ctypes.byref(mem), md, self.engine,
                                                       _P(address)), "memory_create")
                memories.append(mem)
            exec_args = (_ExecArg * len(args))(*[_ExecArg(arg, mem) for (arg, _, _), mem
                                                 in zip(args, memories)])
            self.expect_ok(self.lib.dnnl_primitive_execute(primitive.handle, stream, len(args),
                                                           exec_args), "primitive_execute")
            self.expect_ok(self.lib.dnnl_stream_wait(stream), "stream_wait")
        finally:
            for mem in memories:
                self.lib.dnnl_memory_destroy(mem)


class _Primitive:
    """A primitive with the descriptors of its arguments and its scratchpad's."""

    __slots__ = ("handle", "descs", "scratch", "scratch_bytes")

    def __init__(self, handle: _P, descs: dict[int, _P], scratch: _P | None,
                 scratch_bytes: int):
        self.handle, self.descs = handle, descs
        self.scratch, self.scratch_bytes = scratch, scratch_bytes


_library: _Library | None = None
_loading = threading.Lock()


def load() -> _Library:
    """The library, opened once. OSError where the wheel is missing or cannot load."""
    global _library
    if _library is None:
        with _loading:
            if _library is None:
                path = library_path()
                if path is None:
                    raise OSError(f"{SONAME} not found: the {DISTRIBUTION} wheel is not "
                                  "installed")
                _library = _Library(path)
    return _library


def check() -> None:
    """One 3 x 2 @ (2 x 2)^T product through the library, against its exact value (small
    integers: exact in bf16 and float32): OneDNNError where it cannot run or gets it wrong."""
    x = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    w = np.array([[1, -1], [2, 0]], np.float32)                 # (N, K)
    got = matmul(x, to_bf16(w), True, np.empty((3, 2), np.float32))
    if not np.array_equal(got, x @ w.T):
        raise OneDNNError(f"oneDNN's bf16 product gave {got.tolist()} for "
                          f"{(x @ w.T).tolist()}")


def _elements(a: np.ndarray) -> tuple[int, ...]:
    """a's strides in elements."""
    return tuple(s // a.itemsize for s in a.strides)


def _readable(a: np.ndarray) -> np.ndarray:
    """a 2-D array itself where the library can read it through its strides (non-negative
    multiples of its item), else a C-contiguous copy."""
    if all(s >= 0 and s % a.itemsize == 0 for s in a.strides):
        return a
    return np.ascontiguousarray(a)


def _rounded(lib: _Library, x: np.ndarray, bits: np.ndarray | None = None) -> np.ndarray:
    """x (M, K) float32, any strides -> its bf16 bits (the library's reorder) in the first M
    rows of `bits` (C-contiguous uint16, K columns; a new (M, K) array by default)."""
    m, k = x.shape
    bits = np.empty((m, k), np.uint16) if bits is None else bits
    if x.size == 0:
        return bits
    strides = _elements(x)

    def build():
        descs = {ARG_SRC: lib.desc((m, k), _F32, strides),
                 ARG_DST: lib.desc((m, k), _BF16, (k, 1))}
        return descs, lambda pd: lib.lib.dnnl_reorder_primitive_desc_create(
            pd, descs[ARG_SRC], lib.engine, descs[ARG_DST], lib.engine, lib.attr)

    lib.execute(lib.primitive(("reorder", m, k, strides), build),
                {ARG_SRC: x.ctypes.data, ARG_DST: bits.ctypes.data})
    return bits


def to_bf16(x) -> np.ndarray:
    """float32 x (any shape) -> its bf16 bits (uint16, C-contiguous, x's shape), to nearest
    even."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return _rounded(load(), x.reshape(-1, x.shape[-1] if x.ndim else 1)).reshape(x.shape)


def matmul(x, w_bits: np.ndarray, transpose: bool, out: np.ndarray) -> np.ndarray:
    """out[...] = bf16(x) @ w^T (transpose; w_bits (N, K)) or @ w (w_bits (K, N)), float32
    accumulation and output (see the module docstring). out: (M, N) float32 with non-negative
    strides (a C-contiguous array, or its rows or columns)."""
    lib = load()
    x = _readable(np.asarray(x, dtype=np.float32))
    w_bits = _readable(w_bits)
    m, k = x.shape
    n = w_bits.shape[0] if transpose else w_bits.shape[1]
    if m == 0 or n == 0:
        return out
    if k == 0:
        out[...] = 0.0
        return out
    rows = -(-m // PAD_ROWS) * PAD_ROWS
    xb = np.empty((rows, k), np.uint16)
    xb[m:] = 0
    _rounded(lib, x, xb)
    y = out if rows == m else np.empty((rows, n), np.float32)
    w_strides = _elements(w_bits)[::-1] if transpose else _elements(w_bits)   # of (K, N)
    y_strides = _elements(y)

    def build():
        descs = {ARG_SRC: lib.desc((rows, k), _BF16, (k, 1)),
                 ARG_WEIGHTS: lib.desc((k, n), _BF16, w_strides),
                 ARG_DST: lib.desc((rows, n), _F32, y_strides)}
        return descs, lambda pd: lib.lib.dnnl_matmul_primitive_desc_create(
            pd, lib.engine, descs[ARG_SRC], descs[ARG_WEIGHTS], None, descs[ARG_DST], lib.attr)

    lib.execute(lib.primitive(("matmul", rows, k, n, w_strides, y_strides), build),
                {ARG_SRC: xb.ctypes.data, ARG_WEIGHTS: w_bits.ctypes.data,
                 ARG_DST: y.ctypes.data})
    if y is not out:
        out[...] = y[:m]
    return out
