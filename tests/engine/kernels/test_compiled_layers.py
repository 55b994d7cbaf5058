"""Compiled layer kernels (app.engine.kernels.compiled_layers) against their NumPy twins.

Where the compiled kernel does the twin's float32 operations in the twin's order (RoPE, the
gated activations' products) the bits must match; where it sums in another order (RMSNorm's
row sums and weight gradient) or calls another exp (the activations, softmax), both paths are
held to the float32 bound of the operation against float64 (tests/float32_bounds.py). The
float64 gradient checks of test_backward_dense run on whichever path is on: the suite runs
with the default (compiled) and with WORKBENCH_KERNELS=numpy.
"""

from __future__ import annotations

import numpy as np
import pytest

from app.engine.kernels import compiled_layers, jit
from app.engine.kernels.activations import (geglu_backward, geglu_forward, gelu_tanh,
                                            gelu_tanh_grad, swiglu_backward, swiglu_forward)
from app.engine.kernels.attention import attention_backward, attention_forward, attention_mask
from app.engine.kernels.norm import rmsnorm_backward, rmsnorm_forward
from app.engine.kernels.rope import NEOX, NORM, rope_angles, rope_backward, rope_forward
from tests.float32_bounds import as64, assert_within_gamma, gamma

pytestmark = pytest.mark.skipif(not jit.compiled(), reason="compiled kernels are off")


def both(monkeypatch, fn):
    """(fn() on the NumPy twins, fn() compiled)."""
    monkeypatch.setenv(jit.ENV_VAR, "numpy")
    twin = fn()
    monkeypatch.delenv(jit.ENV_VAR)
    return twin, fn()


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", [NORM, NEOX])
@pytest.mark.parametrize("n_rot", [16, 8])   # 8 < head dim: the tail is copied
def test_rope_bit_identical_both_ways(monkeypatch, dtype, mode, n_rot):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((37, 3, 16)).astype(dtype)
    cos, sin = rope_angles(np, np.arange(5, 42), n_rot, 10000.0, 1.0, dtype)

    def run():
        out, cache = rope_forward(x, cos, sin, n_rot, mode)
        return out, rope_backward(x, cache)
    twin, got = both(monkeypatch, run)
    for a, b in zip(got, twin):
        np.testing.assert_array_equal(bits(a), bits(b))


def _norm_inputs(shape, w_len, seed=2):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    return x, rng.standard_normal(w_len).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape,w_len", [((300, 96), 96), ((70, 4, 20), 20)])  # per-head norm
def test_rmsnorm_forward_within_the_float32_bound(monkeypatch, shape, w_len):
    """rstd is float64 math rounded once to float32 (the row sums differ only in float64's
    last bits); out = (x r) w adds two roundings."""
    x, w, _ = _norm_inputs(shape, w_len)
    x64, w64 = as64(x, w)
    r64 = 1.0 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5)
    for out, cache in both(monkeypatch, lambda: rmsnorm_forward(x, w, 1e-5)):
        assert_within_gamma(cache.rstd, r64, r64, 1, "rstd")
        assert_within_gamma(out, x64 * r64 * w64, np.abs(x64 * r64 * w64), 3, "out")


@pytest.mark.parametrize("shape,w_len", [((300, 96), 96), ((70, 4, 20), 20)])
def test_rmsnorm_backward_within_the_float32_bound(monkeypatch, shape, w_len):
    """With the forward's rstd r fixed: dw = sum over rows of dout x r (n rows, float32 sums in
    another order), dx = r (g - x r mean(g x r)) (C-term mean, then three roundings)."""
    x, w, dout = _norm_inputs(shape, w_len)
    _, cache = rmsnorm_forward(x, w, 1e-5)
    x64, w64, d64, r64 = as64(x, w, dout, cache.rstd)
    xn, g = x64 * r64, d64 * w64
    c, rows = x.shape[-1], x.size // x.shape[-1]
    gx, gx_abs = (g * xn).mean(-1, keepdims=True), np.abs(g * xn).mean(-1, keepdims=True)
    dx_exact, dx_mag = r64 * (g - xn * gx), np.abs(r64) * (np.abs(g) + np.abs(xn) * gx_abs)
    dw_exact = (d64 * xn).reshape(-1, c).sum(0)
    dw_mag = np.abs(d64 * xn).reshape(-1, c).sum(0)
    for dx, dw in both(monkeypatch, lambda: rmsnorm_backward(dout, cache)):
        assert_within_gamma(dx, dx_exact, dx_mag, c + 6, "dx")
        assert_within_gamma(dw, dw_exact, dw_mag, rows + 2, "dw")


def test_rmsnorm_backward_same_bits_on_one_and_two_threads(monkeypatch):
    """dw is summed over blocks of a fixed size, whatever the thread count."""
    x, w, dout = _norm_inputs((700, 64), 64)
    _, cache = rmsnorm_forward(x, w, 1e-5)
    runs = []
    for threads in ("1", "2"):
        monkeypatch.setenv("WORKBENCH_THREADS", threads)
        runs.append(rmsnorm_backward(dout, cache))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_exp32_within_two_ulp_and_exact_at_the_ends():
    """Cephes' expf over float32's whole range, through the backward's probabilities kernel
    (scale 1, mask 0, lse 0: exp(s)); below the range 0 (masked keys stay exactly 0)."""
    x = np.concatenate([np.linspace(-87.3, 88.7, 200_001, dtype=np.float32),
                        np.array([-np.inf, -1e4, -87.4, 0.0, 1e-30, 88.8, np.inf], np.float32)])
    s = x.copy().reshape(1, 1, -1)
    compiled_layers.kernels().softmax_probs(s, np.zeros((1, x.size), np.float32), 0, 0,
                                            np.float32(1), np.zeros((1, 1), np.float32), 0)
    got, exact = s.ravel()[:-7], np.exp(x[:-7].astype(np.float64))
    assert_within_gamma(got, exact, exact, 2, "exp32")
    np.testing.assert_array_equal(s.ravel()[-7:], [0, 0, 0, 1, 1, np.inf, np.inf])


def test_swiglu_within_the_float32_bound(monkeypatch):
    """exp (2 ulp either path), then 1 + e, the reciprocal and the products: a few roundings
    relative to each term; dg's (1 - s) is held to its absolute error."""
    rng = np.random.default_rng(4)
    g, u, dout = ((rng.standard_normal((67, 40)) * 4).astype(np.float32) for _ in range(3))
    g64, u64, d64 = as64(g, u, dout)
    s64 = 1.0 / (1.0 + np.exp(-g64))

    def run():
        out, cache = swiglu_forward(g, u)
        return (out, *swiglu_backward(dout, cache))
    for out, dg, du in both(monkeypatch, run):
        assert_within_gamma(out, g64 * s64 * u64, np.abs(g64 * s64 * u64), 8, "out")
        assert_within_gamma(du, d64 * g64 * s64, np.abs(d64 * g64 * s64), 8, "du")
        dg_exact = d64 * u64 * s64 * (1.0 + g64 * (1.0 - s64))
        assert_within_gamma(dg, dg_exact, np.abs(d64 * u64 * s64) * (1.0 + 2.0 * np.abs(g64)),
                            10, "dg")


def test_geglu_exact_within_the_float32_bound(monkeypatch):
    """tanh is held to its absolute error (GELU uses 1 + tanh): each result to a few roundings
    of |x| times its other factors."""
    rng = np.random.default_rng(6)
    g, u, dout = ((rng.standard_normal((67, 40)) * 4).astype(np.float32) for _ in range(3))
    g64, u64, d64 = as64(g, u, dout)
    gelu, grad = gelu_tanh(g64), gelu_tanh_grad(g64)

    def run():
        out, cache = geglu_forward(g, u, exact=True)
        return (out, *geglu_backward(dout, cache))
    for out, dg, du in both(monkeypatch, run):
        assert_within_gamma(out, gelu * u64, np.abs(g64 * u64), 8, "out")
        assert_within_gamma(du, d64 * gelu, np.abs(d64 * g64), 8, "du")
        assert_within_gamma(dg, d64 * u64 * grad, np.abs(d64 * u64) * (1.0 + 2.0 * g64 ** 2),
                            10, "dg")


def test_geglu_table_path_stays_bit_exact_with_the_twin(monkeypatch):
    """Inference's fp16-table GELU runs the NumPy code either way."""
    rng = np.random.default_rng(7)
    g, u = ((rng.standard_normal((33, 24)) * 4).astype(np.float32) for _ in range(2))
    twin, got = both(monkeypatch, lambda: geglu_forward(g, u)[0])
    np.testing.assert_array_equal(bits(got), bits(twin))


@pytest.mark.parametrize("tq,h,hkv,window", [(200, 4, 2, 0), (150, 2, 1, 40)])
def test_attention_within_a_normwise_float32_bound(monkeypatch, tq, h, hkv, window):
    """Against the twin in float64: a score passes D products into exp, a probability sums Tk
    exps, an output sums Tk products; each result is held to gamma(2 (D + Tk) + 32) times the
    largest magnitude of its tensor (a lost key, a wrong block or mask is O(that magnitude))."""
    rng = np.random.default_rng(5)
    d = 16
    q, k, v, dout = (rng.standard_normal(shape).astype(np.float32)
                     for shape in ((tq, h, d), (tq, hkv, d), (tq, hkv, d), (tq, h, d)))
    mask = attention_mask(np, np.arange(tq), np.arange(tq), window)

    def run(*arrays):
        out, cache = attention_forward(*arrays[:3], 0.25, mask)
        return (out, cache.lse, *attention_backward(arrays[3], cache))
    monkeypatch.setenv(jit.ENV_VAR, "numpy")
    exact = run(*as64(q, k, v, dout))
    n = 2 * (d + tq) + 32
    for got in both(monkeypatch, lambda: run(q, k, v, dout)):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, exact):
            assert np.abs(a - b).max() <= gamma(n) * np.abs(b).max(), name


def test_numpy_switch_runs_the_twins(monkeypatch):
    monkeypatch.setenv(jit.ENV_VAR, "numpy")
    assert not compiled_layers.runs_on(np.zeros(3, np.float32))
