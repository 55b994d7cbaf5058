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

The kernels are vectorised over blocks. Raw bytes are reshaped to (n_blocks, block_bytes),
bit fields are unpacked with broadcast shifts on uint8, and the final multiply writes
straight into the float32 output. This module must not import ``gguf``: the type ids and
block sizes below are hard-coded from ggml (gguf constants.py).

Shape letters: n = number of blocks; the other numbers are literal sizes within a block.
"""

from __future__ import annotations

import numpy as np

from app.engine.backend import get_array_module

QK_K = 256  # elements per K-quant super-block

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
    return int(ggml_type) in BLOCK_SIZES


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
        blocks = raw.reshape(n, block_bytes)                            # (n, block_bytes); copies only if raw is strided
        _KERNELS[int(ggml_type)](xp, blocks, target.reshape(n, block_elems))
    if target is not out:
        out[...] = target
    return out


# ----------------------------------------------------------------------------------- helpers

def _block_size(ggml_type) -> tuple[int, int]:
    try:
        return BLOCK_SIZES[int(ggml_type)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"GGML type {ggml_type!r} is not supported by the array dequantizer") from None


def _f16(xp, b):
    """(n, 2) little-endian fp16 bytes -> (n, 1) float32."""
    return xp.ascontiguousarray(b).view(xp.float16).astype(xp.float32)     # (n, 1)


_SHIFTS = {bits: np.arange(0, 8, bits, dtype=np.uint8).reshape(-1, 1) for bits in (1, 2, 4)}


def _fields(xp, b, bits):
    """Split each byte into 8//bits fields, lowest first, as a new second-to-last axis.

    b: (..., m) uint8 -> (..., 8 // bits, m) uint8 with [..., f, j] = (b[..., j] >> bits*f) & mask.
    This is ggml's layout: field f of byte j holds the element at f*m + j.
    """
    shifts = xp.asarray(_SHIFTS[bits])                                   # (8 // bits, 1)
    return (b[..., None, :] >> shifts) & ((1 << bits) - 1)              # (..., 8 // bits, m)


def _nibbles(xp, b):
    """(n, 16) bytes -> (n, 32) uint8: low nibbles give elements 0-15, high nibbles 16-31."""
    q = xp.empty((b.shape[0], 2, 16), dtype=xp.uint8)                   # (n, 2, 16)
    xp.bitwise_and(b, 0x0F, out=q[:, 0])
    xp.right_shift(b, 4, out=q[:, 1])
    return q.reshape(-1, 32)                                             # (n, 32)


def _high_bits32(xp, qh):
    """(n, 4) bytes = one little-endian uint32 -> (n, 32) uint8 bit j of it, shifted to 0x10."""
    shifts = xp.asarray(_SHIFTS[1].reshape(1, 1, 8))                     # (1, 1, 8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(-1, 32) << 4        # (n, 32)


def _k_scale_min(xp, sc):
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins.

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

# ----------------------------------------------------------------------------------- kernels
# Each kernel: (xp, blocks (n, block_bytes) uint8, out (n, block_elems) float32) -> fills out.

def _deq_f32(xp, blocks, out):
    """F32: 4 little-endian bytes per value."""
    out[...] = xp.ascontiguousarray(blocks).view(xp.float32)            # (n, 1)


def _deq_f16(xp, blocks, out):
    """F16: 2 little-endian bytes per value (IEEE half)."""
    out[...] = xp.ascontiguousarray(blocks).view(xp.float16)            # (n, 1) cast to float32


def _deq_bf16(xp, blocks, out):
    """BF16: 2 bytes per value, the top half of a float32."""
    bits = out.view(xp.uint32)                                           # (n, 1)
    bits[...] = xp.ascontiguousarray(blocks).view(xp.uint16)
    xp.left_shift(bits, 16, out=bits)


def _deq_q4_0(xp, blocks, out):
    """Q4_0, 18 bytes: fp16 d | 16 bytes of 4-bit q (low nibbles = elements 0-15). x = d*(q-8)."""
    d = _f16(xp, blocks[:, 0:2])                                         # (n, 1)
    q = _nibbles(xp, blocks[:, 2:18]).view(xp.int8) - 8                  # (n, 32) in [-8, 7]
    xp.multiply(q, d, out=out)


def _deq_q4_1(xp, blocks, out):
    """Q4_1, 20 bytes: fp16 d | fp16 m | 16 bytes of 4-bit q. x = d*q + m."""
    d = _f16(xp, blocks[:, 0:2])                                         # (n, 1)
    m = _f16(xp, blocks[:, 2:4])                                         # (n, 1)
    q = _nibbles(xp, blocks[:, 4:20])                                    # (n, 32)
    xp.multiply(q, d, out=out)
    xp.add(out, m, out=out)


def _deq_q5_0(xp, blocks, out):
    """Q5_0, 22 bytes: fp16 d | uint32 qh (bit j = 5th bit of element j) | 16 bytes of low nibbles.

    x = d*(q-16).
    """
    d = _f16(xp, blocks[:, 0:2])                                         # (n, 1)
    q = _nibbles(xp, blocks[:, 6:22]) | _high_bits32(xp, blocks[:, 2:6])  # (n, 32) in [0, 31]
    xp.multiply(q.view(xp.int8) - 16, d, out=out)


def _deq_q5_1(xp, blocks, out):
    """Q5_1, 24 bytes: fp16 d | fp16 m | uint32 qh | 16 bytes of low nibbles. x = d*q + m."""
    d = _f16(xp, blocks[:, 0:2])                                         # (n, 1)
    m = _f16(xp, blocks[:, 2:4])                                         # (n, 1)
    q = _nibbles(xp, blocks[:, 8:24]) | _high_bits32(xp, blocks[:, 4:8])  # (n, 32) in [0, 31]
    xp.multiply(q, d, out=out)
    xp.add(out, m, out=out)


def _deq_q8_0(xp, blocks, out):
    """Q8_0, 34 bytes: fp16 d | 32 int8 q. x = q*d."""
    d = _f16(xp, blocks[:, 0:2])                                         # (n, 1)
    xp.multiply(blocks[:, 2:34].view(xp.int8), d, out=out)               # (n, 32)


def _deq_q2_k(xp, blocks, out):
    """Q2_K, 84 bytes: 16 scale bytes | 64 bytes of 2-bit q | fp16 d | fp16 dmin.

    16 sub-blocks of 16 values. Scale byte i holds sub-block i's 4-bit scale (low nibble)
    and 4-bit min (high nibble). Each 32-byte half of q covers 128 values: bits 2f..2f+1
    of byte j give value 32f + j. x = (d*sc)*q - (dmin*m).
    """
    n = blocks.shape[0]
    sc = blocks[:, 0:16]                                                 # (n, 16)
    d = _f16(xp, blocks[:, 80:82])                                       # (n, 1)
    dmin = _f16(xp, blocks[:, 82:84])                                    # (n, 1)
    dl = d * (sc & 0x0F).astype(xp.float32)                              # (n, 16)
    ml = dmin * (sc >> 4).astype(xp.float32)                             # (n, 16)
    q = _fields(xp, blocks[:, 16:80].reshape(n, 2, 32), 2)              # (n, 2, 4, 32)
    o = out.reshape(n, 16, 16)
    xp.multiply(q.reshape(n, 16, 16), dl[:, :, None], out=o)             # (n, 16, 16)
    xp.subtract(o, ml[:, :, None], out=o)


def _deq_q3_k(xp, blocks, out):
    """Q3_K, 110 bytes: 32 bytes hmask | 64 bytes of 2-bit low q | 12 bytes of scales | fp16 d.

    16 sub-blocks of 16 values. The 6-bit scales are biased by 32: low nibbles in bytes 0-7
    (scale i at byte i%8, nibble i//8), and top 2 bits in bytes 8-11 (scale i at byte 8+i%4,
    bits 2*(i//4)). The low bits of q use Q2_K's layout. Bit b of hmask byte j is the high bit
    of value 32b + j. A clear bit subtracts 4, so q = (lo | hi<<2) - 4.
    x = (d*(scale-32))*q.
    """
    n = blocks.shape[0]
    d = _f16(xp, blocks[:, 108:110])                                     # (n, 1)
    lo = _fields(xp, blocks[:, 96:104], 4).reshape(n, 16)                # (n, 16)
    hi = _fields(xp, blocks[:, 104:108], 2).reshape(n, 16)               # (n, 16)
    scale = ((lo | (hi << 4)).view(xp.int8) - 32).astype(xp.float32)     # (n, 16)
    dl = d * scale                                                       # (n, 16)
    ql = _fields(xp, blocks[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 256)  # (n, 256) in [0, 3]
    qh = _fields(xp, blocks[:, 0:32], 1).reshape(n, 256)                # (n, 256) in {0, 1}
    q = (ql | (qh << 2)).view(xp.int8) - 4                               # (n, 256) in [-4, 3]
    xp.multiply(q.reshape(n, 16, 16), dl[:, :, None], out=out.reshape(n, 16, 16))


def _deq_q4_k(xp, blocks, out):
    """Q4_K, 144 bytes: fp16 d | fp16 dmin | 12 bytes of 6-bit scales/mins | 128 bytes of 4-bit q.

    8 sub-blocks of 32 values. Each 32-byte chunk c of q gives values 64c..64c+31 from its
    low nibbles and 64c+32..64c+63 from its high nibbles. x = (d*sc)*q - (dmin*m).
    """
    n = blocks.shape[0]
    d = _f16(xp, blocks[:, 0:2])                                         # (n, 1)
    dmin = _f16(xp, blocks[:, 2:4])                                      # (n, 1)
    sc, mn = _k_scale_min(xp, blocks[:, 4:16])                           # (n, 8) each
    dl = d * sc.astype(xp.float32)                                       # (n, 8)
    ml = dmin * mn.astype(xp.float32)                                    # (n, 8)
    q = _fields(xp, blocks[:, 16:144].reshape(n, 4, 32), 4)             # (n, 4, 2, 32)
    o = out.reshape(n, 8, 32)
    xp.multiply(q.reshape(n, 8, 32), dl[:, :, None], out=o)              # (n, 8, 32)
    xp.subtract(o, ml[:, :, None], out=o)


def _deq_q5_k(xp, blocks, out):
    """Q5_K, 176 bytes: fp16 d | fp16 dmin | 12 bytes scales/mins | 32 bytes qh | 128 bytes low q.

    Like Q4_K. Bit b of qh byte j is the 5th bit of value 32b + j. x = (d*sc)*q - (dmin*m).
    """
    n = blocks.shape[0]
    d = _f16(xp, blocks[:, 0:2])                                         # (n, 1)
    dmin = _f16(xp, blocks[:, 2:4])                                      # (n, 1)
    sc, mn = _k_scale_min(xp, blocks[:, 4:16])                           # (n, 8) each
    dl = d * sc.astype(xp.float32)                                       # (n, 8)
    ml = dmin * mn.astype(xp.float32)                                    # (n, 8)
    ql = _fields(xp, blocks[:, 48:176].reshape(n, 4, 32), 4).reshape(n, 8, 32)  # (n, 8, 32)
    qh = _fields(xp, blocks[:, 16:48], 1)                               # (n, 8, 32)
    q = ql | (qh << 4)                                                   # (n, 8, 32) in [0, 31]
    o = out.reshape(n, 8, 32)
    xp.multiply(q, dl[:, :, None], out=o)                                # (n, 8, 32)
    xp.subtract(o, ml[:, :, None], out=o)


def _deq_q6_k(xp, blocks, out):
    """Q6_K, 210 bytes: 128 bytes of low 4 bits | 64 bytes of high 2 bits | 16 int8 scales | fp16 d.

    16 sub-blocks of 16 values. Each half h (128 values) uses 64 low bytes and 32 high bytes.
    Value 128h + 32k + j takes its low nibble from ql[64h + 32(k%2) + j], nibble k//2, and
    its high bits from qh[32h + j], bits 2k..2k+1. x = (d*scale)*(q-32).
    """
    n = blocks.shape[0]
    scale = blocks[:, 192:208].view(xp.int8).astype(xp.float32)          # (n, 16)
    dl = _f16(xp, blocks[:, 208:210]) * scale                            # (n, 16)
    ql = _fields(xp, blocks[:, 0:128].reshape(n, 2, 64), 4)             # (n, 2, 2, 64)
    qh = _fields(xp, blocks[:, 128:192].reshape(n, 2, 32), 2)           # (n, 2, 4, 32)
    q = (ql.reshape(n, 8, 32) | (qh.reshape(n, 8, 32) << 4)).view(xp.int8) - 32  # (n, 8, 32) in [-32, 31]
    xp.multiply(q.reshape(n, 16, 16), dl[:, :, None], out=out.reshape(n, 16, 16))


_KERNELS = {
    F32: _deq_f32, F16: _deq_f16, BF16: _deq_bf16,
    Q4_0: _deq_q4_0, Q4_1: _deq_q4_1, Q5_0: _deq_q5_0, Q5_1: _deq_q5_1, Q8_0: _deq_q8_0,
    Q2_K: _deq_q2_k, Q3_K: _deq_q3_k, Q4_K: _deq_q4_k, Q5_K: _deq_q5_k, Q6_K: _deq_q6_k,
}
