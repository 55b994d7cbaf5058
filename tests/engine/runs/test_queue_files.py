"""The files beside the queue's database that SQLite would trust blindly: a hard link (another
name, another write-ahead log, another worker lock) and a `-wal` file of another database
(replayed over the queue, its jobs gone) are refused before SQLite opens the database; the
queue's own log, left by a process that died, is replayed as always."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from app.cli.main import run_cli
from app.engine.runs.queue import JobQueue, QueueError
from app.engine.runs.rundir import RunDir
from app.engine.runs.worker import WorkerLock
from tests.conftest import REPO


def _queue_with_jobs(path, *runs) -> JobQueue:
    queue = JobQueue(path)
    for run in runs:
        queue.add(RunDir.create(path.parent / run, {}).path)
    return queue


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_hard_linked_queue_gets_no_second_worker(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    queue = _queue_with_jobs(tmp_path / "a" / "q.sqlite3", "r1")
    queue.close()                                # a worker between two of its jobs holds
    other_name = tmp_path / "b" / "q.sqlite3"    # its lock, not necessarily the database
    os.link(queue.path, other_name)              # the same file, named in another folder
    lock = WorkerLock(queue.path)
    assert lock.acquire()                        # the worker of the first name
    try:
        assert run_cli(["queue", "worker", "--once", "--queue", str(other_name)]) == 2
        err = capsys.readouterr().err
        assert f"{other_name} has 2 hard links" in err and "symbolic links" in err
        with pytest.raises(QueueError, match="hard links"):
            JobQueue(queue.path)                 # every name: the queue is unusable so
    finally:
        lock.release()
    other_name.unlink()
    assert [j.run_dir for j in JobQueue(queue.path).list()] == [str(tmp_path / "a" / "r1")]


@pytest.mark.parametrize("through_a_link", [False, True])
def test_a_foreign_wal_is_refused_and_the_queue_keeps_its_jobs(tmp_path, through_a_link):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    mine = _queue_with_jobs(tmp_path / "a" / "q.sqlite3", "r1", "r2", "r3")
    mine.close()                                 # the last connection: log checkpointed, gone
    assert not os.path.exists(f"{mine.path}-wal")
    other = _queue_with_jobs(tmp_path / "b" / "q.sqlite3", "x1")
    other._connection().execute("PRAGMA wal_checkpoint(TRUNCATE)")
    other.cancel(other.list()[0].id)             # the log now holds this one change only
    wal = tmp_path / "a" / "q.sqlite3-wal"
    shutil.copy(f"{other.path}-wal", wal)
    before = _digest(mine.path)
    name = tmp_path / "link.sqlite3" if through_a_link else mine.path
    if through_a_link:                           # SQLite keeps the log beside the real file
        name.symlink_to(mine.path)
    with pytest.raises(QueueError) as e:
        JobQueue(name)
    assert f"{wal} does not belong to the job queue" in e.value.message
    assert "Move q.sqlite3-wal away" in e.value.hint
    assert _digest(mine.path) == before          # nothing replayed into the database
    wal.rename(tmp_path / "moved-away")
    assert [os.path.basename(j.run_dir) for j in JobQueue(mine.path).list()] == ["r1", "r2",
                                                                                 "r3"]


def test_the_queues_own_log_left_by_a_dead_process_is_replayed(tmp_path):
    queue = _queue_with_jobs(tmp_path / "q.sqlite3", "r1")
    queue.close()
    code = ("import os, sys; from app.engine.runs.queue import JobQueue; "
            "q = JobQueue(sys.argv[1]); q.add(sys.argv[2]); os._exit(0)")   # no checkpoint
    run = RunDir.create(tmp_path / "r2", {})
    subprocess.run([sys.executable, "-c", code, str(queue.path), str(run.path)],
                   cwd=REPO, check=True, timeout=60)
    assert os.path.getsize(f"{queue.path}-wal") > 32
    assert [os.path.basename(j.run_dir) for j in JobQueue(queue.path).list()] == ["r1", "r2"]


@pytest.mark.parametrize("name", ["q.sqlite3", "q.sqlite3-wal", "q.sqlite3-journal"])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero link"])
def test_a_queue_file_that_is_not_a_regular_file_is_refused_naming_it(tmp_path, name, kind):
    """SQLite said 'disk I/O error' for a FIFO or /dev/zero as the database or its log."""
    if name != "q.sqlite3":
        _queue_with_jobs(tmp_path / "q.sqlite3").close()
    odd = tmp_path / name
    odd.unlink(missing_ok=True)
    os.mkfifo(odd) if kind == "fifo" else odd.symlink_to("/dev/zero")
    what = "a named pipe (FIFO)" if kind == "fifo" else "a character device"
    with pytest.raises(QueueError) as e:
        JobQueue(tmp_path / "q.sqlite3")
    assert e.value.message == f"The job queue file {odd} is {what}, not a file."
