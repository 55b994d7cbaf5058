"""`workbench train --method dpo|orpo|simpo|kto`: the run directory (config.json's kind,
status.json's held-out headline), resume, --json events, the queue, refused SFT-only options,
and the export of a preference run's adapter to GGUF LoRA."""

from __future__ import annotations

import json

import pytest

from app.cli.main import run_cli
from app.engine import load_adapter
from app.engine.runs.kinds import kind_of
from app.engine.runs.queue import JobQueue
from app.engine.runs.rundir import RunDir
from app.engine.training.events import problems
from tests.conftest import REPO

MODEL = str(REPO / "sample_data" / "tiny-moe.gguf")
PREFS = str(REPO / "sample_data" / "preferences.jsonl")
SMALL = ["-m", MODEL, "-d", PREFS, "--val-split", "0.1", "--rank", "4", "--batch", "4",
         "--epochs", "0"]


@pytest.mark.slow
def test_dpo_run_resume_and_export(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(["train", "--method", "dpo", *SMALL, "--max-steps", "3", "--beta", "0.2",
                    "--sft-weight", "0.1", "-o", str(out), "--json"]) == 0
    run = RunDir(out)
    config = run.config()
    assert config["kind"] == "dpo" and config["beta"] == 0.2 and config["pairs_per_step"] == 4
    assert kind_of(config).label == "DPO"
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert any(e.get("type") == "eval" for e in lines)
    assert all(problems(e, "dpo") == [] for e in run.metrics())
    status = run.status()
    assert status["state"] == "done" and "eval_rewards/accuracies" in status
    assert run_cli(["resume", str(out), "--extend-epochs", "0"]) == 0   # finished: nothing to do
    capsys.readouterr()
    assert run_cli(["runs", "list", str(tmp_path)]) == 0   # BEST: the held-out accuracy
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("run "))
    assert " dpo " in row and "accuracy " in row
    # the adapter exports to GGUF LoRA and loads back (as for SFT)
    target = tmp_path / "dpo-lora.gguf"
    assert run_cli(["export", str(out), "--to", "gguf-lora", "-o", str(target)]) == 0
    adapter = load_adapter(target)
    assert adapter.arch == "llama" and adapter.tensors


def test_sft_only_options_and_unpaired_data_are_refused(tmp_path, capsys):
    assert run_cli(["train", "--method", "orpo", *SMALL, "--packing", "pad",
                    "-o", str(tmp_path / "a")]) == 2
    assert "--packing apply to supervised runs" in capsys.readouterr().err
    kto = tmp_path / "kto.jsonl"
    kto.write_text("\n".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i}",
                                         "label": i % 2 == 0}) for i in range(8)) + "\n")
    assert run_cli(["train", "--method", "dpo", "-m", MODEL, "-d", str(kto), "--max-steps",
                    "1", "--epochs", "0", "-o", str(tmp_path / "b")]) == 2
    assert "needs chosen/rejected pairs" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()          # a run that fails before a step is taken back
    assert run_cli(["train", "--method", "dpo", "-m", MODEL, "-d", PREFS, "--val-data",
                    str(kto), "--max-steps", "1", "--epochs", "0", "-o", str(tmp_path / "c")]) == 2
    assert "kto.jsonl has unpaired (KTO) rows" in capsys.readouterr().err


def test_a_queued_kto_run_names_its_kind(tmp_path, capsys):
    queue = tmp_path / "q.sqlite3"
    assert run_cli(["train", "--method", "kto", *SMALL, "--max-steps", "2",
                    "--queue", str(queue), "-o", str(tmp_path / "run")]) == 0
    job = JobQueue(queue).list()[0]
    assert RunDir(job.run_dir).config()["kind"] == "kto"


def test_a_cluster_node_runs_a_simpo_run_directory(tmp_path, capsys):
    """`queue run-remote` (what a Ray job runs on a node) finds a preference run's loop in the
    run-kind table and records it as the worker does."""
    from app.engine.runs.remote import EXIT_DONE, run_remote

    out = tmp_path / "run"
    assert run_cli(["train", "--method", "simpo", *SMALL, "--max-steps", "2", "--queue",
                    str(tmp_path / "q.sqlite3"), "-o", str(out)]) == 0
    assert run_remote(out) == EXIT_DONE
    run = RunDir(out)
    assert run.status()["state"] == "done" and run.status()["step"] == 2
    assert all(problems(e, "simpo") == [] for e in run.metrics())
    assert (out / "adapter.gguf").is_file()
