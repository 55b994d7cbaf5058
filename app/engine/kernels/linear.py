"""Linear layers with an optional LoRA term: y = x W^T (+ b) + s * (x A^T) B^T.

A weight may come as a Bf16Weight (--precision bf16): its two products, x W^T and dY W, then
run in bf16 with float32 accumulation (app.engine.runtime.bf16.product), and so does a trained
weight's gradient dW = dY^T x (the bf16 copy of a float32 master: Params.base_weight); the LoRA
branch, the bias and the LoRA gradients stay float32.

Every output row depends on its input row only, so a layer runs as blocks of rows on the
engine's threads (`product_row_blocks`), with its LoRA branch inside each block: the branch's
skinny GEMMs (rank columns) run at a fraction of the BLAS rate and, serial, were a fifth of a
small model's step. Layers that read the same input (attention's q, k and v; the FFN's gate
and up) run as one group: the pieces of all of them in one parallel section, because each
section costs the engine's other thread a wake-up (about 50 us on the development VM, for
pieces of 0.3-1.5 ms at context 256). In backward the LoRA gradients, which sum over the
tokens, are summed from per-block parts in block order, inside the same pieces.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from app.engine.runtime.backend import get_array_module
from app.engine.runtime.bf16 import is_packed, matmul as bf16_matmul, pack, product
from app.engine.runtime.parallel import (parallel_map, product_column_blocks,
                                         product_row_blocks)


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


class Linear(NamedTuple):
    """One layer of a group for linear_forward_group: w (out, in), bias (out,) or None, lora
    (A (R, in), B (out, R), scale) or None, dropout_mask (T, in) or None, x_base (T, in) or
    None (the arguments of linear_forward)."""

    w: Any
    bias: Any = None
    lora: Any = None
    dropout_mask: Any = None
    x_base: Any = None


def linear_forward(x, w, bias=None, lora=None, dropout_mask=None, x_base=None):
    """x: (T, in), w: (out, in), bias: (out,), lora: (A (R, in), B (out, R), scale) or None.

    The LoRA product is bracketed as (x A^T) B^T, never B @ A: rank R is small.
    dropout_mask: (T, in) LoRA dropout on the LoRA branch's input only, already scaled by
    1/(1-p) (0 where dropped), or None.
    x_base: (T, in) what the base product reads instead of x, or None (inference only:
    llama.cpp's rounded activations, app.engine.model.params.Params.base_input); the cache keeps x.
    Cache: LinearCache with xa = (x * mask) A^T (T, R) kept for dB.
    """
    return linear_forward_group(x, [Linear(w, bias, lora, dropout_mask, x_base)])[0]


def linear_forward_group(x, layers: Sequence[Linear]) -> list[tuple[Any, LinearCache]]:
    """Layers that read the same x (T, in), as linear_forward each: [(y (T, out), cache)], their
    blocks of rows in one parallel section (the widest layer's first)."""
    xp = get_array_module(x, *(layer.w for layer in layers))
    t, n_in = x.shape
    base_ins = [x if layer.x_base is None else layer.x_base for layer in layers]  # (T, in)
    ys, xas, pieces = [], [], []
    for i, (layer, base_in) in enumerate(zip(layers, base_ins)):
        ys.append(xp.empty((t, layer.w.shape[0]), xp.result_type(base_in.dtype,
                                                                  layer.w.dtype)))  # (T, out)
        a = None if layer.lora is None else layer.lora[0]
        xas.append(None if a is None else xp.empty((t, a.shape[0]),
                                                   xp.result_type(x.dtype, a.dtype)))  # (T, R)
        pieces += [(i, r) for r in product_row_blocks(t, n_in, layer.w.shape[0], xp)]

    def rows(piece: tuple[int, slice]) -> None:
        i, r = piece
        layer, y, xa = layers[i], ys[i], xas[i]
        product(base_ins[i][r], layer.w, True, y[r], xp)             # (t_r, out)
        if layer.bias is not None:
            y[r] += layer.bias
        if layer.lora is not None:
            a, b, scale = layer.lora
            xl = x[r] if layer.dropout_mask is None else x[r] * layer.dropout_mask[r]
            xp.matmul(xl, a.T, out=xa[r])                            # (t_r, R)
            y[r] += (scale * xa[r]) @ b.T                            # scaled on the rank side
    pieces.sort(key=lambda piece: -layers[piece[0]].w.shape[0])
    parallel_map(rows, pieces, xp)
    return [(y, LinearCache(x, layer.w, layer.bias is not None, layer.lora, xa, layer.dropout_mask))
            for layer, y, xa in zip(layers, ys, xas)]


def linear_backward(dout, cache, need_dw: bool):
    """dout: (T, out) -> (dx (T, in), dw (out, in) or None, dbias (out,) or None, (dA, dB) or None).

    dW = dout^T x only when need_dw: a frozen base weight gets no gradient (and nothing of its
    size is allocated). The base weight is only read through dout @ W. LoRA: with dB_ = dout B
    (T, R), dx += s dB_ A (times the dropout mask), dA = s dB_^T (x * mask) (R, in),
    dB = s dout^T xa (out, R); B @ A is never formed.
    """
    dx, (grads,) = linear_backward_group([dout], [cache], [need_dw])
    return (dx, *grads)


def linear_backward_group(douts: Sequence, caches: Sequence[LinearCache],
                          need_dws: Sequence[bool]):
    """The backward of a group of layers that read the same x: (dx (T, in), the sum of the
    layers' input gradients in their order, [(dw, dbias, dlora) per layer] as linear_backward).

    Pieces: (layer, block of rows), all in one parallel section. Each computes its rows of the
    layer's dx and dB_, and its block's parts of dA and dB (K = the block's rows); the parts are
    summed in block order afterwards, so with one block (small products, one thread) the calls
    are linear_backward's single products. dW (full fine-tuning) comes in matmul's column
    blocks, pieces of the same section."""
    xp = get_array_module(douts[0], *(cache.w for cache in caches))
    t, n_in = caches[0].x.shape
    dxs, dws, blocks, parts, pieces = [], [], [], [], []
    for i, (dout, cache, need_dw) in enumerate(zip(douts, caches, need_dws)):
        dxs.append(xp.empty((t, n_in), xp.result_type(dout.dtype, cache.w.dtype)))  # (T, in)
        blocks.append(product_row_blocks(t, dout.shape[1], n_in, xp))
        parts.append([None] * len(blocks[i]))        # per block: (dA part, dB part) or None
        pieces += [(i, b) for b in range(len(blocks[i]))]
        dws.append(None)
        if need_dw:                                  # (out, in) in column blocks
            dws[i] = xp.empty((dout.shape[1], n_in), xp.result_type(dout.dtype, cache.x.dtype))
            pieces += [(i, cols) for cols in product_column_blocks(dout.shape[1], t, n_in, xp)]

    def piece_of(piece: tuple[int, int | slice]) -> None:
        i, where = piece
        if isinstance(where, slice):                 # columns of dW = dout^T x
            if is_packed(caches[i].w):               # bf16: x's columns packed as the operand
                bf16_matmul(douts[i].T, pack(caches[i].x[:, where], caches[i].w.backend),
                            False, out=dws[i][:, where])
            else:
                xp.matmul(douts[i].T, caches[i].x[:, where], out=dws[i][:, where])
            return
        rows(i, where)

    def rows(i: int, block: int) -> None:
        r, dout, cache = blocks[i][block], douts[i], caches[i]
        dx = dxs[i][r]                                                 # (t_r, in)
        product(dout[r], cache.w, False, dx, xp)
        if cache.lora is not None:
            a, b, scale = cache.lora
            dxa = dout[r] @ b
            dxa *= scale                                               # (t_r, R)
            dxl = dxa @ a                                              # (t_r, in)
            mask = None if cache.mask is None else cache.mask[r]
            dx += dxl if mask is None else dxl * mask
            xl = cache.x[r] if mask is None else cache.x[r] * mask
            parts[i][block] = (dxa.T @ xl,                             # (R, in)
                               dout[r].T @ cache.xa[r])                # (out, R), unscaled
    pieces.sort(key=lambda piece: -douts[piece[0]].shape[1])
    parallel_map(piece_of, pieces, xp)
    grads = []
    for dout, cache, dw, layer_parts in zip(douts, caches, dws, parts):
        dbias = dout.sum(0) if cache.has_bias else None                # (out,)
        dlora = None
        if cache.lora is not None:
            da, db = (_sum_in_order([p[k] for p in layer_parts]) for k in (0, 1))
            dlora = (da, cache.lora[2] * db)                           # (R, in), (out, R)
        grads.append((dw, dbias, dlora))
    return _sum_in_order(dxs), grads


def _sum_in_order(arrays: list):
    """arrays[0] + arrays[1] + ..., in order (the first itself when alone)."""
    total = arrays[0]
    for more in arrays[1:]:
        total = total + more
    return total
