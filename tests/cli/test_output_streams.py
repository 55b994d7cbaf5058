"""Printing never fails a command or a run (issue 28, probe finding 3; app.cli.output): a
closed stdout (`>&-`) is the null device, a stdout on a full disk (/dev/full: every write
fails with ENOSPC) ends a short command with "could not write the output" (exit 2, no
traceback), and a training run whose stdout or stderr cannot be written trains on to the end
and is recorded "done" (it failed as "a bug", or was left with config.json and no status)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "sample_data"
MODEL = str(SAMPLE / "tiny-moe.gguf")
TRAIN = ["train", "-m", MODEL, "-d", str(SAMPLE / "chat.jsonl"), "--max-steps", "2"]
FULL = Path("/dev/full")
needs_full = pytest.mark.skipif(not FULL.exists(), reason="no /dev/full on this system")


def workbench(args, home: Path, stdout="pipe", stderr="pipe") -> tuple[int, str]:
    """(exit status, stderr) of `workbench ARGS` with stdout "pipe", "closed" or "full" (stderr
    likewise): in a fresh HOME, killed if it runs past two minutes."""
    env = {**os.environ, "HOME": str(home)}
    for name in [n for n in env if n.startswith("XDG_")]:
        del env[name]
    full = open(FULL, "w") if "full" in (stdout, stderr) else None
    where = {"pipe": subprocess.PIPE, "full": full, "closed": None}
    closed = [fd for fd, how in ((1, stdout), (2, stderr)) if how == "closed"]
    proc = subprocess.Popen([sys.executable, "-m", "app", *args], cwd=home, env=env,
                            stdout=where[stdout], stderr=where[stderr], text=True,
                            preexec_fn=lambda: [os.close(fd) for fd in closed])
    try:
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if full:
            full.close()
    return proc.returncode, err or ""


@pytest.fixture
def home(tmp_path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.mark.parametrize("args", [["info", MODEL], ["runs", "list"], ["info", MODEL, "--json"]])
def test_a_closed_stdout_is_the_null_device(args, home):
    code, err = workbench(args, home, stdout="closed")
    assert code == 0, err
    assert "Traceback" not in err and "bug" not in err


@needs_full
@pytest.mark.parametrize("args", [["info", MODEL], ["runs", "list"], ["info", MODEL, "--json"],
                                  ["train", "--help"]])
def test_a_full_stdout_is_an_error_not_a_bug(args, home):
    code, err = workbench(args, home, stdout="full")
    assert code == 2, err
    assert "error: could not write the output: no space left on the device." in err
    assert "Traceback" not in err and "bug" not in err and "Exception ignored" not in err


def status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


@needs_full
def test_a_run_trains_on_when_its_stdout_is_full(home):
    code, err = workbench(TRAIN + ["-o", "r"], home, stdout="full")
    assert code == 0, err
    assert "warning: could not write the output: no space left on the device. The run goes on" \
        in err
    assert "Traceback" not in err
    assert status(home / "r")["state"] == "done"
    assert "progress printing stopped: could not write the output" in \
        (home / "r" / "log.txt").read_text()


@needs_full
def test_a_run_is_done_when_stdout_and_stderr_are_full(home):
    code, _ = workbench(TRAIN + ["-o", "r", "--json"], home, stdout="full", stderr="full")
    assert code == 0
    assert status(home / "r")["state"] == "done"


def test_a_run_is_done_when_stdout_and_stderr_are_closed(home):
    code, _ = workbench(TRAIN + ["-o", "r"], home, stdout="closed", stderr="closed")
    assert code == 0
    assert status(home / "r")["state"] == "done"
    assert (home / "r" / "config.json").is_file()
