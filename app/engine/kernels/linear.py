"""Linear layers with an optional LoRA term: y = x W^T (+ b) + s * (x A^T) B^T."""

from __future__ import annotations


def linear_forward(x, w, bias=None, lora=None):
    """x: (T, in), w: (out, in), bias: (out,), lora: (A (R, in), B (out, R), scale) or None.

    The LoRA product is bracketed as (x A^T) B^T, never B @ A: rank R is small.
    Cache: (x, w, has_bias, lora, xa) with xa = x A^T (T, R) kept for dB (None without LoRA).
    """
    y = x @ w.T                                          # (T, out)
    if bias is not None:
        y += bias
    xa = None
    if lora is not None:
        a, b, scale = lora
        xa = x @ a.T                                     # (T, R)
        y += scale * (xa @ b.T)                          # (T, out)
    return y, (x, w, bias is not None, lora, xa)


def linear_backward(dout, cache, need_dw: bool):
    """dout: (T, out) -> (dx (T, in), dw (out, in) or None, dbias (out,) or None, (dA, dB) or None).

    dW = dout^T x only when need_dw: a frozen base weight gets no gradient (and nothing of its
    size is allocated). The base weight is only read through dout @ W. LoRA: with dB_ = dout B
    (T, R), dx += s dB_ A, dA = s dB_^T x (R, in), dB = s dout^T (x A^T) (out, R); B @ A is never
    formed.
    """
    x, w, has_bias, lora, xa = cache
    dx = dout @ w                                        # (T, in)
    dw = dout.T @ x if need_dw else None                 # (out, in)
    dbias = dout.sum(0) if has_bias else None            # (out,)
    dlora = None
    if lora is not None:
        a, b, scale = lora
        dxa = scale * (dout @ b)                         # (T, R)
        dx += dxa @ a                                    # (T, in)
        dlora = (dxa.T @ x, scale * (dout.T @ xa))       # (R, in), (out, R)
    return dx, dw, dbias, dlora
