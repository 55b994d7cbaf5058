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

from app.engine.errors import ModelFormatError


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


def load_adapter(path: str | os.PathLike) -> LoraAdapter:
    """Read a GGUF LoRA adapter written by llama.cpp's converter, PEFT tools or the workbench."""
    from app.engine.gguf_io import read_gguf

    f = read_gguf(path)
    name = os.path.basename(str(path))
    meta = f.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise ModelFormatError(
            f"{name} is not a LoRA adapter (general.type={meta.get('general.type')!r}, "
            f"adapter.type={meta.get('adapter.type')!r}).",
            "Pick a GGUF LoRA adapter, e.g. one written by convert_lora_to_gguf.py.")
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
        if base == "token_embd.weight":
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
