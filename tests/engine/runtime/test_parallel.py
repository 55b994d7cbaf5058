"""The engine's threads change nothing but speed.

Where 1 and N threads make the same BLAS calls (the same blocks, on single-threaded BLAS), the
results are bit-identical, and that is asserted. Where the split of a product follows the thread
count (matmul's column blocks, the one-pass head's row blocks), the calls differ, OpenBLAS's
per-CPU kernels may round them differently, and each thread count is held to the float32 error
bound of the operation against float64 (tests/float32_bounds.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from app.engine import load_model
from app.engine.runtime import parallel
from app.engine.training.config import TrainConfig
from app.engine.kernels.loss import head_row_blocks
from app.engine.data.batches import Batch
from app.engine.training.session import TrainSession
from tests.conftest import GOLDEN
from tests.float32_bounds import U, abs64, as64, assert_within_gamma, gamma

TOKENS = 512


def _train_two_steps(monkeypatch, threads: int, model_name: str, mode: str):
    monkeypatch.setenv("WORKBENCH_THREADS", str(threads))
    model = load_model(GOLDEN / model_name)
    config = TrainConfig(mode=mode, lora_rank=4, lora_alpha=8, max_steps=10, lr=1e-2,
                         lora_targets=("attention", "experts", "ffn"))
    session = TrainSession(model, config)
    tokens = np.random.default_rng(1).integers(0, model.config.n_vocab, TOKENS)
    batch = Batch(tokens, np.roll(tokens, -1))
    losses = [session.step([batch]).loss for _ in range(2)]
    return losses, {k: v.copy() for k, v in session.trainable.items()}


@pytest.mark.parametrize("model_name, mode", [("mixtral-q8_0.gguf", "lora"),
                                              ("qwen2moe-f32.gguf", "full"),
                                              ("llama-f32.gguf", "full")])
def test_training_with_threads_is_bit_identical_to_one_thread(monkeypatch, model_name, mode):
    """Same calls on 1 and 2 threads: these models' products are below matmul's split size,
    element-wise work and each expert's GEMMs are the same per row whatever the row blocks, and
    at 512 tokens the frozen head's row blocks (its GEMMs) are the same for 1 and 2 threads."""
    blocks = []
    for threads in ("1", "2"):
        monkeypatch.setenv("WORKBENCH_THREADS", threads)
        blocks.append(head_row_blocks(np, TOKENS))
    assert blocks[0] == blocks[1]
    assert TOKENS * 32 * 259 < parallel.MIN_SPLIT_WORK          # T x n_embd x n_vocab
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
def test_matmul_splits_big_products_within_the_float32_bound(monkeypatch, shape):
    """Column blocks on the threads make other BLAS calls than one numpy matmul: both are held
    to gamma_K |a| |b| of the float64 product; the blocks run on threads give exactly what the
    same blocks give one after another."""
    monkeypatch.setenv("WORKBENCH_THREADS", "2")
    m, k, n = shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((n, k), dtype=np.float32).T        # a transposed weight, as x @ W.T
    exact, magnitude = as64(a)[0] @ as64(b)[0], abs64(a)[0] @ abs64(b)[0]
    threaded = parallel.matmul(a, b)
    assert_within_gamma(threaded, exact, magnitude, k, "threads")
    assert_within_gamma(a @ b, exact, magnitude, k, "numpy")
    monkeypatch.setattr(parallel, "parallel_map", lambda fn, items, xp=np: [fn(i) for i in items])
    np.testing.assert_array_equal(parallel.matmul(a, b), threaded)


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
    """Same calls: its GEMMs (100 x 64 x 1024) are below matmul's split size, and the row
    blocks only split element-wise work."""
    assert 100 * 64 * 1024 < parallel.MIN_SPLIT_WORK
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


def _frozen_head_float64(h, w, labels, softcap, chunk):
    """The one-pass head's float64 results and the float32 error bound of its loss and dh.

    Logits z = h w^T: |dz_tv| <= e_tv = gamma_C (|h| |w|^T)_tv, E_t = max_v e_tv; the softcap
    is 1-Lipschitz. The online softmax p_tv then has |dp_tv| <= p_tv (2 E_t + 8u) (exp, the
    rescales, the division), the slope s_v = 1 - (z_v / cap)^2 moves by <= 2 E_t / cap + u,
    and dh_t = coef_t (sum_v p_tv s_v w_v - s_label w_label) adds the sum's own rounding,
    gamma over chunk + 2 chunks + 8 terms. The loss sum adds gamma_N over its N terms."""
    h64, w64 = as64(h, w)
    n_chunks = -(-len(w) // chunk)
    z = h64 @ w64.T                                                      # (T, V)
    e_max = (gamma(h.shape[1]) * (np.abs(h64) @ np.abs(w64).T)).max(1)   # (T,)
    slope = np.ones_like(z)
    if softcap:
        z = softcap * np.tanh(z / softcap)
        slope = 1 - (z / softcap) ** 2
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)                                         # (T, V)
    rows, active = np.arange(len(h)), labels >= 0
    coef = active / active.sum()                                         # (T,)
    lab = np.where(active, labels, 0)
    onehot = np.zeros_like(p)
    onehot[rows, lab] = active
    dh = coef[:, None] * ((p * slope - onehot * slope) @ w64)            # (T, C)
    dq = p * (slope * (2 * e_max[:, None] + 8 * U)
              + ((2 * e_max[:, None] / softcap + U) if softcap else 0))  # (T, V)
    dh_bound = coef[:, None] * (dq @ np.abs(w64)
                                + gamma(chunk + 2 * n_chunks + 8) * ((p * slope) @ np.abs(w64))
                                + 2 * U * np.abs(slope[rows, lab][:, None] * w64[lab]))
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)  # (T,)
    nll = (lse - z[rows, lab])[active]
    loss_bound = ((2 * e_max + (n_chunks + 8) * U * (np.abs(lse) + np.abs(z[rows, lab])))[active]
                  .sum() + gamma(len(nll)) * np.abs(nll).sum()) / len(nll)
    top2 = np.sort(z, 1)[:, -2:]                                         # (T, 2)
    assert np.all(top2[active, 1] - top2[active, 0] > 4 * e_max[active]), "argmax tie"
    correct = int((z.argmax(1) == labels)[active].sum())
    return nll.mean(), loss_bound, correct, dh, dh_bound


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_one_pass_frozen_head_on_threads_within_the_float32_bound(monkeypatch, softcap):
    """1, 2 and 3 threads split the rows into other GEMMs: each is held to the float32 bound
    of its loss and dh against float64; the token accuracy is exact, since no row's top two
    logits are within the logits' error of each other (asserted)."""
    from app.engine.kernels.loss import cross_entropy_frozen_head

    rng = np.random.default_rng(5)
    t, c, v = 300, 64, 3000
    h = rng.standard_normal((t, c), dtype=np.float32)
    w = rng.standard_normal((v, c), dtype=np.float32) * 0.3
    labels = rng.integers(0, v, t)
    labels[::7] = -1
    loss64, loss_bound, correct, dh64, dh_bound = _frozen_head_float64(h, w, labels, softcap,
                                                                       1024)
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("WORKBENCH_THREADS", threads)
        loss, stats, dh = cross_entropy_frozen_head(h, w, labels, None, softcap, chunk=1024)
        assert abs(loss - loss64) <= loss_bound, threads
        assert stats["n_tokens"] == (labels >= 0).sum() and stats["n_correct"] == correct
        assert np.all(np.abs(dh - dh64) <= dh_bound), threads


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


def test_a_split_linear_layer_with_bias_lora_and_dropout_within_the_float32_bound(monkeypatch):
    """1 and 2 threads split the GEMMs into other calls. A linear layer and its backward are
    sums of products, so every output is within gamma_n M of float64, M the same layer run on
    absolute values, n <= T + in + out + R roundings on any path."""
    from app.engine.kernels.linear import linear_backward, linear_forward

    rng = np.random.default_rng(4)
    t, n_in, n_out, r = 256, 512, 1536, 8                     # big enough to be split
    x = rng.standard_normal((t, n_in), dtype=np.float32)
    w = rng.standard_normal((n_out, n_in), dtype=np.float32)
    bias = rng.standard_normal(n_out, dtype=np.float32)
    a = rng.standard_normal((r, n_in), dtype=np.float32)
    b = rng.standard_normal((n_out, r), dtype=np.float32)
    mask = (rng.random((t, n_in)) > 0.1).astype(np.float32) / np.float32(0.9)
    dout = rng.standard_normal((t, n_out), dtype=np.float32)

    def layer(x, w, bias, a, b, mask, dout):
        y, cache = linear_forward(x, w, bias, (a, b, 0.7), mask)
        dx, dw, dbias, (da, db) = linear_backward(dout, cache, need_dw=True)
        return y, dx, dw, dbias, da, db

    inputs = (x, w, bias, a, b, mask, dout)
    exact, magnitude = layer(*as64(*inputs)), layer(*abs64(*inputs))
    for threads in ("1", "2"):
        monkeypatch.setenv("WORKBENCH_THREADS", threads)
        for name, got, e, m in zip(("y", "dx", "dw", "dbias", "da", "db"), layer(*inputs),
                                   exact, magnitude):
            assert_within_gamma(got, e, m, t + n_in + n_out + r, f"{name}, {threads} threads")


def test_a_group_of_linear_layers_gives_what_each_layer_gives_alone(monkeypatch):
    """q, k and v (or gate and up) run as one parallel section of (layer, row block) pieces:
    the same BLAS calls as each layer alone, so the same bits; the group's dx is the layers'
    input gradients summed in their order."""
    from app.engine.kernels.linear import (Linear, linear_backward, linear_backward_group,
                                           linear_forward, linear_forward_group)

    monkeypatch.setenv("WORKBENCH_THREADS", "2")
    rng = np.random.default_rng(5)
    t, n_in, r = 256, 512, 8
    x = rng.standard_normal((t, n_in), dtype=np.float32)
    layers = []
    for n_out, with_lora, with_bias in ((512, True, False), (256, False, True), (256, True, True)):
        w = rng.standard_normal((n_out, n_in), dtype=np.float32)
        bias = rng.standard_normal(n_out, dtype=np.float32) if with_bias else None
        lora = (rng.standard_normal((r, n_in), dtype=np.float32),
                rng.standard_normal((n_out, r), dtype=np.float32), 0.5) if with_lora else None
        layers.append(Linear(w, bias, lora))
    douts = [rng.standard_normal((t, layer.w.shape[0]), dtype=np.float32) for layer in layers]
    alone = [linear_forward(x, *layer) for layer in layers]
    grouped = linear_forward_group(x, layers)
    for (y1, c1), (y2, c2) in zip(alone, grouped):
        np.testing.assert_array_equal(y1, y2)
        if c1.xa is not None:
            np.testing.assert_array_equal(c1.xa, c2.xa)
    need_dws = [True, False, False]
    each = [linear_backward(d, c, need) for d, (_, c), need in zip(douts, alone, need_dws)]
    dx, grads = linear_backward_group(douts, [c for _, c in grouped], need_dws)
    np.testing.assert_array_equal(dx, each[0][0] + each[1][0] + each[2][0])
    for (_, *want), got in zip(each, grads):
        for w_part, g_part in zip(want, got):
            if w_part is None:
                assert g_part is None
            elif isinstance(w_part, tuple):
                for wa, ga in zip(w_part, g_part):
                    np.testing.assert_array_equal(wa, ga)
            else:
                np.testing.assert_array_equal(w_part, g_part)


def _one_thread_process(code: str) -> list[str]:
    """What `code` prints, run in a fresh process with WORKBENCH_THREADS=1 and OpenBLAS started
    on 2 threads."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "WORKBENCH_THREADS": "1", "OPENBLAS_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.split()


def test_one_engine_thread_runs_blas_on_one_thread_too():
    """WORKBENCH_THREADS=1 means one core: BLAS goes to one thread the first time the engine
    computes, as it does with the engine's pool (a fresh process: the limit is for good)."""
    assert _one_thread_process(
        "import numpy as np; from threadpoolctl import threadpool_info; "
        "from app.engine.runtime import parallel; "
        "before = max(i['num_threads'] for i in threadpool_info() if i['user_api'] == 'blas'); "
        "parallel.matmul(np.ones((4, 4), np.float32), np.ones((4, 4), np.float32)); "
        "after = [i['num_threads'] for i in threadpool_info() if i['user_api'] == 'blas']; "
        "print(before, max(after))") == ["2", "1"]


def test_one_engine_thread_trains_a_quantized_moe_model_on_one_thread():
    """Every path of a step (the weight store's dequantization, the experts, the compiled
    kernels, the optimizer) keeps to one thread with WORKBENCH_THREADS=1: after a step BLAS
    is at one thread and the engine's pool was never started (a fresh process)."""
    assert _one_thread_process(
        "import numpy as np; from threadpoolctl import threadpool_info; "
        "from app.engine import load_model; from app.engine.runtime import parallel; "
        "from app.engine.training.config import TrainConfig; "
        "from app.engine.training.session import TrainSession; "
        "from app.engine.data.batches import Batch; "
        f"model = load_model({str(GOLDEN / 'mixtral-q8_0.gguf')!r}); "
        "config = TrainConfig(lora_rank=4, lora_alpha=8, max_steps=2, "
        "lora_targets=('attention', 'experts')); "
        "tokens = np.arange(64) % model.config.n_vocab; "
        "TrainSession(model, config).step([Batch(tokens, np.roll(tokens, -1))]); "
        "blas = [i['num_threads'] for i in threadpool_info() if i['user_api'] == 'blas']; "
        "print(max(blas), parallel._pool is None)") == ["1", "True"]


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc's mallopt")
def test_the_engine_process_reuses_freed_arrays_without_page_faults():
    """After the engine's first computation, a freed 16 MiB array is reused from the heap: the
    next one of its size costs no page faults (0 measured; with glibc's defaults it is
    unmapped on free and faults in again when the next one is written: 508 faults on the
    development VM, NumPy's huge-page advice included)."""
    out = _one_thread_process(
        "import resource, numpy as np; from app.engine.runtime import parallel; "
        "parallel.matmul(np.ones((4, 4), np.float32), np.ones((4, 4), np.float32)); "
        "a = np.ones(1 << 22, np.float32); del a; "
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; "
        "b = np.ones(1 << 22, np.float32); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)")
    assert int(out[0]) < 100
