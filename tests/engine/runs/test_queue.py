"""The SQLite job queue: ordering, every state transition, stale-job recovery, several
processes at once, and the `workbench queue` commands."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from app.cli.main import run_cli
from app.engine.errors import ConfigError, EngineError
from app.engine.runs.queue import (Job, JobLostError, JobQueue, JobStateError, NoSuchJobError,
                                   QueueError, default_queue_path, pid_alive, this_host)
from app.engine.runs.rundir import RunDir
from tests.conftest import REPO

ROOT = REPO


@pytest.fixture
def q(tmp_path) -> JobQueue:
    return JobQueue(tmp_path / "q.sqlite3")


def make_run(tmp_path, name: str) -> str:
    return str(RunDir.create(tmp_path / "runs" / name, {"name": name}).path)


def add_runs(q, tmp_path, *names, **kw) -> list[int]:
    return [q.add(make_run(tmp_path, n), **kw) for n in names]


def order(q) -> list[int]:
    return [j.id for j in q.list(("queued", "paused"))]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def set_columns(q, job_id, **cols):
    """Tests only: change a row behind the API (a worker on another host, a dead pid)."""
    with sqlite3.connect(q.path) as conn:
        conn.execute(f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in cols)} WHERE id = ?",
                     (*cols.values(), job_id))


# ---------------------------------------------------------------------------- basics


def test_add_get_list(q, tmp_path):
    a, b = add_runs(q, tmp_path, "a", "b")
    job = q.get(a)
    assert isinstance(job, Job) and job.state == "queued" and job.attempts == 0
    assert job.run_dir == str(tmp_path / "runs" / "a") and job.requested_action == "none"
    assert job.error is None and job.is_pending and not job.is_finished
    with pytest.raises(Exception):
        job.state = "done"  # frozen
    assert [j.id for j in q.list()] == [a, b]
    assert q.list("running") == [] and q.list([]) == []
    with pytest.raises(QueueError, match="Unknown job state"):
        q.list("sleeping")
    with pytest.raises(NoSuchJobError, match="no job 99"):
        q.get(99)
    assert q.find(tmp_path / "runs" / "b")[0].id == b
    assert json.loads(json.dumps(job.to_dict()))["id"] == a


def test_add_checks_the_run_directory(q, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        q.add(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        q.add(tmp_path / "empty")
    assert q.add(tmp_path / "empty", check=False) > 0


def test_a_data_parallel_run_is_refused_by_the_local_queue(q, tmp_path):
    """workers > 1 trains on a Ray cluster only: the local queue says so when the run is added,
    not when its job starts and fails."""
    run = str(RunDir.create(tmp_path / "runs" / "dp", {"name": "dp", "workers": 2}).path)
    with pytest.raises(ConfigError, match=r"data-parallel \(2 workers\).*--on CLUSTER"):
        q.add(run)
    assert q.list() == []


def test_one_active_job_per_run_directory(q, tmp_path):
    run = make_run(tmp_path, "a")
    first = q.add(run)
    with pytest.raises(JobStateError, match=f"already in the queue as job {first}"):
        q.add(run)
    q.cancel(first)
    second = q.add(run)
    with pytest.raises(JobStateError, match=f"already in the queue as job {second}"):
        q.retry(first)


def test_claim_order_priority_and_reorder(q, tmp_path):
    a, b, c = add_runs(q, tmp_path, "a", "b", "c")
    (urgent,) = add_runs(q, tmp_path, "urgent", priority=5)
    (mid,) = add_runs(q, tmp_path, "mid", priority=1)
    (low,) = add_runs(q, tmp_path, "low")
    assert order(q) == [urgent, mid, a, b, c, low]
    q.reorder(low, 1)
    assert order(q) == [low, urgent, mid, a, b, c]
    q.reorder(low, 99)  # clamped to the end
    assert order(q) == [urgent, mid, a, b, c, low]
    q.reorder(a, -3)  # clamped to the front
    assert order(q) == [a, urgent, mid, b, c, low]
    q.move_down(a)
    q.move(c, -2)
    assert order(q) == [urgent, a, c, mid, b, low]
    q.move_up(urgent)  # already first
    q.pause(a)  # paused jobs keep their place but are skipped
    assert order(q) == [urgent, a, c, mid, b, low]
    claimed = [q.claim_next("w").id for _ in range(5)]
    assert claimed == [urgent, c, mid, b, low] and q.claim_next("w") is None
    q.resume(a)
    assert q.claim_next("w").id == a


# ---------------------------------------------------------------------------- transitions

SETUPS = ["queued", "paused", "running", "running+cancel", "running+pause", "done", "failed",
          "cancelled"]


def job_in(q, tmp_path, setup: str) -> int:
    (job_id,) = add_runs(q, tmp_path, "x")
    if setup == "paused":
        q.pause(job_id)
    if setup.startswith("running") or setup in ("done", "failed", "cancelled"):
        assert q.claim_next("w1").id == job_id
    if setup == "running+cancel":
        q.cancel(job_id)
    if setup == "running+pause":
        q.pause(job_id)
    if setup in ("done", "failed", "cancelled"):
        q.finish(job_id, "w1", setup, {"kind": "dataset", "message": "bad", "hint": "fix",
                                       "detail": "tb"} if setup == "failed" else None)
    return job_id


# (setup, action) -> (state, requested_action) after it, or the error message it raises.
EXPECTED = {
    ("queued", "cancel"): ("cancelled", "none"),
    ("queued", "pause"): ("paused", "none"),
    ("queued", "resume"): "is queued, not paused",
    ("queued", "retry"): "only failed or cancelled",
    ("queued", "reorder"): ("queued", "none"),
    ("paused", "cancel"): ("cancelled", "none"),
    ("paused", "pause"): "already paused",
    ("paused", "resume"): ("queued", "none"),
    ("paused", "retry"): "only failed or cancelled",
    ("paused", "reorder"): ("paused", "none"),
    ("running", "cancel"): ("running", "cancel"),
    ("running", "pause"): ("running", "pause"),
    ("running", "resume"): "is running, not paused",
    ("running", "retry"): "only failed or cancelled",
    ("running", "reorder"): "only queued or paused",
    ("running+cancel", "cancel"): "already requested",
    ("running+cancel", "pause"): "being cancelled",
    ("running+cancel", "resume"): "is running, not paused",
    ("running+cancel", "retry"): "only failed or cancelled",
    ("running+cancel", "reorder"): "only queued or paused",
    ("running+pause", "cancel"): ("running", "cancel"),
    ("running+pause", "pause"): "already requested",
    ("running+pause", "resume"): ("running", "none"),
    ("running+pause", "retry"): "only failed or cancelled",
    ("running+pause", "reorder"): "only queued or paused",
    ("done", "cancel"): "already finished",
    ("done", "pause"): "already finished",
    ("done", "resume"): "cannot be resumed",
    ("done", "retry"): "finished successfully",
    ("done", "reorder"): "only queued or paused",
    ("failed", "cancel"): "already finished",
    ("failed", "pause"): "already finished",
    ("failed", "resume"): "cannot be resumed",
    ("failed", "retry"): ("queued", "none"),
    ("failed", "reorder"): "only queued or paused",
    ("cancelled", "cancel"): "already finished",
    ("cancelled", "pause"): "already finished",
    ("cancelled", "resume"): "cannot be resumed",
    ("cancelled", "retry"): ("queued", "none"),
    ("cancelled", "reorder"): "only queued or paused",
}


@pytest.mark.parametrize("setup, action", sorted(EXPECTED))
def test_every_transition(q, tmp_path, setup, action):
    job_id = job_in(q, tmp_path, setup)
    before = q.get(job_id)
    call = (lambda: q.reorder(job_id, 1)) if action == "reorder" else \
        (lambda: getattr(q, action)(job_id))
    expected = EXPECTED[(setup, action)]
    if isinstance(expected, str):
        with pytest.raises(JobStateError, match=expected) as e:
            call()
        assert f"Job {job_id}" in e.value.message and isinstance(e.value, EngineError)
        assert q.get(job_id) == before  # nothing changed
        return
    job = call()
    assert (job.state, job.requested_action) == expected and job == q.get(job_id)
    if job.state == "cancelled":
        assert job.finished_at is not None
    if action == "retry":
        assert job.error is None and job.attempts == 0 and job.finished_at is None
        assert q.claim_next("w2").id == job_id


def test_unknown_job_for_every_action(q):
    for call in (q.cancel, q.pause, q.resume, q.retry, q.get, lambda i: q.reorder(i, 1),
                 lambda i: q.heartbeat(i, "w"), lambda i: q.finish(i, "w", "done")):
        with pytest.raises((NoSuchJobError, JobLostError)):
            call(42)


def test_worker_side_heartbeat_and_finish(q, tmp_path):
    (job_id,) = add_runs(q, tmp_path, "a")
    job = q.claim_next("w1")
    assert job.state == "running" and job.worker_id == "w1" and job.worker_pid == os.getpid()
    assert job.worker_host == this_host() and job.heartbeat_at and job.started_at
    assert q.heartbeat(job_id, "w1") is None
    q.pause(job_id)
    assert q.heartbeat(job_id, "w1") == "pause"
    q.cancel(job_id)
    assert q.heartbeat(job_id, "w1", touch=False) == "cancel"
    with pytest.raises(JobLostError, match="no longer owns"):
        q.heartbeat(job_id, "w2")
    with pytest.raises(JobLostError, match="cannot finish"):
        q.finish(job_id, "w2", "done")
    with pytest.raises(ValueError):
        q.finish(job_id, "w1", "running")
    err = {"kind": "out_of_memory", "message": "out of memory at step 3", "hint": "lower --batch",
           "detail": "Traceback..."}
    job = q.finish(job_id, "w1", "failed", err)
    assert job.state == "failed" and job.error == err and job.finished_at
    assert job.requested_action == "none"
    with pytest.raises(JobLostError):
        q.heartbeat(job_id, "w1")
    with pytest.raises(JobLostError):
        q.finish(job_id, "w1", "done")


def test_finish_paused_and_requeued(q, tmp_path):
    a, b, c = add_runs(q, tmp_path, "a", "b", "c")
    assert q.claim_next("w").id == a
    assert q.finish(a, "w", "paused").state == "paused"
    assert q.claim_next("w").id == b
    q.finish(b, "w", "queued")  # the worker stopped: b goes back to the front
    assert order(q) == [b, a, c] and q.get(b).finished_at is None
    assert q.claim_next("w").id == b


# ---------------------------------------------------------------------------- stale jobs


def test_recover_a_job_whose_worker_pid_is_gone(q, tmp_path):
    a, b = add_runs(q, tmp_path, "a", "b")
    q.claim_next("dead-worker")
    set_columns(q, a, worker_pid=dead_pid())
    assert q.recover_stale(timeout_s=3600) == [q.get(a)]
    job = q.get(a)
    assert job.state == "queued" and job.attempts == 1 and order(q) == [a, b]
    status = RunDir(job.run_dir).status()
    assert status["state"] == "queued" and status["attempts"] == 1
    assert "worker died" in RunDir(job.run_dir).log_path.read_text()


def test_a_live_worker_is_left_alone_and_a_silent_one_is_not(q, tmp_path):
    (a,) = add_runs(q, tmp_path, "a")
    q.claim_next("me")  # this process: alive, fresh heartbeat
    assert q.recover_stale(timeout_s=60) == [] and q.get(a).state == "running"
    # A worker on another host (pid unknowable) whose heartbeat stopped 2 minutes ago:
    set_columns(q, a, worker_host="elsewhere", heartbeat_at=time.time() - 120)
    assert q.recover_stale(timeout_s=600) == []
    assert [j.id for j in q.recover_stale(timeout_s=60)] == [a]
    assert q.get(a).state == "queued" and q.get(a).attempts == 1


def test_a_job_whose_worker_keeps_dying_fails_with_the_reason(q, tmp_path):
    (a,) = add_runs(q, tmp_path, "a")
    for attempt in (1, 2, 3):
        assert q.claim_next("w").id == a
        set_columns(q, a, worker_pid=dead_pid())
        (job,) = q.recover_stale(max_attempts=3)
        assert job.attempts == attempt
    assert job.state == "failed" and job.error_kind == "worker_died"
    assert "died 3 time(s)" in job.error_message and "retry" in job.error_hint
    assert RunDir(job.run_dir).status()["error"]["kind"] == "worker_died"
    assert q.retry(a).state == "queued"


def test_recovering_a_job_with_a_pending_request(q, tmp_path):
    a, b = add_runs(q, tmp_path, "a", "b")
    for job_id, action, expected in ((a, q.cancel, "cancelled"), (b, q.pause, "paused")):
        assert q.claim_next("w").id == job_id
        action(job_id)
        set_columns(q, job_id, worker_pid=dead_pid())
        q.recover_stale()
        assert q.get(job_id).state == expected


def test_pid_alive():
    assert pid_alive(os.getpid())
    assert not pid_alive(dead_pid()) and not pid_alive(None) and not pid_alive(0)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and pid_alive(zombie.pid):
        time.sleep(0.02)
    assert not pid_alive(zombie.pid)  # exited but not reaped yet: a zombie counts as dead
    zombie.wait()


# ---------------------------------------------------------------------------- the database file


def test_queue_location(tmp_path, monkeypatch):
    import platformdirs

    monkeypatch.delenv("WORKBENCH_QUEUE", raising=False)
    monkeypatch.setattr(platformdirs, "user_data_dir", lambda name: str(tmp_path / name))
    assert default_queue_path() == tmp_path / "gguf-workbench" / "queue.sqlite3"
    assert JobQueue().path == tmp_path / "gguf-workbench" / "queue.sqlite3"
    monkeypatch.setenv("WORKBENCH_QUEUE", str(tmp_path / "env" / "q.db"))
    assert JobQueue().path == tmp_path / "env" / "q.db" and (tmp_path / "env" / "q.db").exists()
    assert JobQueue(tmp_path / "explicit.db").path == tmp_path / "explicit.db"


def test_wal_mode_and_a_newer_schema(q, tmp_path):
    with sqlite3.connect(q.path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        conn.execute("PRAGMA user_version = 99")
    with pytest.raises(QueueError, match="newer workbench"):
        JobQueue(q.path)


def test_a_corrupt_database_is_a_clear_error(tmp_path):
    path = tmp_path / "q.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(QueueError, match="corrupt") as e:
        JobQueue(path)
    assert "Move the file away" in e.value.hint


def test_a_locked_database_is_a_clear_error(q, tmp_path):
    (a,) = add_runs(q, tmp_path, "a")
    blocker = sqlite3.connect(q.path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        impatient = JobQueue(q.path, busy_timeout_s=0.2)
        assert impatient.get(a).state == "queued"  # WAL: readers are never blocked
        with pytest.raises(QueueError, match="stayed locked"):
            impatient.cancel(a)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert impatient.cancel(a).state == "cancelled"  # the connection recovered


# ---------------------------------------------------------------------------- several processes

_CLAIMER = """
import sys, time
from app.engine.runs.queue import JobQueue
path, out, go = sys.argv[1:4]
q = JobQueue(path)
deadline = time.time() + 30
while not __import__("os").path.exists(go) and time.time() < deadline:
    time.sleep(0.005)
ids = []
idle = 0
while idle < 40 and time.time() < deadline:
    job = q.claim_next("claimer-" + out)
    if job is None:
        idle += 1
        time.sleep(0.005)
        continue
    idle = 0
    ids.append(job.id)
    q.heartbeat(job.id, "claimer-" + out)
    q.finish(job.id, "claimer-" + out, "done")
open(out, "w").write(",".join(map(str, ids)))
"""


def test_several_processes_claim_add_and_cancel_at_once(q, tmp_path):
    """Three claiming processes and this one (adding, listing, cancelling) on one queue:
    every job is claimed by at most one process, and ends done or cancelled."""
    (tmp_path / "runs").mkdir()
    first = [q.add(tmp_path / "runs" / f"r{i}", check=False) for i in range(30)]
    go = tmp_path / "go"
    outs = [tmp_path / f"claimed-{i}.txt" for i in range(3)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _CLAIMER, str(q.path), str(out), str(go)],
                              env=env) for out in outs]
    go.touch()
    added, cancelled = list(first), set()
    for i in range(30, 60):
        added.append(q.add(tmp_path / "runs" / f"r{i}", check=False))
        if i % 5 == 0:
            try:
                if q.cancel(added[-3]).state == "cancelled":
                    cancelled.add(added[-3])
            except JobStateError:
                pass  # already finished by a claimer
        assert len(q.list()) == len(added)
    for p in procs:
        assert p.wait(timeout=60) == 0
    claimed = [int(x) for out in outs for x in out.read_text().split(",") if x]
    assert len(claimed) == len(set(claimed)), "a job was claimed twice"
    assert set(claimed) | cancelled == set(added) and not set(claimed) & cancelled
    states = {j.id: j.state for j in q.list()}
    assert all(states[i] == "done" for i in claimed)
    assert all(states[i] == "cancelled" for i in cancelled)


# ---------------------------------------------------------------------------- the CLI


def test_queue_cli(tmp_path, capsys):
    qpath = str(tmp_path / "q.sqlite3")
    Q = ["--queue", qpath]
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    assert run_cli(["queue", "add", a, *Q]) == 0
    assert "queued job 1" in capsys.readouterr().out
    assert run_cli(["queue", "add", b, "--priority", "2", *Q]) == 0
    capsys.readouterr()
    RunDir(a).write_status(state="running", step=3, total_steps=10, loss=1.25)
    assert run_cli(["queue", "list", *Q]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].split()[:2] == ["2", "queued"] and lines[2].split()[:2] == ["1", "queued"]
    assert "step 3/10, loss 1.2500" in out
    assert run_cli(["queue", "reorder", "1", "1", *Q]) == 0
    assert run_cli(["queue", "pause", "2", *Q]) == 0
    assert "job 2: paused" in capsys.readouterr().out
    assert run_cli(["queue", "list", "--json", *Q]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["id"], r["state"]) for r in rows] == [(1, "queued"), (2, "paused")]
    assert rows[0]["status"]["step"] == 3
    assert run_cli(["queue", "list", "--state", "paused", "--json", *Q]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == [2]
    assert run_cli(["queue", "resume", "2", *Q]) == 0
    JobQueue(qpath).claim_next("w")
    assert run_cli(["queue", "cancel", "1", *Q]) == 0
    assert "job 1: running, cancel requested" in capsys.readouterr().out
    assert run_cli(["queue", "list", *Q]) == 0
    assert "running (cancel requested)" in capsys.readouterr().out
    assert run_cli(["queue", "cancel", "2", *Q]) == 0
    assert run_cli(["queue", "retry", "2", *Q]) == 0
    assert "job 2: queued" in capsys.readouterr().out
    # Errors: a message and a hint on stderr, exit status 2.
    assert run_cli(["queue", "resume", "2", *Q]) == 2
    err = capsys.readouterr().err
    assert "error: Job 2 is queued, not paused" in err
    assert run_cli(["queue", "cancel", "7", *Q]) == 2
    assert "no job 7" in capsys.readouterr().err
    assert run_cli(["queue", "add", str(tmp_path), *Q]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert run_cli(["queue", "list", "--queue", str(tmp_path / "empty.sqlite3")]) == 0
    assert "no jobs" in capsys.readouterr().out


def test_queue_cli_uses_the_environment_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORKBENCH_QUEUE", str(tmp_path / "env.sqlite3"))
    assert run_cli(["queue", "add", make_run(tmp_path, "a")]) == 0
    assert [j.id for j in JobQueue(tmp_path / "env.sqlite3").list()] == [1]


# ---------------------------------------------------------------------------- a full disk


def test_a_full_database_says_the_disk_is_full(q, tmp_path):
    q._connection().execute("PRAGMA max_page_count = 8")  # SQLITE_FULL, as on a full disk
    with pytest.raises(QueueError) as caught:
        for i in range(200):
            q.add(make_run(tmp_path, f"r{i}"))
    err = caught.value
    assert "is full" in err.message and "Free some space" in err.hint
    assert "writable" not in err.hint


class _FailingConnection:
    def __init__(self, message: str):
        self.message = message

    def execute(self, *args):
        raise sqlite3.OperationalError(self.message)


@pytest.mark.parametrize("free, says", [(1 << 20, "is full"), (1 << 40, "I/O error")])
def test_a_disk_io_error_is_a_full_disk_only_when_the_disk_is_full(q, tmp_path, monkeypatch,
                                                                    free, says):
    monkeypatch.setattr(q, "_connection", lambda: _FailingConnection("disk I/O error"))
    monkeypatch.setattr("shutil.disk_usage", lambda path: SimpleNamespace(free=free))  # bytes
    with pytest.raises(QueueError) as caught:
        q.add(make_run(tmp_path, "r"))
    assert says in caught.value.message
    assert "writable" not in caught.value.hint and "permission" not in caught.value.hint


def test_permission_errors_keep_the_permissions_hint(q, monkeypatch):
    monkeypatch.setattr(q, "_connection",
                        lambda: _FailingConnection("attempt to write a readonly database"))
    with pytest.raises(QueueError, match="cannot be opened or written") as caught:
        q.list()
    assert "writable" in caught.value.hint


def test_continue_run_resumes_retries_or_queues_as_can_continue_says(q, tmp_path):
    """The window's Continue (Runs and Monitor alike, issue 29 item 8): one call."""
    from app.engine.runs.queue import can_continue
    paused = RunDir.create(tmp_path / "paused", {"name": "paused"}).path
    job = q.get(q.pause(q.add(paused)).id)
    assert can_continue(job, job.state, False)
    assert q.continue_run(paused, job) == f"Resumed job {job.id}"
    assert q.get(job.id).state == "queued"
    failed = RunDir.create(tmp_path / "failed", {"name": "failed"}).path
    q.add(failed)
    [claimed] = [j for j in [q.claim_next("w"), q.claim_next("w")] if j.run_dir == str(failed)]
    q.finish(claimed.id, "w", "failed", {"kind": "bug", "message": "boom", "hint": None,
                                         "detail": ""})
    job = q.get(claimed.id)
    assert can_continue(job, job.state, False)
    assert q.continue_run(failed, job) == f"Job {job.id} queued again"
    assert q.get(job.id).state == "queued"
    outside = RunDir.create(tmp_path / "cli", {"name": "cli"}).path
    assert not can_continue(None, "interrupted", False)        # nothing to go on from
    assert can_continue(None, "interrupted", True) and can_continue(None, "running", True, True)
    assert not can_continue(None, "running", True) and not can_continue(None, "done", True)
    message = q.continue_run(outside, None)
    assert message.startswith("Queued cli as job ") and len(q.find(outside)) == 1
