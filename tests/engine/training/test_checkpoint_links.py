"""Checkpoints are written, renamed and pruned only in the run's own folders: a `checkpoints/`
or `step-N` that is a symbolic link (a run folder copied with its links) is refused by name,
and the link's target keeps every file."""

from __future__ import annotations

import os

import numpy as np
import pytest

from app.engine.runtime.files import StorageError
from app.engine.training import sft
from app.engine.training.checkpoints import (list_checkpoints, load_checkpoint,
                                             prune_checkpoints, save_checkpoint, set_aside)

pytestmark = pytest.mark.skipif(os.name == "nt", reason="symbolic links need privileges there")
STATE = {"w": np.arange(4, dtype=np.float32)}


def _elsewhere(tmp_path, steps=(1, 2, 3)):
    """Someone else's checkpoints folder with complete steps: its listing, to compare."""
    target = tmp_path / "elsewhere"
    for step in steps:
        save_checkpoint(target, step, STATE)
    return target, sorted(os.listdir(target))


def test_a_linked_checkpoints_folder_is_neither_written_nor_pruned(tmp_path):
    target, before = _elsewhere(tmp_path)
    link = tmp_path / "run" / "checkpoints"
    link.parent.mkdir()
    link.symlink_to(target)
    for write in (lambda: save_checkpoint(link, 4, STATE),
                  lambda: prune_checkpoints(link, keep_last=1),
                  lambda: set_aside(link / "step-3", "damaged"),
                  lambda: sft.resume(None, link, {}, print)):   # refused before any training
        with pytest.raises(StorageError, match="symbolic link") as e:
            write()
        assert str(link) in e.value.message
    assert sorted(os.listdir(target)) == before
    assert load_checkpoint(link / "step-3").step == 3      # reading through it stays allowed


def test_a_linked_step_folder_is_not_deleted_or_replaced_through(tmp_path):
    target, before = _elsewhere(tmp_path, steps=(1,))
    folder = tmp_path / "run" / "checkpoints"
    save_checkpoint(folder, 2, STATE)
    (folder / "step-1").symlink_to(target / "step-1")
    assert [p.name for p in list_checkpoints(folder)] == ["step-1", "step-2"]
    with pytest.raises(StorageError, match="step-1 is a symbolic link"):
        prune_checkpoints(folder, keep_last=1)
    with pytest.raises(StorageError, match="step-1 is a symbolic link"):
        save_checkpoint(folder, 1, STATE)
    assert sorted(os.listdir(target)) == before
    assert sorted(os.listdir(target / "step-1")) == ["arrays.npz", "manifest.json", "meta.json"]
