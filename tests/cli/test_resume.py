"""`workbench resume` with damaged checkpoints (fallback, --step, none intact) and a
foreground run killed with -9, on the golden mixtral model."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from app.cli.main import run_cli
from app.engine.training.checkpoints import list_checkpoints
from app.engine.training.config import TrainConfig
from app.engine.data.dataset import DataConfig
from app.engine.training.sft import RunConfig, train
from app.engine.runs.rundir import RunDir
from tests.conftest import GOLDEN, REPO

ROOT = REPO


def _config(tmp_path, **kw) -> RunConfig:
    rows = [{"text": f"Expert {i % 4} routes token {i}; the router learns."} for i in range(40)]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return RunConfig(model=str(GOLDEN / "mixtral-q8_0.gguf"), data=str(data),
                     train=TrainConfig(mode="lora", lr=1e-2, lora_targets=("attention", "experts")),
                     data_config=DataConfig(context=48, val_fraction=0.2), epochs=2,
                     eval_every=4, save_every=2, **kw)


def _paused_run(tmp_path) -> tuple[RunConfig, RunDir]:
    """A run directory paused after 5 steps: checkpoints step-4 and step-5."""
    config = _config(tmp_path)
    run = RunDir.create(tmp_path / "run", config.to_dict())
    calls = {"n": 0}

    def pause_after_5():
        calls["n"] += 1
        return "pause" if calls["n"] == 5 else None
    assert train(config, run.append_metrics, pause_after_5, run.checkpoints_dir) == "paused"
    return config, run


def _straight_adapter(tmp_path, config) -> bytes:
    train(config, lambda e: None, lambda: None, tmp_path / "straight" / "checkpoints")
    return (tmp_path / "straight" / "adapter.gguf").read_bytes()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:200])


def test_resume_falls_back_from_a_damaged_checkpoint_and_says_so(tmp_path, capsys):
    config, run = _paused_run(tmp_path)
    _truncate(run.checkpoints_dir / "step-5" / "arrays.npz")      # was a BadZipFile traceback
    assert run_cli(["resume", str(run.path)]) == 0
    line = ("checkpoint step-5 is damaged (arrays.npz does not match its checksum); "
            "resuming from step-4 (kept as step-5.damaged)")
    assert line in capsys.readouterr().out
    assert {"type": "log", "message": line} in [
        {k: e[k] for k in ("type", "message")} for e in run.metrics() if e["type"] == "log"]
    assert (run.path / "adapter.gguf").read_bytes() == _straight_adapter(tmp_path, config)


def test_resume_step_picks_a_checkpoint(tmp_path, capsys):
    config, run = _paused_run(tmp_path)
    assert run_cli(["resume", str(run.path), "--step", "3"]) == 2
    err = capsys.readouterr().err
    assert "there is no checkpoint step-3" in err and "Intact checkpoints: steps 4, 5" in err
    assert run_cli(["resume", str(run.path), "--step", "4"]) == 0
    assert ("resuming from step-4; the newer checkpoints are set aside as step-5.skipped"
            in capsys.readouterr().err)
    assert (run.path / "adapter.gguf").read_bytes() == _straight_adapter(tmp_path, config)


def test_resume_step_refuses_a_damaged_checkpoint(tmp_path, capsys):
    _, run = _paused_run(tmp_path)
    _truncate(run.checkpoints_dir / "step-4" / "meta.json")
    assert run_cli(["resume", str(run.path), "--step", "4"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint step-4 is damaged (meta.json does not match its checksum)" in err
    assert "Intact checkpoints: steps 5" in err
    assert [p.name for p in list_checkpoints(run.checkpoints_dir)] == ["step-4", "step-5"]


def test_no_intact_checkpoint_is_a_clear_error(tmp_path, capsys):
    _, run = _paused_run(tmp_path)
    for ck in list_checkpoints(run.checkpoints_dir):
        (ck / "arrays.npz").unlink()
    assert run_cli(["resume", str(run.path)]) == 2
    err = capsys.readouterr().err
    assert "error: No checkpoint of the run is intact: step-5 is damaged (arrays.npz is " \
           "missing); step-4 is damaged (arrays.npz is missing)." in err
    assert f"workbench train --config {run.config_path}" in err and "Traceback" not in err
    assert run.status()["state"] == "failed"


def test_a_foreground_run_killed_with_9_is_interrupted_not_running(tmp_path, capsys):
    config = dataclasses.replace(_config(tmp_path), epochs=1000)
    (tmp_path / "c.json").write_text(json.dumps(config.to_dict()))
    run = RunDir(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "app", "train", "--config",
                             str(tmp_path / "c.json"), "-o", str(run.path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while run.status().get("step", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.status()["state"] == "running" and run.status()["eta_s"] > 0
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    status = run.status()
    assert status["state"] == "interrupted" and "eta_s" not in status
    assert run_cli(["runs", "list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "interrupted" in out and "running" not in out and "eta" not in out
    assert run_cli(["runs", "show", str(run.path)]) == 0
    assert "state    interrupted" in capsys.readouterr().out
