"""One writer per run, from the command line (issue 28, points 1, 2 and 9): `train ... &` then
`resume` of the same run is refused while the first trains, as is another queue's `queue add`;
the same run spelled two ways is queued once; an output inside another run is refused and a
resume leaves a run it finds among its checkpoints alone; a command that fails before training
removes the folder it made."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from app.cli.main import run_cli
from app.engine.runs.rundir import RunDir
from app.engine.runs.runlock import LOCK
from tests.conftest import REPO, SAMPLE_DATA

MODEL, DATA = str(SAMPLE_DATA / "tiny-moe.gguf"), str(SAMPLE_DATA / "chat.jsonl")
TIMEOUT = 120


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.slow
def test_a_second_writer_is_refused_while_the_first_trains(tmp_path):
    run = RunDir(tmp_path / "conc1")
    first = subprocess.Popen([sys.executable, "-m", "app", "train", "-m", MODEL, "-d", DATA,
                              "--epochs", "0", "--max-steps", "100000", "-o", str(run.path)],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (run.status_path.exists() and run.status().get("state") == "running"):
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.1)
        second = _cli("resume", str(run.path))
        assert second.returncode == 2, second.stderr
        assert f"workbench train (pid {first.pid} on" in second.stderr
        other_queue = {**os.environ, "WORKBENCH_QUEUE": str(tmp_path / "other.sqlite3")}
        queued = _cli("queue", "add", str(run.path), env=other_queue)
        assert queued.returncode == 2 and f"pid {first.pid}" in queued.stderr, queued.stderr
        first.send_signal(signal.SIGTERM)          # pause after the step
        assert first.wait(TIMEOUT) == 130
    finally:
        first.kill()
        first.wait(TIMEOUT)
    starts = [e for e in run.read_metrics()[0] if e.get("type") == "start"]
    assert len(starts) == 1 and run.status()["state"] == "paused"
    assert not (run.path / LOCK).exists()      # the first let go: the run can be resumed


def test_a_run_spelled_two_ways_is_queued_once(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    RunDir.create(tmp_path / "many" / "r1", {"model": MODEL, "data": DATA})
    assert run_cli(["queue", "add", "many/r1"]) == 0
    assert run_cli(["queue", "add", "./many/../many/r1"]) == 2
    assert "already in the queue" in capsys.readouterr().err


def test_an_output_inside_another_run_is_refused_and_resume_leaves_such_a_run_alone(tmp_path,
                                                                                   capsys):
    out = tmp_path / "run"
    assert run_cli(["train", "-m", MODEL, "-d", DATA, "--epochs", "0", "--max-steps", "2",
                    "-o", str(out)]) == 0
    nested = out / "checkpoints" / "step-99"
    assert run_cli(["train", "-m", MODEL, "-d", DATA, "--max-steps", "1", "-o",
                    str(nested)]) == 2
    assert f"inside the run folder {out}" in capsys.readouterr().err
    assert not nested.exists()
    nested.mkdir()                  # made by hand (or by an older workbench): a run's folder
    (nested / "config.json").write_text(json.dumps({"model": MODEL, "data": DATA}))
    assert run_cli(["resume", str(out)]) == 0
    assert "checkpoints/step-99 holds a run (its config.json), not a checkpoint: left as it " \
           "is" in capsys.readouterr().out
    assert sorted(p.name for p in nested.iterdir()) == ["config.json"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-99"]


def test_a_command_that_fails_before_training_removes_the_folder_it_made(tmp_path, monkeypatch,
                                                                        capsys):
    (tmp_path / "blocker").write_text("a file where the state folder goes")
    monkeypatch.setenv("WORKBENCH_QUEUE", str(tmp_path / "blocker" / "state" / "q.sqlite3"))
    command = ["train", "-m", MODEL, "-d", DATA, "--max-steps", "1", "-o",
               str(tmp_path / "runs" / "first")]
    for queue in ([], ["--queue"]):
        assert run_cli(command + queue) == 2
        assert f"create the folder {tmp_path / 'blocker'}" in capsys.readouterr().err
        assert not (tmp_path / "runs" / "first").exists()
    monkeypatch.setenv("WORKBENCH_QUEUE", str(tmp_path / "state" / "q.sqlite3"))
    assert run_cli(command + ["--queue"]) == 0            # the same command, once it can
