"""Exports: what users take away from a run, each verified before we call it good.

Formats (`export(source, to, out)`):

- `gguf-lora`: llama.cpp's GGUF LoRA adapter (SPEC-llamacpp.md section 1) in F32, F16, BF16 or
  Q8_0; rsLoRA and the user's scale are folded into `adapter.lora.alpha` so that llama.cpp's
  `alpha / rank` gives the trained scale at `--lora` (user scale 1).
- `merged`: the base model with `scale * B @ A` added to every adapted tensor and fully trained
  tensors in place, all metadata kept. Changed tensors are stored at a precision that keeps the
  adapter's effect (F16 by default, or the chosen type; F32 tensors stay F32; re-quantizing
  them to the base's Q4_K-like types would undo much of it), untouched tensors are copied byte
  for byte. Processed tensor by tensor (expert by expert). It is good only when its mean NLL on
  a held-out sample is within 1% of base + adapter (verify.nll_check).
- `peft`: Hugging Face PEFT `adapter_model.safetensors` + `adapter_config.json` (app.engine.export.peft).
- `ollama`: a folder with a `Modelfile` and the GGUF adapter (FROM the base, ADAPTER) or, for
  architectures Ollama runs on its own engine (which refuses adapters) and for fully trained
  tensors, the merged model (FROM it); the TEMPLATE of the chat format (ollama_templates) and
  its stop strings.

What to export is an `ExportSource`: a run directory (its newest checkpoint), a live
`TrainSession`, or an adapter file (GGUF, or a PEFT folder: import) with its base model.
Every export is read back and checked (app.engine.export.verify); the report is returned, and written
as JSON next to the export and into the run directory's `exports/`.

Nothing is written over unasked (`check_export_destination`, the rule of every writer in
app.engine.runs.destinations): an existing destination is replaced only with `overwrite=True`,
the export's own inputs and the run's (its model, data, files) never. Files and folders are
written and verified beside the destination, then renamed into place: a failed export leaves
what was there untouched, and one that fails verification goes aside to
`<name>.failed-verification<ext>` instead (the report's `path` says where, `moved_from` where
it was asked for).
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from app.engine.errors import ConfigError, EngineError, ModelFormatError
from app.engine.export.evaluate import mean_nll
from app.engine.export.ollama_templates import OllamaTemplate, ollama_template
from app.engine.export.peft import CONFIG_NAME, WEIGHTS_NAME, export_peft, import_peft, read_peft
from app.engine.export.verify import (HELD_OUT_TEXT, MAX_HELD_OUT, Check, ExportReport,
                                      TensorComparison, add_logit_checks, engine_logits,
                                      llamacpp_check, nll_check, verification_prompt)
from app.engine.io.gguf import (BLOCK_SIZES, GGUFFile, dequantize, quantize, read_gguf, type_name,
                                write_gguf)
from app.engine.model.card import human_bytes
from app.engine.model.lora import (LoraAdapter, LoraConfig, check_adapter_fits,
                                   llamacpp_lora_problems, load_adapter, tensor_kind)
from app.engine.model.transformer import Model, load_model
from app.engine.runs.destinations import (FINAL_ADAPTER, DestinationExists, check_destination,
                                          failed_path, make_parent, run_inputs)
from app.engine.runs.kinds import kind_of
from app.engine.runs.rundir import RunDir, best_checkpoint
from app.engine.runtime.files import atomic_write_bytes, storage_error
from app.engine.training.checkpoints import (DamagedCheckpoint, load_checkpoint, newest_intact,
                                             own_folder)

FORMATS = ("gguf-lora", "merged", "peft", "ollama")
ADAPTER_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8}   # also the types of merged tensors
DEFAULT_TYPES = {"merged": "f16"}                                 # else f32
F32, F16 = 0, 1
CHUNK_ELEMENTS = 1 << 24         # float32 values per merge chunk (64 MB)
MODELFILE = "Modelfile"
OLLAMA_ADAPTER, OLLAMA_MODEL = "adapter.gguf", "model.gguf"
FOLDER_FILES = {"peft": {WEIGHTS_NAME, CONFIG_NAME},       # what a folder export holds
                "ollama": {MODELFILE, OLLAMA_ADAPTER, OLLAMA_MODEL}}
FINETUNED = " (fine-tuned)"
# Architectures Ollama runs on its own engine, which refuses any ADAPTER ("loras are not yet
# implemented"): ollama/ollama fs/ggml/ggml.go, KV.OllamaEngineRequired.
OLLAMA_ENGINE_ARCHS = frozenset((
    "bert", "deepseek2", "deepseekocr", "gemma3", "gemma3n", "gptoss", "gpt-oss", "llama4",
    "mistral3", "mllama", "nemotron_h", "nemotron_h_moe", "nomic-bert", "olmo3", "qwen25vl",
    "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "qwen3vl", "qwen3vlmoe",
    "glm4moelite", "glmocr", "lfm2", "lfm2moe"))


def _close(f: GGUFFile) -> None:
    """Close a file's memory map; if a view of it is still alive, leave that to the GC."""
    try:
        f.close()
    except BufferError:
        pass


# ---- what to export ----------------------------------------------------------------------------

@dataclass
class ExportSource:
    """A trained result: the base model, a LoRA adapter and/or fully trained tensors."""

    model_path: str
    adapter: LoraAdapter | None = None
    full: dict[str, np.ndarray] = field(default_factory=dict)   # GGUF name -> float32 tensor
    run_dir: str | None = None
    checkpoint: str | None = None
    adapter_path: str | None = None
    warnings: list[str] = field(default_factory=list)   # e.g. a damaged checkpoint skipped

    def describe(self) -> dict:
        def absolute(p):
            return str(Path(p).expanduser().absolute()) if p else None
        return {"model": absolute(self.model_path), "run_dir": absolute(self.run_dir),
                "checkpoint": absolute(self.checkpoint), "adapter": absolute(self.adapter_path),
                "alpha": self.adapter.alpha if self.adapter is not None else None,
                "adapted_tensors": len(self.adapter.tensors) if self.adapter is not None else 0,
                "full_tensors": sorted(self.full)}

    def inputs(self) -> list[tuple[str, Path]]:
        """What the export reads, and what its run reads and keeps (runs.destinations.run_inputs:
        model, data, reward files, its own files), labelled: never written over."""
        found = [("the base model", self.model_path), ("the adapter", self.adapter_path),
                 ("the checkpoint", self.checkpoint)]
        labelled = [(label, Path(p).expanduser().absolute()) for label, p in found if p]
        return (run_inputs(self.run_dir) if self.run_dir else []) + labelled


def import_adapter(path: str | os.PathLike, model: Model) -> LoraAdapter:
    """An existing adapter for `model`: a GGUF LoRA file (ours or llama.cpp-converted) or a PEFT
    folder (adapter_config.json + adapter_model.safetensors), checked against the model.
    The result can be evaluated (Model.logits), merged, exported, or trained further."""
    p = Path(path)
    cfg = model.config
    if p.is_dir() or p.suffix == ".safetensors":
        adapter = import_peft(p, arch=cfg.arch, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv,
                              embed_scale=cfg.embed_scale, shapes=model.tensor_shapes)
    else:
        adapter = load_adapter(p)
    check_adapter_fits(adapter, cfg.arch, model.tensor_shapes)
    adapter.arch = cfg.arch
    return adapter


def source_from_adapter(adapter_path: str | os.PathLike, model_path: str | os.PathLike,
                        model: Model | None = None) -> ExportSource:
    model = model or load_model(model_path)
    adapter = import_adapter(adapter_path, model)
    return ExportSource(str(model_path), adapter, adapter_path=str(adapter_path))


def source_from_session(session, run_dir: str | os.PathLike | None = None) -> ExportSource:
    """The live state of a TrainSession (its adapter and fully trained tensors, not copied)."""
    return ExportSource(session.model.path, session.adapter, dict(session.full),
                        run_dir=str(run_dir) if run_dir else None)


def source_from_run(run_dir: str | os.PathLike, step: int | str | None = None,
                    model_path: str | os.PathLike | None = None) -> ExportSource:
    """A run directory's newest checkpoint (or `step`; "best": its best one, else the newest),
    else its final adapter.gguf."""
    run = RunDir(run_dir)
    raw = run.config()
    # every kind's config has the model, train and adapter fields read here
    config = kind_of(raw, str(run.config_path)).config_class.from_dict(raw)
    model_path = str(model_path or config.model)
    if step == "best":
        best = best_checkpoint(run.path)
        step = best[0] if best else None
    warnings = []
    if step is not None:
        checkpoint = _load_step(run, step)
    else:
        checkpoint, damaged = newest_intact(run.checkpoints_dir)
        warnings = [f"checkpoint {bad.name} is damaged ({why}); exporting "
                    + (checkpoint.path.name + ", the newest intact one" if checkpoint else
                       "the run's adapter.gguf") for bad, why in damaged]
    if checkpoint is None:
        final = run.path / FINAL_ADAPTER
        if not final.is_file():
            raise ConfigError(f"The run {run.path} has no "
                              + ("intact checkpoint" if warnings else "checkpoint yet")
                              + ": nothing to export.",
                              "; ".join(warnings) or "Export after the run has saved a "
                              "checkpoint.")
        return ExportSource(model_path, load_adapter(final), run_dir=str(run.path),
                            adapter_path=str(final), warnings=warnings)
    ckpt = checkpoint.path
    trainable = checkpoint.state["trainable"]
    halves: dict[str, dict[str, np.ndarray]] = {}
    full = {}
    for key, value in trainable.items():
        base, _, suffix = key.rpartition(".")
        if suffix in ("lora_a", "lora_b"):
            halves.setdefault(base, {})[suffix] = np.asarray(value, np.float32)
        else:
            full[key] = np.asarray(value, np.float32)
    adapter = None
    if halves:
        tensors = {b: (p["lora_a"], p["lora_b"]) for b, p in halves.items()}
        adapter = LoraAdapter(alpha=_run_alpha(run, config, tensors), tensors=tensors)
    return ExportSource(model_path, adapter, full, run_dir=str(run.path), checkpoint=str(ckpt),
                        warnings=warnings)


def _load_step(run: RunDir, step: int | str):
    """Checkpoint `step` of the run; absent or damaged, a CheckpointError (ConfigError) whose
    hint names the newest intact step to export instead (`export --checkpoint STEP`)."""
    ckpt = run.checkpoints_dir / f"step-{step}"
    try:
        if not ckpt.is_dir():
            raise ConfigError(f"The run has no checkpoint at step {step}.")
        return load_checkpoint(ckpt)
    except (ConfigError, DamagedCheckpoint) as e:
        newest, _ = newest_intact(run.checkpoints_dir)
        e.hint = (f"Export another checkpoint: workbench export {run.path} --checkpoint STEP "
                  f"(the newest intact one is step {newest.step}; see {run.checkpoints_dir})."
                  if newest else f"No checkpoint in {run.checkpoints_dir} is intact.")
        raise


def _run_alpha(run, config, tensors) -> float:
    """The alpha a run's adapter is applied with (rsLoRA folded, as TrainSession stores it)."""
    if not config.adapter:
        rank = int(next(iter(tensors.values()))[1].shape[-1])
        tc = config.train
        return LoraConfig(rank=rank, alpha=tc.lora_alpha, rslora=tc.rslora).stored_alpha
    try:                                    # the run continued an existing adapter: its alpha
        return load_adapter(config.adapter).alpha
    except EngineError:
        final = run.path / FINAL_ADAPTER  # else the one the run saved with the same alpha
        if not final.is_file():
            raise ConfigError(f"The run continued {config.adapter}, which cannot be read, so "
                              "its alpha is unknown.", "Put the adapter file back.") from None
        return load_adapter(final).alpha


# ---- GGUF LoRA adapter -------------------------------------------------------------------------

def fold_scale(adapter: LoraAdapter, user_scale: float) -> LoraAdapter:
    """The adapter whose llama.cpp scale at user scale 1 equals `adapter`'s at `user_scale`:
    the scale goes into alpha (or, for an alpha-0 adapter with mixed ranks, into B)."""
    if not math.isfinite(user_scale) or user_scale == 0:
        raise ConfigError(f"The export scale must be a non-zero number, got {user_scale}.",
                          "A scale of 0 would export an adapter that does nothing.")
    if adapter.alpha:
        return LoraAdapter(adapter.alpha * user_scale, dict(adapter.tensors), adapter.arch)
    if user_scale == 1.0:
        return adapter
    ranks = {adapter.rank(n) for n in adapter.tensors}
    if len(ranks) == 1:   # alpha 0 means scale = user scale: alpha = scale * rank says the same
        return LoraAdapter(user_scale * ranks.pop(), dict(adapter.tensors), adapter.arch)
    scaled = {n: (a, b * np.float32(user_scale)) for n, (a, b) in adapter.tensors.items()}
    return LoraAdapter(0.0, scaled, adapter.arch)


def adapter_tensor_type(base: str, array: np.ndarray, wanted: int) -> int:
    """The stored type of one adapter matrix: the wanted type; F32 for router adapters (as
    convert_hf_to_gguf keeps ffn_gate_inp F32: a rounded router flips expert choices); F16
    when a Q8_0 row does not fill whole blocks (as convert_lora_to_gguf.py falls back)."""
    if tensor_kind(base) == "ffn_gate_inp":
        return F32
    block = BLOCK_SIZES[wanted][0]
    return wanted if array.shape[-1] % block == 0 else F16


def round_to_type(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """x as it reads back after being stored as ggml_type."""
    if ggml_type == F32:
        return np.asarray(x, np.float32)
    return np.reshape(dequantize(quantize(x, ggml_type), ggml_type), x.shape)


def rounded_adapter(adapter: LoraAdapter, types) -> LoraAdapter:
    """The adapter as stored: alpha as FLOAT32, A/B rounded to types[<base>.lora_a/b] (a dict,
    or one type for all)."""
    def t(key):
        return types.get(key, F32) if isinstance(types, dict) else types
    tensors = {n: (round_to_type(a, t(n + ".lora_a")), round_to_type(b, t(n + ".lora_b")))
               for n, (a, b) in adapter.tensors.items()}
    return LoraAdapter(float(np.float32(adapter.alpha)), tensors, adapter.arch)


def write_adapter_gguf(adapter: LoraAdapter, path: str | os.PathLike, *, arch: str,
                       adapter_type: str = "f32", name: str = "LoRA adapter") -> dict[str, int]:
    """Write `adapter` (scale already folded) in llama.cpp's GGUF LoRA format; returns the
    stored type of every tensor (`<base>.lora_a` / `.lora_b`)."""
    if adapter_type not in ADAPTER_TYPES:
        raise ConfigError(f"Unknown adapter type {adapter_type!r}.",
                          "Use one of: " + ", ".join(ADAPTER_TYPES) + ".")
    wanted = ADAPTER_TYPES[adapter_type]
    meta = {"general.architecture": arch, "general.type": "adapter", "general.name": name,
            "adapter.type": "lora", "adapter.lora.alpha": float(adapter.alpha)}
    tensors, types = {}, {}
    for base, (a, b) in adapter.tensors.items():
        for suffix, arr in (("lora_a", a), ("lora_b", b)):
            t = adapter_tensor_type(base, arr, wanted)
            types[f"{base}.{suffix}"] = t
            tensors[f"{base}.{suffix}"] = (quantize(arr, t), t)
    write_gguf(path, meta, tensors, value_types={"adapter.lora.alpha": (6, None)})
    return types


def verify_gguf_lora(path: str | os.PathLike, model: Model, live: LoraAdapter,
                     user_scale: float, tokens, report: ExportReport, *,
                     llamacpp: bool | None = None, prefix: str = "") -> None:
    """Re-read a GGUF LoRA export and compare it with the live adapter at `user_scale`."""
    cfg = model.config
    f = read_gguf(path)
    try:
        meta, vt = f.metadata, f.value_types
        problems = []
        for key, want in (("general.type", "adapter"), ("adapter.type", "lora"),
                          ("general.architecture", cfg.arch)):
            if meta.get(key) != want:
                problems.append(f"{key} is {meta.get(key)!r}, expected {want!r}")
        if vt.get("adapter.lora.alpha") != (6, None):
            problems.append("adapter.lora.alpha is not a FLOAT32")
        stored_types = {n: t.ggml_type for n, t in f.tensors.items()}
    finally:
        _close(f)
    report.add(Check(prefix + "format", not problems, "; ".join(problems) or
                     f"llama.cpp LoRA metadata, alpha {meta.get('adapter.lora.alpha')!r}, "
                     f"{len(stored_types)} tensors"))
    if problems:
        return
    try:
        reread = load_adapter(path)
        check_adapter_fits(reread, cfg.arch, model.tensor_shapes)
        if set(reread.tensors) != set(live.tensors):
            missing = sorted(set(live.tensors) ^ set(reread.tensors))
            raise ModelFormatError(f"adapted tensors differ from the live adapter: {missing[:5]}")
    except ModelFormatError as e:
        report.add(Check(prefix + "shapes", False, e.message))
        return
    report.add(Check(prefix + "shapes", True, f"{len(reread.tensors)} adapted tensors, names "
                     "and shapes fit the base model"))
    intended = fold_scale(live, user_scale)
    bad_scales = [n for n in live.tensors
                  if not math.isclose(reread.scale(n), intended.scale(n), rel_tol=1e-6)]
    report.add(Check(prefix + "scale", not bad_scales,
                     f"llama.cpp's scale differs from the trained one for {bad_scales[:3]}"
                     if bad_scales else f"alpha {reread.alpha:g}: llama.cpp's alpha/rank at user "
                     f"scale 1 gives the trained scale at {user_scale:g}"))
    cmp = TensorComparison(prefix + "tensors")   # B compared with its scale: s B as applied
    for name, (a, b) in live.tensors.items():
        ra, rb = reread.tensors[name]
        cmp.add(name + ".lora_a", ra, a, stored_types[name + ".lora_a"])
        cmp.add(name + ".lora_b (scaled)", rb * np.float32(reread.scale(name)),
                b * np.float32(live.scale(name, user_scale)), stored_types[name + ".lora_b"])
    report.add(cmp.check())
    plain = dict(llamacpp_numerics=False)   # engine self-consistency: float32, as trained
    got = model.logits(tokens, adapter=reread, adapter_scale=1.0, **plain)
    live_logits = model.logits(tokens, adapter=live, adapter_scale=user_scale, **plain)
    rounded = sorted({type_name(t) for t in stored_types.values()} - {"F32"})
    intent = None
    if rounded:
        intent = model.logits(tokens, adapter=rounded_adapter(intended, stored_types), **plain)
    add_logit_checks(report, prefix, got, live_logits, _base(model, tokens, intent),
                     "the live adapter", intent, "/".join(rounded))
    types = {t.ggml_type for t in model.gguf.tensors.values()} | set(stored_types.values())
    report.add(llamacpp_check(model.path, tokens, got, lora_path=str(path), weight_types=types,
                              enabled=llamacpp, name=prefix + "llamacpp"))


def _base(model: Model, tokens, intent):
    """The base model's logits, needed (for the size of the trained change) only when the
    export is compared with the live result directly (intent None)."""
    return model.logits(tokens, llamacpp_numerics=False) if intent is None else None


# ---- merged model ------------------------------------------------------------------------------

def merged_type(source_type: int, row_len: int, wanted: int) -> int:
    """The stored type of a changed tensor: F32 stays F32; else the wanted type, or F16 when
    its blocks do not divide the row."""
    if source_type == F32:
        return F32
    return wanted if row_len % BLOCK_SIZES[wanted][0] == 0 else F16


def merged_size(model_path: str | os.PathLike, changed, merge_type: str) -> tuple[int, int]:
    """(size of the merged file, size of the base file) in bytes, before writing it."""
    f = read_gguf(model_path)
    try:
        grow = 0
        for name in changed:
            info = f.tensors[name]
            t = merged_type(info.ggml_type, info.shape[-1], ADAPTER_TYPES[merge_type])
            block, nbytes = BLOCK_SIZES[t]
            grow += info.n_elements // block * nbytes - info.nbytes
    finally:
        _close(f)
    base = os.path.getsize(model_path)
    return base + grow, base


GGUF_ALIGNMENT = 32
PEFT_TENSOR_HEADER = 120     # safetensors' JSON entry of one tensor (name, dtype, shape, offsets)
TEXT_FILE_ALLOWANCE = 640    # adapter_config.json, a Modelfile: about 500 to 700 bytes


def _gguf_size(metadata: dict, tensors: list[tuple[str, int, int]]) -> int:
    """Bytes of the GGUF (v3) file write_gguf writes: the header, `metadata` (str or 4-byte
    numbers), the infos of `tensors` ((name, n_dims, data bytes)), each data block aligned."""
    def pad(n: int) -> int:
        return -(-n // GGUF_ALIGNMENT) * GGUF_ALIGNMENT
    head = 24 + sum(8 + len(k.encode()) + 4 + (8 + len(v.encode()) if isinstance(v, str) else 4)
                    for k, v in metadata.items())
    head += sum(8 + len(name.encode()) + 4 + 8 * n_dims + 4 + 8 for name, n_dims, _ in tensors)
    return pad(head) + sum(pad(nbytes) for _, _, nbytes in tensors)


def _adapter_gguf_size(adapter: LoraAdapter, arch: str, base_name: str, adapter_type: str) -> int:
    """What write_adapter_gguf writes for `adapter` (the same per-tensor types)."""
    wanted = ADAPTER_TYPES[adapter_type]
    meta = {"general.architecture": arch, "general.type": "adapter",
            "general.name": f"{base_name} LoRA", "adapter.type": "lora", "adapter.lora.alpha": 0.0}
    tensors = []
    for base, (a, b) in adapter.tensors.items():
        for suffix, arr in (("lora_a", a), ("lora_b", b)):
            block, nbytes = BLOCK_SIZES[adapter_tensor_type(base, arr, wanted)]
            tensors.append((f"{base}.{suffix}", arr.ndim, arr.size // block * nbytes))
    return _gguf_size(meta, tensors)


def checked_format(to: str, adapter_type: str | None) -> str:
    """The tensor type an export `to` writes (`adapter_type`, else the format's default); a
    ConfigError for an unknown format or type."""
    if to not in FORMATS:
        raise ConfigError(f"Unknown export format {to!r}.", "Use one of: " + ", ".join(FORMATS))
    adapter_type = adapter_type or DEFAULT_TYPES.get(to, "f32")
    if adapter_type not in ADAPTER_TYPES:
        raise ConfigError(f"Unknown adapter type {adapter_type!r}.",
                          "Use one of: " + ", ".join(ADAPTER_TYPES) + ".")
    return adapter_type


def expected_export_size(source: ExportSource, to: str, adapter_type: str | None = None) -> int:
    """The bytes a `to` export of `source` will write, before writing it (the window shows it).
    GGUF LoRA: exact from the adapter's shapes and the stored types; merged: `merged_size`
    (the base's file, the changed tensors at their new type); PEFT: the tensors at f32/f16 plus
    an allowance for the headers (experts are written one by one) and adapter_config.json;
    Ollama: its adapter or merged model plus the Modelfile. Reads only the base's header.
    Raises ConfigError as `export` does when the format cannot carry the source."""
    adapter_type = checked_format(to, adapter_type)
    f = read_gguf(source.model_path)
    try:
        arch = str(f.metadata.get("general.architecture", "unknown"))
        base_name = f.metadata.get("general.name") or Path(source.model_path).stem
    finally:
        _close(f)
    changed = set(source.full) | set(source.adapter.tensors if source.adapter else ())
    if to == "merged":
        return merged_size(source.model_path, changed, adapter_type)[0]
    if to == "ollama":
        if arch in OLLAMA_ENGINE_ARCHS or source.full:      # as _export_ollama decides
            merge_type = DEFAULT_TYPES["merged"] if adapter_type == "f32" else adapter_type
            size = merged_size(source.model_path, changed, merge_type)[0]
        else:
            size = _adapter_gguf_size(_need_adapter(source, to), arch, base_name, adapter_type)
        return size + TEXT_FILE_ALLOWANCE
    live = _need_adapter(source, to)
    if to == "gguf-lora":
        return _adapter_gguf_size(live, arch, base_name, adapter_type)
    itemsize = 2 if adapter_type == "f16" else 4
    n_tensors = sum(2 * (a.shape[0] if a.ndim == 3 else 1) for a, _ in live.tensors.values())
    return (sum(a.size + b.size for a, b in live.tensors.values()) * itemsize
            + n_tensors * PEFT_TENSOR_HEADER + TEXT_FILE_ALLOWANCE)


def _chunks(shape: tuple[int, ...]) -> Iterator[tuple]:
    """Index tuples covering a tensor along its leading axis: one expert at a time for 3-D
    tensors, blocks of rows of at most CHUNK_ELEMENTS values for 2-D, the whole of a 1-D one."""
    if len(shape) == 1:
        yield (slice(None),)
    elif len(shape) == 3:
        for e in range(shape[0]):
            yield (e,)
    else:
        step = max(1, CHUNK_ELEMENTS // max(int(np.prod(shape[1:])), 1))
        for start in range(0, shape[0], step):
            yield (slice(start, min(start + step, shape[0])),)


def chunk_shape(shape: tuple[int, ...], index: tuple) -> tuple[int, ...]:
    """The shape of `tensor[index]` for an index from _chunks."""
    first = index[0]
    if isinstance(first, int):
        return tuple(shape[1:])
    return (len(range(*first.indices(shape[0]))), *shape[1:])


def merged_values(f: GGUFFile, name: str, index: tuple, adapter: LoraAdapter | None,
                  scale: float, full: dict) -> np.ndarray:
    """The merged float32 values of `name` at `index` (a leading-axis chunk): the fully trained
    tensor or the dequantized base, plus scale * B @ A where the adapter targets it."""
    info = f.tensors[name]
    if name in full:
        w = np.array(full[name][index], np.float32)
    else:
        w = np.array(dequantize(f.raw(name)[index], info.ggml_type), np.float32)
        w = w.reshape(chunk_shape(info.shape, index))
    pair = adapter.scaled(name, scale) if adapter is not None else None
    if pair is not None:
        a, b, s = pair
        if name == "token_embd.weight":                 # A (V, R), B (C, R): delta = A B^T
            delta = a[index] @ b.T
        elif len(info.shape) == 3:                      # A (E, R, in), B (E, out, R)
            delta = b[index] @ a[index]
        else:                                           # A (R, in), B (out, R)
            delta = b[index] @ a
        w += np.float32(s) * delta.astype(np.float32, copy=False)
    return w


@dataclass
class MergeSummary:
    changed: dict[str, int]                  # tensor -> stored type
    retyped: dict[str, tuple[int, int]]      # tensor -> (source type, stored type) if they differ
    name: str = ""


def finetuned_name(meta: dict, path: str) -> str:
    base = meta.get("general.name") or Path(path).stem
    return base if str(base).endswith(FINETUNED) else f"{base}{FINETUNED}"


def write_merged(model_path: str | os.PathLike, out: str | os.PathLike,
                 adapter: LoraAdapter | None, full: dict, *, scale: float = 1.0,
                 merge_type: str = "f16") -> MergeSummary:
    """Write base + scale * B @ A (and fully trained tensors) as a complete GGUF model, the
    changed tensors as `merge_type` (merged_type), the others byte for byte."""
    if merge_type not in ADAPTER_TYPES:
        raise ConfigError(f"Unknown type {merge_type!r} for merged tensors.",
                          "Use one of: " + ", ".join(ADAPTER_TYPES) + ".")
    wanted = ADAPTER_TYPES[merge_type]
    out = Path(out)
    f = read_gguf(model_path)
    scratch = out.with_name(f".{out.name}.scratch-{os.getpid()}")
    mm = None
    try:
        meta = dict(f.metadata)
        meta.pop("general.alignment", None)   # our writer aligns to 32 (the default)
        meta["general.name"] = finetuned_name(meta, str(model_path))
        value_types = dict(f.value_types)
        value_types["general.name"] = (8, None)
        changed_names = set(full) | (set(adapter.tensors) if adapter is not None else set())
        unknown = changed_names - set(f.tensors)
        if unknown:
            raise ConfigError(f"The model has no tensor {min(unknown)!r} to merge into.",
                              "Use the base model the run was trained on.")
        placed: dict[str, tuple[int, int, tuple, int]] = {}
        changed, retyped = {}, {}
        # Changed tensors, computed one chunk at a time, go to a scratch file that the writer
        # then copies from (memory-mapped): peak memory stays at one chunk.
        with open(scratch, "wb") as sf:
            for name, info in f.tensors.items():
                if name not in changed_names:
                    continue
                t = merged_type(info.ggml_type, info.shape[-1], wanted)
                start = sf.tell()
                for index in _chunks(info.shape):
                    quantize(merged_values(f, name, index, adapter, scale, full), t).tofile(sf)
                row_bytes = info.shape[-1] // BLOCK_SIZES[t][0] * BLOCK_SIZES[t][1]
                placed[name] = (start, sf.tell() - start, (*info.shape[:-1], row_bytes), t)
                changed[name] = t
                if t != info.ggml_type:
                    retyped[name] = (info.ggml_type, t)
        if os.path.getsize(scratch):
            mm = np.memmap(scratch, dtype=np.uint8, mode="r")
        tensors = {}
        for name, info in f.tensors.items():
            if name in placed:
                start, n, shape, t = placed[name]
                tensors[name] = (mm[start:start + n].reshape(shape), t)
            else:
                tensors[name] = (f.raw(name), info.ggml_type)   # untouched: the stored bytes
        write_gguf(out, meta, tensors, value_types=value_types)
        return MergeSummary(changed, retyped, meta["general.name"])
    finally:
        tensors = mm = None          # drop the views before removing the scratch file
        if scratch.exists():
            scratch.unlink()
        _close(f)


def _same_value(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and np.array_equal(a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a)
                      and math.isnan(b))


def verify_merged(path: str | os.PathLike, model: Model, adapter: LoraAdapter | None,
                  full: dict, scale: float, summary: MergeSummary, tokens,
                  report: ExportReport, *, llamacpp: bool | None = None,
                  prefix: str = "", fix: str = "") -> None:
    """Re-read a merged model: metadata, tensor list, untouched bytes, changed values, logits,
    and the mean NLL on a held-out sample against base + adapter (`fix`: the option to name
    when it misses)."""
    base = model.gguf
    f = read_gguf(path)
    try:
        problems = []
        skip = {"general.name", "general.alignment"}
        for key, value in base.metadata.items():
            if key in skip:
                continue
            if key not in f.metadata:
                problems.append(f"metadata {key} is missing")
            elif (not _same_value(f.metadata[key], value)
                  or f.value_types[key] != base.value_types[key]):
                problems.append(f"metadata {key} changed")
        extra = set(f.metadata) - set(base.metadata) - skip
        problems += [f"unexpected metadata {k}" for k in sorted(extra)]
        if f.metadata.get("general.name") != summary.name:
            problems.append("general.name is not marked as fine-tuned")
        if list(f.tensors) != list(base.tensors):
            problems.append("the tensor list or order differs from the base model")
        for name, info in base.tensors.items():
            new = f.tensors.get(name)
            if new is None:
                continue
            want_type = summary.changed.get(name, info.ggml_type)
            if new.shape != info.shape or new.ggml_type != want_type:
                problems.append(f"{name}: {new.type_name} {new.shape}, expected "
                                f"{type_name(want_type)} {info.shape}")
        report.add(Check(prefix + "format", not problems, "; ".join(problems[:5]) or
                         f"{len(f.metadata)} metadata keys kept (types too), general.name "
                         f"{summary.name!r}, {len(f.tensors)} tensors",
                         {"problems": problems[:20]}))
        if problems:
            return
        differ = [n for n in base.tensors if n not in summary.changed
                  and not np.array_equal(f.raw(n), base.raw(n))]
        n_same = len(base.tensors) - len(summary.changed)
        report.add(Check(prefix + "unchanged", not differ,
                         f"{len(differ)} untouched tensors differ: {differ[:3]}" if differ else
                         f"{n_same} untouched tensors byte-identical to the base",
                         {"n_tensors": n_same, "differ": differ[:20]}))
        cmp = TensorComparison(prefix + "tensors")
        for name, t in summary.changed.items():
            info = f.tensors[name]
            for index in _chunks(info.shape):
                got = dequantize(f.raw(name)[index], t)
                want = merged_values(base, name, index, adapter, scale, full)
                label = name if len(info.shape) != 3 else f"{name}[{index[0]}]"
                cmp.add(label, np.reshape(got, want.shape) if got.size == want.size else got,
                        want, t)
        report.add(cmp.check())
    finally:
        _close(f)
    merged = load_model(path)
    got = merged.logits(tokens, llamacpp_numerics=False)   # float32, as engine_logits
    live = engine_logits(model, tokens, adapter, scale, full)
    reference = "base + live adapter" if adapter is not None else "the trained tensors"
    quantized = sorted({type_name(t) for t in summary.changed.values()} - {"F32"})
    intent = None
    if quantized:   # the merged weights carry their type's rounding (of the whole weight)
        intent = engine_logits(model, tokens, None, 1.0,
                               StoredMerge(base, summary, adapter, scale, full))
    add_logit_checks(report, prefix, got, live, _base(model, tokens, intent), reference, intent,
                     "/".join(quantized))
    held = verification_prompt(model, HELD_OUT_TEXT, MAX_HELD_OUT)
    report.add(nll_check(prefix + "adapter kept",
                         mean_nll(merged.logits(held, llamacpp_numerics=False), held),
                         mean_nll(engine_logits(model, held, adapter, scale, full), held),
                         mean_nll(engine_logits(model, held), held), fix))
    types = {t.ggml_type for t in merged.gguf.tensors.values()}
    report.add(llamacpp_check(str(path), tokens, got, weight_types=types, enabled=llamacpp,
                              name=prefix + "llamacpp"))


class StoredMerge(Mapping):
    """The changed tensors of a merge as the file should store them (merged, re-quantized,
    dequantized), computed one tensor at a time on access: `full` for engine_logits."""

    def __init__(self, base: GGUFFile, summary: MergeSummary, adapter, scale: float, full: dict):
        self.base, self.summary, self.adapter, self.scale, self.full = (base, summary, adapter,
                                                                        scale, full)

    def __getitem__(self, name: str) -> np.ndarray:
        t = self.summary.changed[name]
        info = self.base.tensors[name]
        out = np.empty(info.shape, np.float32)
        for index in _chunks(info.shape):
            values = merged_values(self.base, name, index, self.adapter, self.scale, self.full)
            out[index] = np.reshape(dequantize(quantize(values, t), t), values.shape)
        return out

    def __contains__(self, name) -> bool:      # without computing the tensor
        return name in self.summary.changed

    def __iter__(self):
        return iter(self.summary.changed)

    def __len__(self) -> int:
        return len(self.summary.changed)


# ---- PEFT --------------------------------------------------------------------------------------

HF_URL = "https://huggingface.co/"


def base_model_id(meta: dict, path: str) -> str:
    """base_model_name_or_path: the Hugging Face repository the GGUF was converted from
    (general.source.huggingface.repository, or general.base_model.N.repo_url on huggingface.co)
    when the file says so, else the GGUF file's absolute path."""
    repo = meta.get("general.source.huggingface.repository")
    if isinstance(repo, str) and repo.strip():
        return repo.strip()
    for i in range(int(meta.get("general.base_model.count") or 1)):
        url = meta.get(f"general.base_model.{i}.repo_url")
        if isinstance(url, str) and url.startswith(HF_URL) and url[len(HF_URL):].strip("/"):
            return url[len(HF_URL):].strip("/")
    return str(Path(path).expanduser().absolute())


def verify_peft(out_dir: str | os.PathLike, model: Model, live: LoraAdapter, user_scale: float,
                tokens, report: ExportReport, dtype: int) -> None:
    cfg = model.config
    try:
        config, tensors = read_peft(out_dir)
        problems = []
        if config.get("peft_type") != "LORA" or not config.get("target_modules"):
            problems.append("adapter_config.json lacks peft_type LORA or target_modules")
        leaves = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors}
        if not leaves <= set(config.get("target_modules") or []):
            problems.append(f"modules {sorted(leaves - set(config['target_modules']))} are not "
                            "in target_modules")
        report.add(Check("format", not problems, "; ".join(problems) or
                         f"PEFT LoRA, r {config.get('r')}, "
                         f"lora_alpha {config.get('lora_alpha'):g}, "
                         f"{len(tensors)} tensors, targets {', '.join(config['target_modules'])}"))
        if problems:
            return
        reread = import_peft(out_dir, arch=cfg.arch, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv,
                             embed_scale=cfg.embed_scale, shapes=model.tensor_shapes)
        check_adapter_fits(reread, cfg.arch, model.tensor_shapes)
        if set(reread.tensors) != set(live.tensors):
            missing = sorted(set(live.tensors) ^ set(reread.tensors))
            raise ModelFormatError(f"modules map to other tensors than the live adapter's: "
                                   f"{missing[:5]}")
    except ModelFormatError as e:
        report.add(Check("shapes", False, e.message))
        return
    report.add(Check("shapes", True, f"{len(tensors) // 2} modules map back to "
                     f"{len(reread.tensors)} adapted tensors that fit the base model"))
    cmp = TensorComparison("tensors")
    for name, (a, b) in live.tensors.items():
        ra, rb = reread.tensors[name]
        cmp.add(name + ".lora_a", ra, a, dtype)
        cmp.add(name + ".lora_b (scaled)", rb * np.float32(reread.scale(name)),
                b * np.float32(live.scale(name, user_scale)), dtype)
    report.add(cmp.check())
    plain = dict(llamacpp_numerics=False)   # engine self-consistency: float32, as trained
    got = model.logits(tokens, adapter=reread, adapter_scale=1.0, **plain)
    live_logits = model.logits(tokens, adapter=live, adapter_scale=user_scale, **plain)
    intent = None
    if dtype != F32:
        intent = model.logits(tokens, adapter=rounded_adapter(fold_scale(live, user_scale), dtype),
                              **plain)
    add_logit_checks(report, "", got, live_logits, _base(model, tokens, intent), "the live adapter",
                     intent, type_name(dtype) if dtype != F32 else "")


# ---- Ollama ------------------------------------------------------------------------------------

def _modelfile_arg(value: str) -> str:
    return f'"{value}"' if any(c.isspace() or c == '"' for c in value) else value


def stop_sequences(model: Model) -> tuple[list[str], list[str]]:
    """(stop strings, skipped notes) from the model's end-of-turn tokens."""
    tok = model.tokenizer
    stops, skipped = [], []
    for i in sorted(tok.eot_ids):
        piece = tok.token_to_piece(i)
        if not piece.strip() or '"' in piece or "\\" in piece or any(ord(c) < 32 for c in piece):
            skipped.append(f"token {i} {piece!r}")
        elif piece not in stops:
            stops.append(piece)
    return stops, skipped


def modelfile_text(model: Model, from_path: str, adapter: str | None, label: str,
                   why_merged: str = "") -> tuple[str, dict]:
    """The Modelfile text and what it should contain (stops, template) for verification."""
    tok = model.tokenizer
    eot, skipped = stop_sequences(model)
    eos = tok.token_to_piece(tok.eos_id) if tok.eos_id is not None else ""
    chat: OllamaTemplate = ollama_template(tok.chat_template, eos)
    stops = list(dict.fromkeys([*chat.stops, *eot]))
    template = chat.template if chat.matches else None
    lines = [f"# Modelfile written by GGUF Workbench ({label}).",
             "# Create the model with: ollama create NAME -f Modelfile"]
    if why_merged:
        lines.append(f"# {why_merged}.")
    lines.append(f"FROM {_modelfile_arg(from_path)}")
    if adapter:
        lines.append(f"ADAPTER {_modelfile_arg(adapter)}")
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    if skipped:
        lines.append(f"# stop tokens not written (not expressible): {', '.join(skipped)}")
    if template is not None:
        lines.append(f"# TEMPLATE: {chat.note}.")
        lines.append(f'TEMPLATE """{template}"""')
    else:
        lines.append(f"# TEMPLATE not written: {chat.note}. `ollama create` picks one from the "
                     "GGUF's tokenizer.chat_template when it recognises it; otherwise add one.")
    return "\n".join(lines) + "\n", {"stops": stops, "template": template,
                                      "template_note": chat.note, "family": chat.family}


def parse_modelfile(text: str) -> dict:
    """FROM, ADAPTER, PARAMETER stop and TEMPLATE of a Modelfile as we write them."""
    out: dict = {"from": None, "adapter": None, "stops": [], "template": None}
    if 'TEMPLATE """' in text:
        out["template"] = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
        text = text.split('TEMPLATE """', 1)[0]
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        word, _, rest = line.strip().partition(" ")
        word = word.upper()
        if word in ("FROM", "ADAPTER"):
            out[word.lower()] = shlex.split(rest)[0] if '"' in rest else rest.strip()
        elif word == "PARAMETER":
            key, _, value = rest.strip().partition(" ")
            if key == "stop":
                value = value.strip()
                out["stops"].append(value[1:-1] if value.startswith('"') else value)
    return out


def verify_modelfile(folder: Path, expected: dict, from_path: str, adapter: str | None, *,
                     final: Path | None = None) -> Check:
    """Parse the written Modelfile in `folder` back: FROM and ADAPTER name the files, which
    exist, the stop parameters and the TEMPLATE are the intended ones. `final`: where the
    folder is going (paths the Modelfile names in it are looked for in `folder`)."""
    parsed = parse_modelfile((folder / MODELFILE).read_text())
    final = final or folder
    problems = []

    def resolve(p):
        return Path(os.path.normpath(final / p)) if p else None

    def present(p: Path) -> bool:
        return (folder / p.relative_to(final) if p.is_relative_to(final) else p).is_file()
    source = resolve(parsed["from"])
    if source is None or source != resolve(from_path) or not present(source):
        problems.append(f"FROM {parsed['from']!r} is not the model file")
    if adapter and (not parsed["adapter"] or resolve(parsed["adapter"]) != resolve(adapter)
                    or not present(resolve(parsed["adapter"]))):
        problems.append(f"ADAPTER {parsed['adapter']!r} is not the exported adapter")
    if parsed["stops"] != expected["stops"]:
        problems.append(f"stop parameters {parsed['stops']} != end-of-turn tokens "
                        f"{expected['stops']}")
    if parsed["template"] != expected["template"]:
        problems.append("TEMPLATE differs from the translated chat template")
    return Check("modelfile", not problems, "; ".join(problems) or
                 f"FROM/ADAPTER resolve, {len(parsed['stops'])} stop parameters, " +
                 (f"TEMPLATE ({expected['family']})" if parsed["template"] else "no TEMPLATE"),
                 {"stops": parsed["stops"], "template": parsed["template"] is not None})


# ---- dispatch ----------------------------------------------------------------------------------

def default_out(source: ExportSource, to: str, adapter_type: str) -> Path:
    if not source.run_dir:
        raise ConfigError("Say where to write the export (--out).",
                          "Exports of a run default to the run directory's exports/ folder.")
    names = {"gguf-lora": f"adapter-{adapter_type}.gguf", "merged": "merged.gguf",
             "peft": "peft", "ollama": "ollama"}
    return RunDir(source.run_dir).exports_dir / names[to]


ExportTargetExists = DestinationExists   # the name the window knows (app.engine.api)


def check_export_destination(source: ExportSource, to: str, out: Path, *,
                             overwrite: bool = False) -> Path:
    """`out` as the destination of a `to` export (runs.destinations.check_destination: never an
    input of the export or of its run, never a run's own files, only a regular file or, for
    peft and ollama, a folder holding only what they write; an existing one only with
    `overwrite`), and its verification reports (replaced with it); returns `out` absolute.
    The default destination in the run's exports/ follows the same rule: an earlier export
    there may already be loaded or shared, so replacing it is the user's call."""
    inputs = source.inputs()
    out = check_destination(out, overwrite=overwrite, inputs=inputs, what=f"a {to} export",
                            folder_files=FOLDER_FILES.get(to))
    for path in report_paths(source, out):
        check_destination(path, overwrite=True, inputs=inputs, what="its verification report",
                          named_after_destination=True)
    return out


@contextmanager
def _staged(out: Path, report: ExportReport, folder: bool) -> Iterator[Path]:
    """A new file or folder beside `out` to write and verify an export in. Verified, it takes
    `out`'s place (an earlier export there is replaced); failing verification, it goes aside
    to a new `<name>.failed-verification<ext>` (`_moved_aside`), and `out` stays as it was. If
    writing fails, it is removed, `out` stays as it was, and an OSError (a full disk, a
    read-only folder) becomes a StorageError naming `out`."""
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        _remove(staging)                        # left by a killed export with this pid
        if folder:
            staging.mkdir()
        yield staging
        if report.ok:
            _move_into_place(staging, out)
        else:
            aside = failed_path(out)
            os.rename(staging, aside)
            _moved_aside(report, out, aside)
    except OSError as e:
        raise storage_error(e, out) from e
    finally:
        _remove(staging)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()


def _moved_aside(report: ExportReport, out: Path, aside: Path) -> None:
    """The report of an export moved aside: its path and files where they are now."""
    report.moved_from, report.path = str(out), str(aside)
    report.files = [str(aside / Path(f).relative_to(out)) if Path(f) != out else str(aside)
                    for f in report.files]


def _move_into_place(staging: Path, out: Path) -> None:
    if staging.is_file() or not os.path.lexists(out):
        os.replace(staging, out)          # a file replaces a file, or a link (not its target)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, old)
    try:
        os.rename(staging, out)
    except OSError:
        os.rename(old, out)
        raise
    if old.is_symlink():
        old.unlink()              # a link: its target is not ours to delete
    else:
        shutil.rmtree(old)


def report_paths(source: ExportSource, out: Path) -> list[Path]:
    """Where the report goes: next to the export, and into the run's exports/ folder (which
    is also where a run's export goes by default): StorageError when that folder is a link."""
    paths = [out.with_name(out.name + ".verify.json")]
    if source.run_dir:      # exports/ a link (a run folder copied with links): refused
        in_run = own_folder(RunDir(source.run_dir).exports_dir) / paths[0].name
        if in_run.resolve() != paths[0].resolve():
            paths.append(in_run)
    return paths


def _verify(report: ExportReport, label: str, check, *args, **kw) -> None:
    """Run a verification; if reading the export back fails at all, that is a failed check."""
    try:
        check(*args, **kw)
    except Exception as e:  # noqa: BLE001 - a broken export must be flagged, not crash the export
        why = e.message if isinstance(e, EngineError) else f"{type(e).__name__}: {e}"
        report.add(Check(label + "read back", False, f"reading the export back failed: {why}"))


def _need_adapter(source: ExportSource, to: str) -> LoraAdapter:
    if source.adapter is None:
        raise ConfigError(f"There is no LoRA adapter to export as {to}: the run trained the "
                          "model in full.", "Export it with --to merged.")
    if source.full:
        raise ConfigError(f"The run also trained {len(source.full)} tensors in full (e.g. "
                          f"{min(source.full)}), which a LoRA adapter cannot carry.",
                          "Export it with --to merged (or --to ollama, which then uses a "
                          "merged model).")
    return source.adapter


def export(source: ExportSource, to: str, out: str | os.PathLike | None = None, *,
           adapter_type: str | None = None, scale: float = 1.0, prompt_tokens=None,
           llamacpp: bool | None = None, overwrite: bool = False, model: Model | None = None,
           write_report: bool = True,
           notify: Callable[[str], None] | None = None) -> ExportReport:
    """Export `source` as `to` (FORMATS) at `out`, verify it, write and return the report.

    adapter_type: the stored type, f32|f16|bf16|q8_0: of GGUF adapters (default f32; PEFT
    f32|f16) and of a merged model's changed tensors (default f16); scale: the user scale,
    folded in; llamacpp: None = compare with llama.cpp when llama-cpp-python is available,
    False = never; overwrite: replace what is at `out` (check_export_destination); notify:
    called with what is about to be written (a merged model's size) before writing it.
    Raises EngineError for bad input (ExportTargetExists when `out` exists and overwrite is
    False) and for a failed write (StorageError: a full disk, a read-only folder); an export
    that fails verification is moved aside (`_staged`) and returned with `report.ok == False`.
    """
    adapter_type = checked_format(to, adapter_type)
    if not math.isfinite(scale) or scale == 0:
        raise ConfigError(f"The export scale must be a non-zero number, got {scale}.")
    if to == "peft" and adapter_type not in ("f32", "f16"):
        raise ConfigError(f"PEFT export writes f32 or f16 tensors, not {adapter_type}.",
                          "Use --type f32 or f16 for PEFT.")
    out = Path(out) if out is not None else default_out(source, to, adapter_type)
    out = check_export_destination(source, to, out, overwrite=overwrite)
    model = model or load_model(source.model_path)
    cfg = model.config
    if source.adapter is not None:
        check_adapter_fits(source.adapter, cfg.arch, model.tensor_shapes)
        source.adapter.arch = cfg.arch
        errors, warnings = llamacpp_lora_problems(source.adapter.tensors, model.tensor_shapes,
                                                  {n: t.ggml_type for n, t in
                                                   model.gguf.tensors.items()})
        if errors:
            raise ConfigError(errors[0], "Train without the embeddings target on this model.")
    for name, arr in source.full.items():
        if model.tensor_shapes.get(name) != tuple(arr.shape):
            raise ConfigError(f"The trained tensor {name!r} does not fit the model.",
                              "Use the base model the run was trained on.")
    if source.adapter is None and not source.full:
        raise ConfigError("Nothing to export: no adapter and no trained tensors.")
    make_parent(out)
    tokens = [int(t) for t in (prompt_tokens if prompt_tokens is not None
                               else verification_prompt(model))]
    report = ExportReport(to, str(out), source=source.describe(), prompt_tokens=tokens,
                          settings={"type": adapter_type, "scale": scale},
                          warnings=list(source.warnings))
    if source.adapter is not None:
        report.warnings += warnings
    base_name = model.metadata.get("general.name") or Path(source.model_path).stem
    if to == "gguf-lora":
        live = _need_adapter(source, to)
        report.files = [str(out)]
        with _staged(out, report, folder=False) as staged:
            types = write_adapter_gguf(fold_scale(live, scale), staged, arch=cfg.arch,
                                       adapter_type=adapter_type, name=f"{base_name} LoRA")
            _note_adapter_fallbacks(report, types, adapter_type)
            _verify(report, "", verify_gguf_lora, staged, model, live, scale, tokens, report,
                    llamacpp=llamacpp)
    elif to == "merged":
        report.files = [str(out)]
        with _staged(out, report, folder=False) as staged:
            summary, fix = _write_merge(source, staged, report, adapter_type, scale, notify)
            _verify(report, "", verify_merged, staged, model, source.adapter, source.full,
                    scale, summary, tokens, report, llamacpp=llamacpp, fix=fix)
    elif to == "peft":
        live = _need_adapter(source, to)
        with _staged(out, report, folder=True) as staging:
            result = export_peft(live, staging, arch=cfg.arch, n_head=cfg.n_head,
                                 n_head_kv=cfg.n_head_kv, embed_scale=cfg.embed_scale,
                                 shapes=model.tensor_shapes, user_scale=scale,
                                 base_model=base_model_id(model.metadata, source.model_path),
                                 dtype=adapter_type)
            report.files = [str(out / Path(f).name) for f in result.files]
            report.warnings += result.warnings
            _verify(report, "", verify_peft, staging, model, live, scale, tokens, report,
                    ADAPTER_TYPES[adapter_type])
    else:
        _export_ollama(source, model, out, report, adapter_type, scale, tokens, llamacpp,
                       base_name, notify)
    for c in report.checks:
        if c.name.endswith("llamacpp") and c.ok is None and c.data.get("skipped") != "disabled":
            report.warnings.append(f"the llama.cpp cross-check did not run ({c.detail}); the "
                                   "export passed the engine's own checks only")
    if write_report:
        report.write(report_paths(source, Path(report.path)))
    return report


def _write_merge(source, out: Path, report, merge_type, scale, notify):
    """Write the merged model at `out` (its size announced first); returns the MergeSummary
    and the option that fixes a merge that loses the adapter."""
    changed = set(source.full) | set(source.adapter.tensors if source.adapter else ())
    size, base_size = merged_size(source.model_path, changed, merge_type)
    report.settings["merged_size_bytes"] = size
    if notify is not None:
        notify(f"writing the merged model: {human_bytes(size)} (base {human_bytes(base_size)}; "
               f"{len(changed)} changed tensors as {merge_type.upper()} (F32 ones stay F32), "
               "the others copied byte for byte)")
    summary = write_merged(source.model_path, out, source.adapter, source.full, scale=scale,
                           merge_type=merge_type)
    _note_retyped(report, summary)
    better = {"q8_0": "--type f16 (or f32)", "bf16": "--type f16 (or f32)", "f16": "--type f32"}
    fix = (f"export again with {better[merge_type]}" if merge_type in better else
           "the stored values differ from what was meant; do not use this file")
    return summary, fix


def _export_ollama(source, model, out: Path, report, adapter_type, scale, tokens, llamacpp,
                   base_name, notify) -> None:
    """Write and verify the folder beside `out`, then move it into place (`_staged`). The
    Modelfile names a merged model by its final path, where verify_modelfile expects it."""
    base_path = str(Path(source.model_path).expanduser().absolute())
    cfg = model.config
    engine = cfg.arch in OLLAMA_ENGINE_ARCHS
    why_merged = ""
    if engine:
        why_merged = (f"Ollama runs {cfg.arch} on its own engine, which refuses adapters "
                      "(\"loras are not yet implemented\"): FROM the merged model, no ADAPTER")
        report.add(Check("ollama engine", None, why_merged, {"informational": True}))
    with _staged(out, report, folder=True) as staging:
        if engine or source.full:   # Ollama's engine, or full/hybrid training: merged model
            name = OLLAMA_MODEL
            merge_type = DEFAULT_TYPES["merged"] if adapter_type == "f32" else adapter_type
            summary, fix = _write_merge(source, staging / name, report, merge_type, scale,
                                        notify)
            _verify(report, "model ", verify_merged, staging / name, model, source.adapter,
                    source.full, scale, summary, tokens, report, llamacpp=llamacpp,
                    prefix="model ", fix=fix)
            from_path, adapter_rel, label = str(out / name), None, f"{base_name}, merged"
        else:
            name = OLLAMA_ADAPTER
            types = write_adapter_gguf(fold_scale(source.adapter, scale), staging / name,
                                       arch=cfg.arch, adapter_type=adapter_type,
                                       name=f"{base_name} LoRA")
            _note_adapter_fallbacks(report, types, adapter_type)
            _verify(report, "adapter ", verify_gguf_lora, staging / name, model, source.adapter,
                    scale, tokens, report, llamacpp=llamacpp, prefix="adapter ")
            from_path, adapter_rel, label = (base_path, f"./{name}",
                                             f"{base_name} + LoRA adapter")
        text, expected = modelfile_text(model, from_path, adapter_rel, label, why_merged)
        atomic_write_bytes(staging / MODELFILE, text.encode("utf-8"))
        report.files = [str(out / MODELFILE), str(out / name)]
        _verify(report, "", lambda: report.add(verify_modelfile(staging, expected, from_path,
                                                                adapter_rel, final=out)))


def _note_adapter_fallbacks(report: ExportReport, types: dict[str, int], adapter_type: str) -> None:
    wanted = ADAPTER_TYPES[adapter_type]
    fell = sorted(n for n, t in types.items() if t == F16 and wanted != F16)
    routers = sorted(n for n, t in types.items() if t == F32 and wanted != F32)
    if fell:
        report.warnings.append(f"{len(fell)} tensors stored as F16 instead of "
                               f"{adapter_type.upper()} (rows not a multiple of its block "
                               f"size): {', '.join(fell[:8])}{' ...' if len(fell) > 8 else ''}")
        report.settings["f16_fallback_tensors"] = fell
    if routers:
        report.warnings.append(f"{len(routers)} router adapter tensors kept F32 (a rounded "
                               "router flips expert choices; llama.cpp's converter keeps "
                               "routers F32 too)")
        report.settings["f32_router_tensors"] = routers


def _note_retyped(report: ExportReport, summary: MergeSummary) -> None:
    """Which changed tensors are stored in another type than the base's (informational)."""
    report.settings["retyped_tensors"] = {n: [type_name(a), type_name(b)]
                                          for n, (a, b) in summary.retyped.items()}
    if summary.retyped:
        pairs = sorted({f"{type_name(a)} -> {type_name(b)}" for a, b in summary.retyped.values()})
        report.add(Check("types", None, f"{len(summary.retyped)} of {len(summary.changed)} "
                         f"changed tensors stored as another type than the base's "
                         f"({', '.join(pairs)}) to keep the adapter's effect",
                         {"informational": True}))
