"""The compiled CPU kernel layer: Numba kernels for the work between the GEMMs.

A kernel with a compiled version keeps its NumPy twin, which stays the reference: the tests
compare the two (bit for bit where the operation order is the same, else to the float32 bound
of the operation) and the float64 gradient checks run on both. `WORKBENCH_KERNELS=numpy` runs
every NumPy twin (debugging, platforms without Numba wheels); the default is compiled where
Numba imports. Compiled kernels are cached on disk (`cache=True`): a process pays the compile
once per kernel after an install, later processes load it. Numba keys that cache by the kernel's
source file, not by the settings of `njit` below: after changing them, delete the kernels'
`__pycache__/*.nbi` and `*.nbc` files, or the old machine code keeps loading. CuPy arrays never
take these paths.
"""

from __future__ import annotations

import os
from typing import Callable

ENV_VAR = "WORKBENCH_KERNELS"


def _numba():
    if os.environ.get(ENV_VAR, "").strip().lower() == "numpy":
        return None
    try:
        import numba
    except ImportError:          # no wheel for this platform: the NumPy twins
        return None
    return numba


def compiled() -> bool:
    """Do compiled kernels run in this process (Numba imported, not switched off)?"""
    return _numba() is not None


def njit(**options) -> Callable:
    """numba.njit(cache=True, fastmath=False, nogil=True, error_model="numpy", **options), or,
    without Numba, a decorator that returns None: callers check `compiled()` and use the NumPy
    twin. error_model="numpy": a float division by zero gives inf/NaN as in NumPy instead of
    raising, and without that check in the loop LLVM vectorizes it (AdamW's update: 40 -> 11 ms
    for 12.8 M float32 parameters on one core)."""
    numba = _numba()
    if numba is None:
        return lambda fn: None
    settings = dict(cache=True, fastmath=False, nogil=True, error_model="numpy")
    settings.update(options)
    return numba.njit(**settings)
