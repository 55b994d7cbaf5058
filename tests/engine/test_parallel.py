"""The engine's threads change nothing but speed: results are bit-identical to one thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from app.engine import load_model, parallel
from app.engine.config import TrainConfig
from app.engine.train import Batch, TrainSession
from tests.conftest import GOLDEN


def _train_two_steps(monkeypatch, threads: int, model_name: str, mode: str):
    monkeypatch.setenv("WORKBENCH_THREADS", str(threads))
    model = load_model(GOLDEN / model_name)
    config = TrainConfig(mode=mode, lora_rank=4, lora_alpha=8, max_steps=10, lr=1e-2,
                         lora_targets=("attention", "experts", "ffn"))
    session = TrainSession(model, config)
    tokens = np.random.default_rng(1).integers(0, model.config.n_vocab, 96)
    batch = Batch(tokens, np.roll(tokens, -1))
    losses = [session.step([batch]).loss for _ in range(2)]
    return losses, {k: v.copy() for k, v in session.trainable.items()}


@pytest.mark.parametrize("model_name, mode", [("mixtral-q8_0.gguf", "lora"),
                                              ("qwen2moe-f32.gguf", "full"),
                                              ("llama-f32.gguf", "full")])
def test_training_with_threads_is_bit_identical_to_one_thread(monkeypatch, model_name, mode):
    losses_1, params_1 = _train_two_steps(monkeypatch, 1, model_name, mode)
    losses_2, params_2 = _train_two_steps(monkeypatch, 2, model_name, mode)
    assert losses_1 == losses_2
    assert params_1.keys() == params_2.keys()
    for name in params_1:
        np.testing.assert_array_equal(params_1[name], params_2[name], err_msg=name)


def test_parallel_map_shares_items_between_caller_and_pool_and_keeps_order(monkeypatch):
    monkeypatch.setenv("WORKBENCH_THREADS", "2")
    seen = set()
    barrier = threading.Barrier(2, timeout=10)

    def work(i):
        seen.add(threading.current_thread().name)
        if i < 2:
            barrier.wait()          # the first two items run at the same time, on two threads
        # a nested map runs serially inside a piece (no deadlock)
        return sum(parallel.parallel_map(lambda j: i * j, range(3)))
    assert parallel.parallel_map(work, range(8)) == [3 * i for i in range(8)]
    caller = threading.current_thread().name
    assert caller in seen and any(n.startswith("workbench-engine") for n in seen - {caller})


@pytest.mark.parametrize("shape", [(256, 512, 1536), (7, 3, 5), (300, 1024, 130)])
def test_matmul_splits_big_products_and_matches_numpy_bit_for_bit(monkeypatch, shape):
    monkeypatch.setenv("WORKBENCH_THREADS", "2")
    m, k, n = shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((n, k), dtype=np.float32).T        # a transposed weight, as x @ W.T
    np.testing.assert_array_equal(parallel.matmul(a, b), a @ b)


def test_one_thread_and_exceptions(monkeypatch):
    monkeypatch.setenv("WORKBENCH_THREADS", "1")
    assert parallel.parallel_map(lambda i: threading.current_thread().name, [0, 1]) == \
        [threading.current_thread().name] * 2
    monkeypatch.setenv("WORKBENCH_THREADS", "2")

    def fail(i):
        if i == 3:
            raise ValueError("piece 3")
        return i
    with pytest.raises(ValueError, match="piece 3"):
        parallel.parallel_map(fail, range(6))


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_chunked_cross_entropy_is_bit_identical_on_threads(monkeypatch, softcap):
    from app.engine.kernels.loss import cross_entropy_backward, cross_entropy_forward

    rng = np.random.default_rng(3)
    t, c, v, r = 100, 64, 3000, 4
    h = rng.standard_normal((t, c), dtype=np.float32)
    w = rng.standard_normal((v, c), dtype=np.float32) * 0.3
    lora = (rng.standard_normal((r, c), dtype=np.float32), rng.standard_normal((v, r),
            dtype=np.float32), 0.5)
    labels = rng.integers(0, v, t)
    labels[::7] = -1
    results = []
    for threads in ("1", "2"):
        monkeypatch.setenv("WORKBENCH_THREADS", threads)
        loss, stats, cache = cross_entropy_forward(h, w, labels, None, lora, softcap, chunk=1024)
        results.append((loss, stats, *cross_entropy_backward(cache, need_dw=True)))
    (loss1, stats1, dh1, dw1, dl1), (loss2, stats2, dh2, dw2, dl2) = results
    assert loss1 == loss2 and stats1 == stats2
    for a, b in ((dh1, dh2), (dw1, dw2), *zip(dl1, dl2)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_one_pass_frozen_head_is_bit_identical_on_threads(monkeypatch, softcap):
    from app.engine.kernels.loss import cross_entropy_frozen_head

    rng = np.random.default_rng(5)
    t, c, v = 300, 64, 3000
    h = rng.standard_normal((t, c), dtype=np.float32)
    w = rng.standard_normal((v, c), dtype=np.float32) * 0.3
    labels = rng.integers(0, v, t)
    labels[::7] = -1
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("WORKBENCH_THREADS", threads)
        results.append(cross_entropy_frozen_head(h, w, labels, None, softcap, chunk=1024))
    for loss, stats, dh in results[1:]:
        assert loss == results[0][0] and stats == results[0][1]
        np.testing.assert_array_equal(dh, results[0][2])


def test_attention_split_by_query_rows_is_bit_identical_on_threads(monkeypatch):
    from app.engine.kernels.attention import (attention_backward, attention_forward,
                                              attention_mask, attention_pieces)

    rng = np.random.default_rng(6)
    t, n_head, d = 300, 4, 32
    q = rng.standard_normal((t, n_head, d), dtype=np.float32)
    k, v, dout = (rng.standard_normal((t, 1, d), dtype=np.float32) for _ in range(3))
    mask = attention_mask(np, np.arange(t), np.arange(t)).astype(np.float32)
    pieces, blocks = attention_pieces(np, 1, mask)
    assert blocks == 4 and pieces[0][3] == slice(0, 75)         # 4 row blocks, causal keys
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("WORKBENCH_THREADS", threads)
        out, cache = attention_forward(q, k, v, 0.2, mask)
        results.append((out, *attention_backward(dout.repeat(n_head, 1), cache)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_a_split_linear_layer_with_bias_lora_and_dropout_is_bit_identical(monkeypatch):
    from app.engine.kernels.linear import linear_backward, linear_forward

    rng = np.random.default_rng(4)
    t, n_in, n_out, r = 256, 512, 1536, 8                     # big enough to be split
    x = rng.standard_normal((t, n_in), dtype=np.float32)
    w = rng.standard_normal((n_out, n_in), dtype=np.float32)
    bias = rng.standard_normal(n_out, dtype=np.float32)
    lora = (rng.standard_normal((r, n_in), dtype=np.float32),
            rng.standard_normal((n_out, r), dtype=np.float32), 0.7)
    mask = (rng.random((t, n_in)) > 0.1).astype(np.float32) / np.float32(0.9)
    dout = rng.standard_normal((t, n_out), dtype=np.float32)
    results = []
    for threads in ("1", "2"):
        monkeypatch.setenv("WORKBENCH_THREADS", threads)
        y, cache = linear_forward(x, w, bias, lora, mask)
        dx, dw, dbias, (da, db) = linear_backward(dout, cache, need_dw=True)
        results.append((y, dx, dw, dbias, da, db))
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)
