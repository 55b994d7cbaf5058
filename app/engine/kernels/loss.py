"""Cross-entropy fused with the output projection, chunked over the vocabulary.

The (T, V) logits never exist at once: forward makes one pass over vocabulary chunks keeping a
running max and sum per token (online log-sum-exp), the label logit (picked when its chunk
passes) and a running argmax; backward makes a second pass recomputing each chunk's logits,
dz = w_t / N * (softmax - onehot). Chunking over the vocabulary streams the output matrix once
per pass (ARCHITECTURE.md, performance notes).

A head that gets no gradient (frozen, without LoRA: the usual LoRA run) needs only dh, which
`cross_entropy_frozen_head` computes in the forward pass itself, the way flash attention does:
the softmax-weighted sum of the head's rows is accumulated against the running max and rescaled
when the max grows. That saves the second pass's logits, a third of the head's FLOPs (on
Gemma 3's 262,144-token vocabulary, 172 GFLOP of a 800 GFLOP step at context 512).

`w_out` is anything with `.shape == (V, C)` whose row slices `w_out[lo:hi]` are float arrays
(a lazily dequantizing view of a quantized matrix works); it is only ever read by row slices.
A frozen head may be a Bf16Weight (--precision bf16, app.engine.runtime.bf16): its two
products, the logits h W^T and dh = dz W, then run in bf16 with float32 accumulation; the
softmax, the running statistics and the loss stay float32.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from app.engine.runtime.backend import get_array_module
from app.engine.runtime.bf16 import is_packed, matmul as bf16_matmul, product
from app.engine.runtime.parallel import (matmul, parallel_map, product_row_blocks, row_blocks,
                                         thread_count)

VOCAB_CHUNK = 8192   # vocabulary rows per chunk: each chunk's logits are (T, VOCAB_CHUNK)


class CrossEntropyCache(NamedTuple):
    """What cross_entropy_backward needs, for the N labelled tokens: h (N, C), w_out (V, C) by
    row slices, labels (N,), coef (N,) = w_t / N, lse (N,), lora (A (R, C), B (V, R), scale) or
    None, ha (N, R) or None, the softcap, the chunk and the tokens (to scatter dh back to T).
    nll (N,): each labelled token's -log p(label) (`label_log_probs` reads it)."""

    h: Any
    w_out: Any
    labels: Any
    coef: Any
    lse: Any
    lora: Any
    ha: Any
    softcap: float
    chunk: int
    tokens: _Tokens
    nll: Any = None


def _head_product(h, w, transpose: bool):
    """h @ w^T (transpose) or h @ w on the engine's threads: matmul's column blocks in float32,
    blocks of rows for a Bf16Weight (its rows are the vocabulary: a block of them would cut
    the chunk's bf16 weight into strided pieces)."""
    if not is_packed(w):
        return matmul(h, w.T if transpose else w)
    n_out = w.shape[0] if transpose else w.shape[1]
    out = np.empty((h.shape[0], n_out), np.float32)
    parallel_map(lambda r: bf16_matmul(h[r], w, transpose, out=out[r]),
                 product_row_blocks(h.shape[0], h.shape[1], n_out))
    return out


def _rows_of(w_chunk, cols):
    """Rows `cols` of a chunk as float32 (a Bf16Weight's widened: the values its products
    used)."""
    return w_chunk[cols].widened() if is_packed(w_chunk) else w_chunk[cols]


def _chunk_logits(xp, h, w_out, lo, hi, lora, ha):
    """Uncapped logits of vocabulary rows lo:hi for the active tokens: (z (n, hi - lo), the
    rows read from w_out). The GEMM runs on the engine's threads; the softcap is applied per
    row block by the caller."""
    w_chunk = w_out[lo:hi]                                              # (v, C)
    z = _head_product(h, w_chunk, True)                                 # (n, v)
    if lora is not None:
        z += (lora[2] * ha) @ lora[1][lo:hi].T                          # (n, v)
    return z, w_chunk


def _softcap(xp, z, softcap):
    """In place: z = cap * tanh(z / cap) (softcap > 0)."""
    z /= softcap
    xp.tanh(z, out=z)
    z *= softcap


def cross_entropy_forward(h, w_out, labels, token_weights=None, lora=None, softcap: float = 0.0,
                          chunk: int = VOCAB_CHUNK):
    """h (T, C), w_out (V, C) by row slices, labels (T,) int with -1 (any negative) = masked.

    token_weights (T,) real weights w_t (any sign) or None for 1; lora (A (R, C), B (V, R),
    scale) or None; softcap > 0: logits = cap * tanh(z / cap).
    loss = sum_t w_t * (lse_t - z_t[label_t]) / N, N = number of unmasked tokens (0 if none).
    Returns (loss: float, stats: dict(n_tokens, n_correct, loss_sum_unweighted),
    CrossEntropyCache).
    """
    xp = get_array_module(h)
    v = w_out.shape[0]
    tokens = _Tokens(xp, h, labels, token_weights, v)
    h_act, lab, wt, n = tokens.h, tokens.labels, tokens.weights, tokens.n
    ha = None if lora is None else h_act @ lora[0].T                    # (N, R)
    run = _Running(xp, n, h.dtype)
    blocks = row_blocks(n)
    if n:
        for lo in range(0, v, chunk):
            hi = min(lo + chunk, v)
            z, _ = _chunk_logits(xp, h_act, w_out, lo, hi, lora, ha)   # (N, v)

            def merge(r: slice) -> None:       # the chunk into the running statistics of rows r
                zr = z[r]                                               # (n_r, v)
                if softcap > 0.0:
                    _softcap(xp, zr, softcap)
                run.merge(zr, r, lab[r], lo, hi)
            parallel_map(merge, blocks, xp)
    lse, loss, stats = run.result(wt, lab)
    cache = CrossEntropyCache(h_act, w_out, lab, wt / max(n, 1), lse, lora, ha, softcap, chunk,
                              tokens, lse - run.label_logit)
    return loss, stats, cache


def label_log_probs(cache: CrossEntropyCache):
    """(T,) log p(label_t) of each labelled token from a cross_entropy_forward cache, 0 where
    the label is masked: a sequence's log-probability is the sum over its tokens (preference
    losses), with no (T, V) logits kept."""
    tokens = cache.tokens
    xp = tokens.xp
    if tokens.all_active:
        return -cache.nll
    out = xp.zeros(tokens.t, dtype=cache.nll.dtype)                     # (T,)
    out[tokens.active] = -cache.nll
    return out


def cross_entropy_frozen_head(h, w_out, labels, token_weights=None, softcap: float = 0.0,
                              chunk: int = VOCAB_CHUNK):
    """Loss, stats and dh (T, C) in one pass over the vocabulary, for a head that gets no
    gradient (frozen, no LoRA); arguments and figures as in cross_entropy_forward.

    With coef_t = w_t / N, p = softmax(z) and the softcap's slope s_v = 1 - (z_v / cap)^2 (1
    without a cap): dh_t = coef_t * (sum_v p_tv s_v w_v - s_label w_label). Per chunk and row
    block, acc_t = sum_v exp(z_tv - m_t) s_v w_v (C,) runs beside the running max m_t and sum
    S_t: when the max grows, acc_t is rescaled by exp(m_old - m_new) as S_t is, and at the end
    sum_v p_tv s_v w_v = acc_t / S_t. Each row block computes its own logits, so a chunk is one
    piece per row block.
    """
    xp = get_array_module(h)
    v = w_out.shape[0]
    tokens = _Tokens(xp, h, labels, token_weights, v)
    h_act, lab, n = tokens.h, tokens.labels, tokens.n
    run = _Running(xp, n, h.dtype)
    acc = xp.zeros(h_act.shape, h.dtype)                                # (N, C)
    label_rows = xp.zeros(h_act.shape, h.dtype)                         # (N, C) s_label w_label
    blocks = head_row_blocks(xp, n)
    if n:
        for lo in range(0, v, chunk):
            hi = min(lo + chunk, v)
            w_chunk = w_out[lo:hi]                                      # (v, C)

            def accumulate(r: slice) -> None:
                zr = product(h_act[r], w_chunk, True, xp=xp)            # (n_r, v) logits
                slope = None
                if softcap > 0.0:
                    _softcap(xp, zr, softcap)
                    slope = zr / softcap
                    slope *= slope
                    xp.subtract(1.0, slope, out=slope)                  # 1 - tanh^2 (n_r, v)
                rescale, inside = run.merge(zr, r, lab[r], lo, hi)      # zr = exp(z - m_new)
                cols = lab[r][inside] - lo                              # (n_in,)
                rows = _rows_of(w_chunk, cols)                          # (n_in, C) w_label
                if slope is not None:
                    zr *= slope
                    rows = rows * slope[inside, cols][:, None]
                label_rows[r][inside] = rows
                acc_r = acc[r]                                          # (n_r, C)
                acc_r *= rescale[:, None]
                acc_r += product(zr, w_chunk, False, xp=xp)
            parallel_map(accumulate, blocks, xp)
    wt = tokens.weights
    _, loss, stats = run.result(wt, lab)
    coef = (wt / max(n, 1))[:, None]                                    # (N, 1)
    acc /= run.sum[:, None]
    acc -= label_rows
    acc *= coef                                                         # dh rows (N, C)
    return loss, stats, tokens.scatter(acc)


def head_row_blocks(xp, n: int) -> list[slice]:
    """The row blocks of cross_entropy_frozen_head, each a piece that runs two GEMMs on its
    rows: blocks of up to 256 rows (one per thread when fewer) beat 128-row blocks by 10-15% in
    Gemma 3's loss phase (1.46 -> 1.25-1.34 s). On CuPy, where pieces run one after another,
    one block of all rows. On NumPy the blocks, so the GEMM calls, depend on the thread count."""
    if xp is not np:
        return [slice(0, n)]
    return row_blocks(n, min_rows=min(256, max(16, n // thread_count())))


class _Tokens:
    """The tokens with a label (label >= 0): their rows of h, labels and weights."""

    def __init__(self, xp, h, labels, token_weights, v: int):
        labels = xp.asarray(labels)
        self.xp, self.t = xp, h.shape[0]
        self.active = xp.nonzero(labels >= 0)[0]                        # (N,)
        self.n = int(self.active.shape[0])
        self.all_active = self.n == self.t
        self.h = h if self.all_active else h[self.active]               # (N, C)
        self.labels = labels if self.all_active else labels[self.active]  # (N,)
        if self.n and int(self.labels.max()) >= v:
            raise ValueError(f"label {int(self.labels.max())} is outside the vocabulary of "
                             f"{v} tokens")
        if token_weights is None:
            self.weights = xp.ones(self.n, dtype=h.dtype)               # (N,)
        else:
            tw = xp.asarray(token_weights, dtype=h.dtype)
            self.weights = tw if self.all_active else tw[self.active]   # (N,)

    def scatter(self, rows):
        """(N, C) rows of the labelled tokens -> (T, C), zero for the others."""
        if self.all_active:
            return rows
        out = self.xp.zeros((self.t, rows.shape[1]), dtype=rows.dtype)  # (T, C)
        out[self.active] = rows
        return out


class _Running:
    """Per-token running statistics over vocabulary chunks: max and sum of exp (online
    log-sum-exp), the label's logit (picked when its chunk passes) and the argmax."""

    def __init__(self, xp, n: int, dtype):
        self.xp = xp
        self.max = xp.full(n, -xp.inf, dtype=dtype)                     # (N,)
        self.sum = xp.zeros(n, dtype=dtype)                             # (N,)
        self.label_logit = xp.zeros(n, dtype=dtype)                     # (N,)
        self.best = xp.zeros(n, dtype=xp.int64)                         # (N,)

    def merge(self, zr, r: slice, lab_r, lo: int, hi: int):
        """Fold the (capped) logits zr (n_r, hi - lo) of rows r into the statistics; zr becomes
        exp(zr - new max) in place. Returns (exp(old max - new max) (n_r,), the indices of the
        rows whose label is in this chunk)."""
        xp = self.xp
        arg = zr.argmax(1)                                              # (n_r,)
        cmax = zr[xp.arange(len(arg)), arg]                             # (n_r,)
        better = cmax > self.max[r]                                     # first index wins ties
        self.best[r] = xp.where(better, arg + lo, self.best[r])
        inside = xp.nonzero((lab_r >= lo) & (lab_r < hi))[0]            # labels in this chunk
        self.label_logit[r][inside] = zr[inside, lab_r[inside] - lo]
        new_max = xp.maximum(self.max[r], cmax)                         # (n_r,)
        zr -= new_max[:, None]
        xp.exp(zr, out=zr)
        rescale = xp.exp(self.max[r] - new_max)                         # (n_r,)
        self.sum[r] = self.sum[r] * rescale + zr.sum(1)
        self.max[r] = new_max
        return rescale, inside

    def result(self, wt, lab):
        """(lse (N,), loss, stats) once every chunk has been merged."""
        xp, n = self.xp, self.max.shape[0]
        lse = self.max + xp.log(self.sum) if n else self.max            # (N,)
        nll = lse - self.label_logit                                    # (N,)
        loss = float((wt * nll).sum() / n) if n else 0.0
        stats = dict(n_tokens=n, n_correct=int((self.best == lab).sum()) if n else 0,
                     loss_sum_unweighted=float(nll.sum()) if n else 0.0)
        return lse, loss, stats


def cross_entropy_backward(cache, need_dw: bool = False):
    """-> (dh (T, C), dw_out (V, C) or None, (dA (R, C), dB (V, R)) or None).

    A second pass over the same vocabulary chunks recomputes each chunk's logits;
    dz = w_t / N * (softmax - onehot), through the softcap when it is on. dw_out only when
    need_dw (a frozen head gets nothing of its size allocated); LoRA grads when a LoRA is given.
    Masked tokens get dh = 0.
    """
    h, w_out, lab, coef, lse = cache.h, cache.w_out, cache.labels, cache.coef, cache.lse
    lora, ha, softcap, chunk = cache.lora, cache.ha, cache.softcap, cache.chunk
    xp = get_array_module(h)
    n, c = h.shape
    v = w_out.shape[0]
    dh_rows = xp.zeros((n, c), dtype=h.dtype)                           # (N, C)
    dw_out = xp.zeros((v, c), dtype=h.dtype) if need_dw else None       # (V, C)
    dlora = None
    if lora is not None:
        dha = xp.zeros(ha.shape, dtype=h.dtype)                         # (N, R)
        db = xp.zeros(lora[1].shape, dtype=h.dtype)                     # (V, R)
    blocks = row_blocks(n)
    if n:
        for lo in range(0, v, chunk):
            hi = min(lo + chunk, v)
            dz, w_chunk = _chunk_logits(xp, h, w_out, lo, hi, lora, ha)  # (N, v) logits

            def softmax_grad(r: slice) -> None:  # dz of rows r, in place of their logits
                zr = dz[r]                                              # (n_r, v)
                capped = None
                if softcap > 0.0:
                    capped = zr.copy()
                    _softcap(xp, zr, softcap)
                zr -= lse[r][:, None]
                xp.exp(zr, out=zr)                                      # softmax (n_r, v)
                lab_r = lab[r]
                inside = xp.nonzero((lab_r >= lo) & (lab_r < hi))[0]
                zr[inside, lab_r[inside] - lo] -= 1.0                   # - onehot
                zr *= coef[r][:, None]
                if capped is not None:                                  # d cap*tanh(z/cap) / dz
                    capped /= softcap
                    xp.tanh(capped, out=capped)
                    capped *= capped
                    zr *= 1.0 - capped
            parallel_map(softmax_grad, blocks, xp)
            dh_rows += _head_product(dz, w_chunk, False)                # (N, C)
            if need_dw:
                matmul(dz.T, h, out=dw_out[lo:hi])                      # (v, C)
            if lora is not None:
                dha += dz @ lora[1][lo:hi]                              # (N, R)
                xp.matmul(dz.T, ha, out=db[lo:hi])                      # (v, R)
    if lora is not None:
        a, _, scale = lora
        dha *= scale
        dh_rows += dha @ a                                              # (N, C)
        db *= scale
        dlora = (dha.T @ h, db)                                         # (R, C), (V, R)
    return cache.tokens.scatter(dh_rows), dw_out, dlora
