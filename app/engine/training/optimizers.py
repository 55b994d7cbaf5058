"""Optimizers, learning-rate schedules and gradient accumulation.

Parameters are a dict ``name -> array`` (NumPy or CuPy) updated in place; gradients are a dict
with the same names, and a name missing from it means "no gradient this step" (that parameter,
its moments and its weight decay are left alone). Optimizer state lives on the parameters'
device.

``AdamW`` and ``SGD`` follow ggml-opt exactly (SPEC-llamacpp.md 4.2, ggml-cpu/ops.cpp)::

    m = b1 m + (1 - b1) g
    v = b2 v + (1 - b2) g^2
    w = w (1 - lr wd) - lr (m b1h) / (sqrt(v b2h) + eps)     b1h = 1/(1 - b1^t), b2h = 1/(1 - b2^t)
    w = w (1 - lr wd) - lr g                                  (SGD)

with t counted from 1. Two optional gradient clippings that ggml-opt does not have, applied in
this order to a private copy (the caller's gradients are never modified):

1. ``max_grad_norm`` > 0: if the global L2 norm over all gradients of the step exceeds it,
   every gradient is multiplied by ``max_grad_norm / norm``.
2. ``gclip`` > 0: each element is then clamped to ``[-gclip, gclip]``.

Before any state is touched, ``step`` computes the global gradient norm; if it is NaN or Inf
the step is skipped (params, moments and step count unchanged) and the returned ``StepStats``
says ``skipped=True``.

Speed: on NumPy with compiled kernels on (the default, app.engine.kernels.jit), AdamW's
clipping and update run in one compiled pass per chunk (app.engine.kernels.compiled_adamw:
bit-identical to the NumPy update) and the global norm's partial sums in another, both over
pieces on the engine's threads: 12.8 M float32 parameters in about 24 ms against 46-58 ms on
the shared 2-core machine. The NumPy update, which stays as their twin (and runs SGD, CuPy,
WORKBENCH_KERNELS=numpy), is a chain of in-place ufuncs over contiguous chunks of
``_CHUNK_BYTES`` per array so the two scratch buffers and the operands stay in the L2 cache;
with 10 M float32 parameters that is about 1.4x faster than the same ufuncs over whole arrays
and 2.4-2.8x faster than naive expressions (``python -m bench.optim``). CuPy arrays are
processed whole.

``LBFGS`` is a full-batch quasi-Newton method for tiny models (two-loop recursion, optional
strong-Wolfe line search), following the algorithm of ``torch.optim.LBFGS``.

Every optimizer has ``state_dict()`` / ``load_state_dict()``: a nested dict of str, int, float
and NumPy arrays (copies, on the host), so save -> load -> continue is bit-identical to not
saving. ``state_dict(copy=False)`` is for a checkpoint written before the next step: on the
CPU it holds the live arrays themselves, so that saving a large adapter does not hold its
optimizer state twice (AdamW's moments are two thirds of a run's trained memory).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from app.engine.runtime.backend import get_array_module, to_host
from app.engine.errors import CheckpointError, ConfigError
from app.engine.kernels import compiled_adamw
from app.engine.runtime.parallel import parallel_map

# Bytes of each operand per chunk in the NumPy update loop (64 K float32 elements): the chunk of
# w, g, m, v plus two scratch buffers fits in a 2 MB L2 cache. Tests shrink it to exercise the loop.
_CHUNK_BYTES = 256 * 1024
# Elements per piece of the compiled one-pass kernels (app.engine.kernels.compiled_adamw), which
# need no scratch: larger pieces, fewer calls (64 K-element pieces cost 10-15% more per step).
_COMPILED_CHUNK = 1 << 18


# ---- validation -------------------------------------------------------------------------------

def _number(name: str, value, *, lo: float = 0.0, hi: float = math.inf, lo_open: bool = False,
            hi_open: bool = False, hint: str = "") -> float:
    """``value`` as a float in the interval, else ConfigError."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}", hint) from None
    low_ok = x > lo if lo_open else x >= lo
    high_ok = x < hi if hi_open else x <= hi
    if not (math.isfinite(x) and low_ok and high_ok):
        if math.isinf(hi):
            wanted = f"{'>' if lo_open else '>='} {lo:g}"
        else:
            wanted = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ConfigError(f"{name} must be a finite number {wanted}, got {value!r}", hint)
    return x


def _integer(name: str, value, *, lo: int, hint: str = "") -> int:
    if isinstance(value, np.ndarray) and value.ndim == 0:  # a scalar read back from .npz
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r}", hint)
    return int(value)


def _check_lr(lr) -> float:
    return _number("learning rate", lr, hint="use a non-negative learning rate such as 1e-4")


def _check_clipping(gclip, max_grad_norm) -> tuple[float, float]:
    gclip = _number("gclip", gclip, hint="0 disables element-wise clipping; try 1.0")
    max_grad_norm = _number("max_grad_norm", max_grad_norm,
                            hint="0 disables global-norm clipping; try 1.0")
    return gclip, max_grad_norm


def _check_params(params: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict name -> array, got {type(params).__name__}")
    out = {}
    for name, p in params.items():
        if not hasattr(p, "dtype") or p.dtype.kind != "f":
            raise TypeError(f"parameter {name!r} must be a floating-point array, "
                            f"got {getattr(p, 'dtype', type(p).__name__)}")
        out[name] = p
    return out


def _on_host(a, copy: bool = True) -> np.ndarray:
    """`a` as a NumPy array; a NumPy array is copied only when `copy` (a device array always is)."""
    h = to_host(a)
    return h.copy() if copy and h is a else h


def _check_shape(src, dst, what: str) -> None:
    if tuple(np.shape(src)) != tuple(dst.shape):
        raise CheckpointError(f"optimizer state {what} has shape {tuple(np.shape(src))}, "
                              f"the parameter has {tuple(dst.shape)}",
                              "the checkpoint belongs to a different model or adapter layout")


def _load_into(dst, src, what: str) -> None:
    """Copy a saved array into a live one (the live one keeps its device, dtype and layout)."""
    _check_shape(src, dst, what)
    xp = get_array_module(dst)
    dst[...] = xp.asarray(src)


def _check_kind(d: Mapping[str, Any], kind: str) -> None:
    if not isinstance(d, Mapping) or d.get("kind") != kind:
        found = d.get("kind") if isinstance(d, Mapping) else type(d).__name__
        raise CheckpointError(f"expected a {kind} optimizer state, got {found!r}",
                              "resume with the optimizer the checkpoint was written with")


# ---- scratch buffers and norms ------------------------------------------------------------------

class _Scratch:
    """Flat float scratch buffers (two) and a bool mask, per thread, array type, dtype and
    device (the engine's threads update different chunks at once)."""

    def __init__(self):
        self._bufs: dict[tuple, tuple] = {}

    def get(self, like, n: int):
        xp = get_array_module(like)
        key = (threading.get_ident(), type(like), like.dtype, str(getattr(like, "device", "")))
        bufs = self._bufs.get(key)
        if bufs is None or bufs[0].size < n:
            bufs = (xp.empty(n, like.dtype), xp.empty(n, like.dtype), xp.empty(n, bool))
            self._bufs[key] = bufs
        return tuple(b[:n] for b in bufs)


def _chunk_len(a) -> int:
    return max(1024, _CHUNK_BYTES // a.itemsize)


def _pieces(w, g, moments, c, step: int) -> list[tuple]:
    """One parameter's update as independent (w, g, moments, constants) pieces: contiguous
    chunks of `step` elements on NumPy (they run on the engine's threads), else whole."""
    xp = get_array_module(w)
    contiguous = w.flags.c_contiguous and all(m.flags.c_contiguous for m in moments)
    if xp is not np or not contiguous:
        return [(w, g, moments, c)]
    wf, gf = w.reshape(-1), g.reshape(-1)  # views (gf copies a non-contiguous gradient)
    mf = [m.reshape(-1) for m in moments]
    return [(wf[a:a + step], gf[a:a + step], [m[a:a + step] for m in mf], c)
            for a in range(0, wf.size, step)]


def _global_sumsq(grads: list) -> float:
    """Sum of squares over all gradients. Where the compiled kernels take a gradient, partial
    sums of its chunks run on the engine's threads and are added in chunk order (the same for
    any thread count); the others go through the NumPy twin, _sumsq."""
    chunks, total = [], 0.0
    for g in grads:
        if compiled_adamw.runs_on(g):
            flat = g.reshape(-1)
            chunks += [flat[a:a + _COMPILED_CHUNK] for a in range(0, flat.size, _COMPILED_CHUNK)]
        else:
            total = total + _sumsq(g)
    return float(total + sum(parallel_map(compiled_adamw.sumsq_chunk, chunks)))


def _sumsq(g):
    """Sum of squares of g: a Python float on NumPy, a float64 0-d device array on CuPy (the
    caller converts the total once: one device sync per step). NaN/Inf iff g has a NaN/Inf
    (or its norm overflows float64)."""
    xp = get_array_module(g)
    flat = g.reshape(-1)
    if xp is not np:
        return xp.square(flat, dtype=xp.float64).sum()
    c = _chunk_len(flat)              # float64 sum of per-chunk BLAS dots: accurate and fast
    with np.errstate(over="ignore"):  # an overflow is handled below
        total = sum(float(np.dot(flat[a:a + c], flat[a:a + c]))
                    for a in range(0, flat.size, c))
    if not math.isfinite(total) and bool(np.isfinite(flat).all()):
        # finite values whose squares overflow the gradient's dtype (float16/float32)
        f64 = flat.astype(xp.float64)
        total = float(xp.vdot(f64, f64))
    return total


# ---- first-order optimizers -------------------------------------------------------------------

@dataclass(frozen=True)
class StepStats:
    """What one ``step`` did.

    grad_norm: global L2 norm of the gradients before any clipping (NaN/Inf when skipped).
    clipped_fraction: fraction of gradient elements the element-wise ``gclip`` clamp changed.
    lr: learning rate used. n_params: number of parameter elements that had a gradient.
    skipped: True if the gradients had a NaN/Inf and nothing was updated.
    """

    grad_norm: float
    clipped_fraction: float
    lr: float
    n_params: int
    skipped: bool = False


class _ElementwiseOptimizer:
    """Shared machinery of AdamW and SGD: gradient checks, global norm, clipping, chunked loop."""

    kind = ""
    _moments: tuple[str, ...] = ()  # names of the per-parameter state arrays

    def __init__(self, params, lr, weight_decay, gclip, max_grad_norm, no_decay=()):
        self.params = _check_params(params)
        self.no_decay = frozenset(no_decay)  # names exempt from weight decay (norms, biases)
        self.lr = _check_lr(lr)
        self.weight_decay = _number("weight_decay", weight_decay,
                                    hint="use 0 (off) or a small value such as 0.01")
        self.gclip, self.max_grad_norm = _check_clipping(gclip, max_grad_norm)
        self.step_count = 0
        self.state: dict[str, dict[str, Any]] = {
            k: {name: get_array_module(p).zeros_like(p) for name, p in self.params.items()}
            for k in self._moments}
        self._scratch = _Scratch()

    # -- subclass hooks
    def _piece_len(self, w, g, moments) -> int:
        """Elements per piece of the update."""
        return _chunk_len(w)

    def _constants(self, lr: float, weight_decay: float) -> tuple:
        raise NotImplementedError

    def _kernel(self, w, g, moments, tmp, c) -> None:
        """Update one chunk in place. ``g`` may be a scratch buffer; ``tmp`` is the free one."""
        raise NotImplementedError

    def hyperparameters(self) -> dict[str, float]:
        raise NotImplementedError

    # -- the step
    def _match(self, grads: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
        pairs = []
        for name, g in grads.items():
            if name not in self.params:
                raise KeyError(f"gradient for unknown parameter {name!r}")
            w = self.params[name]
            if tuple(g.shape) != tuple(w.shape):
                raise ValueError(f"gradient for {name!r} has shape {tuple(g.shape)}, "
                                 f"the parameter has {tuple(w.shape)}")
            pairs.append((name, w, g))
        return pairs

    def step(self, grads: Mapping[str, Any], lr: float | None = None) -> StepStats:
        """Apply one update from ``grads`` (not modified). ``lr`` overrides ``self.lr`` for this
        step (schedules pass it every step)."""
        lr = self.lr if lr is None else _check_lr(lr)
        pairs = self._match(grads)
        n_params = sum(int(w.size) for _, w, _ in pairs)
        sumsq = _global_sumsq([g for _, _, g in pairs])
        if not math.isfinite(sumsq):  # NaN/Inf gradient: nothing has been touched yet
            return StepStats(grad_norm=math.sqrt(sumsq),
                             clipped_fraction=0.0, lr=lr, n_params=n_params, skipped=True)
        norm = math.sqrt(sumsq)
        scale = 1.0
        if self.max_grad_norm > 0 and norm > self.max_grad_norm:
            scale = self.max_grad_norm / norm

        self.step_count += 1
        c = self._constants(lr, self.weight_decay)
        c_no_decay = self._constants(lr, 0.0)
        pieces = []
        for name, w, g in pairs:
            moments = [self.state[k][name] for k in self._moments]
            pieces += _pieces(w, g, moments, c_no_decay if name in self.no_decay else c,
                              self._piece_len(w, g, moments))
        xp = get_array_module(*(w for _, w, _ in pairs[:1]))
        clipped = int(sum(parallel_map(lambda piece: self._clip_and_update(*piece, scale),
                                       pieces, xp)))
        return StepStats(grad_norm=norm, clipped_fraction=clipped / n_params if n_params else 0.0,
                         lr=lr, n_params=n_params)

    def _clip_and_update(self, w, g, moments, c, scale: float):
        """Update one piece in place; returns the number of elements gclip changed (an int, or
        a 0-d device array on CuPy: no sync per piece)."""
        xp = get_array_module(w)
        s, t, mask = (b.reshape(w.shape) for b in self._scratch.get(w, w.size))
        clipped = 0
        if scale != 1.0:                              # 1. global-norm clipping
            xp.multiply(g, scale, out=s)
            g = s
        if self.gclip > 0:                            # 2. element-wise clamp
            xp.abs(g, out=t)
            xp.greater(t, self.gclip, out=mask)
            clipped = xp.count_nonzero(mask)
            xp.clip(g, -self.gclip, self.gclip, out=s)
            g = s
        self._kernel(w, g, moments, t if g is s else s, c)
        return int(clipped) if xp is np else clipped

    # -- checkpoints
    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "step": self.step_count,
                             "hyperparams": self.hyperparameters()}
        for k in self._moments:
            d[k] = {name: _on_host(a, copy) for name, a in self.state[k].items()}
        return d

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        _check_kind(d, self.kind)
        hp = dict(d["hyperparams"])
        probe = type(self)({}, **hp)  # validates the hyperparameters before anything changes
        step = _integer("step", d["step"], lo=0)
        for k in self._moments:
            saved = d[k]
            if set(saved) != set(self.params):
                missing = sorted(set(self.params) - set(saved))
                extra = sorted(set(saved) - set(self.params))
                raise CheckpointError(f"optimizer state '{k}' does not match the parameters "
                                      f"(missing {missing[:5]}, unexpected {extra[:5]})",
                                      "the checkpoint belongs to a different adapter layout")
            for name, a in saved.items():
                _check_shape(a, self.params[name], f"{k}[{name!r}]")
        for k in self._moments:
            for name, a in d[k].items():
                _load_into(self.state[k][name], a, f"{k}[{name!r}]")
        for key, value in probe.hyperparameters().items():
            setattr(self, key, value)
        self.step_count = step


class AdamW(_ElementwiseOptimizer):
    """ggml-opt's AdamW (bias-corrected, eps outside the sqrt, decoupled weight decay), plus
    optional global-norm (``max_grad_norm``) then element-wise (``gclip``) gradient clipping.

    State: ``step_count`` (t of the last update), ``state["m"]``, ``state["v"]`` per parameter.
    """

    kind = "adamw"
    _moments = ("m", "v")

    def __init__(self, params, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                 gclip=0.0, max_grad_norm=0.0, no_decay=()):
        self.beta1 = _number("beta1", beta1, hi=1.0, hi_open=True, hint="the usual value is 0.9")
        self.beta2 = _number("beta2", beta2, hi=1.0, hi_open=True, hint="the usual value is 0.999")
        self.eps = _number("eps", eps, lo_open=True, hint="the usual value is 1e-8")
        super().__init__(params, lr, weight_decay, gclip, max_grad_norm, no_decay)

    def hyperparameters(self) -> dict[str, float]:
        return {"lr": self.lr, "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps,
                "weight_decay": self.weight_decay, "gclip": self.gclip,
                "max_grad_norm": self.max_grad_norm}

    def _constants(self, lr: float, weight_decay: float) -> tuple:
        t = self.step_count
        b1h = 1.0 / (1.0 - self.beta1 ** t)
        b2h = 1.0 / (1.0 - self.beta2 ** t)
        keep = 1.0 - lr * weight_decay
        return (self.beta1, 1.0 - self.beta1, self.beta2, 1.0 - self.beta2, b2h, self.eps,
                lr * b1h, keep)

    def _piece_len(self, w, g, moments) -> int:
        if compiled_adamw.runs_on(w, g, *moments):
            return _COMPILED_CHUNK
        return super()._piece_len(w, g, moments)

    def _clip_and_update(self, w, g, moments, c, scale: float):
        """The compiled one-pass update (app.engine.kernels.compiled_adamw) where it takes the
        arrays, else the NumPy twin: the clipping, then _kernel."""
        if compiled_adamw.runs_on(w, g, *moments):
            return compiled_adamw.adamw_chunk(w, g, *moments, scale, self.gclip, c)
        return super()._clip_and_update(w, g, moments, c, scale)

    def _kernel(self, w, g, moments, tmp, c) -> None:
        b1, one_m_b1, b2, one_m_b2, b2h, eps, step_size, keep = c
        m, v = moments
        xp = get_array_module(w)
        xp.multiply(m, b1, out=m)                 # m = b1 m + (1 - b1) g
        xp.multiply(g, one_m_b1, out=tmp)
        xp.add(m, tmp, out=m)
        xp.multiply(v, b2, out=v)                 # v = b2 v + (1 - b2) g^2
        xp.multiply(g, g, out=tmp)
        xp.multiply(tmp, one_m_b2, out=tmp)
        xp.add(v, tmp, out=v)
        xp.multiply(v, b2h, out=tmp)              # tmp = sqrt(v b2h) + eps
        xp.sqrt(tmp, out=tmp)
        xp.add(tmp, eps, out=tmp)
        xp.divide(m, tmp, out=tmp)                # tmp = lr b1h m / (sqrt(v b2h) + eps)
        xp.multiply(tmp, step_size, out=tmp)
        if keep != 1.0:                           # w = w (1 - lr wd) - tmp
            xp.multiply(w, keep, out=w)
        xp.subtract(w, tmp, out=w)


class SGD(_ElementwiseOptimizer):
    """ggml-opt's SGD: ``w = w (1 - lr wd) - lr g``, with the same optional clipping as AdamW."""

    kind = "sgd"
    _moments = ()

    def __init__(self, params, lr, weight_decay=0.0, gclip=0.0, max_grad_norm=0.0, no_decay=()):
        super().__init__(params, lr, weight_decay, gclip, max_grad_norm, no_decay)

    def hyperparameters(self) -> dict[str, float]:
        return {"lr": self.lr, "weight_decay": self.weight_decay, "gclip": self.gclip,
                "max_grad_norm": self.max_grad_norm}

    def _constants(self, lr: float, weight_decay: float) -> tuple:
        return (lr, 1.0 - lr * weight_decay)

    def _kernel(self, w, g, moments, tmp, c) -> None:
        lr, keep = c
        xp = get_array_module(w)
        xp.multiply(g, lr, out=tmp)
        if keep != 1.0:
            xp.multiply(w, keep, out=w)
        xp.subtract(w, tmp, out=w)


# ---- L-BFGS -------------------------------------------------------------------------------------

class _Point(NamedTuple):
    """A trial step along the search direction: step length, loss, flat gradient, slope."""

    t: float
    f: float
    g: Any
    gtd: float


def _cubic_minimum(a: _Point, b: _Point, bounds: tuple[float, float] | None = None) -> float:
    """Minimiser of the cubic through two points (values and slopes), clamped to ``bounds``
    (default: between the points); the midpoint of the bounds if the cubic has no minimum."""
    lo, hi = bounds if bounds is not None else (min(a.t, b.t), max(a.t, b.t))
    if a.t != b.t:
        d1 = a.gtd + b.gtd - 3.0 * (a.f - b.f) / (a.t - b.t)
        d2_square = d1 * d1 - a.gtd * b.gtd
        if d2_square >= 0.0 and math.isfinite(d2_square):
            d2 = math.sqrt(d2_square)
            left, right = (a, b) if a.t <= b.t else (b, a)
            den = right.gtd - left.gtd + 2.0 * d2
            if den != 0.0:
                t = right.t - (right.t - left.t) * (right.gtd + d2 - d1) / den
                if math.isfinite(t):
                    return min(max(t, lo), hi)
    return (lo + hi) / 2.0


def _strong_wolfe(evaluate: Callable[[float], _Point], start: _Point, t: float, d_max: float,
                  c1: float = 1e-4, c2: float = 0.9, tolerance_change: float = 1e-9,
                  max_ls: int = 25) -> tuple[_Point, int]:
    """Line search for a step satisfying the strong Wolfe conditions (Nocedal & Wright,
    algorithms 3.5 and 3.6, as in torch.optim.LBFGS). Returns the accepted point and the number
    of evaluations. ``start`` is the point at t=0, ``d_max`` the max-abs of the direction."""
    def sufficient_decrease(p: _Point) -> bool:
        return p.f <= start.f + c1 * p.t * start.gtd

    def curvature(p: _Point) -> bool:
        return abs(p.gtd) <= -c2 * start.gtd

    # Phase 1: grow the step until an interval [prev, new] brackets an acceptable step.
    prev, new = start, evaluate(t)
    evals, ls_iter = 1, 0
    bracket = None
    while ls_iter < max_ls:
        if not sufficient_decrease(new) or (ls_iter > 1 and new.f >= prev.f):
            bracket = (prev, new)
            break
        if curvature(new):
            return new, evals
        if new.gtd >= 0:
            bracket = (prev, new)
            break
        # extrapolate: cubic step, at least 1% beyond the current one, at most 10x it
        t_next = _cubic_minimum(prev, new, bounds=(new.t + 0.01 * (new.t - prev.t), new.t * 10.0))
        prev, new = new, evaluate(t_next)
        evals += 1
        ls_iter += 1
    if bracket is None:  # out of evaluations: keep the better end of [0, t]
        bracket = (start, new)

    # Phase 2 (zoom): shrink the bracket. lo has the lowest loss seen, hi is the other end.
    lo, hi = bracket if bracket[0].f <= bracket[1].f else bracket[::-1]
    insufficient_progress = False
    while ls_iter < max_ls:
        if abs(hi.t - lo.t) * d_max < tolerance_change:
            break
        t = _cubic_minimum(lo, hi)
        left, right = min(lo.t, hi.t), max(lo.t, hi.t)
        margin = 0.1 * (right - left)
        # too close to an end of the bracket: move inside it, or allow it once
        if min(right - t, t - left) < margin:
            if insufficient_progress or t >= right or t <= left:
                t = right - margin if abs(t - right) < abs(t - left) else left + margin
                insufficient_progress = False
            else:
                insufficient_progress = True
        else:
            insufficient_progress = False
        new = evaluate(t)
        evals += 1
        ls_iter += 1
        if not sufficient_decrease(new) or new.f >= lo.f:
            hi = new
            if hi.f < lo.f:
                lo, hi = hi, lo
        else:
            if curvature(new):
                return new, evals
            if new.gtd * (hi.t - lo.t) >= 0:
                hi = lo
            lo = new
    return lo, evals


class LBFGS:
    """Full-batch L-BFGS for tiny models (the algorithm of torch.optim.LBFGS; NumPy/CuPy, no torch).

    ``step(closure)`` runs up to ``max_iter`` iterations; ``closure()`` must evaluate the whole
    batch at the current params and return ``(loss, grads)`` (a missing gradient counts as zero).
    It returns the loss of the first evaluation. ``line_search`` is ``"strong_wolfe"`` or None
    (fixed step ``lr``). ``max_eval`` (default ``max_iter * 5 // 4``) caps closure calls per step.
    """

    kind = "lbfgs"

    def __init__(self, params, lr=1.0, history=10, max_iter=20, tolerance_grad=1e-7,
                 tolerance_change=1e-9, line_search="strong_wolfe", max_eval=None):
        self.params = _check_params(params)
        self.lr = _number("lr", lr, lo_open=True, hint="1.0 is the usual L-BFGS step")
        self.history = _integer("history", history, lo=1, hint="try 10")
        self.max_iter = _integer("max_iter", max_iter, lo=1, hint="try 20")
        self.max_eval = (self.max_iter * 5 // 4 if max_eval is None
                         else _integer("max_eval", max_eval, lo=1, hint="try max_iter * 5 // 4"))
        self.tolerance_grad = _number("tolerance_grad", tolerance_grad, hint="try 1e-7")
        self.tolerance_change = _number("tolerance_change", tolerance_change, hint="try 1e-9")
        if line_search not in ("strong_wolfe", None):
            raise ConfigError(f"unknown line search {line_search!r}",
                              "use 'strong_wolfe' or None (fixed step)")
        self.line_search = line_search

        arrays = list(self.params.values())
        self._xp = get_array_module(*arrays) if arrays else np
        self._dtype = np.result_type(*[p.dtype for p in arrays]) if arrays else np.float64
        self._slices, offset = {}, 0
        for name, p in self.params.items():
            self._slices[name] = slice(offset, offset + int(p.size))
            offset += int(p.size)
        self._n = offset
        self.n_iter = 0       # iterations over all step() calls
        self.func_evals = 0   # closure calls over all step() calls
        self._reset_memory()

    def _reset_memory(self) -> None:
        self._d = None                  # last search direction
        self._t = None                  # last step length
        self._s_hist: list = []         # parameter differences s_k = t d
        self._y_hist: list = []         # gradient differences y_k
        self._rho_hist: list[float] = []  # 1 / (y_k . s_k)
        self._h_diag = 1.0              # initial inverse-Hessian scale
        self._prev_g = None
        self._prev_loss = None

    def hyperparameters(self) -> dict[str, Any]:
        return {"lr": self.lr, "history": self.history, "max_iter": self.max_iter,
                "tolerance_grad": self.tolerance_grad, "tolerance_change": self.tolerance_change,
                "line_search": self.line_search, "max_eval": self.max_eval}

    # -- flat views of the parameters
    def _get_flat(self):
        xp = self._xp
        if not self.params:
            return xp.zeros(0, self._dtype)
        return xp.concatenate([p.reshape(-1).astype(self._dtype, copy=False)
                               for p in self.params.values()])

    def _set_flat(self, flat) -> None:
        for name, p in self.params.items():
            p[...] = flat[self._slices[name]].reshape(p.shape)

    def _evaluate(self, closure) -> tuple[float, Any]:
        loss, grads = closure()
        flat = self._xp.zeros(self._n, self._dtype)
        for name, g in grads.items():
            if name not in self._slices:
                raise KeyError(f"gradient for unknown parameter {name!r}")
            flat[self._slices[name]] = g.reshape(-1)
        return float(loss), flat

    def _direction(self, g):
        """Two-loop recursion: -H g with the stored curvature pairs."""
        xp = self._xp
        q = -g
        alphas = [0.0] * len(self._s_hist)
        for i in reversed(range(len(self._s_hist))):
            alphas[i] = float(xp.dot(self._s_hist[i], q)) * self._rho_hist[i]
            q -= alphas[i] * self._y_hist[i]
        r = q * self._h_diag
        for i in range(len(self._s_hist)):
            beta = float(xp.dot(self._y_hist[i], r)) * self._rho_hist[i]
            r += (alphas[i] - beta) * self._s_hist[i]
        return r

    def _remember(self, y, s) -> None:
        ys = float(self._xp.dot(y, s))
        if ys > 1e-10:  # keep only pairs with positive curvature
            if len(self._s_hist) == self.history:
                self._s_hist.pop(0)
                self._y_hist.pop(0)
                self._rho_hist.pop(0)
            self._s_hist.append(s)
            self._y_hist.append(y)
            self._rho_hist.append(1.0 / ys)
            self._h_diag = ys / float(self._xp.dot(y, y))

    def step(self, closure: Callable[[], tuple[float, Mapping[str, Any]]]) -> float:
        xp = self._xp
        loss, g = self._evaluate(closure)
        orig_loss = loss
        evals = 1
        self.func_evals += 1
        if self._n == 0 or float(xp.abs(g).max()) <= self.tolerance_grad:
            return orig_loss

        d, t = self._d, self._t
        n_iter = 0
        while n_iter < self.max_iter:
            n_iter += 1
            self.n_iter += 1
            # 1. search direction
            if self.n_iter == 1:
                d = -g
                self._s_hist, self._y_hist, self._rho_hist, self._h_diag = [], [], [], 1.0
            else:
                self._remember(g - self._prev_g, d * t)
                d = self._direction(g)
            self._prev_g, self._prev_loss = g, loss

            # 2. initial step length: scaled down on the very first iteration
            t = min(1.0, 1.0 / float(xp.abs(g).sum())) * self.lr if self.n_iter == 1 else self.lr
            gtd = float(xp.dot(g, d))
            if gtd > -self.tolerance_change:  # not a descent direction (any more)
                break

            # 3. move
            x0 = self._get_flat()
            if self.line_search == "strong_wolfe":
                def evaluate(step: float) -> _Point:
                    self._set_flat(x0 + step * d)
                    f, grad = self._evaluate(closure)
                    return _Point(step, f, grad, float(xp.dot(grad, d)))

                d_max = float(xp.abs(d).max())
                best, ls_evals = _strong_wolfe(evaluate, _Point(0.0, loss, g, gtd), t, d_max,
                                               tolerance_change=self.tolerance_change)
                t, loss, g = best.t, best.f, best.g
                self._set_flat(x0 + t * d)
            else:
                self._set_flat(x0 + t * d)
                ls_evals = 0
                if n_iter != self.max_iter:
                    loss, g = self._evaluate(closure)
                    ls_evals = 1
            evals += ls_evals
            self.func_evals += ls_evals

            # 4. stopping tests
            if n_iter == self.max_iter or evals >= self.max_eval:
                break
            if float(xp.abs(g).max()) <= self.tolerance_grad:
                break
            if float(xp.abs(d).max()) * abs(t) <= self.tolerance_change:
                break
            if abs(loss - self._prev_loss) < self.tolerance_change:
                break
        self._d, self._t = d, t
        return orig_loss

    # -- checkpoints
    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "hyperparams": self.hyperparameters(),
                               "n_iter": self.n_iter, "func_evals": self.func_evals,
                               "h_diag": self._h_diag}
        k, dtype = len(self._s_hist), self._dtype
        out["s_history"] = (np.stack([to_host(s) for s in self._s_hist]) if k   # a new array
                            else np.zeros((0, self._n), dtype))
        out["y_history"] = (np.stack([to_host(y) for y in self._y_hist]) if k
                            else np.zeros((0, self._n), dtype))
        out["rho_history"] = np.array(self._rho_hist, np.float64)
        if self._d is not None:
            out["d"], out["t"] = _on_host(self._d, copy), float(self._t)
        if self._prev_g is not None:
            out["prev_grad"], out["prev_loss"] = (_on_host(self._prev_g, copy),
                                                  float(self._prev_loss))
        return out

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        _check_kind(d, self.kind)
        hp = dict(d["hyperparams"])
        probe = LBFGS({}, **hp)  # validates
        xp = self._xp
        s_hist, y_hist = np.asarray(d["s_history"]), np.asarray(d["y_history"])
        for name, a in (("s_history", s_hist), ("y_history", y_hist)):
            if a.ndim != 2 or a.shape[1] != self._n or a.shape[0] > probe.history:
                raise CheckpointError(f"L-BFGS state {name} has shape {a.shape}, expected (<= "
                                      f"{probe.history}, {self._n})",
                                      "the checkpoint belongs to different parameters")
        rho = np.asarray(d["rho_history"], np.float64).reshape(-1)
        if not (len(rho) == len(s_hist) == len(y_hist)):
            raise CheckpointError("L-BFGS state has history arrays of different lengths",
                                  "the checkpoint is damaged")
        n_iter = _integer("n_iter", d["n_iter"], lo=0)
        func_evals = _integer("func_evals", d["func_evals"], lo=0)
        for key in ("d", "prev_grad"):
            if key in d and np.shape(d[key]) != (self._n,):
                raise CheckpointError(f"L-BFGS state {key} has shape {np.shape(d[key])}, "
                                      f"expected ({self._n},)",
                                      "the checkpoint belongs to different parameters")
        for key, value in probe.hyperparameters().items():
            setattr(self, key, value)
        self._reset_memory()
        self.n_iter, self.func_evals = n_iter, func_evals
        self._h_diag = float(d["h_diag"])
        as_dev = lambda a: xp.array(a, dtype=self._dtype)  # noqa: E731 (a fresh device copy)
        self._s_hist = [as_dev(s) for s in s_hist]
        self._y_hist = [as_dev(y) for y in y_hist]
        self._rho_hist = [float(r) for r in rho]
        if "d" in d:
            self._d, self._t = as_dev(d["d"]), float(d["t"])
        if "prev_grad" in d:
            self._prev_g, self._prev_loss = as_dev(d["prev_grad"]), float(d["prev_loss"])


# ---- learning-rate schedules ------------------------------------------------------------------

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class Schedule:
    """Learning rate at a step (counted from 0): linear warmup from 0 to ``base_lr`` over
    ``warmup_steps``, then constant, or a linear / cosine decay reaching ``min_lr`` at
    ``total_steps`` and staying there. Build it with ``make_schedule``."""

    kind: str
    base_lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr: float = 0.0

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.base_lr * step / self.warmup_steps
        if self.kind == "constant":
            return self.base_lr
        span = self.total_steps - self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / span) if span > 0 else 1.0
        if self.kind == "linear":
            return self.base_lr + (self.min_lr - self.base_lr) * progress
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.base_lr - self.min_lr) * cosine


def make_schedule(kind: str, base_lr: float, total_steps: int, warmup_steps: int = 0,
                  min_lr: float = 0.0) -> Schedule:
    """A learning-rate schedule ``step -> lr`` (see ``Schedule``)."""
    if kind not in SCHEDULES:
        raise ConfigError(f"unknown learning-rate schedule {kind!r}",
                          f"use one of: {', '.join(SCHEDULES)}")
    base_lr = _check_lr(base_lr)
    total_steps = _integer("total_steps", total_steps, lo=1, hint="the number of optimizer steps")
    warmup_steps = _integer("warmup_steps", warmup_steps, lo=0, hint="0 disables warmup")
    if warmup_steps > total_steps:
        raise ConfigError(f"warmup_steps ({warmup_steps}) exceeds total_steps ({total_steps})",
                          "use fewer warmup steps than training steps")
    min_lr = _number("min_lr", min_lr, hi=base_lr,
                     hint="the final learning rate must lie between 0 and the base rate")
    return Schedule(kind, base_lr, total_steps, warmup_steps, min_lr)


# ---- gradient accumulation --------------------------------------------------------------------

class GradAccumulator:
    """Sums micro-batch gradients over one accumulation cycle.

    A cycle is ``add()`` one or more times, ``result()``, then ``reset()``. Each name's buffer is
    zeroed at its first ``add`` of a cycle (written as ``weight * g``, which is the same thing)
    and accumulates every later ``add`` of that name; buffers are reused across cycles and the
    caller's arrays are never aliased or modified. ``result()`` returns the buffers of the names
    added this cycle (no copy, valid until ``reset()``): the sum, or with ``average=True`` the
    sum divided in place by the total weight of all ``add`` calls of the cycle (= the number of
    micro-batches with the default weight 1; a micro-batch without a gradient for a name counts
    as zero for it). ``add`` after ``result`` raises until ``reset``.
    """

    def __init__(self, average: bool = False):
        self.average = bool(average)
        self._buffers: dict[str, Any] = {}
        self._active: dict[str, None] = {}   # names added this cycle, in order
        self.total_weight = 0.0
        self.n_micro_batches = 0
        self._done = False
        self._scratch = _Scratch()

    def add(self, grads: Mapping[str, Any], weight: float = 1.0) -> None:
        if self._done:
            raise RuntimeError("result() was already taken this cycle; call reset() first")
        weight = float(weight)
        if not math.isfinite(weight):
            raise ValueError(f"weight must be finite, got {weight}")
        for name, g in grads.items():
            xp = get_array_module(g)
            buf = self._buffers.get(name)
            if name not in self._active:
                if (buf is None or buf.shape != g.shape or buf.dtype != g.dtype
                        or get_array_module(buf) is not xp):
                    buf = self._buffers[name] = xp.empty(g.shape, g.dtype)
                if weight == 1.0:
                    xp.copyto(buf, g)
                else:
                    xp.multiply(g, weight, out=buf)
                self._active[name] = None
            else:
                if buf.shape != g.shape:
                    raise ValueError(f"gradient for {name!r} has shape {tuple(g.shape)}, earlier "
                                     f"micro-batches of this cycle had {tuple(buf.shape)}")
                self._axpy(buf, g, weight)
        self.total_weight += weight
        self.n_micro_batches += 1

    def _axpy(self, buf, g, weight: float) -> None:
        """buf += weight * g, in place, chunked through a small scratch on NumPy."""
        xp = get_array_module(buf)
        if weight == 1.0:
            xp.add(buf, g, out=buf)
        elif xp is not np or not buf.flags.c_contiguous:
            xp.add(buf, g * weight, out=buf)
        else:
            bf, gf = buf.reshape(-1), g.reshape(-1)
            step = _chunk_len(bf)
            s = self._scratch.get(bf, min(step, bf.size))[0]
            for a in range(0, bf.size, step):
                b = min(a + step, bf.size)
                np.multiply(gf[a:b], weight, out=s[:b - a])
                np.add(bf[a:b], s[:b - a], out=bf[a:b])

    def result(self) -> dict[str, Any]:
        out = {name: self._buffers[name] for name in self._active}
        if self.average and not self._done and out:
            if self.total_weight == 0.0:
                raise ValueError("cannot average gradients whose weights sum to zero")
            for buf in out.values():
                get_array_module(buf).divide(buf, self.total_weight, out=buf)
        self._done = True
        return out

    def reset(self) -> None:
        """Start a new cycle (buffers are kept for reuse and zeroed on their next first add)."""
        self._active.clear()
        self.total_weight = 0.0
        self.n_micro_batches = 0
        self._done = False


__all__ = ["AdamW", "SGD", "LBFGS", "StepStats", "Schedule", "SCHEDULES", "make_schedule",
           "GradAccumulator"]
