"""Backward twins of the dense forward kernels, each against a float64 finite-difference check."""

from __future__ import annotations

import numpy as np
import pytest

from app.engine.kernels import embedding as emb
from app.engine.kernels.activations import (geglu_backward, geglu_forward, glu_backward,
                                            glu_forward, sigmoid, sigmoid_backward,
                                            swiglu_backward, swiglu_forward)
from app.engine.kernels.attention import attention_backward, attention_forward, attention_mask
from app.engine.kernels.gradcheck import check_backward
from app.engine.kernels.linear import linear_backward, linear_forward
from app.engine.kernels.norm import rmsnorm_backward, rmsnorm_forward
from app.engine.kernels.rope import NEOX, NORM, rope_angles, rope_backward, rope_forward

TOL = 1e-6


def rng(seed=0):
    return np.random.default_rng(seed)


# --- rmsnorm ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(6, 16), (5, 3, 8)], ids=["T,C", "T,H,D per-head"])
def test_rmsnorm_backward(shape):
    r = rng(1)
    x, w = r.standard_normal(shape), r.standard_normal(shape[-1])
    err = check_backward(lambda x, w: rmsnorm_forward(x, w, 1e-5), rmsnorm_backward, [x, w])
    assert err < TOL
    _, dw = rmsnorm_backward(np.ones(shape), rmsnorm_forward(x, w, 1e-5)[1])
    assert dw.shape == (shape[-1],)


# --- rope ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [NORM, NEOX])
@pytest.mark.parametrize("n_rot", [8, 4], ids=["n_rot=D", "n_rot<D"])
def test_rope_backward(mode, n_rot):
    x, pos = rng(2).standard_normal((6, 3, 8)), np.arange(5, 11)
    cos, sin = rope_angles(np, pos, n_rot, 10000.0, 1.0, np.float64)
    err = check_backward(lambda x: rope_forward(x, cos, sin, n_rot, mode), rope_backward, [x])
    assert err < TOL


def test_rope_backward_is_the_inverse_rotation():
    x, pos = rng(3).standard_normal((4, 2, 8)), np.arange(4)
    cos, sin = rope_angles(np, pos, 6, 500.0, 1.0, np.float64)
    out, cache = rope_forward(x, cos, sin, 6, NEOX)
    np.testing.assert_allclose(rope_backward(out, cache), x, atol=1e-12)


# --- attention -------------------------------------------------------------------------------

ATTN_CASES = {
    # name: (Tq, Tk, H, Hkv, D, window, scale)
    "mha": (7, 7, 2, 2, 5, 0, 5 ** -0.5),
    "gqa": (7, 7, 4, 2, 5, 0, 5 ** -0.5),
    "window": (9, 9, 4, 2, 4, 3, 0.5),
    "scale": (6, 6, 2, 1, 4, 0, 1.7),
    "decode_prefix": (3, 10, 4, 2, 4, 0, 0.4),
    "decode_prefix_window": (3, 10, 4, 2, 4, 4, 0.4),
    # one kv head: query rows split into blocks (attention.MIN_PIECES), dk/dv summed over them
    "query_row_blocks": (150, 150, 4, 1, 4, 0, 0.5),
    "query_row_blocks_prefix_window": (140, 160, 2, 1, 3, 20, 0.4),
}


def _attn_inputs(tq, tk, h, hkv, d, window, seed=4):
    r = rng(seed)
    q = r.standard_normal((tq, h, d))
    k = r.standard_normal((tk, hkv, d))
    v = r.standard_normal((tk, hkv, d + 1))                          # Dv != D on purpose
    mask = attention_mask(np, np.arange(tk - tq, tk), np.arange(tk), window)  # q offset by prefix
    return q, k, v, mask


@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_attention_backward(case):
    tq, tk, h, hkv, d, window, scale = ATTN_CASES[case]
    q, k, v, mask = _attn_inputs(tq, tk, h, hkv, d, window)
    err = check_backward(lambda q, k, v: attention_forward(q, k, v, scale, mask),
                         attention_backward, [q, k, v])
    assert err < TOL


@pytest.mark.parametrize("tq,tk", [(6, 6), (3, 8)])
def test_attention_cache_holds_no_probabilities(tq, tk):
    q, k, v, mask = _attn_inputs(tq, tk, 4, 2, 4, 0)
    _, cache = attention_forward(q, k, v, 0.5, mask)
    for item in cache:
        if isinstance(item, np.ndarray) and item.ndim >= 2 and item.shape[-2:] == (tq, tk):
            assert item is mask, f"cache holds a (.., Tq, Tk) array {item.shape}"
    assert cache.lse.shape == (2, 2, tq)


# --- activations -----------------------------------------------------------------------------

def test_sigmoid_backward():
    x = rng(5).standard_normal((4, 6)) * 3
    err = check_backward(lambda x: (sigmoid(x), sigmoid(x)), sigmoid_backward, [x])
    assert err < TOL


def test_swiglu_backward():
    g, u = rng(6).standard_normal((2, 5, 7)) * 2
    assert check_backward(swiglu_forward, swiglu_backward, [g, u]) < TOL


def test_geglu_backward_exact():
    g, u = rng(7).standard_normal((2, 5, 7)) * 2
    err = check_backward(lambda g, u: geglu_forward(g, u, exact=True), geglu_backward, [g, u])
    assert err < TOL


def test_glu_backward_dispatch():
    g, u = rng(8).standard_normal((2, 3, 4))
    d = rng(9).standard_normal((3, 4))
    for got, want in [(glu_backward("silu", d, glu_forward("silu", g, u)[1]),
                       swiglu_backward(d, swiglu_forward(g, u)[1])),
                      (glu_backward("gelu", d, geglu_forward(g, u, exact=True)[1]),
                       geglu_backward(d, geglu_forward(g, u, exact=True)[1]))]:
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError):
        glu_backward("relu", d, glu_forward("silu", g, u)[1])


# --- linear ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("lora", [False, True], ids=["nolora", "lora"])
@pytest.mark.parametrize("need_dw", [False, True], ids=["frozen", "need_dw"])
def test_linear_backward(bias, lora, need_dw):
    r = rng(10)
    t, n_in, n_out, rank, scale = 5, 6, 4, 2, 0.75
    x, w = r.standard_normal((t, n_in)), r.standard_normal((n_out, n_in))
    b = r.standard_normal(n_out)
    la, lb = r.standard_normal((rank, n_in)), r.standard_normal((n_out, rank))

    def forward(x, w, b, la, lb):
        return linear_forward(x, w, b if bias else None, (la, lb, scale) if lora else None)

    def backward(dout, cache):
        dx, dw, db, dl = linear_backward(dout, cache, need_dw)
        assert (dw is None) == (not need_dw)
        assert (db is None) == (not bias)
        assert (dl is None) == (not lora)
        return (dx, dw, db) + (dl if lora else (None, None))

    err = check_backward(forward, backward, [x, w, b, la, lb],
                         differentiable=[True, need_dw, bias, lora, lora])
    assert err < TOL


def test_linear_backward_with_lora_dropout():
    """A fixed dropout mask on the LoRA branch: the base path sees x, the LoRA path x * mask."""
    r = rng(12)
    x, w = r.standard_normal((6, 5)), r.standard_normal((3, 5))
    la, lb = r.standard_normal((2, 5)), r.standard_normal((3, 2))
    mask = (r.random((6, 5)) > 0.3) / 0.7
    forward = lambda x, w, la, lb: linear_forward(x, w, None, (la, lb, 0.5), dropout_mask=mask)
    backward = lambda d, c: (lambda dx, dw, db, dl: (dx, dw, *dl))(*linear_backward(d, c, True))
    assert check_backward(forward, backward, [x, w, la, lb]) < TOL
    y_drop = forward(x, w, la, lb)[0]
    y_plain = linear_forward(x, w, None, (la, lb, 0.5))[0]
    assert not np.allclose(y_drop, y_plain)


# --- embeddings ------------------------------------------------------------------------------

# repeated tokens: 3 appears 20 times (a long run, > _LIGHT), 7 four times, others once
TOKENS = np.array([3] * 20 + [7, 1, 7, 0, 7, 9, 7, 2], dtype=np.int64)
rng(11).shuffle(TOKENS)


def test_embedding_backward():
    table = rng(12).standard_normal((12, 5))                         # rows 4..8, 10, 11 unused
    err = check_backward(lambda t, tok: emb.embedding_forward(t, tok),
                         lambda d, c: (emb.embedding_backward(d, c, 12), None), [table, TOKENS])
    assert err < TOL


def test_embedding_backward_matches_loop_and_gathered_rows():
    table = rng(13).standard_normal((12, 5))
    out, cache = emb.embedding_forward(table[TOKENS], TOKENS, gathered=True)
    np.testing.assert_array_equal(out, table[TOKENS])
    d = rng(14).standard_normal(out.shape)
    expect = np.zeros_like(table)
    for i, tok in enumerate(TOKENS):
        expect[tok] += d[i]
    np.testing.assert_allclose(emb.embedding_backward(d, cache, 12), expect, rtol=1e-12, atol=1e-12)
    got32 = emb.embedding_backward(d.astype(np.float32), cache, 12)
    assert got32.dtype == np.float32
    np.testing.assert_allclose(got32, expect, rtol=1e-5, atol=1e-5)


def test_lora_embedding_backward():
    r = rng(15)
    a, b = r.standard_normal((12, 3)), r.standard_normal((5, 3))
    err = check_backward(lambda a, b: emb.lora_embedding_forward(a, b, TOKENS, 0.6),
                         emb.lora_embedding_backward, [a, b])
    assert err < TOL


# --- the check has teeth; float32 runs -------------------------------------------------------

def test_wrong_gradient_fails_the_check():
    q, k, v, mask = _attn_inputs(7, 7, 4, 2, 5, 3)
    fwd = lambda q, k, v: attention_forward(q, k, v, 0.4, mask)
    wrong = lambda d, c: tuple(g * 1.01 for g in attention_backward(d, c))
    assert check_backward(fwd, attention_backward, [q, k, v]) < TOL
    assert check_backward(fwd, wrong, [q, k, v]) > 1e-3


def test_float32_backwards_match_float64():
    r = rng(16)
    q, k, v, mask = _attn_inputs(5, 8, 4, 2, 4, 3)
    x, w = r.standard_normal((5, 3, 4)), r.standard_normal(4)
    g, u = r.standard_normal((2, 5, 6))
    lw, la, lb = r.standard_normal((3, 6)), r.standard_normal((2, 6)), r.standard_normal((3, 2))
    cos, sin = rope_angles(np, np.arange(5), 4, 10000.0, 1.0, np.float64)
    runs = [
        (lambda q, k, v: attention_forward(q, k, v, 0.5, mask), attention_backward, [q, k, v]),
        (lambda x, w: rmsnorm_forward(x, w, 1e-6), rmsnorm_backward, [x, w]),
        (lambda x: rope_forward(x, cos.astype(x.dtype), sin.astype(x.dtype), 4, NORM),
         rope_backward, [x]),
        (swiglu_forward, swiglu_backward, [g, u]),
        (lambda g, u: geglu_forward(g, u, exact=True), geglu_backward, [g, u]),
        (lambda x, w, a, b: linear_forward(x, w, None, (a, b, 0.5)),
         lambda d, c: (lambda dx, dw, db, dl: (dx, dw, *dl))(*linear_backward(d, c, True)),
         [g, lw, la, lb]),
    ]
    for fwd, bwd, inputs in runs:
        grads = {}
        for dt in (np.float64, np.float32):
            xs = [i.astype(dt) for i in inputs]
            out, cache = fwd(*xs)
            assert out.dtype == dt
            d = rng(17).standard_normal(out.shape).astype(dt)
            res = bwd(d, cache)
            grads[dt] = [g for g in (res if isinstance(res, tuple) else (res,)) if g is not None]
        for g64, g32 in zip(grads[np.float64], grads[np.float32]):
            assert g32.dtype == np.float32, bwd.__name__
            np.testing.assert_allclose(g32, g64, rtol=1e-4, atol=1e-4, err_msg=bwd.__name__)
