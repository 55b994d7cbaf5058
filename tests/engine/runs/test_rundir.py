"""Run directories: atomic files, clear errors for bad files and a full disk, metrics tailing."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

from app.cli.main import run_cli
from app.engine.runs import rundir as rd
from app.engine.runtime import files
from app.engine.errors import CheckpointError, ConfigError, EngineError
from app.engine.runs.rundir import RunDir, dedupe_steps, list_runs
from app.engine.runtime.files import (DiskFullError, StorageError, atomic_write_bytes,
                                      atomic_write_json, read_json)
from tests.conftest import REPO, SAMPLE_DATA

MODEL = str(SAMPLE_DATA / "tiny-moe.gguf")   # the CLI reads its context before a run folder exists
CHAT = str(SAMPLE_DATA / "chat.jsonl")       # and checks its dataset before that


def _leftovers(folder) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------- layout and config


def test_create_writes_config_and_layout(tmp_path):
    run = RunDir.create(tmp_path / "run", {"model": "m.gguf", "lr": 1e-3})
    assert run.config() == {"model": "m.gguf", "lr": 1e-3}
    assert run.exists() and run.checkpoints_dir.is_dir() and run.exports_dir.is_dir()
    assert run.status() == {}  # nothing written yet
    assert RunDir(str(tmp_path / "run")) == run


def test_create_refuses_an_existing_run_unless_asked(tmp_path):
    RunDir.create(tmp_path / "run", {"a": 1})
    with pytest.raises(ConfigError, match="already holds a run"):
        RunDir.create(tmp_path / "run", {"a": 2})
    assert RunDir.create(tmp_path / "run", {"a": 2}, exist_ok=True).config() == {"a": 2}
    with pytest.raises(ConfigError, match="JSON object"):
        RunDir.create(tmp_path / "other", ["not", "a", "dict"])


@pytest.mark.parametrize("content, match", [
    (None, "not a run directory"),
    (b'{"model": "m.gg', "corrupt"),
    (b"\xff\xfe\x00", "corrupt"),
    (b"[1, 2]", "not a JSON object"),
])
def test_bad_config_is_a_clear_config_error(tmp_path, content, match):
    run = RunDir(tmp_path)
    if content is not None:
        run.config_path.write_bytes(content)
    with pytest.raises(ConfigError, match=match) as e:
        run.config()
    assert e.value.hint


def test_missing_run_directory(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        RunDir(tmp_path / "nope").config()


# ---------------------------------------------------------------------------- status


def test_status_merges_fields_and_stamps_updated_at(tmp_path):
    run = RunDir.create(tmp_path / "r", {})
    run.write_status(state="running", step=1, total_steps=10)
    st = run.write_status(step=2, loss=np.float32(2.5), eta_s=12.0)
    assert st == run.status()
    assert st["state"] == "running" and st["step"] == 2 and st["total_steps"] == 10
    assert st["loss"] == 2.5 and isinstance(st["updated_at"], float)
    assert run.write_status(replace=True, state="done")["state"] == "done"
    assert "step" not in run.status()


def test_corrupt_status_is_a_storage_error_and_is_overwritten(tmp_path):
    run = RunDir.create(tmp_path / "r", {})
    run.status_path.write_text('{"state": "runn')
    with pytest.raises(StorageError, match="corrupt") as e:
        run.status()
    assert isinstance(e.value, EngineError) and e.value.hint
    run.write_status(state="queued")  # a writer replaces a corrupt status instead of failing
    assert run.status()["state"] == "queued"


def test_read_json_takes_the_error_class_of_the_caller(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("{nope")
    with pytest.raises(CheckpointError, match="checkpoint state .* is corrupt"):
        read_json(path, what="checkpoint state", error_cls=CheckpointError)
    assert read_json(tmp_path / "missing.json", missing_ok=True) is None
    with pytest.raises(StorageError, match="does not exist"):
        read_json(tmp_path / "missing.json")


# ---------------------------------------------------------------------------- atomic writes


def test_atomic_write_replaces_the_file(tmp_path):
    path = tmp_path / "f.json"
    atomic_write_json(path, {"a": np.arange(3), "b": np.float64(0.5), "p": tmp_path})
    assert json.loads(path.read_text()) == {"a": [0, 1, 2], "b": 0.5, "p": str(tmp_path)}
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and _leftovers(tmp_path) == []


def test_a_crash_before_the_rename_keeps_the_old_file(tmp_path, monkeypatch):
    run = RunDir.create(tmp_path / "r", {"v": 1})
    run.write_status(state="running", step=5)
    before = (run.config_path.read_bytes(), run.status_path.read_bytes())

    def crash(src, dst):
        raise OSError(errno.EIO, "simulated crash")

    monkeypatch.setattr(rd.os, "replace", crash)
    with pytest.raises(StorageError, match="Could not write"):
        run.write_config({"v": 2})
    with pytest.raises(StorageError):
        run.write_status(step=6)

    class Killed(BaseException):
        pass

    def die(src, dst):
        raise Killed

    monkeypatch.setattr(rd.os, "replace", die)
    with pytest.raises(Killed):
        run.write_status(step=7)
    monkeypatch.undo()
    assert (run.config_path.read_bytes(), run.status_path.read_bytes()) == before
    assert run.config() == {"v": 1} and run.status()["step"] == 5
    assert _leftovers(run.path) == []  # the temporary files were removed


def _full_disk_os(after_bytes: int = 0):
    """A stand-in for rundir's `os` whose write fails with ENOSPC after `after_bytes`."""
    fake = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    budget = [after_bytes]

    def write(fd, data):
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = min(len(data), budget[0])
        budget[0] -= n
        return os.write(fd, bytes(data[:n]))

    fake.write = write
    return fake


def test_a_full_disk_is_a_clear_error_and_keeps_the_previous_files(tmp_path, monkeypatch):
    run = RunDir.create(tmp_path / "r", {"v": 1})
    run.write_status(state="running", step=5)
    run.append_metrics({"step": 1, "loss": 2.0})
    before = {p.name: p.read_bytes() for p in run.path.iterdir() if p.is_file()}
    monkeypatch.setattr(files, "os", _full_disk_os(after_bytes=7))
    for write in (lambda: run.write_status(step=6), lambda: run.write_config({"v": 2}),
                  lambda: atomic_write_bytes(run.path / "big.bin", b"x" * 100)):
        with pytest.raises(DiskFullError) as e:
            write()
        assert "disk is full" in e.value.message and "Free some space" in e.value.hint
        assert e.value.kind == "disk_full" and isinstance(e.value, EngineError)
    monkeypatch.undo()
    after = {p.name: p.read_bytes() for p in run.path.iterdir() if p.is_file()}
    assert after == before and _leftovers(run.path) == []


def test_a_full_disk_while_appending_metrics(tmp_path, monkeypatch):
    run = RunDir.create(tmp_path / "r", {})
    run.append_metrics({"step": 1, "loss": 2.0})
    monkeypatch.setattr(files, "os", _full_disk_os(after_bytes=5))  # a torn line is left behind
    with pytest.raises(DiskFullError, match="disk is full"):
        run.append_metrics({"step": 2, "loss": 1.9})
    with pytest.raises(DiskFullError):
        run.log("hello")
    monkeypatch.undo()
    assert [e["step"] for e in run.metrics()] == [1]  # the torn tail is not returned
    run.append_metrics({"step": 3, "loss": 1.8})       # terminates the torn line first
    assert [e["step"] for e in run.metrics()] == [1, 3]


# ---------------------------------------------------------------------------- metrics and log


def test_append_metrics_adds_type_and_time_and_converts_numpy(tmp_path):
    run = RunDir.create(tmp_path / "r", {})
    ev = run.append_metrics({"step": np.int64(3), "loss": np.float32(1.5),
                             "norms": np.ones((2, 2), np.float32)})
    assert ev["type"] == "step" and isinstance(ev["time"], float)
    run.append_metrics({"type": "eval", "loss": 2.0, "time": 123.0})
    events = run.metrics()
    assert events[0] == {"step": 3, "loss": 1.5, "norms": [[1.0, 1.0], [1.0, 1.0]],
                         "type": "step", "time": ev["time"]}
    assert events[1] == {"type": "eval", "loss": 2.0, "time": 123.0}
    assert run.metrics_path.read_text().count("\n") == 2


def test_read_metrics_tails_and_never_returns_a_partial_line(tmp_path):
    run = RunDir.create(tmp_path / "r", {})
    assert run.read_metrics() == ([], 0)  # no file yet
    run.append_metrics({"step": 1})
    events, off = run.read_metrics()
    assert [e["step"] for e in events] == [1]
    with open(run.metrics_path, "ab") as f:  # a writer half way through a line
        f.write(b'{"type": "step", "step": 2, "lo')
    events, off2 = run.read_metrics(off)
    assert events == [] and off2 == off
    with open(run.metrics_path, "ab") as f:
        f.write(b'ss": 0.5}\n{"type": "step", "step": 3}\n{"type"')
    events, off3 = run.read_metrics(off2)
    assert [(e["step"], e.get("loss")) for e in events] == [(2, 0.5), (3, None)]
    assert run.read_metrics(off3) == ([], off3)
    run.metrics_path.write_text('{"type": "step", "step": 9}\n')  # replaced by a shorter file
    assert [e["step"] for e in run.read_metrics(off3)[0]] == [9]


def test_corrupt_lines_are_skipped(tmp_path):
    run = RunDir.create(tmp_path / "r", {})
    run.metrics_path.write_bytes(b'{"step": 1}\nnot json\n[1, 2]\n\xff\n{"step": 2}\n')
    assert [e["step"] for e in run.metrics()] == [1, 2]


def test_a_concurrent_reader_only_sees_whole_events(tmp_path):
    run = RunDir.create(tmp_path / "r", {})
    n = 3000
    payload = "x" * 300  # lines of ~350 bytes: many span page boundaries

    def writer():
        for i in range(n):
            run.append_metrics({"step": i, "pad": payload})

    t = threading.Thread(target=writer)
    t.start()
    seen, off = [], 0
    while t.is_alive() or off < run.metrics_path.stat().st_size:
        events, off = run.read_metrics(off)
        assert all(e["pad"] == payload for e in events)
        seen.extend(e["step"] for e in events)
    t.join()
    seen.extend(e["step"] for e in run.read_metrics(off)[0])
    assert seen == list(range(n))


def test_log_appends_timestamped_lines(tmp_path):
    run = RunDir.create(tmp_path / "r", {})
    run.log("first")
    run.log("second\n")
    lines = run.log_path.read_text().splitlines()
    assert len(lines) == 2 and lines[0].endswith(" first") and lines[1].endswith(" second")


# ---------------------------------------------------------------------------- summaries and CLI


def _sample_run(path, name="run"):
    run = RunDir.create(path / name, {"model": "m.gguf", "mode": "lora", "lora_rank": 8})
    for step, loss in enumerate([3.0, 2.0, 2.5], start=1):
        run.append_metrics({"step": step, "loss": loss, "lr": 1e-3})
    run.append_metrics({"type": "eval", "step": 2, "loss": 2.8})
    run.append_metrics({"type": "eval", "step": 3, "loss": 2.6})
    run.write_status(state="done", step=3, total_steps=3, loss=2.5)
    return run


def test_summary_has_final_and_best_metrics(tmp_path):
    s = _sample_run(tmp_path).summary()
    assert s["final"]["step"]["loss"] == 2.5 and s["best"]["step"]["loss"] == 2.0
    assert s["final"]["eval"]["loss"] == 2.6 and s["best"]["eval"]["loss"] == 2.6
    assert s["status"]["state"] == "done" and s["events"] == 5 and s["problems"] == []
    broken = RunDir(tmp_path / "broken")
    broken.path.mkdir()
    broken.config_path.write_text("{")
    assert "corrupt" in broken.summary()["problems"][0]


def test_runs_list_and_show(tmp_path, capsys):
    _sample_run(tmp_path, "a")
    RunDir.create(tmp_path / "b", {"model": "m.gguf"})
    (tmp_path / "not-a-run").mkdir()
    assert sorted(r.name for r in list_runs(tmp_path)) == ["a", "b"]
    assert run_cli(["runs", "list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "a" in out and "done" in out and "not-a-run" not in out
    assert run_cli(["runs", "list", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rows} == {"a", "b"}
    assert run_cli(["runs", "show", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "model=m.gguf" in out and "state    done" in out
    assert "best step" in out and "loss=2" in out and "final eval" in out
    assert run_cli(["runs", "show", str(tmp_path / "a"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["best"]["eval"]["loss"] == 2.6
    assert run_cli(["runs", "show", str(tmp_path / "not-a-run")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_runs_list_defaults_to_the_user_data_dir(tmp_path, monkeypatch, capsys):
    import platformdirs

    monkeypatch.setattr(platformdirs, "user_data_dir", lambda name: str(tmp_path / name))
    assert rd.default_runs_dir() == tmp_path / "gguf-workbench" / "runs"
    _sample_run(tmp_path / "gguf-workbench" / "runs", "x")
    assert [r.name for r in list_runs()] == ["x"]
    assert run_cli(["runs", "list"]) == 0 and "x" in capsys.readouterr().out


# ---------------------------------------------------------------------------- names and writers


def test_a_run_folder_name_over_255_bytes_is_a_config_error(tmp_path, capsys):
    with pytest.raises(ConfigError, match="is 300 bytes long; file systems allow at most 255"):
        RunDir.create(tmp_path / ("a" * 300), {})
    with pytest.raises(ConfigError, match="is 256 bytes long"):
        RunDir.create(tmp_path / ("é" * 128) / "run", {})           # 2 bytes a letter
    assert run_cli(["train", "-m", MODEL, "-d", CHAT, "--queue",
                    str(tmp_path / "q.sqlite3"), "-o", str(tmp_path / ("r" * 300))]) == 2
    err = capsys.readouterr().err
    assert "is 300 bytes long; file systems allow at most 255" in err
    assert "Traceback" not in err and os.listdir(tmp_path) == []


def test_default_run_names_are_shortened_at_a_character(tmp_path, monkeypatch, capsys):
    name = rd.default_run_name("é" * 200)
    assert len(os.fsencode(name)) == rd.RUN_NAME_MAX - 1 and name.endswith("é")
    assert rd.default_run_name("data")[-5:] == "-data"
    monkeypatch.setattr(rd, "default_runs_dir", lambda: tmp_path / "runs")
    data = tmp_path / ("d" * 249 + ".jsonl")                        # a 255-byte file name
    shutil.copyfile(CHAT, data)
    assert run_cli(["train", "-m", MODEL, "-d", str(data), "--queue",
                    str(tmp_path / "q.sqlite3")]) == 0
    [run] = list_runs(tmp_path / "runs")
    assert len(os.fsencode(run.name)) == rd.RUN_NAME_MAX and run.name.endswith("dddd")


def test_a_running_status_whose_writer_is_gone_reads_as_interrupted(tmp_path):
    from app.views.runs.run_rows import _read_row

    run = RunDir.create(tmp_path / "run", {"model": "m.gguf"})
    st = run.write_status(state="running", step=3, total_steps=10, eta_s=42.0)
    assert st["writer"]["pid"] == os.getpid() and st["writer"]["host"] == socket.gethostname()
    assert run.status()["state"] == "running" and run.status()["eta_s"] == 42.0
    subprocess.run([sys.executable, "-c", "import sys; from app.engine.runs.rundir import RunDir; "
                    "RunDir(sys.argv[1]).write_status(state='running', eta_s=42.0)",
                    str(run.path)], check=True, cwd=REPO)
    st = run.status()                                      # its writer exited while "running"
    assert st["state"] == "interrupted" and "eta_s" not in st and st["step"] == 3
    row = _read_row(str(run.path), None)
    assert row.label == "interrupted" and row.eta_s is None and row.stalled   # resumable
    saved = json.loads(run.status_path.read_text())
    saved["writer"]["host"] = "another-host"               # unknown there: as written
    run.status_path.write_text(json.dumps(saved))
    assert run.status()["state"] == "running"
    if os.path.exists("/proc/self/stat"):                  # a live pid, reused since
        saved["writer"] = {"host": socket.gethostname(), "pid": os.getpid(), "started": "1"}
        run.status_path.write_text(json.dumps(saved))
        assert run.status()["state"] == "interrupted"
    run.write_status(state="paused")
    assert run.status()["state"] == "paused"


def test_metrics_are_deduplicated_by_step(tmp_path):
    """A second attempt resumed from step 2's checkpoint repeats steps 3-4: its events win and
    the first attempt's events from step 3 on (its eval and checkpoint too) are dropped."""
    run = RunDir.create(tmp_path / "run", {"name": "x"})
    first = [{"type": "start"}, {"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0},
             {"type": "checkpoint", "step": 2}, {"step": 3, "loss": 1.5},
             {"type": "eval", "step": 3, "loss": 0.1}, {"step": 4, "loss": 1.2}]
    second = [{"type": "start"}, {"step": 3, "loss": 1.4}, {"step": 4, "loss": 1.1},
              {"step": 5, "loss": 1.0}]
    for ev in first + second:
        run.append_metrics(ev)
    events = run.metrics()
    assert [(e["type"], e.get("step")) for e in events] == [
        ("start", None), ("step", 1), ("step", 2), ("checkpoint", 2), ("start", None),
        ("step", 3), ("step", 4), ("step", 5)]
    assert [e["loss"] for e in events if e["type"] == "step"] == [3.0, 2.0, 1.4, 1.1, 1.0]
    assert run.summary()["best"]["step"]["loss"] == 1.0 and "eval" not in run.summary()["best"]
    assert dedupe_steps(run.read_metrics(0)[0]) == events
