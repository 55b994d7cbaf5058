"""llama.cpp's activation rounding (app.engine.kernels.act_quants) against a per-block
transcription of ggml's C code, and on crafted ties, zero blocks and signs."""

from __future__ import annotations

import numpy as np
import pytest

from app.engine.kernels import quants
from app.engine.kernels.act_quants import quantize_activations

f32 = np.float32


def _ref_q8_0(row):
    """quantize_row_q8_0, x86 AVX path, then dequantize: one block at a time."""
    out = []
    for x in row.reshape(-1, 32):
        amax = max(abs(v) for v in x)
        d = np.float16(f32(amax) / f32(127))
        inv = f32(127) / f32(amax) if amax != 0 else f32(0)
        out += [f32(d) * f32(np.rint(f32(v * inv))) for v in x]        # _mm256_round_ps: ties to even
    return np.array(out, np.float32)


def _ref_q8_k(row):
    """quantize_row_q8_K_ref then dequantize_row_q8_K: one block at a time."""
    out = []
    for x in row.reshape(-1, 256):
        top = amax = f32(0)
        for v in x:
            if abs(v) > amax:
                amax, top = abs(v), v
        if amax == 0:
            out += [f32(0)] * 256
            continue
        iscale = f32(-127) / top
        q = [min(127, int(np.rint(f32(iscale * v)))) for v in x]        # nearest_int: ties to even
        d = f32(1) / iscale
        out += [f32(d * f32(v)) for v in q]
    return np.array(out, np.float32)


@pytest.mark.parametrize("wtype", [quants.Q4_0, quants.Q4_1, quants.Q5_0, quants.Q5_1, quants.Q8_0])
def test_q8_0_family_matches_ggml(wtype):
    x = (np.random.default_rng(0).standard_normal((5, 96)) * 3).astype(np.float32)   # (T, in)
    x[1, 32:64] = 0.0                                                     # a zero block
    got = quantize_activations(x, wtype)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got, np.stack([_ref_q8_0(r) for r in x]))


def test_q8_0_ties_round_to_even_and_the_scale_is_fp16():
    # amax 127 -> 127/amax = 1 exactly: x*1 = 2.5 -> 2, 3.5 -> 4, -2.5 -> -2, 0.5 -> 0
    x = np.zeros((1, 32), np.float32)
    x[0, :5] = [127.0, 2.5, 3.5, -2.5, 0.5]
    np.testing.assert_array_equal(quantize_activations(x, quants.Q8_0)[0, :5], [127, 2, 4, -2, 0])
    # the scale is amax/127 rounded to fp16: 1/127 is not an fp16 value
    y = np.full((1, 32), 1.0, np.float32)
    want = np.float32(np.float16(np.float32(1) / np.float32(127))) * 127
    np.testing.assert_array_equal(quantize_activations(y, quants.Q8_0), np.full((1, 32), want))
    assert want != 1.0


def test_q8_k_matches_ggml_and_takes_the_sign_of_the_first_largest():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    x[1, :256] = 0.0                                                      # amax 0: zeros
    x[2, 10], x[2, 20] = -9.0, 9.0                                        # |max| tie: first wins
    got = quantize_activations(x, quants.Q4_K)
    np.testing.assert_array_equal(got, np.stack([_ref_q8_k(r) for r in x]))
    assert got[2, 10] == pytest.approx(-9.0) and got[2, 20] == pytest.approx(9.0)
    for t in (quants.Q2_K, quants.Q3_K, quants.Q5_K, quants.Q6_K):
        np.testing.assert_array_equal(quantize_activations(x, t), got)


def test_f16_rounds_and_f32_bf16_pass_through():
    x = np.array([[1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 2049.0, 1e-3]], np.float32)
    np.testing.assert_array_equal(quantize_activations(x, quants.F16),
                                  [[1.0, 1.0 + 2.0 ** -9, 2048.0, np.float16(1e-3)]])
    for t in (quants.F32, quants.BF16):
        assert quantize_activations(x, t) is x


@pytest.mark.parametrize("wtype", [quants.Q8_0, quants.Q4_1, quants.Q4_K, quants.Q6_K, quants.F16])
def test_each_token_is_rounded_on_its_own(wtype):
    """ggml converts each src1 row on its own (mul_mat's from_float per row), so a token's
    rounded activations do not depend on the other tokens of the batch: the rounding of the
    first 5 rows of 13 equals that of the 5 rows alone, bit for bit (element-wise operations and
    an exact max per block, the same in both calls). A prefix's logits then depend on the
    later tokens only through float32 summation order (act_quants module docstring)."""
    x = np.random.default_rng(3).standard_normal((13, 512)).astype(np.float32)
    x[7] *= 1e3                              # a loud token must not change the others' scales
    np.testing.assert_array_equal(quantize_activations(x[:5], wtype),
                                  quantize_activations(x, wtype)[:5])
    np.testing.assert_array_equal(quantize_activations(x[None, :9], wtype)[0, :5],
                                  quantize_activations(x[:5], wtype))
