"""Causal self-attention with GQA and an optional sliding window, one layer at a time.

The forward keeps no (Tq, Tk) probabilities in its cache: only q, k, v, the mask it was given,
the scale, the output and the per-row log-sum-exp. The backward recomputes the probabilities one
kv head at a time (flash-attention style), so training never holds more than one layer's
probabilities alive.
"""

from __future__ import annotations

from app.engine.backend import get_array_module
from app.engine.parallel import parallel_map


def attention_mask(xp, q_pos, k_pos, window: int = 0):
    """Additive mask (Tq, Tk): -inf where key j is in the future or (with a window) i - j >= window."""
    diff = q_pos[:, None] - k_pos[None, :]               # (Tq, Tk)
    blocked = diff < 0
    if window > 0:
        blocked |= diff >= window
    return xp.where(blocked, -xp.inf, 0.0)


def attention_forward(q, k, v, scale: float, mask):
    """q: (Tq, H, D), k: (Tk, Hkv, D), v: (Tk, Hkv, Dv), mask: (Tq, Tk) -> out (Tq, H, Dv).

    Query head h reads kv head h // (H / Hkv) (contiguous groups, as ggml broadcasts).
    Cache: (q, k, v, mask, scale, out, lse (Hkv, G, Tq)); `mask` and `out` are references to the
    caller's arrays, not copies, so they must not be modified in place before the backward.
    """
    xp = get_array_module(q)
    tq, n_head, _ = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    mask = mask.astype(q.dtype, copy=False)                           # (Tq, Tk)
    out = xp.empty((tq, n_head, v.shape[2]), q.dtype)                 # (Tq, H, Dv)
    lse = xp.empty((n_kv, group, tq), q.dtype)                        # (Hkv, G, Tq)

    def kv_head(j: int) -> None:
        heads = slice(j * group, (j + 1) * group)
        qj = q[:, heads].transpose(1, 0, 2)                           # (G, Tq, D)
        scores = (qj @ k[:, j].T) * scale + mask                      # (G, Tq, Tk)
        row_max = scores.max(-1, keepdims=True)                       # (G, Tq, 1)
        scores -= row_max
        probs = xp.exp(scores, out=scores)
        row_sum = probs.sum(-1, keepdims=True)                        # (G, Tq, 1)
        probs /= row_sum                                              # (G, Tq, Tk)
        lse[j] = (row_max + xp.log(row_sum))[..., 0]                  # (G, Tq)
        out[:, heads] = (probs @ v[:, j]).transpose(1, 0, 2)          # (Tq, G, Dv)
    parallel_map(kv_head, range(n_kv), xp)
    return out, (q, k, v, mask, scale, out, lse)


def attention_backward(dout, cache):
    """dout: (Tq, H, Dv) -> (dq (Tq, H, D), dk (Tk, Hkv, D), dv (Tk, Hkv, Dv)).

    P = exp(S - lse) is rebuilt per kv head; with D_i = sum_d dO_id O_id,
    dS = P * (dO V^T - D), dq = scale dS K, dk = scale dS^T Q and dv = P^T dO, each summed over
    the G query heads that share a kv head. Peak extra memory: two (G, Tq, Tk) buffers.
    """
    q, k, v, mask, scale, out, lse = cache
    xp = get_array_module(q)
    tq, n_head, _ = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    mask = mask.astype(q.dtype, copy=False)                           # (Tq, Tk)
    delta = (dout * out).sum(-1)                                      # (Tq, H)
    dq, dk, dv = xp.empty_like(q), xp.empty_like(k), xp.empty_like(v)

    def kv_head(j: int) -> None:
        heads = slice(j * group, (j + 1) * group)
        qj = q[:, heads].transpose(1, 0, 2)                           # (G, Tq, D)
        doj = dout[:, heads].transpose(1, 0, 2)                       # (G, Tq, Dv)
        kj, vj = k[:, j], v[:, j]                                     # (Tk, D), (Tk, Dv)
        p = (qj @ kj.T) * scale + mask                                # (G, Tq, Tk)
        p -= lse[j][..., None]
        xp.exp(p, out=p)                                              # (G, Tq, Tk) probabilities
        dv[:, j] = (p.transpose(0, 2, 1) @ doj).sum(0)                # (Tk, Dv)
        ds = doj @ vj.T                                               # (G, Tq, Tk) dP
        ds -= delta[:, heads].T[..., None]
        ds *= p                                                       # (G, Tq, Tk) dS / scale
        del p
        dq[:, heads] = ((ds @ kj) * scale).transpose(1, 0, 2)         # (Tq, G, D)
        dk[:, j] = (ds.transpose(0, 2, 1) @ qj).sum(0) * scale        # (Tk, D)
        del ds
    parallel_map(kv_head, range(n_kv), xp)
    return dq, dk, dv
