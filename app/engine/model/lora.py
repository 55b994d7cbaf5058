"""LoRA adapters: llama.cpp's GGUF adapter format (SPEC-llamacpp.md section 1).

An adapter maps base tensor names to (A, B) pairs in NumPy order, exactly as PEFT stores them:
2-D targets A (R, in), B (out, R); 3-D expert targets A (E, R, in), B (E, out, R); the token
embedding A (n_vocab, R) (PEFT's lora_embedding_A transposed), B (n_embd, R). The applied scale
is user_scale * alpha / R, or user_scale when alpha is 0 (llama.cpp's rule, R = B.shape[-1]).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from app.engine.errors import ConfigError, ModelFormatError
from app.engine.io.gguf import read_gguf, write_gguf
from app.engine.runtime.backend import to_host


@dataclass
class LoraAdapter:
    alpha: float
    tensors: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    arch: str = ""
    path: str = ""

    def rank(self, name: str) -> int:
        return int(self.tensors[name][1].shape[-1])

    def scale(self, name: str, user_scale: float = 1.0) -> float:
        return user_scale * self.alpha / self.rank(name) if self.alpha else user_scale

    def scaled(self, name: str, user_scale: float = 1.0):
        """(A, B, scale) for a base tensor name, or None when the adapter does not target it."""
        if name not in self.tensors:
            return None
        a, b = self.tensors[name]
        return a, b, self.scale(name, user_scale)


def read_adapter_header(path: str | os.PathLike):
    """The GGUF file at `path` (its header read, no tensor data), refused with a
    ModelFormatError unless it is a LoRA adapter: what `train --adapter` checks before it makes
    a run folder, and `load_adapter` first."""
    f = read_gguf(path)
    meta = f.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise ModelFormatError(
            f"{os.path.basename(str(path))} is not a LoRA adapter (general.type="
            f"{meta.get('general.type')!r}, adapter.type={meta.get('adapter.type')!r}).",
            "Pick a GGUF LoRA adapter, e.g. one written by convert_lora_to_gguf.py.")
    return f


def load_adapter(path: str | os.PathLike) -> LoraAdapter:
    """Read a GGUF LoRA adapter written by llama.cpp's converter, PEFT tools or the workbench."""
    f = read_adapter_header(path)
    name = os.path.basename(str(path))
    meta = f.metadata
    alpha = meta.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ModelFormatError(f"{name}: adapter.lora.alpha has an invalid value {alpha!r}.")
    adapter = LoraAdapter(alpha=float(alpha), arch=meta.get("general.architecture", ""),
                          path=str(path))
    halves: dict[str, dict[str, np.ndarray]] = {}
    for tname in f.tensors:
        if tname.endswith("_norm.weight"):
            continue  # llama.cpp silently skips these (SPEC 1.2)
        base, dot, suffix = tname.rpartition(".")
        if suffix not in ("lora_a", "lora_b"):
            raise ModelFormatError(f"{name}: tensor {tname!r} has an unexpected suffix.",
                                   "Adapter tensors must end in .lora_a or .lora_b.")
        halves.setdefault(base, {})[suffix] = np.array(f.array(tname))  # own the memory
    for base, pair in halves.items():
        if set(pair) != {"lora_a", "lora_b"}:
            raise ModelFormatError(f"{name}: {base!r} has only {', '.join(pair)}.",
                                   "Every adapted tensor needs both lora_a and lora_b.")
        a, b = pair["lora_a"], pair["lora_b"]
        if a.ndim < 2 or b.ndim < 2:
            ok = False
        elif base == "token_embd.weight":
            ok = a.ndim == b.ndim == 2 and a.shape[1] == b.shape[1]
        else:
            ok = a.ndim == b.ndim and a.shape[:-2] == b.shape[:-2] and a.shape[-2] == b.shape[-1]
        if not ok:
            raise ModelFormatError(f"{name}: {base!r} has mismatched LoRA shapes "
                                   f"A {a.shape} and B {b.shape}.")
        adapter.tensors[base] = (a, b)
    f.close()
    return adapter


def check_adapter_fits(adapter: LoraAdapter, arch: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise ModelFormatError unless every adapted tensor exists in the model with a matching shape."""
    if adapter.arch and adapter.arch != arch:
        raise ModelFormatError(f"The adapter is for '{adapter.arch}' but the model is '{arch}'.",
                               "Use an adapter trained on this base model.")
    for base, (a, b) in adapter.tensors.items():
        if base not in shapes:
            raise ModelFormatError(f"The adapter targets {base!r}, which the model does not have.",
                                   "Use an adapter trained on this base model.")
        want = shapes[base]
        if base == "token_embd.weight":
            got = (a.shape[0], b.shape[0])
        else:
            got = (*b.shape[:-1], a.shape[-1])  # (..., out, in)
        if tuple(got) != tuple(want):
            raise ModelFormatError(f"The adapter's {base!r} has shape {got}, the model's {want}.",
                                   "Use an adapter trained on this base model.")


# ---- creating adapters to train ------------------------------------------------------------

# Target groups a user picks (GUI checkboxes, CLI --targets) -> tensor kinds (blk.N.<kind>.weight).
TARGET_GROUPS: dict[str, tuple[str, ...]] = {
    "attention": ("attn_q", "attn_k", "attn_v", "attn_output"),
    "ffn": ("ffn_gate", "ffn_up", "ffn_down"),
    "experts": ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
    "shared": ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"),
    "router": ("ffn_gate_inp",),
    "output": ("output",),
    "embeddings": ("token_embd",),
}
DEFAULT_TARGETS = ("attention", "ffn", "experts", "shared")
MANY_EXPERTS, MANY_EXPERTS_RANK = 32, 8   # default expert rank: min(rank, 8) past 32 experts


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = DEFAULT_TARGETS   # group names or tensor kinds (e.g. "attn_q")
    rslora: bool = False                         # scale alpha/sqrt(rank) instead of alpha/rank
    seed: int = 0
    expert_rank: int | None = None               # 3-D expert adapters; None: expert_rank_for's default

    def validate(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"LoRA rank must be at least 1, got {self.rank}.")
        if self.expert_rank is not None and self.expert_rank < 1:
            raise ConfigError(f"The expert rank must be at least 1, got {self.expert_rank}.")
        if self.alpha <= 0:
            raise ConfigError(f"LoRA alpha must be positive, got {self.alpha}.")
        kinds = {k for g in TARGET_GROUPS.values() for k in g}
        unknown = [t for t in self.targets if t not in TARGET_GROUPS and t not in kinds]
        if unknown:
            raise ConfigError(f"Unknown LoRA targets: {', '.join(unknown)}.",
                              "Use groups " + ", ".join(TARGET_GROUPS) + " or tensor kinds "
                              "such as attn_q, ffn_up_exps.")

    def kinds(self) -> set[str]:
        out: set[str] = set()
        for t in self.targets:
            out.update(TARGET_GROUPS.get(t, (t,)))
        return out

    def expert_rank_for(self, n_expert: int) -> int:
        """The rank of 3-D expert adapters on a model with n_expert experts: expert_rank, else
        the rank, at most MANY_EXPERTS_RANK past MANY_EXPERTS experts (their adapters dominate
        the trainable count: 64 experts x 3 projections per layer)."""
        if self.expert_rank is not None:
            return self.expert_rank
        return min(self.rank, MANY_EXPERTS_RANK) if n_expert > MANY_EXPERTS else self.rank

    @property
    def stored_alpha(self) -> float:
        """The alpha to store so that llama.cpp's alpha/rank gives the trained scale (rsLoRA folded)."""
        return self.alpha * self.rank ** 0.5 if self.rslora else self.alpha


def tensor_kind(name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'attn_q'; 'output.weight' -> 'output'; others None."""
    parts = name.split(".")
    if parts[-1] != "weight":
        return None
    if len(parts) == 4 and parts[0] == "blk":
        return parts[2]
    return parts[0] if len(parts) == 2 else None


def lora_targets(shapes: dict[str, tuple[int, ...]], config: LoraConfig) -> list[str]:
    """Base tensor names (2-D or 3-D) the config adapts, in file order."""
    kinds = config.kinds()
    return [n for n, s in shapes.items() if tensor_kind(n) in kinds and len(s) in (2, 3)]


# FFN targets depend on the layout (dense FFN or experts): one that matches nothing only warns.
FFN_TARGETS = {t for g in ("ffn", "experts", "shared", "router") for t in (g, *TARGET_GROUPS[g])}
NVFP4 = 40


def available_targets(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The target groups that match at least one LoRA-able tensor of a model."""
    kinds = {tensor_kind(n) for n, s in shapes.items() if len(s) in (2, 3)}
    return [g for g, group_kinds in TARGET_GROUPS.items() if kinds & set(group_kinds)]


def llamacpp_lora_problems(names, shapes: dict[str, tuple[int, ...]],
                           types: dict[str, int] | None = None) -> tuple[list[str], list[str]]:
    """(errors, warnings) for an adapter on these base tensors as llama.cpp applies it.

    A tied model (no output.weight) runs its head through token_embd.weight, and llama.cpp looks
    adapters up by tensor name, so an embedding adapter lands on the head with shapes that do
    not fit (GGML_ASSERT(ggml_can_mul_mat)). NVFP4 weights with a scale tensor refuse LoRA in
    llama.cpp's FFN (an assert)."""
    errors, warnings = [], []
    tied = "token_embd.weight" in shapes and "output.weight" not in shapes
    if tied and "token_embd.weight" in names:
        errors.append("The adapter targets token_embd (embeddings), but this model ties its "
                      "output head to the embedding: llama.cpp would apply the embedding "
                      "adapter to the head too, whose shapes do not fit, and abort "
                      "(GGML_ASSERT(ggml_can_mul_mat)).")
    nvfp4 = sorted(n for n in names if (types or {}).get(n) == NVFP4)
    if nvfp4:
        warnings.append(f"{len(nvfp4)} targets are NVFP4 ({', '.join(nvfp4[:3])}): llama.cpp "
                        "refuses LoRA on NVFP4 weights that carry a scale tensor.")
    return errors, warnings


def check_targets(shapes: dict[str, tuple[int, ...]], config: LoraConfig,
                  types: dict[str, int] | None = None, *, llamacpp: bool = True) -> list[str]:
    """Decide at the start of a run whether its LoRA targets make an adapter llama.cpp can load.

    Raises ConfigError for a target that matches nothing on this model, naming the model's
    targets (FFN targets of the other layout, e.g. experts on a dense model, are fine when
    another FFN target matched, else a warning), and, with `llamacpp`, for an adapter llama.cpp
    cannot apply (llamacpp_lora_problems). Returns the warnings. The CLI and the window call it
    before a run exists, init_adapter (llamacpp=False: the engine trains any target) and export
    apply the same rule."""
    config.validate()
    available = available_targets(shapes)
    hint = "This model's targets: " + (", ".join(available) or "none") + "."
    absent = [t for t in config.targets if not lora_targets(shapes, LoraConfig(targets=(t,)))]
    missing = [t for t in absent if t not in FFN_TARGETS]
    if missing or len(absent) == len(config.targets):
        tied = "output" in missing and "output.weight" not in shapes
        raise ConfigError(f"No tensor of this model matches the LoRA target(s) "
                          f"{', '.join(missing or absent)}"
                          + (" (its output head is tied to the embedding)" if tied else "")
                          + ".", hint)
    ffn_matched = any(t in FFN_TARGETS and t not in absent for t in config.targets)
    warnings = [] if ffn_matched else [f"The LoRA target {t} matches nothing on this model: "
                                       "skipped." for t in absent]
    if not llamacpp:
        return warnings
    errors, more = llamacpp_lora_problems(lora_targets(shapes, config), shapes, types)
    if errors:
        raise ConfigError(errors[0], "Train without the embeddings target on this model. " + hint)
    return warnings + more


def check_model_targets(model_path: str | os.PathLike, targets) -> list[str]:
    """check_targets for a GGUF model file (reads its header only): raises ConfigError, returns
    the warnings."""
    f = read_gguf(model_path)
    try:
        shapes = {n: t.shape for n, t in f.tensors.items()}
        types = {n: t.ggml_type for n, t in f.tensors.items()}
    finally:
        f.close()
    return check_targets(shapes, LoraConfig(targets=tuple(targets)), types)


def init_adapter(shapes: dict[str, tuple[int, ...]], arch: str, config: LoraConfig) -> LoraAdapter:
    """A fresh adapter: A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming-uniform bound), B = 0,
    so training starts exactly at the base model (the token embedding, as PEFT: A = 0 and B
    random). Float32, seeded. The targets must match the model (check_targets). 3-D expert
    adapters have rank config.expert_rank_for(E); the adapter's one alpha makes their scale
    alpha / that rank (llama.cpp's rule)."""
    check_targets(shapes, config, llamacpp=False)
    targets = lora_targets(shapes, config)
    rng = np.random.default_rng(config.seed)
    adapter = LoraAdapter(alpha=config.stored_alpha, arch=arch)
    for name in targets:
        if name == "token_embd.weight":    # PEFT's embedding init: A = 0, B ~ N(0, 1)
            n_vocab, n_embd = shapes[name]
            a = np.zeros((n_vocab, config.rank), np.float32)
            b = rng.standard_normal((n_embd, config.rank)).astype(np.float32)
        else:
            *experts, out_dim, in_dim = shapes[name]
            rank = config.expert_rank_for(experts[0]) if experts else config.rank
            bound = 1.0 / np.sqrt(in_dim)
            a = rng.uniform(-bound, bound, (*experts, rank, in_dim)).astype(np.float32)
            b = np.zeros((*experts, out_dim, rank), np.float32)
        adapter.tensors[name] = (a, b)
    return adapter


def adapter_on(adapter: LoraAdapter, xp) -> LoraAdapter:
    """The adapter with its arrays on the device of `xp` (the same object for NumPy)."""
    if xp is np:
        return adapter
    tensors = {name: (xp.asarray(a), xp.asarray(b)) for name, (a, b) in adapter.tensors.items()}
    return LoraAdapter(adapter.alpha, tensors, adapter.arch, adapter.path)


def adapter_parameters(adapter: LoraAdapter) -> dict[str, np.ndarray]:
    """The adapter's arrays by gradient name (<tensor>.lora_a / .lora_b), shared, not copied."""
    params = {}
    for base, (a, b) in adapter.tensors.items():
        params[base + ".lora_a"], params[base + ".lora_b"] = a, b
    return params


def adapter_norms(adapter: LoraAdapter, user_scale: float = 1.0) -> dict[str, dict[str, list]]:
    """Per adapted tensor (and per expert for 3-D adapters): ||s B A||_F, ||A||_F, ||B||_F.

    ||B A||_F^2 = trace((B^T B)(A A^T)) uses only (R, R) products, so B @ A is never formed.
    Returns {tensor: {"delta": [...], "a": [...], "b": [...]}} with one entry per expert (one
    entry for a 2-D adapter).
    """
    out = {}
    for name, (a, b) in adapter.tensors.items():
        a, b = to_host(a), to_host(b)                # a GPU run's adapter: computed on the host
        if name == "token_embd.weight":              # A (V, R), B (C, R): delta = B A^T
            a = np.swapaxes(a, -1, -2)
        a3 = a.reshape(-1, *a.shape[-2:]).astype(np.float64)                 # (E, R, in)
        b3 = b.reshape(-1, *b.shape[-2:]).astype(np.float64)                 # (E, out, R)
        gram_b = np.swapaxes(b3, 1, 2) @ b3                                  # (E, R, R)
        gram_a = a3 @ np.swapaxes(a3, 1, 2)                                  # (E, R, R)
        delta_sq = np.einsum("eij,eji->e", gram_b, gram_a)                   # (E,)
        scale = abs(adapter.scale(name, user_scale))
        out[name] = {"delta": (scale * np.sqrt(np.maximum(delta_sq, 0.0))).tolist(),
                     "a": np.linalg.norm(a3.reshape(len(a3), -1), axis=1).tolist(),
                     "b": np.linalg.norm(b3.reshape(len(b3), -1), axis=1).tolist()}
    return out


def save_adapter(adapter: LoraAdapter, path: str | os.PathLike, arch: str | None = None,
                 name: str = "workbench LoRA adapter") -> None:
    """Write the adapter in llama.cpp's GGUF LoRA format (F32 tensors, FLOAT32 alpha).

    Shapes stay as stored (SPEC section 1.3), so `llama --lora` and `load_adapter` read it back.
    """
    arch = arch or adapter.arch
    meta = {"general.architecture": arch, "general.type": "adapter", "general.name": name,
            "adapter.type": "lora", "adapter.lora.alpha": float(adapter.alpha)}
    tensors = {}
    for base, (a, b) in adapter.tensors.items():
        tensors[base + ".lora_a"] = to_host(a).astype(np.float32, copy=False)
        tensors[base + ".lora_b"] = to_host(b).astype(np.float32, copy=False)
    write_gguf(path, meta, tensors, value_types={"adapter.lora.alpha": (6, None)})
