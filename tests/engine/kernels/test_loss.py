"""Chunked cross-entropy fused with the output projection, against a naive float64 computation
over the full (T, V) logits, and float64 finite-difference gradient checks."""

from __future__ import annotations

import numpy as np
import pytest

from app.engine.kernels.gradcheck import directional_check
from app.engine.kernels.loss import (cross_entropy_backward, cross_entropy_forward,
                                   cross_entropy_frozen_head)

TOL = 1e-6


class _RowView:
    """A lazily dequantizing (V, C) matrix: only .shape and row slices w[lo:hi] are allowed."""

    def __init__(self, w, dtype=None):
        self._w, self.shape, self.dtype_out, self.slices = w, w.shape, dtype or w.dtype, []

    def __getitem__(self, key):
        assert isinstance(key, slice) and key.step is None, "only row slices may be read"
        self.slices.append((key.start, key.stop))
        return self._w[key].astype(self.dtype_out)

    def __array__(self, *a, **kw):
        raise AssertionError("the output matrix must never be converted as a whole")


def _naive(h, w, labels, tw, lora, softcap):
    z = h @ w.T                                                          # (T, V)
    if lora is not None:
        z = z + lora[2] * (h @ lora[0].T) @ lora[1].T
    if softcap:
        z = softcap * np.tanh(z / softcap)
    mask = labels >= 0
    n = int(mask.sum())
    m = z.max(1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(1, keepdims=True)))[:, 0]
    safe = np.where(mask, labels, 0)
    nll = lse - z[np.arange(len(labels)), safe]
    wt = np.ones(len(labels)) if tw is None else tw
    loss = float((wt * nll)[mask].sum() / n) if n else 0.0
    correct = int(((z.argmax(1) == labels) & mask).sum())
    # analytic gradient of the same loss with respect to the (capped) logits, then h
    p = np.exp(z - lse[:, None])
    onehot = np.zeros_like(z)
    onehot[np.arange(len(labels)), safe] = 1.0
    dz = np.where(mask, wt / max(n, 1), 0.0)[:, None] * (p - onehot)
    if softcap:
        dz = dz * (1 - (z / softcap) ** 2)
    dh = dz @ w
    if lora is not None:
        dh = dh + lora[2] * (dz @ lora[1]) @ lora[0]
    return loss, correct, float(nll[mask].sum()), dh


def _problem(t=13, c=7, v=37, r=3, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((t, c)) * scale
    w = rng.standard_normal((v, c))
    labels = rng.integers(0, v, t)
    labels[[1, 4, 5]] = -1                                               # masked positions
    tw = rng.standard_normal(t) * 2.0
    tw[[0, 6]] = 0.0                                                     # zero weights
    tw[2] = -1.5                                                         # a negative weight
    lora = (rng.standard_normal((r, c)) / np.sqrt(c), rng.standard_normal((v, r)), 0.6)
    return h, w, labels, tw, lora


CASES = [  # (use token weights, use lora, softcap, chunk)
    (False, False, 0.0, 8192),
    (True, False, 0.0, 8),
    (True, True, 0.0, 8),
    (True, False, 3.0, 10),
    (True, True, 3.0, 6),
    (False, True, 5.0, 37),
    (True, True, 0.0, 1),
]


@pytest.mark.parametrize("use_w,use_lora,softcap,chunk", CASES)
def test_matches_naive_full_logits(use_w, use_lora, softcap, chunk):
    h, w, labels, tw, lora = _problem(scale=2.0)
    tw = tw if use_w else None
    lora = lora if use_lora else None
    loss, stats, cache = cross_entropy_forward(h, w, labels, tw, lora, softcap, chunk)
    ref_loss, ref_correct, ref_sum, ref_dh = _naive(h, w, labels, tw, lora, softcap)
    assert abs(loss - ref_loss) <= 1e-12 * max(1.0, abs(ref_loss))
    assert stats["n_tokens"] == int((labels >= 0).sum())
    assert stats["n_correct"] == ref_correct
    assert abs(stats["loss_sum_unweighted"] - ref_sum) <= 1e-12 * abs(ref_sum)
    dh, dw, dl = cross_entropy_backward(cache)
    assert dw is None and (dl is None) == (lora is None)
    np.testing.assert_allclose(dh, ref_dh, rtol=1e-12, atol=1e-14)
    assert not dh[labels < 0].any()


def test_accuracy_counts_with_ties_and_a_confident_model():
    rng = np.random.default_rng(3)
    t, c, v = 20, 4, 30
    h = rng.standard_normal((t, c))
    w = rng.standard_normal((v, c))
    w[17] = w[5]                                                         # exact tie: first index wins
    z = h @ w.T
    labels = z.argmax(1)                                                 # all correct ...
    labels[:5] = (labels[:5] + 1) % v                                    # ... except five
    labels[5] = -1
    for chunk in (1, 7, 30, 64):
        _, stats, _ = cross_entropy_forward(h, w, labels, chunk=chunk)
        assert stats == dict(n_tokens=19, n_correct=14, loss_sum_unweighted=stats["loss_sum_unweighted"])
        assert stats["n_correct"] == _naive(h, w, labels, None, None, 0.0)[1]


@pytest.mark.parametrize("use_w,use_lora,softcap,chunk", CASES)
def test_gradcheck(use_w, use_lora, softcap, chunk):
    h, w, labels, tw, lora = _problem()
    tw = tw if use_w else None
    a, b, s = lora

    def loss(xs):
        lo = (xs[2], xs[3], s) if use_lora else None
        return cross_entropy_forward(xs[0], xs[1], labels, tw, lo, softcap, chunk)[0]

    _, _, cache = cross_entropy_forward(h, w, labels, tw, (a, b, s) if use_lora else None, softcap, chunk)
    dh, dw, dl = cross_entropy_backward(cache, need_dw=True)
    assert dw.shape == w.shape
    grads = [dh, dw, *(dl if use_lora else (None, None))]
    inputs = [h, w, a, b]
    for seed in range(3):
        err = directional_check(loss, inputs, grads, seed=seed)
        assert err < TOL, err
    for i, g in enumerate(grads):                                        # each gradient alone
        if g is not None:
            only = [g if j == i else None for j in range(4)]
            err = directional_check(loss, inputs, only, seed=10 + i)
            assert err < TOL, (i, err)


def test_gradcheck_detects_a_wrong_gradient():
    h, w, labels, tw, lora = _problem()
    loss = lambda xs: cross_entropy_forward(xs[0], xs[1], labels, tw, chunk=8)[0]
    _, _, cache = cross_entropy_forward(h, w, labels, tw, chunk=8)
    dh, dw, _ = cross_entropy_backward(cache, need_dw=True)
    assert directional_check(loss, [h, w], [dh, dw]) < TOL
    assert directional_check(loss, [h, w], [dh, dw * 1.01]) > 1e-4
    bad = dh.copy()
    bad[2] = -bad[2]                                                     # sign of the negative weight lost
    assert directional_check(loss, [h, w], [bad, dw]) > 1e-4


def test_lazy_row_view_float32():
    h, w, labels, tw, lora = _problem(t=33, c=16, v=301)
    view = _RowView(w, np.float32)
    h32 = h.astype(np.float32)
    lora32 = (lora[0].astype(np.float32), lora[1].astype(np.float32), lora[2])
    loss32, stats32, cache32 = cross_entropy_forward(h32, view, labels, tw, lora32, 4.0, chunk=64)
    assert sorted(set(view.slices)) == [(lo, min(lo + 64, 301)) for lo in range(0, 301, 64)]
    dh32, dw32, (da32, db32) = cross_entropy_backward(cache32, need_dw=True)
    assert dh32.dtype == dw32.dtype == da32.dtype == db32.dtype == np.float32
    w64 = w.astype(np.float32).astype(np.float64)
    lora64 = (lora32[0].astype(np.float64), lora32[1].astype(np.float64), lora32[2])
    loss64, stats64, cache64 = cross_entropy_forward(h32.astype(np.float64), w64, labels, tw,
                                                     lora64, 4.0, chunk=64)
    dh64, dw64, (da64, db64) = cross_entropy_backward(cache64, need_dw=True)
    assert abs(loss32 - loss64) < 1e-5 * max(1.0, abs(loss64))
    assert stats32["n_tokens"] == stats64["n_tokens"]
    for a, b in ((dh32, dh64), (dw32, dw64), (da32, da64), (db32, db64)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max())


def test_all_masked_and_large_logits():
    h, w, labels, tw, _ = _problem()
    loss, stats, cache = cross_entropy_forward(h, w, np.full(len(labels), -1), tw, chunk=8)
    assert loss == 0.0 and stats == dict(n_tokens=0, n_correct=0, loss_sum_unweighted=0.0)
    dh, dw, _ = cross_entropy_backward(cache, need_dw=True)
    assert not dh.any() and not dw.any() and dh.shape == h.shape
    # logits of size ~1e3: the online log-sum-exp must neither overflow nor lose the label logit
    big = h * 300.0
    loss, _, cache = cross_entropy_forward(big, w, labels, None, chunk=5)
    ref = _naive(big, w, labels, None, None, 0.0)
    assert np.isfinite(loss) and abs(loss - ref[0]) <= 1e-12 * abs(ref[0])
    np.testing.assert_allclose(cross_entropy_backward(cache)[0], ref[3], rtol=1e-10, atol=1e-12)


def test_label_outside_vocabulary_is_an_error():
    h, w, labels, _, _ = _problem()
    labels = labels.copy()
    labels[0] = w.shape[0]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        cross_entropy_forward(h, w, labels)


FROZEN_CASES = [(False, 0.0, 8192), (True, 0.0, 8), (True, 3.0, 10), (False, 5.0, 37), (True, 0.0, 1)]


@pytest.mark.parametrize("use_w,softcap,chunk", FROZEN_CASES)
def test_frozen_head_in_one_pass_matches_naive_full_logits(use_w, softcap, chunk):
    h, w, labels, tw, _ = _problem(scale=2.0)
    tw = tw if use_w else None
    loss, stats, dh = cross_entropy_frozen_head(h, w, labels, tw, softcap, chunk)
    ref_loss, ref_correct, ref_sum, ref_dh = _naive(h, w, labels, tw, None, softcap)
    assert abs(loss - ref_loss) <= 1e-12 * max(1.0, abs(ref_loss))
    assert stats == dict(n_tokens=int((labels >= 0).sum()), n_correct=ref_correct,
                         loss_sum_unweighted=stats["loss_sum_unweighted"])
    assert abs(stats["loss_sum_unweighted"] - ref_sum) <= 1e-12 * abs(ref_sum)
    np.testing.assert_allclose(dh, ref_dh, rtol=1e-11, atol=1e-13)
    assert not dh[labels < 0].any()


@pytest.mark.parametrize("softcap", [0.0, 4.0])
def test_frozen_head_gradcheck_and_a_growing_maximum(softcap):
    """The running max grows chunk after chunk (logits sorted upward across the vocabulary), so
    every chunk rescales the accumulated rows; large logits must not overflow."""
    h, w, labels, tw, _ = _problem()
    w = w[np.argsort(w @ h[0])]                                          # rising logits for token 0
    loss = lambda xs: cross_entropy_forward(xs[0], w, labels, tw, None, softcap, 3)[0]
    _, _, dh = cross_entropy_frozen_head(h, w, labels, tw, softcap, 3)
    for seed in range(3):
        assert directional_check(loss, [h], [dh], seed=seed) < TOL
    big = h * 300.0
    loss_big, _, dh_big = cross_entropy_frozen_head(big, w, labels, None, softcap, 5)
    ref = _naive(big, w, labels, None, None, softcap)
    assert np.isfinite(loss_big) and abs(loss_big - ref[0]) <= 1e-12 * abs(ref[0])
    np.testing.assert_allclose(dh_big, ref[3], rtol=1e-10, atol=1e-12)


def test_frozen_head_float32_matches_the_two_pass_path():
    h, w, labels, tw, _ = _problem(t=33, c=16, v=301)
    h32, view = h.astype(np.float32), _RowView(w, np.float32)
    loss1, stats1, dh1 = cross_entropy_frozen_head(h32, view, labels, tw, 4.0, chunk=64)
    loss2, stats2, cache = cross_entropy_forward(h32, view, labels, tw, None, 4.0, chunk=64)
    dh2 = cross_entropy_backward(cache)[0]
    assert dh1.dtype == np.float32 and stats1 == stats2 and loss1 == loss2
    np.testing.assert_allclose(dh1, dh2, rtol=2e-5, atol=1e-6 * np.abs(dh2).max())


def test_frozen_head_with_every_token_masked_or_one_token():
    h, w, labels, tw, _ = _problem()
    loss, stats, dh = cross_entropy_frozen_head(h, w, np.full(len(labels), -1), tw, chunk=8)
    assert loss == 0.0 and stats["n_tokens"] == 0 and dh.shape == h.shape and not dh.any()
    one = np.full(len(labels), -1)
    one[3] = 7
    loss, stats, dh = cross_entropy_frozen_head(h, w, one, None, chunk=8)
    ref_loss, _, _, ref_dh = _naive(h, w, one, None, None, 0.0)
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss) and stats["n_tokens"] == 1
    np.testing.assert_allclose(dh, ref_dh, rtol=1e-11, atol=1e-13)
