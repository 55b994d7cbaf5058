"""Inputs that cannot hang a command (issue 28, points 5 and 7): a FIFO, a device, a socket or a
folder given as a dataset, config, weights, prompts or reward file is refused at once, naming
it; SIGTERM and Ctrl-C stop a run while it reads and tokenizes its data; a model file truncated
under a running run fails it with a message instead of killing it with SIGBUS."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, SAMPLE_DATA

MODEL = str(SAMPLE_DATA / "tiny-moe.gguf")
CHAT = str(SAMPLE_DATA / "chat.jsonl")

pytestmark = pytest.mark.skipif(os.name != "posix", reason="FIFOs, /dev/zero and signals")


def _env(tmp_path) -> dict:
    """A new user's environment: an empty HOME, a cache of this test's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env.update(HOME=str(tmp_path / "home"), WORKBENCH_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("WORKBENCH_QUEUE", None)
    return env


def _start(tmp_path, *argv) -> subprocess.Popen:
    out = open(tmp_path / "out.txt", "wb")
    err = open(tmp_path / "err.txt", "wb")
    return subprocess.Popen([sys.executable, "-m", "app", *argv], cwd=REPO, env=_env(tmp_path),
                            stdout=out, stderr=err)


def _workbench(tmp_path, *argv, timeout=90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *argv], cwd=REPO, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout} s for {what}")
        time.sleep(0.1)


CASES = {   # argv ({fifo}, {run}, {tmp}), the file the error names
    "train dataset": (["train", "-m", MODEL, "-d", "{fifo}", "-o", "{run}"], "{fifo}"),
    "train /dev/zero": (["train", "-m", MODEL, "-d", "/dev/zero", "-o", "{run}"], "/dev/zero"),
    "validation data": (["train", "-m", MODEL, "-d", CHAT, "--val-data", "{fifo}",
                         "-o", "{run}"], "{fifo}"),
    "weights": (["train", "-m", MODEL, "-d", CHAT, "--weights", "{fifo}", "-o", "{run}"],
                "{fifo}"),
    "config": (["train", "--config", "{fifo}", "-m", MODEL, "-d", CHAT, "-o", "{run}"], "{fifo}"),
    "config /dev/zero": (["train", "--config", "/dev/zero", "-m", MODEL, "-d", CHAT,
                          "-o", "{run}"], "/dev/zero"),
    "lint": (["lint", "{fifo}", "-m", MODEL], "{fifo}"),
    "eval text": (["eval", "-m", MODEL, "--file", "{fifo}"], "{fifo}"),
    "grpo prompts": (["grpo", "-m", MODEL, "--prompts", "{fifo}", "--reward", "exact",
                      "-o", "{run}"], "{fifo}"),
    "grpo reward file": (["grpo", "-m", MODEL, "--prompts", str(SAMPLE_DATA / "addition.jsonl"),
                          "--reward", "{tmp}/fifo.py", "-o", "{run}"], "{tmp}/fifo.py"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_special_file_as_input_is_refused_at_once_naming_it(tmp_path, case):
    argv, named = CASES[case]
    os.mkfifo(tmp_path / "fifo.jsonl")
    os.mkfifo(tmp_path / "fifo.py")
    fill = lambda s: s.format(fifo=tmp_path / "fifo.jsonl", run=tmp_path / "run", tmp=tmp_path)
    r = _workbench(tmp_path, *map(fill, argv), timeout=60)  # before: blocked in open() forever
    assert r.returncode == 2, r.stderr
    assert fill(named) in r.stderr and "not a file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()       # refused before a run folder was made


def test_resume_refuses_a_dataset_that_became_a_fifo(tmp_path):
    data = tmp_path / "data.jsonl"
    shutil.copy(CHAT, data)
    run = tmp_path / "run"
    r = _workbench(tmp_path, "train", "-m", MODEL, "-d", str(data), "--max-steps", "1",
                   "-o", str(run))
    assert r.returncode == 0, r.stderr
    data.unlink()
    os.mkfifo(data)
    r = _workbench(tmp_path, "resume", str(run), timeout=60)
    assert r.returncode == 2 and f"{data} is a named pipe (FIFO)" in r.stderr, r.stderr


def _huge_sparse_file(path) -> str:
    """A regular file of 64 GB of zero bytes and no line end, taking no disk space: a stand-in
    for /dev/zero that the type check lets through, so reading it must hear the stop request.
    Returns what the run logs once it reads it."""
    with open(path, "wb") as f:
        f.truncate(64 << 30)
    return "tokenizing"


def _many_rows(path) -> str:
    """30 MB of chat rows (tokenizing takes ~10 s): returns the progress line to wait for, so
    that the signal comes while the rows are tokenized."""
    import random
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven rivers run".split()
    with open(path, "w") as f:
        while f.tell() < 30 << 20:
            say = lambda n: " ".join(rng.choices(words, k=n))
            f.write(json.dumps({"messages": [{"role": "user", "content": say(20)},
                                             {"role": "assistant", "content": say(60)}]}) + "\n")
    return "rows, "


@pytest.mark.parametrize("signum, make", [(signal.SIGTERM, _huge_sparse_file),
                                          (signal.SIGINT, _huge_sparse_file),
                                          (signal.SIGTERM, _many_rows)])
def test_a_signal_while_reading_the_data_pauses_the_run_within_seconds(tmp_path, signum, make):
    data = tmp_path / "data.jsonl"
    reading = make(data)
    run = tmp_path / "run"
    proc = _start(tmp_path, "train", "-m", MODEL, "-d", str(data), "-o", str(run))
    try:
        metrics = run / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and reading in metrics.read_text(), 60,
                  "the run to be reading its data")
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signum)
        proc.wait(timeout=15)            # before: read all 64 GB, ignoring the signal
        assert time.monotonic() - sent < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        data.unlink()
    err = (tmp_path / "err.txt").read_text()
    assert proc.returncode == 130, err
    assert f"paused: continue with  workbench resume {run}" in err
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "paused" and status["error"] is None
    assert '"type": "start"' not in metrics.read_text()     # stopped before training


def test_a_model_file_truncated_under_a_run_fails_it_with_a_message(tmp_path):
    model = tmp_path / "model.gguf"
    shutil.copy(MODEL, model)
    run = tmp_path / "run"
    proc = _start(tmp_path, "train", "-m", str(model), "-d", CHAT, "--epochs", "50",
                  "--ctx", "128", "-o", str(run))
    try:
        status_file = run / "status.json"
        _wait_for(lambda: status_file.exists()
                  and json.loads(status_file.read_text()).get("step", 0) >= 3, 120,
                  "the run's third step")
        os.truncate(model, model.stat().st_size // 3)
        proc.wait(timeout=60)      # before: killed by SIGBUS (exit -7), status "running"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = (tmp_path / "err.txt").read_text()
    assert proc.returncode == 2, err
    assert f"The model file changed while in use: {model} (it was truncated" in err
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed"
    assert status["error"]["kind"] == "model_changed"
    assert status["error"]["message"].startswith("The model file changed while in use")


# ---------------------------------------------------------------------- fingerprints on resume

def _finished_run(tmp_path, capsys):
    """A supervised run of 2 steps on copies of the sample model and data (checkpoints 1, 2)."""
    from app.cli.main import run_cli

    model, data, run = tmp_path / "model.gguf", tmp_path / "data.jsonl", tmp_path / "run"
    shutil.copy(MODEL, model)
    shutil.copy(CHAT, data)
    assert run_cli(["train", "-m", str(model), "-d", str(data), "--max-steps", "2",
                    "--save-every", "1", "-o", str(run)]) == 0
    capsys.readouterr()
    return model, data, run


def _resume(capsys, run, *extra):
    from app.cli.main import run_cli

    code = run_cli(["resume", str(run), *extra])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_resume_refuses_a_swapped_dataset_unless_allowed(tmp_path, capsys):
    model, data, run = _finished_run(tmp_path, capsys)
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(reversed(lines)))          # the same size, another content
    code, text = _resume(capsys, run)
    assert code == 2                                  # before: resumed on the new data, silently
    assert (f"error: The run's input changed since its checkpoint of step 2: the dataset "
            f"{data} (content).") in text
    assert "--allow-changed-data" in text
    code, text = _resume(capsys, run, "--allow-changed-data")
    assert code == 0, text
    assert f"the dataset {data} changed since step 2 (content); continuing on it" in text


def test_resume_refuses_a_changed_model_and_forgives_a_touch(tmp_path, capsys):
    model, data, run = _finished_run(tmp_path, capsys)
    os.utime(data, ns=(10**18, 10**18))
    code, text = _resume(capsys, run)
    assert code == 0, text
    assert f"the dataset {data} was touched since step 2 (its content is the same)" in text
    size = model.stat().st_size
    with open(model, "ab") as f:
        f.write(b"\0" * 64)
    code, text = _resume(capsys, run)
    assert code == 2
    assert f"the model {model} (size {size} -> {size + 64} bytes, content)" in text
