"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w (no +1: Gemma's is folded into the GGUF weight)."""

from __future__ import annotations

from typing import Any, NamedTuple

from app.engine.runtime.backend import get_array_module
from app.engine.runtime.parallel import parallel_map, row_blocks


class RmsNormCache(NamedTuple):
    """What rmsnorm_backward needs: x (..., C), w (C,) or (D,), rstd (..., 1)."""

    x: Any
    w: Any
    rstd: Any


def rmsnorm_forward(x, w, eps: float):
    """x: (..., C) normalised over the last axis; w: (C,) or (D,) for per-head norms.
    Blocks of rows run on the engine's threads."""
    xp = get_array_module(x)
    out = xp.empty_like(x)                                         # (..., C)
    rstd = xp.empty((*x.shape[:-1], 1), x.dtype)                   # (..., 1)

    def rows(r: slice) -> None:
        ms = (x[r].astype(xp.float64) ** 2).mean(-1, keepdims=True)  # summed in double, as ggml
        rstd[r] = 1.0 / xp.sqrt(ms + eps)
        xp.multiply(x[r] * rstd[r], w, out=out[r])
    parallel_map(rows, row_blocks(len(x)), xp)
    return out, RmsNormCache(x, w, rstd)


def rmsnorm_backward(dout, cache):
    """dout: (..., C) -> (dx (..., C), dw (C,)).

    With g = dout * w and r = rstd: dx = r * (g - x * r^2 * mean(g * x)); dw sums dout * x * r
    over every leading axis, so a per-head norm (x (T, H, D), w (D,)) gets dw of shape (D,).
    """
    x, w, rstd = cache.x, cache.w, cache.rstd
    xp = get_array_module(x)
    xn = x * rstd                                                  # (..., C) normalised x
    dw = (dout * xn).reshape(-1, x.shape[-1]).sum(0)               # (C,)
    dx = xp.empty_like(x)                                          # (..., C)

    def rows(r: slice) -> None:
        g = dout[r] * w                                            # (n, ..., C)
        gx = (g * xn[r]).mean(-1, keepdims=True)                   # (n, ..., 1) = r mean(g x)
        xp.multiply(rstd[r], g - xn[r] * gx, out=dx[r])
    parallel_map(rows, row_blocks(len(x)), xp)
    return dx, dw
