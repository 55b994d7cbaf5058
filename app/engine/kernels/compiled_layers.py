"""Compiled (Numba) element-wise layer kernels: RMSNorm, RoPE, attention's softmax and the gated
activations, forward and backward.

Each kernel is one pass over its rows where the NumPy twin (kernels/norm.py, rope.py,
attention.py, activations.py) makes one per operation; the twins stay the reference:
* RoPE, both ways: the twin's float32 operations in its order, so the same bits.
* RMSNorm: the same float32 operations, but the row sums are taken in float64 over eight lanes
  (the twin: NumPy's pairwise sum, in float64 for mean(x^2), in float32 for the backward's
  mean(g x)), and the weight gradient is summed in float32 within fixed blocks of rows, then
  over the blocks in order (the twin: one float32 sum over all rows). The tests hold both to the
  float32 bound of those sums.
* Softmax, SwiGLU and GeGLU's exact (tanh) GELU: float32 exp is `exp32` below, Cephes' expf
  (a degree-6 polynomial after reduction by ln 2, within 2 ulp of exp), written so that LLVM
  vectorizes it: Numba's own np.exp on float32 is a scalar libm call (no SVML here), which
  made a compiled SwiGLU 2.5x slower than NumPy's vectorized exp. NumPy's exp differs from it
  in the last bits, so these kernels and their twins agree to the float32 bound of the
  operation, not bit for bit.
  tanh is 1 - 2 / (exp(2x) + 1). float64 arrays (the gradient checks) use np.exp and np.tanh.
  GeGLU's inference path (ggml's fp16 table) stays on the NumPy code.
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


EXP_LO, EXP_HI = -87.33654, 88.72283    # float32 exp underflows to 0 below, overflows above


@lru_cache(maxsize=None)
def kernels() -> SimpleNamespace:
    """The compiled kernels: rmsnorm_forward, rmsnorm_backward, rope, softmax_forward,
    softmax_probs, softmax_dscores, swiglu_forward, swiglu_backward, geglu_forward (exact
    GELU), geglu_backward."""
    from numba.cpython.unsafe.numbers import viewer
    from numba.core import types
    from numba.extending import overload

    f32 = np.float32

    def helper(stub):
        """Register the decorated implementation of the one-argument `stub`, inlined where a
        kernel calls it. Kernels call helpers through such plain-function stubs, not through other compiled
        functions: Numba's disk cache misses, in every new process, a kernel whose closure
        holds a compiled function (3 s per kernel recompiled on each start)."""
        def register(impl):
            overload(stub, jit_options=dict(inline="always"))(lambda x: impl)
            return impl
        return register

    def exp32(x):
        """Cephes expf for a float32 x, branch-free (selects) so that loops over it vectorize."""

    @helper(exp32)
    def _exp32(x):
        xc = min(max(x, f32(EXP_LO)), f32(EXP_HI))
        n = np.floor(xc * f32(1.44269504088896341) + f32(0.5))   # x = n ln2 + r, |r| <= ln2/2
        r = xc - n * f32(0.693359375) + n * f32(2.12194440e-4)    # ln2 in two parts
        p = f32(1.9875691500e-4)
        p = p * r + f32(1.3981999507e-3)
        p = p * r + f32(8.3334519073e-3)
        p = p * r + f32(4.1665795894e-2)
        p = p * r + f32(1.6666665459e-1)
        p = p * r + f32(5.0000001201e-1)
        y = (p * r) * r + r + f32(1.0)
        k = np.int64(n) - (n > 0)                                 # 2^n = 2^k (2 if n > 0)
        y = y * viewer(np.int32((k + 127) << 23), np.float32)
        y = y * f32(2.0) if n > 0 else y
        y = f32(0.0) if x < f32(EXP_LO) else y
        return f32(np.inf) if x > f32(EXP_HI) else y

    def fexp(x):
        """exp32 on float32, np.exp on float64."""

    @overload(fexp, jit_options=dict(inline="always"))
    def _fexp(x):
        if x == types.float32:
            return lambda x: exp32(x)
        return lambda x: np.exp(x)

    def ftanh(x):
        """1 - 2 / (exp32(2x) + 1) on float32 (within a few ulp of 1 in absolute terms, which
        is what GELU's 1 + tanh needs), np.tanh on float64."""

    @overload(ftanh, jit_options=dict(inline="always"))
    def _ftanh(x):
        if x == types.float32:
            return lambda x: f32(1.0) - f32(2.0) / (exp32(f32(2.0) * x) + f32(1.0))
        return lambda x: np.tanh(x)

    def sum8(x):
        """x: (C,) -> sum in float64 over eight lanes."""

    @helper(sum8)
    def _sum8(x):
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
        n = x.size - x.size % 8
        for j in range(0, n, 8):
            s0 += np.float64(x[j])
            s1 += np.float64(x[j + 1])
            s2 += np.float64(x[j + 2])
            s3 += np.float64(x[j + 3])
            s4 += np.float64(x[j + 4])
            s5 += np.float64(x[j + 5])
            s6 += np.float64(x[j + 6])
            s7 += np.float64(x[j + 7])
        for j in range(n, x.size):
            s0 += np.float64(x[j])
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

    def max8(x):
        """x: (C,) -> max over eight lanes (selects, which vectorize; no NaN expected)."""

    @helper(max8)
    def _max8(x):
        m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = x.dtype.type(-np.inf)
        n = x.size - x.size % 8
        for j in range(0, n, 8):
            m0 = x[j] if x[j] > m0 else m0
            m1 = x[j + 1] if x[j + 1] > m1 else m1
            m2 = x[j + 2] if x[j + 2] > m2 else m2
            m3 = x[j + 3] if x[j + 3] > m3 else m3
            m4 = x[j + 4] if x[j + 4] > m4 else m4
            m5 = x[j + 5] if x[j + 5] > m5 else m5
            m6 = x[j + 6] if x[j + 6] > m6 else m6
            m7 = x[j + 7] if x[j + 7] > m7 else m7
        for j in range(n, x.size):
            m0 = x[j] if x[j] > m0 else m0
        return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))

    @jit.njit()
    def softmax_forward(s, mask, r0, k0, scale, lse, lse_r0):
        """s: (G, Tr, Tk') raw scores q k^T of query rows r0.. and keys k0.., replaced by
        softmax(s scale + mask) along the keys; mask: (Tq, Tk); lse: (G, Tq) gets the rows'
        log-sum-exp at lse_r0.. (whole arrays and offsets: contiguous rows vectorize)."""
        n_g, n_r, n_k = s.shape
        for g in range(n_g):
            for i in range(n_r):
                row, m = s[g, i], mask[r0 + i, k0:k0 + n_k]
                for j in range(n_k):
                    row[j] = row[j] * scale + m[j]
                top = max8(row)
                for j in range(n_k):
                    row[j] = fexp(row[j] - top)
                total = s.dtype.type(sum8(row))
                for j in range(n_k):
                    row[j] = row[j] / total
                lse[g, lse_r0 + i] = top + np.log(total)

    @jit.njit()
    def softmax_probs(s, mask, r0, k0, scale, lse, lse_r0):
        """s: (G, Tr, Tk') raw scores, replaced by exp(s scale + mask - lse) (the forward's
        probabilities again); mask, lse and the offsets as in softmax_forward."""
        n_g, n_r, n_k = s.shape
        for g in range(n_g):
            for i in range(n_r):
                row, m, top = s[g, i], mask[r0 + i, k0:k0 + n_k], lse[g, lse_r0 + i]
                for j in range(n_k):
                    row[j] = fexp((row[j] * scale + m[j]) - top)

    @jit.njit()
    def softmax_dscores(ds, delta, r0, h0, p):
        """ds: (G, Tr, Tk') dP = dO V^T, replaced by P (dP - delta); delta: (Tq, H), read at
        rows r0.. and heads h0..; p as ds."""
        n_g, n_r, n_k = ds.shape
        for g in range(n_g):
            for i in range(n_r):
                row, prow, d = ds[g, i], p[g, i], delta[r0 + i, h0 + g]
                for j in range(n_k):
                    row[j] = (row[j] - d) * prow[j]

    @jit.njit()
    def swiglu_forward(g, u, out):
        """g, u, out: (n,) -> out = g sigmoid(g) u."""
        one = g.dtype.type(1.0)
        for i in range(g.size):
            out[i] = (g[i] * (one / (one + fexp(-g[i])))) * u[i]

    @jit.njit()
    def swiglu_backward(dout, g, u, dg, du):
        """(n,) each: du = dout g s, dg = dout u s (1 + g (1 - s)), s = sigmoid(g)."""
        one = g.dtype.type(1.0)
        for i in range(g.size):
            s = one / (one + fexp(-g[i]))
            du[i] = (dout[i] * g[i]) * s
            dg[i] = ((dout[i] * u[i]) * s) * (one + g[i] * (one - s))

    @jit.njit()
    def geglu_forward(g, u, c, a, out):
        """g, u, out: (n,) -> out = gelu_tanh(g) u, with the twin's constants c = sqrt(2/pi),
        a = 0.044715 in g's dtype."""
        half, one = g.dtype.type(0.5), g.dtype.type(1.0)
        for i in range(g.size):
            x = g[i]
            out[i] = ((half * x) * (one + ftanh((c * x) * (one + (a * x) * x)))) * u[i]

    @jit.njit()
    def geglu_backward(dout, g, u, c, a, dg, du):
        """(n,) each: du = dout gelu_tanh(g), dg = dout u gelu_tanh'(g)."""
        half, one, three = g.dtype.type(0.5), g.dtype.type(1.0), g.dtype.type(3.0)
        for i in range(g.size):
            x = g[i]
            x2 = x * x
            t = ftanh((c * x) * (one + a * x2))
            du[i] = dout[i] * ((half * x) * (one + t))
            dinner = c * (one + (three * a) * x2)
            grad = half * (one + t) + (((half * x) * (one - t * t)) * dinner)
            dg[i] = (dout[i] * u[i]) * grad

    return SimpleNamespace(rmsnorm_forward=rmsnorm_forward, rmsnorm_backward=rmsnorm_backward,
                           rope=rope, softmax_forward=softmax_forward,
                           softmax_probs=softmax_probs, softmax_dscores=softmax_dscores,
                           swiglu_forward=swiglu_forward, swiglu_backward=swiglu_backward,
                           geglu_forward=geglu_forward, geglu_backward=geglu_backward)
