"""NumPy/CuPy selection. Kernels call ``get_array_module(x)`` and never import cupy themselves.

A model is loaded for a device ("cpu" or "cuda", `array_module`); from then on its weights,
trained tensors, activations and optimizer state live there and every kernel follows its
inputs. This module is the only place that knows CuPy's own API (device count, memory).
"""

from __future__ import annotations

import os
import resource

import numpy as np

from app.engine.errors import ConfigError

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


def array_module(device: str):
    """numpy for "cpu", cupy for "cuda"; a clear error when no GPU is usable."""
    if device == "cpu":
        return np
    if device != "cuda":
        raise ConfigError(f"Unknown device {device!r}.", "Use cpu or cuda.")
    if not gpu_available():
        raise ConfigError("No CUDA GPU is usable here: CuPy is not installed, or it finds no "
                          "device.", "Install the gpu extra (pip install -e '.[gpu]') on a "
                          "machine with an NVIDIA GPU, or use --device cpu (the default).")
    return _cupy


def device_memory(xp) -> tuple[int, int]:
    """(free, total) bytes of the device that `xp` computes on (host RAM for NumPy)."""
    if xp is not np:
        free, total = xp.cuda.runtime.memGetInfo()
        return int(free), int(total)
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_report(xp) -> str:
    """What an out-of-memory message should say about memory on this device."""
    if xp is not np:
        free, total = device_memory(xp)
        return (f"GPU memory: {(total - free) / 2**20:.0f} MB in use of {total / 2**20:.0f} MB")
    return f"peak resident memory {peak_rss_mb():.0f} MB"
