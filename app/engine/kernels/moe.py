"""Mixture-of-Experts routing, sort-by-expert dispatch, per-expert FFNs and the weighted combine.

The token slots (T*K of them) are sorted by expert once per layer (stable argsort), so every
expert runs one GEMM on a contiguous block of rows; the combine un-permutes with the inverse
order and sums over the K slots of each token (ARCHITECTURE.md, performance notes).
"""

from __future__ import annotations

from app.engine.backend import get_array_module
from app.engine.kernels.activations import glu_forward
from app.engine.kernels.linear import linear_forward

RENORM_MIN = 6.1035e-5  # llama.cpp clamps the top-k weight sum from below (build_moe_ffn)


def softmax(x, axis=-1):
    xp = get_array_module(x)
    e = xp.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def router_forward(logits, k: int, renorm: bool, weight_scale: float):
    """logits: (T, E) -> selected experts (T, K) int64 and their weights (T, K).

    softmax over all experts, top-k (the selection is a constant for the gradient), optional
    renormalisation of the k weights, optional scale.
    """
    xp = get_array_module(logits)
    probs = softmax(logits)                                             # (T, E)
    selected = xp.argsort(-probs, axis=-1, kind="stable")[:, :k]        # (T, K)
    weights = xp.take_along_axis(probs, selected, axis=-1)              # (T, K)
    total = None
    if renorm:
        total = xp.maximum(weights.sum(-1, keepdims=True), RENORM_MIN)  # (T, 1)
        weights = weights / total
    if weight_scale not in (0.0, 1.0):
        weights = weights * weight_scale
    return selected, weights, (probs, selected, total, weight_scale)


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


def experts_forward(x, order, offsets, token_of, w_gate, w_up, w_down, act: str, loras=(None,) * 3):
    """x: (T, C) -> per-slot expert outputs in sorted order (T*K, C).

    w_gate/w_up: (E, F, C), w_down: (E, C, F), each indexable by expert (a lazily dequantizing
    view works). loras: per projection (A (E, R, in), B (E, out, R), scale) or None.
    """
    xp = get_array_module(x)
    xs = x[token_of]                                                    # (T*K, C)
    ys = xp.zeros_like(xs)                                              # (T*K, C)
    host_offsets = [int(o) for o in offsets]
    for e in range(len(host_offsets) - 1):
        lo, hi = host_offsets[e], host_offsets[e + 1]
        if lo == hi:
            continue
        lg, lu, ld = (None if l is None else (l[0][e], l[1][e], l[2]) for l in loras)
        g, _ = linear_forward(xs[lo:hi], w_gate[e], lora=lg)            # (n_e, F)
        u, _ = linear_forward(xs[lo:hi], w_up[e], lora=lu)              # (n_e, F)
        h, _ = glu_forward(act, g, u)                                   # (n_e, F)
        ys[lo:hi], _ = linear_forward(h, w_down[e], lora=ld)            # (n_e, C)
    return ys


def combine(ys, order, weights):
    """ys: (T*K, C) in sorted order, weights (T, K) -> (T, C) = sum_k w_k * y_k."""
    xp = get_array_module(ys)
    t, k = weights.shape
    unsorted = xp.empty_like(ys)
    unsorted[order] = ys                                                # (T*K, C) slot order
    return (unsorted.reshape(t, k, -1) * weights[:, :, None]).sum(1)    # (T, C)
