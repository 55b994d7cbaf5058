"""`workbench train --queue` when the queue refuses the job: no run folder is left behind to
block the same command."""

from __future__ import annotations

import sqlite3

from app.engine.runs.queue import JobQueue
from tests.cli.test_train import _train


def _locked(queue) -> sqlite3.Connection:
    """Another program holding the queue's write lock."""
    holder = sqlite3.connect(queue, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    return holder


def test_a_train_the_locked_queue_refused_can_be_run_again(tmp_path, monkeypatch, capsys):
    queue, out = tmp_path / "q.sqlite3", tmp_path / "run"
    JobQueue(queue)
    monkeypatch.setattr(JobQueue.__init__, "__kwdefaults__", {"busy_timeout_s": 0.2})
    holder = _locked(queue)
    assert _train(out, "--epochs", "1", "--queue", str(queue)) == 2
    assert "stayed locked" in capsys.readouterr().err
    assert not out.exists()
    holder.execute("ROLLBACK")
    assert _train(out, "--epochs", "1", "--queue", str(queue)) == 0  # the same command
    [job] = JobQueue(queue).list()
    assert job.state == "queued" and (out / "config.json").exists()


def test_an_out_folder_that_was_there_before_is_kept(tmp_path, monkeypatch):
    queue, out = tmp_path / "q.sqlite3", tmp_path / "mine"
    (out / "notes").mkdir(parents=True)
    JobQueue(queue)
    monkeypatch.setattr(JobQueue.__init__, "__kwdefaults__", {"busy_timeout_s": 0.2})
    holder = _locked(queue)
    assert _train(out, "--epochs", "1", "--queue", str(queue)) == 2
    holder.execute("ROLLBACK")
    assert sorted(p.name for p in out.iterdir()) == ["notes"]
