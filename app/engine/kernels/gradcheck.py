"""Float64 finite-difference gradient checks, as a library function (chainer's gradient_check).

A check picks a random direction d for every differentiable input, and compares the directional
derivative of a scalar loss, (L(x + eps d) - L(x - eps d)) / (2 eps), with the analytic
sum_i <grad_i, d_i>. One number per check, relative error; float64 throughout.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


def directional_check(loss: Callable[[Sequence[np.ndarray]], float], inputs: Sequence[np.ndarray],
                      grads: Sequence[np.ndarray | None], eps: float = 1e-6, seed: int = 0) -> float:
    """Relative error between the analytic and the central-difference directional derivative.

    loss(inputs) -> float; grads[i] is d loss / d inputs[i], or None for an input held constant.
    """
    rng = np.random.default_rng(seed)
    dirs = [None if g is None else rng.standard_normal(x.shape) for x, g in zip(inputs, grads)]
    shifted = lambda sign: [x if d is None else x + sign * eps * d for x, d in zip(inputs, dirs)]
    numeric = (loss(shifted(+1)) - loss(shifted(-1))) / (2 * eps)
    analytic = sum(float(np.sum(g * d)) for g, d in zip(grads, dirs) if g is not None)
    return abs(numeric - analytic) / max(abs(numeric), abs(analytic), 1e-12)


def check_backward(forward: Callable, backward: Callable, inputs: Sequence[np.ndarray],
                   differentiable: Sequence[bool] | None = None, eps: float = 1e-6,
                   seed: int = 0) -> float:
    """Check a kernel pair: forward(*inputs) -> (out, cache), backward(dout, cache) -> grads.

    The scalar loss is <out, R> for a fixed random R, so dout = R. `grads` from backward must
    align with `inputs` (None where an input is not differentiable). Returns the relative error.
    """
    inputs = [np.asarray(x, dtype=np.float64) if np.issubdtype(np.asarray(x).dtype, np.floating)
              else x for x in inputs]
    out, cache = forward(*inputs)
    r = np.random.default_rng(seed + 1).standard_normal(np.shape(out))
    grads = backward(r, cache)
    grads = grads if isinstance(grads, (tuple, list)) else (grads,)
    if differentiable is not None:
        grads = [g if ok else None for g, ok in zip(grads, differentiable)]
    return directional_check(lambda xs: float(np.sum(forward(*xs)[0] * r)), inputs, grads, eps, seed)
