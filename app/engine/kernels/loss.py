"""Cross-entropy fused with the output projection, chunked over the vocabulary.

The (T, V) logits never exist at once: forward makes one pass over vocabulary chunks keeping a
running max and sum per token (online log-sum-exp), the label logit (picked when its chunk
passes) and a running argmax; backward makes a second pass recomputing each chunk's logits,
dz = w_t / N * (softmax - onehot). Chunking over the vocabulary streams the output matrix once
per pass (ARCHITECTURE.md, performance notes).

`w_out` is anything with `.shape == (V, C)` whose row slices `w_out[lo:hi]` are float arrays
(a lazily dequantizing view of a quantized matrix works); it is only ever read by row slices.
"""

from __future__ import annotations

from app.engine.backend import get_array_module
from app.engine.parallel import matmul, parallel_map, row_blocks


def _chunk_logits(xp, h, w_out, lo, hi, lora, ha):
    """Uncapped logits of vocabulary rows lo:hi for the active tokens: (z (n, hi - lo), the
    rows read from w_out). The GEMM runs on the engine's threads; the softcap is applied per
    row block by the caller."""
    w_chunk = w_out[lo:hi]                                              # (v, C)
    z = matmul(h, w_chunk.T)                                            # (n, v)
    if lora is not None:
        z += (lora[2] * ha) @ lora[1][lo:hi].T                          # (n, v)
    return z, w_chunk


def _softcap(xp, z, softcap):
    """In place: z = cap * tanh(z / cap) (softcap > 0)."""
    z /= softcap
    xp.tanh(z, out=z)
    z *= softcap


def cross_entropy_forward(h, w_out, labels, token_weights=None, lora=None, softcap: float = 0.0,
                          chunk: int = 8192):
    """h (T, C), w_out (V, C) by row slices, labels (T,) int with -1 (any negative) = masked.

    token_weights (T,) real weights w_t (any sign) or None for 1; lora (A (R, C), B (V, R),
    scale) or None; softcap > 0: logits = cap * tanh(z / cap).
    loss = sum_t w_t * (lse_t - z_t[label_t]) / N, N = number of unmasked tokens (0 if none).
    Returns (loss: float, stats: dict(n_tokens, n_correct, loss_sum_unweighted), cache).
    """
    xp = get_array_module(h)
    t = h.shape[0]
    v = w_out.shape[0]
    labels = xp.asarray(labels)
    active = xp.nonzero(labels >= 0)[0]                                 # (N,)
    n = int(active.shape[0])
    all_active = n == t
    h_act = h if all_active else h[active]                              # (N, C)
    lab = labels if all_active else labels[active]                      # (N,)
    if n and int(lab.max()) >= v:
        raise ValueError(f"label {int(lab.max())} is outside the vocabulary of {v} tokens")
    if token_weights is None:
        wt = xp.ones(n, dtype=h.dtype)                                  # (N,)
    else:
        tw = xp.asarray(token_weights, dtype=h.dtype)
        wt = tw if all_active else tw[active]                           # (N,)
    ha = None if lora is None else h_act @ lora[0].T                    # (N, R)
    run_max = xp.full(n, -xp.inf, dtype=h.dtype)                        # (N,)
    run_sum = xp.zeros(n, dtype=h.dtype)                                # (N,)
    label_logit = xp.zeros(n, dtype=h.dtype)                            # (N,)
    best_idx = xp.zeros(n, dtype=xp.int64)                              # (N,)
    blocks = row_blocks(n)
    if n:
        for lo in range(0, v, chunk):
            hi = min(lo + chunk, v)
            z, _ = _chunk_logits(xp, h_act, w_out, lo, hi, lora, ha)   # (N, v)

            def merge(r: slice) -> None:       # the chunk into the running statistics of rows r
                zr = z[r]                                               # (n_r, v)
                if softcap > 0.0:
                    _softcap(xp, zr, softcap)
                arg = zr.argmax(1)                                      # (n_r,)
                cmax = zr[xp.arange(len(arg)), arg]                     # (n_r,)
                better = cmax > run_max[r]                              # first index wins ties
                best_idx[r] = xp.where(better, arg + lo, best_idx[r])
                lab_r = lab[r]
                sel = xp.nonzero((lab_r >= lo) & (lab_r < hi))[0]       # labels in this chunk
                label_logit[r][sel] = zr[sel, lab_r[sel] - lo]
                new_max = xp.maximum(run_max[r], cmax)                  # (n_r,)
                zr -= new_max[:, None]
                xp.exp(zr, out=zr)
                run_sum[r] = run_sum[r] * xp.exp(run_max[r] - new_max) + zr.sum(1)
                run_max[r] = new_max
            parallel_map(merge, blocks, xp)
    lse = run_max + xp.log(run_sum) if n else run_max                   # (N,)
    nll = lse - label_logit                                             # (N,)
    loss = float((wt * nll).sum() / n) if n else 0.0
    stats = dict(n_tokens=n, n_correct=int((best_idx == lab).sum()) if n else 0,
                 loss_sum_unweighted=float(nll.sum()) if n else 0.0)
    cache = dict(h=h_act, w_out=w_out, labels=lab, coef=wt / max(n, 1), lse=lse, lora=lora,
                 ha=ha, softcap=softcap, chunk=chunk, active=active, t=t, all_active=all_active)
    return loss, stats, cache


def cross_entropy_backward(cache, need_dw: bool = False):
    """-> (dh (T, C), dw_out (V, C) or None, (dA (R, C), dB (V, R)) or None).

    A second pass over the same vocabulary chunks recomputes each chunk's logits;
    dz = w_t / N * (softmax - onehot), through the softcap when it is on. dw_out only when
    need_dw (a frozen head gets nothing of its size allocated); LoRA grads when a LoRA is given.
    Masked tokens get dh = 0.
    """
    h, w_out, lab, coef, lse = cache["h"], cache["w_out"], cache["labels"], cache["coef"], cache["lse"]
    lora, ha, softcap, chunk = cache["lora"], cache["ha"], cache["softcap"], cache["chunk"]
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
            dh_rows += matmul(dz, w_chunk)                              # (N, C)
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
    if cache["all_active"]:
        dh = dh_rows
    else:
        dh = xp.zeros((cache["t"], c), dtype=h.dtype)                   # (T, C)
        dh[cache["active"]] = dh_rows
    return dh, dw_out, dlora
