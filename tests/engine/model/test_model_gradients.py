"""Whole-model float64 gradient checks on every golden architecture.

LoRA mode trains every target the golden adapters have (attention, dense FFN, experts, shared
experts, router); full mode trains every tensor; hybrid trains LoRA and some full tensors at
once. A directional finite difference of the loss must match the analytic gradient to 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest

from app.engine import load_adapter, load_model
from app.engine.kernels.gradcheck import directional_check
from app.engine.model.lora import LoraConfig, init_adapter
from tests.conftest import GOLDEN, GOLDEN_MODELS

REL_TOL = 1e-5


def _batch(name):
    tokens = np.load(GOLDEN / f"{name}.npz")["tokens"].astype(np.int64)   # (24,)
    rng = np.random.default_rng(1)
    labels = np.roll(tokens, -1)
    labels[[3, 10, -1]] = -1                                              # masked positions
    weights = rng.uniform(-0.5, 2.0, tokens.size)                         # reward weights
    return tokens, labels, weights


def _check(model, make_params, names, arrays, tokens, labels, weights, **kw):
    """Worst relative error of a directional check per tensor (arrays[i] is named names[i]).

    One direction per tensor, so a small tensor's wrong gradient cannot hide in the total."""
    def loss_at(values):
        return model.loss_and_grads(make_params(dict(zip(names, values))), tokens, labels,
                                    weights, **kw)[0]

    _, _, grads = model.loss_and_grads(make_params(dict(zip(names, arrays))), tokens, labels,
                                       weights, **kw)
    missing = [n for n in names if n not in grads]
    assert not missing, f"no gradient for {missing}"
    errors = {}
    for i, n in enumerate(names):
        only_i = [grads[n] if j == i else None for j in range(len(names))]
        errors[n] = directional_check(loss_at, arrays, only_i, seed=i)
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def _lora_params(model, adapter):
    def make(values):
        ad = type(adapter)(adapter.alpha, {}, adapter.arch)
        for base in adapter.tensors:
            ad.tensors[base] = (values[base + ".lora_a"], values[base + ".lora_b"])
        return model.params(ad, dtype=np.float64, training=True)
    names, arrays = [], []
    for base, (a, b) in adapter.tensors.items():
        names += [base + ".lora_a", base + ".lora_b"]
        arrays += [a.astype(np.float64), b.astype(np.float64)]
    return make, names, arrays


@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_lora_gradients(name):
    model = load_model(GOLDEN / f"{name}-f32.gguf")
    adapter = load_adapter(GOLDEN / f"{name}-lora.gguf")
    make, names, arrays = _lora_params(model, adapter)
    assert any("exps" in n for n in names) or not model.config.is_moe
    err, worst = _check(model, make, names, arrays, *_batch(name))
    assert err < REL_TOL, worst


@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_full_gradients(name):
    model = load_model(GOLDEN / f"{name}-f32.gguf")
    names = list(model.gguf.tensors)
    arrays = [np.array(model.gguf.array(n), dtype=np.float64) for n in names]
    make = lambda values: model.params(full=values, dtype=np.float64, training=True)
    err, worst = _check(model, make, names, arrays, *_batch(name))
    assert err < REL_TOL, worst


@pytest.mark.parametrize("name", ["qwen2moe", "gemma3"])
def test_hybrid_lora_and_full_gradients(name):
    """LoRA on the adapter's targets while norms (and the router, where there is one) train fully."""
    model = load_model(GOLDEN / f"{name}-f32.gguf")
    adapter = load_adapter(GOLDEN / f"{name}-lora.gguf")
    make_lora, lora_names, lora_arrays = _lora_params(model, adapter)
    full_names = [n for n in model.gguf.tensors if "norm" in n or "gate_inp" in n]
    full_names = [n for n in full_names if n not in adapter.tensors]
    full_arrays = [np.array(model.gguf.array(n), dtype=np.float64) for n in full_names]

    def make(values):
        params = make_lora(values)
        params.full = {n: values[n] for n in full_names}
        return params
    err, worst = _check(model, make, lora_names + full_names, lora_arrays + full_arrays,
                        *_batch(name))
    assert err < REL_TOL, worst


@pytest.mark.parametrize("name", ["mixtral", "gemma3", "deepseek"])
@pytest.mark.parametrize("interval", [1, 2])
def test_checkpointing_gives_the_same_gradients(name, interval):
    model = load_model(GOLDEN / f"{name}-f32.gguf")
    adapter = load_adapter(GOLDEN / f"{name}-lora.gguf")
    params = model.params(adapter, training=True)
    batch = _batch(name)
    loss0, _, g0 = model.loss_and_grads(params, *batch)
    loss1, _, g1 = model.loss_and_grads(params, *batch, checkpoint_interval=interval)
    assert loss0 == loss1 and g0.keys() == g1.keys()
    for key in g0:
        np.testing.assert_array_equal(g0[key], g1[key], err_msg=key)


def test_gradient_check_has_teeth():
    """A 1% error in one gradient tensor must fail the check."""
    model = load_model(GOLDEN / "mixtral-f32.gguf")
    adapter = load_adapter(GOLDEN / "mixtral-lora.gguf")
    make, names, arrays = _lora_params(model, adapter)
    tokens, labels, weights = _batch("mixtral")
    _, _, grads = model.loss_and_grads(make(dict(zip(names, arrays))), tokens, labels, weights)
    wrong = [grads[n] * (1.01 if "ffn_down_exps" in n else 1.0) for n in names]
    loss_at = lambda values: model.loss_and_grads(make(dict(zip(names, values))), tokens, labels,
                                                  weights)[0]
    assert directional_check(loss_at, arrays, wrong) > 1e-4


def test_train_loss_equals_inference_cross_entropy():
    """The training forward (float32, SwiGLU model) gives the loss of the inference logits."""
    model = load_model(GOLDEN / "qwen3moe-f32.gguf")
    tokens, labels, _ = _batch("qwen3moe")
    logits = model.logits(tokens).astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    mask = labels >= 0
    expect = (lse[mask] - logits[mask, labels[mask]]).mean()
    loss, stats, _ = model.loss_and_grads(model.params(training=True), tokens, labels)
    assert loss == pytest.approx(expect, rel=1e-5)
    assert stats["n_tokens"] == mask.sum()
    assert stats["n_correct"] == (logits[mask].argmax(1) == labels[mask]).sum()


@pytest.mark.parametrize("name", ["qwen2", "llama"])                  # tied / untied output head
def test_embedding_and_output_head_lora_gradients(name):
    model = load_model(GOLDEN / f"{name}-f32.gguf")
    targets = ("embeddings", "output") if not model.config.tied_output else ("embeddings",)
    adapter = init_adapter(model.tensor_shapes, model.config.arch,
                           LoraConfig(rank=3, targets=targets))
    rng = np.random.default_rng(5)
    for base, (a, b) in list(adapter.tensors.items()):
        adapter.tensors[base] = (rng.standard_normal(a.shape), rng.standard_normal(b.shape) * 0.1)
    make, names, arrays = _lora_params(model, adapter)
    err, worst = _check(model, make, names, arrays, *_batch(name))
    assert err < REL_TOL, worst
