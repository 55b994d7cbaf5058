"""The queue's side of executors (issue 23): each job's executor, attempt and handle; an older
database gains the columns; a cluster job must be on storage its cluster sees; a local job's
handle guards against a reused pid; a cluster job whose worker died is reattached, not lost."""

from __future__ import annotations

import json
import sqlite3

import pytest

from app.engine.errors import ConfigError
from app.engine.runs.clusters import Cluster, ClusterError, PathMap
from app.engine.runs.executors import LocalExecutor
from app.engine.runs.executors.local import local_handle
from app.engine.runs.queue import JobQueue
from tests.engine.runs.test_queue import dead_pid, make_run, set_columns

SCHEMA_1 = """
CREATE TABLE jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_dir TEXT NOT NULL, state TEXT NOT NULL,
    priority INTEGER NOT NULL DEFAULT 0, position INTEGER NOT NULL,
    requested_action TEXT NOT NULL DEFAULT 'none', worker_id TEXT, worker_host TEXT,
    worker_pid INTEGER, heartbeat_at REAL, created_at REAL NOT NULL, started_at REAL,
    finished_at REAL, attempts INTEGER NOT NULL DEFAULT 0, error_kind TEXT, error_message TEXT,
    error_hint TEXT, error_detail TEXT);
INSERT INTO jobs (run_dir, state, position, created_at) VALUES ('/old/run', 'queued', 1, 0);
PRAGMA user_version = 1;
"""


@pytest.fixture
def q(tmp_path) -> JobQueue:
    queue = JobQueue(tmp_path / "q.sqlite3")
    store = queue.clusters()
    store.save(Cluster("far", "http://head.example:8265",
                       PathMap.parse(f"{tmp_path}/shared=/mnt/shared")))
    store.save(Cluster("loop", "http://127.0.0.1:8265"))
    return queue


def test_an_older_database_gains_the_columns(tmp_path):
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.executescript(SCHEMA_1)
    job = JobQueue(path).list()[0]
    assert (job.run_dir, job.executor, job.attempt, job.handle) == ("/old/run", "local", 0, None)
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    JobQueue(path)  # opening it again changes nothing


def test_add_on_a_cluster(q, tmp_path):
    local = q.add(make_run(tmp_path, "here"))
    shared = q.add(make_run(tmp_path / "shared", "there"), executor="far")
    loop = q.add(make_run(tmp_path, "loop"), executor="loop")
    assert [q.get(i).executor for i in (local, shared, loop)] == ["local", "far", "loop"]
    assert q.get(local).is_local and not q.get(shared).is_local
    with pytest.raises(ConfigError, match="not under a shared folder"):
        q.add(make_run(tmp_path, "unshared"), executor="far")
    with pytest.raises(ClusterError, match="No cluster named 'nowhere'"):
        q.add(make_run(tmp_path, "x"), executor="nowhere")


def test_a_local_job_records_its_worker_process(q, tmp_path):
    job_id = q.add(make_run(tmp_path, "a"))
    job = q.claim_next("w")
    assert job.handle == local_handle(job.worker_pid) and job.handle["start_time"]
    assert LocalExecutor().poll(job.handle).state == "running"
    # the same pid, another process (the pid was reused): the worker is dead
    set_columns(q, job_id, handle=json.dumps({**job.handle, "start_time": "1"}))
    assert LocalExecutor().poll(q.get(job_id).handle).state == "lost"
    assert [j.state for j in q.recover_stale()] == ["queued"]
    job = q.get(job_id)
    assert (job.attempts, job.handle) == (1, None)


def test_a_cluster_job_is_reattached_after_its_worker_died(q, tmp_path):
    job_id = q.add(make_run(tmp_path, "a"), executor="loop")
    job = q.claim_next("w1")
    assert job.handle is None
    q.record_attempt(job_id, "w1", 1, {"submission_id": "wb-1-a1", "cluster": "loop"})
    set_columns(q, job_id, worker_pid=dead_pid())
    assert [j.state for j in q.recover_stale()] == ["queued"]
    job = q.cancel(job_id)  # asked while no worker follows it: kept for the next one
    assert (job.state, job.requested_action, job.in_flight) == ("queued", "cancel", True)
    job = q.claim_next("w2")
    assert (job.attempt, job.attempts, job.requested_action) == (1, 0, "cancel")
    assert job.handle == {"submission_id": "wb-1-a1", "cluster": "loop"}
    # a worker that stops puts it back with its handle; a finished attempt forgets it
    assert q.finish(job_id, "w2", "queued").handle is not None
    q.claim_next("w3")
    job = q.finish(job_id, "w3", "cancelled")
    assert (job.handle, job.attempt) == (None, 1)
    assert q.retry(job_id).attempt == 1  # attempts only grow: a submission id is never reused


def test_each_queue_has_its_own_id(q, tmp_path):
    """It names the queue's submissions: job 1 of another queue on the same cluster differs."""
    other = JobQueue(tmp_path / "other.sqlite3")
    assert len(q.queue_id) == 8 and q.queue_id == JobQueue(q.path).queue_id != other.queue_id
