"""Checkpoints: atomic folders, pruning, and bit-identical resume of a training session."""

from __future__ import annotations

import os

import numpy as np
import pytest

from app.engine import load_model
from app.engine.checkpoint import (latest_checkpoint, list_checkpoints, load_checkpoint,
                                   prune_checkpoints, save_checkpoint)
from app.engine.config import TrainConfig
from app.engine.errors import CheckpointError
from app.engine.train import TrainSession, pack
from tests.conftest import GOLDEN

TEXT = np.frombuffer(b"Experts route tokens; routers learn. " * 5, np.uint8).astype(np.int64)
BATCHES = [pack([(TEXT[i:i + 40], TEXT[i + 1:i + 41])]) for i in range(0, 120, 20)]


def _session(mode="lora", optimizer="adamw"):
    model = load_model(GOLDEN / "qwen2moe-q8_0.gguf")
    config = TrainConfig(mode=mode, optimizer=optimizer, lr=1e-2, full_targets=("norms", "router"),
                         lora_dropout=0.1 if mode == "lora" else 0.0, schedule="cosine",
                         warmup_steps=2, max_steps=6)
    return TrainSession(model, config)


@pytest.mark.parametrize("mode", ["lora", "hybrid"])
@pytest.mark.parametrize("stop_after", [1, 3, 5])
def test_resume_is_bit_identical(tmp_path, mode, stop_after):
    straight = _session(mode)
    expected = [straight.step([b]).loss for b in BATCHES]

    first = _session(mode)
    losses = [first.step([b]).loss for b in BATCHES[:stop_after]]
    save_checkpoint(tmp_path, first.step_count, first.state_dict(), {"position": stop_after})
    del first

    resumed = _session(mode)
    ckpt = load_checkpoint(latest_checkpoint(tmp_path))
    resumed.load_state_dict(ckpt.state)
    losses += [resumed.step([b]).loss for b in BATCHES[ckpt.meta["position"]:]]
    assert losses == expected


def test_lbfgs_state_round_trips(tmp_path):
    a = _session("hybrid", "lbfgs")
    a.step([BATCHES[0]])
    save_checkpoint(tmp_path, 1, a.state_dict())
    b = _session("hybrid", "lbfgs")
    b.load_state_dict(load_checkpoint(tmp_path / "step-1").state)
    assert a.step([BATCHES[1]]).loss == b.step([BATCHES[1]]).loss


def test_checkpoint_folders_are_atomic_and_pruned(tmp_path, monkeypatch):
    session = _session()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, session.state_dict())
    # a crash before the rename leaves a temporary folder that is not a checkpoint
    real_rename = os.rename

    def crash(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(CheckpointError, match="step 5") as err:
        save_checkpoint(tmp_path, 5, session.state_dict())
    assert "disk is full" in err.value.hint
    monkeypatch.setattr(os, "rename", real_rename)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-1", "step-2", "step-3", "step-4"]
    prune_checkpoints(tmp_path, keep_last=2, keep=(1,))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-1", "step-3", "step-4"]
    assert not list(tmp_path.glob(".tmp-*"))


def test_corrupt_or_mismatched_checkpoints_are_clear_errors(tmp_path):
    session = _session()
    path = save_checkpoint(tmp_path, 1, session.state_dict())
    (path / "arrays.npz").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path)
    other = _session("hybrid")
    good = save_checkpoint(tmp_path, 2, other.state_dict())
    with pytest.raises(CheckpointError, match="does not match"):
        session.load_state_dict(load_checkpoint(good).state)
