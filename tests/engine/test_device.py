"""The device (GPU) code paths, run on the CPU through a CuPy stand-in (tests/fake_cupy.py).

These machines have no GPU. The stand-in's arrays refuse to mix with host arrays, as CuPy's do,
and count every device-to-host read, so these tests show that a training step on "cuda" keeps
everything on the device, reads back only what it must, and computes what the CPU computes.
"""

from __future__ import annotations

import numpy as np
import pytest

from app.engine import load_model
from app.engine.config import TrainConfig
from app.engine.errors import ConfigError
from app.engine.lora import load_adapter, save_adapter
from app.engine.train import Batch, TrainSession
from tests import fake_cupy
from tests.conftest import GOLDEN


def _steps(device: str, model_name: str, mode: str, n_steps: int = 3, **train):
    model = load_model(GOLDEN / model_name, device=device)
    config = TrainConfig(mode=mode, lora_rank=4, lora_alpha=8, lr=1e-2, max_steps=10,
                         lora_targets=("attention", "experts", "ffn", "router"), gclip=0.5,
                         device=device, **train)
    session = TrainSession(model, config)
    tokens = np.random.default_rng(2).integers(0, model.config.n_vocab, 80)
    labels = np.roll(tokens, -1)
    labels[:5] = -1
    batch = Batch(tokens, labels)
    metrics = [session.step([batch]) for _ in range(n_steps)]
    return session, metrics


@pytest.mark.parametrize("model_name, mode, train", [
    ("mixtral-q4_0.gguf", "lora", {}),
    ("qwen2moe-q8_0.gguf", "lora", {"checkpoint_interval": 1}),
    ("gemma3-f32.gguf", "full", {}),
    ("llama-f32.gguf", "hybrid", {"full_targets": ("norms",)}),
])
def test_training_on_the_device_matches_the_cpu(monkeypatch, model_name, mode, train):
    cpu_session, cpu_metrics = _steps("cpu", model_name, mode, **train)
    fake_cupy.install(monkeypatch)
    gpu_session, gpu_metrics = _steps("cuda", model_name, mode, **train)
    for a in gpu_session.trainable.values():
        assert isinstance(a, fake_cupy.DeviceArray)
    assert [m.loss for m in gpu_metrics] == [m.loss for m in cpu_metrics]
    # the norm's sum of squares: float64 on the device, float32 BLAS dots per chunk on the CPU
    assert [m.grad_norm for m in gpu_metrics] == pytest.approx([m.grad_norm for m in cpu_metrics],
                                                               rel=1e-7)
    for name, a in cpu_session.trainable.items():
        np.testing.assert_array_equal(fake_cupy.asnumpy(gpu_session.trainable[name]), a)
    for layer, counts in gpu_metrics[-1].routing.items():
        assert type(counts) is np.ndarray
        np.testing.assert_array_equal(counts, cpu_metrics[-1].routing[layer])


def test_a_device_step_reads_back_only_a_few_numbers_per_moe_layer(monkeypatch):
    fake_cupy.install(monkeypatch)
    session, _ = _steps("cuda", "mixtral-q8_0.gguf", "lora", n_steps=1)
    tokens = np.arange(64) % session.model.config.n_vocab
    fake_cupy.transfers.update(to_host=0)
    session.step([Batch(tokens, np.roll(tokens, -1))])
    n_moe = session.model.config.n_layer
    # per MoE layer its expert offsets; per step six scalars: the label range check, loss,
    # correct tokens, unweighted loss sum, the gradient norm and the clipped-element count
    assert fake_cupy.transfers["to_host"] == n_moe + 6


def test_checkpoint_state_and_adapters_come_back_to_the_host(monkeypatch, tmp_path):
    fake_cupy.install(monkeypatch)
    session, _ = _steps("cuda", "mixtral-q4_0.gguf", "lora", n_steps=1)
    state = session.state_dict()
    assert all(type(a) is np.ndarray for a in state["trainable"].values())
    save_adapter(session.adapter, tmp_path / "a.gguf")
    adapter = load_adapter(tmp_path / "a.gguf")
    for name, (a, b) in adapter.tensors.items():
        np.testing.assert_array_equal(a, fake_cupy.asnumpy(session.adapter.tensors[name][0]))
    before = {n: fake_cupy.asnumpy(a) for n, a in session.trainable.items()}
    session.step([Batch(np.arange(16), np.arange(1, 17))])
    session.load_state_dict(state)
    for name, a in session.trainable.items():
        np.testing.assert_array_equal(fake_cupy.asnumpy(a), before[name])


def test_generation_on_the_device_matches_the_cpu(monkeypatch):
    prompt = [1, 5, 9, 13]
    cpu = list(load_model(GOLDEN / "mixtral-f32.gguf").generate(prompt, 6))
    fake_cupy.install(monkeypatch)
    gpu = list(load_model(GOLDEN / "mixtral-f32.gguf", device="cuda").generate(prompt, 6))
    assert gpu == cpu


def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="No CUDA GPU") as info:
        load_model(GOLDEN / "llama-f32.gguf", device="cuda")
    assert "--device cpu" in info.value.hint
