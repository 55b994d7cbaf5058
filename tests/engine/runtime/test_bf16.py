"""app.engine.runtime.bf16: detection with a faked CPU and library, the AMX permission refused,
bf16 rounding, and each bf16 product against its error bound.

The bound of one output of x @ w^T in bf16 (see the module docstring for the numerics): x and w
rounded to bf16 (relative error <= u = 2^-8 each, so each product within (2u + u^2) of exact),
and a float32 sum of K products (within gamma_K of its exact value, tests/float32_bounds.py),
returned in float32: with M = sum_k |x_k||w_k|, |got - exact| <= (2u + u^2) M + gamma_K (1 + 2u
+ u^2) M, taken as (2u + gamma_K) M (1 + 2u). The emulation against the library (same rounded
inputs, other summation order): the two float32 sums differ by <= 2 gamma_K M' (M' the sum on
the rounded inputs).
"""

from __future__ import annotations

import numpy as np
import pytest

from app.engine.runtime import bf16
from tests.float32_bounds import gamma

U = 2.0 ** -8
RNG = np.random.default_rng(30)


def exact_and_magnitude(x, w, transpose=True):
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    w64 = w64.T if transpose else w64
    return x64 @ w64, np.abs(x64) @ np.abs(w64)


# --- detection and choice -------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _auto_not_forced(monkeypatch):
    """The suite sets WORKBENCH_PRECISION=fp32 (tests/conftest.py); here auto is auto."""
    monkeypatch.delenv(bf16.ENV, raising=False)


def test_the_environment_decides_what_auto_means(monkeypatch):
    device = bf16.detect(flags=frozenset({"avx512_bf16"}), library=True)
    monkeypatch.setenv(bf16.ENV, "fp32")
    assert bf16.choose("auto", device).name == "fp32"
    assert bf16.choose("bf16", device).name == "bf16"          # an explicit choice stays
    monkeypatch.setenv(bf16.ENV, "bf16")
    assert bf16.choose("auto", bf16.detect(flags=frozenset(), library=False)).backend == \
        "emulation"


def test_flags_from_cpuinfo_text():
    text = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n\nprocessor\t: 1\n"
    assert bf16.cpu_flags(text) == {"fpu", "sse", "avx512f", "avx512_bf16"}
    assert bf16.cpu_flags("no flags here") == frozenset()


@pytest.mark.parametrize("flags, unit", [
    ({"amx_bf16", "amx_tile", "avx512_bf16"}, "AMX-BF16"),
    ({"avx512_bf16", "avx512f"}, "AVX512-BF16"),
    ({"avx2", "fma", "avx512f"}, None),
])
def test_unit_by_flags(flags, unit):
    assert bf16.bf16_unit(frozenset(flags)) == unit


def test_choice_with_unit_and_library():
    device = bf16.detect(flags=frozenset({"avx512_bf16"}), library=True)
    got = bf16.choose("auto", device)
    assert (got.name, got.backend) == ("bf16", "onednn")
    assert got.reason == "bf16: AVX512-BF16 via oneDNN"
    assert bf16.choose("fp32", device).name == "fp32"


def test_choice_without_unit():
    device = bf16.detect(flags=frozenset({"avx2"}), library=True)
    assert bf16.choose("auto", device) == bf16.Precision(
        "fp32", None, "float32: this CPU has no bf16 unit")
    forced = bf16.choose("bf16", device)      # asked for: the emulation, which says so
    assert (forced.name, forced.backend) == ("bf16", "emulation")
    assert "no bf16 unit" in forced.reason


def test_choice_without_library_names_the_extra():
    device = bf16.detect(flags=frozenset({"avx512_bf16"}), library=False)
    got = bf16.choose("auto", device)
    assert got.name == "fp32"
    assert "pip install -e '.[bf16]'" in got.reason and "measured" in got.reason
    assert bf16.choose("bf16", device).backend == "emulation"


def test_amx_permission_granted_and_refused():
    flags = frozenset({"amx_bf16", "amx_tile", "avx512_bf16"})
    calls = []

    def granted(*args):
        calls.append(args)
        return 0
    device = bf16.detect(flags=flags, library=True, syscall=granted)
    assert device.unit == "AMX-BF16" and device.refused == ""
    assert calls == [(bf16.SYS_ARCH_PRCTL, bf16.ARCH_REQ_XCOMP_PERM, bf16.XFEATURE_XTILEDATA)]
    # A VM or an old kernel: the flags are there, the permission is not -> float32, no crash.
    refused = bf16.detect(flags=flags, library=True, syscall=lambda *args: -1)
    assert refused.unit is None and "refused" in refused.refused
    got = bf16.choose("auto", refused)
    assert got.name == "fp32" and "refused AMX" in got.reason


def test_a_library_that_fails_to_load_falls_back_with_its_reason(monkeypatch):
    monkeypatch.setattr(bf16, "_device", bf16.Device("AVX512-BF16", True))

    def broken():
        raise OSError("libgomp.so.1: cannot open shared object file")
    monkeypatch.setattr(bf16, "_library", broken)
    auto = bf16.choose_precision("auto")
    assert auto.name == "fp32" and "libgomp.so.1" in auto.reason
    assert "install GCC's OpenMP runtime (libgomp1" in auto.reason
    forced = bf16.choose_precision("bf16")
    assert forced.backend == "emulation" and "failed to load or run" in forced.reason


@pytest.mark.skipif(not bf16.library_available(), reason="the bf16 extra is not installed")
def test_a_library_whose_product_is_wrong_falls_back(monkeypatch):
    """The run tries one tiny product before it trusts the library (onednn.check)."""
    from app.engine.runtime import onednn
    monkeypatch.setattr(bf16, "_device", bf16.Device("AVX512-BF16", True))
    onednn.check()                                              # this machine's: right
    monkeypatch.setattr(onednn, "matmul", lambda x, w, t, out: out * 0)
    auto = bf16.choose_precision("auto")
    assert auto.name == "fp32" and "OneDNNError" in auto.reason and "gave" in auto.reason


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="auto, fp32, bf16"):
        bf16.choose("fp16")


def test_this_machine_detects_without_error():
    device = bf16.detect()
    assert device is bf16.detect()                       # once
    assert bf16.choose("auto").name in ("fp32", "bf16")


@pytest.mark.parametrize("cc, requested, name, compute_type", [
    ("80", "auto", "tf32", 7), ("90", "bf16", "tf32", 7), ("80", "fp32", "fp32", 1),
    ("75", "auto", "fp32", 1)])
def test_a_gpu_uses_tf32_where_it_has_tensor_cores(monkeypatch, cc, requested, name,
                                                   compute_type):
    from tests import fake_cupy
    fake_cupy.install(monkeypatch)
    fake_cupy.device["compute_capability"] = cc
    got = bf16.choose_precision(requested, fake_cupy.module)
    assert got.name == name and fake_cupy.device["float32_compute_type"] == compute_type
    assert (f"compute capability {int(cc) / 10:.1f}" in got.reason) == (requested != "fp32")
    assert ("not built" in got.reason) == (requested == "bf16")
    monkeypatch.setenv(bf16.ENV, "fp32")                  # the suite's: plain float32 GEMMs
    assert bf16.choose_precision("auto", fake_cupy.module).name == "fp32"
    assert fake_cupy.device["float32_compute_type"] == 1


# --- rounding --------------------------------------------------------------------------------

def test_rounding_is_to_nearest_even():
    one = 1.0
    ulp = 2.0 ** -7                                      # bf16 spacing in [1, 2)
    x = np.array([one + ulp / 2, one + 3 * ulp / 2, one + ulp / 2 + 2 ** -20, -(one + ulp / 2),
                  np.inf, -np.inf, 0.0, 3.4e38, 1e-40], np.float32)
    got = bf16.round_bf16(x)
    assert got[0] == one                                  # tie -> even (down)
    assert got[1] == one + 2 * ulp                        # tie -> even (up)
    assert got[2] == one + ulp                            # above the tie -> up
    assert got[3] == -one
    assert np.isposinf(got[4]) and np.isneginf(got[5]) and got[6] == 0.0
    assert np.isinf(got[7])                               # past bf16's largest finite: inf
    assert np.isnan(bf16.round_bf16(np.array([np.nan], np.float32)))[0]


def test_rounding_is_the_nearest_bf16_value():
    x = (RNG.standard_normal(100_000) * 10.0 ** RNG.integers(-30, 30, 100_000)).astype(np.float32)
    got = bf16.round_bf16(x).astype(np.float64)
    below = bf16.widen(np.ascontiguousarray(x).view(np.uint32) >> 16).astype(np.float64)
    above = bf16.widen((np.ascontiguousarray(x).view(np.uint32) >> 16) + 1).astype(np.float64)
    x64 = x.astype(np.float64)
    best = np.minimum(np.abs(x64 - below), np.abs(x64 - above))
    assert np.all(np.abs(x64 - got) == best)              # never the farther neighbour
    assert np.all(np.abs(x64 - got) <= U * np.abs(x64))   # relative error <= u = 2^-8


@pytest.mark.skipif(not bf16.library_available(), reason="the bf16 extra is not installed")
def test_the_librarys_rounding_is_ours():
    x = (RNG.standard_normal(200_000) * 10.0 ** RNG.integers(-30, 30, 200_000)).astype(np.float32)
    x[:4] = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.4e38]          # ties, overflow
    np.testing.assert_array_equal(bf16.pack(x[None], "onednn").bits[0], bf16.round_bits(x))


def test_packed_weight_is_half_the_bytes_and_slices_rows():
    w = RNG.standard_normal((96, 64)).astype(np.float32)
    packed = bf16.pack(w)
    assert packed.shape == w.shape and packed.nbytes == w.nbytes // 2
    np.testing.assert_array_equal(packed[16:32].widened(), bf16.round_bf16(w[16:32]))


# --- products --------------------------------------------------------------------------------

BACKENDS = ["emulation"] + (["onednn"] if bf16.library_available() else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transpose", [True, False])
def test_product_within_bf16_bound(backend, transpose):
    m, k, n = 37, 300, 53
    x = RNG.standard_normal((m, k)).astype(np.float32)
    w = RNG.standard_normal((n, k) if transpose else (k, n)).astype(np.float32)
    w[0] *= 1e3                                           # magnitudes that differ by rows
    got = bf16.matmul(x, bf16.pack(w, backend), transpose)
    assert got.dtype == np.float32 and got.shape == (m, n)
    exact, mag = exact_and_magnitude(x, w, transpose)
    bound = (2 * U + gamma(k)) * (1 + 2 * U) * mag
    assert np.all(np.abs(got - exact) <= bound)
    # ... and it is bf16, not float32: far outside float32's own bound somewhere.
    assert np.any(np.abs(got - exact) > 4 * gamma(k) * mag)


@pytest.mark.parametrize("backend", BACKENDS)
def test_product_into_out_rows(backend):
    x = RNG.standard_normal((32, 48)).astype(np.float32)
    w = bf16.pack(RNG.standard_normal((40, 48)).astype(np.float32), backend)
    out = np.full((32, 40), np.nan, np.float32)
    bf16.matmul(x[:16], w, True, out=out[:16])
    bf16.matmul(x[16:], w, True, out=out[16:])
    # bit-identical to the same two calls without `out` (a 16-row and a 32-row product of the
    # whole x are different BLAS calls: equal only up to float32 summation order)
    np.testing.assert_array_equal(out, np.concatenate([bf16.matmul(x[:16], w, True),
                                                       bf16.matmul(x[16:], w, True)]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_product_of_a_transposed_view_into_columns(backend):
    """Full fine-tuning's dW = dY^T x: x a transposed view, the result written into a block
    of dW's columns; the rest of dW untouched."""
    dy = RNG.standard_normal((70, 24)).astype(np.float32)              # (T, out)
    x = bf16.pack(RNG.standard_normal((70, 40)).astype(np.float32), backend)   # (T, in)
    dw = np.full((24, 100), np.nan, np.float32)
    bf16.matmul(dy.T, x, False, out=dw[:, 30:70])
    assert np.isnan(dw[:, :30]).all() and np.isnan(dw[:, 70:]).all()
    # against the product of a contiguous copy (another call: equal up to summation order)
    again = bf16.matmul(np.ascontiguousarray(dy.T), x, False)
    _, mag = exact_and_magnitude(bf16.round_bf16(dy.T), x.widened(), False)
    assert np.all(np.abs(dw[:, 30:70].astype(np.float64) - again) <= 2 * gamma(70) * mag)


@pytest.mark.skipif(not bf16.library_available(), reason="the bf16 extra is not installed")
@pytest.mark.parametrize("transpose", [True, False])
def test_emulation_is_the_library_up_to_summation_order(transpose):
    m, k, n = 64, 512, 96
    x = RNG.standard_normal((m, k)).astype(np.float32)
    w = RNG.standard_normal((n, k) if transpose else (k, n)).astype(np.float32)
    lib = bf16.matmul(x, bf16.pack(w, "onednn"), transpose)
    emu = bf16.matmul(x, bf16.pack(w, "emulation"), transpose)
    _, mag = exact_and_magnitude(bf16.round_bf16(x), bf16.round_bf16(w), transpose)
    assert np.all(np.abs(lib.astype(np.float64) - emu) <= 2 * gamma(k) * mag)
