"""Gated activations: SwiGLU (silu(g) * u) and GeGLU with ggml's fp16 GELU table."""

from __future__ import annotations

import numpy as np

from app.engine.backend import get_array_module

_SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)
_GELU_COEF_A = np.float32(0.044715)
_GELU_TABLE = None  # (65536,) float32: ggml_table_gelu_f16 indexed by the fp16 bit pattern


def sigmoid(x):
    xp = get_array_module(x)
    return 1.0 / (1.0 + xp.exp(-x))


def gelu_tanh(x):
    """Exact tanh-approximation GELU in the dtype of x."""
    xp = get_array_module(x)
    return 0.5 * x * (1.0 + xp.tanh(_SQRT_2_OVER_PI * x * (1.0 + _GELU_COEF_A * x * x)))


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


def swiglu_forward(g, u):
    """g, u: (T, F) -> silu(g) * u."""
    sg = sigmoid(g)                                      # (T, F)
    return g * sg * u, (g, u, sg)


def geglu_forward(g, u, exact: bool = False):
    """g, u: (T, F) -> gelu(g) * u, with ggml's table unless exact (the training path)."""
    act = gelu_tanh(g) if exact else gelu_ggml(g)        # (T, F)
    return act * u, (g, u, act)


def glu_forward(kind: str, g, u):
    return swiglu_forward(g, u) if kind == "silu" else geglu_forward(g, u)
