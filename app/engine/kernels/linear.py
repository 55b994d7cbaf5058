"""Linear layers with an optional LoRA term: y = x W^T (+ b) + s * (x A^T) B^T."""

from __future__ import annotations

from typing import Any, NamedTuple

from app.engine.runtime.parallel import matmul


class LinearCache(NamedTuple):
    """What linear_backward needs. `w` may be set to None while the step is between forward
    and backward and put back with `_replace(w=...)`: the model does that, so that a weight
    dequantized for the forward is not kept alive across the step (app.engine.model.transformer).
    x (T, in), w (out, in), lora (A (R, in), B (out, R), scale) or None, xa (T, R) or None,
    mask (T, in) or None."""

    x: Any
    w: Any
    has_bias: bool
    lora: Any
    xa: Any
    mask: Any


def linear_forward(x, w, bias=None, lora=None, dropout_mask=None, x_base=None):
    """x: (T, in), w: (out, in), bias: (out,), lora: (A (R, in), B (out, R), scale) or None.

    The LoRA product is bracketed as (x A^T) B^T, never B @ A: rank R is small.
    dropout_mask: (T, in) LoRA dropout on the LoRA branch's input only, already scaled by
    1/(1-p) (0 where dropped), or None.
    x_base: (T, in) what the base product reads instead of x, or None (inference only:
    llama.cpp's rounded activations, app.engine.model.params.Params.base_input); the cache keeps x.
    Cache: LinearCache with xa = (x * mask) A^T (T, R) kept for dB.
    """
    y = matmul(x if x_base is None else x_base, w.T)     # (T, out)
    if bias is not None:
        y += bias
    xa = None
    if lora is not None:
        a, b, scale = lora
        xl = x if dropout_mask is None else x * dropout_mask
        xa = xl @ a.T                                    # (T, R)
        y += (scale * xa) @ b.T                          # (T, out): scaled on the rank side
    return y, LinearCache(x, w, bias is not None, lora, xa, dropout_mask)


def linear_backward(dout, cache, need_dw: bool):
    """dout: (T, out) -> (dx (T, in), dw (out, in) or None, dbias (out,) or None, (dA, dB) or None).

    dW = dout^T x only when need_dw: a frozen base weight gets no gradient (and nothing of its
    size is allocated). The base weight is only read through dout @ W. LoRA: with dB_ = dout B
    (T, R), dx += s dB_ A (times the dropout mask), dA = s dB_^T (x * mask) (R, in),
    dB = s dout^T xa (out, R); B @ A is never formed.
    """
    x, w, lora, xa, mask = cache.x, cache.w, cache.lora, cache.xa, cache.mask
    dx = matmul(dout, w)                                 # (T, in)
    dw = matmul(dout.T, x) if need_dw else None          # (out, in)
    dbias = dout.sum(0) if cache.has_bias else None      # (out,)
    dlora = None
    if lora is not None:
        a, b, scale = lora
        dxa = scale * (dout @ b)                         # (T, R)
        dxl = dxa @ a                                    # (T, in)
        dx += dxl if mask is None else dxl * mask
        xl = x if mask is None else x * mask
        dlora = (dxa.T @ xl, scale * (dout.T @ xa))      # (R, in), (out, R)
    return dx, dw, dbias, dlora
