"""TrainConfig: how a run trains (what is trainable, the optimizer, the schedule, the step
structure), checked by the run-config schema (`app.engine.runtime.schema`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import ClassVar

from app.engine.data.dataset import DataConfig
from app.engine.errors import ConfigError
from app.engine.kernels.loss import VOCAB_CHUNK
from app.engine.model.lora import TARGET_GROUPS
from app.engine.runtime.schema import (AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, TEXT, Range,
                                       check)
from app.engine.training.optimizers import SCHEDULES

TRAIN_MODES = ("lora", "full", "hybrid")
# Learning rates (bench/defaults_sweep.py, docs/USER_GUIDE.md "Why these defaults"). LoRA's best
# rate did not move with the rank (4 to 64 at one alpha) and fell with the alpha about as
# 1 / sqrt(alpha): LORA_LR at alpha LORA_LR_ALPHA, times sqrt(LORA_LR_ALPHA / alpha) at another.
# Full fine-tuning keeps the earlier default (not swept).
LORA_LR, LORA_LR_ALPHA = 5e-3, 16.0
FULL_LR = 1e-4


def default_lr(mode: str, alpha: float = LORA_LR_ALPHA) -> float:
    """The learning rate a run gets unless the user sets one: FULL_LR for full fine-tuning;
    for LoRA and hybrid runs LORA_LR * sqrt(LORA_LR_ALPHA / alpha), to two digits (5e-3 at
    alpha 16, 3.5e-3 at 32, 1.8e-3 at 128) whatever the rank."""
    if mode == "full":
        return FULL_LR
    return float(f"{LORA_LR * math.sqrt(LORA_LR_ALPHA / alpha):.2g}")
OPTIMIZERS = ("adamw", "sgd", "lbfgs")
# The largest LoRA rank a run takes. A rank past the smaller side of the matrix it adapts adds
# nothing (A is rank x in, B out x rank: their product's rank is at most min(in, out)), and
# the matrices of the models the workbench trains are narrower than this on their smaller side;
# what a rank up to it costs on a given model is checked against the machine's memory before
# anything is allocated (app.engine.training.memory.check_run_memory).
MAX_RANK = 4096
RANK = Range(1, MAX_RANK)


@dataclass(frozen=True)
class TrainConfig:
    """How to train: what is trainable, the optimizer, the schedule, the step structure.

    mode: "lora" (adapters only), "full" (every F32/F16/BF16 tensor; quantized ones stay frozen)
    or "hybrid" (adapters plus the unquantized tensors named by `full_targets`).
    full_targets: tensor kinds or groups for hybrid runs: "norms", "router", "embeddings",
    "output", or kinds such as "attn_q".
    weight_decay: decoupled, on matrices only; 1-D tensors (norms, biases) are never decayed.
    warmup_steps: linear warmup; 0: warmup_fraction of the run's steps.

    The defaults (lr, schedule, warmup, clipping) come from the sweep in bench/defaults_sweep.py
    (docs/USER_GUIDE.md, "Why these defaults"); lr is default_lr at the default alpha: the CLI
    and the window use default_lr(mode, alpha) for a run that sets none.
    """

    mode: str = "lora"
    lora_rank: int = 16
    expert_rank: int | None = None  # 3-D expert adapters (None: min(lora_rank, 8) past 32 experts)
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = ("attention", "ffn", "experts", "shared")
    rslora: bool = False
    lora_dropout: float = 0.0       # on 2-D targets' LoRA input; 3-D expert adapters have none (as PEFT)
    full_targets: tuple[str, ...] = ()
    optimizer: str = "adamw"
    lr: float = default_lr("lora", 32.0)   # lora_alpha's default: 3.5e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    gclip: float = 0.0
    max_grad_norm: float = 1.0
    schedule: str = "cosine"
    warmup_steps: int = 0
    warmup_fraction: float = 0.05
    min_lr: float = 0.0
    max_steps: int = 100
    grad_accum: int = 1
    checkpoint_interval: int = 0
    vocab_chunk: int = VOCAB_CHUNK
    seed: int = 0
    device: str = "cpu"             # "cpu" (NumPy) or "cuda" (CuPy): where the step computes
    weight_cache_mb: int | None = None  # dequantized weights kept (None: run_cache_budget)
    # The frozen base's products: "auto" (bf16 where the CPU has a bf16 unit and the bf16 extra
    # is installed, else float32), "fp32" or "bf16" (app/engine/runtime/bf16.py)
    precision: str = "auto"

    SCHEMA_RULES: ClassVar[dict] = dict(  # app.engine.runtime.schema: what the types cannot say
        mode=TRAIN_MODES, lora_rank=RANK, expert_rank=RANK, lora_alpha=POSITIVE,
        lora_targets=tuple(dict.fromkeys([*TARGET_GROUPS, *(kind for kinds in TARGET_GROUPS.values()
                                                            for kind in kinds)])),
        lora_dropout=FRACTION, full_targets=TEXT, optimizer=OPTIMIZERS, lr=POSITIVE,
        weight_decay=AT_LEAST_0, beta1=FRACTION, beta2=FRACTION, eps=POSITIVE, gclip=AT_LEAST_0,
        max_grad_norm=AT_LEAST_0, schedule=SCHEDULES, warmup_steps=AT_LEAST_0,
        warmup_fraction=FRACTION, min_lr=AT_LEAST_0,
        max_steps=AT_LEAST_1, grad_accum=AT_LEAST_1, checkpoint_interval=AT_LEAST_0,
        vocab_chunk=AT_LEAST_1, seed=AT_LEAST_0, device=("cpu", "cuda"),
        weight_cache_mb=AT_LEAST_0, precision=("auto", "fp32", "bf16"))

    @property
    def cache_budget(self) -> int | None:
        """weight_cache_mb in bytes, for load_model (None: its default)."""
        return None if self.weight_cache_mb is None else self.weight_cache_mb << 20

    def for_steps(self, total: int) -> "TrainConfig":
        """This config for a run of `total` optimizer steps: max_steps, and the warmup in steps
        (warmup_steps, else warmup_fraction of `total`)."""
        warmup = self.warmup_steps or round(self.warmup_fraction * total)
        return replace(self, max_steps=total, warmup_steps=min(warmup, total))

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """From a run's config.json section (lists become tuples); any unknown key, wrong type or
        value out of range is a ConfigError listing them all (app.engine.runtime.schema)."""
        check(d, cls)
        d = dict(d)
        for key in ("lora_targets", "full_targets"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)

    def validate(self) -> None:
        """The schema's types, ranges and allowed values (app.engine.runtime.schema), then what
        one key cannot say: a hybrid run names what it trains in full."""
        check(asdict(self), TrainConfig)
        if self.mode == "hybrid" and not self.full_targets:
            raise ConfigError("A hybrid run needs full_targets (e.g. norms, router).")


def model_context(model) -> int:
    """The context a model was trained with: `model` is a ModelCard, a loaded model or a
    ModelConfig (anything with `.config.context_length` or `.context_length`)."""
    return getattr(model, "config", model).context_length


def default_context(model) -> int:
    """A run's context unless the user sets one: DataConfig's (512), at most the model's."""
    return min(DataConfig.context, model_context(model))


def check_context(context: int, model) -> None:
    """ConfigError when `context` is longer than the model's: positions it never saw."""
    limit = model_context(model)
    if context > limit:
        raise ConfigError(f"The context {context:,} is longer than the model's ({limit:,} tokens): "
                          "the model never saw positions past it.",
                          f"Use a context of at most {limit:,} (--ctx {limit}).")
