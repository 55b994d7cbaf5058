"""Causal self-attention with GQA and an optional sliding window, one layer at a time.

The forward keeps no (Tq, Tk) probabilities in its cache: only q, k, v, the mask it was given,
the scale, the output and the per-row log-sum-exp. The backward recomputes the probabilities one
kv head at a time (flash-attention style), so training never holds more than one layer's
probabilities alive.

The work is cut into pieces for the engine's threads: kv heads times blocks of query rows
(at least MIN_PIECES pieces, blocks of about BLOCK_ROWS rows). A row block reads only the keys
its mask does not block for all its rows, so under a causal mask the early blocks skip the
future half of the square (and under a sliding window, the distant past). The backward sums a
kv head's dk and dv over its row blocks in block order. The split depends on the shapes and the
mask only, never on the thread count, so the results do not either.

On NumPy with compiled kernels on (app.engine.kernels.jit), the softmax between the two GEMMs of
a piece is one compiled kernel (scale, mask, max, exp, sum, divide and the log-sum-exp), and so
are the backward's probabilities and dS (app.engine.kernels.compiled_layers); the NumPy code
here is their twin.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from app.engine.kernels import compiled_layers
from app.engine.runtime.backend import get_array_module
from app.engine.runtime.parallel import parallel_map

MIN_PIECES = 4         # kv heads x query-row blocks per layer, at least (when rows allow)
BLOCK_ROWS = 128
MIN_BLOCK_ROWS = 64


class AttentionCache(NamedTuple):
    """What attention_backward needs: q (Tq, H, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), mask
    (Tq, Tk), out (Tq, H, Dv), lse (Hkv, G, Tq), and the forward's pieces (attention_pieces).
    `mask` and `out` are references to the caller's arrays, not copies, so they must not be
    modified in place before the backward."""

    q: Any
    k: Any
    v: Any
    mask: Any
    scale: float
    out: Any
    lse: Any
    pieces: list[tuple[int, int, slice, slice]]
    n_blocks: int


def attention_pieces(xp, n_kv: int, mask) -> tuple[list[tuple[int, int, slice, slice]], int]:
    """([(kv head, block index, query rows, keys they may read)], blocks per kv head).

    On CuPy one block of all rows and keys per kv head: the pieces run one after another there,
    and finding the keys would read the mask back to the host."""
    tq, tk = mask.shape
    blocks = row_block_count(n_kv, tq) if xp is np else 1
    step = -(-tq // blocks)
    rows = [slice(lo, min(lo + step, tq)) for lo in range(0, tq, step)]
    keys = [slice(0, tk)]
    if len(rows) > 1:
        readable = np.isfinite(mask)                                  # (Tq, Tk)
        keys = [_readable_keys(readable[r]) for r in rows]
    pieces = [(j, b, r, keys[b % len(keys)]) for j in range(n_kv) for b, r in enumerate(rows)]
    return pieces, len(rows)


def row_block_count(n_kv: int, n_rows: int) -> int:
    """Query-row blocks per kv head on the CPU: enough for MIN_PIECES pieces in all, about
    BLOCK_ROWS rows each, none under MIN_BLOCK_ROWS (one block when the rows are fewer)."""
    blocks = max(-(-MIN_PIECES // n_kv), n_rows // BLOCK_ROWS)
    return max(1, min(blocks, n_rows // MIN_BLOCK_ROWS))


def _readable_keys(readable) -> slice:
    """The span of keys that some row of `readable` (Tr, Tk) bool may read (all if none)."""
    cols = np.nonzero(readable.any(0))[0]
    return slice(int(cols[0]), int(cols[-1]) + 1) if cols.size else slice(0, readable.shape[1])


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
    Cache: AttentionCache.
    """
    xp = get_array_module(q)
    tq, n_head, _ = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    mask = mask.astype(q.dtype, copy=False)                           # (Tq, Tk)
    out = xp.empty((tq, n_head, v.shape[2]), q.dtype)                 # (Tq, H, Dv)
    lse = xp.empty((n_kv, group, tq), q.dtype)                        # (Hkv, G, Tq)
    fused = compiled_layers.runs_on(q, k, v, mask) and mask.flags.c_contiguous

    def piece(args) -> None:
        j, _, rows, keys = args
        heads = slice(j * group, (j + 1) * group)
        qj = q[rows, heads].transpose(1, 0, 2)                        # (G, Tr, D)
        if fused:
            probs = qj @ k[keys, j].T                                 # (G, Tr, Tk')
            compiled_layers.kernels().softmax_forward(probs, mask, rows.start, keys.start,
                                                      q.dtype.type(scale), lse[j], rows.start)
            out[rows, heads] = (probs @ v[keys, j]).transpose(1, 0, 2)
            return
        scores = (qj @ k[keys, j].T) * scale + mask[rows, keys]       # (G, Tr, Tk')
        row_max = scores.max(-1, keepdims=True)                       # (G, Tr, 1)
        scores -= row_max
        probs = xp.exp(scores, out=scores)
        row_sum = probs.sum(-1, keepdims=True)                        # (G, Tr, 1)
        probs /= row_sum                                              # (G, Tr, Tk)
        lse[j][:, rows] = (row_max + xp.log(row_sum))[..., 0]         # (G, Tr)
        out[rows, heads] = (probs @ v[keys, j]).transpose(1, 0, 2)    # (Tr, G, Dv)
    pieces, n_blocks = attention_pieces(xp, n_kv, mask)
    parallel_map(piece, pieces, xp)
    return out, AttentionCache(q, k, v, mask, scale, out, lse, pieces, n_blocks)


def attention_backward(dout, cache):
    """dout: (Tq, H, Dv) -> (dq (Tq, H, D), dk (Tk, Hkv, D), dv (Tk, Hkv, Dv)).

    P = exp(S - lse) is rebuilt per kv head; with D_i = sum_d dO_id O_id,
    dS = P * (dO V^T - D), dq = scale dS K, dk = scale dS^T Q and dv = P^T dO, each summed over
    the G query heads that share a kv head. Peak extra memory: two (G, Tr, Tk) buffers per
    thread.
    """
    q, k, v, scale, lse = cache.q, cache.k, cache.v, cache.scale, cache.lse
    xp = get_array_module(q)
    tq, n_head, _ = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    mask = cache.mask.astype(q.dtype, copy=False)                     # (Tq, Tk)
    delta = (dout * cache.out).sum(-1)                                # (Tq, H)
    dq = xp.empty_like(q)                                             # (Tq, H, D)
    dk_parts = xp.zeros((cache.n_blocks, *k.shape), k.dtype)          # (B, Tk, Hkv, D)
    dv_parts = xp.zeros((cache.n_blocks, *v.shape), v.dtype)          # (B, Tk, Hkv, Dv)
    fused = (compiled_layers.runs_on(q, k, v, mask, dout, lse, delta)
             and mask.flags.c_contiguous and lse.flags.c_contiguous)

    def piece(args) -> None:
        j, block, rows, keys = args
        heads = slice(j * group, (j + 1) * group)
        qj = q[rows, heads].transpose(1, 0, 2)                        # (G, Tr, D)
        doj = dout[rows, heads].transpose(1, 0, 2)                    # (G, Tr, Dv)
        kj, vj = k[keys, j], v[keys, j]                               # (Tk', D), (Tk', Dv)
        if fused:
            p = qj @ kj.T                                             # (G, Tr, Tk')
            compiled_layers.kernels().softmax_probs(p, mask, rows.start, keys.start,
                                                    q.dtype.type(scale), lse[j], rows.start)
        else:
            p = (qj @ kj.T) * scale + mask[rows, keys]                # (G, Tr, Tk')
            p -= lse[j][:, rows, None]
            xp.exp(p, out=p)                                          # (G, Tr, Tk') probabilities
        dv_parts[block, keys, j] = (p.transpose(0, 2, 1) @ doj).sum(0)  # (Tk', Dv)
        ds = doj @ vj.T                                               # (G, Tr, Tk') dP
        if fused:
            compiled_layers.kernels().softmax_dscores(ds, delta, rows.start, heads.start, p)
        else:
            ds -= delta[rows, heads].T[..., None]
            ds *= p                                                   # (G, Tr, Tk') dS / scale
        del p
        dq[rows, heads] = ((ds @ kj) * scale).transpose(1, 0, 2)      # (Tr, G, D)
        dk_parts[block, keys, j] = (ds.transpose(0, 2, 1) @ qj).sum(0) * scale  # (Tk', D)
        del ds
    parallel_map(piece, cache.pieces, xp)
    dk, dv = dk_parts.sum(0), dv_parts.sum(0)                         # over row blocks, in order
    return dq, dk, dv
