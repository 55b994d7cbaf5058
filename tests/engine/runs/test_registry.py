"""The user's list of runs (app.engine.runs.registry): every RunDir.create registers its run,
wherever its folder is; a deleted folder is listed as missing."""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.cli.main import run_cli
from app.engine.errors import ConfigError
from app.engine.runs import rundir
from app.engine.runs.clusters import Cluster, ClusterStore
from app.engine.runs.queue import JobQueue
from app.engine.runs.registry import registry_entries, registry_path
from app.engine.runs.rundir import (RunDir, best_evaluation, registered_run_paths,
                                    registered_runs)
from app.engine.runtime.files import DiskFullError, StorageError
from app.engine.training.reward_functions import RewardSpec, trust_reward_files
from tests.fuzz import fuzz, fuzz_settings


def _by_path(path):
    return {r.path: r for r in registered_runs()}.get(RunDir(path).path)


def test_a_created_run_is_registered_with_its_model_and_dataset(tmp_path):
    run = RunDir.create(tmp_path / "anywhere" / "r1", {"model": "/m/tiny.gguf",
                                                       "data": "/d/chat.jsonl"})
    row = _by_path(run.path)
    assert (row.kind, row.model, row.dataset, row.state) == ("sft", "/m/tiny.gguf",
                                                             "/d/chat.jsonl", "new")
    assert row.name == "r1" and row.created > 0


def test_a_run_with_status_and_evaluations_shows_duration_steps_and_best(tmp_path):
    run = RunDir.create(tmp_path / "r2", {"kind": "grpo", "model": "m", "prompts": "p.jsonl"})
    run.write_status(state="done", step=10, total_steps=10, started_at=100.0, finished_at=160.0)
    for step, reward in ((0, 0.1), (5, 0.7), (10, 0.4)):
        run.append_metrics({"type": "eval", "step": step, "reward_mean": reward})
    row = _by_path(run.path)
    assert (row.kind, row.dataset, row.state, row.step, row.duration_s) == (
        "grpo", "p.jsonl", "done", 10, 60.0)
    assert row.best == {"metric": "reward", "value": 0.7, "step": 5}


def test_a_deleted_folder_is_missing_not_an_error(tmp_path):
    run = RunDir.create(tmp_path / "gone", {"model": "m", "data": "d"})
    shutil.rmtree(run.path)
    assert _by_path(run.path).state == "missing"


def test_torn_lines_are_skipped_and_a_path_is_listed_once(tmp_path):
    run = RunDir.create(tmp_path / "twice", {"model": "m", "data": "a"})
    with open(registry_path(), "a") as f:
        f.write('{"path": "torn\n')
    RunDir.create(run.path, {"model": "m", "data": "b"}, exist_ok=True)
    mine = [e for e in registry_entries() if e["path"] == str(run.path)]
    assert len(mine) == 1 and mine[0]["dataset"] == "b"


def test_best_evaluation_is_the_lowest_validation_loss():
    events = [{"type": "step", "step": 1, "loss": 0.1},
              {"type": "eval", "step": 30, "loss": 1.5}, {"type": "eval", "step": 60, "loss": 1.2},
              {"type": "eval", "step": 90, "loss": 1.4}]
    assert best_evaluation(events) == {"metric": "val_loss", "value": 1.2, "step": 60}
    assert best_evaluation([]) is None


# ---------------------------------------------------------------- the state folder (issue 28)


@pytest.fixture
def fresh_state(tmp_path, monkeypatch):
    """A new user's home (0755) without the state folder three folders below it."""
    (tmp_path / "home").mkdir(mode=0o755)
    state = tmp_path / "home" / ".local" / "share" / "gguf-workbench"
    monkeypatch.setenv("WORKBENCH_QUEUE", str(state / "queue.sqlite3"))
    return state


def test_the_first_run_of_a_new_user_makes_a_private_state_folder(fresh_state, tmp_path):
    run = RunDir.create(tmp_path / "runs" / "first", {"model": "m", "data": "d"})
    assert [e["path"] for e in registry_entries()] == [str(run.path)]
    for folder in (fresh_state, fresh_state.parent, fresh_state.parent.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert stat.S_IMODE((tmp_path / "home").stat().st_mode) == 0o755   # there before: kept


@pytest.mark.parametrize("writer", ["queue", "clusters", "trust"])
def test_every_writer_of_the_state_makes_its_folder(fresh_state, tmp_path, writer):
    if writer == "queue":
        JobQueue().list()
    elif writer == "clusters":
        ClusterStore().save(Cluster(name="c", url="http://127.0.0.1:8265"))
    else:
        reward = tmp_path / "main_rew.py"
        reward.write_text("def reward(prompt, completion, **kw):\n    return 1.0\n")
        trust_reward_files([RewardSpec(kind="file", arg=str(reward))])
    assert stat.S_IMODE(fresh_state.stat().st_mode) == 0o700


def test_a_state_folder_that_cannot_be_made_is_named_and_no_run_is_left(tmp_path, monkeypatch):
    (tmp_path / "blocker").write_text("a file where a folder goes")
    monkeypatch.setenv("WORKBENCH_QUEUE", str(tmp_path / "blocker" / "state" / "q.sqlite3"))
    with pytest.raises(StorageError, match=f"create the folder {tmp_path / 'blocker'}"):
        RunDir.create(tmp_path / "run", {"model": "m", "data": "d"})
    assert not (tmp_path / "run").exists()


def test_a_failure_after_the_folder_is_made_takes_back_only_what_create_made(tmp_path,
                                                                             monkeypatch):
    def full(*args):
        raise DiskFullError("The disk is full.")

    monkeypatch.setattr(rundir, "register_run", full)
    with pytest.raises(DiskFullError):
        RunDir.create(tmp_path / "new", {"model": "m", "data": "d"})
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    (mine / "exports").mkdir(parents=True)
    (mine / "exports" / "keep.txt").write_text("the user's")
    with pytest.raises(DiskFullError):
        RunDir.create(mine, {"model": "m", "data": "d"})
    assert sorted(p.name for p in mine.iterdir()) == ["exports"]
    assert (mine / "exports" / "keep.txt").read_text() == "the user's"


def test_a_run_inside_another_runs_folder_is_refused_before_anything_is_made(tmp_path):
    outer = RunDir.create(tmp_path / "outer", {"model": "m", "data": "d"})
    for inside in (outer.checkpoints_dir / "step-99", outer.path / "deeper" / "run"):
        with pytest.raises(ConfigError, match=f"inside the run folder {outer.path}"):
            RunDir.create(inside, {"model": "m", "data": "d"})
        assert not inside.exists()
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "config.json").write_text("{}")   # not a run: no checkpoints/
    RunDir.create(tmp_path / "project" / "run", {"model": "m", "data": "d"})
    RunDir.create(outer.checkpoints_dir / ".." / ".." / "beside", {"model": "m", "data": "d"})


# ---------------------------------------------------------------- hostile registry lines


HOSTILE = ["[" * 100_000, '{"path": "/r/nan", "created": NaN}',
           '{"path": "/r/inf", "created": Infinity}', '{"path": "/r/far", "created": -1e18}',
           '{"path": "/r/big", "created": 1e300}', '{"path": "/r/str", "created": "yesterday"}',
           '{"path": "/r/bool", "created": true, "kind": ["sft"], "model": {"a": 1}}',
           '{"path": "relative/run"}', '{"path": "/r/nul\\u0000"}', '{"path": 5}', "[]",
           '{"path": "/' + "x" * 5000 + '"}', '{"path": "/r/\\ud800"}', "1" * 5000]


def _write_registry(lines: list[str]) -> None:
    path = registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogatepass"))


def test_hostile_registry_lines_never_stop_the_list(fresh_state, tmp_path, capsys):
    run = RunDir.create(tmp_path / "good", {"model": "m", "data": "d"})
    good = registry_path().read_text()
    _write_registry(HOSTILE + [good.strip()])
    rows = {str(r.path): r for r in registered_runs()}
    assert rows[str(run.path)].state == "new"
    assert all(r.created == 0.0 for p, r in rows.items() if p.startswith("/r/"))
    assert "relative/run" not in rows and "/r/nul\0" not in rows
    assert run_cli(["runs", "list"]) == 0
    assert "good" in capsys.readouterr().out


JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.floats(), st.text(max_size=12),
                              st.integers(min_value=-2**70, max_value=2**70)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3),
                                            st.dictionaries(st.text(max_size=5), inner,
                                                            max_size=3)), max_leaves=8)
RECORDS = st.fixed_dictionaries({}, optional={
    "path": st.one_of(st.text(max_size=30).map(lambda t: "/" + t), JSON),
    "created": st.one_of(st.floats(), st.integers(min_value=-2**70, max_value=2**70), JSON),
    "kind": JSON, "model": JSON, "dataset": JSON})
LINES = st.one_of(RECORDS.map(json.dumps), JSON.map(json.dumps), st.text(max_size=40),
                  st.sampled_from(HOSTILE))


@fuzz
@fuzz_settings(100)
@given(lines=st.lists(LINES, min_size=1, max_size=6))
def test_any_registry_lines_leave_the_list_working(tmp_path_factory, lines):
    state = tmp_path_factory.mktemp("state")
    before = os.environ["WORKBENCH_QUEUE"]
    os.environ["WORKBENCH_QUEUE"] = str(state / "queue.sqlite3")
    try:
        _write_registry(lines)
        for row in registered_runs():
            assert isinstance(row.created, float | int) and 0 <= row.created
        registered_run_paths()
    finally:
        os.environ["WORKBENCH_QUEUE"] = before
