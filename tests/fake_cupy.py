"""A stand-in for CuPy on machines without a GPU, so CPU tests run the engine's device code paths.

Device arrays are NumPy arrays of the subclass `DeviceArray`. Like CuPy arrays they refuse to
mix with host arrays in arithmetic and NumPy functions (TypeError: a host array that slipped
into a device computation is a bug, and a copy on a real GPU). Every device-to-host read
(`.get()`, `asnumpy`, `.item()`, `.tolist()`, `float()`, `int()`, `bool()`) is counted in
`transfers`, so tests can assert how many host round trips a training step makes.

`install(monkeypatch)` makes `app.engine.runtime.backend` see this module as CuPy with one device.
"""

from __future__ import annotations

import types

import numpy as np

transfers = {"to_host": 0, "to_device": 0}


class DeviceArray(np.ndarray):
    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        if out is not None:
            kwargs["out"] = tuple(_to_plain(o) for o in out)
        result = getattr(ufunc, method)(*(_to_plain(x) for x in inputs), **kwargs)
        return _wrap(result)

    def __array_function__(self, func, types_, args, kwargs):
        return _wrap(func(*_to_plain(args), **_to_plain(kwargs)))

    def get(self) -> np.ndarray:
        transfers["to_host"] += 1
        return np.array(self.view(np.ndarray))

    def item(self, *args):
        transfers["to_host"] += 1
        return self.view(np.ndarray).item(*args)

    def tolist(self):
        transfers["to_host"] += 1
        return self.view(np.ndarray).tolist()

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __index__(self):
        return int(self.item())

    def __bool__(self):
        return bool(self.item())


def _to_plain(x):
    """Device arrays -> plain views; a host array (not a scalar) in a device operation raises."""
    if isinstance(x, DeviceArray):
        return x.view(np.ndarray)
    if isinstance(x, np.ndarray) and x.ndim > 0:
        raise TypeError(f"host array of shape {x.shape} mixed with device arrays")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_plain(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_plain(v) for k, v in x.items()}
    return x


def _wrap(result):
    if isinstance(result, np.generic):              # reductions give 0-d device arrays, as CuPy
        result = np.asarray(result)
    if isinstance(result, np.ndarray) and not isinstance(result, DeviceArray):
        return result.view(DeviceArray)
    if isinstance(result, tuple):
        return tuple(_wrap(r) for r in result)
    if isinstance(result, list):
        return [_wrap(r) for r in result]
    return result


def asarray(a, dtype=None, **kwargs):
    if isinstance(a, DeviceArray):
        return a if dtype is None else a.astype(dtype, copy=False)
    if isinstance(a, np.ndarray) and a.ndim > 0:
        transfers["to_device"] += 1
    return np.array(a, dtype=dtype, **kwargs).view(DeviceArray)


def asnumpy(a) -> np.ndarray:
    return a.get() if isinstance(a, DeviceArray) else np.asarray(a)


def get_array_module(*arrays):
    return module if any(isinstance(a, DeviceArray) for a in arrays) else np


def _device_function(name: str):
    fn = getattr(np, name)

    def call(*args, **kwargs):
        return _wrap(fn(*_to_plain(args), **_to_plain(kwargs)))
    call.__name__ = name
    return call


module = types.ModuleType("fake_cupy")
for _name in dir(np):
    _attr = getattr(np, _name)
    if callable(_attr) and not isinstance(_attr, type) and not _name.startswith("_"):
        setattr(module, _name, _device_function(_name))
    elif not _name.startswith("_"):
        setattr(module, _name, _attr)       # dtypes, constants (float32, inf, newaxis, ...)
module.ndarray = DeviceArray
module.asarray = asarray
module.array = asarray
module.asnumpy = asnumpy
module.get_array_module = get_array_module
_GPU_BYTES = 16 << 30
module.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(
    getDeviceCount=lambda: 1,
    memGetInfo=lambda: (_GPU_BYTES // 2, _GPU_BYTES),
    getDeviceProperties=lambda i: {"name": b"Fake GPU (tests)", "totalGlobalMem": _GPU_BYTES}),
    Device=lambda *a: types.SimpleNamespace(compute_capability=device["compute_capability"]))
# The device's compute capability (CuPy's string form) and the float32 GEMMs' compute type as
# set through CuPy's _core._routines_linalg.set_compute_type (1 default, 7 TF32).
device = {"compute_capability": "80", "float32_compute_type": None}


def _set_compute_type(dtype, compute_type):
    assert np.dtype(dtype) == np.float32
    device["float32_compute_type"] = compute_type


module._core = types.SimpleNamespace(_routines_linalg=types.SimpleNamespace(
    COMPUTE_TYPE_DEFAULT=1, COMPUTE_TYPE_TF32=7, set_compute_type=_set_compute_type))


def install(monkeypatch) -> None:
    import app.engine.runtime.backend as backend
    monkeypatch.setattr(backend, "_cupy", module)
    transfers.update(to_host=0, to_device=0)
    device.update(compute_capability="80", float32_compute_type=None)
