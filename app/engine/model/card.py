"""The model card: what a GGUF file holds and roughly what a LoRA run on it will need.

The memory model (`MemoryEstimate`, `layer_activation_bytes`) is the one bench/cost.py's lower
bound uses, plus what the engine holds beyond it: the dequantized-weight cache, the float32
weights alive beyond it when the cache cannot hold them all, the backward's and the loss head's
working buffers (`layer_backward_bytes`, `loss_head_bytes`) and the process's runtime. Measured
against it (peak RSS, 2026-11-22): Gemma 3 270M Q4_K_M LoRA at context 512, 1.91 GB with the
default cache and 0.93 GB without; bench-moe Q8_0 at context 256, 389 MB and 191 MB. The
real-size MoE rows (bench/moe_shapes.py, docs/PERFORMANCE.md) are the check of the MoE terms.

Reads only the header (metadata and tensor table), so it is fast even for a 50 GB file. Used by
`workbench info` and by the GUI's model picker.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from app.engine.model.config import ModelConfig, config_from_metadata
from app.engine.io.gguf import GGUFFile, read_gguf, type_name
from app.engine.kernels.attention import row_block_count
from app.engine.kernels.loss import VOCAB_CHUNK
from app.engine.model.lora import LoraConfig
from app.engine.model.params import TRAINABLE_TYPES
from app.engine.model.weights import default_cache_budget
from app.engine.runtime.bf16 import choose as choose_precision
from app.engine.runtime.parallel import thread_count

DEFAULT_LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output",
                        "ffn_gate", "ffn_up", "ffn_down",
                        "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                        "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


# ---- what a training step keeps ------------------------------------------------------------------

F32 = 4  # bytes


class Linear(NamedTuple):
    name: str      # the weight's tensor name
    rows: int      # input rows per step (tokens, or token slots for expert projections)
    n_in: int
    n_out: int


def block_linears(cfg: ModelConfig, il: int, n_tokens: int) -> list[Linear]:
    """The linear layers of block `il` with their row counts for a step of n_tokens."""
    t, c, p = n_tokens, cfg.n_embd, f"blk.{il}."
    q_out, kv_out = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    out = [Linear(p + "attn_q.weight", t, c, q_out), Linear(p + "attn_k.weight", t, c, kv_out),
           Linear(p + "attn_v.weight", t, c, kv_out), Linear(p + "attn_output.weight", t, q_out, c)]

    def ffn(pattern: str, rows: int, width: int) -> list[Linear]:
        return [Linear(p + pattern.format("gate"), rows, c, width),
                Linear(p + pattern.format("up"), rows, c, width),
                Linear(p + pattern.format("down"), rows, width, c)]

    if not cfg.layer_is_moe(il):
        return out + ffn("ffn_{}.weight", t, cfg.n_ff)
    out.append(Linear(p + "ffn_gate_inp.weight", t, c, cfg.n_expert))
    out += ffn("ffn_{}_exps.weight", t * cfg.n_expert_used, cfg.n_ff_exp)
    if cfg.n_ff_shexp:
        out += ffn("ffn_{}_shexp.weight", t, cfg.n_ff_shexp)
    return out


def layer_activation_bytes(cfg: ModelConfig, n_tokens: int, ranks: dict[str, int]) -> list[int]:
    """Bytes each layer keeps for its backward, for n_tokens tokens: float32 values per token

        attention: block input and normed input (2C), q, k, v after RoPE (H·D + 2·Hkv·D),
                   attention output (H·D), log-sum-exp (H)
        FFN:       its input and normed input (2C), gate and up pre-activations (2F dense;
                   2·K·F_exp for the routed experts, 2·F_shexp for shared experts, E router
                   probabilities), and for routed experts the two dispatch copies of the
                   K slots (2·K·C: the sorted inputs and the un-permuted outputs)
        LoRA:      the rank activations x·A^T, R per adapted projection per row

    ranks: LoRA rank per adapted tensor name."""
    out = []
    for il in range(cfg.n_layer):
        c, d = cfg.n_embd, cfg.head_dim
        n = 2 * c + 2 * cfg.n_head * d + 2 * cfg.n_head_kv * d + cfg.n_head        # attention
        n += 2 * c                                                                 # FFN input
        if cfg.layer_is_moe(il):
            n += cfg.n_expert + 2 * cfg.n_expert_used * (cfg.n_ff_exp + c) + 2 * cfg.n_ff_shexp
        else:
            n += 2 * cfg.n_ff
        for lin in block_linears(cfg, il, 1):                                      # rows per token
            n += lin.rows * ranks.get(lin.name, 0)
        out.append(n * n_tokens * F32)
    return out


def layer_backward_bytes(cfg: ModelConfig, n_tokens: int) -> list[int]:
    """Bytes each layer's backward allocates beyond what it keeps for n_tokens tokens (T): the
    larger of its two halves, float32

        attention: dk and dv of each of the B row blocks before their sum (2·B·Hkv·D per
                   token), dq and the output projection's gradient (2·H·D per token), and per
                   engine thread the probabilities and dS of one piece (2·G·ceil(T/B)·T,
                   G = H / Hkv query heads per kv head)
        FFN:       routed experts: the sorted slot gradients that combine's backward returns
                   and experts' backward writes (2·K·C per token), dx (C), per engine thread
                   one expert's dh, recomputed activation, dg and du (4·F_exp per row, at the
                   average load of T·K/E rows), and a shared expert's as a dense FFN's; dense:
                   the activation's gradient, the recomputed activation, dg and du (4·F per
                   token) and dx (C)"""
    t, c, d = n_tokens, cfg.n_embd, cfg.head_dim
    b = row_block_count(cfg.n_head_kv, t)            # the CPU's (one block on a GPU: fewer bytes)
    group = cfg.n_head // cfg.n_head_kv
    attention = ((2 * b * cfg.n_head_kv * d + 2 * cfg.n_head * d) * t
                 + thread_count() * 2 * group * -(-t // b) * t)
    out = []
    for il in range(cfg.n_layer):
        if cfg.layer_is_moe(il):
            expert_rows = -(-t * cfg.n_expert_used // cfg.n_expert)
            ffn = ((2 * cfg.n_expert_used * c + c + 4 * cfg.n_ff_shexp) * t
                   + thread_count() * 4 * cfg.n_ff_exp * expert_rows)
        else:
            ffn = (4 * cfg.n_ff + c) * t
        out.append(max(attention, ffn) * F32)
    return out


def loss_head_bytes(cfg: ModelConfig, n_tokens: int) -> int:
    """The loss head's working buffers for n_tokens tokens (T), float32: one chunk of logits
    (T x min(V, VOCAB_CHUNK): the trained head's; a frozen head's row blocks hold at most this)
    and two (T, C) arrays (dh and the label rows, or dh and the hidden state's gradient)."""
    return (n_tokens * min(cfg.n_vocab, VOCAB_CHUNK) + 2 * n_tokens * cfg.n_embd) * F32


def kept_activation_bytes(layers: list[int], boundary: int, checkpoint: int) -> int:
    """Activations alive at once: every layer's without checkpointing; with interval N the
    saved inputs of ceil(L/N) segments (`boundary` bytes each) plus one segment of N layers
    during its backward. Plus the residual stream and its gradient (2 x boundary)."""
    if checkpoint:
        starts = range(0, len(layers), checkpoint)
        kept = len(starts) * boundary + max((sum(layers[s:s + checkpoint]) for s in starts),
                                            default=0)
    else:
        kept = sum(layers)
    return kept + 2 * boundary


# The engine's process without a model's own memory: Python, NumPy and the compiled kernels
# (Numba, llvmlite's 69 MB mapped): 164 MB measured after two LoRA steps on a 28 KB model.
RUNTIME_BYTES = 165 << 20
# What a run whose bf16 products go through the library (oneDNN, app.engine.runtime.onednn) adds
# to that: +13 MB of RSS loading it in a bare process here, and its compiled kernels and each
# thread's scratchpad: bench-moe-q8_0 LoRA with the weight cache off peaked 22 MB higher in bf16
# than in float32 (docs/PERFORMANCE.md, "bf16 products").
BF16_LIBRARY_BYTES = 40 << 20


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a training run needs, by part, for the card's LoRA rank (every target) and
    context, float32 compute. `total_for` puts them together for the chosen settings (under
    precision "bf16" the cache holds half: `cached`)."""

    weights: int                        # base weights as stored (memory-mapped, all read)
    dequantized: int                    # float32 copies of every quantized tensor the engine
                                        # reads whole: the most the weight cache
                                        # (app.engine.model.weights) holds. Not an untied token
                                        # embedding: its lookups dequantize only their rows
    dequant_working: int                # float32 copies alive beyond the cache: the larger of
                                        # one quantized 2-D block weight or group of weights
                                        # read together (q, k, v; gate, up: dropped after use)
                                        # and two chunks of a quantized output head (the
                                        # next made while the last is held), plus per engine
                                        # thread one expert of each projection (the tiles)
    adapter: int                        # LoRA params + grads + AdamW moments, every target
    layer_activations: tuple[int, ...]  # what each layer keeps for backward (no checkpointing)
    layer_backward: tuple[int, ...]     # what each layer's backward allocates beyond that
    boundary: int                       # one layer's input (T x C float32): a checkpoint
    loss_head: int                      # the loss head's working buffers (loss_head_bytes)

    def activations(self, checkpoint: int = 0) -> int:
        """Kept activations plus the working buffers of whichever comes larger, the loss head
        or the backward of a layer (they run one after the other)."""
        kept = kept_activation_bytes(list(self.layer_activations), self.boundary, checkpoint)
        return kept + max(self.loss_head, max(self.layer_backward, default=0))

    def cached(self, precision: str = "fp32") -> int:
        """The most the weight cache holds for a run whose base's products compute in
        `precision` (a chosen one: "fp32", "tf32" or "bf16"): `dequantized`, or half of it
        under bf16, where the cache holds the weights packed in bf16 (WeightStore.packed)."""
        return self.dequantized // 2 if precision == "bf16" else self.dequantized

    def dequantized_in_use(self, cache_budget: int, precision: str = "fp32") -> int:
        """Dequantized weights alive: what the cache keeps under `cache_budget` bytes (in
        float32, or packed bf16: `cached`), plus `dequant_working` when the cache cannot keep
        them all (counted in float32 under bf16 too: a bound)."""
        whole = self.cached(precision)
        kept = min(cache_budget, whole)
        return kept + (self.dequant_working if kept < whole else 0)

    def total_for(self, trained_state: int, checkpoint: int = 0,
                  cache_budget: int | None = None, precision: str = "fp32") -> int:
        """Weights, dequantized weights in use (in `precision`), `trained_state` (adapter or
        full copies with their gradients and moments), activations and the process's
        runtime."""
        budget = default_cache_budget() if cache_budget is None else cache_budget
        return (self.weights + self.dequantized_in_use(budget, precision) + trained_state
                + self.activations(checkpoint) + RUNTIME_BYTES)

    @property
    def total(self) -> int:
        """A LoRA run on every target without checkpointing, with the default weight cache."""
        return self.total_for(self.adapter)


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
        auto = choose_precision("auto")      # what a run with the default settings computes in
        cache = m.dequantized_in_use(default_cache_budget(), auto.name)
        library = BF16_LIBRARY_BYTES if auto.backend == "onednn" else 0
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
            # what --precision auto picks on this computer, and what the bf16 extra would gain
            ("Precision (auto)", auto.reason),
            (f"LoRA run estimate (rank {self.lora_rank}, context {self.context})",
             f"{human_bytes(m.total_for(m.adapter, precision=auto.name) + library)}: weights "
             f"{human_bytes(m.weights)}, dequantized weights {human_bytes(cache)}"
             f"{' (packed bf16)' if auto.bf16 and cache else ''}, adapter+optimizer "
             f"{human_bytes(m.adapter)} ({human_count(self.lora_params)} trainable), activations "
             f"{human_bytes(m.activations())}, runtime {human_bytes(RUNTIME_BYTES + library)}"),
        ]

    def to_dict(self) -> dict:
        m = self.memory
        return {"path": self.path, "file_size": self.file_size, "name": self.name,
                "config": self.config.to_dict(), "n_params": self.n_params,
                "tensor_types": self.tensor_types, "has_chat_template": self.has_chat_template,
                "tokenizer_model": self.tokenizer_model, "lora_params": self.lora_params,
                "lora_rank": self.lora_rank, "context": self.context,
                "memory": {"weights": m.weights, "dequantized": m.dequantized,
                           "dequant_working": m.dequant_working, "adapter": m.adapter,
                           "activations": m.activations(), "runtime": RUNTIME_BYTES,
                           "total": m.total}}


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


def lora_ranks(shapes: dict[str, tuple[int, ...]], rank: int, targets=DEFAULT_LORA_TARGETS,
               expert_rank: int | None = None) -> dict[str, int]:
    """LoRA rank per adapted block tensor (kind in targets): `rank`, and for 3-D expert stacks
    LoraConfig.expert_rank_for(E) (expert_rank, else min(rank, 8) past 32 experts)."""
    config = LoraConfig(rank=rank, expert_rank=expert_rank)
    ranks = {}
    for name, shape in shapes.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in targets and parts[3] == "weight":
            ranks[name] = config.expert_rank_for(shape[0]) if len(shape) == 3 else rank
    return ranks


def lora_param_count(shapes: dict[str, tuple[int, ...]], rank: int,
                     targets=DEFAULT_LORA_TARGETS, expert_rank: int | None = None) -> int:
    """Trainable parameters of the adapters of `lora_ranks` (every tensor whose kind is in
    targets)."""
    total = 0
    for name, r in lora_ranks(shapes, rank, targets, expert_rank).items():
        *experts, out, inp = shapes[name]
        total += (experts[0] if experts else 1) * r * (out + inp)
    return total


# Linear layers that read the same input run as one group, their weights fetched together
# (app.engine.model.transformer, Model._linear_forward_group).
_READ_TOGETHER = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


def _dequantized_together(quantized: dict, il: int) -> int:
    """Elements of layer il's quantized 2-D weights in float32 at once: the largest weight or
    group of weights fetched together."""
    sizes = {n.split(".")[2]: t.n_elements for n, t in quantized.items()      # kind -> elements
             if n.startswith(f"blk.{il}.") and len(t.shape) < 3}
    return max([*sizes.values(), *(sum(sizes.get(kind, 0) for kind in group)
                                   for group in _READ_TOGETHER)], default=0)


def estimate_lora_memory(f: GGUFFile, cfg: ModelConfig, rank: int, context: int,
                         targets=DEFAULT_LORA_TARGETS,
                         expert_rank: int | None = None) -> tuple[MemoryEstimate, int]:
    shapes = {n: t.shape for n, t in f.tensors.items()}
    n_lora = lora_param_count(shapes, rank, targets, expert_rank)
    quantized = {n: t for n, t in f.tensors.items() if t.ggml_type != 0}
    head = "token_embd.weight" if cfg.tied_output else "output.weight"
    whole = {n: t for n, t in quantized.items()             # what the cache may hold
             if n != "token_embd.weight" or cfg.tied_output}
    block_2d = [_dequantized_together(quantized, il) for il in range(cfg.n_layer)]
    head_chunks = 2 * min(cfg.n_vocab, VOCAB_CHUNK) * cfg.n_embd if head in quantized else 0
    tiles = max((sum(t.n_elements // t.shape[0] for n, t in quantized.items()  # (out, in) each
                     if n.startswith(f"blk.{il}.") and len(t.shape) == 3)
                 for il in range(cfg.n_layer)), default=0)
    ranks = lora_ranks(shapes, rank, targets, expert_rank)
    t = context
    return MemoryEstimate(
        weights=sum(t.nbytes for t in f.tensors.values()),
        dequantized=sum(t.n_elements * F32 for t in whole.values()),
        dequant_working=(max(max(block_2d, default=0), head_chunks)
                         + thread_count() * tiles) * F32,
        adapter=n_lora * 16,
        layer_activations=tuple(layer_activation_bytes(cfg, t, ranks)),
        layer_backward=tuple(layer_backward_bytes(cfg, t)),
        boundary=t * cfg.n_embd * F32,
        loss_head=loss_head_bytes(cfg, t)), n_lora


def describe_model(path: str | os.PathLike, rank: int = 16, context: int = 512,
                   expert_rank: int | None = None, targets=DEFAULT_LORA_TARGETS) -> ModelCard:
    """Read a GGUF header and build its card (raises ModelFormatError/UnsupportedModelError).
    The estimate adapts the tensor kinds in `targets`, experts at LoraConfig's expert rank."""
    f = read_gguf(path)
    try:
        cfg = config_from_metadata(f.metadata, f.tensors)
        context = min(context, cfg.context_length)
        memory, n_lora = estimate_lora_memory(f, cfg, rank, context, targets, expert_rank)
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
