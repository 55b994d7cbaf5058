"""Rotary position embeddings, ggml's two layouts.

NORM rotates adjacent pairs (2i, 2i+1) (llama, deepseek); NEOX rotates (i, i + n_rot/2) (qwen,
olmoe, gemma). theta_i = pos * freq_scale * base^(-2i/n_rot). Only the first n_rot dimensions of
each head rotate; the rest pass through.

On NumPy with compiled kernels on (app.engine.kernels.jit), both directions run one compiled pass
per block of positions (app.engine.kernels.compiled_layers), bit-identical to the NumPy code
here, their twin.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from app.engine.kernels import compiled_layers
from app.engine.runtime.parallel import array_row_blocks, parallel_map

NORM, NEOX = "norm", "neox"


class RopeCache(NamedTuple):
    """What rope_backward needs: the tables cos, sin (T, n_rot/2), n_rot and the layout."""

    cos: Any
    sin: Any
    n_rot: int
    mode: str


def rope_angles(xp, positions, n_rot: int, base: float, freq_scale: float, dtype):
    """cos, sin of shape (T, n_rot/2) for integer positions (T,)."""
    inv_freq = base ** (-xp.arange(0, n_rot, 2, dtype=xp.float64) / n_rot)       # (n_rot/2,)
    theta = positions.astype(xp.float64)[:, None] * freq_scale * inv_freq[None]   # (T, n_rot/2)
    return xp.cos(theta).astype(dtype), xp.sin(theta).astype(dtype)


def _split(x, n_rot: int, mode: str):
    """The two halves of each rotated pair: (T, H, n_rot/2) each."""
    if mode == NORM:
        return x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    return x[..., : n_rot // 2], x[..., n_rot // 2 : n_rot]


def _merge(out, a, b, n_rot: int, mode: str):
    if mode == NORM:
        out[..., 0:n_rot:2], out[..., 1:n_rot:2] = a, b
    else:
        out[..., : n_rot // 2], out[..., n_rot // 2 : n_rot] = a, b
    return out


def rope_forward(x, cos, sin, n_rot: int, mode: str):
    """x: (T, H, D); cos, sin: (T, n_rot/2). Returns the rotated copy and the cache."""
    if compiled_layers.runs_on(x, cos, sin):
        return _rope_compiled(x, cos, sin, n_rot, mode, 1), RopeCache(cos, sin, n_rot, mode)
    x0, x1 = _split(x, n_rot, mode)                      # (T, H, n_rot/2)
    c, s = cos[:, None, :], sin[:, None, :]              # (T, 1, n_rot/2)
    out = x.copy()
    _merge(out, x0 * c - x1 * s, x0 * s + x1 * c, n_rot, mode)
    return out, RopeCache(cos, sin, n_rot, mode)


def rope_backward(dout, cache):
    """dout: (T, H, D) -> dx (T, H, D): the inverse rotation (the transpose of an orthogonal map,
    i.e. rotation by -theta); dimensions past n_rot pass the gradient straight through."""
    n_rot, mode = cache.n_rot, cache.mode
    if compiled_layers.runs_on(dout, cache.cos, cache.sin):
        return _rope_compiled(dout, cache.cos, cache.sin, n_rot, mode, -1)
    d0, d1 = _split(dout, n_rot, mode)                   # (T, H, n_rot/2)
    c, s = cache.cos[:, None, :], cache.sin[:, None, :]  # (T, 1, n_rot/2)
    dx = dout.copy()                                     # (T, H, D)
    return _merge(dx, d0 * c + d1 * s, d1 * c - d0 * s, n_rot, mode)


def _rope_compiled(x, cos, sin, n_rot: int, mode: str, sign: int):
    """x: (T, H, D) rotated by +theta (sign 1) or -theta (-1), blocks of positions on the
    engine's threads."""
    out = np.empty_like(x)                               # (T, H, D)
    x, cos, sin = (np.ascontiguousarray(a) for a in (x, cos, sin))
    kernel = compiled_layers.kernels().rope
    parallel_map(lambda r: kernel(x[r], cos[r], sin[r], n_rot, mode == NEOX, sign, out[r]),
                 array_row_blocks(x))
    return out
