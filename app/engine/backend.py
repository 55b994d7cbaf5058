"""NumPy/CuPy selection. Kernels call ``get_array_module(x)`` and never import cupy themselves."""

from __future__ import annotations

import numpy as np

try:  # CuPy is an optional extra (`pip install .[gpu]`); these machines have no GPU.
    import cupy as _cupy  # type: ignore
except Exception:  # ImportError, or a CUDA runtime that fails to initialise
    _cupy = None


def get_array_module(*arrays):
    """Return ``cupy`` if any argument is a CuPy array, else ``numpy``."""
    if _cupy is not None:
        return _cupy.get_array_module(*arrays)
    return np


def gpu_available() -> bool:
    if _cupy is None:
        return False
    try:
        return _cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def to_host(x) -> np.ndarray:
    """Copy an array to host memory as NumPy (no copy for NumPy input)."""
    if _cupy is not None and isinstance(x, _cupy.ndarray):
        return _cupy.asnumpy(x)
    return np.asarray(x)


def device_info() -> str:
    if gpu_available():
        props = _cupy.cuda.runtime.getDeviceProperties(0)
        return f"GPU: {props['name'].decode()}"
    return "CPU (NumPy)"
