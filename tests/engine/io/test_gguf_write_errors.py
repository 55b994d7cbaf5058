"""write_gguf on a full disk: the gguf writer writes tensors with NumPy's tofile, whose short
write is an OSError without an errno ("143360 requested and 65536 written"); on a disk with
less free space than what was left unwritten it is raised as ENOSPC, so every GGUF writer
(export, new-model, adapters) says "no space left in DIR" through files.storage_error."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import numpy as np
import pytest

from app.engine.io import gguf as gguf_io
from app.engine.runtime.files import DiskFullError, storage_error

Usage = namedtuple("Usage", "total used free")


def _short_write(monkeypatch, free: int) -> None:
    import gguf

    def short(*args, **kwargs):
        raise OSError("143360 requested and 65536 written")   # numpy's tofile, errno None
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", short)
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: Usage(1 << 20, (1 << 20) - free,
                                                                   free))


def _write(path) -> None:
    gguf_io.write_gguf(path, {"general.architecture": "llama", "general.name": "t"},
                       {"w": np.zeros((4, 4), np.float32)})


def test_a_short_write_on_a_full_disk_says_no_space_left_in_the_folder(tmp_path, monkeypatch):
    _short_write(monkeypatch, free=4096)
    out = tmp_path / "exports" / "x.gguf"
    out.parent.mkdir()
    with pytest.raises(OSError) as e:
        _write(out)
    assert e.value.errno == errno.ENOSPC
    err = storage_error(e.value, out)
    assert isinstance(err, DiskFullError)
    assert err.message == f"The disk is full: no space left in {out.parent} to write x.gguf."
    assert list(out.parent.iterdir()) == []          # the temporary file is gone too


def test_a_short_write_with_space_left_keeps_its_own_error(tmp_path, monkeypatch):
    _short_write(monkeypatch, free=1 << 30)          # a quota, an I/O error: not "disk full"
    with pytest.raises(OSError, match="143360 requested") as e:
        _write(tmp_path / "x.gguf")
    assert e.value.errno is None and list(tmp_path.iterdir()) == []
