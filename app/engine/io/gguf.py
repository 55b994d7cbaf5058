"""Reading (and, later, writing) GGUF files: the only module that imports `gguf`.

The reader is our own: GGUF files are untrusted input, so every count, length, dimension and
offset is checked against the file size before anything is allocated, and every failure is a
`ModelFormatError` that says what is wrong. Tensor data is memory-mapped and never copied here.

Shape convention: GGUF stores ggml's `ne` (fastest axis first). Everything this module returns
uses the NumPy order, i.e. `shape = tuple(reversed(ne))`; a weight of HF shape (out, in) has
`ne = [in, out]` and NumPy shape (out, in). Quantized tensors are exposed as uint8 rows of shape
(*shape[:-1], row_bytes).
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import shutil
import stat
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.engine.errors import ModelFormatError, UnsupportedModelError
from app.engine.kernels import quants
from app.engine.runtime import faults
from app.engine.runtime.backend import get_array_module, to_host

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4

# Metadata value types (gguf spec).
_SCALAR_FORMATS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY_DTYPES = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}
_STRING, _ARRAY = 8, 9


def _all_block_sizes() -> dict[int, tuple[int, int]]:
    """Block sizes of every ggml type `gguf` knows (ours are a subset)."""
    import gguf

    sizes = {int(t): tuple(v) for t, v in gguf.GGML_QUANT_SIZES.items()}
    sizes.update(quants.BLOCK_SIZES)
    return sizes


BLOCK_SIZES = _all_block_sizes()


def type_name(ggml_type: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type#{ggml_type}"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]      # NumPy order (reversed ggml ne)
    ggml_type: int
    offset: int                 # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        block_elems, block_bytes = BLOCK_SIZES[self.ggml_type]
        return self.shape[-1] // block_elems * block_bytes


class _Cursor:
    """Bounds-checked little-endian reader over a bytes-like buffer."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def fail(self, what: str) -> ModelFormatError:
        return ModelFormatError(
            f"{Path(self.path).name} is not a valid GGUF file: {what} (at byte {self.pos}).",
            "The file is truncated or corrupt. Download or convert it again.",
        )

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} runs past the end of the file ({self.size} bytes)")

    def scalar(self, vtype: int, what: str):
        fmt, n = _SCALAR_FORMATS[vtype]
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def peek_u32(self) -> int | None:
        """The next u32 without moving (None at the end of the file)."""
        if self.pos + 4 > self.size:
            return None
        return struct.unpack_from("<I", self.buf, self.pos)[0]

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:  # keep the bytes: tokens may be partial UTF-8 sequences
            return raw.decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALAR_FORMATS:
            v = self.scalar(vtype, what)
            return bool(v) if vtype == 7 else v
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth > 0:
                raise self.fail(f"{what} is a nested array, which the workbench does not read")
            item_type = self.u32(f"item type of {what}")
            count = self.u64(f"length of {what}")
            if item_type in _NUMPY_DTYPES:
                itemsize = _SCALAR_FORMATS[item_type][1]
                self.need(count * itemsize, f"array {what} ({count} items)")
                arr = np.frombuffer(self.buf, dtype=_NUMPY_DTYPES[item_type], count=count,
                                    offset=self.pos).copy()
                self.pos += count * itemsize
                return arr
            if item_type == _STRING:
                self.need(count * 8, f"array {what} ({count} strings)")  # each has a u64 length
                return [self.string(f"{what}[{i}]") for i in range(count)]
            raise self.fail(f"{what} has unknown array item type {item_type}")
        raise self.fail(f"{what} has unknown value type {vtype}")


def _shown(magic: bytes) -> str:
    """A file's first bytes for a message: as text when printable ("GGML"), else in hex."""
    text = magic.decode("ascii", "replace")
    return f'"{text}"' if text.isprintable() and text.isascii() else "the bytes " + magic.hex(" ")


class ModelFileChanged(ModelFormatError):
    """The model file was truncated, rewritten or replaced while it was in use."""

    kind = "model_changed"


_OPEN: "weakref.WeakSet[GGUFFile]" = weakref.WeakSet()   # mapped files, for a SIGBUS's message


class GGUFFile:
    """A parsed, validated GGUF file with memory-mapped tensor data.

    The mapping stays valid only while the file keeps its size: reading a page past a truncated
    end kills the process (SIGBUS). So every tensor read (`raw`) first checks that the file is
    still the one opened (`check_unchanged`: its size, mtime and inode), which turns a change
    into ModelFileChanged, and a run's SIGBUS handler (app.engine.runtime.faults) names the
    file if it shrinks between that check and the read."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        try:
            st = os.stat(self.path)
            if stat.S_ISDIR(st.st_mode):  # checked first: Windows reports a folder as PermissionError
                raise IsADirectoryError(self.path)
            if not stat.S_ISREG(st.st_mode):  # a pipe would block open() forever
                raise ModelFormatError(f"{self.path} is not a regular file.",
                                       "Pick a GGUF model file.")
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                self.file_size = st.st_size
                if self.file_size == 0:
                    raise ModelFormatError(f"{Path(self.path).name} is empty.",
                                           "Pick a GGUF model file.")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self._where = os.path.abspath(self.path)   # stat()ed by check_unchanged
                self._opened = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            raise ModelFormatError(f"No such file: {self.path}", "Check the path.") from None
        except IsADirectoryError:
            raise ModelFormatError(f"{self.path} is a folder, not a GGUF file.",
                                   "Pick the .gguf file inside it.") from None
        except PermissionError:
            raise ModelFormatError(f"Cannot read {self.path}: permission denied.",
                                   "Check the file's permissions.") from None
        except (OSError, ValueError) as e:  # e.g. a file used as a folder, a NUL in the path
            reason = getattr(e, "strerror", None) or str(e)
            raise ModelFormatError(f"Cannot read {self.path}: {reason}.", "Check the path.") from None
        self._data = np.frombuffer(self._mmap, dtype=np.uint8)
        self._parse(_Cursor(self._mmap, self.path))
        _OPEN.add(self)

    def _parse(self, cur: _Cursor) -> None:
        cur.need(4, "magic")
        magic = bytes(cur.buf[0:4])
        if magic != GGUF_MAGIC:
            raise ModelFormatError(
                f"{Path(self.path).name} is not a GGUF file: it starts with {_shown(magic)}, "
                "not \"GGUF\".",
                "Pick a .gguf model; convert other formats with llama.cpp's convert_hf_to_gguf.py.")
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            raise ModelFormatError(
                f"{Path(self.path).name} has GGUF version {self.version}; supported: 2 and 3.",
                "Re-convert the model with a current llama.cpp.")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        # Every metadata entry takes at least 13 bytes and every tensor entry at least 28.
        if n_kv * 13 > self.file_size or n_tensors * 28 > self.file_size:
            raise cur.fail(f"absurd counts ({n_tensors} tensors, {n_kv} metadata entries)")

        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, tuple[int, int | None]] = {}  # for writing the same types back
        for i in range(n_kv):
            key = cur.string(f"key of metadata entry {i}")
            vtype = cur.u32(f"type of {key!r}")
            item_type = cur.peek_u32() if vtype == _ARRAY else None
            self.metadata[key] = cur.value(vtype, repr(key))
            self.value_types[key] = (vtype, item_type)

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0
                or alignment & (alignment - 1)):
            raise cur.fail(f"general.alignment {alignment!r:.40} is not a power of two")
        self.alignment = alignment

        infos = [self._read_tensor_info(cur) for _ in range(n_tensors)]
        data_start = -(-cur.pos // self.alignment) * self.alignment
        self.data_offset = data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, rel_offset, nbytes in infos:
            if rel_offset % self.alignment:
                raise cur.fail(f"tensor {name!r} offset {rel_offset} is not aligned")
            start = data_start + rel_offset
            if start + nbytes > self.file_size:
                raise ModelFormatError(
                    f"{Path(self.path).name} is truncated: tensor {name!r} ends at byte "
                    f"{start + nbytes} but the file has {self.file_size} bytes.",
                    "The download or copy did not finish. Get the file again.")
            if name in self.tensors:
                raise cur.fail(f"tensor {name!r} appears twice")
            self.tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)

    def _read_tensor_info(self, cur: _Cursor):
        name = cur.string("tensor name")
        n_dims = cur.u32(f"dimension count of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions")
        ne = [cur.u64(f"dimension of {name!r}") for _ in range(n_dims)]
        ggml_type = cur.u32(f"type of {name!r}")
        rel_offset = cur.u64(f"offset of {name!r}")
        if any(d == 0 or d > self.file_size * 256 for d in ne):
            raise cur.fail(f"tensor {name!r} has impossible dimensions {ne}")
        if ggml_type not in BLOCK_SIZES:
            raise UnsupportedModelError(
                f"Tensor {name!r} has ggml type {ggml_type}, which this version does not know.",
                "Use a model quantized with a common type (F16, Q8_0, Q4_K_M, ...).")
        block_elems, block_bytes = BLOCK_SIZES[ggml_type]
        if ne[0] % block_elems:
            raise cur.fail(f"tensor {name!r} row length {ne[0]} is not a multiple of the "
                           f"{type_name(ggml_type)} block size {block_elems}")
        n_rows = int(np.prod(ne[1:], dtype=object)) if n_dims > 1 else 1
        nbytes = ne[0] // block_elems * block_bytes * n_rows
        if nbytes > self.file_size:
            raise cur.fail(f"tensor {name!r} ({nbytes} bytes) is larger than the file")
        return name, tuple(int(d) for d in reversed(ne)), ggml_type, rel_offset, int(nbytes)

    # ---- tensor access -------------------------------------------------------------------
    def change(self) -> str | None:
        """How the file differs from when it was opened ("it was truncated to N bytes", ...),
        or None. A truncated mapping is found through the mapping itself (mmap.size() stats its
        own descriptor), a rewrite or a replacement through the path."""
        if self._mmap.closed:
            return None
        try:
            mapped_size = self._mmap.size()
            if mapped_size < self.file_size:
                return f"it was truncated from {self.file_size:,} to {mapped_size:,} bytes"
            st = os.stat(self._where)
        except OSError as e:
            return f"it can no longer be read ({e.strerror or e})"
        dev, ino, size, mtime_ns = self._opened
        if (st.st_dev, st.st_ino) != (dev, ino):
            return "another file was put in its place"
        if st.st_size != size:
            return f"its size went from {size:,} to {st.st_size:,} bytes"
        if st.st_mtime_ns != mtime_ns:
            return "it was rewritten"
        return None

    def check_unchanged(self) -> None:
        """ModelFileChanged when the file is no longer the one opened (see `change`)."""
        change = self.change()
        if change is not None:
            raise ModelFileChanged(f"The model file changed while in use: {self.path} "
                                   f"({change}).", faults.HINT)

    def raw(self, name: str) -> np.ndarray:
        """Read-only uint8 view (*shape[:-1], row_bytes) of a tensor's stored bytes, once
        `check_unchanged` says the file is still the one mapped."""
        self.check_unchanged()
        info = self.tensors[name]
        flat = self._data[info.offset:info.offset + info.nbytes]
        return flat.reshape(*info.shape[:-1], info.row_bytes)

    def array(self, name: str) -> np.ndarray:
        """The tensor as float32 in NumPy shape: a zero-copy view for F32, dequantized otherwise."""
        info = self.tensors[name]
        if info.ggml_type == 0:
            return self.raw(name).view(np.float32).reshape(info.shape)
        return dequantize(self.raw(name), info.ggml_type).reshape(info.shape)

    def close(self) -> None:
        _OPEN.discard(self)
        self._data = None
        self._mmap.close()

    def __repr__(self) -> str:
        return (f"GGUFFile({self.path!r}, v{self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors)")


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    return GGUFFile(path)


def _changed_files() -> str | None:
    """For a SIGBUS (app.engine.runtime.faults): the message naming the mapped file that changed."""
    for f in list(_OPEN):
        change = f.change()
        if change is not None:
            return f"The model file changed while in use: {f.path} ({change})."
    return None


faults.explain_with(_changed_files)


def dequantize(raw: np.ndarray, ggml_type: int, out=None):
    """Dequantize rows of raw blocks on NumPy or CuPy; types our kernels lack use gguf (CPU)."""
    if quants.is_supported(ggml_type):
        return quants.dequantize(raw, ggml_type, out=out)
    import gguf

    xp = get_array_module(raw)
    try:
        result = gguf.quants.dequantize(to_host(raw), gguf.GGMLQuantizationType(ggml_type))
    except NotImplementedError:
        raise UnsupportedModelError(
            f"Tensor type {type_name(ggml_type)} cannot be dequantized.",
            "Use a model quantized with a common type (F16, Q8_0, Q4_K_M, ...).") from None
    result = xp.asarray(result, dtype=xp.float32)
    if out is not None:
        out[...] = result
        return out
    return result


# ---- writing ---------------------------------------------------------------------------------

# Metadata value type ids -> gguf's enum, for writing back exactly the types a file had.
def _value_type(vtype: int):
    import gguf

    return gguf.GGUFValueType(vtype)


def _infer_value_type(key: str, value) -> tuple[int, int | None]:
    """(value type, array item type) for a Python/NumPy value without a recorded type.

    Integers are UINT32 (what llama.cpp reads for counts, lengths and token ids) unless they
    do not fit; floats FLOAT32 (`adapter.lora.alpha` must be FLOAT32); NumPy arrays keep their
    dtype; lists of str are string arrays, lists of numbers INT32 or FLOAT32 arrays.
    """
    dtype_types = {np.dtype(t): v for v, t in _NUMPY_DTYPES.items()}
    if isinstance(value, (bool, np.bool_)):
        return 7, None
    if isinstance(value, str):
        return _STRING, None
    if isinstance(value, (int, np.integer)):
        if 0 <= value < 2**32:
            return 4, None
        return (5, None) if -2**31 <= value < 2**31 else (11, None)
    if isinstance(value, (float, np.floating)):
        return 6, None
    if isinstance(value, np.ndarray):
        if value.dtype not in dtype_types:
            raise TypeError(f"metadata {key!r}: unsupported array dtype {value.dtype}")
        return _ARRAY, dtype_types[value.dtype]
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, str) for v in value):
            return _ARRAY, _STRING
        if all(isinstance(v, (bool, np.bool_)) for v in value):
            return _ARRAY, 7
        if all(isinstance(v, (int, np.integer)) for v in value):
            return _ARRAY, 5
        return _ARRAY, 6
    raise TypeError(f"metadata {key!r}: cannot store a {type(value).__name__}")


def write_gguf(path: str | os.PathLike, metadata: dict[str, Any], tensors: dict[str, Any],
               value_types: dict[str, tuple[int, int | None]] | None = None) -> None:
    """Write a GGUF file atomically (temporary file, fsync, rename).

    metadata: key -> value (as read by GGUFFile); value_types: key -> (type, item type) to keep
    a source file's exact types (GGUFFile.value_types), else inferred. tensors: name -> float
    array (NumPy shape; written as F32), or (raw uint8 rows, ggml type) for stored/quantized
    data such as GGUFFile.raw(name) or the output of `quantize`.
    """
    import gguf

    path = str(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    _make_own_temporary(tmp)
    arch = metadata.get("general.architecture", "unknown")
    writer = gguf.GGUFWriter(tmp, arch, use_temp_file=False)
    try:
        _add_metadata(writer, metadata, value_types)
        for name, tensor in tensors.items():
            if isinstance(tensor, tuple):
                raw, ggml_type = tensor
                writer.add_tensor(name, np.ascontiguousarray(raw),
                                  raw_dtype=gguf.GGMLQuantizationType(ggml_type))
            else:
                writer.add_tensor(name, np.ascontiguousarray(tensor, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            writer.close()
        except OSError:     # flushing onto the same full disk: the first error says it
            pass
        full = isinstance(exc, OSError) and _short_write_on_full_disk(exc, tmp)
        if os.path.exists(tmp):
            os.remove(tmp)
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path) from exc
        raise


def _add_metadata(writer, metadata: dict[str, Any],
                  value_types: dict[str, tuple[int, int | None]] | None) -> None:
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        vtype, item = (value_types or {}).get(key) or _infer_value_type(key, value)
        if vtype == _ARRAY:
            items = value.tolist() if isinstance(value, np.ndarray) else list(value)
            writer.add_key_value(key, items, _value_type(vtype), _value_type(item))
        else:
            writer.add_key_value(key, value, _value_type(vtype))


def write_gguf_header(path: str | os.PathLike, metadata: dict[str, Any],
                      tensors: dict[str, TensorInfo],
                      value_types: dict[str, tuple[int, int | None]] | None = None
                      ) -> tuple[int, int]:
    """The file `write_gguf` would write for `metadata` and tensors of these shapes and types,
    without their data: the header as written, then a sparse hole up to the file's full size
    (the reader checks the tensors' extents against it; nothing reads the weights).
    (the header's length up to the aligned start of the data, the file's size)."""
    import gguf

    path = str(path)
    writer = gguf.GGUFWriter(path, metadata.get("general.architecture", "unknown"),
                             use_temp_file=False)
    try:
        _add_metadata(writer, metadata, value_types)
        data = 0
        for name, t in tensors.items():
            writer.add_tensor_info(name, t.shape, np.dtype(np.float32), t.nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType(t.ggml_type))
            data += gguf.GGUFWriter.ggml_pad(t.nbytes, writer.data_alignment)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        with open(path, "r+b") as f:
            start = gguf.GGUFWriter.ggml_pad(f.seek(0, os.SEEK_END), writer.data_alignment)
            f.truncate(start + data)
        return start, start + data
    except BaseException:
        writer.close()
        raise


def _short_write_on_full_disk(exc: OSError, tmp: str) -> bool:
    """Is `exc` a short write on a full disk? NumPy's tofile, which the gguf writer writes
    tensors with, reports one as an OSError without an errno ("143360 requested and 65536
    written"); when the folder's disk has less free space than the bytes left unwritten, it
    is a full disk (ENOSPC, so that the caller's files.storage_error says "no space left in
    DIR"). A full quota with free space on the disk keeps the error as it is."""
    found = re.search(r"(\d+) requested and (\d+) written", str(exc))
    if exc.errno is not None or found is None:
        return False
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(tmp))).free
    except OSError:
        return False
    return free < int(found[1]) - int(found[2])


def _make_own_temporary(tmp: str) -> None:
    """Create `tmp` as a new regular file before the gguf writer opens it by name: whatever lay
    at that name (a leftover of a process with the same pid, or a link planted in a run folder)
    is removed, never written through."""
    if os.path.lexists(tmp):
        os.remove(tmp)      # a link is removed, not its target
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                     0o644))


# ---- quantizing (for writing) ------------------------------------------------------------------

def quantize(array, ggml_type: int) -> np.ndarray:
    """Float values in NumPy shape -> raw uint8 rows (*shape[:-1], row_bytes) of `ggml_type`,
    ready for `write_gguf` as `(raw, ggml_type)`.

    F32 and F16 are plain casts; BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (and the other types the
    `gguf` package implements) are bit-exact with ggml's reference quantizers. Types `gguf`
    cannot produce (K-quants, IQ*) and rows whose length is not a multiple of the type's block
    size raise UnsupportedModelError.
    """
    import gguf

    arr = np.ascontiguousarray(array, dtype=np.float32)
    if ggml_type not in BLOCK_SIZES:
        raise UnsupportedModelError(f"Unknown ggml type {ggml_type}.")
    block_elems, block_bytes = BLOCK_SIZES[ggml_type]
    if arr.ndim == 0 or arr.shape[-1] % block_elems:
        raise UnsupportedModelError(
            f"Rows of {arr.shape[-1] if arr.ndim else 0} values cannot be stored as "
            f"{type_name(ggml_type)} (blocks of {block_elems}).",
            "Pick a type whose block size divides the row length, e.g. F16.")
    if ggml_type == 0:
        out = arr
    elif ggml_type == 1:
        out = arr.astype(np.float16)
    else:
        try:
            out = gguf.quants.quantize(arr, gguf.GGMLQuantizationType(ggml_type))
        except (NotImplementedError, gguf.quants.QuantError, ValueError):
            raise UnsupportedModelError(
                f"The gguf package cannot quantize to {type_name(ggml_type)}.",
                "Use Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16 or BF16 (llama-quantize makes K-quants)."
            ) from None
    row_bytes = arr.shape[-1] // block_elems * block_bytes
    return np.ascontiguousarray(out).view(np.uint8).reshape(*arr.shape[:-1], row_bytes)
