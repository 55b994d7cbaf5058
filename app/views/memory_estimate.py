"""The memory a run needs (LoRA or full fine-tuning), estimated from the model card for the
current settings.

`estimate_memory(card, trainable, tokens, ...)`: `card` is `describe_model(path, rank, tokens)`
(its `memory` holds the weights, the dequantized weights, the activations of `tokens` tokens
per layer and the adapter bytes of all LoRA targets: app.engine.model.card.MemoryEstimate);
`trainable` the parameters of the chosen targets. Full fine-tuning (`full`) counts 16 bytes for
every unquantized parameter instead of the adapter (its float32 copy, gradient and two AdamW
moments). `checkpoint` is the gradient-checkpointing interval (0: off) and `weight_cache_mb` the
dequantized-weight cache (None: the engine's default, 40% of the memory). Returns (bytes, the
sentence the New run screen shows). On device "cuda" the sentence ends with the GPU's memory,
total and free.
"""

from __future__ import annotations

from app.engine.runtime.backend import array_module, device_memory, gpu_available
from app.engine.model.card import RUNTIME_BYTES, ModelCard, human_bytes, human_count
from app.engine.model.weights import default_cache_budget


def estimate_memory(card: ModelCard, trainable: int | None, tokens: str,
                    full: bool = False, device: str = "cpu", checkpoint: int = 0,
                    weight_cache_mb: int | None = None) -> tuple[int | None, str]:
    """See the module docstring; `tokens` says what the activations are for ("context
    256")."""
    m = card.memory
    where = _gpu_memory() if device == "cuda" else ""
    if weight_cache_mb is not None:
        budget = weight_cache_mb << 20
    else:
        on_gpu = device == "cuda" and gpu_available()
        budget = default_cache_budget(array_module("cuda" if on_gpu else "cpu"))
    if full:
        state = card.full_params * 16       # float32 copy, gradient and two AdamW moments
        trained = (f"trained copies + gradients + optimizer {human_bytes(state)} "
                   f"({human_count(card.full_params)} trainable)")
    else:
        per_param = m.adapter / card.lora_params if card.lora_params else 16
        state = int((trainable or 0) * per_param)
        trained = (f"adapter + optimizer {human_bytes(state)} "
                   f"({human_count(trainable or 0)} trainable)")
    total = m.total_for(state, checkpoint, budget)
    dequantized = m.dequantized_in_use(budget)
    cached = f", dequantized weights {human_bytes(dequantized)}" if dequantized else ""
    saving = f"checkpoint every {checkpoint} layers" if checkpoint else "no checkpointing"
    return total, (f"Estimated memory: {human_bytes(total)} \u2014 weights "
                   f"{human_bytes(m.weights)} (memory-mapped){cached}, {trained}, activations "
                   f"{human_bytes(m.activations(checkpoint))} ({tokens}, {saving}), runtime "
                   f"{human_bytes(RUNTIME_BYTES)}{where}")


def _gpu_memory() -> str:
    """ " - GPU: 24 GB, 20 GB free" for the estimate's sentence, or a note that there is none."""
    if not gpu_available():
        return " — no usable CUDA GPU here"
    free, total = device_memory(array_module("cuda"))
    return f" — GPU memory {human_bytes(total)}, {human_bytes(free)} free"
