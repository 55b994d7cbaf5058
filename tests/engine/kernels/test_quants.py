"""Array dequantization kernels against gguf.quants (gguf 0.19.0, bit-exact with llama.cpp's C)."""

from __future__ import annotations

import ast
import inspect

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from app.engine.kernels import dequant_compiled, jit, quants

TYPES = sorted(quants.BLOCK_SIZES)
IDS = [quants.TYPE_NAMES[t] for t in TYPES]

# Byte offsets of the fp16 fields (scales, mins) in each block type.
F16_FIELDS = {
    quants.Q4_0: [0], quants.Q4_1: [0, 2], quants.Q5_0: [0], quants.Q5_1: [0, 2], quants.Q8_0: [0],
    quants.Q2_K: [80, 82], quants.Q3_K: [108], quants.Q4_K: [0, 2], quants.Q5_K: [0, 2],
    quants.Q6_K: [208],
}


def finite_bits(rng, n, bits):
    """n random bit patterns of an IEEE float with `bits` bits (16, 32 or "bf16"), all finite.

    Zeros, subnormals and both signs are all possible. An all-ones exponent has its top bit cleared.
    """
    if bits == 32:
        u = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
        exp_mask, top = np.uint32(0x7F800000), np.uint32(0x40000000)
    else:
        u = rng.integers(0, 2**16, n, dtype=np.uint32).astype(np.uint16)
        exp_mask = np.uint16(0x7C00 if bits == 16 else 0x7F80)
        top = np.uint16(0x4000)
    u[(u & exp_mask) == exp_mask] ^= top
    return u


def random_raw(t, shape, rng, finite=True):
    """Random raw rows, uint8 shape (*shape[:-1], shape[-1] * block_bytes) with shape[-1] blocks.

    The payload bytes are fully random. With finite=True the fp16 scales and F16/BF16/F32 values
    are random finite floats, so that NaN != NaN cannot weaken the comparison.
    """
    *lead, k = shape
    _, block_bytes = quants.BLOCK_SIZES[t]
    raw = rng.integers(0, 256, (*lead, k * block_bytes), dtype=np.uint8)
    if not finite:
        return raw
    blocks = raw.reshape(-1, block_bytes)                                # (n_blocks, block_bytes)
    n = blocks.shape[0]
    if t in (quants.F32, quants.F16, quants.BF16):
        kind = {quants.F32: 32, quants.F16: 16, quants.BF16: "bf16"}[t]
        blocks[:] = finite_bits(rng, n, kind).view(np.uint8).reshape(n, block_bytes)
    for pos in F16_FIELDS.get(t, []):
        blocks[:, pos:pos + 2] = finite_bits(rng, n, 16).view(np.uint8).reshape(n, 2)
    return raw


def oracle(raw, t):
    ref = gguf.quants.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(t))
    return np.asarray(ref, dtype=np.float32)


def assert_bits_equal(got, expect):
    assert got.dtype == np.float32 and got.shape == expect.shape
    np.testing.assert_array_equal(got.view(np.uint32), expect.view(np.uint32))


# ------------------------------------------------------------------------------- bit-exactness

@pytest.mark.parametrize("k", [1, 2, 7, 16])
@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_bit_exact_with_gguf(t, k):
    rng = np.random.default_rng(1000 * t + k)
    raw = random_raw(t, (3, k), rng)
    got = quants.dequantize(raw, t)
    block_elems, _ = quants.BLOCK_SIZES[t]
    assert got.shape == (3, k * block_elems)
    assert_bits_equal(got, oracle(raw, t))


@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_bit_exact_many_blocks(t):
    """Enough blocks that every byte value appears in every payload position."""
    rng = np.random.default_rng(t)
    raw = random_raw(t, (64, 4096 // quants.BLOCK_SIZES[t][0]), rng)
    assert_bits_equal(quants.dequantize(raw, t), oracle(raw, t))


@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_fully_random_bytes_match_including_nan_and_inf(t):
    """Random scale bytes too: NaN/Inf/subnormal scales give the same values (NaN == NaN here)."""
    rng = np.random.default_rng(77 + t)
    raw = random_raw(t, (5, 8), rng, finite=False)
    with np.errstate(all="ignore"):                                      # inf * 0 and the like, in both
        np.testing.assert_array_equal(quants.dequantize(raw, t), oracle(raw, t))


# ------------------------------------------------------------------------------- compiled kernels

COMPILED = list(dequant_compiled.TYPES)
needs_numba = pytest.mark.skipif(not jit.compiled(), reason="compiled kernels are switched off")


def numpy_twin(raw, t):
    """The NumPy kernel of `quants` (the oracle of the compiled ones) on raw rows."""
    block_elems, block_bytes = quants.BLOCK_SIZES[t]
    n = raw.size // block_bytes
    out = np.empty((n, block_elems), np.float32)
    quants._KERNELS[t](np, np.ascontiguousarray(raw).reshape(n, block_bytes), out)
    return out.reshape(*raw.shape[:-1], -1)


@needs_numba
@pytest.mark.parametrize("finite", [True, False])
@pytest.mark.parametrize("t", COMPILED, ids=[quants.TYPE_NAMES[t] for t in COMPILED])
def test_compiled_kernels_bit_exact_with_numpy_twins(t, finite):
    """Every byte value in every position (and NaN/Inf/subnormal scales when not finite)."""
    rng = np.random.default_rng(300 + t)
    raw = random_raw(t, (64, 4096 // quants.BLOCK_SIZES[t][0]), rng, finite=finite)
    block_elems, block_bytes = quants.BLOCK_SIZES[t]
    got = np.empty((raw.size // block_bytes, block_elems), np.float32)
    with np.errstate(all="ignore"):
        dequant_compiled.dequantize_blocks(t, raw.reshape(-1, block_bytes), got)
        np.testing.assert_array_equal(got.reshape(64, -1).view(np.uint32),
                                      numpy_twin(raw, t).view(np.uint32))


@needs_numba
def test_compiled_kernels_split_over_threads_match_one_call(monkeypatch):
    """Many blocks go to the engine's threads in row ranges: the same bits as one call."""
    monkeypatch.setenv("WORKBENCH_THREADS", "2")
    rng = np.random.default_rng(9)
    raw = random_raw(quants.Q4_K, (8, 4 * dequant_compiled.MIN_BLOCKS_PER_PIECE), rng)
    assert_bits_equal(quants.dequantize(raw, quants.Q4_K), numpy_twin(raw, quants.Q4_K))


def test_numpy_switch_runs_the_numpy_kernels(monkeypatch):
    monkeypatch.setenv(jit.ENV_VAR, "numpy")
    assert not dequant_compiled.available(quants.Q4_K)
    rng = np.random.default_rng(10)
    raw = random_raw(quants.Q6_K, (2, 3), rng)
    assert_bits_equal(quants.dequantize(raw, quants.Q6_K), oracle(raw, quants.Q6_K))


QUANTIZABLE = [quants.F32, quants.F16, quants.BF16, quants.Q4_0, quants.Q4_1, quants.Q5_0,
               quants.Q5_1, quants.Q8_0]                                 # gguf has no K-quant quantizer


@pytest.mark.parametrize("t", QUANTIZABLE, ids=[quants.TYPE_NAMES[t] for t in QUANTIZABLE])
def test_weights_quantized_by_gguf(t):
    """Bytes made by gguf's quantizer, not only random bytes."""
    x = np.random.default_rng(5).standard_normal((4, 512)).astype(np.float32)
    raw = gguf.quants.quantize(x, GGMLQuantizationType(t))
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(4, -1)
    assert_bits_equal(quants.dequantize(raw, t), oracle(raw, t))


@pytest.mark.slow
def test_real_gemma3_q4_k_m_tensors(gemma3_270m):
    """Every supported tensor type of a real llama-quantize output (Q4_K, Q6_K, Q5_0, Q8_0, F32)."""
    from app.engine.io.gguf import read_gguf

    f = read_gguf(gemma3_270m)                                           # memory-mapped; closed by GC
    seen = set()
    for name, info in f.tensors.items():
        if not (name.startswith("blk.0.") or name == "token_embd.weight"):
            continue
        if not quants.is_supported(info.ggml_type):
            continue
        raw = np.asarray(f.raw(name))
        raw = raw.reshape(-1, raw.shape[-1])[:4096]                      # token_embd: first 4096 rows
        assert_bits_equal(quants.dequantize(raw, info.ggml_type), oracle(raw, info.ggml_type))
        seen.add(quants.TYPE_NAMES[info.ggml_type])
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= seen, seen


# ------------------------------------------------------------------------------- API behaviour

@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_out_is_filled_and_returned(t):
    rng = np.random.default_rng(3)
    raw = random_raw(t, (3, 4), rng)
    out = np.full((3, 4 * quants.BLOCK_SIZES[t][0]), np.nan, dtype=np.float32)
    assert quants.dequantize(raw, t, out=out) is out
    assert_bits_equal(out, oracle(raw, t))


@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_out_not_contiguous(t):
    rng = np.random.default_rng(4)
    raw = random_raw(t, (3, 2), rng)
    cols = 2 * quants.BLOCK_SIZES[t][0]
    big = np.zeros((3, cols + 5), dtype=np.float32)
    out = big[:, 5:]                                                     # (3, cols), strided rows
    assert quants.dequantize(raw, t, out=out) is out
    assert_bits_equal(out, oracle(raw, t))
    assert not big[:, :5].any()


@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_batched_3d_input(t):
    """(E, rows, bytes): expert weights dequantized in one call."""
    rng = np.random.default_rng(5)
    raw = random_raw(t, (4, 3, 2), rng)                                  # (E, rows, bytes)
    got = quants.dequantize(raw, t)
    assert got.shape == (4, 3, 2 * quants.BLOCK_SIZES[t][0])
    assert_bits_equal(got, oracle(raw.reshape(12, -1), t).reshape(got.shape))
    out = np.empty_like(got)
    assert quants.dequantize(raw, t, out=out) is out
    assert_bits_equal(out, got)


@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_strided_input_and_1d_row(t):
    rng = np.random.default_rng(6)
    raw = random_raw(t, (6, 3), rng)
    every_other = raw[::2]                                               # (3, bytes), not contiguous
    assert_bits_equal(quants.dequantize(every_other, t), oracle(every_other, t))
    assert_bits_equal(quants.dequantize(raw[1], t), oracle(raw[1:2], t)[0])


def test_empty_input():
    raw = np.zeros((0, 2 * 144), dtype=np.uint8)
    assert quants.dequantize(raw, quants.Q4_K).shape == (0, 512)
    assert quants.dequantize(np.zeros((2, 0), np.uint8), quants.Q8_0).shape == (2, 0)


def test_accepts_gguf_enum():
    raw = random_raw(quants.Q8_0, (2, 2), np.random.default_rng(7))
    assert_bits_equal(quants.dequantize(raw, GGMLQuantizationType.Q8_0), oracle(raw, quants.Q8_0))
    assert quants.is_supported(GGMLQuantizationType.Q6_K)


def test_result_does_not_alias_raw():
    raw = random_raw(quants.F32, (2, 3), np.random.default_rng(8))
    got = quants.dequantize(raw, quants.F32)
    got[:] = 0
    assert raw.any()


@pytest.mark.parametrize("t", [gguf.GGMLQuantizationType.IQ2_XXS, gguf.GGMLQuantizationType.TQ1_0,
                               gguf.GGMLQuantizationType.Q8_K, gguf.GGMLQuantizationType.I32, 99])
def test_unsupported_type_raises_value_error(t):
    assert not quants.is_supported(t)
    with pytest.raises(ValueError, match="not supported"):
        quants.dequantize(np.zeros((2, 256), np.uint8), t)
    with pytest.raises(ValueError):
        quants.row_bytes(t, 256)


@pytest.mark.parametrize("t", [quants.Q4_0, quants.Q6_K, quants.F16], ids=["Q4_0", "Q6_K", "F16"])
def test_bad_row_length_raises_value_error(t):
    _, block_bytes = quants.BLOCK_SIZES[t]
    with pytest.raises(ValueError, match="multiple"):
        quants.dequantize(np.zeros((2, 3 * block_bytes + 1), np.uint8), t)


def test_bad_raw_or_out_raises_value_error():
    raw = np.zeros((2, 34), np.uint8)
    with pytest.raises(ValueError):
        quants.dequantize(raw.view(np.int8), quants.Q8_0)                # not uint8
    with pytest.raises(ValueError):
        quants.dequantize(np.uint8(3), quants.Q8_0)                      # 0-d
    with pytest.raises(ValueError):
        quants.dequantize(raw, quants.Q8_0, out=np.empty((2, 33), np.float32))
    with pytest.raises(ValueError):
        quants.dequantize(raw, quants.Q8_0, out=np.empty((2, 32), np.float64))


def test_tables_match_gguf():
    for t in TYPES:
        qt = GGMLQuantizationType(t)
        assert quants.BLOCK_SIZES[t] == tuple(gguf.GGML_QUANT_SIZES[qt])
        assert quants.TYPE_NAMES[t] == qt.name
        assert quants.is_supported(t)
    assert set(quants.TYPE_NAMES) == set(quants.BLOCK_SIZES)


def test_row_bytes():
    assert quants.row_bytes(quants.Q4_K, 4096) == 16 * 144
    assert quants.row_bytes(quants.Q8_0, 64) == 68
    assert quants.row_bytes(quants.F32, 3) == 12
    assert quants.row_bytes(quants.BF16, 5) == 10
    with pytest.raises(ValueError):
        quants.row_bytes(quants.Q4_K, 4000)


def test_imports_only_numpy_and_backend():
    tree = ast.parse(inspect.getsource(quants))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    assert imported <= {"__future__", "numpy", "app.engine.runtime.backend",
                        "app.engine.kernels"}, imported            # the compiled twins


# ------------------------------------------------------------------------------- CuPy

def _cupy():
    try:
        import cupy
    except Exception:                                                     # ImportError, or a broken CUDA runtime
        return None
    return cupy


cupy = _cupy()


@pytest.mark.skipif(cupy is None, reason="cupy is not installed")
@pytest.mark.parametrize("t", TYPES, ids=IDS)
def test_cupy_bit_exact_with_gguf(t):
    from app.engine.runtime.backend import gpu_available

    if not gpu_available():
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(2000 + t)
    raw = random_raw(t, (4, 3, 5), rng)                                  # (E, rows, bytes)
    expect = oracle(raw.reshape(12, -1), t).reshape(4, 3, -1)
    got = quants.dequantize(cupy.asarray(raw), t)
    assert isinstance(got, cupy.ndarray)
    assert_bits_equal(cupy.asnumpy(got), expect)
    out = cupy.empty(expect.shape, dtype=cupy.float32)
    assert quants.dequantize(cupy.asarray(raw), t, out=out) is out
    assert_bits_equal(cupy.asnumpy(out), expect)
