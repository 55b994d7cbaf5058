"""One rule for every writer (app.engine.runs.destinations): a run folder's own files, a
command's inputs (through symbolic and hard links) and anything but a regular file are never
written over, not even with overwrite; an existing file only with it; names leave room for
the files written beside them. (issue 28, point 3)"""

from __future__ import annotations

import os

import pytest

from app.engine.errors import ConfigError
from app.engine.runs.destinations import (MAX_NAME, DestinationExists, check_destination,
                                          failed_path, run_inputs)
from app.engine.runs.rundir import RunDir


@pytest.fixture
def run(tmp_path) -> RunDir:
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hi"}\n')
    run = RunDir.create(tmp_path / "run", {
        "model": str(tmp_path / "m.gguf"), "data": str(data),
        "data_config": {"val_path": str(tmp_path / "val.jsonl")},
        "rewards": [{"kind": "file", "arg": str(tmp_path / "rew.py")}, {"kind": "exact"}],
        "eval_task": f"winogrande:{tmp_path / 'wino.csv'}"})
    for name in ("status.json", "metrics.jsonl", "log.txt"):
        (run.path / name).write_text("")
    (run.checkpoints_dir / "step-1").mkdir()
    return run


@pytest.mark.parametrize("name", ["config.json", "status.json", "metrics.jsonl", "log.txt",
                                  "run.lock", "adapter.gguf", "checkpoints/step-1/arrays.npz",
                                  "checkpoints/new.gguf", "checkpoints"])
def test_a_run_folders_own_files_are_never_written(run, name):
    """Of any run folder, not only the one a command reads: a run's files are its own."""
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match=f"would write over .* of the run {run.path}"):
            check_destination(run.path / name, overwrite=overwrite)
    with pytest.raises(ConfigError, match="would write over its folder"):
        check_destination(run.path, overwrite=True, folder_files=())
    assert check_destination(run.exports_dir / "merged.gguf") == run.exports_dir / "merged.gguf"
    check_destination(run.path / "notes-export.gguf")          # a new name beside them is fine


def test_a_link_into_a_run_is_its_file(run, tmp_path):
    link = tmp_path / "looks-harmless.json"
    link.symlink_to(run.config_path)
    with pytest.raises(ConfigError, match="would write over config.json of the run"):
        check_destination(link, overwrite=True)


@pytest.mark.parametrize("link", [os.symlink, os.link], ids=["symlink", "hard link"])
def test_inputs_are_compared_through_links(tmp_path, link):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    out = tmp_path / "out.gguf"
    link(model, out)
    with pytest.raises(ConfigError, match=f"would write over the model \\({model}\\)"):
        check_destination(out, overwrite=True, inputs=[("the model", model)])


def test_a_runs_inputs_come_from_its_config(run, tmp_path):
    labels = dict((str(p), label) for label, p in run_inputs(run.path))
    assert labels[str(tmp_path / "data.jsonl")] == "the run's dataset"
    assert labels[str(tmp_path / "val.jsonl")] == "the run's validation data"
    assert labels[str(tmp_path / "rew.py")] == "the run's reward file"
    assert labels[str(tmp_path / "wino.csv")] == "the run's evaluation task"
    assert labels[str(run.config_path)] == "the run's config.json"
    with pytest.raises(ConfigError, match="would write over the run's dataset"):
        check_destination(tmp_path / "data.jsonl", overwrite=True, inputs=run_inputs(run.path))


def test_only_regular_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    device = tmp_path / "null-link"
    device.symlink_to("/dev/null")            # the link is not replaced either: refused
    folder = tmp_path / "folder"
    folder.mkdir()
    for path, kind in ((fifo, "a FIFO"), (device, "a character device"), (folder, "a folder")):
        with pytest.raises(ConfigError, match=f"is {kind}, and the output is one regular file"):
            check_destination(path, overwrite=True)
    with pytest.raises(ConfigError, match="is a character device"):
        check_destination("/dev/null", overwrite=True)
    with pytest.raises(ConfigError, match="is a FIFO, and a peft export is a folder"):
        check_destination(fifo, overwrite=True, what="a peft export", folder_files=())


def test_an_existing_file_needs_overwrite(tmp_path):
    out = tmp_path / "precious.txt"
    out.write_text("mine")
    with pytest.raises(DestinationExists):
        check_destination(out)
    assert check_destination(out, overwrite=True) == out
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(DestinationExists):
        check_destination(dangling)


def test_names_leave_room_for_the_files_beside_them(tmp_path):
    with pytest.raises(ConfigError, match=f"is 245 bytes long; the output may have at most "
                                          f"{MAX_NAME}"):
        check_destination(tmp_path / ("a" * 241 + ".npy"))
    assert check_destination(tmp_path / ("é" * (MAX_NAME // 2))).name == "é" * (MAX_NAME // 2)


def test_failed_path_is_new(tmp_path):
    out = tmp_path / "m.gguf"
    assert failed_path(out) == tmp_path / "m.failed-verification.gguf"
    (tmp_path / "m.failed-verification.gguf").write_bytes(b"an earlier failure")
    assert failed_path(out) == tmp_path / "m.failed-verification-2.gguf"
    (tmp_path / "peft").mkdir()
    assert failed_path(tmp_path / "peft") == tmp_path / "peft.failed-verification"
