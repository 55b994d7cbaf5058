"""Fuzzing the GGUF reader, the config builder and the model/adapter loaders with corrupt files.

GGUF files are untrusted input. The contract: `read_gguf`, `load_model` (and `logits` on a model
that loaded) and `load_adapter` either succeed or raise an `EngineError` subclass with a clear
message. Never another exception, a crash, a hang or a huge allocation.

Every fuzz case mutates a small golden file (tests/data/golden) and runs in a long-lived worker
subprocess (`_Worker`). The worker has an address-space limit (RLIMIT_AS, where the platform
has one) and measures each case's tracemalloc peak. A crash (segfault, abort) or a hang kills
only the worker, and the case fails with what the worker printed. Hypothesis runs with
`derandomize=True` and no example database, so every run tests the same cases
(tests/fuzz.py: `WORKBENCH_FUZZ=long` for a longer, random hunt).

Mutations: random bytes in the header (everything before `data_offset`); huge values in the u64
count/length/dimension/offset fields; truncation (header and tensor data); inserted and deleted
bytes; bad magic and version; tensor dimensions, types and offsets; extreme values and wrong
types in the metadata scalars (the config builder reads these).
"""

from __future__ import annotations

import json
import os
import queue
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.engine import EngineError, ModelFormatError, load_adapter, load_model
from app.engine.io.gguf import read_gguf
from tests.conftest import GOLDEN, REPO
from tests.fuzz import fuzz, fuzz_settings

GOLDEN = GOLDEN
MODEL_FILES = ("llama-q8_0.gguf", "mixtral-q4_0.gguf", "qwen2-f32.gguf", "gemma3-q8_0.gguf")
ADAPTER_FILES = ("mixtral-lora.gguf",)
ALL_FILES = MODEL_FILES + ADAPTER_FILES

MAX_PEAK_BYTES = 200 << 20     # tracemalloc peak of one case
ADDRESS_SPACE_HEADROOM = 1 << 30  # RLIMIT_AS above the warmed-up worker: the hard backstop
HANG_SECONDS = 10.0            # no answer from the worker in this time: a hang

HUGE_U64 = (2**63 - 1, 2**64 - 1, 2**40, 2**63, 2**62, 2**32, 2**32 - 1, 2**31)


pytestmark = [pytest.mark.slow, fuzz]   # ~35 s in all


def gguf_fuzz_settings(max_examples: int):
    """No per-example deadline: a wall-clock limit failed one example (1.1 s) on a busy 2-core
    machine; a hang is HANG_SECONDS without an answer from the worker."""
    return fuzz_settings(max_examples)


# ---------------------------------------------------------------------------- the golden files
# An independent walk over a valid GGUF header: where every field is, so that the strategies
# can aim at counts, lengths, types, dimensions and offsets rather than only at token text.

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_PACK = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B",
                10: "<Q", 11: "<q", 12: "<d"}
U64_KINDS = ("count", "key_len", "str_len", "arr_count", "arr_str_len", "name_len", "dim",
             "toffset")


@dataclass(frozen=True)
class Field:
    kind: str       # see U64_KINDS, plus magic version value_type scalar arr_item_type n_dims ttype
    offset: int
    size: int
    vtype: int = -1  # metadata value type of a "scalar"
    label: str = ""  # metadata key or tensor name


@dataclass(frozen=True)
class Golden:
    name: str
    data: bytes = field(repr=False)
    data_offset: int
    fields: dict[str, tuple[Field, ...]] = field(repr=False)
    tensor_spans: tuple[tuple[int, int], ...] = field(repr=False)  # absolute [start, end)
    kv_spans: dict[str, tuple[int, int]] = field(repr=False)       # key -> [start, end) of entry

    @property
    def kind(self) -> str:
        return "adapter" if self.name in ADAPTER_FILES else "model"


@cache
def golden(name: str) -> Golden:
    data = (GOLDEN / name).read_bytes()
    fields: dict[str, list[Field]] = {}
    pos = 0

    def add(kind, size, **kw) -> int:
        nonlocal pos
        fields.setdefault(kind, []).append(Field(kind, pos, size, **kw))
        value = int.from_bytes(data[pos:pos + size], "little") if size in (4, 8) else None
        pos += size
        return value

    def string(kind) -> str:
        nonlocal pos
        n = add(kind, 8)
        pos += n
        return data[pos - n:pos].decode("utf-8", "surrogateescape")

    add("magic", 4)
    add("version", 4)
    n_tensors, n_kv = add("count", 8), add("count", 8)
    kv_spans = {}
    for _ in range(n_kv):
        kv_start = pos
        key = string("key_len")
        vtype = add("value_type", 4, label=key)
        if vtype == 8:
            string("str_len")
        elif vtype == 9:
            item_type = add("arr_item_type", 4, label=key)
            count = add("arr_count", 8, label=key)
            for _ in range(count):
                if item_type == 8:
                    string("arr_str_len")
                else:
                    pos += _SCALAR_SIZES[item_type]
        else:
            add("scalar", _SCALAR_SIZES[vtype], vtype=vtype, label=key)
        kv_spans[key] = (kv_start, pos)
    infos = []
    for _ in range(n_tensors):
        tname = string("name_len")
        n_dims = add("n_dims", 4, label=tname)
        ne = [add("dim", 8, label=tname) for _ in range(n_dims)]
        ggml_type = add("ttype", 4, label=tname)
        infos.append((ne, ggml_type, add("toffset", 8, label=tname)))

    f = read_gguf(GOLDEN / name)
    assert f.data_offset == -(-pos // 32) * 32, "the walk and the reader disagree"
    spans = tuple(sorted((t.offset, t.offset + t.nbytes) for t in f.tensors.values()))
    f.close()
    return Golden(name, data, f.data_offset, {k: tuple(v) for k, v in fields.items()}, spans,
                  kv_spans)


def encode_kv(key: str, vtype: int, value) -> bytes:
    """One metadata entry: key, value type, value (arrays: `value` = (item_type, items))."""
    def enc(t, v):
        if t == 8:
            raw = v.encode()
            return struct.pack("<Q", len(raw)) + raw
        if t == 9:
            item_type, items = v
            return struct.pack("<IQ", item_type, len(items)) + b"".join(enc(item_type, i)
                                                                       for i in items)
        return struct.pack(_SCALAR_PACK[t], v)
    return enc(8, key) + struct.pack("<I", vtype) + enc(vtype, value)


def with_metadata(name: str, changes: dict[str, bytes | None]) -> bytes:
    """The golden file with metadata entries replaced, added (encode_kv) or dropped (None).

    The tensor data moves to the next aligned position after the new header; tensor offsets
    are relative to it, so the file stays valid apart from the changed entries.
    """
    g = golden(name)
    kv_end = max(end for _, end in g.kv_spans.values())
    entries = {k: g.data[a:b] for k, (a, b) in g.kv_spans.items()}
    for key, raw in changes.items():
        if raw is None:
            del entries[key]
        else:
            entries[key] = raw
    tensor_infos = g.data[kv_end:max(f.offset + f.size for f in g.fields["toffset"])]
    n_tensors = struct.unpack_from("<Q", g.data, 8)[0]
    header = (g.data[:8] + struct.pack("<QQ", n_tensors, len(entries))
              + b"".join(entries.values()) + tensor_infos)
    return header + bytes(-len(header) % 32) + g.data[g.data_offset:]


def put(buf: bytearray, fld: Field, value: int | float, fmt: str | None = None) -> None:
    """Overwrite a field in place with `value` (unsigned little-endian of the field's size)."""
    if fmt is None:
        fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[fld.size]
    struct.pack_into(fmt, buf, fld.offset, value)


@dataclass(frozen=True)
class Case:
    """One mutated file: hypothesis prints the file name and the mutation, not the bytes."""

    file: str
    mutation: str
    data: bytes = field(repr=False)
    kind: str = "model"

    def __repr__(self) -> str:
        return f"Case({self.file!r}, {self.mutation!r})"

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis' printer: no 100 KB of bytes
        printer.text(repr(self))


def case(g: Golden, mutation: str, buf) -> Case:
    return Case(g.name, mutation, bytes(buf), g.kind)


# ---------------------------------------------------------------------------- the worker

_WORKER = r"""
import faulthandler, gc, json, os, sys, time, tracemalloc, traceback, warnings
faulthandler.enable()
warnings.simplefilter("ignore")          # NaN/overflow warnings of a corrupt model are fine
import numpy as np
from app.engine import EngineError, load_adapter, load_model
from app.engine.io.gguf import read_gguf

def run(path, kind):
    stage = "read_gguf"
    try:
        read_gguf(path)
        if kind == "adapter":
            stage = "load_adapter"
            load_adapter(path)
            return {"status": "ok", "stage": stage}
        stage = "load_model"
        model = load_model(path)
        stage = "logits"
        out = model.logits([1, 2, 3])
        if not isinstance(out, np.ndarray) or out.shape != (3, model.config.n_vocab):
            return {"status": "error", "stage": stage, "type": "WrongOutput",
                    "message": f"logits gave {type(out).__name__} {getattr(out, 'shape', '')}"}
        return {"status": "ok", "stage": stage}
    except EngineError as e:
        return {"status": "engine_error", "stage": stage, "type": type(e).__name__,
                "message": str(e)}
    except BaseException as e:
        return {"status": "error", "stage": stage, "type": type(e).__name__,
                "message": str(e)[:2000], "traceback": traceback.format_exc()[-6000:]}

# Warm up (lazy imports, tables), then cap the address space above what that took.
for warm in sys.argv[1:]:
    run(warm, "adapter" if "lora" in warm else "model")
gc.collect()
try:
    import resource
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + int(os.environ["FUZZ_AS_HEADROOM"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
except (ImportError, OSError, StopIteration, ValueError):
    pass                                   # no RLIMIT_AS here: tracemalloc still measures
tracemalloc.start()
print(json.dumps({"status": "ready"}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    gc.collect()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    res = run(req["path"], req["kind"])
    res["seconds"] = time.perf_counter() - t0
    res["peak"] = tracemalloc.get_traced_memory()[1] - base
    print(json.dumps(res), flush=True)
"""


class _Worker:
    """A subprocess that loads files on request; restarted after a crash or a hang."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue = queue.Queue()
        self.counter = 0

    def start(self) -> None:
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
                   MKL_NUM_THREADS="1", FUZZ_AS_HEADROOM=str(ADDRESS_SPACE_HEADROOM))
        self.stderr_path = self.tmp / "worker-stderr.txt"
        root = REPO
        warm = [str(GOLDEN / n) for n in ALL_FILES]
        with open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER, *warm], cwd=root, env=env, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
        self.lines = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines),
                         daemon=True).start()
        ready = self._answer(HANG_SECONDS * 3)
        assert ready.get("status") == "ready", f"the fuzz worker did not start: {ready}"

    @staticmethod
    def _pump(stream, lines: queue.Queue) -> None:
        with stream:
            for line in stream:
                lines.put(line)
        lines.put(None)

    def _answer(self, timeout: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.stop()
            return {"status": "hang", "message": f"no answer in {timeout:.0f} s"}
        if line is None:
            rc = self.proc.wait()
            self.proc.stdin.close()
            self.proc = None
            return {"status": "crash", "message": f"worker died with exit code {rc}",
                    "traceback": self.stderr_path.read_text(errors="replace")[-6000:]}
        return json.loads(line)

    def run(self, data: bytes, kind: str) -> dict:
        """Load `data` as a file of this kind ("model" or "adapter"); the worker's answer."""
        self.counter += 1
        path = self.tmp / f"case-{self.counter}.gguf"
        path.write_bytes(data)
        try:
            return self.run_path(path, kind)
        finally:
            try:
                path.unlink()
            except OSError:
                pass  # still mapped (Windows): the temporary folder goes away anyway

    def run_path(self, path: Path, kind: str) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.proc.stdin.write(json.dumps({"path": str(path), "kind": kind}) + "\n")
        self.proc.stdin.flush()
        return self._answer(HANG_SECONDS)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdin.close()
            self.proc = None


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = _Worker(tmp_path_factory.mktemp("gguf-fuzz"))
    w.start()
    yield w
    w.stop()


def check(worker: _Worker, c: Case) -> None:
    """The contract: success or an EngineError, within the memory bound."""
    res = worker.run(c.data, c.kind)
    where = f"{c.file} [{c.mutation}] at {res.get('stage', '?')}"
    assert res["status"] in ("ok", "engine_error"), (
        f"{where}: {res['status']} {res.get('type', '')}: {res.get('message', '')}\n"
        f"{res.get('traceback', '')}")
    assert res["peak"] < MAX_PEAK_BYTES, f"{where}: allocated {res['peak'] >> 20} MB"


# ---------------------------------------------------------------------------- strategies

goldens = st.sampled_from(ALL_FILES).map(golden)


@st.composite
def any_field(draw, g: Golden, kinds=None) -> Field:
    """A field of the header: first a kind (so the 259 token strings do not dominate), then one."""
    kinds = sorted(k for k in g.fields if kinds is None or k in kinds)
    return draw(st.sampled_from(g.fields[draw(st.sampled_from(kinds))]))


@st.composite
def header_bytes(draw) -> Case:
    """Flip bits in / overwrite 1-8 bytes before data_offset, half of them inside fields."""
    g = draw(goldens)
    buf, done = bytearray(g.data), []
    for _ in range(draw(st.integers(1, 8))):
        if draw(st.booleans()):
            fld = draw(any_field(g))
            pos = fld.offset + draw(st.integers(0, fld.size - 1))
        else:
            pos = draw(st.integers(0, g.data_offset - 1))
        if draw(st.booleans()):
            bit = draw(st.integers(0, 7))
            buf[pos] ^= 1 << bit
            done.append(f"flip bit {bit} of byte {pos}")
        else:
            buf[pos] = draw(st.integers(0, 255))
            done.append(f"byte {pos} = {buf[pos]}")
    return case(g, "; ".join(done), buf)


@st.composite
def huge_u64(draw) -> Case:
    """Set one or two u64 counts/lengths/dimensions/offsets to a huge value."""
    g = draw(goldens)
    buf, done = bytearray(g.data), []
    for _ in range(draw(st.integers(1, 2))):
        fld = draw(any_field(g, U64_KINDS))
        value = draw(st.sampled_from(HUGE_U64) | st.integers(len(g.data), 2**64 - 1))
        put(buf, fld, value)
        done.append(f"{fld.kind} {fld.label!r} at {fld.offset} = {value}")
    return case(g, "; ".join(done), buf)


@st.composite
def truncated(draw) -> Case:
    """Cut the file: anywhere, in the header, at a field or tensor boundary, inside a tensor."""
    g = draw(goldens)
    ends = [f.offset for fs in g.fields.values() for f in fs] + [g.data_offset]
    ends += [e for span in g.tensor_spans for e in span]
    start, end = draw(st.sampled_from(g.tensor_spans))
    length = draw(st.integers(0, len(g.data) - 1)
                  | st.integers(0, g.data_offset)
                  | st.sampled_from(sorted(set(ends) - {len(g.data)}))
                  | st.integers(start + 1, end - 1))
    return case(g, f"truncated to {length} of {len(g.data)} bytes", g.data[:length])


@st.composite
def inserted_deleted(draw) -> Case:
    """Insert or delete 1-64 bytes, mostly in the header."""
    g = draw(goldens)
    pos = draw(st.integers(0, g.data_offset) | st.integers(0, len(g.data)))
    if draw(st.booleans()):
        extra = draw(st.binary(min_size=1, max_size=64))
        return case(g, f"insert {extra!r} at {pos}", g.data[:pos] + extra + g.data[pos:])
    n = draw(st.integers(1, 64))
    return case(g, f"delete {n} bytes at {pos}", g.data[:pos] + g.data[pos + n:])


@st.composite
def magic_version(draw) -> Case:
    g = draw(goldens)
    buf = bytearray(g.data)
    magic = draw(st.sampled_from([b"GGUF", b"GGML", b"GGJT", b"GGLA", b"FUGG", b"gguf", b"\0" * 4])
                 | st.binary(min_size=4, max_size=4))
    version = draw(st.sampled_from([0, 1, 2, 3, 4, 2**31, 2**32 - 1, 0x03000000])
                   | st.integers(0, 2**32 - 1))
    buf[0:4] = magic
    struct.pack_into("<I", buf, 4, version)
    return case(g, f"magic {magic!r}, version {version}", buf)


@st.composite
def tensor_dims(draw) -> Case:
    """One dimension (or the dimension count) of one tensor: 0, 1, +-1, doubled, random, huge."""
    g = draw(goldens)
    buf = bytearray(g.data)
    if draw(st.integers(0, 4)) == 0:
        fld = draw(any_field(g, ("n_dims",)))
        value = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 2**32 - 1]))
    else:
        fld = draw(any_field(g, ("dim",)))
        old = int.from_bytes(g.data[fld.offset:fld.offset + 8], "little")
        value = draw(st.sampled_from([0, 1, old - 1, old + 1, old * 2, old // 2, 2**16, 2**31,
                                      2**32, 2**40, 2**63 - 1, 2**64 - 1])
                     | st.integers(0, 2**20) | st.integers(0, 2**64 - 1))
        value = max(value, 0)
    put(buf, fld, value)
    return case(g, f"{fld.kind} of {fld.label!r} = {value}", buf)


KNOWN_TYPES = tuple(range(0, 42))


@st.composite
def tensor_types(draw) -> Case:
    """One tensor's ggml type: any id 0-41 (known ones and the gaps), or an unknown big id."""
    g = draw(goldens)
    buf = bytearray(g.data)
    fld = draw(any_field(g, ("ttype",)))
    value = draw(st.sampled_from(KNOWN_TYPES) | st.integers(42, 2**32 - 1)
                 | st.sampled_from([2**31, 2**32 - 1]))
    put(buf, fld, value)
    return case(g, f"type of {fld.label!r} = {value}", buf)


@st.composite
def tensor_offsets(draw) -> Case:
    """One tensor's data offset: misaligned, another tensor's, past the end, random."""
    g = draw(goldens)
    buf = bytearray(g.data)
    fld = draw(any_field(g, ("toffset",)))
    old = int.from_bytes(g.data[fld.offset:fld.offset + 8], "little")
    other = draw(st.sampled_from(g.fields["toffset"]))
    other_off = int.from_bytes(g.data[other.offset:other.offset + 8], "little")
    size = len(g.data) - g.data_offset
    value = draw(st.integers(1, 31).map(lambda d: old + d)
                 | st.integers(1, 31).map(lambda d: max(old - d, 0))
                 | st.just(other_off)
                 | st.integers(0, size // 32).map(lambda k: 32 * k)
                 | st.sampled_from([size, size - 32, size + 32, 2**64 - 32, 2**63])
                 | st.integers(0, 2**64 - 1))
    put(buf, fld, value)
    return case(g, f"offset of {fld.label!r} = {value} (was {old})", buf)


_EXTREME_INTS = (0, 1, 2, 3, 5, 7, 255, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1,
                 2**63 - 1, 2**64 - 1)
_EXTREME_FLOATS = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1.0, 1e-45, 1e-30,
                   3.4e38, -3.4e38)


@st.composite
def metadata_values(draw) -> Case:
    """A metadata scalar (block_count, head counts, eps, ...) set to an extreme value of its
    type, or its value type changed (same size: reinterpreted; other size: misparsed)."""
    g = draw(goldens)
    buf = bytearray(g.data)
    if draw(st.integers(0, 3)) == 0:
        fld = draw(any_field(g, ("value_type", "arr_item_type")))
        value = draw(st.integers(0, 13) | st.integers(0, 2**32 - 1))
        put(buf, fld, value)
        return case(g, f"{fld.kind} of {fld.label!r} = {value}", buf)
    fld = draw(any_field(g, ("scalar",)))
    fmt = _SCALAR_PACK[fld.vtype]
    if fld.vtype in (6, 12):
        extreme = _EXTREME_FLOATS + ((1e300, -1e300, 5e-324) if fld.vtype == 12 else ())
        value = draw(st.sampled_from(extreme) | st.floats(width=32 if fld.vtype == 6 else 64))
    else:
        bits = fld.size * 8
        lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if fmt[1].islower() else (0, 2**bits - 1)
        old = struct.unpack_from(fmt, g.data, fld.offset)[0]
        value = draw(st.sampled_from(_EXTREME_INTS + (old - 1, old + 1, old * 2, -1))
                     | st.integers(lo, hi))
        value = min(max(value, lo), hi)
    put(buf, fld, value, fmt)
    return case(g, f"{fld.label!r} ({fld.vtype}) = {value!r}", buf)


# ---------------------------------------------------------------------------- fuzz tests

@gguf_fuzz_settings(300)
@given(header_bytes())
def test_fuzz_header_bytes(worker, c):
    check(worker, c)


@gguf_fuzz_settings(300)
@given(huge_u64())
def test_fuzz_huge_counts_and_lengths(worker, c):
    check(worker, c)


@gguf_fuzz_settings(300)
@given(truncated())
def test_fuzz_truncated(worker, c):
    check(worker, c)


@gguf_fuzz_settings(300)
@given(inserted_deleted())
def test_fuzz_inserted_and_deleted_bytes(worker, c):
    check(worker, c)


@gguf_fuzz_settings(100)
@given(magic_version())
def test_fuzz_magic_and_version(worker, c):
    check(worker, c)


@gguf_fuzz_settings(300)
@given(tensor_dims())
def test_fuzz_tensor_dimensions(worker, c):
    check(worker, c)


@gguf_fuzz_settings(300)
@given(tensor_types())
def test_fuzz_tensor_types(worker, c):
    check(worker, c)


@gguf_fuzz_settings(300)
@given(tensor_offsets())
def test_fuzz_tensor_offsets(worker, c):
    check(worker, c)


@gguf_fuzz_settings(500)
@given(metadata_values())
def test_fuzz_metadata_values(worker, c):
    check(worker, c)


# ---------------------------------------------------------------------------- exact cases

def _expect_format_error(path: Path, *words: str) -> None:
    """read_gguf, load_model and load_adapter all raise ModelFormatError mentioning `words`."""
    for loader in (read_gguf, load_model, load_adapter):
        with pytest.raises(ModelFormatError) as info:
            loader(path)
        message = str(info.value)
        for word in words:
            assert word in message, f"{loader.__name__}: {word!r} not in {message!r}"


def _mutated(tmp_path: Path, name: str, edit) -> Path:
    g = golden(name)
    buf = bytearray(g.data)
    buf = edit(g, buf) or buf
    path = tmp_path / f"mutated-{name}"
    path.write_bytes(bytes(buf))
    return path


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    _expect_format_error(path, "empty.gguf", "empty")


def test_directory(tmp_path):
    _expect_format_error(tmp_path, str(tmp_path), "folder")


def test_missing_file(tmp_path):
    _expect_format_error(tmp_path / "nope.gguf", "No such file", "nope.gguf")


def test_ggml_magic(tmp_path):
    def edit(g, buf):
        buf[0:4] = b"GGML"
    _expect_format_error(_mutated(tmp_path, "llama-q8_0.gguf", edit), "not a GGUF file", "GGML")


def test_version_1(tmp_path):
    def edit(g, buf):
        struct.pack_into("<I", buf, 4, 1)
    _expect_format_error(_mutated(tmp_path, "llama-q8_0.gguf", edit), "GGUF version 1")


@pytest.mark.parametrize("name", ["llama-q8_0.gguf", "mixtral-lora.gguf"])
def test_truncated_inside_tensor_data(tmp_path, name):
    g = golden(name)
    start, end = g.tensor_spans[len(g.tensor_spans) // 2]
    path = tmp_path / name
    path.write_bytes(g.data[:(start + end) // 2])
    _expect_format_error(path, "truncated", name)


def test_file_used_as_a_folder(tmp_path):
    _expect_format_error(GOLDEN / "llama-q8_0.gguf" / "x", "Cannot read")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_named_pipe(worker, tmp_path):
    # In the worker: before the fix, open() blocked forever waiting for a writer.
    os.mkfifo(tmp_path / "pipe.gguf")
    res = worker.run_path(tmp_path / "pipe.gguf", "model")
    assert (res["status"], res.get("type")) == ("engine_error", "ModelFormatError"), res
    assert "not a regular file" in res["message"]


def test_string_length_2_pow_63(tmp_path):
    def edit(g, buf):
        put(buf, g.fields["key_len"][0], 2**63)
    _expect_format_error(_mutated(tmp_path, "llama-q8_0.gguf", edit), "runs past the end")


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type"])
def test_array_count_2_pow_62(tmp_path, key):
    def edit(g, buf):
        put(buf, next(f for f in g.fields["arr_count"] if f.label == key), 2**62)
    _expect_format_error(_mutated(tmp_path, "llama-q8_0.gguf", edit), "runs past the end",
                         str(2**62))


def test_tensor_count_2_pow_60(tmp_path):
    def edit(g, buf):
        put(buf, g.fields["count"][0], 2**60)
    _expect_format_error(_mutated(tmp_path, "llama-q8_0.gguf", edit), "absurd counts",
                         str(2**60))


# Each of these let a non-EngineError escape (or hung) before the fixes in config.py/gguf_io.py.
u32 = lambda key, v: encode_kv(key, 4, v)  # noqa: E731

BAD_METADATA = [
    ("llama-q8_0.gguf", {"llama.block_count": u32("llama.block_count", 2**31 - 1)},
     "block_count"),                                       # hang + gigabytes in the loader
    ("llama-q8_0.gguf", {"llama.rope.dimension_count": u32("llama.rope.dimension_count", 7)},
     "rope.dimension_count"),                              # ValueError in rope_forward
    ("llama-q8_0.gguf", {"llama.rope.dimension_count": u32("llama.rope.dimension_count", 16)},
     "rope.dimension_count"),                              # wider than the head
    ("llama-q8_0.gguf", {"llama.attention.key_length": u32("llama.attention.key_length", 0)},
     "head size 0"),                                       # ZeroDivisionError
    ("llama-q8_0.gguf", {"llama.embedding_length": u32("llama.embedding_length", 0)},
     "embedding_length"),
    ("mixtral-q4_0.gguf", {"llama.expert_used_count": u32("llama.expert_used_count", 0)},
     "expert counts"),                                     # ValueError in the MoE combine
    ("mixtral-q4_0.gguf", {"llama.expert_used_count": u32("llama.expert_used_count", 5)},
     "expert counts"),
    ("mixtral-q4_0.gguf", {"llama.expert_count": u32("llama.expert_count", 2**20)},
     "expert_count"),
    ("llama-q8_0.gguf", {"llama.vocab_size": None,
                         "tokenizer.ggml.tokens": u32("tokenizer.ggml.tokens", 5)},
     "no vocabulary"),                                     # TypeError: len() of an int
    ("gemma3-q8_0.gguf", {"gemma3.attention.sliding_window_pattern":
                          encode_kv("gemma3.attention.sliding_window_pattern", 8, "six")},
     "sliding_window_pattern"),                            # ValueError: int("six")
    ("gemma3-q8_0.gguf", {"gemma3.attention.sliding_window_pattern":
                          encode_kv("gemma3.attention.sliding_window_pattern", 9, (7, [True]))},
     "1 entries for 3 layers"),                            # IndexError in the forward pass
    ("llama-q8_0.gguf", {"general.alignment": encode_kv("general.alignment", 8, "thirty-two")},
     "general.alignment"),                                 # ValueError/TypeError: int(...)
    ("llama-q8_0.gguf", {"general.alignment": encode_kv("general.alignment", 6, float("nan"))},
     "general.alignment"),
]


@pytest.mark.parametrize("name, changes, words", BAD_METADATA,
                         ids=[f"{n}:{next(iter(c))}" for n, c, _ in BAD_METADATA])
def test_bad_metadata_is_a_format_error(worker, name, changes, words):
    # In the worker: before the fix, the block_count case allocated gigabytes.
    res = worker.run(with_metadata(name, changes), "model")
    assert (res["status"], res.get("type")) == ("engine_error", "ModelFormatError"), res
    assert words in res["message"] and res["stage"] in ("read_gguf", "load_model"), res


def test_bias_of_the_wrong_length(tmp_path):
    """Found by test_fuzz_tensor_dimensions: blk.1.attn_q.bias (32,) -> (31,) loads, and the
    forward pass fails with a NumPy broadcast ValueError. Needs a shape check in model.py."""
    g = golden("qwen2-f32.gguf")
    buf = bytearray(g.data)
    put(buf, next(f for f in g.fields["dim"] if f.label == "blk.1.attn_q.bias"), 31)
    path = tmp_path / "bias31.gguf"
    path.write_bytes(bytes(buf))
    with pytest.raises(EngineError):
        load_model(path).logits([1, 2, 3])


def test_adapter_with_1d_lora_tensors(tmp_path):
    """A valid GGUF whose lora_a/lora_b are 1-D: load_adapter's shape check indexes
    shape[-2] (IndexError). Needs an ndim check in lora.py."""
    import gguf
    import numpy as np

    path = tmp_path / "lora-1d.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 8.0)
    for half in ("lora_a", "lora_b"):
        w.add_tensor(f"blk.0.attn_q.weight.{half}", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match=r"blk\.0\.attn_q\.weight"):
        load_adapter(path)


def test_metadata_rewrite_keeps_the_file_valid(tmp_path):
    """The helper above: unchanged and re-encoded entries give a loadable model."""
    path = tmp_path / "same.gguf"
    path.write_bytes(with_metadata("llama-q8_0.gguf", {"llama.block_count": u32(
        "llama.block_count", 2), "general.alignment": u32("general.alignment", 32)}))
    assert load_model(path).logits([1, 2, 3]).shape == (3, 259)


def test_unmutated_golden_files_load(worker):
    """The harness itself: the pristine files pass through the worker as successes."""
    for name in ALL_FILES:
        g = golden(name)
        res = worker.run(g.data, g.kind)
        assert res["status"] == "ok", res
