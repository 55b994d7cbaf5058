"""The sentence the New run screen shows for a run's memory estimate.

`memory_sentence(est, tokens, full, checkpoint, device)` words an engine estimate
(`estimate_memory`, app.engine.training.memory): the total, then each part; `tokens` says what the
activations are for ("context 256"). The dequantized weights say when the cache holds them packed
in bf16 (half the float32 bytes). On device "cuda" it ends with the GPU's memory, total and
free.
"""

from __future__ import annotations

from app.engine.api import TrainingMemory, human_bytes, human_count


def memory_sentence(est: TrainingMemory, tokens: str, full: bool, checkpoint: int,
                    device: str) -> str:
    packed = " (packed bf16: --precision)" if est.precision == "bf16" else ""
    cached = (f", dequantized weights {human_bytes(est.dequantized)}{packed}"
              if est.dequantized else "")
    what = "trained copies + gradients + optimizer" if full else "adapter + optimizer"
    saving = f"checkpoint every {checkpoint} layers" if checkpoint else "no checkpointing"
    return (f"Estimated memory: {human_bytes(est.total)} \u2014 weights "
            f"{human_bytes(est.weights)} (memory-mapped){cached}, {what} "
            f"{human_bytes(est.trained)} ({human_count(est.trainable)} trainable), activations "
            f"{human_bytes(est.activations)} ({tokens}, {saving}), runtime "
            f"{human_bytes(est.runtime)}{_gpu_words(est.gpu) if device == 'cuda' else ''}")


def _gpu_words(gpu: tuple[int, int] | None) -> str:
    """ " - GPU memory 24 GB, 20 GB free", or a note that there is no usable GPU."""
    if gpu is None:
        return " \u2014 no usable CUDA GPU here"
    free, total = gpu
    return f" \u2014 GPU memory {human_bytes(total)}, {human_bytes(free)} free"
