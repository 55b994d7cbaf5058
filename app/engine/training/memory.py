"""The memory a training run needs (LoRA or full fine-tuning) for given settings, by part.

`estimate_memory(card, trainable, ...)`: `card` is `describe_model(path, rank, tokens)` (its
`memory`, an app.engine.model.card.MemoryEstimate, holds the weights, the dequantized weights,
the activations per layer and the adapter bytes of all LoRA targets); `trainable` the parameters
of the chosen targets. Full fine-tuning (`full`) counts 16 bytes for every unquantized parameter
instead of the adapter (its float32 copy, gradient and two AdamW moments), and 2 more under bf16
(the bf16 copy of each trained matrix its pass's products read, app.engine.model.params).
`checkpoint` is the gradient-checkpointing interval (0: off) and `weight_cache_mb` the
dequantized-weight cache (None: what a run gets by default, `cache_budget_for`: 40% of the
memory of `device`, less where the run would otherwise pass RUN_MEMORY_SHARE of that memory).
On device "cuda" the estimate carries the GPU's free and total memory too (None where no GPU is
usable). `precision` is the run's --precision (auto|fp32|bf16), resolved as the trainer
resolves it (`run_precision`): under bf16 the cache holds the frozen weights packed in bf16,
half the float32 bytes, and where the products go through the library (oneDNN) the runtime
counts its libraries (BF16_LIBRARY_BYTES).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.errors import OutOfMemoryError
from app.engine.model.card import (BF16_LIBRARY_BYTES, RUNTIME_BYTES, ModelCard, describe_model,
                                   human_bytes)
from app.engine.model.lora import LoraConfig
from app.engine.model.weights import default_cache_budget
from app.engine.runtime.bf16 import FP32, Precision, choose
from app.engine.runtime.backend import array_module, device_memory, gpu_available
from app.engine.training.config import TrainConfig

# By default a run keeps its whole estimate within this share of the device's memory (16 GB of
# a 24 GB machine): the weight cache gets what is left of it, at most the engine's default. The
# rest stays for the desktop, the window and what the user runs beside it (a llama.cpp server).
# Measured on the OLMoE-1B-7B shapes (docs/PERFORMANCE.md), the cache saves little once the
# dequantization is compiled: the step without it was within the machine's noise.
RUN_MEMORY_SHARE = 2 / 3


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of a run by part; `total` is their sum."""

    total: int
    weights: int                     # base weights as stored (memory-mapped)
    dequantized: int                 # copies of quantized weights alive (float32, or bf16)
    trained: int                     # adapter (or full copies) + gradients + optimizer
    trainable: int                   # the parameters trained
    activations: int                 # kept activations and backward's buffers
    runtime: int                     # the engine's process before a model (+ the bf16 library)
    gpu: tuple[int, int] | None      # (free, total) of the GPU, on device "cuda"
    precision: str = "fp32"          # what the base's products compute in: "fp32" or "bf16"


def estimate_memory(card: ModelCard, trainable: int | None, full: bool = False,
                    device: str = "cpu", checkpoint: int = 0,
                    weight_cache_mb: int | None = None,
                    precision: str = "auto") -> TrainingMemory:
    """See the module docstring."""
    m = card.memory
    xp, on_gpu = _compute_module(device)
    chosen = run_precision(precision, device)
    library = BF16_LIBRARY_BYTES if chosen.backend == "onednn" else 0
    trainable, state = _trained(card, trainable, full)
    if full and chosen.bf16:        # each pass's bf16 copies of the trained matrices (params.py)
        state += card.full_params * 2
    if weight_cache_mb is not None:
        budget = weight_cache_mb << 20
    else:
        budget = cache_budget_for(m.total_for(state, checkpoint, 0, chosen.name) + library, xp)
    return TrainingMemory(
        total=m.total_for(state, checkpoint, budget, chosen.name) + library, weights=m.weights,
        dequantized=m.dequantized_in_use(budget, chosen.name), trained=state,
        trainable=trainable, activations=m.activations(checkpoint),
        runtime=RUNTIME_BYTES + library,
        gpu=device_memory(array_module("cuda")) if on_gpu else None, precision=chosen.name)


def run_precision(requested: str, device: str = "cpu") -> Precision:
    """The precision a run asking for `requested` on `device` computes its base's products in,
    as TrainSession chooses it (app.engine.runtime.bf16.choose_precision): bf16 (the library's
    or the emulation) or float32. A GPU's cache is float32 whatever it computes in (its TF32
    rounds inside cuBLAS): FP32 here. On the
    CPU the library is not loaded here (a second, for every estimate): a broken install, which
    the run would find and fall back from to float32, is taken at its word (the estimate is
    then short by half the cache; the run's log says why it fell back)."""
    if _compute_module(device)[1]:
        return FP32
    return choose(requested)


def _compute_module(device: str):
    """(the array module a run on `device` computes with, whether that is a GPU): the CPU where
    no GPU is usable."""
    on_gpu = device == "cuda" and gpu_available()
    return array_module("cuda" if on_gpu else "cpu"), on_gpu


def _trained(card: ModelCard, trainable: int | None, full: bool) -> tuple[int, int]:
    """(parameters trained, their bytes with gradients and AdamW moments)."""
    if full:
        return card.full_params, card.full_params * 16   # float32 copy, gradient, two moments
    trainable = trainable or 0
    per_param = card.memory.adapter / card.lora_params if card.lora_params else 16
    return trainable, int(trainable * per_param)


def cache_budget_for(rest: int, xp) -> int:
    """The default weight cache of a run whose estimate without a cache is `rest` bytes: the
    engine's default (40% of the device's memory), cut so that the whole run stays within
    RUN_MEMORY_SHARE of that memory; 0 when the rest alone is over it."""
    try:
        total = device_memory(xp)[1]
    except (ValueError, OSError, AttributeError):
        return default_cache_budget(xp)
    return int(max(0, min(default_cache_budget(xp), RUN_MEMORY_SHARE * total - rest)))


def run_cache_budget(model_path: str, train: TrainConfig, context: int) -> int:
    """The weight cache of a training run: `train.weight_cache_mb` when set, else
    `cache_budget_for` the run's estimate without a cache (its model, rank, expert rank,
    targets, mode, context, checkpointing and device)."""
    if train.cache_budget is not None:
        return train.cache_budget
    kinds = tuple(LoraConfig(targets=tuple(train.lora_targets)).kinds())
    card = describe_model(model_path, train.lora_rank, context, train.expert_rank, kinds)
    rest = estimate_memory(card, card.lora_params, train.mode == "full", train.device,
                           train.checkpoint_interval, weight_cache_mb=0,
                           precision=train.precision).total
    return cache_budget_for(rest, _compute_module(train.device)[0])


def check_run_memory(model_path: str, train: TrainConfig, context: int, sequences: int = 0,
                     sequence_tokens: int = 0) -> None:
    """OutOfMemoryError naming the size when a run cannot fit the memory of its device, before
    anything is allocated: its estimate with the least weight cache (the cache is optional),
    plus the KV cache of `sequences` sampled at once for at least `sequence_tokens` tokens each
    (GRPO's group of a step, its generated tokens alone: a lower bound, so a run that fits is
    never refused). A LoRA rank of 4096 on a large model, or a GRPO step of 1,024 x 1,024
    completions, fails here with the figure instead of allocating until the OOM killer comes."""
    kinds = tuple(LoraConfig(targets=tuple(train.lora_targets)).kinds())
    card = describe_model(model_path, train.lora_rank, context, train.expert_rank, kinds)
    run = estimate_memory(card, card.lora_params, train.mode == "full", train.device,
                          train.checkpoint_interval, weight_cache_mb=0,
                          precision=train.precision)
    c = card.config
    kv = sequences * sequence_tokens * c.n_layer * 2 * c.n_head_kv * c.head_dim * 4
    xp, on_gpu = _compute_module(train.device)
    try:
        total = device_memory(xp)[1]
    except (ValueError, OSError, AttributeError):   # no figure for this device: nothing to say
        return
    need = run.total + kv
    if need > total:
        where = "the GPU has" if on_gpu else "this machine has"
        sampled = f" (sampling {sequences:,} completions at once: {human_bytes(kv)})" if kv else ""
        raise OutOfMemoryError(
            f"This run needs at least {human_bytes(need)} of memory{sampled}, and {where} "
            f"{human_bytes(total)}.",
            "Lower the LoRA rank (--rank, --expert-rank), the context, or for GRPO the group "
            "size and prompts per step; gradient checkpointing (--checkpoint-interval 1) "
            "saves activations.")
