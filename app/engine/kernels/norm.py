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
