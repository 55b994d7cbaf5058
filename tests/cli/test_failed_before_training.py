"""A command that fails before training starts leaves no run folder behind (issue 28; probe
finding 7): a bad --adapter, a dataset whose format cannot be told, a format that rejects
every row, a context no row fits, prompts that are chat rows. Each exits 2 with its error,
leaves no folder and no run in `runs list`, and the same command with its input fixed then
succeeds (it said "already holds a run"). The cheap ones (adapter header, format) are refused
before a folder exists, for `--queue` too; the others are taken back when the run fails
before its first step."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from app.cli.main import run_cli
from app.engine.runs.queue import JobQueue
from app.engine.runs.rundir import registered_run_paths
from tests.conftest import SAMPLE_DATA

MODEL, CHAT = str(SAMPLE_DATA / "tiny-moe.gguf"), str(SAMPLE_DATA / "chat.jsonl")
ADDITION = str(SAMPLE_DATA / "addition.jsonl")
QUICK = ["--max-steps", "1", "--epochs", "0", "--val-split", "0"]


@pytest.fixture
def inputs(tmp_path):
    os.mkfifo(tmp_path / "fifo.gguf")
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": "x" * 5000}) + "\n")
    return tmp_path


# (what fails, the failing options, the error's words, the same options fixed)
CASES = [
    ("a FIFO as adapter", ["-d", CHAT, "--adapter", "{tmp}/fifo.gguf"], "not a regular file",
     ["-d", CHAT]),
    ("a model as adapter", ["-d", CHAT, "--adapter", MODEL], "is not a LoRA adapter",
     ["-d", CHAT]),
    ("an unknown format", ["-d", "{tmp}/bad.jsonl"], "Cannot tell the format", ["-d", CHAT]),
    ("sharegpt on chat rows", ["-d", CHAT, "--format", "sharegpt"], "Nothing to train on",
     ["-d", CHAT, "--format", "chat"]),
    ("a context of 1", ["-d", CHAT, "--ctx", "1"], "", ["-d", CHAT, "--ctx", "64"]),
    ("every row dropped", ["-d", "{tmp}/long.jsonl", "--overflow", "drop", "--ctx", "16"],
     "Nothing to train on", ["-d", "{tmp}/long.jsonl", "--overflow", "truncate", "--ctx", "16"]),
]


def _argv(options, tmp):
    return [o.replace("{tmp}", str(tmp)) for o in options]


@pytest.mark.parametrize("what, bad, words, fixed", CASES, ids=[c[0] for c in CASES])
def test_a_train_that_fails_before_training_leaves_no_folder(inputs, capsys, what, bad, words,
                                                             fixed):
    out = inputs / "run"
    command = ["train", "-m", MODEL, "-o", str(out), *QUICK]
    assert run_cli([*command, *_argv(bad, inputs)]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and words in err and "Traceback" not in err
    assert not out.exists() and str(out) not in registered_run_paths()
    assert run_cli([*command, *_argv(fixed, inputs)]) == 0, capsys.readouterr().err
    assert (out / "adapter.gguf").is_file() and str(out) in registered_run_paths()


def test_an_existing_folder_is_left_as_it_was(inputs, capsys):
    """In a folder that was there, only what the run made goes (a log.txt of the user's stays)."""
    out = inputs / "there"
    out.mkdir()
    (out / "log.txt").write_text("mine\n")
    assert run_cli(["train", "-m", MODEL, "-d", CHAT, "--ctx", "1", "-o", str(out), *QUICK]) == 2
    assert [p.name for p in out.iterdir()] == ["log.txt"]
    assert (out / "log.txt").read_text().startswith("mine\n")
    assert str(out) not in registered_run_paths()


def test_grpo_on_chat_rows_as_prompts_leaves_no_folder(inputs, capsys):
    out = inputs / "g"
    command = ["grpo", "-m", MODEL, "-r", "exact", "-o", str(out), "--max-steps", "1",
               "-G", "2", "-P", "1", "--max-new-tokens", "2"]
    assert run_cli([*command, "--prompts", CHAT]) == 2
    assert "no usable prompt rows" in capsys.readouterr().err
    assert not out.exists() and str(out) not in registered_run_paths()
    assert run_cli([*command, "--prompts", ADDITION]) == 0, capsys.readouterr().err
    assert (out / "config.json").is_file()


@pytest.mark.parametrize("bad, words", [(["--adapter", MODEL], "is not a LoRA adapter"),
                                        (["-d", "{tmp}/bad.jsonl"], "Cannot tell the format")])
def test_a_queued_run_is_checked_before_it_is_queued(inputs, capsys, bad, words):
    out, queue = inputs / "queued", inputs / "q.sqlite3"
    argv = ["train", "-m", MODEL, "-d", CHAT, "-o", str(out), "--queue", str(queue),
            *_argv(bad, inputs)]
    assert run_cli(argv) == 2
    assert words in capsys.readouterr().err
    assert not out.exists() and not queue.exists()


def test_an_output_folder_around_a_run_is_refused(inputs, capsys):
    """Probe finding 12: `train -o outer` with outer/a/inner a run was accepted."""
    inner = inputs / "outer" / "a" / "inner"
    assert run_cli(["train", "-m", MODEL, "-d", CHAT, "-o", str(inner), *QUICK]) == 0
    capsys.readouterr()
    before = sorted(p.name for p in (inputs / "outer").rglob("*"))
    assert run_cli(["train", "-m", MODEL, "-d", CHAT, "-o", str(inputs / "outer"), *QUICK]) == 2
    assert f"error: {inputs / 'outer'} holds the run {inner}." in capsys.readouterr().err
    assert sorted(p.name for p in (inputs / "outer").rglob("*")) == before


def test_a_run_the_queue_refuses_leaves_no_folder_and_no_listed_run(inputs, capsys):
    out = inputs / "refused"
    assert run_cli(["train", "-m", MODEL, "-d", CHAT, "-o", str(out), "--queue",
                    str(inputs / "q.sqlite3"), "--on", "nowhere"]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert not out.exists() and str(out) not in registered_run_paths()


def test_workers_without_a_cluster_and_a_bad_chat_template_are_refused_first(inputs, capsys):
    """`--workers N` trains data-parallel on a Ray cluster only (a run here or queued for this
    machine failed at its start); `--chat-template` names a file that must be a template."""
    out = inputs / "dp"
    for queue in ([], ["--queue", str(inputs / "q.sqlite3")]):
        assert run_cli(["train", "-m", MODEL, "-d", CHAT, "-o", str(out), "--workers", "2",
                        *QUICK, *queue]) == 2
        err = capsys.readouterr().err
        assert "error: --workers 2 trains data-parallel on a Ray cluster" in err, err
        assert "--on CLUSTER" in err and not out.exists()
    (inputs / "t.jinja").write_text("{% for m in messages %}")
    assert run_cli(["train", "-m", MODEL, "-d", CHAT, "-o", str(out), "--chat-template",
                    str(inputs / "t.jinja"), *QUICK]) == 2
    assert "does not compile" in capsys.readouterr().err and not out.exists()
