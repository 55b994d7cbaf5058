"""The memory a run needs (LoRA or full fine-tuning), estimated from the model card for the current settings.

`estimate_memory(card, trainable, tokens)`: `card` is `describe_model(path, rank, tokens)` (its
`memory` holds the weights, the dequantized working layer, the activations of `tokens` tokens
and the adapter bytes of all LoRA targets); `trainable` the parameters of the chosen targets.
Full fine-tuning (`full`) counts 16 bytes for every unquantized parameter instead of the adapter
(its float32 copy, gradient and two AdamW moments). Returns (bytes, the sentence the New run
screen shows). On device "cuda" the sentence ends with the GPU's memory, total and free.
"""

from __future__ import annotations

from app.engine.backend import array_module, device_memory, gpu_available
from app.engine.model_info import ModelCard, human_bytes, human_count


def estimate_memory(card: ModelCard, trainable: int | None, tokens: str,
                    full: bool = False, device: str = "cpu") -> tuple[int | None, str]:
    """See the module docstring; `tokens` says what the activations are for ("context
    256")."""
    m = card.memory
    where = _gpu_memory() if device == "cuda" else ""
    if full:
        state = card.full_params * 16       # float32 copy, gradient and two AdamW moments
        total = m.weights + state + m.activations
        return total, (f"Estimated memory: {human_bytes(total)} \u2014 weights "
                       f"{human_bytes(m.weights)} (memory-mapped), trained copies + gradients + "
                       f"optimizer {human_bytes(state)} ({human_count(card.full_params)} "
                       f"trainable), activations {human_bytes(m.activations)} ({tokens}){where}")
    per_param = m.adapter / card.lora_params if card.lora_params else 16
    adapter = int((trainable or 0) * per_param)
    total = m.weights + m.dequant_working + m.activations + adapter
    return total, (f"Estimated memory: {human_bytes(total)} \u2014 weights "
                   f"{human_bytes(m.weights)} (memory-mapped), dequantized layer "
                   f"{human_bytes(m.dequant_working)}, adapter + optimizer "
                   f"{human_bytes(adapter)} ({human_count(trainable or 0)} trainable), "
                   f"activations {human_bytes(m.activations)} ({tokens}){where}")


def _gpu_memory() -> str:
    """ " - GPU: 24 GB, 20 GB free" for the estimate's sentence, or a note that there is none."""
    if not gpu_available():
        return " — no usable CUDA GPU here"
    free, total = device_memory(array_module("cuda"))
    return f" — GPU memory {human_bytes(total)}, {human_bytes(free)} free"
