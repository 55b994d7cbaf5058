"""A split GGUF model (`name-00001-of-0000N.gguf`, llama.cpp's gguf-split layout) as one file,
for training: the workbench's reader takes one file, so the first training from a split model
writes the parts together once, beside the dataset cache (`<cache>/merged-models/`), never in
the Hugging Face cache (that is the client's). The tensors are copied as stored (quantized
stays quantized), the metadata is the first part's without the split.* keys.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from app.engine.data.cache import cache_dir
from app.engine.errors import ModelFormatError
from app.engine.hub.names import split_part
from app.engine.io.gguf import read_gguf, write_gguf, write_gguf_header
from app.engine.runtime.files import storage_error

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def merged_dir() -> Path:
    return cache_dir().parent / "merged-models"


def parts_of(first: Path) -> list[Path]:
    """Every part of the split model whose first part is `first`, in order; ModelFormatError
    naming the missing ones."""
    stem, _k, count = split_part(first.name) or (None, 0, 0)
    if stem is None:
        return [first]
    parts = [first.with_name(f"{stem}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelFormatError(f"The split model {stem} lacks {', '.join(missing)}.",
                               "Get the model again: every part is downloaded with it.")
    return parts


def trainable_path(path: str | Path, key: str = "") -> Path:
    """`path` itself for a one-file model; for a part of a split model the merged file
    (written once: `merged-models/<key>/<name>.gguf`, `key` naming its source, e.g. the
    repository and commit)."""
    path = Path(path)
    part = split_part(path.name)
    if part is None:
        return path
    first = path.with_name(f"{part[0]}-00001-of-{part[2]:05d}.gguf")
    out = merged_dir() / (key or "local") / f"{part[0]}.gguf"
    if out.is_file():
        return out
    parts = parts_of(first)
    files = [read_gguf(p) for p in parts]
    tensors: dict = {}                     # views of the parts' mappings, released below
    try:
        declared = files[0].metadata.get("split.tensors.count")
        for f in files:
            for name, info in f.tensors.items():
                tensors[name] = (f.raw(name), info.ggml_type)
        if isinstance(declared, int) and declared != len(tensors):
            raise ModelFormatError(
                f"The parts of {part[0]} hold {len(tensors)} tensors; the first says "
                f"{declared}.", "Get the model again.")
        metadata = {k: v for k, v in files[0].metadata.items() if k not in SPLIT_KEYS}
        types = {k: v for k, v in files[0].value_types.items() if k not in SPLIT_KEYS}
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            write_gguf(out, metadata, tensors, types)
        except OSError as e:
            raise storage_error(e, out, "write") from None
    finally:
        tensors.clear()
        for f in files:
            f.close()
    return out


def merged_header(parts: list[tuple[bytes, int]]) -> tuple[bytes, int]:
    """(the header, the size) of the file `trainable_path` would write from a split model,
    from each part's (header, file size) in order (its weights never fetched): the first
    part's metadata without the split.* keys, every part's tensors with their shapes and
    types. What fits is then read from it as from an unsplit file."""
    tensors: dict = {}
    with tempfile.TemporaryDirectory(prefix="wb-split-") as folder:
        for k, (prefix, size) in enumerate(parts):
            path = os.path.join(folder, f"part-{k}.gguf")
            with open(path, "wb") as f:
                f.write(prefix)
                f.truncate(max(size, len(prefix)))    # sparse: the reader checks extents
            g = read_gguf(path)
            try:
                if k == 0:
                    metadata = {n: v for n, v in g.metadata.items() if n not in SPLIT_KEYS}
                    types = {n: v for n, v in g.value_types.items() if n not in SPLIT_KEYS}
                    declared = g.metadata.get("split.tensors.count")
                tensors.update(g.tensors)
            finally:
                g.close()
        if isinstance(declared, int) and declared != len(tensors):
            raise ModelFormatError(f"The parts of the split model hold {len(tensors)} tensors; "
                                   f"the first says {declared}.", "Pick another model.")
        out = os.path.join(folder, "merged.gguf")
        start, size = write_gguf_header(out, metadata, tensors, types)
        with open(out, "rb") as f:
            return f.read(start), size
