"""The last resort when a memory-mapped file shrinks under a run: SIGBUS.

Model weights are memory-mapped (app.engine.io.gguf). Reading a page of a mapping whose file
was truncated raises SIGBUS, which kills the process without a word, leaving its run "running".
The readers check the file before they read (`GGUFFile.check_unchanged`), which turns a change
into an error; this module covers the moment between that check and the read.

Python's own signal handlers cannot help: they run later, between bytecodes, while the faulting
instruction faults again at once. So `on_bus_error` installs a C-level handler (through ctypes)
that runs on the faulting thread, asks the `explain` callback what happened ("the model file X
changed"), gives each registered recorder (a run's reporter: status.json "failed") its one
chance, prints the message and ends the process with exit status 2. Nothing is resumed: after a
bus error the process must end. POSIX only (Windows has no SIGBUS; a truncated mapping cannot
happen there, the file being locked while mapped).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from typing import Callable

EXIT_STATUS = 2
HINT = ("Put the model file back as it was, then run the command again (a run: workbench "
        "resume RUN_DIR).")

_recorders: dict[object, Callable[[str, str], None]] = {}
_explainers: list[Callable[[], "str | None"]] = []
_installed: list = []          # the ctypes handler, kept alive while installed
_lock = threading.Lock()


def explain_with(explain: Callable[[], "str | None"]) -> None:
    """Register a callback that says which mapped file changed (None: not one of its files)."""
    _explainers.append(explain)


def on_bus_error(key: object, record: Callable[[str, str], None]) -> None:
    """Call `record(message, hint)` if the process gets SIGBUS (until `forget(key)`), then end
    it with EXIT_STATUS; installs the handler the first time."""
    with _lock:
        _recorders[key] = record
        if not _installed:
            _install()


def forget(key: object) -> None:
    _recorders.pop(key, None)


def _install() -> None:
    sigbus = getattr(signal, "SIGBUS", None)
    if sigbus is None or os.name != "posix":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)
        handler = handler_type(_on_sigbus)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, handler_type)
        libc.signal(sigbus, handler)
    except (OSError, AttributeError):   # no libc to call: the process dies as it did before
        return
    _installed.append(handler)


def _on_sigbus(signum: int) -> None:
    """Runs in the signal handler: as little as can tell the user and the run what happened."""
    message = "The process was stopped by a bus error (SIGBUS): a memory-mapped file shrank."
    try:
        for explain in _explainers:
            found = explain()
            if found:
                message = found
                break
    except BaseException:
        pass
    for record in list(_recorders.values()):
        try:
            record(message, HINT)
        except BaseException:
            pass
    try:
        os.write(2, f"\nerror: {message}\nhint: {HINT}\n".encode("utf-8", "replace"))
    finally:
        os._exit(EXIT_STATUS)
