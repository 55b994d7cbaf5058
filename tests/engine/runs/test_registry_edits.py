"""The Runs screen's edits of the user's list of runs (app.engine.runs.registry): forget a run,
give it a display name, and what `read_registry` says about lines it cannot read."""

from __future__ import annotations

import pytest

from app.engine.api import forget_run, read_registry, rename_run
from app.engine.errors import ConfigError
from app.engine.runs.registry import registry_entries, registry_path
from app.engine.runs.rundir import RunDir, registered_run_paths
from app.engine.runtime.files import StorageError


@pytest.fixture(autouse=True)
def _own_state_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_QUEUE", str(tmp_path / "state" / "queue.sqlite3"))


def test_a_forgotten_run_leaves_the_list_until_created_again(tmp_path):
    keep = RunDir.create(tmp_path / "keep", {"model": "m.gguf"})
    gone = RunDir.create(tmp_path / "gone", {"model": "m.gguf"})
    forget_run(gone.path)
    assert [e["path"] for e in registry_entries()] == [str(keep.path)]
    assert read_registry().forgotten == {str(gone.path)}
    assert str(gone.path) not in registered_run_paths()
    assert gone.path.is_dir()                                  # the folder is not touched
    RunDir.create(tmp_path / "gone", {"model": "m.gguf"}, exist_ok=True)   # made again
    assert read_registry().forgotten == set()
    assert str(gone.path) in registered_run_paths()

def test_a_display_name_is_kept_and_the_folder_is_not_renamed(tmp_path):
    run = RunDir.create(tmp_path / "20261128-0647-chat", {"model": "m.gguf", "data": "d.jsonl"})
    assert rename_run(run.path, "  first   try ") == "first try"
    [entry] = registry_entries()
    assert entry["name"] == "first try" and entry["model"] == "m.gguf"
    assert entry["created"] is not None                        # the record is kept whole
    assert run.path.name == "20261128-0647-chat" and run.path.is_dir()
    assert rename_run(run.path, "") == "20261128-0647-chat"     # empty: the folder's name
    assert registry_entries()[0]["name"] is None
    with pytest.raises(ConfigError, match="at most 200"):
        rename_run(run.path, "x" * 201)


def test_unreadable_lines_are_counted_and_an_unreadable_file_is_an_error(tmp_path):
    run = RunDir.create(tmp_path / "r", {"model": "m.gguf"})
    with open(registry_path(), "a") as f:
        f.write('{"path": "torn\n\n[1, 2]\n')
    found = read_registry()
    assert [e["path"] for e in found.entries] == [str(run.path)]
    assert found.unreadable == [2, 4]                           # the blank line is no line
    registry_path().unlink()
    registry_path().mkdir()                                     # cannot be read as a file
    with pytest.raises(StorageError, match="runs.jsonl"):
        read_registry()
