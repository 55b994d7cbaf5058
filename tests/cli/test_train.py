"""`workbench train` / `resume` on the bundled sample model and data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli.main import run_cli
from app.engine.runs.queue import JobQueue
from app.engine.runs.rundir import RunDir
from tests.conftest import SAMPLE_DATA

SAMPLE = SAMPLE_DATA


def _train(out, *extra):
    return run_cli(["train", "-m", str(SAMPLE / "tiny-moe.gguf"), "-d", str(SAMPLE / "chat.jsonl"),
                    "--rank", "8", "--alpha", "16", "--targets", "attn,experts,router",
                    "--lr", "5e-3", "--val-split", "0.1", "-o", str(out), *extra])


@pytest.mark.slow
def test_train_on_sample_data_lowers_the_loss(tmp_path, capsys):
    assert _train(tmp_path / "run", "--epochs", "1", "--eval-every", "10", "--json") == 0
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    steps = [e for e in lines if e["type"] == "step"]
    assert {"type", "step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(steps[0])
    evals = [e["loss"] for e in lines if e["type"] == "eval"]
    assert len(evals) >= 3 and evals[-1] < 0.8 * evals[0]
    run = RunDir(tmp_path / "run")
    assert run.status()["state"] == "done"
    assert (tmp_path / "run" / "adapter.gguf").exists()
    assert run_cli(["runs", "show", str(tmp_path / "run")]) == 0


@pytest.mark.slow
def test_resume_extends_a_finished_run(tmp_path, capsys):
    assert _train(tmp_path / "run", "--epochs", "1", "--max-steps", "4") == 0
    capsys.readouterr()
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    config["max_steps"] = 0                                   # let the extension run whole epochs
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    assert run_cli(["resume", str(tmp_path / "run"), "--extend-epochs", "1", "--json"]) == 0
    steps = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    steps = [e["step"] for e in steps if e["type"] == "step"]
    assert steps[0] == 5 and steps[-1] == 2 * 59     # chat.jsonl: 59 steps per epoch at context 256


def test_train_into_the_queue(tmp_path, capsys):
    queue = tmp_path / "q.sqlite3"
    assert _train(tmp_path / "run", "--epochs", "1", "--queue", str(queue)) == 0
    [job] = JobQueue(queue).list()
    assert job.state == "queued" and Path(job.run_dir) == tmp_path / "run"


def test_train_without_data_is_a_clear_error(tmp_path, capsys):
    assert run_cli(["train", "-m", str(SAMPLE / "tiny-moe.gguf"), "-o", str(tmp_path / "r")]) == 2
    assert "needs a model and a dataset" in capsys.readouterr().err


def test_cuda_without_a_gpu_is_refused_before_a_run_folder_exists(tmp_path, capsys):
    assert _train(tmp_path / "run", "--epochs", "1", "--device", "cuda") == 2
    assert "No CUDA GPU is usable here" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert _train(tmp_path / "q", "--epochs", "1", "--device", "cuda",      # a GPU machine's queue
                  "--queue", str(tmp_path / "q.sqlite3")) == 0
    assert json.loads((tmp_path / "q" / "config.json").read_text())["train"]["device"] == "cuda"


def test_weight_cache_option_reaches_the_model(tmp_path, monkeypatch, capsys):
    import app.engine.training.sft as run

    budgets = []
    real = run.load_model
    monkeypatch.setattr(run, "load_model", lambda path, budget=None, device="cpu":
                        budgets.append(budget) or real(path, budget, device))
    assert _train(tmp_path / "run", "--epochs", "1", "--max-steps", "1",
                  "--weight-cache-mb", "0") == 0
    assert budgets == [0]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"][
        "weight_cache_mb"] == 0
    assert _train(tmp_path / "bad", "--epochs", "1", "--weight-cache-mb", "-1") == 2
    assert "train.weight_cache_mb: expected an integer in [0, " in capsys.readouterr().err
