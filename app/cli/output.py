"""What the command line prints through: printing is never what fails a command or a run.

- A standard stream that is closed (`workbench info m.gguf >&-`: Python's sys.stdout is None)
  is opened on the null device at start (`ensure_standard_streams`), its file descriptor too,
  so that no file the command opens takes descriptor 1 or 2 and receives what others print.
- While a command runs, stdout and stderr are `Guarded`: a write to stdout that fails (a full
  disk: `> /mnt/full/out.txt`, `> /dev/full`) raises OutputError, which the CLI prints as
  "error: could not write the output: no space left on the device" (exit 2) instead of a
  traceback; a closed pipe stays BrokenPipeError (the reader went away: a quiet end). A write
  to stderr that fails is dropped: there is nowhere left to say anything, and a note on a full
  disk must not fail a run (it left a run folder with config.json and no status.json).
- Either way the descriptor is pointed at the null device (`silence`), so that Python's own
  flush at exit does not fail again on what is still buffered.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys

from app.engine.errors import EngineError


class OutputError(EngineError):
    """stdout could not be written (not a closed pipe)."""

    kind = "output"


def ensure_standard_streams() -> None:
    """Open the null device on each of descriptors 0, 1 and 2 that is closed, and give Python a
    stream for a sys.stdin/stdout/stderr that is None (a closed descriptor at start)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            with contextlib.suppress(OSError):
                opened = os.open(os.devnull, os.O_RDWR)   # the lowest free descriptor: fd
                if opened != fd:
                    os.dup2(opened, fd)
                    os.close(opened)
    for name, mode in (("stdin", "r"), ("stdout", "w"), ("stderr", "w")):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, mode, encoding="utf-8"))


def silence(stream) -> None:
    """Point `stream`'s descriptor at the null device: what it still buffers, and Python's
    flush at exit, go nowhere instead of failing again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no descriptor (a capture)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def reason(e: OSError) -> str:
    """Why a write failed, in words ("no space left on the device")."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the device"
    return (e.strerror or str(e)).lower()


class Guarded:
    """A text stream (sys.stdout or sys.stderr) whose failures are handled as the module doc
    says; everything else is the wrapped stream's."""

    def __init__(self, stream, is_stdout: bool):
        self.stream, self.is_stdout, self.lost = stream, is_stdout, False

    def _guard(self, method, *args):
        if self.lost:
            return None
        try:
            return method(*args)
        except OSError as e:
            if self.is_stdout and isinstance(e, BrokenPipeError):
                raise
            self.lost = True
            silence(self.stream)
            if self.is_stdout:
                raise OutputError(f"could not write the output: {reason(e)}.",
                                  "Send it to a file on a disk with space, or to a terminal.") \
                    from None
            return None

    def write(self, text: str):
        return self._guard(self.stream.write, text)

    def flush(self) -> None:
        self._guard(self.stream.flush)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def guarded_output():
    """sys.stdout and sys.stderr Guarded for the block, the streams of before restored after
    (run_cli runs in-process in the tests)."""
    before = sys.stdout, sys.stderr
    sys.stdout = before[0] if isinstance(before[0], Guarded) else Guarded(before[0], True)
    sys.stderr = before[1] if isinstance(before[1], Guarded) else Guarded(before[1], False)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = before
