"""Gated activations: SwiGLU (silu(g) * u) and GeGLU with ggml's fp16 GELU table.

On NumPy with compiled kernels on (app.engine.kernels.jit), SwiGLU and GeGLU with the exact GELU
(the training path), forward and backward, run one compiled pass per block of rows
(app.engine.kernels.compiled_layers); the NumPy code here is their twin. GeGLU with ggml's fp16
table (inference) runs the NumPy code, bit-exact with llama.cpp's table as before.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from app.engine.kernels import compiled_layers
from app.engine.runtime.backend import get_array_module
from app.engine.runtime.parallel import array_row_blocks, parallel_map

_SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)
_GELU_COEF_A = np.float32(0.044715)
_GELU_TABLE = None  # (65536,) float32: ggml_table_gelu_f16 indexed by the fp16 bit pattern


def sigmoid(x):
    xp = get_array_module(x)
    return 1.0 / (1.0 + xp.exp(-x))


def sigmoid_backward(dout, s):
    """dout, s = sigmoid(x): (...) -> dx = dout * s * (1 - s)."""
    return dout * s * (1.0 - s)


def gelu_tanh(x):
    """Exact tanh-approximation GELU in the dtype of x."""
    xp = get_array_module(x)
    return 0.5 * x * (1.0 + xp.tanh(_SQRT_2_OVER_PI * x * (1.0 + _GELU_COEF_A * x * x)))


def gelu_tanh_grad(x):
    """d gelu_tanh / dx, with the same (float32-rounded) constants as gelu_tanh."""
    xp = get_array_module(x)
    x2 = x * x                                                              # (...)
    t = xp.tanh(_SQRT_2_OVER_PI * x * (1.0 + _GELU_COEF_A * x2))            # (...)
    dinner = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_COEF_A * x2)              # (...) d(tanh arg)/dx
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner


def _gelu_table(xp):
    """ggml's CPU GELU table: fp16(gelu_f32(fp16 input)) for every fp16 bit pattern."""
    global _GELU_TABLE
    if _GELU_TABLE is None:
        with np.errstate(all="ignore"):
            grid = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
            _GELU_TABLE = gelu_tanh(grid).astype(np.float16).astype(np.float32)
    return xp.asarray(_GELU_TABLE)


def gelu_ggml(x):
    """GELU as llama.cpp's CPU backend computes it: x rounded to fp16, looked up in the fp16
    table; x <= -10 gives 0 and x >= 10 gives x. Differs from exact GELU by one fp16 step."""
    xp = get_array_module(x)
    idx = x.astype(xp.float32).astype(xp.float16).view(xp.uint16)
    y = _gelu_table(xp)[idx].astype(x.dtype)
    y = xp.where(x <= -10.0, 0.0, y)
    return xp.where(x >= 10.0, x, y).astype(x.dtype)


class SwigluCache(NamedTuple):
    """What swiglu_backward needs: g, u (T, F). Not sigmoid(g): backward recomputes it rather
    than keep a third (T, F) array of every layer alive across the step."""

    g: Any
    u: Any


class GegluCache(NamedTuple):
    """What geglu_backward needs: g, u (T, F) and which GELU ran. Not gelu(g): backward
    recomputes it."""

    g: Any
    u: Any
    exact: bool


def swiglu_forward(g, u):
    """g, u: (T, F) -> (silu(g) * u, SwigluCache) (blocks of rows on the engine's threads)."""
    xp = get_array_module(g)
    out = xp.empty_like(g)                               # (T, F)
    if compiled_layers.runs_on(g, u) and _flat_rows(g, u, out):
        kernel = compiled_layers.kernels().swiglu_forward
        parallel_map(lambda r: kernel(g[r].reshape(-1), u[r].reshape(-1), out[r].reshape(-1)),
                     array_row_blocks(g))
        return out, SwigluCache(g, u)

    def rows(r: slice) -> None:
        xp.multiply(g[r] * sigmoid(g[r]), u[r], out=out[r])
    parallel_map(rows, array_row_blocks(g), xp)
    return out, SwigluCache(g, u)


def swiglu_backward(dout, cache):
    """dout: (T, F) -> (dg, du): d silu(g)/dg = s (1 + g (1 - s)) with s = sigmoid(g)."""
    g, u = cache.g, cache.u
    xp = get_array_module(g)
    dg, du = xp.empty_like(g), xp.empty_like(g)          # (T, F)
    if compiled_layers.runs_on(dout, g, u) and _flat_rows(dout, g, u, dg, du):
        kernel = compiled_layers.kernels().swiglu_backward
        parallel_map(lambda r: kernel(*(a[r].reshape(-1) for a in (dout, g, u, dg, du))),
                     array_row_blocks(g))
        return dg, du

    def rows(r: slice) -> None:
        sg = sigmoid(g[r])                               # (n, F) recomputed
        xp.multiply(dout[r] * g[r], sg, out=du[r])
        xp.multiply(dout[r] * u[r] * sg, 1.0 + g[r] * (1.0 - sg), out=dg[r])
    parallel_map(rows, array_row_blocks(g), xp)
    return dg, du


def _gelu_constants(g):
    """gelu_tanh's float32 constants in g's dtype, as NumPy promotes them."""
    return g.dtype.type(_SQRT_2_OVER_PI), g.dtype.type(_GELU_COEF_A)


def _flat_rows(*arrays) -> bool:
    """Are these C-contiguous, so that a block of rows flattens to a view?"""
    return all(a.flags.c_contiguous for a in arrays)


def geglu_forward(g, u, exact: bool = False):
    """g, u: (T, F) -> gelu(g) * u, with ggml's table unless exact (the training path).
    Cache: GegluCache."""
    xp = get_array_module(g)
    out = xp.empty_like(g)                               # (T, F)
    if exact and compiled_layers.runs_on(g, u) and _flat_rows(g, u, out):
        kernel, c, a = compiled_layers.kernels().geglu_forward, *_gelu_constants(g)
        parallel_map(lambda r: kernel(g[r].reshape(-1), u[r].reshape(-1), c, a,
                                      out[r].reshape(-1)), array_row_blocks(g))
        return out, GegluCache(g, u, exact)

    def rows(r: slice) -> None:
        xp.multiply(gelu_tanh(g[r]) if exact else gelu_ggml(g[r]), u[r], out=out[r])
    parallel_map(rows, array_row_blocks(g), xp)
    return out, GegluCache(g, u, exact)


def geglu_backward(dout, cache):
    """dout: (T, F) -> (dg, du), using the derivative of the exact tanh-GELU.

    ggml's fp16-table GELU (exact=False) rounds its input to fp16 and looks the result up in a
    table: it is piecewise constant, so its true derivative is zero almost everywhere and useless
    for training. Training therefore runs geglu_forward(g, u, exact=True), whose derivative this
    is; for a table-GELU cache, dg is still the exact GELU's derivative (a surrogate).
    """
    g, u, exact = cache.g, cache.u, cache.exact
    xp = get_array_module(g)
    dg, du = xp.empty_like(g), xp.empty_like(g)          # (T, F)
    if exact and compiled_layers.runs_on(dout, g, u) and _flat_rows(dout, g, u, dg, du):
        kernel, c, a = compiled_layers.kernels().geglu_backward, *_gelu_constants(g)
        parallel_map(lambda r: kernel(*(x[r].reshape(-1) for x in (dout, g, u)), c, a,
                                      dg[r].reshape(-1), du[r].reshape(-1)), array_row_blocks(g))
        return dg, du

    def rows(r: slice) -> None:
        xp.multiply(dout[r], gelu_tanh(g[r]) if exact else gelu_ggml(g[r]), out=du[r])
        xp.multiply(dout[r] * u[r], gelu_tanh_grad(g[r]), out=dg[r])
    parallel_map(rows, array_row_blocks(g), xp)
    return dg, du


def glu_forward(kind: str, g, u):
    return swiglu_forward(g, u) if kind == "silu" else geglu_forward(g, u)


def glu_backward(kind: str, dout, cache):
    """(dg, du) for glu_forward(kind, ...): kind "silu" is SwiGLU, "gelu" is GeGLU."""
    if kind == "silu":
        return swiglu_backward(dout, cache)
    if kind == "gelu":
        return geglu_backward(dout, cache)
    raise ValueError(f"unknown gated activation {kind!r}")
