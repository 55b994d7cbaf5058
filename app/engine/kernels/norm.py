"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w (no +1: Gemma's is folded into the GGUF weight).

On NumPy with compiled kernels on (app.engine.kernels.jit), forward and backward run one
compiled pass per block of rows (app.engine.kernels.compiled_layers); the NumPy code here is
their twin and the reference.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from app.engine.kernels import compiled_layers
from app.engine.runtime.backend import get_array_module
from app.engine.runtime.parallel import MIN_PIECE_VALUES, array_row_blocks, parallel_map

DW_BLOCK_VALUES = 1 << 15   # a backward piece's rows hold about this many values (C x rows)


class RmsNormCache(NamedTuple):
    """What rmsnorm_backward needs: x (..., C), w (C,) or (D,), rstd (..., 1)."""

    x: Any
    w: Any
    rstd: Any


def rmsnorm_forward(x, w, eps: float):
    """x: (..., C) normalised over the last axis; w: (C,) or (D,) for per-head norms.
    Blocks of rows run on the engine's threads."""
    xp = get_array_module(x)
    rstd = xp.empty((*x.shape[:-1], 1), x.dtype)                   # (..., 1)
    if compiled_layers.runs_on(x, w):
        c = x.shape[-1]
        x2, out = np.ascontiguousarray(x).reshape(-1, c), np.empty(x.shape, x.dtype)
        out2, rstd1 = out.reshape(-1, c), rstd.reshape(-1)             # (n, C), (n,)
        kernel = compiled_layers.kernels().rmsnorm_forward
        parallel_map(lambda r: kernel(x2[r], w, eps, out2[r], rstd1[r]), array_row_blocks(x2))
        return out, RmsNormCache(x, w, rstd)
    out = xp.empty_like(x)                                         # (..., C)

    def rows(r: slice) -> None:
        ms = (x[r].astype(xp.float64) ** 2).mean(-1, keepdims=True)  # summed in double, as ggml
        rstd[r] = 1.0 / xp.sqrt(ms + eps)
        xp.multiply(x[r] * rstd[r], w, out=out[r])
    parallel_map(rows, array_row_blocks(x), xp)
    return out, RmsNormCache(x, w, rstd)


def rmsnorm_backward(dout, cache):
    """dout: (..., C) -> (dx (..., C), dw (C,)).

    With g = dout * w and r = rstd: dx = r * (g - x * r^2 * mean(g * x)); dw sums dout * x * r
    over every leading axis, so a per-head norm (x (T, H, D), w (D,)) gets dw of shape (D,).
    """
    x, w, rstd = cache.x, cache.w, cache.rstd
    if compiled_layers.runs_on(dout, x, w, rstd):
        return _rmsnorm_backward_compiled(dout, x, w, rstd)
    xp = get_array_module(x)
    xn = x * rstd                                                  # (..., C) normalised x
    dw = (dout * xn).reshape(-1, x.shape[-1]).sum(0)               # (C,)
    dx = xp.empty_like(x)                                          # (..., C)

    def rows(r: slice) -> None:
        g = dout[r] * w                                            # (n, ..., C)
        gx = (g * xn[r]).mean(-1, keepdims=True)                   # (n, ..., 1) = r mean(g x)
        xp.multiply(rstd[r], g - xn[r] * gx, out=dx[r])
    parallel_map(rows, array_row_blocks(x), xp)
    return dx, dw


def _rmsnorm_backward_compiled(dout, x, w, rstd):
    """The compiled backward on blocks of rows of a fixed size (so dw, summed per block and then
    over the blocks in order, does not depend on the thread count)."""
    c = x.shape[-1]
    x2, dout2 = np.ascontiguousarray(x).reshape(-1, c), np.ascontiguousarray(dout).reshape(-1, c)
    dx = np.empty_like(x2)                                         # (n, C)
    step = max(16, DW_BLOCK_VALUES // c)
    blocks = [slice(lo, lo + step) for lo in range(0, len(x2), step)]
    dw_parts = np.zeros((len(blocks), c), x.dtype)                 # (blocks, C)
    rstd1, kernel = rstd.reshape(-1), compiled_layers.kernels().rmsnorm_backward

    def block(b: int) -> None:
        kernel(dout2[blocks[b]], x2[blocks[b]], w, rstd1[blocks[b]], dx[blocks[b]], dw_parts[b])
    if x2.size < 2 * MIN_PIECE_VALUES:      # too little work to wake the other threads for
        for b in range(len(blocks)):
            block(b)
    else:
        parallel_map(block, range(len(blocks)))
    dw = dw_parts[0].copy()                                        # (C,)
    for part in dw_parts[1:]:
        dw += part
    return dx.reshape(x.shape), dw
