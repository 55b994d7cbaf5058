"""A GGUF header read before its weights: how many leading bytes it takes, and what fits.

`header_length(prefix)` walks the GGUF layout (magic, version, counts, metadata, tensor infos;
gguf's spec, docs/gguf.md in ggml) over the bytes fetched so far and answers the header's length,
or None while more bytes are needed. The caller fetches ranges until it has them, writes them to
a sparse file of the file's full size (the reader checks tensor extents against the size; the
weights are never read), and `fits_here` reads that file with the model card's reader and the
training memory estimate, exactly as for a file on disk.
"""

from __future__ import annotations

import os
import struct
import tempfile
from dataclasses import dataclass

from app.engine.errors import EngineError, ModelFormatError
from app.engine.hub.names import FILE_TYPES
from app.engine.model.card import describe_model, human_bytes
from app.engine.runtime.backend import array_module, device_memory
from app.engine.training.memory import estimate_memory

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
MAX_HEADER = 256 << 20         # a header past this is not a model's (the largest vocabularies
                               # take tens of MB)


class _NeedMore(Exception):
    pass


def header_length(prefix: bytes) -> int | None:
    """The byte length of the GGUF header (up to the aligned start of the tensor data) in
    `prefix`, None when `prefix` ends before the header does. ModelFormatError when the bytes
    are not a GGUF header."""
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(prefix):
            raise _NeedMore
        out = prefix[pos:pos + n]
        pos += n
        return out

    def u32() -> int:
        return struct.unpack("<I", take(4))[0]

    def u64() -> int:
        return struct.unpack("<Q", take(8))[0]

    def skip(n: int) -> None:
        nonlocal pos
        if n > MAX_HEADER:
            raise ModelFormatError("The file's header is not a GGUF header (absurd sizes).",
                                   "Pick another file.")
        if pos + n > len(prefix):
            raise _NeedMore
        pos += n

    def value(vtype: int) -> int | None:
        if vtype in _SCALAR:
            raw = take(_SCALAR[vtype])
            return int.from_bytes(raw, "little") if vtype in (4, 10) else None
        if vtype == _STRING:
            skip(u64())
            return None
        if vtype == _ARRAY:
            item, count = u32(), u64()
            if item in _SCALAR:
                skip(_SCALAR[item] * count)
            elif item == _STRING:
                if count > MAX_HEADER:
                    raise ModelFormatError("The file's header is not a GGUF header.", "")
                for _ in range(count):
                    skip(u64())
            else:
                raise ModelFormatError(f"The GGUF header has an array of type {item}.", "")
            return None
        raise ModelFormatError(f"The GGUF header has a value of type {vtype}.",
                               "The file is not a GGUF model the workbench reads.")

    try:
        if take(4) != b"GGUF":
            raise ModelFormatError("The file does not start with \"GGUF\": it is not a GGUF "
                                   "model.", "Pick a .gguf file of the repository.")
        u32()                                   # version
        n_tensors, n_kv = u64(), u64()
        if n_tensors > 1 << 24 or n_kv > 1 << 24:
            raise ModelFormatError("The file's header is not a GGUF header (absurd counts).",
                                   "Pick another file.")
        alignment = 32
        for _ in range(n_kv):
            n = u64()
            if n > 1 << 16:
                raise ModelFormatError("The file's header is not a GGUF header (a key of "
                                       f"{n:,} bytes).", "Pick another file.")
            key = take(n)
            found = value(u32())
            if key == b"general.alignment" and found:
                alignment = found
        for _ in range(n_tensors):
            skip(u64())                          # name
            skip(8 * u32())                      # dimensions
            take(12)                             # type, offset
    except _NeedMore:
        return None
    return -(-pos // alignment) * alignment


@dataclass(frozen=True)
class Fit:
    """What fits here: `supported` (the architecture, read from the header), `need` the
    estimate of a LoRA run (bytes), `have` this machine's memory; `note` says it in words;
    `quant` the quant type the header says (general.file_type; "" when it says none)."""

    architecture: str
    supported: bool
    need: int | None
    have: int | None
    note: str
    quant: str = ""

    @property
    def fits(self) -> bool | None:
        if not self.supported or self.need is None or self.have is None:
            return None if self.supported else False
        return self.need <= self.have

    def to_dict(self) -> dict:
        return {"architecture": self.architecture, "supported": self.supported,
                "need": self.need, "have": self.have, "fits": self.fits, "note": self.note,
                "quant": self.quant}


def fits_here(prefix: bytes, file_size: int, name: str, rank: int = 16, context: int = 512) -> Fit:
    """The architecture check and the training estimate (LoRA at `rank`, `context` tokens, the
    model card's estimate) of the model whose header is `prefix` and whose file has
    `file_size` bytes, against this machine's memory."""
    with tempfile.TemporaryDirectory(prefix="wb-header-") as folder:
        path = os.path.join(folder, os.path.basename(name) or "model.gguf")
        try:
            with open(path, "wb") as f:
                f.write(prefix)
                f.truncate(max(file_size, len(prefix)))     # sparse: the weights take no space
        except OSError as e:                # a size past what the file system holds (EFBIG)
            raise ModelFormatError(
                f"{os.path.basename(name)} is said to be {file_size:,} bytes, which cannot be "
                f"checked here ({e.strerror or e}).",
                "Check HF_ENDPOINT: the size does not look like a model's.") from None
        arch, quant = _header_facts(path)
        try:
            card = describe_model(path, rank=rank, context=context)
        except EngineError as e:
            return Fit(arch, False, None, None, e.message, quant)
    need = estimate_memory(card, card.lora_params).total
    try:
        have = device_memory(array_module("cpu"))[1]
    except (ValueError, OSError, AttributeError):
        have = None
    if have is None:
        note = f"needs about {human_bytes(need)} to train (LoRA rank {rank}, context {context})"
    else:
        verdict = "fits" if need <= have else "does not fit"
        note = (f"{verdict}: needs about {human_bytes(need)} to train (LoRA rank {rank}, "
                f"context {card.context}), this machine has {human_bytes(have)}")
    return Fit(card.config.arch, True, need, have, note, quant)


def _header_facts(path: str) -> tuple[str, str]:
    """(general.architecture, the quant general.file_type names) of a header, "" for what it
    does not say (or when it cannot be read: the card says why)."""
    from app.engine.io.gguf import read_gguf

    try:
        f = read_gguf(path)
    except EngineError:
        return "", ""
    try:
        file_type = f.metadata.get("general.file_type")
        quant = FILE_TYPES.get(int(file_type), "") if isinstance(file_type, int) else ""
        return str(f.metadata.get("general.architecture", "")), quant
    finally:
        f.close()


def quant_shown(named: str, fit: Fit | None) -> str:
    """A model's quant for a listing: the file name's, confirmed by the header ("Q8_0"), the
    header's when the name says none, both when they differ ("Q4_K_M (header: Q8_0)")."""
    header = fit.quant if fit is not None else ""
    base = named.upper().removeprefix("UD-").removesuffix("_XL")   # Unsloth's name variants
    if not header or header == base or (named and header.startswith(base + "_")):
        return named or header or "-"
    return f"{named} (header: {header})" if named else header
