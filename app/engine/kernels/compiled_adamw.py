"""Compiled (Numba) AdamW: the update in one pass over a chunk of value, gradient and moments.

`adamw_chunk` reads w, g, m, v once and writes w, m, v once (28 bytes per float32 parameter),
where the NumPy twin (`app.engine.training.optimizers.AdamW._kernel` and the clipping before it)
makes 14 passes through scratch buffers. It does the twin's float32 operations in the twin's
order, element by element: global-norm scale, element-wise clamp (counting what it changed),
m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, w = w keep - step_size m / (sqrt(v b2h) + eps).
Numba keeps float32 arithmetic in float32 and `fastmath=False` forbids contraction into FMAs,
so the result is bit-identical to the twin.

`sumsq_chunk` is the global norm's partial sum of one chunk, accumulated in float64 over eight
lanes (the twin sums float32 BLAS dots in float64: the two agree to the float32 bound of the
dot, not bit for bit).

The caller (the optimizer) hands chunks to the engine's threads; the kernels release the GIL.
They are compiled on first use (cached on disk), so importing this module does not import Numba.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from app.engine.kernels import jit


@lru_cache(maxsize=None)
def _kernels():
    """(adamw_chunk, sumsq_chunk), compiled."""

    @jit.njit()
    def adamw_chunk(w, g, m, v, scale, lo, hi, b1, omb1, b2, omb2, b2h, eps, step_size, keep):
        """w, g, m, v: (n,) of one float dtype; the constants of that dtype. Switched-off
        clippings and decay come as exact identities (scale 1, clamp to +-inf, keep 1): no
        branch in the loop, which LLVM vectorizes. Updates w, m, v in place; returns the
        number of elements the clamp changed."""
        clipped = 0
        for i in range(w.size):
            gi = g[i] * scale
            clipped += (gi > hi) | (gi < lo)
            gi = hi if gi > hi else (lo if gi < lo else gi)
            mi = m[i] * b1 + gi * omb1
            vi = v[i] * b2 + (gi * gi) * omb2
            m[i] = mi
            v[i] = vi
            w[i] = w[i] * keep - mi / (np.sqrt(vi * b2h) + eps) * step_size
        return clipped

    @jit.njit()
    def sumsq_chunk(g):
        """g: (n,) -> sum of g^2 in float64 over eight lanes (scalars, not an array: LLVM keeps
        them in registers), NaN/Inf iff g has one."""
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
        n = g.size - g.size % 8
        for i in range(0, n, 8):
            x0, x1, x2, x3 = np.float64(g[i]), np.float64(g[i + 1]), np.float64(g[i + 2]), \
                np.float64(g[i + 3])
            x4, x5, x6, x7 = np.float64(g[i + 4]), np.float64(g[i + 5]), np.float64(g[i + 6]), \
                np.float64(g[i + 7])
            s0 += x0 * x0
            s1 += x1 * x1
            s2 += x2 * x2
            s3 += x3 * x3
            s4 += x4 * x4
            s5 += x5 * x5
            s6 += x6 * x6
            s7 += x7 * x7
        for i in range(n, g.size):
            x = np.float64(g[i])
            s0 += x * x
        return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))

    return adamw_chunk, sumsq_chunk


def runs_on(*arrays) -> bool:
    """Do the compiled kernels take these arrays (NumPy, one float32/float64 dtype, contiguous)?"""
    dtype = arrays[0].dtype
    return (jit.compiled() and dtype in (np.float32, np.float64)
            and all(type(a) is np.ndarray and a.dtype == dtype and a.flags.c_contiguous
                    for a in arrays))


def adamw_chunk(w, g, m, v, scale: float, gclip: float, constants: tuple) -> int:
    """One chunk's update (see the module docstring); constants as AdamW._constants returns
    them: (b1, 1 - b1, b2, 1 - b2, b2h, eps, lr b1h, keep). Returns the clamped count."""
    t = w.dtype.type
    hi = t(gclip) if gclip > 0 else t(np.inf)
    return int(_kernels()[0](w, g, m, v, t(scale), -hi, hi, *(t(c) for c in constants)))


def sumsq_chunk(g) -> float:
    return float(_kernels()[1](g))
