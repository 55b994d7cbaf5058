"""Optimizers (app.engine.training.optimizers): AdamW/SGD against float64 references of ggml-opt's update rule,
clipping and non-finite handling, L-BFGS on Rosenbrock and least squares, schedules, state_dict
round trips (bit-identical continuation) and gradient accumulation."""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest

from app.engine.kernels import compiled_adamw, jit
from app.engine.training import optimizers as optim
from app.engine.errors import CheckpointError, ConfigError
from app.engine.training.optimizers import (LBFGS, SGD, AdamW, GradAccumulator, StepStats,
                                            make_schedule)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """1024-element chunks, so the parameters below exercise the chunked loop and its tail
    (the compiled kernels' pieces too)."""
    monkeypatch.setattr(optim, "_CHUNK_BYTES", 1024)
    monkeypatch.setattr(optim, "_COMPILED_CHUNK", 1000)


def make_params(dtype=np.float64, seed=0):
    """A mix of layouts: multi-chunk (2500 > 1024 elements), small, scalar, non-contiguous."""
    rng = np.random.default_rng(seed)
    return {
        "big": rng.standard_normal((50, 50)).astype(dtype),
        "small": rng.standard_normal(7).astype(dtype),
        "scalar": np.array(0.5, dtype),
        "fortran": np.asfortranarray(rng.standard_normal((6, 5)).astype(dtype)),
    }


def make_grads(params, seed, scale=1.0, skip=()):
    rng = np.random.default_rng(1000 + seed)
    return {k: (scale * rng.standard_normal(p.shape)).astype(p.dtype)
            for k, p in params.items() if k not in skip}


def clip_ref(grads, gclip, max_grad_norm):
    """Float64 reference clipping: global-norm scaling, then element-wise clamp."""
    g = {k: v.astype(np.float64) for k, v in grads.items()}
    norm = math.sqrt(sum(float(np.sum(v * v)) for v in g.values()))
    if max_grad_norm > 0 and norm > max_grad_norm:
        g = {k: v * (max_grad_norm / norm) for k, v in g.items()}
    n_clipped = 0
    if gclip > 0:
        n_clipped = sum(int(np.sum(np.abs(v) > gclip)) for v in g.values())
        g = {k: np.clip(v, -gclip, gclip) for k, v in g.items()}
    return g, norm, n_clipped


class AdamWRef:
    """Straightforward float64 AdamW exactly as ggml-opt writes it."""

    def __init__(self, params, lr, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0, gclip=0.0,
                 max_grad_norm=0.0):
        self.w = {k: v.astype(np.float64) for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.w.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.w.items()}
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, beta1, beta2, eps, wd
        self.gclip, self.max_grad_norm, self.t = gclip, max_grad_norm, 0

    def step(self, grads):
        g, norm, n_clipped = clip_ref(grads, self.gclip, self.max_grad_norm)
        self.t += 1
        b1h = 1.0 / (1.0 - self.b1 ** self.t)
        b2h = 1.0 / (1.0 - self.b2 ** self.t)
        for k, gk in g.items():
            self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * gk
            self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * gk ** 2
            self.w[k] = (self.w[k] * (1 - self.lr * self.wd)
                         - self.lr * (self.m[k] * b1h) / (np.sqrt(self.v[k] * b2h) + self.eps))
        return norm, n_clipped


# ---- AdamW ----------------------------------------------------------------------------------

ADAMW_CASES = {
    "plain": dict(),
    "weight_decay": dict(weight_decay=0.1),
    "gclip": dict(gclip=1.0),
    "max_grad_norm": dict(max_grad_norm=5.0),
    "all": dict(weight_decay=0.05, gclip=0.08, max_grad_norm=5.0, beta1=0.8, beta2=0.99, eps=1e-6),
}


@pytest.mark.parametrize("case", list(ADAMW_CASES))
def test_adamw_matches_float64_reference(case):
    kw = ADAMW_CASES[case]
    params = make_params(np.float64)
    ref_kw = {("wd" if k == "weight_decay" else k): v for k, v in kw.items()}
    ref = AdamWRef(params, lr=0.01, **ref_kw)
    opt = AdamW(params, lr=0.01, **kw)
    n_total = sum(p.size for p in params.values())
    for step in range(6):
        skip = ("small",) if step == 3 else ()  # a missing gradient: that parameter sits still
        grads = make_grads(params, step, skip=skip)
        norm, n_clipped = ref.step(grads)
        stats = opt.step(grads)
        n = n_total - (params["small"].size if skip else 0)
        assert not stats.skipped and stats.n_params == n and stats.lr == 0.01
        assert stats.grad_norm == pytest.approx(norm, rel=1e-12)
        assert stats.clipped_fraction == pytest.approx(n_clipped / n, abs=1e-12)
        if kw.get("gclip"):
            assert 0.05 < stats.clipped_fraction < 0.95  # the clamp engages on some elements
        if kw.get("max_grad_norm"):
            assert norm > kw["max_grad_norm"]          # the global clipping engages
        for k in params:
            np.testing.assert_allclose(params[k], ref.w[k], rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(opt.state["m"][k], ref.m[k], rtol=1e-12, atol=1e-15)
            np.testing.assert_allclose(opt.state["v"][k], ref.v[k], rtol=1e-12, atol=1e-15)
    assert opt.step_count == 6


def test_adamw_float32_close_to_float64_reference():
    params = make_params(np.float32)
    ref = AdamWRef(params, lr=1e-3, wd=0.01, gclip=1.5, max_grad_norm=40.0)
    opt = AdamW(params, lr=1e-3, weight_decay=0.01, gclip=1.5, max_grad_norm=40.0)
    for step in range(5):
        grads = make_grads(params, step)
        ref.step(grads)
        opt.step(grads)
    for k in params:
        assert params[k].dtype == np.float32 and opt.state["m"][k].dtype == np.float32
        np.testing.assert_allclose(params[k], ref.w[k], rtol=1e-5, atol=1e-6)


def test_adamw_first_update_is_minus_lr_sign_of_gradient():
    params = make_params(np.float64)
    before = copy.deepcopy(params)
    grads = make_grads(params, 0)
    AdamW(params, lr=0.01).step(grads)  # bias correction: m b1h = g, sqrt(v b2h) = |g|
    for k in params:
        delta, g = params[k] - before[k], grads[k]
        np.testing.assert_allclose(delta, -0.01 * g / (np.abs(g) + 1e-8), rtol=1e-9)
        large = np.abs(g) > 1e-3  # eps only matters for tiny gradients
        np.testing.assert_allclose(delta[large], -0.01 * np.sign(g[large]), rtol=1e-5)


def test_adamw_global_norm_clip_scales_to_max_norm():
    params = {"x": np.zeros(4)}
    grads = {"x": np.array([3.0, 4.0, 0.0, 0.0])}  # norm 5
    opt = SGD(params, lr=1.0, max_grad_norm=1.0)
    stats = opt.step(grads)
    assert stats.grad_norm == 5.0 and stats.clipped_fraction == 0.0
    np.testing.assert_allclose(params["x"], [-0.6, -0.8, 0.0, 0.0], rtol=1e-15)
    np.testing.assert_array_equal(grads["x"], [3.0, 4.0, 0.0, 0.0])  # caller's gradient untouched


def test_clip_order_is_global_norm_then_elementwise():
    params = {"x": np.zeros(3)}
    grads = {"x": np.array([10.0, 0.0, 0.1])}
    stats = SGD(params, lr=1.0, gclip=2.0, max_grad_norm=5.0).step(grads)
    # norm 10.0005 -> scaled by 5/10.0005 to (4.9998, 0, 0.05); then clamped to (2, 0, 0.05)
    assert stats.grad_norm == pytest.approx(math.sqrt(100.01))
    assert stats.clipped_fraction == pytest.approx(1 / 3)
    np.testing.assert_allclose(params["x"], [-2.0, 0.0, -0.1 * 5.0 / math.sqrt(100.01)])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("opt_cls", [AdamW, SGD])
def test_nonfinite_gradient_skips_step_and_leaves_state_untouched(bad, opt_cls):
    params = make_params(np.float32)
    opt = opt_cls(params, lr=0.01, gclip=1.0, max_grad_norm=10.0)
    opt.step(make_grads(params, 0))
    snap_params = copy.deepcopy(params)
    snap_state = opt.state_dict()
    grads = make_grads(params, 1)
    grads["big"][17, 3] = bad
    stats = opt.step(grads)
    assert stats.skipped and not math.isfinite(stats.grad_norm)
    for k in params:
        np.testing.assert_array_equal(params[k], snap_params[k])
    assert opt.step_count == 1
    for key in opt_cls._moments:
        for k in params:
            np.testing.assert_array_equal(opt.state[key][k], snap_state[key][k])
    good = opt.step(make_grads(params, 2))  # and the next good step goes through
    assert not good.skipped and opt.step_count == 2


def test_float32_gradient_whose_square_overflows_is_not_skipped():
    params = {"x": np.zeros(4, np.float32)}
    grads = {"x": np.full(4, 1e20, np.float32)}  # finite, but 1e40 overflows float32
    stats = SGD(params, lr=0.01).step(grads)
    assert not stats.skipped and stats.grad_norm == pytest.approx(2e20, rel=1e-6)
    np.testing.assert_allclose(params["x"], -1e18, rtol=1e-6)


def test_lr_override_and_gradient_errors():
    params = make_params()
    opt = AdamW(params, lr=0.5)
    assert opt.step(make_grads(params, 0), lr=0.001).lr == 0.001
    with pytest.raises(KeyError, match="nope"):
        opt.step({"nope": np.zeros(3)})
    with pytest.raises(ValueError, match="shape"):
        opt.step({"small": np.zeros(8)})
    with pytest.raises(ConfigError):
        opt.step(make_grads(params, 1), lr=-0.1)
    assert opt.step_count == 1


# ---- SGD -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=0.1), dict(gclip=0.5, max_grad_norm=3.0)])
def test_sgd_formula(kw):
    params = make_params(np.float64)
    w = {k: v.copy() for k, v in params.items()}
    opt = SGD(params, lr=0.05, **kw)
    wd = kw.get("weight_decay", 0.0)
    for step in range(4):
        grads = make_grads(params, step)
        g, norm, _ = clip_ref(grads, kw.get("gclip", 0.0), kw.get("max_grad_norm", 0.0))
        for k in w:
            w[k] = w[k] * (1 - 0.05 * wd) - 0.05 * g[k]
        stats = opt.step(grads)
        assert stats.grad_norm == pytest.approx(norm, rel=1e-12)
    for k in params:
        np.testing.assert_allclose(params[k], w[k], rtol=1e-13, atol=1e-15)


# ---- L-BFGS --------------------------------------------------------------------------------------

def rosenbrock(x):
    f = np.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)
    g = np.zeros_like(x)
    g[:-1] += -400.0 * x[:-1] * (x[1:] - x[:-1] ** 2) - 2.0 * (1.0 - x[:-1])
    g[1:] += 200.0 * (x[1:] - x[:-1] ** 2)
    return float(f), g


def counting_closure(params, fn):
    calls = [0]

    def closure():
        calls[0] += 1
        f, g = fn(params["x"])
        return f, {"x": g}
    return closure, calls


def test_lbfgs_minimises_10d_rosenbrock():
    params = {"x": np.zeros(10)}
    closure, calls = counting_closure(params, rosenbrock)
    opt = LBFGS(params)
    for _ in range(20):
        opt.step(closure)
        if rosenbrock(params["x"])[0] < 1e-6:
            break
    assert rosenbrock(params["x"])[0] < 1e-6
    np.testing.assert_allclose(params["x"], 1.0, atol=1e-3)
    assert calls[0] == opt.func_evals < 200


def least_squares(seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((60, 10))
    x_true = rng.standard_normal(10)
    b = a @ x_true                                   # consistent: the minimum loss is 0

    def fn(x):
        r = a @ x - b
        return 0.5 * float(r @ r), a.T @ r
    return fn, x_true


def test_lbfgs_solves_least_squares_to_machine_precision_faster_than_adamw():
    fn, x_true = least_squares()

    def rel_err(x):
        return np.linalg.norm(x - x_true) / np.linalg.norm(x_true)

    params = {"x": np.zeros(10)}
    closure, calls = counting_closure(params, fn)
    opt = LBFGS(params, tolerance_grad=1e-13, tolerance_change=0.0)
    for _ in range(5):
        opt.step(closure)
        if rel_err(params["x"]) < 1e-13:
            break
    assert rel_err(params["x"]) < 1e-13
    lbfgs_calls = calls[0]
    assert lbfgs_calls <= 40

    params = {"x": np.zeros(10)}
    closure, adam_calls = counting_closure(params, fn)
    adam = AdamW(params, lr=0.05)
    while rel_err(params["x"]) >= 1e-13 and adam_calls[0] < 10 * lbfgs_calls:
        adam.step(closure()[1])
    assert adam_calls[0] == 10 * lbfgs_calls   # AdamW did not get there with 10x the calls
    assert rel_err(params["x"]) > 1e-10


def test_lbfgs_without_line_search_on_a_quadratic():
    fn, x_true = least_squares(seed=1)
    params = {"x": np.zeros(10)}
    closure, _ = counting_closure(params, fn)
    opt = LBFGS(params, lr=0.05, line_search=None, max_iter=50, tolerance_change=0.0)
    losses = [opt.step(closure) for _ in range(10)]
    assert losses[-1] < 1e-3 * losses[0]


def test_lbfgs_multi_parameter_dict_and_missing_gradient():
    fn, x_true = least_squares(seed=2)
    params = {"a": np.zeros(4), "b": np.zeros((2, 3)), "frozen": np.ones(3)}

    def closure():
        x = np.concatenate([params["a"], params["b"].ravel()])
        f, g = fn(x)
        return f, {"a": g[:4], "b": g[4:].reshape(2, 3)}   # no gradient for "frozen"
    opt = LBFGS(params, tolerance_change=0.0, tolerance_grad=1e-12)
    for _ in range(3):
        opt.step(closure)
    np.testing.assert_allclose(np.concatenate([params["a"], params["b"].ravel()]), x_true,
                               rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(params["frozen"], 1.0)


# ---- schedules ---------------------------------------------------------------------------------

def test_schedules_at_key_steps():
    lin = make_schedule("linear", 1e-3, total_steps=110, warmup_steps=10, min_lr=1e-4)
    cos = make_schedule("cosine", 1e-3, total_steps=110, warmup_steps=10, min_lr=1e-4)
    const = make_schedule("constant", 1e-3, total_steps=110, warmup_steps=10)
    for s in (lin, cos, const):
        assert s(0) == 0.0                                   # warmup starts at 0
        assert s(5) == pytest.approx(5e-4)                   # halfway through warmup
        assert s(10) == pytest.approx(1e-3)                  # warmup end: base lr
    assert lin(60) == pytest.approx(5.5e-4)                  # midpoint of the decay
    assert cos(60) == pytest.approx(5.5e-4)                  # cosine midpoint = mean of ends
    assert cos(35) == pytest.approx(1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lin(110) == pytest.approx(1e-4) and cos(110) == pytest.approx(1e-4)  # end
    assert lin(10_000) == pytest.approx(1e-4) and cos(500) == pytest.approx(1e-4)  # clamped
    assert const(60) == const(110) == const(10_000) == 1e-3
    no_warmup = make_schedule("cosine", 2.0, total_steps=4)
    assert [no_warmup(i) for i in range(6)] == pytest.approx(
        [2.0, 1.0 + math.cos(math.pi / 4), 1.0, 1.0 - math.cos(math.pi / 4), 0.0, 0.0])
    with pytest.raises(ValueError):
        lin(-1)


@pytest.mark.parametrize("args, kw", [
    (("exponential", 1e-3, 10), {}),
    (("cosine", -1e-3, 10), {}),
    (("cosine", 1e-3, 0), {}),
    (("cosine", 1e-3, 10), dict(warmup_steps=11)),
    (("cosine", 1e-3, 10), dict(warmup_steps=-1)),
    (("cosine", 1e-3, 10), dict(min_lr=1e-2)),
    (("linear", float("nan"), 10), {}),
])
def test_schedule_config_errors(args, kw):
    with pytest.raises(ConfigError) as info:
        make_schedule(*args, **kw)
    assert info.value.hint


# ---- hyperparameter validation -------------------------------------------------------------------

@pytest.mark.parametrize("cls, kw", [
    (AdamW, dict(lr=-1e-3)),
    (AdamW, dict(lr=float("inf"))),
    (AdamW, dict(beta1=1.0)),
    (AdamW, dict(beta1=-0.1)),
    (AdamW, dict(beta2=1.5)),
    (AdamW, dict(eps=0.0)),
    (AdamW, dict(weight_decay=-0.01)),
    (AdamW, dict(gclip=-1.0)),
    (AdamW, dict(max_grad_norm=float("nan"))),
    (AdamW, dict(lr="fast")),
    (SGD, dict(lr=-1.0)),
    (LBFGS, dict(lr=0.0)),
    (LBFGS, dict(history=0)),
    (LBFGS, dict(max_iter=2.5)),
    (LBFGS, dict(tolerance_grad=-1.0)),
    (LBFGS, dict(line_search="armijo")),
])
def test_invalid_hyperparameters_raise_config_error(cls, kw):
    with pytest.raises(ConfigError) as info:
        cls({"x": np.zeros(3)}, **kw)
    assert info.value.kind == "config" and info.value.message and info.value.hint


def test_integer_parameters_rejected():
    with pytest.raises(TypeError, match="floating"):
        AdamW({"x": np.zeros(3, np.int32)})


# ---- state_dict round trips -------------------------------------------------------------------

def npz_round_trip(state):
    """Store the arrays with numpy (as the checkpoint code will) and read them back."""
    arrays, scalars = {}, {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, prefix + k + "/")
            elif isinstance(v, np.ndarray):
                arrays[prefix + k] = v
            else:
                assert isinstance(v, (int, float, str, type(None))), (k, type(v))
                scalars[prefix + k] = v
    walk(state, "")
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    buf.seek(0)
    loaded = dict(np.load(buf))
    out: dict = {}
    for key, v in list(loaded.items()) + list(scalars.items()):
        *path, leaf = key.split("/")
        node = out
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


def first_order_run(opt, params, steps):
    for s in steps:
        opt.step(make_grads(params, s, scale=3.0), lr=0.01 / (1 + s))


@pytest.mark.parametrize("make", [
    lambda p: AdamW(p, lr=0.01, weight_decay=0.1, gclip=2.0, max_grad_norm=30.0, beta2=0.99),
    lambda p: SGD(p, lr=0.01, weight_decay=0.1, gclip=2.0, max_grad_norm=30.0),
], ids=["adamw", "sgd"])
def test_first_order_state_dict_round_trip_is_bit_identical(make):
    params = make_params(np.float32)
    opt = make(params)
    first_order_run(opt, params, range(3))
    saved_state = npz_round_trip(opt.state_dict())
    saved_params = copy.deepcopy(params)
    first_order_run(opt, params, range(3, 7))  # the uninterrupted run

    resumed_params = saved_params
    resumed = type(opt)(resumed_params, lr=0.5)  # other hyperparameters: the state restores them
    resumed.load_state_dict(saved_state)
    assert resumed.hyperparameters() == opt.hyperparameters()
    first_order_run(resumed, resumed_params, range(3, 7))
    assert resumed.step_count == opt.step_count == 7
    for k in params:
        np.testing.assert_array_equal(resumed_params[k], params[k])
        for key in opt._moments:
            np.testing.assert_array_equal(resumed.state[key][k], opt.state[key][k])


def test_state_dict_is_a_copy():
    params = make_params(np.float32)
    opt = AdamW(params)
    opt.step(make_grads(params, 0))
    state = opt.state_dict()
    m_before = state["m"]["big"].copy()
    opt.step(make_grads(params, 1))
    np.testing.assert_array_equal(state["m"]["big"], m_before)
    assert state["step"] == 1


def test_lbfgs_state_dict_round_trip_is_bit_identical():
    params = {"x": np.tile([-1.2, 1.0], 5)}
    closure, _ = counting_closure(params, rosenbrock)
    opt = LBFGS(params, max_iter=4, history=3)
    opt.step(closure)
    opt.step(closure)
    saved_state = npz_round_trip(opt.state_dict())
    saved_x = params["x"].copy()
    for _ in range(3):
        opt.step(closure)

    resumed_params = {"x": saved_x}
    closure2, _ = counting_closure(resumed_params, rosenbrock)
    resumed = LBFGS(resumed_params)
    resumed.load_state_dict(saved_state)
    for _ in range(3):
        resumed.step(closure2)
    np.testing.assert_array_equal(resumed_params["x"], params["x"])
    assert (resumed.n_iter, resumed.func_evals) == (opt.n_iter, opt.func_evals)


def test_load_state_dict_rejects_mismatches_without_changing_anything():
    params = make_params()
    opt = AdamW(params)
    opt.step(make_grads(params, 0))
    state = opt.state_dict()
    with pytest.raises(CheckpointError):
        SGD(params, lr=0.1).load_state_dict(state)
    other = AdamW({"big": np.zeros((50, 49))})
    with pytest.raises(CheckpointError):
        other.load_state_dict({**state, "m": {"big": state["m"]["big"]},
                               "v": {"big": state["v"]["big"]}})
    fresh = AdamW(make_params())
    bad = copy.deepcopy(state)
    bad["v"]["small"] = np.zeros(8)
    with pytest.raises(CheckpointError):
        fresh.load_state_dict(bad)
    assert fresh.step_count == 0 and not fresh.state["m"]["big"].any()
    bad = copy.deepcopy(state)
    bad["hyperparams"]["beta1"] = 2.0
    with pytest.raises(ConfigError):
        fresh.load_state_dict(bad)
    with pytest.raises(CheckpointError):
        LBFGS({"x": np.zeros(3)}).load_state_dict(state)


# ---- gradient accumulation ------------------------------------------------------------------

def test_accumulator_sums_averages_and_resets():
    rng = np.random.default_rng(0)
    gs = [{"a": rng.standard_normal((3, 4)), "b": rng.standard_normal(5)} for _ in range(3)]
    acc = GradAccumulator()
    for g in gs:
        acc.add(g)
    out = acc.result()
    np.testing.assert_allclose(out["a"], gs[0]["a"] + gs[1]["a"] + gs[2]["a"])
    np.testing.assert_allclose(out["b"], gs[0]["b"] + gs[1]["b"] + gs[2]["b"])
    buffer_a = out["a"]
    assert buffer_a is not gs[0]["a"]

    acc.reset()                                              # a new cycle starts from zero
    acc.add({"a": gs[2]["a"]})
    out = acc.result()
    assert set(out) == {"a"}                                 # "b" is stale, not returned
    np.testing.assert_array_equal(out["a"], gs[2]["a"])
    assert out["a"] is buffer_a                              # buffers are reused

    avg = GradAccumulator(average=True)
    avg.add(gs[0])
    avg.add({"a": gs[1]["a"]})                               # no "b" in this micro-batch
    out = avg.result()
    np.testing.assert_allclose(out["a"], (gs[0]["a"] + gs[1]["a"]) / 2)
    np.testing.assert_allclose(out["b"], gs[0]["b"] / 2)
    np.testing.assert_allclose(avg.result()["a"], (gs[0]["a"] + gs[1]["a"]) / 2)  # idempotent
    with pytest.raises(RuntimeError):
        avg.add(gs[2])
    avg.reset()
    avg.add(gs[2], weight=3.0)
    avg.add(gs[0], weight=1.0)
    np.testing.assert_allclose(avg.result()["b"], (3 * gs[2]["b"] + gs[0]["b"]) / 4)


def test_accumulator_same_name_twice_accumulates_and_never_aliases():
    big = np.arange(3000, dtype=np.float32)                # several 1024-element chunks
    g = {"w": big.copy()}
    acc = GradAccumulator()
    acc.add(g)
    acc.add(g, weight=0.5)
    acc.add({"w": big[::-1].copy()}, weight=2.0)
    np.testing.assert_allclose(acc.result()["w"], 1.5 * big + 2.0 * big[::-1])
    np.testing.assert_array_equal(g["w"], big)              # the caller's array is untouched
    acc.reset()
    g["w"][:] = 7.0                                         # caller reuses its buffer
    acc.add(g)
    np.testing.assert_array_equal(acc.result()["w"], 7.0)
    assert acc.n_micro_batches == 1 and acc.total_weight == 1.0


def test_accumulator_feeds_optimizer_like_one_big_batch():
    params = make_params()
    p2 = copy.deepcopy(params)
    micro = [make_grads(params, s) for s in range(4)]
    acc = GradAccumulator(average=True)
    for g in micro:
        acc.add(g)
    AdamW(params, lr=0.01).step(acc.result())
    mean = {k: sum(g[k] for g in micro) / 4 for k in params}
    AdamW(p2, lr=0.01).step(mean)
    for k in params:
        np.testing.assert_allclose(params[k], p2[k], rtol=1e-12)


def test_step_stats_is_a_dataclass():
    s = StepStats(grad_norm=1.0, clipped_fraction=0.0, lr=1e-3, n_params=3)
    assert s.skipped is False


def test_no_decay_names_skip_weight_decay():
    w = {"matrix": np.ones((2, 2), np.float32), "norm": np.ones(2, np.float32)}
    opt = SGD(w, lr=0.1, weight_decay=0.5, no_decay=["norm"])
    opt.step({"matrix": np.zeros((2, 2), np.float32), "norm": np.zeros(2, np.float32)})
    np.testing.assert_allclose(w["matrix"], 0.95)
    np.testing.assert_array_equal(w["norm"], 1.0)


# ---- the compiled one-pass AdamW (app.engine.kernels.compiled_adamw) against its NumPy twin -----

needs_numba = pytest.mark.skipif(not jit.compiled(), reason="compiled kernels are off")


def _adamw_run(monkeypatch, kernels: str, dtype, steps=4, **kw):
    """Params, optimizer and stats after `steps` AdamW steps with kernels "numpy" or compiled."""
    if kernels == "numpy":
        monkeypatch.setenv(jit.ENV_VAR, "numpy")
    else:
        monkeypatch.delenv(jit.ENV_VAR, raising=False)
    params = make_params(dtype)
    opt = AdamW(params, lr=0.05, no_decay=("small",), **kw)
    stats = [opt.step(make_grads(params, s, scale=0.3)) for s in range(steps)]
    return params, opt, stats


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.1, "gclip": 0.2}])
def test_compiled_adamw_is_bit_identical_to_the_numpy_twin(monkeypatch, dtype, kw):
    """Same float operations in the same order, element by element: the same bits, clamp
    counts included (gclip 0.2 clamps about half of these gradients)."""
    want = _adamw_run(monkeypatch, "numpy", dtype, **kw)
    got = _adamw_run(monkeypatch, "compiled", dtype, **kw)
    for k in want[0]:
        np.testing.assert_array_equal(_bits(got[0][k]), _bits(want[0][k]), err_msg=k)
        for key in ("m", "v"):
            np.testing.assert_array_equal(_bits(got[1].state[key][k]),
                                          _bits(want[1].state[key][k]), err_msg=f"{key} {k}")
    for a, b in zip(got[2], want[2]):
        assert a.clipped_fraction == b.clipped_fraction
        assert (a.clipped_fraction > 0) == bool(kw)


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_global_norm_within_the_float32_bound(monkeypatch, dtype):
    """The compiled partial sums (float64, eight lanes) and the twin's (float32 BLAS dots summed
    in float64) both hold the norm to the bound of a float32 dot of n terms; the steps that
    follow differ only through the clipping scale."""
    want = _adamw_run(monkeypatch, "numpy", dtype, max_grad_norm=1.0)
    got = _adamw_run(monkeypatch, "compiled", dtype, max_grad_norm=1.0)
    n = want[2][0].n_params
    for a, b in zip(got[2], want[2]):
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=2 * n * 2.0 ** -24)
    for k in want[0]:
        np.testing.assert_allclose(got[0][k], want[0][k], rtol=1e-5, atol=1e-6)


@needs_numba
def test_compiled_sumsq_matches_float64():
    g = np.random.default_rng(3).standard_normal(10_007).astype(np.float32)
    exact = float(np.dot(g.astype(np.float64), g.astype(np.float64)))
    assert compiled_adamw.sumsq_chunk(g) == pytest.approx(exact, rel=1e-13)
    assert math.isnan(compiled_adamw.sumsq_chunk(np.array([1.0, np.nan], np.float32)))


def test_numpy_switch_runs_the_numpy_twin(monkeypatch):
    monkeypatch.setenv(jit.ENV_VAR, "numpy")
    assert not compiled_adamw.runs_on(np.zeros(4, np.float32))
