"""Compiled (Numba) element-wise layer kernels: RMSNorm and RoPE, forward and backward.

Each kernel is one pass over its rows where the NumPy twin (kernels/norm.py, kernels/rope.py)
makes one per operation; the twins stay the reference:
* RoPE, both ways: the twin's float32 operations in its order, so the same bits.
* RMSNorm: the same float32 operations, but the row sums are taken in float64 over eight lanes
  (the twin: NumPy's pairwise sum, in float64 for mean(x^2), in float32 for the backward's
  mean(g x)), and the weight gradient is summed in float32 within fixed blocks of rows, then
  over the blocks in order (the twin: one float32 sum over all rows). The tests hold both to the
  float32 bound of those sums.
Rows are (n, C) C-contiguous arrays; the callers split them into row blocks for the engine's
threads (the kernels release the GIL). Compiled on first use (and cached on disk), so importing
this module does not import Numba.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

import numpy as np

from app.engine.kernels import jit


def runs_on(*arrays) -> bool:
    """Do the compiled kernels take these arrays (NumPy, one float32/float64 dtype)?"""
    dtype = arrays[0].dtype
    return (jit.compiled() and dtype in (np.float32, np.float64)
            and all(type(a) is np.ndarray and a.dtype == dtype for a in arrays))


@lru_cache(maxsize=None)
def kernels() -> SimpleNamespace:
    """The compiled kernels: rmsnorm_forward, rmsnorm_backward, rope."""

    @jit.njit(inline="always")
    def sum8(a):
        """a: (C,) -> sum in float64 over eight lanes."""
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
        n = a.size - a.size % 8
        for j in range(0, n, 8):
            s0 += np.float64(a[j])
            s1 += np.float64(a[j + 1])
            s2 += np.float64(a[j + 2])
            s3 += np.float64(a[j + 3])
            s4 += np.float64(a[j + 4])
            s5 += np.float64(a[j + 5])
            s6 += np.float64(a[j + 6])
            s7 += np.float64(a[j + 7])
        for j in range(n, a.size):
            s0 += np.float64(a[j])
        return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))

    @jit.njit()
    def rmsnorm_forward(x, w, eps, out, rstd):
        """x, out: (n, C); w: (C,); rstd: (n,). out = x r w with r = 1/sqrt(mean(x^2) + eps),
        mean(x^2) in float64 as the twin (and ggml) take it."""
        n, c = x.shape
        sq = np.empty(c)                                          # (C,) float64 squares
        for i in range(n):
            for j in range(c):
                xj = np.float64(x[i, j])
                sq[j] = xj * xj
            r = x.dtype.type(1.0 / np.sqrt(sum8(sq) / c + eps))
            rstd[i] = r
            for j in range(c):
                out[i, j] = (x[i, j] * r) * w[j]

    @jit.njit()
    def rmsnorm_backward(dout, x, w, rstd, dx, dw):
        """dout, x, dx: (n, C); w: (C,); rstd: (n,); dw: (C,) zeros, gets sum_i dout_i x_i r_i.
        dx = r (g - x r mean(g x r)) with g = dout w."""
        n, c = x.shape
        t = np.empty(c, x.dtype)                                  # (C,) g * xn of one row
        for i in range(n):
            r = rstd[i]
            for j in range(c):
                xn = x[i, j] * r
                dw[j] += dout[i, j] * xn
                t[j] = (dout[i, j] * w[j]) * xn
            gx = x.dtype.type(sum8(t) / c)
            for j in range(c):
                dx[i, j] = r * (dout[i, j] * w[j] - (x[i, j] * r) * gx)

    @jit.njit()
    def rope(x, cos, sin, n_rot, neox, sign, out):
        """x, out: (T, H, D); cos, sin: (T, n_rot/2); sign +1 rotates by theta (forward),
        -1 by -theta (backward: the transpose). Pairs (2i, 2i+1), or (i, i + n_rot/2) when
        neox; dimensions past n_rot are copied."""
        t_len, n_head, d = x.shape
        half = n_rot // 2
        for t in range(t_len):
            for h in range(n_head):
                for i in range(half):
                    a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
                    x0, x1, c, s = x[t, h, a], x[t, h, b], cos[t, i], sin[t, i]
                    if sign > 0:
                        out[t, h, a] = x0 * c - x1 * s
                        out[t, h, b] = x0 * s + x1 * c
                    else:
                        out[t, h, a] = x0 * c + x1 * s
                        out[t, h, b] = x1 * c - x0 * s
                for j in range(n_rot, d):
                    out[t, h, j] = x[t, h, j]

    return SimpleNamespace(rmsnorm_forward=rmsnorm_forward, rmsnorm_backward=rmsnorm_backward,
                           rope=rope)
