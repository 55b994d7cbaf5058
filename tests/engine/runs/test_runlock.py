"""One writer per run (issue 28, point 2): the run's lock (app.engine.runs.runlock) refuses a
second writer naming the first, is taken over once its holder died, is never a link; the queue
keys a run by its resolved path and refuses a run another process writes; a worker's job on
such a run fails without writing to it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from app.engine.runs.queue import JobQueue, JobStateError
from app.engine.runs.remote import run_remote
from app.engine.runs.rundir import RunDir
from app.engine.runs.runlock import LOCK, RunBusyError, RunLock, lock_holder
from app.engine.runs.worker import run_worker
from app.engine.runtime.files import StorageError
from tests.conftest import REPO

HOLD = ("import sys, time\n"
        "from app.engine.runs.runlock import RunLock\n"
        "RunLock(sys.argv[1], 'a test holder').acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(300)\n")


@pytest.fixture
def run(tmp_path) -> RunDir:
    return RunDir.create(tmp_path / "run", {"kind": "sft", "model": "m.gguf", "data": "d.jsonl"})


@pytest.fixture
def holder(run):
    """A process that holds the run's lock (killed at the end, whatever happens)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run.path)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait(30)


def test_a_second_writer_is_refused_naming_the_holder(run, holder):
    with pytest.raises(RunBusyError) as e:
        RunLock(run, "this test").acquire()
    assert f"a test holder (pid {holder.pid} on {socket.gethostname()}" in e.value.message
    assert lock_holder(run)["pid"] == holder.pid
    # the CLI's resume: exit 2, the holder named, nothing of the run touched
    before = sorted(p.name for p in run.path.iterdir())
    done = subprocess.run([sys.executable, "-m", "app", "resume", str(run.path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"pid {holder.pid}" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in run.path.iterdir()) == before


def test_a_lock_left_by_a_killed_holder_is_taken_over_with_a_log_line(run, holder):
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(30)
    assert (run.path / LOCK).exists() and lock_holder(run) is None   # the kernel let it go
    with RunLock(run, "this test"):
        assert lock_holder(run)["pid"] == os.getpid()
        log = run.log_path.read_text()
        assert f"this test took over the lock {LOCK} left by a test holder (pid {holder.pid}" in log
    assert not (run.path / LOCK).exists()    # released: the file goes with it
    with RunLock(run, "again"):
        pass
    assert run.log_path.read_text() == log   # nothing was left this time: nothing to say


def test_the_lock_is_never_a_link(run, tmp_path):
    target = tmp_path / "elsewhere.txt"
    (run.path / LOCK).symlink_to(target)
    with pytest.raises(StorageError, match="is a symbolic link"):
        RunLock(run, "this test").acquire()
    assert not target.exists()


def test_the_queue_keys_a_run_by_its_resolved_path(tmp_path):
    q = JobQueue(tmp_path / "q.sqlite3")
    many = tmp_path / "many"
    RunDir.create(many / "r1", {"model": "m", "data": "d"})
    (tmp_path / "link").symlink_to(many)
    job = q.add(many / "r1")
    for spelling in (f"{many}/../many/r1", tmp_path / "link" / "r1"):
        with pytest.raises(JobStateError, match=f"already in the queue as job {job}"):
            q.add(spelling)
        assert [j.id for j in q.find(spelling)] == [job]


def test_queue_add_refuses_a_run_another_process_writes(run, holder, tmp_path):
    with pytest.raises(RunBusyError, match=f"pid {holder.pid}"):
        JobQueue(tmp_path / "other.sqlite3").add(run.path)


def test_a_job_on_a_run_another_process_writes_fails_and_leaves_the_run_alone(run, tmp_path):
    q = JobQueue(tmp_path / "q.sqlite3")
    job_id = q.add(run.path)
    ran = []
    with RunLock(run, "a terminal's resume"):
        run_worker(q, runner=lambda run_dir, control: ran.append(1), once=True)
    job = q.get(job_id)
    assert (job.state, job.error_kind, ran) == ("failed", "run_busy", [])
    assert f"a terminal's resume (pid {os.getpid()}" in job.error_message
    assert not run.status_path.exists() and not run.log_path.exists()


def test_a_cluster_attempt_on_a_run_another_process_writes_is_refused(run, holder):
    ran = []
    with pytest.raises(RunBusyError, match=f"pid {holder.pid}"):
        run_remote(run.path, runner=lambda run_dir, control: ran.append(1))
    assert ran == [] and not run.status_path.exists()


def test_deleting_run_lock_does_not_let_a_second_writer_in(run, holder, tmp_path):
    """The run folder itself is locked (flock on its descriptor): run.lock deleted under a
    running holder, a second writer, a queue's add and lock_holder still see the run held."""
    (run.path / LOCK).unlink()
    with pytest.raises(RunBusyError, match="being written by another process"):
        RunLock(run, "this test").acquire()
    assert lock_holder(run) == {}
    with pytest.raises(RunBusyError, match="another process"):
        JobQueue(tmp_path / "other.sqlite3").add(run.path)
    assert not (run.path / LOCK).exists()   # the refused writer made no lock file of its own
    holder.kill()
    holder.wait(30)
    with RunLock(run, "this test"):         # the kernel let the folder go with its holder
        assert lock_holder(run)["pid"] == os.getpid()
