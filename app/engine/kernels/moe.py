"""Mixture-of-Experts routing, sort-by-expert dispatch, per-expert FFNs and the weighted combine,
with their backward passes.

The token slots (T*K of them) are sorted by expert once per layer (stable argsort), so every
expert runs one GEMM on a contiguous block of rows; the combine un-permutes with the inverse
order and sums over the K slots of each token (ARCHITECTURE.md, performance notes). Backward
reuses the same order: the expert-weight gradient is the scattered outer product of llama.cpp's
OUT_PROD_ID, dW[e] = dYs[seg_e]^T @ Xs[seg_e], written per segment into an (E, out, in) array,
and dX un-permutes with the inverse order and a reshape-sum over the K slots (never np.add.at).

Every pass over the T*K slots (the gather of the sorted inputs, the combine, the un-permute and
their backward) runs on the engine's threads in blocks of rows: each block writes its own rows,
so the results do not depend on the thread count. Frozen quantized experts are read through the
views' `tile(e, slot)` when they have one: the cache's array, or this thread's reused buffer
(app.engine.model.weights), one slot per projection.

Training path (forward with cache, then backward)::

    selected, weights, rcache = router_forward(logits, k, renorm, scale)
    order, offsets, token_of = dispatch_order(selected, n_expert)
    ys, ecache = experts_forward_train(x, order, offsets, token_of, wg, wu, wd, act, loras)
    out, ccache = combine_forward(ys, order, weights)
    ...
    dys, dweights = combine_backward(dout, ccache)
    dx, dws, dloras = experts_backward(dys, ecache, need_dw)
    dlogits = router_backward(dweights, rcache)
"""

from __future__ import annotations

from typing import Any, NamedTuple

from app.engine.runtime.backend import get_array_module
from app.engine.runtime.bf16 import product
from app.engine.kernels.activations import gelu_tanh, gelu_tanh_grad, glu_forward, sigmoid
from app.engine.kernels.linear import linear_forward
from app.engine.runtime.parallel import parallel_map, row_blocks

RENORM_MIN = 6.1035e-5  # llama.cpp clamps the top-k weight sum from below (build_moe_ffn)


class RouterCache(NamedTuple):
    """What router_backward needs: probs (T, E), selected (T, K), total (T, 1) or None,
    clamped (T, 1) bool or None (both None without renormalisation), weight_scale."""

    probs: Any
    selected: Any
    total: Any
    clamped: Any
    weight_scale: float


class ExpertsCache(NamedTuple):
    """What experts_backward needs: the input's shape (T, C), order (T*K,), offsets (E+1,) host
    ints, the sorted inputs xs (T*K, C), pre-activations g, u (T*K, F), the weights (gate, up
    (E, F, C), down (E, C, F)), act, per projection the LoRA or None and its rank activations
    (T*K, R) or None, inverse (T*K,) the sorted position of each slot. Not h = act(g) * u:
    backward recomputes it."""

    x_shape: tuple[int, int]
    order: Any
    offsets: list[int]
    xs: Any
    g: Any
    u: Any
    weights: tuple[Any, Any, Any]
    act: str
    loras: tuple[Any, Any, Any]
    lora_acts: tuple[Any, Any, Any]
    inverse: Any


class CombineCache(NamedTuple):
    """What combine_backward needs: the expert outputs in slot order (T*K, C), order (T*K,),
    weights (T, K)."""

    unsorted: Any
    order: Any
    weights: Any


def softmax(x, axis=-1):
    xp = get_array_module(x)
    e = xp.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


# ---- router ------------------------------------------------------------------------------------

def router_forward(logits, k: int, renorm: bool, weight_scale: float):
    """logits: (T, E) -> selected experts (T, K) int64, their weights (T, K), cache.

    softmax over all experts, top-k (the selection is a constant for the gradient), optional
    renormalisation of the k weights by max(sum, RENORM_MIN), optional scale.
    Cache: RouterCache.
    """
    xp = get_array_module(logits)
    probs = softmax(logits)                                             # (T, E)
    selected = xp.argsort(-probs, axis=-1, kind="stable")[:, :k]        # (T, K)
    weights = xp.take_along_axis(probs, selected, axis=-1)              # (T, K)
    total = clamped = None
    if renorm:
        raw = weights.sum(-1, keepdims=True)                            # (T, 1)
        clamped = raw < RENORM_MIN                                      # (T, 1) constant sum
        total = xp.maximum(raw, RENORM_MIN)                             # (T, 1)
        weights = weights / total
    if weight_scale not in (0.0, 1.0):
        weights = weights * weight_scale
    return selected, weights, RouterCache(probs, selected, total, clamped, weight_scale)


def router_backward(dweights, cache):
    """dweights: (T, K) -> dlogits (T, E), through scale, renorm (with its clamp), the top-k
    gather (selection constant) and the softmax over all experts."""
    probs, selected, total = cache.probs, cache.selected, cache.total
    xp = get_array_module(dweights)
    dw = dweights
    if cache.weight_scale not in (0.0, 1.0):
        dw = dw * cache.weight_scale                                    # (T, K)
    if total is not None:
        w = xp.take_along_axis(probs, selected, axis=-1) / total        # (T, K) renormed weights
        # d(w0 / S) with S = sum(w0): (dw - <dw, w>) / S; with S clamped (a constant): dw / S
        proj = (dw * w).sum(-1, keepdims=True)                          # (T, 1)
        dw = (dw - xp.where(cache.clamped, 0.0, proj)) / total          # (T, K)
    dprobs = xp.zeros_like(probs)                                       # (T, E)
    xp.put_along_axis(dprobs, selected, dw.astype(probs.dtype, copy=False), axis=-1)
    return probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True))   # (T, E)


def dispatch_order(selected, n_expert: int):
    """Sort the T*K token slots by expert.

    Returns order (T*K,) slot indices sorted by expert, offsets (E+1,) segment bounds in that
    order, and token_of (T*K,) the token each sorted slot reads.
    """
    xp = get_array_module(selected)
    k = selected.shape[1]
    flat = selected.reshape(-1)                                         # (T*K,)
    order = xp.argsort(flat, kind="stable")                             # (T*K,)
    counts = xp.bincount(flat, minlength=n_expert)                      # (E,)
    offsets = xp.concatenate([xp.zeros(1, dtype=counts.dtype), xp.cumsum(counts)])
    return order, offsets, order // k


def inverse_order(order):
    """order (T*K,) sorted position -> slot; returns (T*K,) slot -> sorted position."""
    xp = get_array_module(order)
    inverse = xp.empty_like(order)
    inverse[order] = xp.arange(len(order), dtype=order.dtype)
    return inverse


def gather_rows(src, index, out=None):
    """out[i] = src[index[i]]: (N, C) rows of src (M, C), in row blocks on the engine's threads."""
    xp = get_array_module(src)
    if out is None:
        out = xp.empty((len(index), src.shape[1]), src.dtype)
    parallel_map(lambda r: xp.take(src, index[r], axis=0, out=out[r]), row_blocks(len(index)), xp)
    return out


def _token_blocks(n_tokens: int, k: int) -> list[tuple[slice, slice]]:
    """(token rows, their K slots each) blocks for work split by token."""
    return [(r, slice(r.start * k, r.stop * k)) for r in row_blocks(n_tokens)]


# ---- experts -----------------------------------------------------------------------------------

def _expert(w, e: int, slot: int):
    """Expert e of w (E, out, in): through the view's reused buffer `slot` when it has one."""
    return w.tile(e, slot) if hasattr(w, "tile") else w[e]

def busiest_first(offsets) -> list[int]:
    """Experts that received tokens, most slots first (offsets: host list (E+1,)): the order
    in which the engine's threads take them, so the long ones do not come last."""
    counts = [(offsets[e + 1] - offsets[e], e) for e in range(len(offsets) - 1)]
    return [e for n, e in sorted(counts, reverse=True) if n]


def experts_forward(x, order, offsets, token_of, w_gate, w_up, w_down, act: str, loras=(None,) * 3,
                    base_inputs=(None,) * 3):
    """x: (T, C) -> per-slot expert outputs in sorted order (T*K, C). Inference path (GeGLU uses
    ggml's fp16 GELU table, like llama.cpp); training uses experts_forward_train.

    w_gate/w_up: (E, F, C), w_down: (E, C, F), each indexable by expert (a lazily dequantizing
    view works). loras: per projection (A (E, R, in), B (E, out, R), scale) or None.
    base_inputs: per projection a row-wise function giving what its base weight multiplies
    (llama.cpp's rounded activations, Params.base_input; the LoRA branch reads the rows as
    they are), or None.
    """
    xp = get_array_module(x)
    xs = gather_rows(x, token_of)                                       # (T*K, C)
    ys = xp.zeros_like(xs)                                              # (T*K, C)
    host_offsets = [int(o) for o in offsets]
    fg, fu, fd = base_inputs
    xg, xu = (xs if f is None else f(x)[token_of] for f in (fg, fu))    # (T*K, C) each

    def run(e: int) -> None:
        lo, hi = host_offsets[e], host_offsets[e + 1]
        lg, lu, ld = (None if l is None else (l[0][e], l[1][e], l[2]) for l in loras)
        g, _ = linear_forward(xs[lo:hi], _expert(w_gate, e, 0), lora=lg, x_base=xg[lo:hi])
        u, _ = linear_forward(xs[lo:hi], _expert(w_up, e, 1), lora=lu, x_base=xu[lo:hi])
        h, _ = glu_forward(act, g, u)                                   # (n_e, F)
        ys[lo:hi], _ = linear_forward(h, _expert(w_down, e, 2), lora=ld,
                                      x_base=None if fd is None else fd(h))     # (n_e, C)
    parallel_map(run, busiest_first(host_offsets), xp)
    return ys


def _glu_act(act: str, g):
    """Training gate activation a(g) (n, F): SiLU, or the exact tanh-GELU for any other act."""
    return g * sigmoid(g) if act == "silu" else gelu_tanh(g)


def _glu_grads(act: str, g, u, dh):
    """h = a(g) * u: returns (h, dg, du) for the upstream dh (all (n, F)).

    Same math as activations.swiglu_backward / geglu_backward (exact GELU), fused with the
    recomputation of h and done in place: backward needs h for dW_down and the down LoRA."""
    if act == "silu":
        s = sigmoid(g)                                                  # (n, F)
        a = g * s                                                       # silu(g)
        da = s * (1.0 + g * (1.0 - s))                                  # silu'(g)
    else:
        a, da = gelu_tanh(g), gelu_tanh_grad(g)                         # (n, F)
    du = dh * a                                                         # (n, F)
    da *= dh
    da *= u                                                             # dg
    a *= u                                                              # h
    return a, da, du


def experts_forward_train(x, order, offsets, token_of, w_gate, w_up, w_down, act: str,
                          loras=(None,) * 3):
    """Training forward of the expert block: like experts_forward, returns (ys (T*K, C), cache).

    act: "silu" (SwiGLU) or anything else for GeGLU with the exact tanh GELU (differentiable; the
    inference path uses ggml's fp16 table). Cache: ExpertsCache, h recomputed from g, u in
    backward. Frozen expert weights are read one expert at a time.
    """
    xp = get_array_module(x)
    n_slots, c = token_of.shape[0], x.shape[1]
    f = w_gate.shape[1]
    dtype = x.dtype
    xs = gather_rows(x, token_of)                                       # (T*K, C)
    g_all = xp.empty((n_slots, f), dtype)                               # (T*K, F)
    u_all = xp.empty((n_slots, f), dtype)                               # (T*K, F)
    ys = xp.empty((n_slots, c), dtype)                                  # (T*K, C)
    lora_acts = tuple(None if l is None else xp.empty((n_slots, l[0].shape[1]), dtype)
                      for l in loras)                                   # (T*K, R) each
    host_offsets = offsets.tolist()

    def run(e: int) -> None:
        lo, hi = host_offsets[e], host_offsets[e + 1]
        xe = xs[lo:hi]                                                  # (n, C)
        ge, ue = g_all[lo:hi], u_all[lo:hi]
        product(xe, _expert(w_gate, e, 0), True, ge, xp)                # (n, F)
        product(xe, _expert(w_up, e, 1), True, ue, xp)                  # (n, F)
        for (lora, acts, out) in ((loras[0], lora_acts[0], ge), (loras[1], lora_acts[1], ue)):
            if lora is not None:
                xa = xp.matmul(xe, lora[0][e].T, out=acts[lo:hi])       # (n, R)
                out += (lora[2] * xa) @ lora[1][e].T                    # (n, F)
        a = _glu_act(act, ge)                                           # (n, F)
        a *= ue                                                         # h (n, F)
        ye = product(a, _expert(w_down, e, 2), True, ys[lo:hi], xp)     # (n, C)
        if loras[2] is not None:
            ha = xp.matmul(a, loras[2][0][e].T, out=lora_acts[2][lo:hi])  # (n, R)
            ye += (loras[2][2] * ha) @ loras[2][1][e].T                 # (n, C)
    parallel_map(run, busiest_first(host_offsets), xp)
    cache = ExpertsCache(x.shape, order, host_offsets, xs, g_all, u_all, (w_gate, w_up, w_down),
                         act, tuple(loras), lora_acts, inverse_order(order))
    return ys, cache


def experts_backward(dys, cache, need_dw=(False, False, False), dw_out=None):
    """dys: (T*K, C) in sorted order -> (dx (T, C), dWs, dloras).

    need_dw: one bool per projection (gate, up, down), or one bool for all three.
    dWs: per projection the weight gradient (E, out, in) when need_dw[i], else None (a frozen,
    possibly quantized expert stack gets nothing of its size allocated). dW[e] is the scattered
    outer product dYs[seg_e]^T @ Xs[seg_e] (OUT_PROD_ID), one GEMM per expert segment.
    dw_out: optional per projection preallocated (E, out, in) arrays (or None) that the weight
    gradients are written into (overwritten) and returned: reusing them across steps avoids
    page-faulting three fresh E*out*in arrays per call, which costs about as much as the GEMMs.
    dloras: per projection (dA (E, R, in), dB (E, out, R)) when that projection has a LoRA,
    else None. Experts that received no token get zero gradients.
    """
    xp = get_array_module(dys)
    if isinstance(need_dw, bool):
        need_dw = (need_dw,) * 3
    dw_out = (None,) * 3 if dw_out is None else dw_out
    xs, g_all, u_all, act = cache.xs, cache.g, cache.u, cache.act
    weights, loras, lora_acts = cache.weights, cache.loras, cache.lora_acts
    offs, order = cache.offsets, cache.order
    t, c = cache.x_shape
    n_expert = len(offs) - 1
    dtype = xs.dtype
    dws = []
    for w, need, out in zip(weights, need_dw, dw_out):
        if need and out is None:
            out = xp.zeros((n_expert, *w.shape[1:]), dtype)             # (E, out, in)
        dws.append(out if need else None)
    dws = tuple(dws)
    dloras = tuple(None if l is None else (xp.zeros(l[0].shape, dtype), xp.zeros(l[1].shape, dtype))
                   for l in loras)                                      # (E, R, in), (E, out, R)
    dxs = xp.empty_like(xs)                                             # (T*K, C) sorted
    w_gate, w_up, w_down = weights

    for e in range(n_expert):
        if offs[e] == offs[e + 1]:
            for dw in dws:
                if dw is not None:
                    dw[e] = 0.0                                         # a reused dw_out buffer

    def run(e: int) -> None:
        lo, hi = offs[e], offs[e + 1]
        dy, xe = dys[lo:hi], xs[lo:hi]                                  # (n, C)
        # down projection: y = h Wd^T + s (h Ad^T) Bd^T
        wd = _expert(w_down, e, 2)                                      # (C, F)
        dh = product(dy, wd, False, xp=xp)                              # (n, F)
        if loras[2] is not None:
            a_d, b_d, s_d = loras[2][0][e], loras[2][1][e], loras[2][2]
            dha = dy @ b_d                                              # (n, R)
            dha *= s_d
            dh += dha @ a_d                                             # (n, F)
        h, dg, du = _glu_grads(act, g_all[lo:hi], u_all[lo:hi], dh)    # (n, F)
        if dws[2] is not None:
            xp.matmul(dy.T, h, out=dws[2][e])                           # (C, F)
        if loras[2] is not None:
            xp.matmul(dha.T, h, out=dloras[2][0][e])                    # (R, F)
            xp.matmul(dy.T, lora_acts[2][lo:hi], out=dloras[2][1][e])   # (C, R)
            dloras[2][1][e] *= s_d
        # gate and up projections: dx = dg Wg + du Wu (+ LoRA terms)
        dxe = product(dg, _expert(w_gate, e, 0), False, dxs[lo:hi], xp)  # (n, C)
        dxe += product(du, _expert(w_up, e, 1), False, xp=xp)           # (n, C)
        for i, dz in ((0, dg), (1, du)):
            if dws[i] is not None:
                xp.matmul(dz.T, xe, out=dws[i][e])                      # (F, C)
            if loras[i] is not None:
                a_i, b_i, s_i = loras[i][0][e], loras[i][1][e], loras[i][2]
                dza = dz @ b_i                                          # (n, R)
                dza *= s_i
                dxe += dza @ a_i                                        # (n, C)
                xp.matmul(dza.T, xe, out=dloras[i][0][e])               # (R, C)
                xp.matmul(dz.T, lora_acts[i][lo:hi], out=dloras[i][1][e])  # (F, R)
                dloras[i][1][e] *= s_i
    parallel_map(run, busiest_first(offs), xp)
    # un-permute to slot order (t * K + k) and sum the K slots of each token
    k = len(dxs) // max(t, 1)
    dx = xp.empty((t, c), dtype)                                        # (T, C)

    def unpermute(rows: slice, slots: slice) -> None:
        dx[rows] = xp.take(dxs, cache.inverse[slots], axis=0).reshape(-1, k, c).sum(1)
    parallel_map(lambda b: unpermute(*b), _token_blocks(t, k), xp)
    return dx, dws, dloras


# ---- combine -----------------------------------------------------------------------------------

def combine_forward(ys, order, weights):
    """ys: (T*K, C) in sorted order, weights (T, K) -> ((T, C) = sum_k w_k * y_k, CombineCache)."""
    xp = get_array_module(ys)
    t, k = weights.shape
    c = ys.shape[1]
    inverse = inverse_order(order)
    unsorted = xp.empty_like(ys)                                        # (T*K, C) slot order
    out = xp.empty((t, c), xp.result_type(ys.dtype, weights.dtype))     # (T, C)

    def run(rows: slice, slots: slice) -> None:
        u = xp.take(ys, inverse[slots], axis=0, out=unsorted[slots])    # (n*K, C)
        out[rows] = (u.reshape(-1, k, c) * weights[rows, :, None]).sum(1)
    parallel_map(lambda b: run(*b), _token_blocks(t, k), xp)
    return out, CombineCache(unsorted, order, weights)


def combine(ys, order, weights):
    """ys: (T*K, C) in sorted order, weights (T, K) -> (T, C) = sum_k w_k * y_k."""
    return combine_forward(ys, order, weights)[0]


def combine_backward(dout, cache):
    """dout: (T, C) -> (dys (T*K, C) in sorted order, dweights (T, K))."""
    unsorted, order, weights = cache.unsorted, cache.order, cache.weights
    xp = get_array_module(dout)
    t, k = weights.shape
    c = dout.shape[1]
    dweights = xp.empty((t, k), xp.result_type(unsorted.dtype, dout.dtype))     # (T, K)
    dslots = xp.empty((t * k, c), xp.result_type(dout.dtype, weights.dtype))    # (T*K, C)

    def run(rows: slice, slots: slice) -> None:
        y3 = unsorted[slots].reshape(-1, k, c)                          # (n, K, C)
        dweights[rows] = (y3 @ dout[rows, :, None])[:, :, 0]            # (n, K)
        dslots[slots].reshape(-1, k, c)[...] = dout[rows, None, :] * weights[rows, :, None]
    parallel_map(lambda b: run(*b), _token_blocks(t, k), xp)
    return gather_rows(dslots, order), dweights                        # sorted (T*K, C)
