"""The memory a training run needs (LoRA or full fine-tuning) for given settings, by part.

`estimate_memory(card, trainable, ...)`: `card` is `describe_model(path, rank, tokens)` (its
`memory`, an app.engine.model.card.MemoryEstimate, holds the weights, the dequantized weights,
the activations per layer and the adapter bytes of all LoRA targets); `trainable` the parameters
of the chosen targets. Full fine-tuning (`full`) counts 16 bytes for every unquantized parameter
instead of the adapter (its float32 copy, gradient and two AdamW moments). `checkpoint` is the
gradient-checkpointing interval (0: off) and `weight_cache_mb` the dequantized-weight cache
(None: the engine's default, 40% of the memory of `device`). On device "cuda" the estimate
carries the GPU's free and total memory too (None where no GPU is usable).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.model.card import RUNTIME_BYTES, ModelCard
from app.engine.model.weights import default_cache_budget
from app.engine.runtime.backend import array_module, device_memory, gpu_available


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of a run by part; `total` is their sum."""

    total: int
    weights: int                     # base weights as stored (memory-mapped)
    dequantized: int                 # float32 copies of quantized weights alive
    trained: int                     # adapter (or full copies) + gradients + optimizer
    trainable: int                   # the parameters trained
    activations: int                 # kept activations and backward's buffers
    runtime: int                     # the engine's process before a model
    gpu: tuple[int, int] | None      # (free, total) of the GPU, on device "cuda"


def estimate_memory(card: ModelCard, trainable: int | None, full: bool = False,
                    device: str = "cpu", checkpoint: int = 0,
                    weight_cache_mb: int | None = None) -> TrainingMemory:
    """See the module docstring."""
    m = card.memory
    on_gpu = device == "cuda" and gpu_available()
    if weight_cache_mb is not None:
        budget = weight_cache_mb << 20
    else:
        budget = default_cache_budget(array_module("cuda" if on_gpu else "cpu"))
    if full:
        trainable = card.full_params
        state = trainable * 16              # float32 copy, gradient and two AdamW moments
    else:
        trainable = trainable or 0
        per_param = m.adapter / card.lora_params if card.lora_params else 16
        state = int(trainable * per_param)
    return TrainingMemory(
        total=m.total_for(state, checkpoint, budget), weights=m.weights,
        dequantized=m.dequantized_in_use(budget), trained=state, trainable=trainable,
        activations=m.activations(checkpoint), runtime=RUNTIME_BYTES,
        gpu=device_memory(array_module("cuda")) if on_gpu else None)
