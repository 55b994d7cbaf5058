"""Freshly initialised small models ("train from scratch"), written as ordinary GGUF files.

The architecture and sizes are options; the tokenizer (every `tokenizer.*` key) is copied from an
existing GGUF file. The tensors are exactly those the loader requires for that architecture
(`app.engine.model.transformer.expected_shapes`), so the result loads, trains and runs like any other model.

A shape whose tensors do not fit the machine's memory is refused with the size it would need
before anything is allocated or written (`check_fits_memory`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from app.engine.model.card import human_bytes, human_count
from app.engine.model.config import MAX_EXPERTS, MAX_LAYERS, config_from_metadata
from app.engine.errors import ConfigError, OutOfMemoryError
from app.engine.io.gguf import read_gguf, write_gguf
from app.engine.model.transformer import expected_shapes
from app.engine.runtime.backend import device_memory
from app.engine.runtime.files import storage_error
from app.engine.runtime.schema import INT_MAX


# The shortest context a new model may have: a few tokens of text and the one after them (a
# context of 0 wrote a model nothing can be trained on or generated with).
MIN_CONTEXT = 8

# Architectures whose required metadata NewModelSpec covers (qwen2moe and deepseek need shared-
# expert and leading-dense settings it does not have).
NEW_MODEL_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "olmoe", "gemma3")


@dataclass(frozen=True)
class NewModelSpec:
    arch: str = "llama"
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 0            # 0: same as n_head (no GQA)
    n_ff: int = 688               # dense FFN width (also the expert width for llama/olmoe)
    n_expert: int = 0
    n_expert_used: int = 0
    context_length: int = 512
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    tied_output: bool = False
    init_std: float = 0.02
    seed: int = 0
    name: str = "workbench-from-scratch"

    @property
    def kv_heads(self) -> int:
        return self.n_head_kv or self.n_head

    def validate(self) -> None:
        if self.arch not in NEW_MODEL_ARCHITECTURES:
            raise ConfigError(f"New models of architecture '{self.arch}' are not supported.",
                              "Use one of: " + ", ".join(NEW_MODEL_ARCHITECTURES) + ".")
        if min(self.n_layer, self.n_embd, self.n_head, self.kv_heads, self.n_ff) < 1:
            raise ConfigError("Layers, width, heads and FFN width must be positive.")
        # llama.cpp's limits, said as limits of the shape asked for (the loader's own check
        # calls a count past them a corrupt file)
        if self.n_layer > MAX_LAYERS:
            raise ConfigError(f"{self.n_layer:,} layers is more than llama.cpp allows "
                              f"({MAX_LAYERS}).", f"Choose at most {MAX_LAYERS} layers.")
        if self.n_expert > MAX_EXPERTS:
            raise ConfigError(f"{self.n_expert:,} experts is more than llama.cpp allows "
                              f"({MAX_EXPERTS}).", f"Choose at most {MAX_EXPERTS} experts.")
        if not MIN_CONTEXT <= self.context_length <= INT_MAX:
            raise ConfigError(f"A context of {self.context_length:,} tokens is not usable.",
                              f"Choose a context from {MIN_CONTEXT} to {INT_MAX:,} tokens.")
        if not 0 <= self.seed <= INT_MAX:   # numpy refuses a negative seed; the window's range
            raise ConfigError(f"The seed {self.seed} is not from 0 to {INT_MAX:,}.",
                              "Choose a seed in that range.")
        if self.n_embd % self.n_head or self.n_head % self.kv_heads:
            raise ConfigError("The width must divide by the heads, and the heads by the kv heads.")
        if self.arch in ("qwen3moe", "olmoe") and not self.n_expert:
            raise ConfigError(f"A '{self.arch}' model needs experts (n_expert > 0).")
        if self.n_expert and not 0 < self.n_expert_used <= self.n_expert:
            raise ConfigError("Experts used per token must be between 1 and the expert count.")


def _metadata(spec: NewModelSpec, tokenizer_meta: dict) -> dict:
    a = spec.arch
    n_vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    meta = {
        "general.architecture": a, "general.name": spec.name, "general.type": "model",
        f"{a}.block_count": spec.n_layer, f"{a}.embedding_length": spec.n_embd,
        f"{a}.feed_forward_length": spec.n_ff, f"{a}.context_length": spec.context_length,
        f"{a}.attention.head_count": spec.n_head, f"{a}.attention.head_count_kv": spec.kv_heads,
        f"{a}.attention.layer_norm_rms_epsilon": spec.rms_eps,
        f"{a}.rope.freq_base": spec.rope_base, f"{a}.vocab_size": n_vocab,
    }
    if spec.n_expert:
        meta.update({f"{a}.expert_count": spec.n_expert,
                     f"{a}.expert_used_count": spec.n_expert_used,
                     f"{a}.expert_feed_forward_length": spec.n_ff})
    meta.update(tokenizer_meta)
    return meta


def init_tensors(shapes: dict[str, tuple[int, ...]], init_std: float, seed: int) -> dict:
    """Norm weights 1, biases 0, everything else N(0, init_std); output projections (attention
    output and FFN down) scaled by 1/sqrt(2 n_layer) as GPT-2 does, for a stable deep start."""
    rng = np.random.default_rng(seed)
    n_layer = 1 + max((int(n.split(".")[1]) for n in shapes if n.startswith("blk.")), default=0)
    tensors = {}
    for name, shape in shapes.items():
        if "norm" in name:
            tensors[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            tensors[name] = np.zeros(shape, np.float32)
        else:
            std = init_std
            if "attn_output" in name or "ffn_down" in name:
                std /= np.sqrt(2 * n_layer)
            tensors[name] = rng.normal(0.0, std, shape).astype(np.float32)
    return tensors


def check_fits_memory(shapes: dict[str, tuple[int, ...]]) -> None:
    """OutOfMemoryError when making a model of these shapes needs more than this machine's
    memory: every tensor in float32 at once (init_tensors), plus the float64 draw of the
    largest one (numpy's normal() draws float64 before the cast)."""
    counts = [math.prod(shape) for shape in shapes.values()]
    need = 4 * sum(counts) + 8 * max(counts)
    total = device_memory(np)[1]
    if need > total:
        raise OutOfMemoryError(
            f"A model of this shape has {human_count(sum(counts))} parameters: making it needs "
            f"about {human_bytes(need)} of memory, and this machine has {human_bytes(total)}.",
            "Choose fewer layers, a smaller width or FFN width, or fewer experts.")


def create_model(path: str | os.PathLike, spec: NewModelSpec, tokenizer_from: str | os.PathLike):
    """Write a freshly initialised F32 model with the tokenizer of `tokenizer_from`
    (OutOfMemoryError, before allocating, for a shape this machine cannot hold)."""
    spec.validate()
    source = read_gguf(tokenizer_from)
    tokenizer_meta = {k: v for k, v in source.metadata.items() if k.startswith("tokenizer.")}
    source.close()
    if "tokenizer.ggml.tokens" not in tokenizer_meta:
        raise ConfigError(f"{tokenizer_from} has no tokenizer to copy.",
                          "Pick a GGUF model or vocab file with tokenizer.ggml.tokens.")
    meta = _metadata(spec, tokenizer_meta)
    names = ["token_embd.weight"] + ([] if spec.tied_output else ["output.weight"])
    cfg = config_from_metadata(meta, names)
    shapes = expected_shapes(cfg)
    if spec.arch in ("qwen2", "qwen2moe"):  # these GGUFs carry q/k/v biases
        for il in range(cfg.n_layer):
            for proj in ("q", "k", "v"):
                shapes[f"blk.{il}.attn_{proj}.bias"] = (shapes[f"blk.{il}.attn_{proj}.weight"][0],)
    check_fits_memory(shapes)
    try:
        write_gguf(path, meta, init_tensors(shapes, spec.init_std, spec.seed))
    except OSError as e:
        raise storage_error(e, path) from e
    return path
