"""The GGUF models already on this computer: the Hugging Face cache's, llama.cpp's cache, LM
Studio's model folders and Ollama's blobs (named through its manifests). Folders only: no
network. (Moved here from the window's model picker so that `workbench models list` shares it.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from app.engine.hub.client import cached_models, hf_cache_dir


@dataclass(frozen=True)
class FoundModel:
    path: str
    name: str          # what the user knows it as (file name, or Ollama's "name:tag")
    source: str        # "Hugging Face", "llama.cpp cache", "LM Studio", "Ollama"
    size: int


MAX_FOUND = 300
_SKIP_PREFIXES = ("mmproj", "ggml-vocab")      # vision projectors and vocab-only files


def model_folders(home: str | os.PathLike | None = None,
                  env: Mapping[str, str] | None = None) -> list[tuple[str, Path]]:
    """(source, folder) pairs where the Hugging Face cache, llama.cpp, LM Studio and Ollama
    keep GGUF files."""
    env = os.environ if env is None else env
    home = Path(home) if home is not None else Path.home()
    hf = [("Hugging Face", hf_cache_dir(home, env))]
    llama = [Path(env["LLAMA_CACHE"])] if env.get("LLAMA_CACHE") else []
    llama += [home / ".cache" / "llama.cpp", home / "Library" / "Caches" / "llama.cpp"]
    if env.get("LOCALAPPDATA"):
        llama.append(Path(env["LOCALAPPDATA"]) / "llama.cpp")
    ollama = [Path(env["OLLAMA_MODELS"])] if env.get("OLLAMA_MODELS") else []
    ollama.append(home / ".ollama" / "models")
    out = hf + [("llama.cpp cache", p) for p in llama]
    out += [("LM Studio", home / ".lmstudio" / "models"),
            ("LM Studio", home / ".cache" / "lm-studio" / "models")]
    out += [("Ollama", p) for p in ollama]
    return out


def _gguf_files(folder: Path, max_depth: int = 4):
    base = len(folder.parts)
    for root, dirs, files in os.walk(folder):
        if len(Path(root).parts) - base >= max_depth:
            dirs[:] = []
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for f in sorted(files):
            if f.lower().endswith(".gguf") and not f.lower().startswith(_SKIP_PREFIXES):
                yield Path(root) / f


def _ollama_models(folder: Path):
    """(name:tag, blob path) of Ollama's models: manifests name the blob of the GGUF layer."""
    manifests = folder / "manifests"
    if not manifests.is_dir():
        return
    for root, _dirs, files in os.walk(manifests):
        for tag in files:
            manifest = Path(root) / tag
            try:
                layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
            except (OSError, ValueError, AttributeError):
                continue
            for layer in layers:
                if not isinstance(layer, dict) or \
                        layer.get("mediaType") != "application/vnd.ollama.image.model":
                    continue
                digest = str(layer.get("digest", "")).replace(":", "-")
                blob = folder / "blobs" / digest
                if blob.is_file():
                    parts = manifest.relative_to(manifests).parts
                    repo = parts[-2] if len(parts) >= 2 else "model"
                    if len(parts) >= 3 and parts[-3] not in ("library",):
                        repo = f"{parts[-3]}/{repo}"
                    yield f"{repo}:{tag}", blob


def discover_models(home: str | os.PathLike | None = None,
                    env: Mapping[str, str] | None = None) -> list[FoundModel]:
    """GGUF models in the Hugging Face cache, llama.cpp's cache, LM Studio's and Ollama's
    folders (those that exist). A Hub model's name is `owner/name:QUANT`."""
    found: list[FoundModel] = []
    seen: set[str] = set()

    def add(path: Path, name: str, source: str) -> None:
        key = os.path.realpath(path)
        if key in seen or len(found) >= MAX_FOUND:
            return
        seen.add(key)
        try:
            size = path.stat().st_size
        except OSError:
            return
        found.append(FoundModel(str(path), name, source, size))

    for source, folder in model_folders(home, env):
        if not folder.is_dir():
            continue
        try:
            if source == "Hugging Face":
                for c in cached_models(folder):
                    add(c.path, f"{c.repo_id}:{c.quant or c.name}", source)
            elif source == "Ollama":
                for name, blob in _ollama_models(folder):
                    add(blob, name, source)
            else:
                for path in _gguf_files(folder):
                    add(path, path.name, source)
        except OSError:
            continue
    return found
