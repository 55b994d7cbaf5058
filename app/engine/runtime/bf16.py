"""bf16 products on the CPU's matrix units: one small interface, so the kernels stay NumPy.

What runs in bf16 (issue 30) is the base's products: x W^T (forward) and dY W (backward) with
W a frozen weight (packed once, app.engine.model.weights), or under full fine-tuning a bf16 copy
of a trained matrix made per pass from its float32 master, whose dW = dY^T x runs in bf16 too
(app.engine.model.params.Params.base_weight); bf16 inputs, float32 accumulation. Everything
else (LoRA, its gradients, the optimizer, norms, softmax, the router, the residual stream, the
loss) stays float32. On a GPU `choose_precision` switches CuPy's float32 GEMMs to TF32 instead.

- `detect()` reads the CPU's flags once (/proc/cpuinfo): `amx_bf16` (Intel AMX) or
  `avx512_bf16` (AVX512-BF16: Zen 4/5, Cooper Lake and later Xeons). AMX tiles may only be
  touched after the kernel granted the process the tile state
  (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, asked here through a raw syscall before
  the library is loaded; oneDNN asks too). A CPU that lists amx_bf16 but whose kernel refuses (a
  VM, an old kernel) is treated as one without the unit: float32, with the refusal in the reason.
- The library is oneDNN, called through its C API (app.engine.runtime.onednn; `pip install -e
  '.[bf16]'` installs the `onednn-cpu-gomp` wheel; the measurements that chose it are in
  docs/PERFORMANCE.md, "bf16 products"). Loaded only once bf16 was chosen.
- `choose(requested)` turns `precision = auto|fp32|bf16` into a `Precision`: auto = bf16 where
  the unit and the library are there, float32 elsewhere; an explicit bf16 without the unit or the
  library runs the EMULATION (same numerics, slower than float32: for tests and comparisons).
  Each says why in `reason`, which the run's log, status.json and Monitor show.
- `pack(w)` rounds a float32 weight to bf16 once (`Bf16Weight`: the bits as uint16, half the
  float32 bytes; what the weight cache holds); `matmul(x, w, transpose)` is x @ w^T
  (transpose=True) or x @ w, float32 in and out.

Numerics, the same on both backends up to summation order: x and W rounded to bf16 (round to
nearest even), the products accumulated in float32 and returned in float32. So each output is
within 2u sum_k |x_k||w_k| of the exact product of the float32 inputs (u = 2^-8, one for each
input's rounding) plus the float32 accumulation term.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from app.engine.runtime import onednn

PRECISIONS = ("auto", "fp32", "bf16")
ENV = "WORKBENCH_PRECISION"
INSTALL_HINT = "pip install -e '.[bf16]'"
# Training steps in bf16 against float32 (python -m bench --quick's rows with the weight cache,
# ctx 256: 1.40-1.72x on the quiet machine) on the AVX512-BF16 machine that measured them
# (docs/PERFORMANCE.md, "bf16 products"): what the reason promises a user without the extra.
# Rounded: machines differ.
MEASURED_GAIN = "1.4-1.7x"

# oneDNN's wheel links GCC's OpenMP runtime from the system (app/engine/runtime/onednn.py).
LIBGOMP_HINT = "libgomp1 on Debian and Ubuntu, libgomp on Fedora"

# arch_prctl(2) on x86-64: request permission for a dynamically enabled XSAVE feature.
SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


@dataclass(frozen=True)
class Device:
    """What this CPU offers: `unit` ("AMX-BF16", "AVX512-BF16" or None), `library` (oneDNN's
    wheel installed), `refused` (the kernel refused AMX's tile state: its message, else "")."""

    unit: str | None
    library: bool
    refused: str = ""


@dataclass(frozen=True)
class Precision:
    """The chosen precision of the frozen base's products: `name` "fp32", "bf16" (the CPU) or
    "tf32" (a GPU: choose_precision), `backend` "onednn", "emulation" or "cublas", `reason`
    one line for the log, status and Monitor."""

    name: str
    backend: str | None
    reason: str

    @property
    def bf16(self) -> bool:
        return self.name == "bf16"

    def to_dict(self) -> dict:
        return {"precision": self.name, "backend": self.backend, "reason": self.reason}


FP32 = Precision("fp32", None, "float32")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The flags of the first processor in /proc/cpuinfo (or of the text given); empty where
    there is no such file (not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def bf16_unit(flags: frozenset[str]) -> str | None:
    """The CPU's bf16 matrix unit by its flags, the best first."""
    if {"amx_bf16", "amx_tile"} <= flags:
        return "AMX-BF16"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    return None


def request_amx_permission(syscall: Callable[..., int] | None = None) -> str:
    """Ask the kernel for the AMX tile state for this process: "" when granted, else why not.
    Must run before any tile instruction (an ungranted one kills the thread with SIGILL);
    asking again once granted is harmless. `syscall` is for tests (libc's by default)."""
    try:
        if syscall is None:
            libc = ctypes.CDLL(None, use_errno=True)
            syscall = libc.syscall
        rc = syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    except (OSError, AttributeError) as exc:
        return f"arch_prctl unavailable ({exc})"
    if rc != 0:
        err = ctypes.get_errno()
        why = os.strerror(err) if err else rc
        return f"the kernel refused AMX's tile state (arch_prctl: {why})"
    return ""


def library_available() -> bool:
    """oneDNN's wheel installed (found by its file list, not loaded)."""
    return onednn.library_path() is not None


_device: Device | None = None


def detect(flags: frozenset[str] | None = None, library: bool | None = None,
           syscall: Callable[..., int] | None = None) -> Device:
    """This CPU's bf16 unit and library, detected once (the arguments fake them, for tests:
    any given one skips the cache)."""
    global _device
    faked = flags is not None or library is not None or syscall is not None
    if _device is not None and not faked:
        return _device
    unit = bf16_unit(cpu_flags() if flags is None else flags)
    refused = ""
    if unit == "AMX-BF16":
        refused = request_amx_permission(syscall)
        if refused:
            unit = None
    device = Device(unit, library_available() if library is None else library, refused)
    if not faked:
        _device = device
    return device


def choose(requested: str = "auto", device: Device | None = None) -> Precision:
    """`precision` (auto|fp32|bf16) on this device (detect() unless given) -> Precision.
    WORKBENCH_PRECISION=fp32|bf16 in the environment decides what auto means (the test suite
    sets fp32, so its float32 expectations hold on every CPU: tests/conftest.py)."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {requested!r}")
    forced = os.environ.get(ENV, "").strip().lower()
    if requested == "auto" and forced == "fp32":
        return Precision("fp32", None, f"float32: {ENV}=fp32")
    if requested == "auto" and forced == "bf16":
        chosen = choose(forced, device)
        return replace(chosen, reason=f"{chosen.reason} ({ENV}=bf16)")
    if requested == "fp32":
        return Precision("fp32", None, "float32: asked for (--precision fp32)")
    device = detect() if device is None else device
    if device.unit and device.library:
        return Precision("bf16", "onednn", f"bf16: {device.unit} via oneDNN")
    if requested == "bf16":
        why = ("this CPU has no bf16 unit" if not device.unit
               else f"the bf16 extra is missing ({INSTALL_HINT})")
        return Precision("bf16", "emulation", f"bf16 emulated in NumPy ({why}): slower than "
                         "float32, the same numerics")
    if device.refused:
        return Precision("fp32", None, f"float32: {device.refused}")
    if not device.unit:
        return Precision("fp32", None, "float32: this CPU has no bf16 unit")
    return Precision("fp32", None, f"float32: install the bf16 extra: {INSTALL_HINT} "
                                   f"(measured {MEASURED_GAIN} on an {device.unit} CPU)")


def choose_precision(requested: str, xp=np) -> Precision:
    """`choose` for a run computing on `xp`. On a GPU (CuPy) every float32 product is cuBLAS's:
    auto (and bf16, whose GPU path is not built) switch CuPy's float32 GEMMs to TF32 on the
    tensor cores (inputs rounded to 10 bits, float32 accumulation) where the GPU has them
    (compute capability 8.0 and later), and fp32 sets them back to plain float32 (the mode is
    CuPy's, for the whole process)."""
    if xp is np:
        chosen = choose(requested)
        if chosen.backend == "onednn":
            try:                       # the run will use it: load it now, or say why not
                _library()
            except Exception as exc:   # noqa: BLE001 - a broken install: float32, said so
                why = f"the bf16 library failed to load or run ({type(exc).__name__}: {exc})"
                if "libgomp" in str(exc):    # the wheel links the system's OpenMP runtime
                    why += f"; install GCC's OpenMP runtime ({LIBGOMP_HINT})"
                if requested == "bf16":
                    return Precision("bf16", "emulation", f"bf16 emulated in NumPy ({why})")
                return Precision("fp32", None, f"float32: {why}")
        return chosen
    if requested not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {requested!r}")
    forced = os.environ.get(ENV, "").strip().lower()
    if requested == "auto" and forced in ("fp32", "bf16"):     # as on the CPU (`choose`)
        chosen = choose_precision(forced, xp)
        return replace(chosen, reason=f"float32: {ENV}=fp32" if chosen.name == "fp32"
                       else f"{chosen.reason} ({ENV}={forced})")
    linalg = xp._core._routines_linalg
    cc = int(xp.cuda.Device().compute_capability)
    if requested == "fp32" or cc < 80:
        linalg.set_compute_type(xp.float32, linalg.COMPUTE_TYPE_DEFAULT)
        why = ("asked for (--precision fp32)" if requested == "fp32" else
               f"this GPU (compute capability {cc / 10:.1f}) has no TF32 tensor cores")
        return Precision("fp32", None, f"float32: {why}")
    linalg.set_compute_type(xp.float32, linalg.COMPUTE_TYPE_TF32)
    note = "" if requested == "auto" else " (bf16 on the GPU is not built yet)"
    return Precision("tf32", "cublas", f"tf32: the float32 products on the GPU's tensor cores "
                                       f"(compute capability {cc / 10:.1f}){note}")


# ---------------------------------------------------------------------------------------------
# The numbers: rounding, packing, products.

def round_bits(x) -> np.ndarray:
    """float32 -> the bf16 bits (uint16, same shape), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():                     # the carry would make a NaN with a small payload infinite
        rounded = np.where(nan, (u >> 16) | np.uint32(0x40), rounded)
    return rounded.astype(np.uint16)


def widen(bits) -> np.ndarray:
    """bf16 bits (uint16) -> float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_bf16(x) -> np.ndarray:
    """float32 x rounded to the nearest bf16 value, as float32."""
    return widen(round_bits(x))


class Bf16Weight:
    """A frozen weight (out, in) in bf16: `bits` uint16, C-contiguous, half its float32 bytes;
    `backend` "onednn" or "emulation", the one its products run on. Rows slice (the loss
    head's vocabulary chunks) without a copy."""

    __slots__ = ("bits", "backend")

    def __init__(self, bits: np.ndarray, backend: str = "emulation"):
        self.bits, self.backend = bits, backend

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes

    dtype = np.dtype(np.float32)      # what its products give

    def __len__(self) -> int:
        return self.bits.shape[0]

    def __getitem__(self, rows):
        return Bf16Weight(self.bits[rows], self.backend)

    def widened(self) -> np.ndarray:
        """The float32 values (a new array): the emulation's operand, and for tests."""
        return widen(self.bits)


def is_packed(w) -> bool:
    return isinstance(w, Bf16Weight)


def product(x, w, transpose: bool = True, out=None, xp=np):
    """x @ w^T (transpose) or x @ w, for a frozen base weight: in bf16 (`matmul`) when w is a
    Bf16Weight, else xp.matmul in w's own dtype. The kernels call this for the base's
    products."""
    if isinstance(w, Bf16Weight):
        return matmul(x, w, transpose, out)
    return xp.matmul(x, w.T if transpose else w, out=out)


def _library():
    """oneDNN, opened once and tried on a tiny product (app.engine.runtime.onednn.load and
    check: OSError or OneDNNError where it cannot run here)."""
    lib = onednn.load()
    onednn.check()
    return lib


def pack(w, backend: str = "emulation") -> Bf16Weight:
    """A float32 weight (out, in) rounded to bf16 once, for `matmul` on `backend`. With the
    library its reorder rounds (to nearest even, the same bits as round_bits: tested), in one
    pass where round_bits makes several: full fine-tuning rounds every trained matrix once per
    pass."""
    if backend != "onednn":
        return Bf16Weight(round_bits(w))
    return Bf16Weight(onednn.to_bf16(w), backend)


def matmul(x, w: Bf16Weight, transpose: bool = True, out=None) -> np.ndarray:
    """x (M, K) float32 @ w^T (w (N, K), transpose=True) or @ w (w (K, N)) -> (M, N) float32
    (into `out` if given, a float32 array), in bf16 with float32 accumulation: see the module
    docstring for the numerics."""
    if w.backend != "onednn":
        return emulated_matmul(x, w.bits, transpose, out)
    if out is None:
        out = np.empty((x.shape[0], w.shape[0] if transpose else w.shape[1]), np.float32)
    return onednn.matmul(x, w.bits, transpose, out)


def emulated_matmul(x, bits, transpose: bool = True, out=None) -> np.ndarray:
    """The library's numerics in NumPy (the oracle, and the path of CPUs without the unit):
    inputs rounded to bf16, a float32 product."""
    wf = widen(bits)
    return np.matmul(round_bf16(x), wf.T if transpose else wf, out=out)
