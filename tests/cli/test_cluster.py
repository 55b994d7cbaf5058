"""`workbench cluster add|list|test|remove`, `queue add --on`, `train --on` and the ON / TRY
columns of `queue list` (issue 23)."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest

import app
from app.cli.main import run_cli
from app.engine.runs.clusters import cluster_token_env
from app.engine.runs.queue import JobQueue
from tests.conftest import REPO
from tests.engine.runs.cluster_runs import train_args, wait_finished, worker
from tests.engine.runs.test_queue import make_run


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = run_cli(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_add_list_remove(tmp_path, capsys, monkeypatch, memory_keyring):
    Q = ["--queue", str(tmp_path / "q.sqlite3")]
    monkeypatch.setattr(sys, "stdin", io.StringIO("s3cret\n"))
    code, out, _ = _cli(capsys, "cluster", "add", "lab", "http://head:8265/", "--token-stdin",
                        "--path-map", "/home/me/runs=/mnt/runs", "--python", "/opt/wb/python",
                        "--cpus", "4", "--gpus", "1", *Q)
    assert code == 0 and "cluster lab: http://head:8265 (token saved)" in out
    assert memory_keyring.passwords == {("gguf-workbench", "cluster:lab"): "s3cret"}
    code, out, _ = _cli(capsys, "cluster", "list", *Q)
    assert code == 0 and "lab  http://head:8265  4 CPU, 1 GPU per run" in out
    assert "token set" in out and "paths: /home/me/runs=/mnt/runs" in out
    assert JobQueue(tmp_path / "q.sqlite3").clusters().get("lab").python == "/opt/wb/python"
    assert _cli(capsys, "cluster", "remove", "lab", *Q)[0] == 0
    assert memory_keyring.passwords == {}
    code, _, err = _cli(capsys, "cluster", "test", "lab", *Q)
    assert code == 2 and "No cluster named 'lab'" in err


def test_without_a_keyring_the_token_goes_to_a_private_file_with_a_warning(tmp_path, capsys,
                                                                          monkeypatch,
                                                                          no_keyring):
    """Issue 29 item 10: without an OS keyring `cluster add --token-stdin` failed; the token is
    now kept in cluster-tokens.json beside clusters.json (0600), and the command says so."""
    Q = ["--queue", str(tmp_path / "state" / "q.sqlite3")]
    monkeypatch.delenv("WORKBENCH_CLUSTER_TOKEN_LAB", raising=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO("s3cret\n"))
    code, out, err = _cli(capsys, "cluster", "add", "lab", "http://head:8265", "--token-stdin", *Q)
    token_file = tmp_path / "state" / "cluster-tokens.json"
    assert code == 0 and "(token saved)" in out
    assert f"warning: No OS keyring is available" in err and str(token_file) in err
    assert os.stat(token_file).st_mode & 0o777 == 0o600
    assert "s3cret" not in (tmp_path / "state" / "clusters.json").read_text()
    code, out, _ = _cli(capsys, "cluster", "list", *Q)
    assert "token set" in out and "s3cret" not in out
    assert _cli(capsys, "cluster", "remove", "lab", *Q)[0] == 0
    assert json.loads(token_file.read_text()) == {}


def test_queue_add_on_a_cluster_and_the_list_columns(tmp_path, capsys):
    Q = ["--queue", str(tmp_path / "q.sqlite3")]
    shared = tmp_path / "shared"
    assert _cli(capsys, "cluster", "add", "lab", "http://head:8265", "--path-map",
                f"{shared}=/mnt/shared", *Q)[0] == 0
    code, out, _ = _cli(capsys, "queue", "add", "--on", "lab", make_run(shared, "a"), *Q)
    assert code == 0 and out.strip().endswith(" on lab")
    code, _, err = _cli(capsys, "queue", "add", "--on", "lab", make_run(tmp_path, "b"), *Q)
    assert code == 2 and "is not under a shared folder" in err
    assert _cli(capsys, "queue", "add", make_run(tmp_path, "c"), *Q)[0] == 0
    code, out, _ = _cli(capsys, "queue", "list", *Q)
    header, *rows = out.splitlines()
    assert header.split()[:4] == ["ID", "STATE", "ON", "TRY"]
    assert [r.split()[:4] for r in rows] == [["1", "queued", "lab", "0"],
                                            ["2", "queued", "local", "0"]]


def test_train_on_a_cluster_queues_the_run(tmp_path, capsys, monkeypatch):
    queue = JobQueue(tmp_path / "q.sqlite3")
    monkeypatch.setenv("WORKBENCH_QUEUE", str(queue.path))
    assert _cli(capsys, "cluster", "add", "loop", "http://127.0.0.1:8265")[0] == 0
    # no --queue needed: --on queues the run
    assert run_cli(train_args(tmp_path / "run", 2) + ["--on", "loop"]) == 0
    [job] = queue.list()
    assert (job.executor, job.state) == ("loop", "queued")
    assert "on loop" in capsys.readouterr().out


@pytest.mark.slow
def test_cluster_test_with_and_without_the_token(tmp_path, capsys, monkeypatch, ray_head):
    """With the token, `cluster test` runs a job there: the workbench imported by the
    cluster's Python (its version compared), a file written and read through the path map
    (a link stands in for the cluster's side of the shared storage)."""
    Q = ["--queue", str(tmp_path / "q.sqlite3")]
    shared, view = tmp_path / "shared", tmp_path / "view"
    shared.mkdir()
    view.symlink_to(shared)
    assert _cli(capsys, "cluster", "add", "loop", ray_head.dashboard_url, "--python",
                sys.executable, "--path-map", f"{shared}={view}", *Q)[0] == 0
    monkeypatch.delenv(cluster_token_env("loop"), raising=False)
    code, _, err = _cli(capsys, "cluster", "test", "loop", *Q)
    assert code == 2 and "token is missing or wrong" in err and "hint:" in err
    monkeypatch.setenv(cluster_token_env("loop"), ray_head.token)
    code, out, err = _cli(capsys, "cluster", "test", "loop", *Q)
    assert code == 0 and out.startswith("loop: Ray 2.60.0"), err
    assert f"workbench {app.__version__} (as here) at {sys.executable}" in out
    assert f"path map {shared}={view} written and read both ways" in out
    assert list(shared.iterdir()) == []  # its test files are gone
    assert _cli(capsys, "cluster", "add", "loop", ray_head.dashboard_url, "--python",
                sys.executable, "--path-map", f"{shared}={tmp_path / 'elsewhere'}", *Q)[0] == 0
    code, _, err = _cli(capsys, "cluster", "test", "loop", *Q)
    assert code == 2 and f"does not see {shared} of this machine as" in err


@pytest.mark.slow
def test_a_python_without_the_workbench_fails_the_test_and_the_job_at_once(
        tmp_path, capsys, monkeypatch, ray_head):
    """The cluster's Python finds the app but not its dependencies (site-packages off): `cluster
    test` says what it lacks, and a job sent there fails on its first attempt with that cause
    (it was retried three times as "a bug in the workbench")."""
    python = tmp_path / "bare-python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    queue = JobQueue(tmp_path / "q.sqlite3")
    Q = ["--queue", str(queue.path)]
    assert _cli(capsys, "cluster", "add", "bare", ray_head.dashboard_url, "--python",
                str(python), *Q)[0] == 0
    monkeypatch.setenv(cluster_token_env("bare"), ray_head.token)
    code, _, err = _cli(capsys, "cluster", "test", "bare", *Q)
    assert code == 2 and f"cannot run the workbench with its Python ({python}): " in err
    assert "No module named" in err and "--python PATH" in err
    assert run_cli(train_args(tmp_path / "run", 2) + [*Q, "--on", "bare"]) == 0
    [job] = queue.list()
    with worker(queue):
        job = wait_finished(queue, job.id)
    assert (job.state, job.attempt) == ("failed", 1)
    assert "cannot run the workbench" in job.error_message
    assert "No module named" in job.error_message


def test_queue_logs_of_a_running_job(tmp_path, capsys):
    """A local job's logs are its worker's (the handle names the worker process)."""
    queue = JobQueue(tmp_path / "q.sqlite3")
    Q = ["--queue", str(queue.path)]
    job_id = queue.add(make_run(tmp_path, "a"))
    code, _, err = _cli(capsys, "queue", "logs", str(job_id), *Q)
    assert code == 2 and "no attempt of it runs now" in err
    queue.claim_next("w")
    (tmp_path / "q.sqlite3.worker.log").write_text("worker says hello\n")
    assert _cli(capsys, "queue", "logs", str(job_id), *Q)[1] == "worker says hello\n"


def test_add_refuses_a_bad_url_and_list_never_shows_a_password(tmp_path, capsys):
    """`cluster add` with a URL a user may type (issue 28): an error and a hint, no traceback;
    an older clusters.json whose URL holds credentials is listed without them."""
    Q = ["--queue", str(tmp_path / "q.sqlite3")]
    for url in ("http://[::1", "http://head:8265\nx", "http://head:99999",
                "http://alice:s3cret@head:8265"):
        code, out, err = _cli(capsys, "cluster", "add", "v6", url, *Q)
        assert code == 2 and err.startswith("error: ") and "hint: " in err, err
        assert "s3cret" not in out + err and "Traceback" not in err
    assert not (tmp_path / "clusters.json").exists()
    (tmp_path / "clusters.json").write_text(
        '{"clusters": [{"name": "old", "url": "http://bob:hunter2@head:8265"}]}')
    code, out, err = _cli(capsys, "cluster", "list", *Q)
    assert code == 0 and "old  http://head:8265 " in out and "hunter2" not in out + err


def test_a_token_that_cannot_be_a_header_and_a_nested_file_are_errors(tmp_path, capsys,
                                                                       monkeypatch,
                                                                       memory_keyring):
    """A token with a line break (from stdin or the environment) was a ValueError of
    http.client ("Invalid header value"); a clusters.json nested too deeply a RecursionError."""
    Q = ["--queue", str(tmp_path / "q.sqlite3")]
    monkeypatch.setattr(sys, "stdin", io.StringIO("to\rken\n"))
    code, _, err = _cli(capsys, "cluster", "add", "lab", "http://127.0.0.1:9", "--token-stdin",
                        *Q)
    assert code == 2 and "holds a space, a control character" in err
    assert memory_keyring.passwords == {}
    assert _cli(capsys, "cluster", "add", "lab", "http://127.0.0.1:9", *Q)[0] == 0
    monkeypatch.setenv(cluster_token_env("lab"), "a\nb")
    code, _, err = _cli(capsys, "cluster", "test", "lab", *Q)
    assert code == 2 and f"(in {cluster_token_env('lab')}) holds a space" in err
    code, out, _ = _cli(capsys, "cluster", "list", *Q)
    assert code == 0 and "token unusable" in out
    (tmp_path / "clusters.json").write_text('{"clusters": ' + "[" * 100_000 + "]" * 100_000
                                            + "}")
    code, _, err = _cli(capsys, "cluster", "list", *Q)
    assert code == 2 and "nested too deeply" in err
