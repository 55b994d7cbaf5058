"""Linear layers with an optional LoRA term: y = x W^T (+ b) + s * (x A^T) B^T."""

from __future__ import annotations


def linear_forward(x, w, bias=None, lora=None):
    """x: (T, in), w: (out, in), bias: (out,), lora: (A (R, in), B (out, R), scale) or None.

    The LoRA product is bracketed as (x A^T) B^T, never B @ A: rank R is small.
    """
    y = x @ w.T                                          # (T, out)
    if bias is not None:
        y += bias
    if lora is not None:
        a, b, scale = lora
        xa = x @ a.T                                     # (T, R)
        y += scale * (xa @ b.T)                          # (T, out)
    return y, (x, w, lora)
