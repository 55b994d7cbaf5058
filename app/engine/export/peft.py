"""PEFT interop: our GGUF-named LoRA adapters <-> Hugging Face PEFT `adapter_model.safetensors`.

llama.cpp's `convert_lora_to_gguf.py` (SPEC-llamacpp.md 1.6) maps PEFT modules to GGUF tensors by
running the base model's converter on the LoRA pair. This module is the inverse, and the same
mapping forwards so a round trip is exact:

- module names: `blk.N.attn_q.weight` <-> `model.layers.N.self_attn.q_proj`, per-architecture MoE
  names (Mixtral `block_sparse_moe.experts.E.w1/w2/w3` and `block_sparse_moe.gate`; Qwen2/3-MoE,
  OLMoE and DeepSeek `mlp.experts.E.gate_proj/up_proj/down_proj` and `mlp.gate`; Qwen2-MoE
  `mlp.shared_expert.*` and `mlp.shared_expert_gate`; DeepSeek `mlp.shared_experts.*`), in the
  transformers 4.x layout with one nn.Linear per expert, which is what the converter reads;
- 3-D expert adapters A (E, R, in), B (E, out, R) <-> one module per expert (the converter stacks
  them back on the expert axis);
- `llama` and `deepseek` GGUFs carry the Q/K rows permuted for ggml's NORM RoPE (SPEC 3.2); the
  converter permutes B only, so export un-permutes B and import permutes it again;
- the token embedding: PEFT's `lora_embedding_A` (R, V) is our A transposed; architectures that
  scale embeddings (Gemma 3: x sqrt(n_embd)) scale the LoRA delta too in llama.cpp but not in
  PEFT (the scaled embedding module is PEFT's base layer), so `lora_embedding_B` carries the scale;
- scales: PEFT applies lora_alpha / r per module (`alpha_pattern`/`rank_pattern` for exceptions);
  we write the exact per-tensor scale llama.cpp would use, so no rsLoRA flag is needed;
- import also reads transformers 5 fused-expert adapters (peft >= 0.17 `target_parameters`, e.g.
  `["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]`): each targeted parameter wraps the
  `experts` module once more, the first innermost, so its keys are
  `...experts[.base_layer]*.lora_A/B.weight` (outermost = last parameter). For a parameter of
  shape (E, d1, d2): lora_A (E*r, d1) with the expert slowest, lora_B (d2, E*r) with the expert
  fastest, delta[e] = A[e].T @ B[:, :, e].T of shape (d1, d2) (peft's ParamWrapper). transformers
  5 stores gate_up_proj (E, 2F, C) (gate rows first) and down_proj (E, C, F); they become 3-D
  ffn_gate/up/down_exps adapters of rank r.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from app.engine.errors import ConfigError, ModelFormatError
from app.engine.model.lora import LoraAdapter
from app.engine.runtime.files import atomic_write_bytes, atomic_write_json

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
PREFIX = "base_model.model."

PERMUTED_QK_ARCHS = ("llama", "deepseek")   # converters permute Q/K rows for NORM RoPE

_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}
_DENSE_FFN = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_EXPERTS = {"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
            "ffn_down_exps": "mlp.experts.{e}.down_proj", "ffn_gate_inp": "mlp.gate"}
_MIXTRAL = {"ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
            "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
            "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
            "ffn_gate_inp": "block_sparse_moe.gate"}
_QWEN2MOE_SHARED = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                    "ffn_up_shexp": "mlp.shared_expert.up_proj",
                    "ffn_down_shexp": "mlp.shared_expert.down_proj",
                    "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_DEEPSEEK_SHARED = {"ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                    "ffn_up_shexp": "mlp.shared_experts.up_proj",
                    "ffn_down_shexp": "mlp.shared_experts.down_proj"}

# Per architecture: GGUF tensor kind (blk.N.<kind>.weight) -> module under model.layers.N.
LAYER_MODULES: dict[str, dict[str, str]] = {
    "llama": {**_ATTENTION, **_DENSE_FFN, **_MIXTRAL},
    "qwen2": {**_ATTENTION, **_DENSE_FFN},
    "qwen3": {**_ATTENTION, **_DENSE_FFN},
    "qwen2moe": {**_ATTENTION, **_EXPERTS, **_QWEN2MOE_SHARED},
    "qwen3moe": {**_ATTENTION, **_EXPERTS},
    "olmoe": {**_ATTENTION, **_EXPERTS},
    "deepseek": {**_ATTENTION, **_DENSE_FFN, **_EXPERTS, **_DEEPSEEK_SHARED},
    "gemma3": {**_ATTENTION, **_DENSE_FFN},
}
TOP_MODULES = {"token_embd.weight": "model.embed_tokens", "output.weight": "lm_head"}
EMBEDDING = "token_embd.weight"


@dataclass(frozen=True)
class ModuleRef:
    """Where a PEFT module's LoRA lives in our adapter: a GGUF tensor and, for 3-D expert
    tensors, the expert index."""

    tensor: str
    expert: int | None = None


def module_map(arch: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, ModuleRef]:
    """HF module name -> ModuleRef for every LoRA-able tensor of a model (file order)."""
    kinds = LAYER_MODULES.get(arch)
    if kinds is None:
        raise ConfigError(f"PEFT names for the '{arch}' architecture are not known.",
                          "PEFT export supports: " + ", ".join(LAYER_MODULES) + ".")
    out: dict[str, ModuleRef] = {}
    for name, shape in shapes.items():
        if name in TOP_MODULES:
            out[TOP_MODULES[name]] = ModuleRef(name)
            continue
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight" or parts[2] not in kinds:
            continue
        module = f"model.layers.{parts[1]}.{kinds[parts[2]]}"
        if "{e}" in module:
            if len(shape) != 3:
                continue
            for e in range(shape[0]):
                out[module.format(e=e)] = ModuleRef(name, e)
        else:
            out[module] = ModuleRef(name)
    return out


# ---- the Q/K row permutation of llama-style GGUFs (SPEC 3.2) -----------------------------------

def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF row order -> GGUF row order, as convert_hf_to_gguf's LlamaModel.permute: within each
    head, rows (first half, second half) become interleaved pairs. w: (out, ...)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF row order -> HF row order (the inverse of permute_rows)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def qk_heads(arch: str, tensor: str, n_head: int, n_head_kv: int) -> int | None:
    """Heads to (un)permute B's rows by, or None when the tensor carries no permutation."""
    if arch not in PERMUTED_QK_ARCHS:
        return None
    if tensor.endswith(".attn_q.weight"):
        return n_head
    if tensor.endswith(".attn_k.weight"):
        return n_head_kv
    return None


# ---- export ------------------------------------------------------------------------------------

@dataclass
class PeftExport:
    """What export_peft wrote: files, the adapter config, and notes for the report."""

    files: list[str]
    config: dict
    n_modules: int
    warnings: list[str] = field(default_factory=list)


def _hf_pairs(adapter: LoraAdapter, arch: str, n_head: int, n_head_kv: int, embed_scale: float,
              user_scale: float, modules: dict[str, ModuleRef]):
    """Yield (module, A_hf, B_hf, scale) for every module the adapter covers, in adapter order."""
    by_tensor: dict[str, list[tuple[str, int | None]]] = {}
    for module, ref in modules.items():
        by_tensor.setdefault(ref.tensor, []).append((module, ref.expert))
    for name, (a, b) in adapter.tensors.items():
        if name not in by_tensor:
            raise ConfigError(f"The adapter's tensor {name!r} has no Hugging Face module name for "
                              f"'{arch}'.", "Export this adapter as GGUF instead.")
        scale = adapter.scale(name, user_scale)
        heads = qk_heads(arch, name, n_head, n_head_kv)
        for module, expert in by_tensor[name]:
            if name == EMBEDDING:
                # ours: A (V, R), B (C, R), delta added before the embedding scale
                yield module, a.T, b * np.float32(embed_scale), scale
                continue
            ae, be = (a, b) if expert is None else (a[expert], b[expert])
            if heads is not None:
                be = unpermute_rows(be, heads)
            yield module, ae, be, scale


def export_peft(adapter: LoraAdapter, out_dir: str | os.PathLike, *, arch: str, n_head: int,
                n_head_kv: int, embed_scale: float, shapes: dict[str, tuple[int, ...]],
                user_scale: float = 1.0, base_model: str = "", dtype: str = "f32") -> PeftExport:
    """Write `adapter_model.safetensors` and `adapter_config.json` into out_dir (atomically,
    as new files are: 0666 less the umask; safetensors' own save_file makes them 0600)."""
    from safetensors.numpy import save


    if dtype not in ("f32", "f16"):
        raise ConfigError(f"PEFT export writes f32 or f16 tensors, not {dtype}.",
                          "Use --type f32 or f16 for PEFT.")
    np_dtype = np.float32 if dtype == "f32" else np.float16
    modules = module_map(arch, shapes)
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for module, a_hf, b_hf, scale in _hf_pairs(adapter, arch, n_head, n_head_kv, embed_scale,
                                                user_scale, modules):
        key = PREFIX + module
        if module == TOP_MODULES[EMBEDDING]:
            tensors[key + ".lora_embedding_A"] = np.ascontiguousarray(a_hf, np_dtype)
            tensors[key + ".lora_embedding_B"] = np.ascontiguousarray(b_hf, np_dtype)
        else:
            tensors[key + ".lora_A.weight"] = np.ascontiguousarray(a_hf, np_dtype)
            tensors[key + ".lora_B.weight"] = np.ascontiguousarray(b_hf, np_dtype)
        rank = int(b_hf.shape[-1])
        ranks[module], alphas[module] = rank, float(scale) * rank
    if not ranks:
        raise ConfigError("The adapter is empty: nothing to export.")
    first = next(iter(ranks))
    r, lora_alpha = ranks[first], alphas[first]
    rank_pattern = {m: v for m, v in ranks.items() if v != r}
    alpha_pattern = {m: v for m, v in alphas.items() if not math.isclose(v, lora_alpha,
                                                                         rel_tol=1e-12)}
    leaves = sorted({m.rsplit(".", 1)[-1] for m in ranks})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": r, "lora_alpha": lora_alpha, "target_modules": leaves, "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern, "revision": None,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights, cfg_path = out / WEIGHTS_NAME, out / CONFIG_NAME
    atomic_write_bytes(weights, save(tensors, metadata={"format": "pt"}))
    atomic_write_json(cfg_path, config)
    warnings = []
    if EMBEDDING in adapter.tensors:
        warnings.append("lora_embedding_A has the GGUF vocabulary's width; if the Hugging Face "
                        "model pads its embedding (Gemma 3 does), pad it with zero columns.")
    if arch == "deepseek" and any(t.endswith("ffn_gate_inp.weight") for t in adapter.tensors):
        warnings.append("DeepSeek's router (mlp.gate, a custom MoEGate) is not an nn.Linear: "
                        "PEFT cannot attach its adapter, convert_lora_to_gguf.py can.")
    if any(len(a.shape) == 3 for a, _ in adapter.tensors.values()):
        warnings.append("Expert adapters are written per expert (the transformers 4.x module "
                        "layout convert_lora_to_gguf.py reads; transformers 5 maps them onto "
                        "its fused experts). Import reads both layouts.")
    return PeftExport([str(weights), str(cfg_path)], config, len(ranks), warnings)


# ---- import ------------------------------------------------------------------------------------

_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B",
             ".lora_embedding_A": "A", ".lora_embedding_B": "B"}
# transformers 5 fused expert parameters -> the GGUF expert tensors they hold (in row order)
FUSED_EXPERTS = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "down_proj": ("ffn_down_exps",)}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _fused_parameter(module: str, config: dict) -> str | None:
    """For a `...experts[.base_layer]*` module of a target_parameters adapter, the full name of
    the parameter its LoRA targets (peft nests one wrapper per parameter, the first innermost);
    None for other modules."""
    depth = 0
    while module.endswith(".base_layer"):
        module, depth = module[:-len(".base_layer")], depth + 1
    params = [f"{module}.{p.rsplit('.', 1)[-1]}" for p in config.get("target_parameters") or []
              if f"{module}.{p.rsplit('.', 1)[-1]}".endswith(p)]
    if not params or depth >= len(params):
        return None
    return params[len(params) - 1 - depth]


def _fused_pairs(param: str, a: np.ndarray, b: np.ndarray, rank: int,
                 shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Our 3-D (A, B) pairs, by GGUF tensor, of one fused-expert parameter's lora_A/lora_B."""
    layer = _LAYER.search(param)
    kinds = FUSED_EXPERTS.get(param.rsplit(".", 1)[-1])
    names = [f"blk.{layer.group(1)}.{k}.weight" for k in kinds] if layer and kinds else []
    if not names or any(n not in shapes or len(shapes[n]) != 3 for n in names):
        raise ModelFormatError(f"The PEFT adapter targets the parameter {param!r}, which has no "
                               "expert tensor in this model.",
                               "Fused-expert adapters (target_parameters) import onto a "
                               "mixture-of-experts model with the same layers.")
    n_expert, rows, cols = shapes[names[0]][0], sum(shapes[n][1] for n in names), shapes[names[0]][2]
    if a.shape[0] != rank * n_expert or b.shape[1] != a.shape[0]:
        raise ModelFormatError(f"{param}: lora_A {a.shape} and lora_B {b.shape} do not hold "
                               f"{n_expert} experts of rank {rank} (the config's).")
    a3 = a.reshape(n_expert, rank, a.shape[1])              # (E, r, d1)
    b3 = b.reshape(b.shape[0], rank, n_expert)              # (d2, r, E)
    if (a.shape[1], b.shape[0]) == (rows, cols):            # transformers 5: (E, out, in)
        bb, aa = a3.transpose(0, 2, 1), b3.transpose(2, 1, 0)
    elif (a.shape[1], b.shape[0]) == (cols, rows):          # (E, in, out), e.g. GPT-OSS
        bb, aa = b3.transpose(2, 0, 1), a3
    else:
        raise ModelFormatError(f"{param}: lora_A {a.shape} and lora_B {b.shape} do not fit the "
                               f"model's experts ({n_expert} x {rows} x {cols}).")
    out, start = {}, 0
    for n in names:
        stop = start + shapes[n][1]
        out[n] = (np.ascontiguousarray(aa, np.float32),
                  np.ascontiguousarray(bb[:, start:stop], np.float32))
        start = stop
    return out


def read_peft(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """(adapter_config, tensors by key) of a PEFT adapter folder (or its safetensors file)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    p = Path(path)
    folder = p if p.is_dir() else p.parent
    weights = folder / WEIGHTS_NAME if p.is_dir() else p
    cfg_path = folder / CONFIG_NAME
    for f in (weights, cfg_path):
        if not f.is_file():
            raise ModelFormatError(f"{folder} has no {f.name}.",
                                   "A PEFT adapter folder holds adapter_config.json and "
                                   "adapter_model.safetensors.")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{cfg_path} is not valid JSON: {e}.") from None
    if not isinstance(config, dict):
        raise ModelFormatError(f"{cfg_path} is not a JSON object.")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelFormatError(f"{weights} is not a readable safetensors file: {e}.") from None
    return config, tensors


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern/alpha_pattern lookup: a key matches a module name ending with it."""
    for key, value in (patterns or {}).items():
        try:
            found = re.fullmatch(rf"(.*\.)?({key})", module) is not None
        except re.error:
            found = module.endswith("." + key)
        if module == key or found:
            return value
    return default


def _split_key(key: str) -> tuple[str, str]:
    """'base_model.model.<module>.lora_A.weight' -> (module, 'A')."""
    k = key.removeprefix(PREFIX)
    k = re.sub(r"\.(lora_[AB]|lora_embedding_[AB])\.default(?=\.weight$|$)", r".\1", k)
    for suffix, half in _SUFFIXES.items():
        if k.endswith(suffix):
            return k[:-len(suffix)], half
    raise ModelFormatError(f"PEFT tensor {key!r} is not a LoRA A/B matrix.",
                           "Only LoRA adapters (lora_A/lora_B) can be imported.")


def import_peft(path: str | os.PathLike, *, arch: str, n_head: int, n_head_kv: int,
                embed_scale: float, shapes: dict[str, tuple[int, ...]]) -> LoraAdapter:
    """A PEFT LoRA adapter as our GGUF-named adapter for this base model (exact inverse of
    export_peft). Per-module PEFT scales (lora_alpha / r, rsLoRA, alpha_pattern) are folded
    into one alpha; a module whose scale differs from the first gets it folded into its B.
    Per-expert modules stack into 3-D adapters; experts without a module get zero matrices."""
    config, tensors = read_peft(path)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ModelFormatError(f"The PEFT adapter is {config.get('peft_type')}, not LoRA.")
    if config.get("use_dora"):
        raise ModelFormatError("DoRA adapters cannot be expressed in llama.cpp's LoRA format.")
    if config.get("fan_in_fan_out"):
        raise ModelFormatError("fan_in_fan_out adapters (GPT-2 Conv1D) are not supported.")
    modules = module_map(arch, shapes)
    halves: dict[str, dict[str, np.ndarray]] = {}
    fused: dict[str, str] = {}               # key module -> fused parameter it targets
    for key, value in tensors.items():
        module, half = _split_key(key)
        param = _fused_parameter(module, config) if module not in modules else None
        if param is not None:
            fused[module] = param
        elif module not in modules:
            example = next(iter(modules), "none")
            raise ModelFormatError(
                f"PEFT module {module!r} does not exist in this '{arch}' model (its modules "
                f"are named like {example!r}).",
                "The adapter's layout is one the workbench does not map (PEFT's "
                "target_parameters are read for transformers 5 fused experts only), or it was "
                "made for a model of another architecture or size."
                if ".base_layer" in module or config.get("target_parameters") else
                "The adapter was made for a model of another architecture or size: import it "
                "with the base model it was trained on.")
        halves.setdefault(module, {})[half] = np.asarray(value, dtype=np.float32)
    if not halves:
        raise ModelFormatError("The PEFT adapter has no tensors.")
    r_default = int(config.get("r", 8))
    alpha_default = float(config.get("lora_alpha", r_default))
    rslora = bool(config.get("use_rslora", False))
    scales: dict[str, float] = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ModelFormatError(f"PEFT module {module!r} has only lora_{''.join(pair)}.")
        name = fused.get(module, module)
        r = int(_pattern_value(config.get("rank_pattern"), name, r_default))
        rank = r if module in fused else int(pair["B"].shape[-1])   # fused: _fused_pairs checks
        if r != rank:
            raise ModelFormatError(f"PEFT module {module!r} has rank {rank} but the config "
                                   f"says {r}.")
        alpha = float(_pattern_value(config.get("alpha_pattern"), name, alpha_default))
        scales[module] = alpha / (math.sqrt(rank) if rslora else rank)
    first = next(iter(halves))
    gguf_alpha = scales[first] * int(_pattern_value(config.get("rank_pattern"),
                                                    fused.get(first, first), r_default))
    if gguf_alpha == 0:
        raise ModelFormatError("The PEFT adapter's lora_alpha is 0 (it would do nothing).")

    adapter = LoraAdapter(alpha=gguf_alpha, arch=arch, path=str(path))
    grouped: dict[str, dict[int | None, tuple[np.ndarray, np.ndarray]]] = {}
    for module, pair in halves.items():
        a, b = pair["A"], pair["B"]
        if module in fused:
            r = int(_pattern_value(config.get("rank_pattern"), fused[module], r_default))
            for tensor, (fa, fb) in _fused_pairs(fused[module], a, b, r, shapes).items():
                fold = scales[module] * fb.shape[-1] / gguf_alpha
                adapter.tensors[tensor] = (fa, fb * np.float32(fold) if fold != 1.0 else fb)
            continue
        ref = modules[module]
        fold = scales[module] * b.shape[-1] / gguf_alpha
        if fold != 1.0:
            b = b * np.float32(fold)
        if ref.tensor == EMBEDDING:
            a, b = a.T, b / np.float32(embed_scale)
        else:
            heads = qk_heads(arch, ref.tensor, n_head, n_head_kv)
            if heads is not None:
                b = permute_rows(b, heads)
        grouped.setdefault(ref.tensor, {})[ref.expert] = (np.ascontiguousarray(a),
                                                          np.ascontiguousarray(b))
    order = {m.tensor: i for i, m in enumerate(modules.values())}
    for tensor in sorted(grouped, key=order.get):
        parts = grouped[tensor]
        if None in parts:
            adapter.tensors[tensor] = parts[None]
            continue
        n_expert = shapes[tensor][0]
        ranks = {a.shape[0] for a, _ in parts.values()}
        if len(ranks) != 1:
            raise ModelFormatError(f"The experts of {tensor} have different ranks {sorted(ranks)};"
                                   " a 3-D GGUF adapter needs one rank.")
        a0, b0 = next(iter(parts.values()))
        a3 = np.zeros((n_expert, *a0.shape), np.float32)   # experts without an adapter: zero
        b3 = np.zeros((n_expert, *b0.shape), np.float32)
        for e, (a, b) in parts.items():
            a3[e], b3[e] = a, b
        adapter.tensors[tensor] = (a3, b3)
    return adapter
