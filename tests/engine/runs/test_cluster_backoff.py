"""A cluster that does not answer (issue 28): its job goes back to the queue and the worker
tries that cluster again after 1, 2, 4 ... 60 s while it runs the other jobs; past the limit
the job fails with the reason; a worker asked to stop (SIGTERM) stops within seconds, even
while a head that never answers holds a request, and leaves the job queued."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from app.engine.runs.clusters import Cluster
from app.engine.runs.queue import JobQueue
from app.engine.runs.rundir import RunDir
from app.engine.runs.worker import ClusterBackoff, run_worker
from tests.conftest import REPO
from tests.engine.runs.test_queue import make_run

TIMEOUT = 30.0


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_head():
    """A loopback port that accepts connections and never answers (a hung head)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def wait_for(cond, what: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def queue_with(tmp_path, url: str) -> tuple[JobQueue, int, int]:
    """A queue holding a job on cluster "down" (at `url`), then a local job."""
    q = JobQueue(tmp_path / "q.sqlite3")
    q.clusters().save(Cluster("down", url))
    return q, q.add(make_run(tmp_path, "far"), executor="down"), q.add(make_run(tmp_path, "here"))


def test_the_wait_doubles_up_to_a_minute_and_a_cluster_that_answers_is_forgotten():
    now = [0.0]
    backoff = ClusterBackoff(give_up_s=600, clock=lambda: now[0])
    waits = []
    for _ in range(9):
        silent, wait = backoff.failed("lab")
        assert backoff.waiting() == ["lab"] and silent == now[0]
        waits.append(wait)
        now[0] += wait
        assert backoff.waiting() == []
    assert waits == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    backoff.reached("lab")
    assert backoff.failed("lab") == (0.0, 1.0)


def test_a_local_job_runs_while_the_cluster_is_unreachable(tmp_path, closed_port):
    q, far, here = queue_with(tmp_path, f"http://127.0.0.1:{closed_port}")
    ran = []
    stop = threading.Event()
    worker = threading.Thread(target=run_worker, args=(q,), daemon=True, kwargs=dict(
        runner=lambda run, control: ran.append(run.path.name), poll_s=0.05, stop_event=stop,
        exclusive=False))
    worker.start()
    try:
        wait_for(lambda: q.get(here).state == "done", "the local job")
        time.sleep(1.0)
    finally:
        stop.set()
        worker.join(TIMEOUT)
    assert not worker.is_alive() and ran == ["here"]
    job = q.get(far)
    assert (job.state, job.attempt, job.handle) == ("queued", 0, None)
    run = RunDir(job.run_dir)
    assert run.status()["state"] == "queued"
    tries = run.log_path.read_text().count("cannot be reached")
    assert 1 <= tries <= 3  # 1 s, then 2 s: not one a poll


def test_a_cluster_silent_past_the_limit_fails_its_job(tmp_path, closed_port):
    q, far, here = queue_with(tmp_path, f"http://127.0.0.1:{closed_port}")
    run_worker(q, runner=lambda run, control: "done", once=True, exclusive=False,
               unreachable_timeout_s=0)
    job = q.get(far)
    assert job.state == "failed" and "cannot be reached" in job.error_message
    assert q.get(here).state == "done"


def test_stopping_does_not_wait_for_a_head_that_never_answers(tmp_path, silent_head):
    q, far, _ = queue_with(tmp_path, silent_head)
    stop = threading.Event()
    worker = threading.Thread(target=run_worker, args=(q,), daemon=True, kwargs=dict(
        poll_s=0.05, stop_event=stop, exclusive=False))
    worker.start()
    wait_for(lambda: q.get(far).handle is not None, "the submission")
    time.sleep(0.3)  # the POST waits on the head (its timeout: 60 s)
    stop.set()
    worker.join(5.0)
    assert not worker.is_alive()
    job = q.get(far)  # it may have arrived: the next worker asks the cluster by its handle
    assert job.state == "queued" and job.handle["submission_id"].endswith(f"-{far}-a1")


def test_sigterm_stops_a_worker_whose_cluster_is_unreachable(tmp_path, closed_port):
    """The reproduction: a job on a cluster at a closed port; the worker got SIGTERM and spun
    for a minute writing thousands of "trying again" lines a second."""
    q = JobQueue(tmp_path / "q.sqlite3")
    q.clusters().save(Cluster("down", f"http://127.0.0.1:{closed_port}"))
    far = q.add(make_run(tmp_path, "far"), executor="down")
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "app", "queue", "worker", "--queue",
                                   str(q.path)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "cannot be reached" in log.read_text(), "the first try")
        time.sleep(1.5)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(10) == 0
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
    assert q.get(far).state == "queued"
    assert log.read_text().count("cannot be reached") <= 3


def test_a_head_that_never_answers_does_not_hold_the_local_job_behind_it(tmp_path, silent_head,
                                                                         capsys):
    """Probe finding 5: the local job behind a job on a head that accepts connections and never
    answers started after 60 s (the submission's timeout), the cluster job shown "running"
    meanwhile; a later retry held the worker 10 s; the worker's count took retries for jobs."""
    from app.cli.main import run_cli

    q, far, here = queue_with(tmp_path, silent_head)
    count = []
    stop = threading.Event()
    worker = threading.Thread(target=lambda: count.append(run_worker(
        q, runner=lambda run, control: "done", poll_s=0.05, stop_event=stop, exclusive=False)),
        daemon=True)
    started = time.monotonic()
    worker.start()
    try:
        wait_for(lambda: q.get(far).handle is not None, "the submission")
        assert run_cli(["queue", "list", "--queue", str(q.path)]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines()
                   if line.split()[0] == str(far))
        assert row.split()[1] == "submitting"
        wait_for(lambda: q.get(here).state == "done", "the local job", timeout=15.0)
        assert time.monotonic() - started < 15.0
    finally:
        stop.set()
        worker.join(TIMEOUT)
    assert not worker.is_alive() and count == [1]
    job = q.get(far)
    assert (job.state, job.handle) == ("queued", None)
    assert "did not answer" in RunDir(job.run_dir).log_path.read_text() \
        or "timed out" in RunDir(job.run_dir).log_path.read_text()
