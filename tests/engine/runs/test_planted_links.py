"""No write through links: a run folder copied with its links (metrics.jsonl, log.txt,
status.json, config.json pointing elsewhere), or a linked registry, never has the workbench
append to or replace the file a link points to."""

from __future__ import annotations

import os

import pytest

from app.engine.runs.registry import register_run
from app.engine.runs.rundir import RunDir
from app.engine.runtime.files import StorageError, append_line

pytestmark = pytest.mark.skipif(os.name == "nt", reason="symbolic links need privileges there")


def _run_with_link(tmp_path, name: str, *, dangling: bool = False):
    """A run folder whose `name` is a link to a file outside it: (run, link, target)."""
    run = RunDir.create(tmp_path / "run", {"model": "m.gguf"})
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    if not dangling:
        target.write_bytes(b"the user's own file\n")
    link = run.path / name
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    return run, link, target


@pytest.mark.parametrize("dangling", [False, True], ids=["link", "dangling-link"])
@pytest.mark.parametrize("name, append", [
    ("metrics.jsonl", lambda run: run.append_metrics({"step": 1, "loss": 2.0})),
    ("log.txt", lambda run: run.log("resumed from step 1")),
])
def test_appends_refuse_a_planted_link(tmp_path, name, append, dangling):
    run, link, target = _run_with_link(tmp_path, name, dangling=dangling)
    with pytest.raises(StorageError, match="symbolic link") as e:
        append(run)
    assert str(link) in e.value.message and f"Replace {link}" in e.value.hint
    if dangling:
        assert not os.path.lexists(target)      # O_CREAT did not make the link's target
    else:
        assert target.read_bytes() == b"the user's own file\n"
    assert link.is_symlink()


def test_an_append_to_a_special_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)                             # no reader: a blocking open would hang here
    with pytest.raises(StorageError, match="not a regular file"):
        append_line(fifo, "{}")


@pytest.mark.parametrize("name, append", [
    ("metrics.jsonl", lambda run: run.append_metrics({"step": 1, "loss": 2.0})),
    ("log.txt", lambda run: run.log("resumed from step 1")),
])
def test_appends_refuse_a_hard_linked_run_file(tmp_path, name, append):
    """`ln victim.txt RUN/metrics.jsonl`: a run's own file never has a second name, so an
    append through one would change the user's file under its other name."""
    run = RunDir.create(tmp_path / "run", {"model": "m.gguf"})
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"the user's own file\n")
    os.link(victim, run.path / name)
    with pytest.raises(StorageError, match="is a hard link") as e:
        append(run)
    assert str(run.path / name) in e.value.message and "copy" in e.value.hint
    assert victim.read_bytes() == b"the user's own file\n"


def test_the_registry_is_not_appended_through_a_link(tmp_path, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setenv("WORKBENCH_QUEUE", str(state / "queue.sqlite3"))
    register_run(tmp_path / "r0", {})           # makes the state folder and the registry
    target = tmp_path / "elsewhere.jsonl"
    target.write_text("mine\n")
    (state / "runs.jsonl").unlink()
    (state / "runs.jsonl").symlink_to(target)
    with pytest.raises(StorageError, match="symbolic link"):
        register_run(tmp_path / "r1", {})
    assert target.read_text() == "mine\n"


@pytest.mark.parametrize("name, write", [
    ("status.json", lambda run: run.write_status(state="running", step=3)),
    ("config.json", lambda run: run.write_config({"model": "other.gguf"})),
])
def test_atomic_replacement_replaces_the_link_not_its_target(tmp_path, name, write):
    run, link, target = _run_with_link(tmp_path, name)
    write(run)
    assert target.read_bytes() == b"the user's own file\n"
    assert not link.is_symlink() and link.is_file()


@pytest.mark.parametrize("out", [None, "elsewhere.gguf"], ids=["default-out", "out-elsewhere"])
def test_an_export_never_writes_through_a_linked_exports_folder(tmp_path, capsys, out):
    import shutil

    from app.cli.main import run_cli
    from tests.conftest import GOLDEN

    base = tmp_path / "base.gguf"
    shutil.copy(GOLDEN / "qwen2-f32.gguf", base)
    run = RunDir.create(tmp_path / "run", {"model": str(base), "data": "d.jsonl"})
    shutil.copy(GOLDEN / "qwen2-lora.gguf", run.path / "adapter.gguf")
    target = tmp_path / "someone-elses"
    target.mkdir()
    run.exports_dir.rmdir()
    run.exports_dir.symlink_to(target)
    args = ["export", str(run.path), "--to", "gguf-lora", "--type", "f32", "--no-llamacpp"]
    assert run_cli(args + (["--out", str(tmp_path / out)] if out else [])) == 2
    assert f"{run.exports_dir} is a symbolic link" in capsys.readouterr().err
    assert os.listdir(target) == [] and not (tmp_path / "elsewhere.gguf").exists()


def test_a_gguf_is_never_written_through_a_link_at_its_temporary_name(tmp_path):
    """write_gguf writes `NAME.tmp-PID` beside the file, then renames it: a link planted at that
    name (a run folder copied from a process with the same pid) is replaced, not written through."""
    import numpy as np

    from app.engine.io.gguf import GGUFFile, write_gguf

    run, link, target = _run_with_link(tmp_path, f"adapter.gguf.tmp-{os.getpid()}")
    write_gguf(run.path / "adapter.gguf", {"general.architecture": "llama"},
               {"w": np.ones((2, 3), np.float32)})
    assert target.read_bytes() == b"the user's own file\n"
    assert not os.path.lexists(link)
    np.testing.assert_array_equal(GGUFFile(run.path / "adapter.gguf").array("w"), np.ones((2, 3)))
