"""The kernels with a frozen weight in bf16 (--precision bf16, issue 30): linear layers, the MoE
experts and the loss head, each against float64 within the bound of bf16 products.

One product output sum_k x_k w_k in bf16 (app/engine/runtime/bf16.py: x and w rounded to bf16,
a float32 sum, returned in float32) is within (2u + gamma_K)(1 + 2u) M of the exact sum,
u = 2^-8, M = sum_k |x_k||w_k|, gamma_K the float32 accumulation term (tests/float32_bounds.py;
the derivation is in tests/engine/runtime/test_bf16.py). Every test also checks the result is
NOT within float32's bound somewhere, so a path that silently stayed float32 fails, and runs on
both backends where the library is installed (the emulation everywhere).
"""

from __future__ import annotations

import numpy as np
import pytest

from app.engine.kernels.linear import Linear, linear_backward_group, linear_forward_group
from app.engine.kernels.loss import cross_entropy_forward, cross_entropy_frozen_head
from app.engine.kernels.moe import dispatch_order, experts_backward, experts_forward_train
from app.engine.runtime import bf16
from tests.float32_bounds import gamma

U = 2.0 ** -8
BACKENDS = ["emulation"] + (["onednn"] if bf16.library_available() else [])


def bound(k: int, magnitude):
    return (2 * U + gamma(k)) * (1 + 2 * U) * magnitude


def assert_bf16_product(got, exact, magnitude, k: int):
    diff = np.abs(np.asarray(got, np.float64) - exact)
    assert np.all(diff <= bound(k, magnitude)), float(np.max(diff / bound(k, magnitude)))
    assert np.any(diff > 4 * gamma(k) * magnitude), "float32 accuracy: bf16 was not used"


class Stack(list):
    """Experts as packed weights, indexable by expert like an (E, out, in) array (what
    app.engine.model.weights.PackedExperts gives the kernels)."""

    def __init__(self, items, shape):
        super().__init__(items)
        self.shape = shape


def assert_rounded_inputs(got, x, w):
    """Tighter, and what tells bf16 inputs from one rounded operand: against the exact product
    of the bf16-ROUNDED inputs x (M, K) and w (N, K), got is within its float32 sum's error
    gamma_K M' (M' on the rounded inputs): the output is float32, not rounded again."""
    xr = bf16.round_bf16(x).astype(np.float64)
    wr = bf16.round_bf16(w).astype(np.float64)
    exact = xr @ wr.T
    k = x.shape[1]
    limit = gamma(k) * (np.abs(xr) @ np.abs(wr).T)
    assert np.all(np.abs(got - exact) <= limit), float(np.max(np.abs(got - exact) / limit))


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def test_linear_forward_and_backward_in_bf16(backend):
    rng = np.random.default_rng(1)
    t, n_in, n_out, r = 64, 96, 80, 4
    x = rng.standard_normal((t, n_in)).astype(np.float32)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    packed = bf16.pack(w, backend)
    # a LoRA branch stays float32: compared as its own float32 product below
    a = (0.1 * rng.standard_normal((r, n_in))).astype(np.float32)
    b = (0.1 * rng.standard_normal((n_out, r))).astype(np.float32)
    (y, cache), = linear_forward_group(x, [Linear(packed, lora=(a, b, 0.5))])
    (y0, _), = linear_forward_group(x, [Linear(packed)])
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    assert_bf16_product(y0, x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, n_in)
    assert_rounded_inputs(y0, x, w)
    lora = 0.5 * (x64 @ a.T.astype(np.float64)) @ b.T.astype(np.float64)
    lora_mag = 0.5 * (np.abs(x64) @ np.abs(a.T)) @ np.abs(b.T)
    np.testing.assert_array_less(np.abs((y.astype(np.float64) - y0) - lora),
                                 gamma(n_in + r + 2) * lora_mag + 2 * gamma(1) * np.abs(y0) + 1e-30)

    dy = rng.standard_normal((t, n_out)).astype(np.float32)
    dx, [(dw, _, (da, db))] = linear_backward_group([dy], [cache], [False])
    assert dw is None
    dy64 = dy.astype(np.float64)
    (dx0, _), = [linear_backward_group([dy], [cache._replace(lora=None, xa=None)], [False])]
    assert_bf16_product(dx0, dy64 @ w64, np.abs(dy64) @ np.abs(w64), n_out)
    assert_rounded_inputs(dx0, dy, np.ascontiguousarray(w.T))
    # the LoRA gradients are float32 products of float32 inputs
    exact_db = 0.5 * dy64.T @ (x64 @ a.T.astype(np.float64))
    np.testing.assert_allclose(db, exact_db, rtol=0, atol=1e-4 * np.abs(exact_db).max())


def test_a_trained_weights_gradient_in_bf16(backend):
    """Full fine-tuning in bf16: dW = dY^T x with both in bf16 (x's columns packed per block),
    float32 output, beside the float32 master weight the optimizer keeps."""
    rng = np.random.default_rng(4)
    t, n_in, n_out = 256, 512, 384           # large enough for the engine's column blocks
    x = rng.standard_normal((t, n_in)).astype(np.float32)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    (_, cache), = linear_forward_group(x, [Linear(bf16.pack(w, backend))])
    dy = rng.standard_normal((t, n_out)).astype(np.float32)
    _, [(dw, _, _)] = linear_backward_group([dy], [cache], [True])
    dy64, x64 = dy.astype(np.float64), x.astype(np.float64)
    assert_bf16_product(dw, dy64.T @ x64, np.abs(dy64).T @ np.abs(x64), t)
    assert_rounded_inputs(dw, np.ascontiguousarray(dy.T), np.ascontiguousarray(x.T))


def test_experts_in_bf16(backend):
    rng = np.random.default_rng(2)
    t, c, f, n_expert, k = 48, 64, 96, 4, 2
    x = rng.standard_normal((t, c)).astype(np.float32)
    experts = [rng.standard_normal((n_expert, f, c)).astype(np.float32),      # gate
               rng.standard_normal((n_expert, f, c)).astype(np.float32),      # up
               rng.standard_normal((n_expert, c, f)).astype(np.float32)]      # down
    packed = [Stack([bf16.pack(w[e], backend) for e in range(n_expert)], w.shape)
              for w in experts]
    selected = np.stack([rng.permutation(n_expert)[:k] for _ in range(t)])    # (T, K)
    order, offsets, token_of = dispatch_order(selected, n_expert)
    ys, cache = experts_forward_train(x, order, offsets, token_of, *packed, "silu")
    # the gate and up products are the first bf16 products: check them directly
    xs = x[token_of].astype(np.float64)
    offs = np.asarray(offsets).tolist()
    segments = [slice(offs[e], offs[e + 1]) for e in range(n_expert)]
    w64 = [w.astype(np.float64) for w in experts]
    for i, got in ((0, cache.g), (1, cache.u)):
        exact = np.concatenate([xs[s] @ w64[i][e].T for e, s in enumerate(segments)])
        mag = np.concatenate([np.abs(xs[s]) @ np.abs(w64[i][e]).T for e, s in enumerate(segments)])
        assert_bf16_product(got, exact, mag, c)
        for e, s in enumerate(segments):
            assert_rounded_inputs(got[s], x[token_of][s], experts[i][e])
    # down: its input h is the float32 activation of the bf16 gate/up outputs (cached g, u)
    h = (cache.g / (1 + np.exp(-cache.g.astype(np.float64)))) * cache.u
    for e, s in enumerate(segments):
        mag = np.abs(h[s]) @ np.abs(w64[2][e]).T
        assert np.all(np.abs(ys[s] - h[s] @ w64[2][e].T) <= bound(f, mag) + 1e-5 * mag)
    dys = rng.standard_normal(ys.shape).astype(np.float32)
    dx, dws, dloras = experts_backward(dys, cache)
    assert dws == (None, None, None) and dx.shape == (t, c)


@pytest.mark.parametrize("frozen", [True, False])
def test_loss_head_in_bf16(backend, frozen):
    """The head's logits h W^T in bf16 move each logit by at most E_tv = bound(C, |h_t||w_v|);
    the log-sum-exp and the label logit each move by at most max_v E_tv, so each token's loss
    by at most 2 max_v E_tv (the mean: their mean)."""
    rng = np.random.default_rng(3)
    t, c, v = 40, 64, 300
    h = rng.standard_normal((t, c)).astype(np.float32)
    w = (rng.standard_normal((v, c)) / 4).astype(np.float32)
    labels = rng.integers(0, v, t)
    packed = bf16.pack(w, backend)
    if frozen:
        loss, _, dh = cross_entropy_frozen_head(h, packed, labels, chunk=128)
    else:
        loss, _, _ = cross_entropy_forward(h, packed, labels, chunk=128)
    h64, w64 = h.astype(np.float64), w.astype(np.float64)
    z = h64 @ w64.T
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    nll = lse - z[np.arange(t), labels]
    e_max = bound(c, np.abs(h64) @ np.abs(w64).T).max(1)                       # (T,)
    assert abs(loss - nll.mean()) <= (2 * e_max).mean() + gamma(t) * np.abs(nll).mean()
    assert abs(loss - nll.mean()) > 4 * gamma(c) * nll.mean()                  # not float32
    if frozen:
        # dh_t = (sum_v p_tv w_v - w_label) / T: p moves by a factor within exp(+-2 E), so by at
        # most (e^{2E} - 1) p in each entry (sum <= e^{2E} - 1), and the product's two inputs
        # (p and w_v) by u each when they are rounded to bf16 (2u; its output is float32).
        p = np.exp(z - lse[:, None])
        exact = (p @ w64 - w64[labels]) / t
        slack = (np.expm1(2 * e_max)[:, None] + 2 * U) * np.abs(w64).max(0)[None, :] / t
        assert np.all(np.abs(dh - exact) <= 2 * slack)
