"""One writer per run: `RUN_DIR/run.lock`, an OS file lock that whoever trains a run holds
for as long as it writes the run (`workbench train`, `resume`, `grpo`, a queue worker's job,
`queue run-remote` on a cluster's node).

The lock is `flock` on POSIX (`msvcrt.locking` on Windows) on the file, so the kernel releases
it when its holder dies, even by kill -9: a lock file whose lock can be taken is stale by
definition, whatever it says. The file names its holder (host, pid, process start time, what it
runs, since when) so that a second writer is refused with `RunBusyError` saying who writes the
run. A holder that ends well removes its file; a file left behind by a holder that died is
taken over, with a line in the run's log.txt naming the process that left it.

The run folder itself is locked too (`flock` on a descriptor of the folder, POSIX only),
before the file: run.lock is a file anyone can delete, and a second writer would then lock a
new one while the first still writes; the folder cannot be deleted from under its holder's
descriptor, so a deleted run.lock still leaves the run locked (its holder then unnamed, "another
process"). A file system that cannot lock a folder keeps the file's lock alone.

Removing the file while another process may be opening it is safe because a taker checks,
once it holds the lock, that the path still names the file it locked (else it locked a file
already removed, and tries again). On Windows the file cannot be removed while open and its
locked first byte cannot be read by others, so there a holder is named as "another process".
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from app.engine.errors import EngineError
from app.engine.runs.rundir import RunDir
from app.engine.runtime.files import loads_json, open_own_file, storage_error
from app.engine.runtime.processes import process_started

LOCK = "run.lock"


class RunBusyError(EngineError):
    """Another process writes the run (holds its lock)."""

    kind = "run_busy"


# --------------------------------------------------------------------------- the OS's file locks


def try_lock(fd: int, shared: bool = False) -> bool:
    """Take the OS lock of open file `fd` without waiting; False when another holds it."""
    if os.name == "nt":
        import msvcrt

        try:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    import fcntl

    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def unlock(fd: int) -> None:
    if os.name == "nt":
        import msvcrt

        try:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        except OSError:
            pass
        return
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- the run's lock


def lock_path(run_dir: RunDir | str | os.PathLike) -> Path:
    return (run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)).path / LOCK


class RunLock:
    """The lock of one run; `what` says what holds it ("workbench train", "queue job 3"). Use
    as a context manager, or `acquire()` / `release()`."""

    def __init__(self, run_dir: RunDir | str | os.PathLike, what: str):
        self.run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.path = lock_path(self.run)
        self.what = what
        self._fd: int | None = None
        self._folder_fd: int | None = None

    def acquire(self) -> "RunLock":
        """Take the lock (the folder's, then the file's), or raise RunBusyError naming its
        holder (StorageError when the lock file cannot be made, or is a link)."""
        folder_fd = _lock_folder(self.run.path)
        if folder_fd is False:
            raise self._busy(_named_holder(self.path))
        try:
            while True:
                fd = _open(self.path, os.O_RDWR | os.O_CREAT)
                if not try_lock(fd):
                    holder = _holder(fd)
                    os.close(fd)
                    raise self._busy(holder)
                if _same_file(fd, self.path):
                    break
                os.close(fd)   # locked a file its last holder removed meanwhile: the new one
        except BaseException:
            _close_folder(folder_fd)
            raise
        self._fd, self._folder_fd = fd, folder_fd
        left = _holder(fd)
        try:
            _write(fd, {"host": socket.gethostname(), "pid": os.getpid(),
                        "started": process_started(os.getpid()), "what": self.what,
                        "since": time.time()})
        except OSError as e:
            self.release()
            raise storage_error(e, self.path) from e
        if left:
            self.run.log(f"{self.what} took over the lock {LOCK} left by {describe(left)}, "
                         "which ended without releasing it")
        return self

    def _busy(self, holder: dict | None) -> RunBusyError:
        return RunBusyError(f"The run {self.run.path} is being written by {describe(holder)}: "
                            "a run has one writer at a time.",
                            "Wait until it ends, or stop it first (Ctrl-C in its terminal, "
                            "Pause in the window, or workbench queue pause JOB), then try again.")

    @property
    def held(self) -> bool:
        """Does this object hold the lock now?"""
        return self._fd is not None

    def release(self) -> None:
        """Let the lock go and remove its file (best effort; idempotent)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)        # a file that stays (Windows) names no holder
            os.unlink(self.path)       # while held: nobody locks this file afterwards
        except OSError:
            pass
        unlock(fd)
        os.close(fd)
        _close_folder(self._folder_fd)
        self._folder_fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_holder(run_dir: RunDir | str | os.PathLike) -> dict | None:
    """Who holds the run's lock ({"host", "pid", ...}, {} when it cannot be read), or None
    when nobody does (this process's own hold counts). Makes no file."""
    path = lock_path(run_dir)
    if _folder_locked(path.parent):
        return _named_holder(path) or {}   # {}: run.lock deleted or not written yet
    try:
        fd = _open(path, os.O_RDONLY)
    except EngineError:
        return None
    try:
        if try_lock(fd, shared=True):
            unlock(fd)
            return None
        return _holder(fd) or {}     # {}: held, its holder not written yet
    finally:
        os.close(fd)


def describe(holder: dict | None) -> str:
    """"workbench train (pid 123 on host h, since 12:04:05)" for a lock's holder."""
    if not holder:
        return "another process"
    since = holder.get("since")
    when = (f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}"
            if isinstance(since, (int, float)) and 0 <= since < 1e11 else "")
    return (f"{holder.get('what') or 'a process'} (pid {holder.get('pid')} on "
            f"{holder.get('host')}{when})")


def _open(path: Path, flags: int) -> int:
    """The lock file's descriptor; never through a link (a planted run.lock -> elsewhere) and
    only a regular file (files.open_own_file)."""
    try:
        return open_own_file(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise storage_error(e, path, "open") from e


def _named_holder(path: Path) -> dict | None:
    """The holder run.lock names, None when there is none (no file, an empty one)."""
    try:
        fd = _open(path, os.O_RDONLY)
    except EngineError:
        return None
    try:
        return _holder(fd)
    finally:
        os.close(fd)


def _folder_fd(folder: Path) -> int | None:
    """A descriptor of the run folder to `flock`; None on Windows (no folder locks there)."""
    if os.name == "nt":
        return None
    try:
        return os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                       | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise storage_error(e, folder, "open") from e


def _lock_folder(folder: Path) -> int | None | bool:
    """The run folder's descriptor, locked (exclusive); False when another holds its lock;
    None where it cannot be locked (Windows, a file system without flock on folders: the
    lock file's lock alone then)."""
    fd = _folder_fd(folder)
    if fd is None:
        return None
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return False
    except OSError:
        os.close(fd)
        return None


def _folder_locked(folder: Path) -> bool:
    """Does a process (this one included) hold the run folder's lock?"""
    try:
        fd = _folder_fd(folder)
    except EngineError:
        return False
    if fd is None:
        return False
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _close_folder(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)   # releases its flock


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _holder(fd: int) -> dict | None:
    """The holder a lock file names: a dict, {} for content that is not one, None when empty."""
    try:
        data = os.pread(fd, 4096, 0) if hasattr(os, "pread") else _read_start(fd)
    except OSError:
        return {}
    if not data.strip():
        return None
    try:
        holder = loads_json(data.decode("utf-8", errors="replace"))
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _read_start(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096)


def _write(fd: int, holder: dict) -> None:
    data = (json.dumps(holder) + "\n").encode("utf-8")
    os.ftruncate(fd, 0)
    if hasattr(os, "pwrite"):
        os.pwrite(fd, data, 0)
    else:
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, data)
