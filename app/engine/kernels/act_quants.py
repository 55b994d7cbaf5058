"""llama.cpp's rounding of activations before a matmul with a quantized (or F16) weight.

ggml's CPU backend does not multiply a quantized weight by float32 activations: it first
converts each activation row to the weight type's ``vec_dot_type`` (``type_traits_cpu`` in
ggml-cpu.c) and takes integer block dot products. The kernels here return the activations
after that round trip, quantized and dequantized again (x' = d * q), so that a float32 matmul
of x' with the dequantized weight gives llama.cpp's result up to float32 summation order:

- Q4_0, Q5_0, Q8_0 -> Q8_0 and Q4_1, Q5_1 -> Q8_1: ``quantize_row_q8_0`` / ``quantize_row_q8_1``
  as the x86 AVX path computes it (ggml-cpu/arch/x86/quants.c): per block of 32,
  amax = max |x|, q = round_half_even(x * (127 / amax)), d = fp16(amax / 127). Q8_1 also
  stores s = fp16(d * sum q) for the weight's min term; its fp16 rounding is not emulated.
- Q2_K..Q6_K -> Q8_K: ``quantize_row_q8_K_ref`` (ggml-quants.c; x86 calls the reference):
  per block of 256, max = the first x of largest |x|, iscale = -127 / max,
  q = min(127, round_half_even(iscale * x)), d = 1 / iscale in float32 (0 for a zero block).
- F16 -> F16: ``GGML_CPU_FP32_TO_FP16``, round to nearest even.

Rows must be whole blocks, which they are for these weight types (their rows are).
Only the inference forward uses this (app.engine.model.params.Params.base_input): training computes
in plain float32.

Sequence length. Each token's row is rounded on its own, as ggml converts each src1 row
(``ggml_compute_forward_mul_mat`` in ggml-cpu.c: ``from_float`` once per row i11), so the
rounding adds no dependence of a prefix on the later tokens. The float32 products before it do:
OpenBLAS sums in an order that depends on the number of rows (measured: the first rows of x[:m]
@ W^T change in the last bits with m, for most m from 1 to 150), and attention's products have
one key per token. The roundings are steps, so a last-bit change can move an activation a whole
Q8 step, and the steps compound over the layers. On Gemma 3 270M Q4_K_M (BOS + 11 random ids, 5
draws) the first 6 positions' logits move by 0.7-4.3 at most between a 6- and a 12-token forward
(max |logit| 22-190; next-token log-probs by 0.12-0.62), against 0.007-0.14 with
llamacpp_numerics off; nudging every embedding by one float32 ulp at a fixed length moves them
as much (0.3-8.8 on, 0-0.1 off, two draws); no one rounding dominates (each weight group's
alone: 0.05-1.3, the head's least). So two float32 summation orders land this far apart on such
a model, and ours cannot be expected to match llama.cpp's per-token logits closer than that at
any length (what holds there are averages: perplexity, README's "How exact is it"). llama.cpp
keeps a row's arithmetic fixed across batch sizes (integer block dot products per row and
output; the KQ mask padded to 256 keys, ``llama_kv_cache::get_n_kv`` in src/llama-kv-cache.cpp),
except on repacked Q4_0/Q4_K/IQ4_NL weights, where ``forward_mul_mat_one_chunk`` in
ggml-cpu/repack.cpp runs the first ne11 - ne11 % 4 rows through gemm and the rest through gemv
("If there are more than three rows in src1, use gemm; otherwise, use gemv"). Making ours
batch-invariant would steady a prefix but bring it no closer to llama.cpp; it takes fixed shapes
in attention too: with every linear product run as zero-padded 16-row GEMMs, 6- and 12-token
prefixes agreed bit for bit but 12 and 16 still differed by 0.6-5.8 (left unpadded: attention's
products, over 12 against 16 keys). The golden models are too small to amplify: there a 5- or
13-token forward matches llama.cpp's rows of its 24-token batch to the same 1e-5
(tests/engine/model/test_golden.py).
"""

from __future__ import annotations

import numpy as np

from app.engine.runtime.backend import get_array_module
from app.engine.kernels.quants import F16, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0


def _q8_0(xp, x):
    """quantize_row_q8_0 (AVX) then dequantize: (..., n*32) -> same shape."""
    blocks = x.reshape(-1, 32)                                          # (n, 32)
    amax = xp.abs(blocks).max(1, keepdims=True)                         # (n, 1)
    nonzero = amax != 0
    inv = xp.where(nonzero, np.float32(127) / xp.where(nonzero, amax, 1), 0).astype(x.dtype)
    q = xp.rint(blocks * inv)                                           # (n, 32) ties to even
    d = (amax / np.float32(127)).astype(xp.float16).astype(x.dtype)     # (n, 1) fp16 scale
    return (d * q).reshape(x.shape)


def _q8_k(xp, x):
    """quantize_row_q8_K_ref then dequantize: (..., n*256) -> same shape."""
    blocks = x.reshape(-1, 256)                                         # (n, 256)
    first = xp.abs(blocks).argmax(1)[:, None]                           # (n, 1) first largest |x|
    top = xp.take_along_axis(blocks, first, 1)                          # (n, 1) signed
    nonzero = top != 0
    iscale = xp.where(nonzero, np.float32(-127) / xp.where(nonzero, top, 1), 0).astype(x.dtype)
    q = xp.minimum(xp.rint(iscale * blocks), 127)                       # (n, 256)
    d = xp.where(nonzero, np.float32(1) / xp.where(nonzero, iscale, 1), 0).astype(x.dtype)
    return (d * q).reshape(x.shape)


def _f16(xp, x):
    """fp32 -> fp16 (round to nearest even) -> fp32."""
    return x.astype(xp.float16).astype(x.dtype)


# weight type -> the round trip of its vec_dot_type
_ROUND_TRIPS = {Q4_0: _q8_0, Q5_0: _q8_0, Q8_0: _q8_0, Q4_1: _q8_0, Q5_1: _q8_0,
                Q2_K: _q8_k, Q3_K: _q8_k, Q4_K: _q8_k, Q5_K: _q8_k, Q6_K: _q8_k, F16: _f16}


def quantize_activations(x, weight_type: int):
    """x (..., in) float32 as llama.cpp's CPU backend feeds it to a weight stored as
    `weight_type` (a GGML type id): a new array of x's shape, or x itself for F32 (read as
    float32 by ggml too) and for the types not emulated (BF16 rounds x to bf16 in ggml)."""
    round_trip = _ROUND_TRIPS.get(int(weight_type))
    return x if round_trip is None else round_trip(get_array_module(x), x)
