"""Build small GGUF files for tests by rewriting the golden ones (metadata + tensors)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from app.engine.io.gguf import read_gguf


def read_all(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """Metadata and every tensor as a float32 NumPy array (F32 files only)."""
    f = read_gguf(path)
    tensors = {name: np.array(f.array(name)) for name in f.tensors}
    return dict(f.metadata), tensors


def write_gguf(path: Path, metadata: dict, tensors: dict[str, np.ndarray],
               split_max_tensors: int = 0) -> Path:
    """Write an F32 GGUF with the given metadata (python values) and tensors (NumPy order).
    `split_max_tensors`: gguf's own split into `<stem>-0000k-of-0000n.gguf` files of at most
    that many tensors (llama.cpp's gguf-split layout and split.* keys)."""
    arch = metadata["general.architecture"]
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    for key, value in metadata.items():
        if key in ("general.architecture", "GGUF.version") or key.startswith("GGUF."):
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, (int, np.integer)):
            w.add_uint32(key, int(value))
        elif isinstance(value, (float, np.floating)):
            w.add_float32(key, float(value))
        elif isinstance(value, np.ndarray):
            w.add_array(key, value.tolist())
        else:
            w.add_array(key, list(value))
    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_same_model(a_path, b_path):
    """Two GGUF files hold the same tensors (stored bytes, in order) and metadata (a merged
    split model against its unsplit source)."""
    a, b = read_gguf(a_path), read_gguf(b_path)
    assert list(a.tensors) == list(b.tensors)
    assert all(np.array_equal(a.raw(n), b.raw(n)) for n in b.tensors)
    assert a.metadata.keys() == b.metadata.keys()
    for k, v in b.metadata.items():
        assert np.array_equal(a.metadata[k], v) if isinstance(v, np.ndarray) else \
            a.metadata[k] == v, k
