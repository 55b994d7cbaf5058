"""Files the engine writes and reads: atomic replacement (temporary file in the same folder,
fsync, os.replace), appended lines, JSON, and OSErrors turned into StorageError with a hint
(DiskFullError for a full disk). A reader never sees a half-written file, and a crash or a
full disk keeps the previous one."""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
import sys
from pathlib import Path
from typing import Any

from app.engine.errors import EngineError

_DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
NAME_MAX = 255   # bytes in one file or folder name (ext4, APFS; NTFS counts 255 UTF-16 units)


class StorageError(EngineError):
    """A file could not be read or written, or its content is corrupt."""

    kind = "storage"


class DiskFullError(StorageError):
    """The disk (or the user's quota) is full."""

    kind = "disk_full"


# --------------------------------------------------------------------------- atomic file helpers


def _json_default(obj: Any) -> Any:
    """numpy scalars and arrays (and anything with .item()/.tolist()) as plain JSON values."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def to_json(obj: Any, indent: int | None = None) -> str:
    r"""JSON text that always encodes as UTF-8: non-ASCII text as itself, except where `obj`
    holds a lone surrogate (a path with a byte that is not UTF-8, as os.fsdecode gives it:
    b"data\xff.jsonl" is "data\udcff.jsonl"), written then as \u escapes, which read back as
    the same string and so open the same file (os.fsencode)."""
    text = json.dumps(obj, indent=indent, default=_json_default, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, indent=indent, default=_json_default, ensure_ascii=True)
    return text


def storage_error(exc: OSError, path: str | os.PathLike, action: str = "write") -> StorageError:
    """The EngineError for an OSError while reading or writing `path`: a full disk names the
    folder that has no space left, a folder the user cannot write to (a read-only file system,
    or permission denied by the folder itself) says that folder is read-only."""
    path = Path(path)
    folder = path.parent
    if exc.errno in _DISK_FULL_ERRNOS:
        return DiskFullError(
            f"The disk is full: no space left in {folder} to {action} {path.name}.",
            f"Free some space on the disk that holds {folder} (for example delete old "
            "checkpoints, exports or runs), then resume or retry the run. The previous files "
            "were kept intact.")
    if action != "read" and (exc.errno == errno.EROFS or (
            isinstance(exc, PermissionError) and folder.is_dir()
            and not os.access(folder, os.W_OK))):
        return StorageError(f"{folder} is read-only: could not {action} {path.name}.",
                            "Write somewhere you can write to, or make the folder writable "
                            "(its permissions, or how its disk is mounted).")
    if isinstance(exc, PermissionError):
        return StorageError(f"Permission denied: could not {action} {path}.",
                            "Check the file's and the folder's permissions.")
    return StorageError(f"Could not {action} {path}: {exc.strerror or exc}.",
                        "Check that the disk is mounted and writable.")


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (best effort: not every platform allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temporary_name(name: str) -> str:
    """A fresh name for a temporary file beside `name`: `.<name>.<random>.tmp`, with `name`
    shortened (whole characters) so that the result fits NAME_MAX bytes however long `name` is."""
    token = secrets.token_hex(4)
    room = NAME_MAX - len(f"..{token}.tmp")
    return f".{os.fsencode(name)[:room].decode('utf-8', 'ignore')}.{token}.tmp"


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = True,
                       mode: int = 0o666) -> None:
    """Replace `path` with `data` atomically: temp file in the same directory, fsync, os.replace.

    Readers see the old or the new content, never a mix; if anything fails (a crash, a full
    disk) the old file stays as it was and the temporary file is removed. The new file gets
    `mode` less the umask, as any program's new file does (0644 under the usual umask; pass
    0o600 for a private one). OSErrors become StorageError / DiskFullError.
    """
    path = Path(path)
    tmp = None
    try:
        for _ in range(100):   # a name taken by another writer: draw another one
            tmp = path.with_name(temporary_name(path.name))
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                             mode)
                break
            except FileExistsError:
                tmp = None
        else:
            raise FileExistsError(errno.EEXIST, "no free temporary name", str(path.parent))
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = None
        if fsync:
            fsync_dir(path.parent)
    except OSError as e:
        raise storage_error(e, path) from e
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def atomic_write_json(path: str | os.PathLike, obj: Any, *, fsync: bool = True,
                      mode: int = 0o666) -> None:
    """`obj` as indented JSON (numpy values converted), written with `atomic_write_bytes`
    (`mode`: the new file's, less the umask; 0o600 for a private one)."""
    atomic_write_bytes(path, (to_json(obj, indent=2) + "\n").encode("utf-8"), fsync=fsync,
                       mode=mode)


# --------------------------------------------------------------------------- reading files safely

JSON_MAX_BYTES = 16 << 20   # config.json, status.json, clusters.json...: a few KB when real

_NOT_REGULAR = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISSOCK, "a socket"))


def size_text(n: int) -> str:
    """A size for a message: "20.0 GB", "3.5 MB", "12 KB"."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GB"
    return f"{n / (1 << 20):.1f} MB" if n >= 1 << 20 else f"{n / 1024:.0f} KB"


def check_regular(st: os.stat_result, shown: str, what: str, *, max_bytes: int | None = None,
                  error: type[EngineError] = StorageError, own: bool = False) -> None:
    """`error` unless `st` is a regular file of at most `max_bytes`: a FIFO blocks open() and
    read() forever, a device such as /dev/zero never ends, a 20 GB sparse file fills memory.
    `own`: a file the workbench writes itself (a run's config.json, the registry...), which
    only another program can have made so; else an input the user named (a dataset...)."""
    if stat.S_ISREG(st.st_mode):
        if max_bytes is None or st.st_size <= max_bytes:
            return
        raise error(f"The {what} {shown} is {size_text(st.st_size)}; at most "
                    f"{size_text(max_bytes)} is read.",
                    "The workbench never writes one that large: another program changed it. "
                    "Restore it from a backup, or move it aside." if own else
                    f"Check that this is the {what} you meant.")
    kind = next((name for test, name in _NOT_REGULAR if test(st.st_mode)), "not a regular file")
    raise error(f"The {what} {shown} is {kind}, not a file.",
                f"Remove {shown} or replace it with a regular file: the workbench writes it as "
                "one (another program or a copy made it so)." if own else
                f"Give the {what} as a regular file (a pipe or a device cannot be read as one; "
                "save its content to a file first).")


def open_regular(path: str | os.PathLike, what: str, *, max_bytes: int | None = None,
                 error: type[EngineError] = StorageError, own: bool = False) -> int:
    """A descriptor for reading `path` once `check_regular` accepts it (links followed: reading
    through one writes nothing). `os.stat` comes first, as open() itself blocks on a FIFO; the
    open uses O_NONBLOCK (on a regular file the flag changes nothing) and the opened file is
    checked again, so a file swapped for a pipe in between cannot block either. OSErrors (a
    missing file...) and ValueError (a NUL in the path) are raised as they are."""
    shown = os.fspath(path)
    check_regular(os.stat(path), shown, what, max_bytes=max_bytes, error=error, own=own)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_BINARY", 0))
    try:
        check_regular(os.fstat(fd), shown, what, max_bytes=max_bytes, error=error, own=own)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_own_bytes(path: str | os.PathLike, what: str, *, max_bytes: int = JSON_MAX_BYTES,
                   error: type[EngineError] = StorageError) -> bytes:
    """The content of a file the workbench writes (`open_regular`, `own`), at most `max_bytes`
    even if it grows while read. OSErrors are raised as they are."""
    with os.fdopen(open_regular(path, what, max_bytes=max_bytes, error=error, own=True),
                   "rb") as f:
        return f.read(max_bytes)


def read_range(path: str | os.PathLike, what: str, offset: int, max_bytes: int) -> bytes:
    """At most `max_bytes` of `path` from byte `offset` (`open_regular`: never a FIFO or a
    device); a reader that tails a growing file (a run's metrics.jsonl, log.txt, the worker's
    log) calls it again from where the complete lines it used end. OSErrors as they are."""
    fd = open_regular(path, what)
    try:
        if hasattr(os, "pread"):
            return os.pread(fd, max_bytes, offset)
        os.lseek(fd, offset, os.SEEK_SET)
        return os.read(fd, max_bytes)
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike, *, what: str = "file",
              error_cls: type[EngineError] = StorageError, missing_ok: bool = False,
              max_bytes: int = JSON_MAX_BYTES) -> Any:
    """Parse a JSON file the workbench writes; missing, unreadable or corrupt files raise
    `error_cls` with a hint, and so does anything but a regular file of at most `max_bytes`
    (`read_own_bytes`: a FIFO, a link to /dev/zero or a huge sparse file neither hangs nor
    fills memory).

    With `missing_ok`, a missing file returns None.
    """
    path = Path(path)
    try:
        raw = read_own_bytes(path, what, max_bytes=max_bytes, error=error_cls)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise error_cls(f"The {what} {path} does not exist.",
                        "Check the path; the run directory may be incomplete.") from None
    except OSError as e:
        err = storage_error(e, path, "read")
        raise error_cls(err.message, err.hint) from e
    try:
        return loads_json(raw.decode("utf-8"))  # nested too deeply: a ValueError too
    except (UnicodeDecodeError, ValueError) as e:
        raise error_cls(f"The {what} {path} is corrupt (not valid JSON: {e}).",
                        "Restore it from a backup or recreate the run; the workbench always "
                        "writes it atomically, so another program may have changed it.") from e


def _read_at(fd: int, offset: int) -> bytes:
    if hasattr(os, "pread"):
        return os.pread(fd, 1, offset)
    os.lseek(fd, offset, os.SEEK_SET)  # Windows: O_APPEND writes still go to the end
    return os.read(fd, 1)


def link_error(path: str | os.PathLike) -> StorageError:
    """The error for a symbolic link where the workbench writes a file or folder of its own
    (a run folder copied with its links, say): writing through it would change a file the user
    never named, wherever the link points."""
    return StorageError(
        f"{path} is a symbolic link; the workbench does not write through links.",
        f"Replace {path} with a regular file or folder (a copy of what it points to), or "
        "remove it: a folder copied with its links, for instance, holds such links.")


def open_own_file(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """`os.open` of a file the workbench writes (in a run folder, in the user's state): never
    through a symbolic link at `path` (O_NOFOLLOW; where the OS has none, a check just before),
    and only a regular file (O_NONBLOCK, so that a FIFO planted there does not block the open)
    with one name (a hard link's other name is a file elsewhere, the user's).
    The folders above `path` may be links: a run folder or a state folder moved elsewhere and
    linked back is the user's doing. A link or anything but a regular file is a StorageError
    naming it; other OSErrors are raised as they are."""
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    if not nofollow and os.path.islink(path):
        raise link_error(path)
    try:
        fd = os.open(path, flags | nofollow | getattr(os, "O_NONBLOCK", 0), mode)
    except OSError:
        if os.path.islink(path):   # ELOOP on Linux and macOS, EMLINK on FreeBSD
            raise link_error(path) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise StorageError(f"{path} is not a regular file; the workbench writes only into "
                           "regular files.", f"Remove {path} or replace it with a regular file.")
    if st.st_nlink > 1:   # a file of the workbench's own never has a second name
        os.close(fd)
        raise StorageError(
            f"{path} is a hard link (one of {st.st_nlink} names of one file); the workbench "
            "does not write through links.",
            f"Replace {path} with a copy of its own (copy it, then move the copy over it), or "
            "remove it: writing to it would change the file its other names show.")
    return fd


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line (a newline is added) with a single write on an O_APPEND descriptor.

    If the file ends in a torn line (a crash or a full disk in the middle of a write), that
    line is terminated first so the new line stays parseable. A symbolic link or a special file
    at `path` is refused (`open_own_file`): a run's metrics.jsonl or log.txt, and the registry,
    are the workbench's own files, never another file reached through them.
    """
    path = Path(path)
    # a log line naming a path with a byte that is not UTF-8 (os.fsdecode's surrogate escape)
    # is written with the escape spelled out: a failure here would take the worker down
    data = line.encode("utf-8", "backslashreplace") + b"\n"
    try:
        fd = open_own_file(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            if size and _read_at(fd, size - 1) != b"\n":
                data = b"\n" + data
            view = memoryview(data)
            while view:  # one write for a regular file; the loop only guards short writes
                n = os.write(fd, view)
                view = view[n:]
        finally:
            os.close(fd)
    except OSError as e:
        raise storage_error(e, path, "append to") from e


def loads_json(text: str) -> Any:
    """json.loads whose every failure is a ValueError: a json.JSONDecodeError (with its msg,
    line and column), or a ValueError saying which limit the text exceeds (an integer longer
    than Python's int-from-string digit limit, nesting deeper than the recursion limit)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError:
        raise ValueError(f"an integer longer than {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
