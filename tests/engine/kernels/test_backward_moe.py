"""MoE backward kernels: float64 finite-difference checks (app.engine.kernels.gradcheck) for the
router, the expert block (SwiGLU / exact GeGLU, LoRA on every projection, frozen or trained
expert weights, experts without tokens) and the combine, plus structural regressions."""

from __future__ import annotations

import numpy as np
import pytest

from app.engine.kernels.activations import gelu_tanh, sigmoid
from app.engine.kernels.gradcheck import check_backward, directional_check
from app.engine.kernels.moe import (RENORM_MIN, combine, combine_backward, combine_forward,
                                    dispatch_order, experts_backward, experts_forward,
                                    experts_forward_train, router_backward, router_forward)

TOL = 1e-6


# ---- router ------------------------------------------------------------------------------------

def _router_check(logits, k, renorm, scale, seed=0):
    def fwd(lg):
        _, w, cache = router_forward(lg, k, renorm, scale)
        return w, cache
    return check_backward(fwd, lambda dw, cache: router_backward(dw, cache), [logits], seed=seed)


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("scale", [1.0, 1.5])
@pytest.mark.parametrize("k", [1, 2])
def test_router_backward(renorm, scale, k):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((11, 4)) * 2.0
    for seed in range(3):
        err = _router_check(logits, k, renorm, scale, seed)
        assert err < TOL, err


@pytest.mark.parametrize("k,e", [(1, 20000), (2, 40000)])
def test_router_backward_renorm_clamp_active(k, e):
    """With very many experts the top-k sum falls below 6.1035e-5: the clamp is a constant."""
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((4, e)) * 0.01                          # near-uniform rows
    logits[3, :k] += 6.0                                                 # one row not clamped
    _, _, (probs, selected, total, clamped, _) = router_forward(logits, k, True, 1.5)
    assert clamped[:3].all() and not clamped[3].any()
    assert np.all(total[:3] == RENORM_MIN)
    for seed in range(3):
        err = _router_check(logits, k, True, 1.5, seed)
        assert err < TOL, err


def test_router_backward_clamp_uses_constant_sum():
    """Clamped rows: dlogits equals the gradient of (scale / RENORM_MIN) * p[selected]."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 20000)) * 0.01
    _, _, cache = router_forward(logits, 1, True, 1.0)
    dw = rng.standard_normal((2, 1))
    got = router_backward(dw, cache)
    probs, sel = cache.probs, cache.selected
    dp = np.zeros_like(probs)
    np.put_along_axis(dp, sel, dw / RENORM_MIN, axis=-1)
    np.testing.assert_allclose(got, probs * (dp - (dp * probs).sum(-1, keepdims=True)), rtol=1e-12)


# ---- experts -----------------------------------------------------------------------------------

def _expert_problem(t, c, f, e, k, r, lora_on, empty=(), seed=0):
    rng = np.random.default_rng(seed)
    allowed = [i for i in range(e) if i not in empty]
    selected = np.array([rng.choice(allowed, k, replace=False) for _ in range(t)])  # (T, K)
    x = rng.standard_normal((t, c))
    ws = [rng.standard_normal((e, f, c)) / np.sqrt(c), rng.standard_normal((e, f, c)) / np.sqrt(c),
          rng.standard_normal((e, c, f)) / np.sqrt(f)]
    loras = []
    for w in ws:
        if lora_on:
            out, inp = w.shape[1:]
            loras += [rng.standard_normal((e, r, inp)) / np.sqrt(inp), rng.standard_normal((e, out, r))]
        else:
            loras += [None, None]
    return selected, x, ws, loras


def _expert_pair(selected, e, act, scales, need_dw):
    order, offsets, token_of = dispatch_order(selected, e)

    def fwd(x, wg, wu, wd, *ab):
        lo = tuple(None if ab[2 * i] is None else (ab[2 * i], ab[2 * i + 1], scales[i]) for i in range(3))
        return experts_forward_train(x, order, offsets, token_of, wg, wu, wd, act, lo)

    def bwd(dys, cache):
        dx, dws, dls = experts_backward(dys, cache, need_dw)
        flat = []
        for d in dls:
            flat += [None, None] if d is None else list(d)
        return (dx, *dws, *flat)
    return fwd, bwd, order, offsets


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("lora_on", [True, False])
@pytest.mark.parametrize("need_dw", [(True, True, True), (False, False, False), (False, True, False)])
@pytest.mark.parametrize("k,e", [(2, 4), (1, 4)])
def test_experts_backward(act, lora_on, need_dw, k, e):
    selected, x, ws, loras = _expert_problem(9, 6, 5, e, k, 3, lora_on, empty=(2,))
    fwd, bwd, _, offsets = _expert_pair(selected, e, act, (0.7, 1.3, 0.4), need_dw)
    assert offsets[2] == offsets[3]                                      # expert 2 gets no token
    inputs = [x, *ws, *loras]
    diff = [True, *need_dw, *[lora_on] * 6]
    for seed in range(2):
        err = check_backward(fwd, bwd, inputs, differentiable=diff, seed=seed)
        assert err < TOL, err
    # each gradient on its own (a directional check sums them, so one could hide another)
    ys, cache = fwd(*inputs)
    r = np.random.default_rng(5).standard_normal(ys.shape)
    grads = bwd(r, cache)
    for i, ok in enumerate(diff):
        if not ok:
            assert grads[i] is None or i > 3                             # frozen: nothing allocated
            continue
        only = [g if j == i else None for j, g in enumerate(grads)]
        err = directional_check(lambda xs: float(np.sum(fwd(*xs)[0] * r)), inputs, only, seed=i)
        assert err < TOL, (i, err)
    for i in range(1, 4):
        if need_dw[i - 1]:
            assert grads[i].shape == ws[i - 1].shape and not grads[i][2].any()
    if lora_on:
        for i in range(4, 10):
            assert grads[i].shape == loras[i - 4].shape and not grads[i][2].any()


def test_experts_backward_bool_need_dw_and_lora_on_one_projection():
    selected, x, ws, loras = _expert_problem(8, 6, 5, 4, 2, 2, True)
    loras[0] = loras[1] = loras[4] = loras[5] = None                     # LoRA on up only
    order, offsets, token_of = dispatch_order(selected, 4)
    lo = (None, (loras[2], loras[3], 0.9), None)
    ys, cache = experts_forward_train(x, order, offsets, token_of, *ws, "silu", lo)
    dx, dws, dls = experts_backward(np.ones_like(ys), cache, need_dw=True)
    assert all(d is not None for d in dws) and dls[0] is None and dls[2] is None
    assert dls[1][0].shape == loras[2].shape and dls[1][1].shape == loras[3].shape


def test_experts_backward_into_reused_dw_out():
    """Reused gradient buffers are overwritten, including experts that got no token this time."""
    _, x, ws, loras = _expert_problem(9, 6, 5, 4, 2, 2, False)
    rng = np.random.default_rng(8)
    bufs = tuple(np.full(w.shape, np.nan) for w in ws)
    for empty in ((), (1,), (0, 3)):
        allowed = [i for i in range(4) if i not in empty]
        selected = np.array([rng.choice(allowed, 2, replace=False) for _ in range(9)])
        order, offsets, token_of = dispatch_order(selected, 4)
        ys, cache = experts_forward_train(x, order, offsets, token_of, *ws, "gelu")
        dys = rng.standard_normal(ys.shape)
        dx, dws, _ = experts_backward(dys, cache, (True, False, True), dw_out=bufs)
        ref_dx, ref_dws, _ = experts_backward(dys, cache, (True, False, True))
        assert dws[0] is bufs[0] and dws[1] is None and dws[2] is bufs[2]
        np.testing.assert_array_equal(dx, ref_dx)
        np.testing.assert_array_equal(dws[0], ref_dws[0])
        np.testing.assert_array_equal(dws[2], ref_dws[2])


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_experts_forward_train_matches_per_token_loop(act):
    selected, x, ws, loras = _expert_problem(7, 6, 5, 4, 2, 2, True)
    order, offsets, token_of = dispatch_order(selected, 4)
    lo = tuple((loras[2 * i], loras[2 * i + 1], 0.5 + i) for i in range(3))
    ys, _ = experts_forward_train(x, order, offsets, token_of, *ws, act, lo)
    if act == "silu":
        np.testing.assert_allclose(ys, experts_forward(x, order, offsets, token_of, *ws, act, lo),
                                   rtol=1e-12, atol=1e-12)
    k = selected.shape[1]
    for i, slot in enumerate(order):
        tok, ex = slot // k, selected.flat[slot]
        xi = x[tok]
        lin = lambda j, v: ws[j][ex] @ v + lo[j][2] * lo[j][1][ex] @ (lo[j][0][ex] @ v)
        g, u = lin(0, xi), lin(1, xi)
        a = g * sigmoid(g) if act == "silu" else gelu_tanh(g)
        np.testing.assert_allclose(ys[i], lin(2, a * u), rtol=1e-12, atol=1e-12)


class _FrozenExperts:
    """A frozen, lazily dequantizing expert stack: readable only as w[e] (one expert)."""

    def __init__(self, w):
        self._w, self.shape, self.reads = w, w.shape, []

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, e):
        assert isinstance(e, int), "experts are read one at a time"
        self.reads.append(e)
        return self._w[e].astype(np.float32)


def test_experts_backward_frozen_lazy_weights_float32():
    selected, x, ws, loras = _expert_problem(16, 8, 6, 4, 2, 2, True, empty=(1,))
    order, offsets, token_of = dispatch_order(selected, 4)
    lo64 = tuple((loras[2 * i], loras[2 * i + 1], 0.5) for i in range(3))
    lo32 = tuple((a.astype(np.float32), b.astype(np.float32), s) for a, b, s in lo64)
    views = [_FrozenExperts(w) for w in ws]
    x32 = x.astype(np.float32)
    ys32, cache32 = experts_forward_train(x32, order, offsets, token_of, *views, "silu", lo32)
    ys64, cache64 = experts_forward_train(x, order, offsets, token_of,
                                          *(w.astype(np.float32).astype(np.float64) for w in ws),
                                          "silu", lo64)
    dys = np.random.default_rng(0).standard_normal(ys64.shape)
    g32 = experts_backward(dys.astype(np.float32), cache32)
    g64 = experts_backward(dys, cache64)
    assert ys32.dtype == g32[0].dtype == g32[2][0][0].dtype == np.float32
    assert g32[1] == (None, None, None)
    np.testing.assert_allclose(g32[0], g64[0], rtol=2e-4, atol=2e-4)
    for a, b in zip(g32[2], g64[2]):
        np.testing.assert_allclose(a[0], b[0], rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(a[1], b[1], rtol=2e-4, atol=2e-4)
    assert all(1 not in v.reads for v in views)                          # empty expert never read


class _NoAddAt:
    """Stands in for np.add: everything passes through except .at, which fails the test."""

    def __init__(self, ufunc):
        self._ufunc = ufunc

    def __call__(self, *a, **kw):
        return self._ufunc(*a, **kw)

    def __getattr__(self, name):
        if name == "at":
            raise AssertionError("np.add.at is ~600x slower than per-segment GEMMs; do not use it")
        return getattr(self._ufunc, name)


def test_no_add_at_in_moe_backward(monkeypatch):
    selected, x, ws, loras = _expert_problem(12, 6, 5, 4, 2, 2, True)
    order, offsets, token_of = dispatch_order(selected, 4)
    lo = tuple((loras[2 * i], loras[2 * i + 1], 0.5) for i in range(3))
    _, weights, rcache = router_forward(np.random.default_rng(0).standard_normal((12, 4)), 2, True, 1.0)
    monkeypatch.setattr(np, "add", _NoAddAt(np.add))
    with pytest.raises(AssertionError):
        np.add.at(np.zeros(3), [0, 0], 1.0)                              # the guard works
    ys, cache = experts_forward_train(x, order, offsets, token_of, *ws, "silu", lo)
    out, ccache = combine_forward(ys, order, weights)
    dys, dweights = combine_backward(np.ones_like(out), ccache)
    experts_backward(dys, cache, need_dw=True)
    router_backward(dweights, rcache)


# ---- combine and the whole block ---------------------------------------------------------------

@pytest.mark.parametrize("k,e", [(2, 4), (1, 4), (3, 5)])
def test_combine_backward(k, e):
    rng = np.random.default_rng(4)
    t, c = 7, 5
    selected = np.array([rng.choice(e, k, replace=False) for _ in range(t)])
    order, _, _ = dispatch_order(selected, e)
    ys, weights = rng.standard_normal((t * k, c)), rng.standard_normal((t, k))
    out, _ = combine_forward(ys, order, weights)
    np.testing.assert_array_equal(out, combine(ys, order, weights))
    for seed in range(3):
        err = check_backward(lambda y, w: combine_forward(y, order, w), combine_backward,
                             [ys, weights], seed=seed)
        assert err < TOL, err


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("renorm,scale,k", [(True, 1.0, 2), (False, 1.5, 2), (True, 2.5, 1)])
def test_moe_block_end_to_end(act, renorm, scale, k):
    """router -> dispatch -> experts -> combine, gradients into x, router logits, LoRA, weights."""
    e = 4
    rng = np.random.default_rng(6)
    t, c, f = 10, 6, 5
    x, logits = rng.standard_normal((t, c)), rng.standard_normal((t, e)) * 2
    _, _, ws, loras = _expert_problem(t, c, f, e, k, 2, True, seed=7)
    sel0, _, _ = router_forward(logits, k, renorm, scale)

    def fwd(x, logits, wg, wu, wd, *ab):
        sel, weights, rcache = router_forward(logits, k, renorm, scale)
        assert np.array_equal(sel, sel0)                                 # selection is constant
        order, offsets, token_of = dispatch_order(sel, e)
        lo = tuple((ab[2 * i], ab[2 * i + 1], 0.8) for i in range(3))
        ys, ecache = experts_forward_train(x, order, offsets, token_of, wg, wu, wd, act, lo)
        out, ccache = combine_forward(ys, order, weights)
        return out, (rcache, ecache, ccache)

    def bwd(dout, cache):
        rcache, ecache, ccache = cache
        dys, dweights = combine_backward(dout, ccache)
        dx, dws, dls = experts_backward(dys, ecache, (True, True, True))
        return (dx, router_backward(dweights, rcache), *dws, *[g for d in dls for g in d])

    for seed in range(3):
        err = check_backward(fwd, bwd, [x, logits, *ws, *loras], seed=seed)
        assert err < TOL, err


def test_gradcheck_detects_a_wrong_gradient():
    selected, x, ws, loras = _expert_problem(9, 6, 5, 4, 2, 3, True)
    fwd, bwd, _, _ = _expert_pair(selected, 4, "silu", (0.7, 1.3, 0.4), (True, True, True))
    inputs = [x, *ws, *loras]
    assert check_backward(fwd, bwd, inputs) < TOL

    def perturbed(dys, cache):
        grads = list(bwd(dys, cache))
        grads[5] = grads[5] * 1.01                                       # dB of the gate LoRA 1% off
        return grads
    assert check_backward(fwd, perturbed, inputs) > 1e-4

    def dropped(dys, cache):
        grads = list(bwd(dys, cache))
        grads[0] = grads[0].copy()
        grads[0][3] = 0.0                                                # one token's dx lost
        return grads
    assert check_backward(fwd, dropped, inputs) > 1e-4


def test_quantized_experts_through_reused_tiles_match_the_cached_store(tmp_path):
    """A store without cache dequantizes each expert into the thread's reused buffer: the
    same forward and backward, bit for bit, as with every expert cached."""
    from app.engine.io.gguf import quantize, read_gguf, write_gguf
    from app.engine.kernels.quants import Q8_0
    from app.engine.model.weights import WeightStore

    e, f, c, t, k = 4, 32, 64, 24, 2
    rng = np.random.default_rng(3)
    shapes = {"gate": (e, f, c), "up": (e, f, c), "down": (e, c, f)}
    path = tmp_path / "experts.gguf"
    write_gguf(path, {"general.architecture": "llama"},
               {f"blk.0.ffn_{p}_exps.weight": (quantize(rng.standard_normal(s), Q8_0), Q8_0)
                for p, s in shapes.items()})
    x = rng.standard_normal((t, c), dtype=np.float32)
    order, offsets, token_of = dispatch_order(rng.integers(0, e, (t, k)), e)
    dys = rng.standard_normal((t * k, c), dtype=np.float32)
    results = []
    for budget in (1 << 30, 0):
        store = WeightStore(read_gguf(path), budget)
        views = [store.experts(f"blk.0.ffn_{p}_exps.weight") for p in shapes]
        ys, cache = experts_forward_train(x, order, offsets, token_of, *views, "silu")
        results.append((ys, experts_backward(dys, cache)[0]))
    for cached, tiled in zip(*results):
        np.testing.assert_array_equal(cached, tiled)
    first = views[0].tile(0, 0)
    assert views[0].tile(1, 0) is first                                 # one buffer, reused
    np.testing.assert_array_equal(views[0].tile(1, 0), views[0][1])
