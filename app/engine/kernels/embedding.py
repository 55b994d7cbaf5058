"""Token embeddings and the token-embedding LoRA, with scatter-add backwards.

The backward of a gather `table[tokens]` is a rows scatter-add. It is done without np.add.at
(slow on old NumPy, atomics on CuPy): the tokens are sorted once (stable), and each run of equal
tokens is summed. Runs of at most _LIGHT rows (almost every token in real text) are summed
together one occurrence rank at a time, a vectorised step whose target rows are distinct; the
few longer runs (padding, very frequent tokens) are summed one run at a time, in float64.
Measured faster than both np.add.reduceat over the sorted rows and a flat np.bincount.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from app.engine.runtime.backend import get_array_module

_LIGHT = 16  # longest run of one token summed by the rank loop; longer runs are summed per token


class EmbeddingCache(NamedTuple):
    """What embedding_backward needs: the tokens (T,) int; nothing else."""

    tokens: Any


class LoraEmbeddingCache(NamedTuple):
    """What lora_embedding_backward needs: tokens (T,), A[tokens] (T, R), B (C, R), the scale
    and the vocabulary size V."""

    tokens: Any
    at: Any
    b: Any
    scale: float
    n_vocab: int


def _segment_rows(rows, tokens):
    """Sum the rows of `rows` (T, C) that share a token: (unique tokens (U,), sums (U, C))."""
    xp = get_array_module(rows)
    order = xp.argsort(tokens, kind="stable")                        # (T,)
    st = tokens[order]                                               # (T,) sorted tokens
    new = xp.ones(st.shape, dtype=bool)
    new[1:] = st[1:] != st[:-1]
    starts = xp.flatnonzero(new)                                     # (U,)
    counts = xp.diff(xp.append(starts, st.shape[0]))                 # (U,)
    rs = rows[order]                                                 # (T, C) sorted rows
    sums = rs[starts]                                                # (U, C) first occurrences
    light = counts <= _LIGHT                                         # (U,)
    for r in range(1, min(int(counts.max()), _LIGHT)):
        seg = xp.flatnonzero(light & (counts > r))                   # runs with an r-th row
        sums[seg] += rs[starts[seg] + r]                             # (n, C), seg distinct
    for i in xp.flatnonzero(~light).tolist():
        s0 = int(starts[i])
        sums[i] = rs[s0:s0 + int(counts[i])].sum(0, dtype=xp.float64)  # (C,) long run, in double
    return st[starts], sums


def _scatter_rows(rows, tokens, n_rows: int):
    """Dense (n_rows, C) gradient with the rows of `rows` (T, C) summed into their tokens."""
    xp = get_array_module(rows)
    out = xp.zeros((n_rows, rows.shape[1]), dtype=rows.dtype)        # (V, C)
    if tokens.shape[0]:
        uniq, sums = _segment_rows(rows, tokens)                     # (U,), (U, C)
        out[uniq] = sums
    return out


def embedding_forward(table, tokens, gathered: bool = False):
    """table: (V, C) float, tokens: (T,) int -> (rows (T, C), cache).

    With gathered=True, `table` is already the looked-up rows (T, C) (e.g. WeightStore.rows for
    a quantized table, which must not be dequantized whole) and is returned as is. The cache is
    an EmbeddingCache either way.
    """
    xp = get_array_module(table)
    tokens = xp.asarray(tokens)                                      # (T,)
    out = table if gathered else table[tokens]                       # (T, C)
    return out, EmbeddingCache(tokens)


def embedding_backward(dout, cache, n_vocab: int):
    """dout: (T, C) -> dtable (V, C): the rows of dout scatter-added into their tokens."""
    return _scatter_rows(dout, cache.tokens, n_vocab)


def lora_embedding_forward(a, b, tokens, scale: float):
    """Token-embedding LoRA: a (V, R), b (C, R) -> delta (T, C) = s * A[tokens] B^T (to add to
    the embedding rows e). Cache: LoraEmbeddingCache."""
    tokens = get_array_module(a).asarray(tokens)                     # (T,)
    at = a[tokens]                                                   # (T, R)
    return scale * (at @ b.T), LoraEmbeddingCache(tokens, at, b, scale, a.shape[0])  # (T, C)


def lora_embedding_backward(dout, cache):
    """dout: (T, C) -> (dA (V, R), dB (C, R)): dB = s dout^T A[tokens], dA = rows scatter of
    s dout B."""
    at, b, scale = cache.at, cache.b, cache.scale
    db = scale * (dout.T @ at)                                       # (C, R)
    dat = scale * (dout @ b)                                         # (T, R)
    return _scatter_rows(dat, cache.tokens, cache.n_vocab), db
