"""On-disk cache of tokenized datasets.

A dataset is tokenized once per (dataset file content, tokenizer, chat template, tokenization
settings): the key is a SHA-256 over the file's SHA-256, `Tokenizer.hash()`, the template text
and the settings that change tokens or masks. Entries are ``.npz`` files (no pickles) in
``<user cache dir>/gguf-workbench/datasets/`` (`platformdirs.user_cache_dir`), or in
``$WORKBENCH_CACHE_DIR/datasets/`` when that variable is set. Writes are atomic (a temporary file
in the same directory, then a rename), so a crash never leaves a half-written entry under a
valid name; an entry that does not load (truncated, corrupt, from another version) is ignored,
and the caller rebuilds and overwrites it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from app.engine.runtime.inputs import NEVER, open_input

CACHE_VERSION = 1
ENV_VAR = "WORKBENCH_CACHE_DIR"


def cache_dir() -> Path:
    root = os.environ.get(ENV_VAR)
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("gguf-workbench")
    return Path(root) / "datasets"


def file_digest(path, chunk: int = 1 << 20, what: str = "dataset",
                stop: Callable[[], None] = NEVER) -> str:
    """SHA-256 of a file's bytes, read in chunks (an input file: `open_input` checks it and
    `what` names it; `stop`, a `StopCheck`, is called between chunks)."""
    h = hashlib.sha256()
    with open_input(path, what) as f:
        while block := f.read(chunk):
            stop()
            h.update(block)
    return h.hexdigest()


def cache_key(parts: dict) -> str:
    blob = json.dumps({"version": CACHE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()


def load(key: str) -> dict[str, np.ndarray] | None:
    """The arrays stored under `key`, or None (absent or unreadable)."""
    path = cache_dir() / f"{key}.npz"
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except Exception:  # any damage means "not cached"; the caller rebuilds the entry
        return None


def save(key: str, arrays: dict[str, np.ndarray]) -> Path | None:
    """Store arrays atomically; returns the path, or None when the cache is not writable (the
    dataset still works, it is just tokenized again next time)."""
    directory = cache_dir()
    path = directory / f"{key}.npz"
    tmp = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}-", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return None


def clear() -> int:
    """Remove every cache entry (and leftovers of interrupted writes); returns how many files."""
    removed = 0
    for path in list(cache_dir().glob("*.npz")) + list(cache_dir().glob(".*.tmp")):
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def json_array(value) -> np.ndarray:
    """A JSON-serialisable value as a uint8 array (for metadata inside an .npz)."""
    return np.frombuffer(json.dumps(value).encode("utf-8"), dtype=np.uint8)


def from_json_array(arr: np.ndarray):
    return json.loads(arr.tobytes().decode("utf-8"))
