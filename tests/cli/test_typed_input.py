"""No traceback from input a user can type (issue 28, point 8): a closed pipe, ids and numbers
out of range, sampling settings generation cannot use, a metrics line nested too deeply, a
dataset path with a byte that is not UTF-8, a module the Python lacks; and `lint`'s exit
status when no row is accepted (point 9)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from app.cli import main as cli
from app.cli.main import run_cli
from app.engine.runs.rundir import RunDir
from tests.conftest import REPO, SAMPLE_DATA

MODEL = str(SAMPLE_DATA / "tiny-moe.gguf")
CHAT = str(SAMPLE_DATA / "chat.jsonl")


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = run_cli(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _workbench(tmp_path, *argv, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(tmp_path / "home"), "XDG_DATA_HOME": "",
           "XDG_CONFIG_HOME": ""}
    return subprocess.run([sys.executable, "-m", "app", *argv], cwd=REPO, env=env,
                          timeout=120, **kw)


@pytest.mark.parametrize("argv", [
    ["info", MODEL], ["lint", CHAT, "-m", MODEL], ["tokenize", "-m", MODEL, "--text", "hi"],
    ["queue", "list", "--queue", "{tmp}/q.sqlite3"], ["cluster", "list", "--queue",
                                                      "{tmp}/q.sqlite3"]])
def test_a_closed_pipe_ends_quietly(tmp_path, argv):
    """`workbench ... | head`: the reader is gone before the first write (its end of the pipe
    closed before the command starts), so the first write fails with EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = _workbench(tmp_path, *(a.format(tmp=tmp_path) for a in argv), stdout=write_end,
                          stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    assert done.returncode == 0, done.stderr
    assert not any(word in done.stderr for word in ("Traceback", "BrokenPipe", "error"))


def test_a_run_whose_output_reader_is_gone_trains_on(tmp_path):
    """`workbench train ... | head -1`: the run failed as "a bug: BrokenPipeError"."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = _workbench(tmp_path, "train", "-m", MODEL, "-d", CHAT, "--max-steps", "2",
                          "--epochs", "0", "--val-split", "0", "--ctx", "64", "-o",
                          str(tmp_path / "run"), stdout=write_end, stderr=subprocess.PIPE,
                          text=True)
    finally:
        os.close(write_end)
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert RunDir(tmp_path / "run").status()["state"] == "done"


@pytest.mark.parametrize("argv", [
    ["cancel", "12345678901234567890123"], ["pause", "0"], ["resume", "-1"],
    ["retry", "9" * 5000], ["logs", "99999999999999999999"], ["reorder", "1", "1" + "0" * 30],
    ["add", "run", "--priority", "1" + "0" * 22], ["worker", "--nice", "9" * 30],
    ["worker", "--stop-grace", "inf"], ["worker", "--pending-timeout", "nan"]])
def test_numbers_out_of_range_are_errors_of_the_command_line(tmp_path, capsys, argv):
    with pytest.raises(SystemExit) as e:
        run_cli(["queue", *argv, "--queue", str(tmp_path / "q.sqlite3")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: argument" in err and "Traceback" not in err


def test_queue_list_shows_a_nonsense_eta_as_unknown(tmp_path, capsys):
    queue = ["--queue", str(tmp_path / "q.sqlite3")]
    run = RunDir.create(tmp_path / "run", {"name": "run"})
    assert _cli(capsys, "queue", "add", str(run.path), *queue)[0] == 0
    run.write_status(state="running", step=1, eta_s=float("inf"))
    code, out, _ = _cli(capsys, "queue", "list", *queue)
    assert code == 0 and "eta ?" in out


@pytest.mark.parametrize("option, value, what", [
    ("-t", "nan", "Temperature"), ("-t", "inf", "Temperature"), ("-t", "-1", "Temperature"),
    ("--top-p", "-0.5", "Top-p"), ("--top-p", "0", "Top-p"), ("--top-p", "nan", "Top-p"),
    ("--seed", "-1", "Seed"), ("--seed", str(2**64), "Seed"), ("-n", "-1", "Max new tokens")])
def test_generate_refuses_what_it_cannot_sample_with(capsys, option, value, what):
    code, _, err = _cli(capsys, "generate", "-m", MODEL, "-p", "Hi", option, value)
    assert code == 2 and err.startswith(f"error: {what} ") and "hint: " in err


def test_a_metrics_line_nested_too_deeply_is_skipped(tmp_path, capsys):
    run = RunDir.create(tmp_path / "run", {"name": "run"})
    run.append_metrics({"type": "step", "step": 1, "loss": 2.0})
    with open(run.metrics_path, "a") as f:
        f.write("[" * 100_000 + "]" * 100_000 + "\n")
    run.append_metrics({"type": "step", "step": 2, "loss": 1.0})
    code, out, err = _cli(capsys, "runs", "show", str(run.path))
    assert (code, err) == (0, "") and "events   2 in metrics.jsonl" in out


def test_a_dataset_path_with_a_byte_that_is_not_utf8(tmp_path):
    """config.json keeps the path (\\udcff escaped), the run trains, and every command that
    prints it prints it escaped."""
    data = os.path.join(os.fsencode(tmp_path), b"data\xff.jsonl")
    try:
        with open(data, "wb") as f:
            f.write(open(CHAT, "rb").read())
    except OSError:
        pytest.skip("this file system refuses names that are not UTF-8")
    run = tmp_path / "run"
    done = _workbench(tmp_path, "train", "-m", MODEL, "-d", os.fsdecode(data), "--max-steps",
                      "2", "--epochs", "0", "--val-split", "0", "--ctx", "64", "-o", str(run),
                      capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert RunDir(run).config()["data"] == os.fsdecode(data)
    for argv in (["runs", "show", str(run)], ["runs", "list"]):
        done = _workbench(tmp_path, *argv, capture_output=True, text=True)
        assert done.returncode == 0 and "data\\udcff.jsonl" in done.stdout, done.stderr


def test_lint_exits_1_when_no_row_is_accepted(tmp_path, capsys):
    assert _cli(capsys, "lint", CHAT, "-m", MODEL)[0] == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": ""}\n{"messages": []}\n')
    code, out, _ = _cli(capsys, "lint", str(bad), "-m", MODEL)
    assert code == 1 and out


def test_a_missing_module_is_an_installation_to_fix_not_a_bug(capsys, monkeypatch):
    def lacks(name):
        def command(args):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return command

    monkeypatch.setitem(cli.COMMANDS, "info", lacks("platformdirs"))
    code, _, err = _cli(capsys, "info", MODEL)
    assert code == 2 and "cannot run the workbench: No module named 'platformdirs'" in err
    assert "Traceback" not in err and "pip install" in err
    monkeypatch.setitem(cli.COMMANDS, "info", lacks("app.engine.gone"))
    code, _, err = _cli(capsys, "info", MODEL)
    assert code == 1 and "this is a bug" in err


def test_the_queue_refuses_a_run_path_that_is_not_utf8(tmp_path, capsys):
    """SQLite's text cannot hold the escaped byte (it was a UnicodeEncodeError)."""
    try:
        run = RunDir.create(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"run\xff")),
                            {"name": "run"})
    except OSError:
        pytest.skip("this file system refuses names that are not UTF-8")
    code, _, err = _cli(capsys, "queue", "add", str(run.path), "--queue",
                        str(tmp_path / "q.sqlite3"))
    assert code == 2 and "has a byte that is not UTF-8" in err and "foreground" in err


@pytest.mark.parametrize("argv", [["tokenize", "-m", MODEL, "--text", "a\udcff"],
                                  ["generate", "-m", MODEL, "-p", "a\udcff"]])
def test_text_with_a_byte_that_is_not_utf8_is_an_error_of_the_command_line(capsys, argv):
    """argv holds such a byte as a surrogate escape: the tokenizer raised a TypeError."""
    with pytest.raises(SystemExit) as e:
        run_cli(argv)
    assert e.value.code == 2 and "a byte that is not UTF-8" in capsys.readouterr().err


def test_a_failure_naming_a_path_that_is_not_utf8_is_recorded(tmp_path):
    """The worker writes a failed job's error to its run's log.txt: with the escaped byte of a
    dataset path in it, that was a UnicodeEncodeError that took the worker down."""
    from app.engine.errors import DatasetError
    from app.engine.runs.queue import JobQueue
    from app.engine.runs.worker import run_worker

    def runner(run, control):
        raise DatasetError("Cannot read /data/chat\udcff.jsonl.")

    queue = JobQueue(tmp_path / "q.sqlite3")
    first = queue.add(RunDir.create(tmp_path / "a", {"name": "a"}).path)
    second = queue.add(RunDir.create(tmp_path / "b", {"name": "b"}).path)
    assert run_worker(queue, runner=runner, once=True, exclusive=False) == 2
    assert [queue.get(i).state for i in (first, second)] == ["failed", "failed"]
    assert "chat\\udcff.jsonl" in (tmp_path / "a" / "log.txt").read_text()
