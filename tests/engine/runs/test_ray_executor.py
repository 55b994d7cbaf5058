"""The Ray executor against the loopback head (token auth on): `check_cluster` with and without
the token, a job asking a GPU the cluster has not, reattaching after the worker restarts (no
second submission), an attempt killed mid-run (resumed as attempt 2, steps deduplicated) and a
path map (the cluster sees the run folder under another path)."""

from __future__ import annotations

import http.server
import os
import signal
import threading

import pytest

from app.engine.errors import ConfigError
from app.engine.runs.clusters import Cluster, ClusterError
from app.engine.runs.executors import AlreadySubmitted, RayExecutor, check_cluster
from app.engine.runs.queue import JobQueue
from app.engine.runs.rundir import RunDir
from app.engine.runtime.files import atomic_write_json
from tests.engine.runs.cluster_runs import (add_loop_cluster, last_step, queue_run,
                                            reference_adapter, wait_for, wait_finished, worker)

pytestmark = pytest.mark.slow


@pytest.fixture
def q(tmp_path) -> JobQueue:
    return JobQueue(tmp_path / "q.sqlite3")


@pytest.fixture
def not_ray():
    """An HTTP server that is not a Ray dashboard (404 everywhere)."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    server.RequestHandlerClass.log_message = lambda *a: None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/nothing-here"
    server.shutdown()


def test_check_says_what_is_wrong(ray_head, not_ray):
    cluster = Cluster("loop", ray_head.dashboard_url)
    assert check_cluster(cluster, ray_head.token).startswith("Ray 2.60.0")
    for token in (None, "wrong"):
        with pytest.raises(ClusterError, match="token is missing or wrong"):
            check_cluster(cluster, token)
    with pytest.raises(ClusterError, match="cannot be reached"):
        check_cluster(Cluster("gone", "http://127.0.0.1:9"), ray_head.token)
    with pytest.raises(ClusterError, match="not a Ray dashboard"):
        check_cluster(Cluster("web", not_ray), ray_head.token)


def test_a_job_without_the_token_fails_with_the_reason(q, tmp_path, ray_head, monkeypatch):
    add_loop_cluster(q, ray_head, monkeypatch, token=None)
    job_id = queue_run(q, tmp_path / "run", "loop", steps=2)
    with worker(q):
        job = wait_finished(q, job_id)
    assert job.state == "failed" and job.error_kind == "cluster"
    assert "token is missing or wrong" in job.error_message


def test_a_gpu_the_cluster_has_not_fails_after_the_timeout(q, tmp_path, ray_head, monkeypatch):
    add_loop_cluster(q, ray_head, monkeypatch, num_gpus=1)
    job_id = queue_run(q, tmp_path / "run", "loop", steps=2)
    with worker(q, pending_timeout_s=1.0):
        job = wait_finished(q, job_id)
    assert job.state == "failed" and "has 0 GPU(s); each run asks 1" in job.error_message
    # Ray cannot stop a job pending for resources (its stop waits for the job's supervisor,
    # which pends too): the run folder's fence makes it leave the run alone if it ever starts
    assert RunDir(tmp_path / "run").status()["submission_id"] is None


def test_cancelling_a_job_that_pends_gives_it_up_after_the_grace(q, tmp_path, ray_head,
                                                                 monkeypatch):
    """Ray's stop cannot reach a job pending for resources: after the stop grace the job is
    cancelled here, and the fence keeps that attempt off the run."""
    add_loop_cluster(q, ray_head, monkeypatch, num_gpus=1)
    job_id = queue_run(q, tmp_path / "run", "loop", steps=2)
    with worker(q, pending_timeout_s=60.0, stop_grace_s=1.0):
        wait_for(lambda: q.get(job_id).handle is not None, "the submission")
        q.cancel(job_id)
        job = wait_finished(q, job_id, timeout=15)
    assert job.state == "cancelled"
    assert RunDir(tmp_path / "run").status()["submission_id"] is None


def test_a_restarted_worker_reattaches_without_submitting_again(q, tmp_path, ray_head,
                                                                monkeypatch):
    add_loop_cluster(q, ray_head, monkeypatch)
    job_id = queue_run(q, tmp_path / "run", "loop", steps=20)
    run = RunDir(tmp_path / "run")
    with worker(q):
        wait_for(lambda: last_step(run) >= 2, "step 2")
    job = q.get(job_id)  # the worker stopped: the cluster carries on
    assert (job.state, job.attempt) == ("queued", 1) and job.handle is not None
    executor = RayExecutor(q.clusters().get("loop"), ray_head.token, queue_id=q.queue_id)
    assert executor.poll(job.handle).state == "running"
    with pytest.raises(AlreadySubmitted):
        executor.submit(job, run.path)
    with worker(q):
        job = wait_finished(q, job_id)
    assert (job.state, job.attempt) == ("done", 1)
    assert "reattached to " + executor.handle_for(job_id, 1)["submission_id"] in \
        run.log_path.read_text()
    assert run.status()["step"] == 20 and "attempt ended: done" in run.log_path.read_text()
    assert "attempt ended: done" in executor.logs(executor.handle_for(job_id, 1))


def test_an_attempt_killed_mid_run_is_resumed_and_its_steps_deduplicated(q, tmp_path, ray_head,
                                                                          monkeypatch):
    expected = reference_adapter(tmp_path / "straight", steps=24)
    add_loop_cluster(q, ray_head, monkeypatch)
    job_id = queue_run(q, tmp_path / "run", "loop", steps=24)
    run = RunDir(tmp_path / "run")
    with worker(q):
        wait_for(lambda: last_step(run) >= 5 and last_step(run) % 2, "step 5, 7...")
        os.kill(run.status()["pid"], signal.SIGKILL)  # the node loses the attempt
        job = wait_finished(q, job_id)
    assert (job.state, job.attempt) == ("done", 2)
    raw = [e["step"] for e in run.read_metrics(0)[0] if e.get("type") == "step"]
    assert len(raw) >= 24  # the second attempt repeats the steps after the last checkpoint
    assert [e["step"] for e in run.metrics() if e.get("type") == "step"] == list(range(1, 25))
    assert (run.path / "adapter.gguf").read_bytes() == expected


def test_a_path_map_round_trip(q, tmp_path, ray_head, monkeypatch):
    """The cluster sees this machine's `shared` folder as `view` (a link here): the entrypoint
    names the run by the cluster's path, and the run writes into the same folder."""
    shared, view = tmp_path / "shared", tmp_path / "view"
    shared.mkdir()
    view.symlink_to(shared)
    cluster = add_loop_cluster(q, ray_head, monkeypatch, path_map=f"{shared}={view}")
    assert cluster.local_path(cluster.cluster_path(shared / "run")) == str(shared / "run")
    job_id = queue_run(q, shared / "run", "loop", steps=2)
    with worker(q):
        job = wait_finished(q, job_id)
    assert job.state == "done" and (shared / "run" / "adapter.gguf").exists()
    executor = RayExecutor(cluster, ray_head.token, queue_id=q.queue_id)
    assert executor.entrypoint(shared / "run").endswith(
        f"run-remote {view / 'run'} --path-map {shared}={view}")
    assert f"run-remote {view / 'run'}" in executor.client.call(
        "GET", f"/api/jobs/{executor.handle_for(job_id, 1)['submission_id']}")["entrypoint"]
    with pytest.raises(ConfigError, match="not under a shared folder"):
        Cluster("far", "http://head.example:8265", cluster.path_map).cluster_path(tmp_path / "x")


def test_a_data_parallel_run_on_the_cluster(q, tmp_path, ray_head, monkeypatch):
    """run-remote trains a run with `workers: 2` as Ray Train workers on the cluster it runs in
    (app.engine.runs.data_parallel; its equivalence with one process is tested there)."""
    add_loop_cluster(q, ray_head, monkeypatch, num_cpus=0)  # the CPUs go to the two workers
    job_id = queue_run(q, tmp_path / "run", "loop", steps=4)
    run = RunDir(tmp_path / "run")
    config = run.config()
    atomic_write_json(run.config_path, {**config, "workers": 2})
    with worker(q):
        job = wait_finished(q, job_id)
    assert (job.state, job.error_message) == ("done", None)
    assert [e["step"] for e in run.metrics() if e.get("type") == "step"] == [1, 2, 3, 4]
    assert (run.path / "adapter.gguf").exists()
