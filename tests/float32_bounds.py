"""Error bounds for float32 results whose BLAS calls differ from another path's.

Two paths that split a product differently (column blocks, row blocks, another device) make
different BLAS calls, and OpenBLAS picks its kernels by CPU, so their last bits may differ on
some machine even where they agree on this one. Such tests compare each path with the same
computation in float64 and assert the classical bound (Higham, Accuracy and Stability of
Numerical Algorithms, sections 3.1 and 3.5): a float32 sum of products evaluated in any order,
with or without FMA, through at most n roundings on any path from the inputs, is within
gamma_n * M of the exact value, where gamma_n = n u / (1 - n u), u = 2^-24, and M is the same
computation on the inputs' absolute values (every term counted with a plus sign). A wrong
block, a race or a lost term moves results by O(M), far beyond gamma_n M.
"""

from __future__ import annotations

import numpy as np

U = 2.0 ** -24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def as64(*arrays):
    return [None if a is None else np.asarray(a, dtype=np.float64) for a in arrays]


def abs64(*arrays):
    return [None if a is None else np.abs(np.asarray(a, dtype=np.float64)) for a in arrays]


def assert_within_gamma(got, exact, magnitude, n: int, err_msg: str = "") -> None:
    """|got - exact| <= gamma_n * magnitude, element by element."""
    diff = np.abs(np.asarray(got, np.float64) - exact)
    bound = gamma(n) * np.asarray(magnitude, np.float64)
    worst = np.unravel_index(np.argmax(diff - bound), diff.shape) if diff.ndim else ()
    assert np.all(diff <= bound), (f"{err_msg}: |diff| {diff[worst]:.3g} > bound "
                                   f"{bound[worst]:.3g} at {worst}")
