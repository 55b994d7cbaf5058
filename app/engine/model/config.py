"""Model hyperparameters read from GGUF metadata, with each architecture's fixed semantics.

`ModelConfig` is a frozen dataclass: everything the forward pass needs to know about an
architecture, resolved once at load time (SPEC-llamacpp.md sections 2 and 3 give the facts and
their sources in llama.cpp). The forward pass never looks at the architecture string again.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import numpy as np

from app.engine.errors import ModelFormatError, UnsupportedModelError

ROPE_NORM, ROPE_NEOX = "norm", "neox"

# arch -> fixed graph semantics. rope: pair layout. qk_norm: none | head (RMS per head, before
# RoPE) | full (RMS over the whole projection, before the reshape). renorm: top-k weights are
# renormalised to sum 1. shared_gate: the shared expert output is multiplied by a sigmoid gate.
_ARCH_TRAITS: dict[str, dict[str, Any]] = {
    "llama":    dict(rope=ROPE_NORM, qk_norm="none", renorm=True,  act="silu"),
    "qwen2":    dict(rope=ROPE_NEOX, qk_norm="none", renorm=False, act="silu"),
    "qwen2moe": dict(rope=ROPE_NEOX, qk_norm="none", renorm=False, act="silu", shared_gate=True),
    "qwen3":    dict(rope=ROPE_NEOX, qk_norm="head", renorm=False, act="silu"),
    "qwen3moe": dict(rope=ROPE_NEOX, qk_norm="head", renorm=True,  act="silu"),
    "olmoe":    dict(rope=ROPE_NEOX, qk_norm="full", renorm=False, act="silu"),
    "deepseek": dict(rope=ROPE_NORM, qk_norm="none", renorm=False, act="silu"),
    "gemma3":   dict(rope=ROPE_NEOX, qk_norm="head", renorm=False, act="gelu",
                     post_norms=True, embed_scale=True),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCH_TRAITS)
CORRUPT_HINT = "The file is corrupt. Download or convert it again."
# llama.cpp's own limits (LLAMA_MAX_LAYERS, LLAMA_MAX_EXPERTS): a corrupt count above them must
# not make the loader build millions of per-layer entries before it finds a missing tensor.
MAX_LAYERS = 512
MAX_EXPERTS = 512


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    context_length: int
    rms_eps: float
    n_ff: int = 0                   # dense FFN width (0 if every layer is MoE)
    # RoPE
    rope_type: str = ROPE_NORM
    rope_dim: int = 0
    rope_base: float = 10000.0
    rope_base_swa: float = 10000.0
    rope_freq_scale: float = 1.0    # 1 / rope.scaling.factor for linear scaling
    # attention
    attn_scale: float = 0.0         # multiplies q.k (1/sqrt(head_dim) unless overridden)
    qk_norm: str = "none"
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()
    # FFN / MoE
    act: str = "silu"
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    expert_weights_norm: bool = False
    expert_weights_scale: float = 1.0
    shared_expert_gate: bool = False
    leading_dense_blocks: int = 0
    # gemma3
    post_norms: bool = False
    embed_scale: float = 1.0
    final_logit_softcap: float = 0.0
    tied_output: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def layer_is_moe(self, il: int) -> bool:
        return self.is_moe and il >= self.leading_dense_blocks

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        return d


class _Meta:
    """Typed access to `{arch}.*` keys with clear errors."""

    def __init__(self, meta: Mapping[str, Any], arch: str):
        self.meta, self.arch = meta, arch

    def get(self, key: str, default=None):
        value = self.meta.get(f"{self.arch}.{key}", default)
        if isinstance(value, np.ndarray):  # per-layer arrays: all equal, or keep the first
            return value.tolist()
        return value

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise ModelFormatError(f"The model has no '{self.arch}.{key}' metadata entry.",
                                   "The file was written by an incomplete converter.")
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise UnsupportedModelError(
                    f"'{self.arch}.{key}' varies per layer ({value}), which is not supported yet.")
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < 2**31:
            raise ModelFormatError(f"'{self.arch}.{key}' has an invalid value {value!r}.")
        return int(value)

    def float(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if isinstance(value, list) or not isinstance(value, (int, float, np.number)):
            raise ModelFormatError(f"'{self.arch}.{key}' has an invalid value {value!r}.")
        return float(value)


def _swa_layers(m: _Meta, n_layer: int) -> tuple[bool, ...]:
    """Which layers use the sliding window (gemma3: il % pattern < pattern - 1, default 6)."""
    if m.arch != "gemma3" or not m.get("attention.sliding_window"):
        return (False,) * n_layer
    pattern = m.get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per-layer array of bools: true = SWA layer
        if len(pattern) < n_layer:
            raise ModelFormatError(
                f"'{m.arch}.attention.sliding_window_pattern' has {len(pattern)} entries for "
                f"{n_layer} layers.", "The file was written by an incomplete converter.")
        return tuple(bool(p) for p in pattern[:n_layer])
    pattern = m.int("attention.sliding_window_pattern", 6)
    return tuple(pattern > 0 and il % pattern < pattern - 1 for il in range(n_layer))


def config_from_metadata(meta: Mapping[str, Any], tensor_names=()) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (and the tensor names, for tied output etc.)."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError("The file has no 'general.architecture' entry.",
                               "This GGUF file is not a language model.")
    if arch not in _ARCH_TRAITS:
        raise UnsupportedModelError(
            f"Architecture '{arch}' is not supported.",
            "Supported architectures: " + ", ".join(SUPPORTED_ARCHITECTURES) + ".")
    traits = _ARCH_TRAITS[arch]
    m = _Meta(meta, arch)
    names = set(tensor_names)

    n_layer = m.int("block_count")
    if n_layer > MAX_LAYERS:
        raise ModelFormatError(f"'{arch}.block_count' is {n_layer}; llama.cpp allows at most "
                               f"{MAX_LAYERS} layers.", CORRUPT_HINT)
    n_embd = m.int("embedding_length")
    if n_embd == 0:
        raise ModelFormatError(f"'{arch}.embedding_length' is 0.", CORRUPT_HINT)
    n_head = m.int("attention.head_count")
    n_head_kv = m.int("attention.head_count_kv", n_head)
    if n_head == 0 or n_head_kv == 0 or n_head % n_head_kv:
        raise ModelFormatError(f"Invalid head counts: {n_head} heads, {n_head_kv} kv heads.")
    head_dim = m.int("attention.key_length", n_embd // n_head)
    if head_dim == 0:
        raise ModelFormatError(f"Invalid head size 0 ({n_embd} embedding, {n_head} heads).",
                               CORRUPT_HINT)
    tokens = meta.get("tokenizer.ggml.tokens", ())
    n_vocab = m.int("vocab_size", len(tokens) if isinstance(tokens, (list, np.ndarray)) else 0)
    if n_vocab == 0:
        raise ModelFormatError(f"The model has no vocabulary ('{arch}.vocab_size' and "
                               "'tokenizer.ggml.tokens' are missing or empty).", CORRUPT_HINT)
    n_expert = m.int("expert_count", 0)
    if n_expert > MAX_EXPERTS:
        raise ModelFormatError(f"'{arch}.expert_count' is {n_expert}; llama.cpp allows at most "
                               f"{MAX_EXPERTS} experts.", CORRUPT_HINT)
    n_ff = m.int("feed_forward_length", 0)
    n_expert_used = m.int("expert_used_count", 0) if n_expert else 0
    if n_expert and not 1 <= n_expert_used <= n_expert:
        raise ModelFormatError(f"Invalid expert counts: {n_expert_used} of {n_expert} experts "
                               "used per token.", CORRUPT_HINT)
    # qwen2moe: expert width falls back to n_ff / n_expert_used (SPEC 2.3); others use n_ff.
    ff_exp_default = (n_ff // max(n_expert_used, 1)) if arch == "qwen2moe" else n_ff
    n_ff_exp = m.int("expert_feed_forward_length", ff_exp_default) if n_expert else 0
    n_ff_shexp = 0
    if arch == "qwen2moe":
        n_ff_shexp = m.int("expert_shared_feed_forward_length", 0)
    elif arch == "deepseek":
        n_ff_shexp = n_ff_exp * m.int("expert_shared_count", 0)

    if arch == "gemma3":
        attn_scale = 1.0 / math.sqrt(n_embd / n_head if n_layer == 62 else head_dim)  # 27B
    else:
        attn_scale = m.float("attention.scale", 0.0) or 1.0 / math.sqrt(head_dim)

    scaling = m.get("rope.scaling.type", "linear")
    if scaling not in ("none", "linear"):
        raise UnsupportedModelError(f"RoPE scaling '{scaling}' is not supported yet.",
                                    "Supported: none and linear.")
    factor = m.float("rope.scaling.factor", 0.0)
    rope_dim = m.int("rope.dimension_count", head_dim)
    if rope_dim % 2 or rope_dim > head_dim:
        raise ModelFormatError(f"'{arch}.rope.dimension_count' is {rope_dim}; it must be even "
                               f"and at most the head size {head_dim}.", CORRUPT_HINT)
    freq_scale = 1.0 / factor if scaling == "linear" and factor > 0 else 1.0
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError("Models with per-dimension RoPE factors (rope_freqs) are "
                                    "not supported yet.")

    return ModelConfig(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_vocab=n_vocab,
        context_length=m.int("context_length", 2048),
        rms_eps=m.float("attention.layer_norm_rms_epsilon", 1e-6),
        n_ff=n_ff if (not n_expert or arch == "deepseek") else 0,
        rope_type=traits["rope"], rope_dim=rope_dim,
        rope_base=m.float("rope.freq_base", 10000.0),
        rope_base_swa=m.float("rope.freq_base_swa", 10000.0),
        rope_freq_scale=freq_scale,
        attn_scale=attn_scale, qk_norm=traits["qk_norm"],
        sliding_window=m.int("attention.sliding_window", 0) if arch == "gemma3" else 0,
        swa_layers=_swa_layers(m, n_layer),
        act=traits["act"],
        n_expert=n_expert, n_expert_used=n_expert_used, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp,
        expert_weights_norm=traits["renorm"],
        expert_weights_scale=m.float("expert_weights_scale", 1.0) if arch == "deepseek" else 1.0,
        shared_expert_gate=traits.get("shared_gate", False),
        leading_dense_blocks=m.int("leading_dense_block_count", 0) if arch == "deepseek" else 0,
        post_norms=traits.get("post_norms", False),
        embed_scale=float(np.float32(math.sqrt(n_embd))) if traits.get("embed_scale") else 1.0,
        final_logit_softcap=m.float("final_logit_softcapping", 0.0) if arch == "gemma3" else 0.0,
        tied_output="output.weight" not in names,
        extra={k: v for k, v in meta.items() if k.startswith(arch + ".")},
    )


# ---- training ------------------------------------------------------------------------------
