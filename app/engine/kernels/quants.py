"""GGML block dequantization on NumPy and CuPy arrays alike.

Frozen base weights stay quantized in memory. A matmul calls :func:`dequantize` just in time
on a block of rows, on the device the bytes already live on. Every kernel here is bit-exact
with ``gguf.quants.dequantize`` (gguf 0.19.0), and so with llama.cpp's C reference
(SPEC-llamacpp.md section 6). Three rules keep it exact:

- fp16 scales are converted to float32 before any arithmetic;
- integer quant values are formed exactly in int8/uint8 and cast to float32 only inside the
  final multiply;
- float32 operations run in the same order as gguf's, one rounding per operation. Each
  operation is its own ufunc call, so nothing fuses into an FMA.

On the CPU, Q4_0, Q8_0, Q4_K, Q5_K and Q6_K run compiled kernels (`dequant_compiled`, Numba,
bit-exact with the NumPy kernels here, which stay the reference and run with
WORKBENCH_KERNELS=numpy). The NumPy kernels are vectorised over blocks; no Python loop runs
over blocks. Raw bytes are
reshaped to (n_blocks, block_bytes). Bit fields are unpacked on uint8 into planes, one plane
per field (``_planes``). The float32 output is filled with the broadcast scale and then
multiplied in place by the quant values. This module must not import ``gguf``: the type ids
and block sizes below are hard-coded from ggml (gguf constants.py).

Shape letters: n = number of blocks; the other numbers are literal sizes within a block.
"""

from __future__ import annotations

import numpy as np

from app.engine.kernels import dequant_compiled
from app.engine.runtime.backend import get_array_module

# GGML type ids (ggml.h / gguf constants.py), only those this module dequantizes.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30

BLOCK_SIZES: dict[int, tuple[int, int]] = {  # type id -> (elements per block, bytes per block)
    F32: (1, 4),
    F16: (1, 2),
    BF16: (1, 2),
    Q4_0: (32, 18),
    Q4_1: (32, 20),
    Q5_0: (32, 22),
    Q5_1: (32, 24),
    Q8_0: (32, 34),
    Q2_K: (256, 84),
    Q3_K: (256, 110),
    Q4_K: (256, 144),
    Q5_K: (256, 176),
    Q6_K: (256, 210),
}

TYPE_NAMES: dict[int, str] = {
    F32: "F32", F16: "F16", BF16: "BF16",
    Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
    Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K",
}


def is_supported(ggml_type: int) -> bool:
    """True if :func:`dequantize` handles this GGML type id."""
    try:
        return int(ggml_type) in BLOCK_SIZES
    except (TypeError, ValueError):
        return False


def row_bytes(ggml_type: int, n_elements: int) -> int:
    """Bytes taken by a row of ``n_elements`` values of ``ggml_type``."""
    block_elems, block_bytes = _block_size(ggml_type)
    if n_elements % block_elems:
        raise ValueError(f"{TYPE_NAMES[int(ggml_type)]}: row of {n_elements} elements is not "
                         f"a multiple of the block size {block_elems}")
    return n_elements // block_elems * block_bytes


def dequantize(raw, ggml_type: int, out=None):
    """Dequantize GGUF rows: uint8 ``(..., bytes_per_row)`` -> float32 ``(..., elements_per_row)``.

    ``raw`` holds the rows exactly as a GGUF tensor stores them, with whole blocks back to back
    in each row. F32/F16/BF16 rows are raw bytes as well. The result is always a new array
    (never a view of ``raw``), or ``out`` when given: a float32 array of the result's shape
    on the same device. Raises ``ValueError`` for an unsupported type; the caller then falls
    back to ``gguf.quants`` on the CPU. Also raises it for a row length that is not a
    multiple of the block bytes, and for a bad ``raw`` or ``out``.
    """
    block_elems, block_bytes = _block_size(ggml_type)
    name = TYPE_NAMES[int(ggml_type)]
    xp = get_array_module(raw)
    raw = xp.asarray(raw)
    if raw.dtype != xp.uint8 or raw.ndim == 0:
        raise ValueError(f"{name}: raw must be a uint8 array of shape (..., bytes_per_row), "
                         f"got {raw.dtype} {raw.shape}")
    if raw.shape[-1] % block_bytes:
        raise ValueError(f"{name}: row of {raw.shape[-1]} bytes is not a multiple of the "
                         f"block size {block_bytes} bytes")
    out_shape = (*raw.shape[:-1], raw.shape[-1] // block_bytes * block_elems)
    if out is None:
        out = xp.empty(out_shape, dtype=xp.float32)
    elif get_array_module(out) is not xp or out.dtype != xp.float32 or out.shape != out_shape:
        raise ValueError(f"{name}: out must be a float32 {type(raw).__name__} of shape "
                         f"{out_shape}, got {type(out).__name__} {out.dtype} {out.shape}")
    # Kernels need a contiguous output so that it reshapes to blocks as a view.
    target = out if out.flags.c_contiguous else xp.empty(out_shape, dtype=xp.float32)
    n = raw.size // block_bytes
    if n:
        blocks = xp.ascontiguousarray(raw).reshape(n, block_bytes)     # (n, block_bytes)
        if xp is np and dequant_compiled.available(ggml_type):
            dequant_compiled.dequantize_blocks(ggml_type, blocks, target.reshape(n, block_elems))
        else:
            _KERNELS[int(ggml_type)](xp, blocks, target.reshape(n, block_elems))
    if target is not out:
        out[...] = target
    return out


# ----------------------------------------------------------------------------------- helpers
#
# Performance (NumPy; CuPy would not care): a ufunc over a contiguous array runs as one inner
# loop, but an operation whose innermost axis is a short block row pays a fixed cost per row.
# A 1024x4096 weight has 131072 blocks of 32 values. So the kernels do their bit work on
# whole contiguous arrays, one bit field (plane) at a time, and touch each block row as few
# times as possible: at most one gather of q, one broadcast copy of the scale, the multiply,
# and the min.

def _block_size(ggml_type) -> tuple[int, int]:
    try:
        return BLOCK_SIZES[int(ggml_type)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"GGML type {ggml_type!r} is not supported by the array dequantizer") from None


def _f16_at(xp, blocks, byte: int):
    """The fp16 field at an even byte offset of every block, as float32: (n, block_bytes) -> (n,)."""
    return blocks.view(xp.uint16)[:, byte // 2].view(xp.float16).astype(xp.float32)  # (n,)


def _planes(xp, b, bits: int, to: int = 0):
    """Bit-field planes: uint8 (...) -> (8 // bits, ...), plane f = ((b >> bits*f) & mask) << to.

    This is ggml's packing order: field f of byte j holds a later value than field f-1 of any
    byte in the same group. The loop runs over the 2-8 fields, not over blocks. Scalar shifts
    of a contiguous array are ~3x faster in NumPy than a broadcast array of shifts. Moves to
    the left are multiplies, because NumPy's uint8 left_shift is not vectorised (4x slower).
    """
    b = xp.ascontiguousarray(b)
    n_fields, mask = 8 // bits, ((1 << bits) - 1) << to
    p = xp.empty((n_fields, *b.shape), dtype=xp.uint8)                   # (fields, ...)
    for f in range(n_fields):
        move = bits * f - to
        if move > 0:
            src = xp.right_shift(b, move, out=p[f])
        elif move < 0:
            src = xp.multiply(b, 1 << -move, out=p[f])                   # b << -move (mod 256)
        else:
            src = b
        if to or f < n_fields - 1:                                        # a top field at bit 0 needs no mask
            xp.bitwise_and(src, mask, out=p[f])
    return p


def _gather_or(xp, a, b):
    """a | b as a new C-contiguous uint8 array, from two strided views of planes in value order.

    This is the one pass that moves quant values from plane order into block order.
    """
    q = xp.empty(a.shape, dtype=xp.uint8)
    xp.bitwise_or(a, b, out=q)
    return q


def _scale_into(xp, out, q, scale):
    """out = q * scale with scale broadcast along the last axis (float32, one rounding).

    This is a broadcast copy and then an in-place multiply. In NumPy that is faster than
    ``multiply(q, scale, out=out)`` with a (.., 1) scale, and the result has the same bits
    because IEEE multiplication commutes.
    """
    out[...] = scale
    xp.multiply(out, q, out=out)


def _k_scale_min(xp, sc):
    """Q4_K/Q5_K: (n, 12) bytes -> eight 6-bit scales and eight 6-bit mins, each (n, 8) uint8.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, and bytes 4-7 hold mins 0-3 the same way.
    Bytes 8-11 hold the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high
    nibble). The top 2 bits of bytes 0-3 and 4-7 give the high bits of scales/mins 4-7.
    """
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]                       # (n, 4) each
    scale = xp.empty((sc.shape[0], 8), dtype=xp.uint8)                   # (n, 8)
    scale[:, 0:4] = d & 0x3F
    scale[:, 4:8] = (md & 0x0F) | ((d >> 2) & 0x30)
    mn = xp.empty((sc.shape[0], 8), dtype=xp.uint8)                      # (n, 8)
    mn[:, 0:4] = m & 0x3F
    mn[:, 4:8] = (md >> 4) | ((m >> 2) & 0x30)
    return scale, mn


# _SPREAD16[b] is 8 bytes, where byte k = 16 if bit k of b is set, else 0. Little-endian, like
# every platform ggml runs on. Indexing it with the 4 qh bytes of a Q5_0/Q5_1 block gives
# the 5th bit of its 32 values, in order.
_SPREAD16 = sum(((np.arange(256, dtype=np.uint64) >> np.uint64(k)) & np.uint64(1)) << np.uint64(8 * k + 4)
                for k in range(8)).astype("<u8")


def _high_bits32(xp, qh):
    """(n, 4) bytes = one little-endian uint32 per block -> (n, 32) uint8: 16 * bit j."""
    return xp.asarray(_SPREAD16)[qh].view(xp.uint8).reshape(qh.shape[0], 32)  # (n, 32)


# ----------------------------------------------------------------------------------- kernels
# Each kernel: (xp, blocks (n, block_bytes) contiguous uint8, out (n, block_elems) contiguous
# float32) -> fills out.

def _deq_f32(xp, blocks, out):
    """F32: 4 little-endian bytes per value."""
    out[...] = blocks.view(xp.float32)                                   # (n, 1)


def _deq_f16(xp, blocks, out):
    """F16: 2 little-endian bytes per value (IEEE half)."""
    out[...] = blocks.view(xp.float16)                                   # (n, 1), cast to float32


def _deq_bf16(xp, blocks, out):
    """BF16: 2 bytes per value, the top half of a float32."""
    bits = out.view(xp.uint32)                                           # (n, 1)
    bits[...] = blocks.view(xp.uint16)
    xp.left_shift(bits, 16, out=bits)


def _deq_q4_0(xp, blocks, out):
    """Q4_0, 18 bytes: fp16 d | 16 bytes of 4-bit q (low nibbles = values 0-15). x = d*(q-8)."""
    n = blocks.shape[0]
    d = _f16_at(xp, blocks, 0)                                           # (n,)
    nib = _planes(xp, blocks, 4).view(xp.int8)                           # (2, n, 18): low, high nibbles
    xp.subtract(nib, 8, out=nib)                                         # q - 8, in [-8, 7]
    q = nib.transpose(1, 0, 2)[:, :, 2:18]                               # (n, 2, 16) view
    _scale_into(xp, out.reshape(n, 2, 16), q, d[:, None, None])


def _deq_q4_1(xp, blocks, out):
    """Q4_1, 20 bytes: fp16 d | fp16 m | 16 bytes of 4-bit q. x = d*q + m."""
    n = blocks.shape[0]
    d, m = _f16_at(xp, blocks, 0), _f16_at(xp, blocks, 2)                # (n,) each
    q = _planes(xp, blocks, 4).transpose(1, 0, 2)[:, :, 4:20]            # (n, 2, 16) view
    o = out.reshape(n, 2, 16)
    _scale_into(xp, o, q, d[:, None, None])
    xp.add(o, m[:, None, None], out=o)


def _q5_values(xp, blocks, qh_at: int):
    """Q5_0/Q5_1 5-bit q, (n, 32) uint8. The uint32 qh at byte qh_at has the 5th bit of value j
    at bit j, and the 16 bytes after it hold the low nibbles, as in Q4_0."""
    n = blocks.shape[0]
    q = _high_bits32(xp, blocks[:, qh_at:qh_at + 4])                     # (n, 32) 0 or 16
    lo = _planes(xp, blocks, 4).transpose(1, 0, 2)[:, :, qh_at + 4:]     # (n, 2, 16) view
    xp.bitwise_or(q.reshape(n, 2, 16), lo, out=q.reshape(n, 2, 16))
    return q                                                             # (n, 32) in [0, 31]


def _deq_q5_0(xp, blocks, out):
    """Q5_0, 22 bytes: fp16 d | uint32 qh | 16 bytes of low nibbles. x = d*(q-16)."""
    d = _f16_at(xp, blocks, 0)                                           # (n,)
    q = _q5_values(xp, blocks, 2).view(xp.int8)                          # (n, 32)
    xp.subtract(q, 16, out=q)                                            # q - 16, in [-16, 15]
    _scale_into(xp, out, q, d[:, None])


def _deq_q5_1(xp, blocks, out):
    """Q5_1, 24 bytes: fp16 d | fp16 m | uint32 qh | 16 bytes of low nibbles. x = d*q + m."""
    d, m = _f16_at(xp, blocks, 0), _f16_at(xp, blocks, 2)                # (n,) each
    _scale_into(xp, out, _q5_values(xp, blocks, 4), d[:, None])
    xp.add(out, m[:, None], out=out)


def _deq_q8_0(xp, blocks, out):
    """Q8_0, 34 bytes: fp16 d | 32 int8 q. x = q*d."""
    d = _f16_at(xp, blocks, 0)                                           # (n,)
    _scale_into(xp, out, blocks[:, 2:34].view(xp.int8), d[:, None])      # (n, 32)


def _deq_q2_k(xp, blocks, out):
    """Q2_K, 84 bytes: 16 scale bytes | 64 bytes of 2-bit q | fp16 d | fp16 dmin.

    16 sub-blocks of 16 values. Scale byte s holds sub-block s's 4-bit scale (low nibble)
    and 4-bit min (high nibble). Each 32-byte half h of q holds 128 values: bits 2f..2f+1
    of byte j give value 128h + 32f + j. x = (d*sc)*q - (dmin*m).
    """
    n = blocks.shape[0]
    sc = blocks[:, 0:16]                                                 # (n, 16)
    d, dmin = _f16_at(xp, blocks, 80), _f16_at(xp, blocks, 82)           # (n,) each
    dl = d[:, None] * (sc & 0x0F).astype(xp.float32)                     # (n, 16)
    ml = dmin[:, None] * (sc >> 4).astype(xp.float32)                    # (n, 16)
    q = _planes(xp, blocks[:, 16:80], 2)                                 # (4, n, 64) [f, i, 32h + j]
    q = q.reshape(4, n, 2, 2, 16).transpose(1, 2, 0, 3, 4)               # (n, 2, 4, 2, 16): sub-block 8h + 2f + j//16
    o = out.reshape(n, 2, 4, 2, 16)
    _scale_into(xp, o, q, dl.reshape(n, 2, 4, 2, 1))
    xp.subtract(o, ml.reshape(n, 2, 4, 2, 1), out=o)


def _deq_q3_k(xp, blocks, out):
    """Q3_K, 110 bytes: 32 bytes hmask | 64 bytes of 2-bit low q | 12 bytes of scales | fp16 d.

    16 sub-blocks of 16 values. The 6-bit scales are biased by 32: low nibbles in bytes 0-7
    (scale s at byte s%8, nibble s//8), and top 2 bits in bytes 8-11 (scale s at byte 8+s%4,
    bits 2*(s//4)). The low 2 bits of q use Q2_K's layout. Bit b of hmask byte j is the high
    bit of value 32b + j. A clear bit means -4, so q = (lo | hi<<2) - 4.
    x = (d*(scale-32))*q.
    """
    n = blocks.shape[0]
    d = _f16_at(xp, blocks, 108)                                         # (n,)
    lo = _planes(xp, blocks[:, 96:104], 4).transpose(1, 0, 2).reshape(n, 16)    # (n, 16)
    hi = _planes(xp, blocks[:, 104:108], 2).transpose(1, 0, 2).reshape(n, 16)   # (n, 16)
    scale = ((lo | (hi << 4)).view(xp.int8) - 32).astype(xp.float32)     # (n, 16)
    dl = d[:, None] * scale                                              # (n, 16)
    ql = _planes(xp, blocks[:, 32:96], 2)                                # (4, n, 64) [f, i, 32h + j]
    qh = _planes(xp, blocks[:, 0:32], 1, to=2)                           # (8, n, 32) [4h + f, i, j], 0 or 4
    q = _gather_or(xp, ql.reshape(4, n, 2, 32).transpose(1, 2, 0, 3),   # (n, 2, 4, 32): value 128h + 32f + j
                   qh.reshape(2, 4, n, 32).transpose(2, 0, 1, 3)).view(xp.int8)
    xp.subtract(q, 4, out=q)                                             # in [-4, 3]
    _scale_into(xp, out.reshape(n, 16, 16), q.reshape(n, 16, 16), dl[:, :, None])


def _deq_q4_k(xp, blocks, out):
    """Q4_K, 144 bytes: fp16 d | fp16 dmin | 12 bytes of 6-bit scales/mins | 128 bytes of 4-bit q.

    8 sub-blocks of 32 values. Each 32-byte chunk c of q gives values 64c..64c+31 from its
    low nibbles and 64c+32..64c+63 from its high nibbles. x = (d*sc)*q - (dmin*m).
    """
    n = blocks.shape[0]
    d, dmin = _f16_at(xp, blocks, 0), _f16_at(xp, blocks, 2)             # (n,) each
    sc, mn = _k_scale_min(xp, blocks[:, 4:16])                           # (n, 8) each
    dl = d[:, None] * sc.astype(xp.float32)                              # (n, 8)
    ml = dmin[:, None] * mn.astype(xp.float32)                           # (n, 8)
    q = _planes(xp, blocks[:, 16:144], 4)                                # (2, n, 128) [s, i, 32c + j]
    q = q.reshape(2, n, 4, 32).transpose(1, 2, 0, 3)                     # (n, 4, 2, 32): sub-block 2c + s
    o = out.reshape(n, 4, 2, 32)
    _scale_into(xp, o, q, dl.reshape(n, 4, 2, 1))
    xp.subtract(o, ml.reshape(n, 4, 2, 1), out=o)


def _deq_q5_k(xp, blocks, out):
    """Q5_K, 176 bytes: fp16 d | fp16 dmin | 12 bytes scales/mins | 32 bytes qh | 128 bytes low q.

    Like Q4_K. Bit b of qh byte j is the 5th bit of value 32b + j. x = (d*sc)*q - (dmin*m).
    """
    n = blocks.shape[0]
    d, dmin = _f16_at(xp, blocks, 0), _f16_at(xp, blocks, 2)             # (n,) each
    sc, mn = _k_scale_min(xp, blocks[:, 4:16])                           # (n, 8) each
    dl = d[:, None] * sc.astype(xp.float32)                              # (n, 8)
    ml = dmin[:, None] * mn.astype(xp.float32)                           # (n, 8)
    ql = _planes(xp, blocks[:, 48:176], 4)                               # (2, n, 128) [s, i, 32c + j]
    qh = _planes(xp, blocks[:, 16:48], 1, to=4)                          # (8, n, 32) [2c + s, i, j], 0 or 16
    q = _gather_or(xp, ql.reshape(2, n, 4, 32).transpose(1, 2, 0, 3),   # (n, 4, 2, 32): sub-block 2c + s
                   qh.reshape(4, 2, n, 32).transpose(2, 0, 1, 3))
    _scale_into(xp, out.reshape(n, 8, 32), q.reshape(n, 8, 32), dl[:, :, None])
    xp.subtract(out.reshape(n, 8, 32), ml[:, :, None], out=out.reshape(n, 8, 32))


def _deq_q6_k(xp, blocks, out):
    """Q6_K, 210 bytes: 128 bytes of low 4 bits | 64 bytes of high 2 bits | 16 int8 scales | fp16 d.

    16 sub-blocks of 16 values. Each half h (128 values) uses 64 low bytes and 32 high bytes.
    Value 128h + 32k + j takes its low nibble from ql[64h + 32(k%2) + j], nibble k//2, and
    its high bits from qh[32h + j], bits 2k..2k+1. x = (d*scale)*(q-32).
    """
    n = blocks.shape[0]
    scale = blocks[:, 192:208].view(xp.int8).astype(xp.float32)          # (n, 16)
    dl = _f16_at(xp, blocks, 208)[:, None] * scale                       # (n, 16)
    ql = _planes(xp, blocks[:, 0:128], 4)                                # (2, n, 128) [k//2, i, 64h + 32(k%2) + j]
    qh = _planes(xp, blocks[:, 128:192], 2, to=4)                        # (4, n, 64) [k, i, 32h + j], bits 4-5
    q = _gather_or(xp, ql.reshape(2, n, 2, 2, 32).transpose(1, 2, 0, 3, 4),  # (n, h, k//2, k%2, 32)
                   qh.reshape(2, 2, n, 2, 32).transpose(2, 3, 0, 1, 4)).view(xp.int8)
    xp.subtract(q, 32, out=q)                                            # in [-32, 31]
    _scale_into(xp, out.reshape(n, 16, 16), q.reshape(n, 16, 16), dl[:, :, None])


_KERNELS = {
    F32: _deq_f32, F16: _deq_f16, BF16: _deq_bf16,
    Q4_0: _deq_q4_0, Q4_1: _deq_q4_1, Q5_0: _deq_q5_0, Q5_1: _deq_q5_1, Q8_0: _deq_q8_0,
    Q2_K: _deq_q2_k, Q3_K: _deq_q3_k, Q4_K: _deq_q4_k, Q5_K: _deq_q5_k, Q6_K: _deq_q6_k,
}
