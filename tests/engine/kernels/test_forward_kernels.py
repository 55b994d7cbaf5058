"""Forward kernels against independent float64 oracles written the slow, obvious way."""

from __future__ import annotations

import numpy as np
import pytest

from app.engine.kernels.activations import gelu_ggml, gelu_tanh, glu_forward
from app.engine.kernels.attention import attention_forward, attention_mask
from app.engine.kernels.moe import combine, dispatch_order, experts_forward, router_forward
from app.engine.kernels.norm import rmsnorm_forward
from app.engine.kernels.rope import NEOX, NORM, rope_angles, rope_forward

rng = np.random.default_rng(0)


def test_rmsnorm():
    x, w = rng.standard_normal((5, 16)), rng.standard_normal(16)
    out, _ = rmsnorm_forward(x, w, 1e-5)
    expect = np.array([row / np.sqrt(np.mean(row ** 2) + 1e-5) * w for row in x])
    np.testing.assert_allclose(out, expect, rtol=1e-12)


def _rope_oracle(x, pos, base, n_rot, mode):
    """Rotate each pair of each head explicitly."""
    out = x.copy()
    for t in range(x.shape[0]):
        for i in range(n_rot // 2):
            theta = pos[t] * base ** (-2 * i / n_rot)
            a, b = (2 * i, 2 * i + 1) if mode == NORM else (i, i + n_rot // 2)
            x0, x1 = x[t, :, a], x[t, :, b]
            out[t, :, a] = x0 * np.cos(theta) - x1 * np.sin(theta)
            out[t, :, b] = x0 * np.sin(theta) + x1 * np.cos(theta)
    return out


@pytest.mark.parametrize("mode", [NORM, NEOX])
@pytest.mark.parametrize("n_rot", [8, 4])  # n_rot < head dim: the tail passes through
def test_rope_matches_pairwise_rotation(mode, n_rot):
    x, pos = rng.standard_normal((6, 3, 8)), np.arange(10, 16)
    cos, sin = rope_angles(np, pos, n_rot, 10000.0, 1.0, np.float64)
    out, _ = rope_forward(x, cos, sin, n_rot, mode)
    np.testing.assert_allclose(out, _rope_oracle(x, pos, 10000.0, n_rot, mode), atol=1e-12)


def test_rope_freq_scale_is_position_scaling():
    x, pos = rng.standard_normal((4, 2, 8)), np.arange(4)
    cos, sin = rope_angles(np, pos, 8, 500.0, 0.25, np.float64)
    cos2, sin2 = rope_angles(np, pos * 0.25, 8, 500.0, 1.0, np.float64)
    np.testing.assert_allclose(rope_forward(x, cos, sin, 8, NEOX)[0],
                               rope_forward(x, cos2, sin2, 8, NEOX)[0], atol=1e-12)


@pytest.mark.parametrize("window", [0, 3])
def test_attention_matches_loop_with_gqa_and_window(window):
    t, h, hkv, d = 7, 4, 2, 5
    q, k, v = (rng.standard_normal((t, n, d)) for n in (h, hkv, hkv))
    pos = np.arange(t)
    out, _ = attention_forward(q, k, v, 0.3, attention_mask(np, pos, pos, window))
    expect = np.zeros_like(out)
    for i in range(t):
        for head in range(h):
            kv = head // (h // hkv)
            keys = [j for j in range(i + 1) if not window or i - j < window]
            s = np.array([q[i, head] @ k[j, kv] * 0.3 for j in keys])
            p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            expect[i, head] = sum(pj * v[j, kv] for pj, j in zip(p, keys))
    np.testing.assert_allclose(out, expect, atol=1e-12)


def test_gelu_ggml_is_the_fp16_table():
    x = np.concatenate([rng.standard_normal(1000) * 4, [-10.5, -10.0, 10.0, 12.0, 0.0]])
    x = x.astype(np.float32)
    y = gelu_ggml(x)
    x16 = x.astype(np.float16).astype(np.float32)
    table = gelu_tanh(x16).astype(np.float16).astype(np.float32)
    expect = np.where(x <= -10, 0, np.where(x >= 10, x, table))
    np.testing.assert_array_equal(y, expect)
    assert np.abs(y - gelu_tanh(x)).max() < 1e-2  # one fp16 step away from the exact GELU


@pytest.mark.parametrize("renorm,scale", [(True, 1.0), (False, 1.0), (False, 1.5)])
def test_moe_matches_per_token_loop(renorm, scale):
    t, c, f, e, k = 9, 6, 5, 4, 2
    x = rng.standard_normal((t, c))
    w_gate, w_up = rng.standard_normal((e, f, c)), rng.standard_normal((e, f, c))
    w_down = rng.standard_normal((e, c, f))
    lora = (rng.standard_normal((e, 2, c)), rng.standard_normal((e, f, 2)), 0.7)
    logits = rng.standard_normal((t, e))
    selected, weights, _ = router_forward(logits, k, renorm, scale)
    order, offsets, token_of = dispatch_order(selected, e)
    ys = experts_forward(x, order, offsets, token_of, w_gate, w_up, w_down, "silu",
                         (lora, None, None))
    out = combine(ys, order, weights)

    expect = np.zeros((t, c))
    for i in range(t):
        p = np.exp(logits[i]) / np.exp(logits[i]).sum()
        top = np.argsort(-p)[:k]
        wts = p[top] / (p[top].sum() if renorm else 1.0) * scale
        for ex, wt in zip(top, wts):
            g = w_gate[ex] @ x[i] + 0.7 * lora[1][ex] @ (lora[0][ex] @ x[i])
            hid = glu_forward("silu", g, w_up[ex] @ x[i])[0]
            expect[i] += wt * (w_down[ex] @ hid)
    np.testing.assert_allclose(out, expect, atol=1e-10)
    assert list(offsets) == [0, *np.cumsum(np.bincount(selected.ravel(), minlength=e))]
