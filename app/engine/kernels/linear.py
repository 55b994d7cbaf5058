"""Linear layers with an optional LoRA term: y = x W^T (+ b) + s * (x A^T) B^T."""

from __future__ import annotations

from typing import Any, NamedTuple

from app.engine.runtime.backend import get_array_module
from app.engine.runtime.parallel import matmul, parallel_map, product_row_blocks


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

    Every output row depends on its input row only, so blocks of rows run on the engine's
    threads with their LoRA branch (its skinny GEMMs, rank columns, run at a fraction of the
    BLAS rate: serial, they were a fifth of a small model's step).
    """
    xp = get_array_module(x, w)
    base_in = x if x_base is None else x_base
    t, n_out = x.shape[0], w.shape[0]
    y = xp.empty((t, n_out), xp.result_type(base_in.dtype, w.dtype))  # (T, out)
    xa = None
    if lora is not None:
        a, b, scale = lora
        xa = xp.empty((t, a.shape[0]), xp.result_type(x.dtype, a.dtype))  # (T, R)

    def rows(r: slice) -> None:
        xp.matmul(base_in[r], w.T, out=y[r])                      # (t_r, out)
        if bias is not None:
            y[r] += bias
        if lora is not None:
            xl = x[r] if dropout_mask is None else x[r] * dropout_mask[r]
            xp.matmul(xl, a.T, out=xa[r])                          # (t_r, R)
            y[r] += (scale * xa[r]) @ b.T                          # scaled on the rank side
    parallel_map(rows, product_row_blocks(t, x.shape[1], n_out, xp), xp)
    return y, LinearCache(x, w, bias is not None, lora, xa, dropout_mask)


def linear_backward(dout, cache, need_dw: bool):
    """dout: (T, out) -> (dx (T, in), dw (out, in) or None, dbias (out,) or None, (dA, dB) or None).

    dW = dout^T x only when need_dw: a frozen base weight gets no gradient (and nothing of its
    size is allocated). The base weight is only read through dout @ W. LoRA: with dB_ = dout B
    (T, R), dx += s dB_ A (times the dropout mask), dA = s dB_^T (x * mask) (R, in),
    dB = s dout^T xa (out, R); B @ A is never formed.

    dx and dB_ follow the rows (blocks of rows on the engine's threads, as in forward); the
    products that sum over the tokens (dW, dA, dB) run after them, dA beside dB.
    """
    x, w, lora, xa, mask = cache.x, cache.w, cache.lora, cache.xa, cache.mask
    xp = get_array_module(dout, w)
    t, n_in = x.shape
    blocks = product_row_blocks(t, dout.shape[1], n_in, xp)
    dx = xp.empty((t, w.shape[1]), xp.result_type(dout.dtype, w.dtype))  # (T, in)
    dxa = None
    if lora is not None:
        a, b, scale = lora
        dxa = xp.empty((t, a.shape[0]), xp.result_type(dout.dtype, b.dtype))  # (T, R)

    def rows(r: slice) -> None:
        xp.matmul(dout[r], w, out=dx[r])                           # (t_r, in)
        if lora is not None:
            dxa_r = dxa[r]
            xp.matmul(dout[r], b, out=dxa_r)
            dxa_r *= scale                                         # (t_r, R)
            dxl = dxa_r @ a                                        # (t_r, in)
            dx[r] += dxl if mask is None else dxl * mask[r]
    parallel_map(rows, blocks, xp)
    dw = matmul(dout.T, x) if need_dw else None                   # (out, in)
    dbias = dout.sum(0) if cache.has_bias else None                # (out,)
    dlora = None
    if lora is not None:
        xl = x if mask is None else x * mask
        products = (lambda: dxa.T @ xl,                            # (R, in)
                    lambda: scale * (dout.T @ xa))                 # (out, R)
        dlora = tuple(parallel_map(lambda product: product(), products,
                                   xp) if len(blocks) > 1 else (p() for p in products))
    return dx, dw, dbias, dlora
