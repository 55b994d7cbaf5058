"""The same runs on each executor (issue 23): "local" (the worker runs it in its process) and
"loop" (the loopback Ray head, through the Jobs REST API): the happy path, a cancel (stopped
within the grace, a checkpoint at or after the cancel step, no process left), and a pause then
resume that ends with the adapter of an uninterrupted seeded run."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from app.engine.runs.executors.ray import DEFAULT_STOP_GRACE_S, SUBMISSION_ENV
from app.engine.runs.queue import JobQueue
from app.engine.runs.clusters import PathMap
from app.engine.runs.remote import EXIT_STOPPED, MappedRunDir, run_remote
from app.engine.runs.rundir import RunDir, run_entry
from app.engine.runtime.processes import pid_alive
from tests.engine.runs.cluster_runs import (add_loop_cluster, checkpoint_steps, last_step,
                                            queue_run, reference_adapter, wait_for,
                                            wait_finished, worker)

EXECUTORS = ["local", pytest.param("loop", marks=pytest.mark.slow)]


@pytest.fixture
def q(tmp_path, request, monkeypatch) -> JobQueue:
    queue = JobQueue(tmp_path / "q.sqlite3")
    if request.node.callspec.params["executor"] == "loop":
        add_loop_cluster(queue, request.getfixturevalue("ray_head"), monkeypatch)
    return queue


def _remote_pid_gone(run: RunDir, executor: str) -> bool:
    """No process of the run is left: the Ray job's driver (its pid in status.json) is gone."""
    pid = run.status().get("pid")
    return executor == "local" or (pid is not None and not pid_alive(pid))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_run_on_each_executor(q, tmp_path, executor):
    job_id = queue_run(q, tmp_path / "run", executor, steps=6)
    with worker(q):
        job = wait_finished(q, job_id)
    run = RunDir(tmp_path / "run")
    assert (job.state, job.executor, job.error) == ("done", executor, None)
    assert job.attempt == (0 if executor == "local" else 1) and job.handle is None
    assert run.status()["state"] == "done" and (run.path / "adapter.gguf").exists()
    assert [e["step"] for e in run.metrics() if e.get("type") == "step"] == [1, 2, 3, 4, 5, 6]
    assert _remote_pid_gone(run, executor)
    entry = run_entry(run.path)  # what Runs and `workbench runs list` show
    assert (entry.executor, entry.attempt) == (executor, job.attempt)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_cancel_on_each_executor(q, tmp_path, executor):
    job_id = queue_run(q, tmp_path / "run", executor, steps=400)
    run = RunDir(tmp_path / "run")
    with worker(q):
        wait_for(lambda: last_step(run) >= 3, "step 3")
        cancel_step = last_step(run)
        asked = time.monotonic()
        q.cancel(job_id)
        job = wait_finished(q, job_id)
        took = time.monotonic() - asked
    assert job.state == "cancelled" and took < DEFAULT_STOP_GRACE_S + 5
    assert max(checkpoint_steps(run)) >= cancel_step
    assert last_step(run) < 400 and run.status()["state"] == "cancelled"
    wait_for(lambda: _remote_pid_gone(run, executor), "the run's process to end", 10)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_pause_then_resume_ends_as_an_uninterrupted_run(q, tmp_path, executor):
    expected = reference_adapter(tmp_path / "straight", steps=24)
    job_id = queue_run(q, tmp_path / "run", executor, steps=24)
    run = RunDir(tmp_path / "run")
    with worker(q):
        wait_for(lambda: last_step(run) >= 4, "step 4")
        q.pause(job_id)
        job = wait_finished(q, job_id)
        assert job.state == "paused" and 4 <= max(checkpoint_steps(run)) < 24
        q.resume(job_id)
        job = wait_for(lambda: (lambda j: j if j.state == "done" else None)(q.get(job_id)),
                       "the resumed job to finish")
    assert job.attempt == (0 if executor == "local" else 2)
    assert (run.path / "adapter.gguf").read_bytes() == expected
    steps = [e["step"] for e in run.metrics() if e.get("type") == "step"]
    assert steps == list(range(1, 25))


def test_an_attempt_that_starts_after_it_was_superseded_leaves_the_run_alone(tmp_path,
                                                                             monkeypatch):
    """Ray cannot stop a job pending for resources; if it starts later, run-remote finds
    another submission in status.json than its own and exits without touching the run."""
    run = RunDir.create(tmp_path / "run", {"kind": "sft"})
    run.write_status(submission_id="wb-q-1-a2")
    monkeypatch.setenv(SUBMISSION_ENV, "wb-q-1-a1")
    assert run_remote(run.path, runner=lambda *a: pytest.fail("it ran")) == EXIT_STOPPED
    assert "superseded" in run.log_path.read_text() and "state" not in run.status()


def test_a_local_worker_killed_mid_run_is_resumed_and_its_steps_deduplicated(tmp_path):
    """The local twin of the Ray test of a lost attempt: the worker process dies (kill -9), the
    next worker resumes the job from its last checkpoint."""
    q = JobQueue(tmp_path / "q.sqlite3")
    expected = reference_adapter(tmp_path / "straight", steps=24)
    job_id = queue_run(q, tmp_path / "run", "local", steps=24)
    run = RunDir(tmp_path / "run")
    doomed = subprocess.Popen([sys.executable, "-m", "app", "queue", "worker", "--queue",
                               str(q.path)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: last_step(run) >= 5 and last_step(run) % 2, "step 5, 7...")
    finally:
        doomed.kill()
        doomed.wait()
    with worker(q):
        job = wait_for(lambda: (lambda j: j if j.state == "done" else None)(q.get(job_id)),
                       "the resumed job to finish")
    assert job.attempts == 1
    raw = [e["step"] for e in run.read_metrics(0)[0] if e.get("type") == "step"]
    assert len(raw) >= 24  # more, unless the kill came just after a checkpoint
    assert [e["step"] for e in run.metrics() if e.get("type") == "step"] == list(range(1, 25))
    assert (run.path / "adapter.gguf").read_bytes() == expected


def test_the_config_files_are_read_through_the_path_map(tmp_path):
    """On a node, the model and data a config names by this machine's paths are read where
    the cluster sees them; other values and unmapped paths are left alone."""
    run = RunDir.create(tmp_path / "run", {
        "model": "/home/me/models/m.gguf", "data": "/home/me/data/d.jsonl",
        "data_config": {"val_path": "/home/me/data/v.jsonl", "format": "auto"},
        "rewards": [{"path": "/opt/rewards.py"}], "name": "chat-1"})
    mapped = MappedRunDir(run.path, PathMap.parse("/home/me=/mnt/me,/home/me/models=/models"))
    assert mapped.config() == {
        "model": "/models/m.gguf", "data": "/mnt/me/data/d.jsonl",
        "data_config": {"val_path": "/mnt/me/data/v.jsonl", "format": "auto"},
        "rewards": [{"path": "/opt/rewards.py"}], "name": "chat-1"}


def test_the_evaluation_tasks_path_reads_as_the_cluster_sees_it(tmp_path):
    """eval_task is KIND:PATH (issue 32): its path part maps like any other file's."""
    run = RunDir.create(tmp_path / "run", {"eval_task": "hellaswag:/home/me/tasks/h.txt",
                                           "data": "/home/me/d.jsonl"})
    mapped = MappedRunDir(run.path, PathMap.parse("/home/me=/mnt/me"))
    assert mapped.config() == {"eval_task": "hellaswag:/mnt/me/tasks/h.txt",
                               "data": "/mnt/me/d.jsonl"}
