"""Input files (app.engine.runtime.inputs): special files refused before open() (which blocks
forever on a FIFO), sizes capped, stop requests heard by the clock, fingerprints."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from app.engine.errors import Cancelled, ConfigError, DatasetError
from app.engine.runtime import inputs
from app.engine.runtime.inputs import (StopCheck, check_input_file, fingerprint,
                                       fingerprint_changes, open_input)

posix_only = pytest.mark.skipif(os.name != "posix", reason="FIFOs, sockets and /dev/zero")


def _open_without_hanging(path, **kw):
    """open_input(path) in a thread: a regression that blocks in open() fails the test instead
    of hanging it (the FIFO's writer end is opened to let the thread go)."""
    result = {}

    def run():
        try:
            result["file"] = open_input(path, "dataset", **kw)
        except Exception as e:  # noqa: BLE001 (handed to the test)
            result["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail(f"open_input({path}) blocked")
    return result


@posix_only
def test_a_fifo_a_device_a_socket_and_a_folder_are_refused_naming_the_file(tmp_path):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    sock_path = tmp_path / "s.sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    try:
        for path, kind in ((fifo, "a named pipe (FIFO)"), ("/dev/zero", "a character device"),
                           (sock_path, "a socket"), (tmp_path, "a folder")):
            error = _open_without_hanging(path).get("error")
            assert isinstance(error, DatasetError), path
            assert error.message == f"The dataset {path} is {kind}, not a file."
            with pytest.raises(DatasetError, match="not a file"):
                check_input_file(path, "dataset")
    finally:
        sock.close()


def test_a_missing_file_and_a_size_cap(tmp_path):
    with pytest.raises(ConfigError, match=r"Cannot read the config file .*missing.json: No such"):
        check_input_file(tmp_path / "missing.json", "config file", error=ConfigError)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (2 << 20))
    with pytest.raises(ConfigError, match=r"big.json is 2.0 MB; at most 1.0 MB is read"):
        check_input_file(big, "config file", max_bytes=1 << 20, error=ConfigError)
    with open_input(big, "dataset") as f:      # no cap: a dataset may be large
        assert f.read(3) == b"   "


def test_a_stop_check_asks_by_the_clock_and_raises_cancelled(monkeypatch):
    answers = iter([None, "pause"])
    asked = []

    def should_stop():
        asked.append(1)
        return next(answers)
    monkeypatch.setattr(inputs, "STOP_EVERY_S", 0.0)
    check = StopCheck(should_stop, "reading x.jsonl")
    check()
    with pytest.raises(Cancelled, match="Stopped while reading x.jsonl"):
        check()
    assert len(asked) == 2
    monkeypatch.setattr(inputs, "STOP_EVERY_S", 3600.0)
    quiet = StopCheck(lambda: pytest.fail("asked before its interval"))
    for _ in range(1000):
        quiet()                       # a small file's read costs no question
    StopCheck(None)()                 # no should_stop: never stops


def test_fingerprints_see_content_and_size_but_forgive_a_touch(tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_bytes(b"".join(b'{"text": "row %d"}\n' % i for i in range(50_000)))
    fp = fingerprint(p)
    assert fingerprint_changes(fp) == ([], False)
    os.utime(p, ns=(fp["mtime_ns"] + 10**9, fp["mtime_ns"] + 10**9))
    assert fingerprint_changes(fp) == ([], True)          # touched: the same content
    data = bytearray(p.read_bytes())
    sample = len(data) // (inputs.SAMPLES + 1)                   # where the first sample starts
    data[sample + 100: sample + 180] = b"x" * 80
    p.write_bytes(bytes(data))
    assert fingerprint_changes(fp) == (["content"], False)
    with open(p, "ab") as f:
        f.write(b'{"text": "one more"}\n')
    changes, _ = fingerprint_changes(fp)
    assert changes[0].startswith(f"size {fp['size']} -> ") and "content" in changes
    p.unlink()
    changes, _ = fingerprint_changes(fp)
    assert "No such file or directory" in changes[0]
