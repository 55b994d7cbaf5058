"""Files the engine reads that the user names (datasets, validation data, weights files, GRPO
prompts, config files, reward files): checked before they are opened, read so that a stop
request is heard, and fingerprinted so that a resumed run notices when one changed.

- `check_input_file` / `open_input`: an input must be a regular file (of at most `max_bytes`
  where a cap makes sense, e.g. a config). `os.stat` comes first because open() itself blocks
  forever on a FIFO and a device such as /dev/zero never ends; the open uses O_NONBLOCK and
  checks the opened file again, so a file swapped for a pipe in between cannot block either.
- `StopCheck`: a reader's loop calls it as often as it likes (every line); it asks the run's
  `should_stop` every STOP_EVERY_S seconds, by the clock, and raises `Cancelled` when the
  answer is a request to stop, so a cancel, a pause or SIGTERM is heard within a second
  whatever the rows look like.
- `fingerprint` / `fingerprint_changes`: size, mtime and SHA-256 of a file's first and last
  64 KiB and of 16 samples between them (about 1.1 MB read, whatever the size): cheap enough
  for a many-GB model at every resume, and it catches a swapped, truncated, appended or edited
  file (an edit of a few bytes between the samples of the same size and mtime goes unnoticed).
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import BinaryIO, Callable

from app.engine.errors import Cancelled, DatasetError, EngineError
from app.engine.runtime.files import check_regular, open_regular

CONFIG_MAX_BYTES = 1 << 20     # a run config is a few KB; a larger "config" is not one
EDGE_BYTES = 64 << 10          # a fingerprint hashes the first and last 64 KiB ...
SAMPLES, SAMPLE_BYTES = 16, 4 << 10   # ... and 16 samples of 4 KiB spread between them


def check_input_file(path, what: str, *, max_bytes: int | None = None,
                     error: type[EngineError] = DatasetError) -> os.stat_result:
    """The stat of `path`, an input the user named ("dataset", "config file", ...): `error`
    when it is missing, unreadable, not a regular file or larger than `max_bytes`
    (files.check_regular)."""
    shown = os.fspath(path)
    try:
        st = os.stat(path)
    except (OSError, ValueError) as exc:   # ValueError: a NUL in the path
        raise _unreadable(shown, what, exc, error) from None
    check_regular(st, shown, what, max_bytes=max_bytes, error=error)
    return st


def open_input(path, what: str, *, max_bytes: int | None = None,
               error: type[EngineError] = DatasetError) -> BinaryIO:
    """`path` opened for binary reading once `check_input_file` accepts it, through
    files.open_regular: it may have been replaced by a pipe in between, so the opened file is
    checked again, and the open cannot block."""
    try:
        fd = open_regular(path, what, max_bytes=max_bytes, error=error)
    except (OSError, ValueError) as exc:
        raise _unreadable(os.fspath(path), what, exc, error) from None
    return os.fdopen(fd, "rb")


def _unreadable(shown: str, what: str, exc: Exception, error: type[EngineError]) -> EngineError:
    return error(f"Cannot read the {what} {shown}: {getattr(exc, 'strerror', None) or exc}.",
                 "Check the path and that the file is readable.")


STOP_EVERY_S = 0.5   # how often a reader asks should_stop (tests set 0: at every call)


class StopCheck:
    """`check()` raises Cancelled when `should_stop()` asks to stop (any true value: "pause",
    "cancel"), asking it every STOP_EVERY_S seconds by the clock (the first time that long
    after the start: reading a small file costs no question). With `should_stop` None it never
    stops."""

    def __init__(self, should_stop: Callable[[], object] | None, what: str = "reading"):
        self.should_stop, self.what = should_stop, what
        self._next = time.monotonic() + STOP_EVERY_S

    def __call__(self) -> None:
        if self.should_stop is None:
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + STOP_EVERY_S
        if self.should_stop():
            raise Cancelled(f"Stopped while {self.what}.",
                            "Nothing was trained yet; run or resume it again to start over.")


NEVER = StopCheck(None)


# ---- fingerprints ------------------------------------------------------------------------------

def fingerprint(path, what: str = "file") -> dict:
    """{"path", "size", "mtime_ns", "sha256"} of a file: sha256 over its first and last
    EDGE_BYTES and SAMPLES samples between them (see the module docstring). An EngineError
    naming the file as `what` when it is not a readable regular file."""
    with open_input(path, what, error=EngineError) as f:
        size = os.fstat(f.fileno()).st_size
        mtime_ns = os.fstat(f.fileno()).st_mtime_ns
        h = hashlib.sha256(size.to_bytes(8, "little"))
        offsets = [0, max(size - EDGE_BYTES, 0)]
        offsets += [size * (k + 1) // (SAMPLES + 1) for k in range(SAMPLES)]
        for offset in sorted(set(offsets)):
            f.seek(offset)
            h.update(f.read(EDGE_BYTES if offset in offsets[:2] else SAMPLE_BYTES))
    return {"path": os.fspath(path), "size": size, "mtime_ns": mtime_ns, "sha256": h.hexdigest()}


def fingerprint_changes(recorded: dict) -> tuple[list[str], bool]:
    """(what changed in the file since `recorded` was taken, only its mtime changed?): e.g.
    ["size 100 -> 80 bytes", "content"]; ([], True) for a touched file of the same content."""
    path = recorded["path"]
    try:
        now = fingerprint(path)
    except EngineError as exc:
        return [exc.message], False
    changes = []
    if now["size"] != recorded.get("size"):
        changes.append(f"size {recorded.get('size')} -> {now['size']} bytes")
    if now["sha256"] != recorded.get("sha256"):
        changes.append("content")
    return changes, not changes and now["mtime_ns"] != recorded.get("mtime_ns")
