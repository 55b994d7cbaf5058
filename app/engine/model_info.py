"""The model card: what a GGUF file holds and roughly what a LoRA run on it will need.

Reads only the header (metadata and tensor table), so it is fast even for a 50 GB file. Used by
`workbench info` and by the GUI's model picker.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from app.engine.config import TRAINABLE_TYPES, ModelConfig, config_from_metadata
from app.engine.gguf_io import GGUFFile, read_gguf, type_name

DEFAULT_LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output",
                        "ffn_gate", "ffn_up", "ffn_down",
                        "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                        "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a LoRA run needs, by part. Float32 compute; checkpointing at layer boundaries."""

    weights: int            # base weights as stored (memory-mapped)
    dequant_working: int    # float32 copy of the largest layer's quantized weights
    adapter: int            # LoRA params + grads + AdamW moments (4 float32 per parameter)
    activations: int        # layer-boundary checkpoints + one layer recomputed + loss chunk

    @property
    def total(self) -> int:
        return self.weights + self.dequant_working + self.adapter + self.activations


@dataclass(frozen=True)
class ModelCard:
    path: str
    file_size: int
    name: str
    config: ModelConfig
    n_params: int
    tensor_types: dict[str, int]
    has_chat_template: bool
    tokenizer_model: str
    lora_params: int
    memory: MemoryEstimate
    lora_rank: int
    context: int
    full_params: int = 0    # elements full fine-tuning trains (every F32/F16/BF16 tensor)
    tensor_shapes: dict[str, tuple[int, ...]] = field(repr=False, default_factory=dict)

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs for a card in the CLI or the GUI."""
        c = self.config
        experts = "none (dense)"
        if c.is_moe:
            experts = f"{c.n_expert} ({c.n_expert_used} used per token)"
            if c.n_ff_shexp:
                experts += ", shared expert" + (" (sigmoid-gated)" if c.shared_expert_gate else "")
            if c.leading_dense_blocks:
                experts += f", {c.leading_dense_blocks} leading dense layer(s)"
        types = ", ".join(f"{t} x{n}" for t, n in sorted(self.tensor_types.items(),
                                                          key=lambda kv: -kv[1]))
        m = self.memory
        return [
            ("File", os.path.basename(self.path)),
            ("Name", self.name),
            ("Architecture", c.arch),
            ("Layers", str(c.n_layer)),
            ("Width", str(c.n_embd)),
            ("Heads", f"{c.n_head} ({c.n_head_kv} kv, head dim {c.head_dim})"),
            ("Experts", experts),
            ("Context length", f"{c.context_length:,}"),
            ("Vocabulary", f"{c.n_vocab:,} ({self.tokenizer_model})"),
            ("Parameters", human_count(self.n_params)),
            ("Tensor types", types),
            ("File size", human_bytes(self.file_size)),
            ("Chat template", "yes" if self.has_chat_template else "no (ChatML default)"),
            (f"LoRA run estimate (rank {self.lora_rank}, context {self.context})",
             f"{human_bytes(m.total)}: weights {human_bytes(m.weights)}, dequantized layer "
             f"{human_bytes(m.dequant_working)}, adapter+optimizer {human_bytes(m.adapter)} "
             f"({human_count(self.lora_params)} trainable), activations {human_bytes(m.activations)}"),
        ]

    def to_dict(self) -> dict:
        return {"path": self.path, "file_size": self.file_size, "name": self.name,
                "config": self.config.to_dict(), "n_params": self.n_params,
                "tensor_types": self.tensor_types, "has_chat_template": self.has_chat_template,
                "tokenizer_model": self.tokenizer_model, "lora_params": self.lora_params,
                "lora_rank": self.lora_rank, "context": self.context,
                "memory": {**self.memory.__dict__, "total": self.memory.total}}


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def lora_param_count(shapes: dict[str, tuple[int, ...]], rank: int,
                     targets=DEFAULT_LORA_TARGETS) -> int:
    """Trainable parameters of rank-`rank` adapters on every tensor whose kind is in targets."""
    total = 0
    for name, shape in shapes.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in targets and parts[3] == "weight":
            *experts, out, inp = shape
            total += (experts[0] if experts else 1) * rank * (out + inp)
    return total


def estimate_lora_memory(f: GGUFFile, cfg: ModelConfig, rank: int, context: int,
                         targets=DEFAULT_LORA_TARGETS) -> tuple[MemoryEstimate, int]:
    shapes = {n: t.shape for n, t in f.tensors.items()}
    n_lora = lora_param_count(shapes, rank, targets)
    weights = sum(t.nbytes for t in f.tensors.values())
    layer_f32 = max((sum(t.n_elements * 4 for n, t in f.tensors.items()
                         if n.startswith(f"blk.{il}.") and t.ggml_type != 0)
                     for il in range(cfg.n_layer)), default=0)
    t, c = context, cfg.n_embd
    ffn = max(cfg.n_ff, cfg.n_ff_exp * max(cfg.n_expert_used, 1) + cfg.n_ff_shexp)
    one_layer = t * (8 * c + 3 * ffn + 2 * cfg.n_head * cfg.head_dim) * 4 + cfg.n_head * t * t * 4
    activations = cfg.n_layer * t * c * 4 + one_layer + t * min(cfg.n_vocab, 32768) * 4
    return MemoryEstimate(weights, layer_f32, n_lora * 16, activations), n_lora


def describe_model(path: str | os.PathLike, rank: int = 16, context: int = 512) -> ModelCard:
    """Read a GGUF header and build its card (raises ModelFormatError/UnsupportedModelError)."""
    f = read_gguf(path)
    try:
        cfg = config_from_metadata(f.metadata, f.tensors)
        context = min(context, cfg.context_length)
        memory, n_lora = estimate_lora_memory(f, cfg, rank, context)
        return ModelCard(
            path=str(path), file_size=f.file_size,
            name=str(f.metadata.get("general.name", os.path.basename(str(path)))),
            config=cfg, n_params=sum(t.n_elements for t in f.tensors.values()),
            tensor_types=dict(Counter(type_name(t.ggml_type) for t in f.tensors.values())),
            has_chat_template=bool(f.metadata.get("tokenizer.chat_template")),
            tokenizer_model=str(f.metadata.get("tokenizer.ggml.model", "none")),
            lora_params=n_lora, memory=memory, lora_rank=rank, context=context,
            full_params=sum(t.n_elements for t in f.tensors.values()
                            if t.ggml_type in TRAINABLE_TYPES),
            tensor_shapes={n: t.shape for n, t in f.tensors.items()})
    finally:
        f.close()
