"""Causal self-attention with GQA and an optional sliding window, one layer at a time."""

from __future__ import annotations

from app.engine.backend import get_array_module


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
    """
    xp = get_array_module(q)
    tq, n_head, _ = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    qg = q.reshape(tq, n_kv, group, -1).transpose(1, 2, 0, 3)        # (Hkv, G, Tq, D)
    kt = k.transpose(1, 2, 0)[:, None]                                # (Hkv, 1, D, Tk)
    scores = (qg @ kt) * scale + mask.astype(q.dtype)                 # (Hkv, G, Tq, Tk)
    scores -= scores.max(-1, keepdims=True)
    probs = xp.exp(scores)
    probs /= probs.sum(-1, keepdims=True)                             # (Hkv, G, Tq, Tk)
    out = probs @ v.transpose(1, 0, 2)[:, None]                       # (Hkv, G, Tq, Dv)
    out = out.transpose(2, 0, 1, 3).reshape(tq, n_head, -1)           # (Tq, H, Dv)
    return out, (q, k, v, probs, scale)
