"""The device (GPU) code paths, run on the CPU through a CuPy stand-in (tests/fake_cupy.py).

These machines have no GPU. The stand-in's arrays refuse to mix with host arrays, as CuPy's do,
and count every device-to-host read, so these tests show that a training step on "cuda" keeps
everything on the device, reads back only what it must, and computes what the CPU computes.

The device path splits its work otherwise than the CPU path (one block of all rows, no column
blocks), so its float32 results may differ from the CPU's in the last bits, differently on each
CPU's BLAS kernels. Its gradients are therefore held to the float32 error the CPU path itself
shows against the same step in float64 (at most 4x that, or 16 ulps of the tensor's largest
value), not to bit-identity.
"""

from __future__ import annotations

import numpy as np
import pytest

from app.engine import load_model
from app.engine.training.config import TrainConfig
from app.engine.errors import ConfigError
from app.engine.model.lora import load_adapter, save_adapter
from app.engine.data.batches import Batch
from app.engine.training.session import TrainSession
from tests import fake_cupy
from tests.conftest import GOLDEN
from tests.float32_bounds import U


def _batch(n_vocab: int) -> Batch:
    tokens = np.random.default_rng(2).integers(0, n_vocab, 80)
    labels = np.roll(tokens, -1)
    labels[:5] = -1
    return Batch(tokens, labels)


def _session(device: str, model_name: str, mode: str, **train) -> TrainSession:
    model = load_model(GOLDEN / model_name, device=device)
    config = TrainConfig(mode=mode, lora_rank=4, lora_alpha=8, lr=1e-2, max_steps=10,
                         lora_targets=("attention", "experts", "ffn", "router"), gclip=0.5,
                         device=device, precision="fp32", **train)      # float32 on both
    return TrainSession(model, config)


def _steps(device: str, model_name: str, mode: str, n_steps: int = 3, **train):
    """The session after n_steps, their metrics, and the first step's (loss, gradients)."""
    session = _session(device, model_name, mode, **train)
    batch = _batch(session.model.config.n_vocab)
    loss, _, grads = session.loss_and_grads(batch)
    first = (loss, {name: fake_cupy.asnumpy(g) for name, g in grads.items()})
    metrics = [session.step([batch]) for _ in range(n_steps)]
    return session, metrics, first


def _float64_step(model_name: str, mode: str, **train):
    """The first step's loss and gradients in float64, from the same initial tensors."""
    session = _session("cpu", model_name, mode, **train)
    batch = _batch(session.model.config.n_vocab)
    full = {n: a.astype(np.float64) for n, a in session.full.items()}
    params = session.model.params(session.adapter, full=full, dtype=np.float64, training=True)
    loss, _, grads = session.model.loss_and_grads(params, batch.tokens, batch.labels,
                                                  checkpoint_interval=0)
    return loss, grads


def _assert_as_accurate(name, device, cpu, exact):
    """The device's float32 error is of the CPU path's size (module docstring)."""
    cpu_error = np.abs(cpu - exact).max()
    bound = 4 * cpu_error + 16 * U * np.abs(exact).max()
    assert np.abs(device - exact).max() <= bound, (name, np.abs(device - exact).max(), bound)


@pytest.mark.parametrize("model_name, mode, train", [
    ("mixtral-q4_0.gguf", "lora", {}),
    ("qwen2moe-q8_0.gguf", "lora", {"checkpoint_interval": 1}),
    ("gemma3-f32.gguf", "full", {}),
    ("llama-f32.gguf", "hybrid", {"full_targets": ("norms",)}),
])
def test_training_on_the_device_matches_the_cpu(monkeypatch, model_name, mode, train):
    loss64, grads64 = _float64_step(model_name, mode, **train)
    cpu_session, cpu_metrics, (cpu_loss, cpu_grads) = _steps("cpu", model_name, mode, **train)
    fake_cupy.install(monkeypatch)
    gpu_session, gpu_metrics, (gpu_loss, gpu_grads) = _steps("cuda", model_name, mode, **train)
    for a in gpu_session.trainable.values():
        assert isinstance(a, fake_cupy.DeviceArray)
    _assert_as_accurate("loss", np.float64(gpu_loss), np.float64(cpu_loss), np.float64(loss64))
    assert gpu_grads.keys() == cpu_grads.keys() == grads64.keys()
    for name, exact in grads64.items():
        _assert_as_accurate(name, gpu_grads[name], cpu_grads[name], exact)
    # The first step's gradient norm moves by at most the gradients' difference (triangle
    # inequality) plus the sum of squares' own rounding (float64 on the device, float32 BLAS
    # dots per chunk on the CPU).
    gap = np.sqrt(sum(((gpu_grads[n] - cpu_grads[n]).astype(np.float64) ** 2).sum()
                      for n in grads64))
    norm = cpu_metrics[0].grad_norm
    assert abs(gpu_metrics[0].grad_norm - norm) <= gap + 64 * U * norm
    # Later steps: AdamW's first updates are lr * g / |g| wherever |g| >> eps, so the two runs'
    # tensors stay as close as their gradients, except where |g| is at rounding level, and
    # such a tensor moves the loss by |g| * lr, nothing. 1e-5 is 10x the float32 noise of
    # these losses.
    assert [m.loss for m in gpu_metrics] == pytest.approx([m.loss for m in cpu_metrics],
                                                          rel=1e-5)
    # Routing follows the router's logits: at the first step the chosen and the first rejected
    # expert's logits are at least 2e-2 apart on these batches (measured), 1e5 times their
    # float32 noise, so the counts are the same.
    for layer, counts in gpu_metrics[0].routing.items():
        assert type(counts) is np.ndarray
        np.testing.assert_array_equal(counts, cpu_metrics[0].routing[layer])


def test_a_device_step_reads_back_only_a_few_numbers_per_moe_layer(monkeypatch):
    fake_cupy.install(monkeypatch)
    session, _, _ = _steps("cuda", "mixtral-q8_0.gguf", "lora", n_steps=1)
    tokens = np.arange(64) % session.model.config.n_vocab
    fake_cupy.transfers.update(to_host=0)
    session.step([Batch(tokens, np.roll(tokens, -1))])
    n_moe = session.model.config.n_layer
    # per MoE layer its expert offsets; per step six scalars: the label range check, loss,
    # correct tokens, unweighted loss sum, the gradient norm and the clipped-element count
    assert fake_cupy.transfers["to_host"] == n_moe + 6


def test_checkpoint_state_and_adapters_come_back_to_the_host(monkeypatch, tmp_path):
    fake_cupy.install(monkeypatch)
    session, _, _ = _steps("cuda", "mixtral-q4_0.gguf", "lora", n_steps=1)
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
