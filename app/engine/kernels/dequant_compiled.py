"""Compiled (Numba) GGML block dequantization for NumPy arrays: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K.

One loop over blocks, each block's values written once, so a kernel reads its bytes and writes
its float32 output in one pass (the NumPy kernels of `quants` make 4-6 passes over planes).
Bit-exact with `quants`' NumPy kernels, which stay the oracle in the tests: fp16 fields go
through a 65,536-entry float32 table built by NumPy's own conversion, integer quant values are
formed exactly and cast to float32 only for the final multiply, and every float32 operation is
the one `quants` does, in its order (d*sc, then that times q, then minus dmin*m); Numba keeps
float32 arithmetic in float32 and `fastmath=False` forbids contraction into FMAs.

`dequantize_blocks(t, blocks, out)` is what `quants.dequantize` calls on the CPU when compiled
kernels run (`app.engine.kernels.jit.compiled()`); large inputs are split into row ranges of
blocks on the engine's threads (the kernels release the GIL). The kernels are compiled on first
use (and cached on disk), so importing this module does not import Numba.

Shape letters: n = blocks; within a block the literal sizes of `quants`.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from app.engine.kernels import jit
from app.engine.runtime.parallel import parallel_map, row_blocks

Q4_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 8, 12, 13, 14
TYPES = (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K)
MIN_BLOCKS_PER_PIECE = 2048   # ~0.5M K-quant values: below this a piece is not worth a thread


def _f16_table() -> np.ndarray:
    """float32 value of every fp16 bit pattern: (65536,)."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def k_scale_min(blocks, i, j):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block j (scale bytes at offset 4). A stub the
    kernels call, its compiled body registered in _kernels: a kernel whose closure held a
    compiled helper missed Numba's disk cache and recompiled in every process."""
    raise NotImplementedError("compiled only")


def _kernels() -> dict:
    """The per-type kernels, compiled, each (blocks (n, block_bytes) uint8, out (n, block_elems) float32,
    f16 (65536,) float32) -> fills out."""

    @jit.njit()
    def q4_0(blocks, out, f16):
        for i in range(blocks.shape[0]):
            d = f16[blocks[i, 0] | (np.uint16(blocks[i, 1]) << 8)]
            for j in range(16):
                b = blocks[i, 2 + j]
                out[i, j] = d * np.float32(np.int8(b & 15) - np.int8(8))
                out[i, 16 + j] = d * np.float32(np.int8(b >> 4) - np.int8(8))

    @jit.njit()
    def q8_0(blocks, out, f16):
        for i in range(blocks.shape[0]):
            d = f16[blocks[i, 0] | (np.uint16(blocks[i, 1]) << 8)]
            for j in range(32):
                out[i, j] = d * np.float32(np.int8(blocks[i, 2 + j]))

    from numba.extending import overload

    @overload(k_scale_min, jit_options=dict(inline="always"))
    def _k_scale_min(blocks, i, j):
        def impl(blocks, i, j):
            if j < 4:
                return blocks[i, 4 + j] & 63, blocks[i, 8 + j] & 63
            sc = (blocks[i, 8 + j] & 15) | ((blocks[i, j] >> 6) << 4)
            mn = (blocks[i, 8 + j] >> 4) | ((blocks[i, 4 + j] >> 6) << 4)
            return sc, mn
        return impl

    @jit.njit()
    def q4_k(blocks, out, f16):
        for i in range(blocks.shape[0]):
            d = f16[blocks[i, 0] | (np.uint16(blocks[i, 1]) << 8)]
            dmin = f16[blocks[i, 2] | (np.uint16(blocks[i, 3]) << 8)]
            for c in range(4):                              # chunk c: sub-blocks 2c (low), 2c+1 (high)
                sc0, mn0 = k_scale_min(blocks, i, 2 * c)
                sc1, mn1 = k_scale_min(blocks, i, 2 * c + 1)
                dl0, ml0 = d * np.float32(sc0), dmin * np.float32(mn0)
                dl1, ml1 = d * np.float32(sc1), dmin * np.float32(mn1)
                for j in range(32):
                    b = blocks[i, 16 + 32 * c + j]
                    out[i, 64 * c + j] = dl0 * np.float32(b & 15) - ml0
                    out[i, 64 * c + 32 + j] = dl1 * np.float32(b >> 4) - ml1

    @jit.njit()
    def q5_k(blocks, out, f16):
        for i in range(blocks.shape[0]):
            d = f16[blocks[i, 0] | (np.uint16(blocks[i, 1]) << 8)]
            dmin = f16[blocks[i, 2] | (np.uint16(blocks[i, 3]) << 8)]
            for c in range(4):                              # qh bit 2c (low), 2c+1 (high)
                sc0, mn0 = k_scale_min(blocks, i, 2 * c)
                sc1, mn1 = k_scale_min(blocks, i, 2 * c + 1)
                dl0, ml0 = d * np.float32(sc0), dmin * np.float32(mn0)
                dl1, ml1 = d * np.float32(sc1), dmin * np.float32(mn1)
                for j in range(32):
                    b, hb = blocks[i, 48 + 32 * c + j], blocks[i, 16 + j] >> (2 * c)
                    out[i, 64 * c + j] = dl0 * np.float32((b & 15) | ((hb & 1) << 4)) - ml0
                    out[i, 64 * c + 32 + j] = dl1 * np.float32((b >> 4) | ((hb & 2) << 3)) - ml1

    @jit.njit()
    def q6_k(blocks, out, f16):
        for i in range(blocks.shape[0]):
            d = f16[blocks[i, 208] | (np.uint16(blocks[i, 209]) << 8)]
            for h in range(2):                              # values 128h + 32k + j, k = 0..3
                for half in range(2):                       # j in 16 half ..: sub-block 8h + 2k + half
                    dl0 = d * np.float32(np.int8(blocks[i, 192 + 8 * h + half]))
                    dl1 = d * np.float32(np.int8(blocks[i, 194 + 8 * h + half]))
                    dl2 = d * np.float32(np.int8(blocks[i, 196 + 8 * h + half]))
                    dl3 = d * np.float32(np.int8(blocks[i, 198 + 8 * h + half]))
                    for j in range(16 * half, 16 * half + 16):
                        l0, l1 = blocks[i, 64 * h + j], blocks[i, 64 * h + 32 + j]
                        hb = blocks[i, 128 + 32 * h + j]
                        o = 128 * h + j
                        out[i, o] = dl0 * np.float32(np.int32((l0 & 15) | ((hb & 3) << 4)) - 32)
                        out[i, o + 32] = dl1 * np.float32(np.int32((l1 & 15) | ((hb & 12) << 2)) - 32)
                        out[i, o + 64] = dl2 * np.float32(np.int32((l0 >> 4) | (hb & 48)) - 32)
                        out[i, o + 96] = dl3 * np.float32(np.int32((l1 >> 4) | ((hb >> 2) & 48)) - 32)

    return {Q4_0: q4_0, Q8_0: q8_0, Q4_K: q4_k, Q5_K: q5_k, Q6_K: q6_k}


@lru_cache(maxsize=1)
def _compiled() -> dict:
    return _kernels()


def available(ggml_type: int) -> bool:
    """Does a compiled kernel run for this type in this process?"""
    return int(ggml_type) in TYPES and jit.compiled()


_F16 = _f16_table()


def dequantize_blocks(ggml_type: int, blocks: np.ndarray, out: np.ndarray) -> None:
    """blocks (n, block_bytes) C-contiguous uint8 -> out (n, block_elems) C-contiguous float32,
    on the engine's threads in row ranges when there are many blocks."""
    kernel = _compiled()[int(ggml_type)]
    n = blocks.shape[0]
    pieces = row_blocks(n, MIN_BLOCKS_PER_PIECE)
    if len(pieces) == 1:
        kernel(blocks, out, _F16)
        return
    parallel_map(lambda rows: kernel(blocks[rows], out[rows], _F16), pieces)
