"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w (no +1: Gemma's is folded into the GGUF weight)."""

from __future__ import annotations

from app.engine.backend import get_array_module


def rmsnorm_forward(x, w, eps: float):
    """x: (..., C) normalised over the last axis; w: (C,) or (D,) for per-head norms."""
    xp = get_array_module(x)
    ms = (x.astype(xp.float64) ** 2).mean(-1, keepdims=True)      # (..., 1) summed in double, as ggml
    rstd = (1.0 / xp.sqrt(ms + eps)).astype(x.dtype)               # (..., 1)
    out = x * rstd * w                                             # (..., C)
    return out, (x, w, rstd)


def rmsnorm_backward(dout, cache):
    """dout: (..., C) -> (dx (..., C), dw (C,)).

    With g = dout * w and r = rstd: dx = r * (g - x * r^2 * mean(g * x)); dw sums dout * x * r
    over every leading axis, so a per-head norm (x (T, H, D), w (D,)) gets dw of shape (D,).
    """
    x, w, rstd = cache
    xn = x * rstd                                                  # (..., C) normalised x
    dw = (dout * xn).reshape(-1, x.shape[-1]).sum(0)               # (C,)
    g = dout * w                                                   # (..., C)
    gx = (g * xn).mean(-1, keepdims=True)                          # (..., 1) = r * mean(g * x)
    dx = rstd * (g - xn * gx)                                      # (..., C)
    return dx, dw
