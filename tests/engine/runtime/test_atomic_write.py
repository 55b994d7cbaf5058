"""atomic_write_bytes: new files get 0666 less the umask like any program's (they were 0600,
mkstemp's mode), or a private mode when asked; a name of up to NAME_MAX bytes still gets its
temporary file; full disks and read-only folders name the folder. (issue 28, points 8 and 9)"""

from __future__ import annotations

import errno
import os
import stat

import pytest

from app.engine.runtime import files
from app.engine.runtime.files import (NAME_MAX, DiskFullError, StorageError, atomic_write_bytes,
                                      storage_error)


@pytest.fixture
def umask():
    def set_umask(value):
        os.umask(value)
    previous = os.umask(0o022)
    yield set_umask
    os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_files_follow_the_umask(tmp_path, umask):
    atomic_write_bytes(tmp_path / "a", b"x")
    assert mode(tmp_path / "a") == 0o644
    umask(0o077)
    atomic_write_bytes(tmp_path / "b", b"x")
    assert mode(tmp_path / "b") == 0o600
    umask(0o022)
    atomic_write_bytes(tmp_path / "c", b"x", mode=0o600)      # a private file stays private
    assert mode(tmp_path / "c") == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]


def test_a_name_of_name_max_bytes(tmp_path):
    for name in ("n" * NAME_MAX, "é" * (NAME_MAX // 2)):
        atomic_write_bytes(tmp_path / name, b"data")
        assert (tmp_path / name).read_bytes() == b"data"
    assert len(list(tmp_path.iterdir())) == 2                # no temporary file left


def test_full_disk_and_read_only_folders_name_the_folder(tmp_path, monkeypatch):
    out = tmp_path / "sub" / "x.npy"
    err = storage_error(OSError(errno.ENOSPC, "No space left on device"), out)
    assert isinstance(err, DiskFullError)
    assert err.message == f"The disk is full: no space left in {out.parent} to write x.npy."
    err = storage_error(OSError(errno.EROFS, "Read-only file system"), out)
    assert err.message == f"{out.parent} is read-only: could not write x.npy."
    (tmp_path / "sub").mkdir()
    monkeypatch.setattr(files.os, "access", lambda path, how: False)   # as a user, not root
    err = storage_error(PermissionError(errno.EACCES, "Permission denied"), out)
    assert err.message == f"{out.parent} is read-only: could not write x.npy."
    err = storage_error(PermissionError(errno.EACCES, "Permission denied"), out, "read")
    assert err.message == f"Permission denied: could not read {out}."


def test_a_write_into_a_read_only_folder(tmp_path, monkeypatch):
    real_open = os.open

    def read_only(path, flags, *args):
        if os.path.dirname(path) == str(tmp_path) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)
    monkeypatch.setattr(files.os, "open", read_only)
    with pytest.raises(StorageError, match=f"^{tmp_path} is read-only: could not write a.json"):
        atomic_write_bytes(tmp_path / "a.json", b"{}")
