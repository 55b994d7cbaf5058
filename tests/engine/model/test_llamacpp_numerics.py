"""The llamacpp_numerics switch: Model.logits / Model.generate round activations like
llama.cpp; training, GRPO sampling and its log-probs compute in plain float32."""

from __future__ import annotations

import numpy as np
import pytest

from app.engine import load_adapter, load_model
from app.engine.kernels import act_quants, quants
from app.engine.model.params import Params
from tests.conftest import GOLDEN


@pytest.fixture(scope="module")
def model():
    return load_model(GOLDEN / "qwen2moe-q8_0.gguf")      # attention, experts, shared experts


def _count_roundings(monkeypatch):
    calls = []
    real = act_quants.quantize_activations

    def spy(x, weight_type):
        calls.append(weight_type)
        return real(x, weight_type)

    monkeypatch.setattr("app.engine.model.params.quantize_activations", spy)
    return calls


def test_training_computes_in_plain_float32(model, monkeypatch):
    tokens = np.load(GOLDEN / "qwen2moe.npz")["tokens"]
    adapter = load_adapter(GOLDEN / "qwen2moe-lora.gguf")
    with pytest.raises(ValueError):
        model.params(adapter, training=True, llamacpp_numerics=True)
    calls = _count_roundings(monkeypatch)
    labels = np.roll(tokens, -1)
    labels[-1] = -1
    loss, _, grads = model.loss_and_grads(model.params(adapter, training=True), tokens, labels)
    assert calls == [] and grads

    def xent(logits):   # mean cross-entropy of labels[:-1] given logits (T, V)
        z = logits[:-1].astype(np.float64)
        lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        return float(np.mean(lse - z[np.arange(len(z)), labels[:-1]]))

    # the loss of the plain-float logits, not of llama.cpp's
    plain = model.logits(tokens, adapter, llamacpp_numerics=False)
    assert float(loss) == pytest.approx(xent(plain), abs=1e-5)
    assert abs(float(loss) - xent(model.logits(tokens, adapter))) > 1e-4


def test_logits_and_generate_round_generate_batch_does_not(model, monkeypatch):
    calls = _count_roundings(monkeypatch)
    model.logits([1, 2, 3])
    assert set(calls) == {quants.F32, quants.Q8_0}        # F32: the router, unchanged
    calls.clear()
    model.logits([1, 2, 3], llamacpp_numerics=False)
    list(model.generate([1, 2, 3], 3, stop=[], llamacpp_numerics=False))
    model.generate_batch([[1, 2, 3]], 3, stop=[])                        # GRPO's sampler
    assert calls == []
    list(model.generate([1, 2, 3], 3, stop=[]))
    assert calls
    prompt = [5, 17, 99, 3]
    for flag in (True, False):   # each decodes greedily from its own numerics' logits
        seq = list(prompt)
        for token in model.generate_batch([prompt], 4, stop=[], llamacpp_numerics=flag)[0]:
            assert token == int(np.argmax(model.logits(seq, llamacpp_numerics=flag)[-1]))
            seq.append(token)


def test_grpo_samples_and_scores_in_plain_float32(model, monkeypatch):
    from app.engine.training.grpo import token_log_probs

    calls = _count_roundings(monkeypatch)
    token_log_probs(model, [1, 2, 3], [4, 5])
    assert calls == []


def test_trained_tensors_and_f32_weights_are_not_rounded(model):
    params = model.params(llamacpp_numerics=True)
    x = np.random.default_rng(0).standard_normal((2, 32)).astype(np.float32)
    assert params.base_input("blk.0.ffn_gate_inp.weight", x) is x           # F32 router
    assert params.base_input("blk.0.attn_q.weight", x) is not x             # Q8_0
    full = {"blk.0.attn_q.weight": model.weights.get("blk.0.attn_q.weight")}
    trained = Params(model.weights, full=full, llamacpp_numerics=True)
    assert trained.base_input("blk.0.attn_q.weight", x) is x
