"""--eval-task: a multiple-choice task scored at every evaluation of a supervised run, its
accuracy in each eval event (a metric curve), the same as scoring the saved adapter alone."""

from __future__ import annotations

import json

import pytest

from app.cli.main import run_cli
from app.engine.errors import ConfigError
from app.engine.evaluation import scoring, tasks
from app.engine.evaluation.during_training import task_evaluator
from app.engine.model.lora import load_adapter
from app.engine.model.transformer import load_model
from app.engine.runs.rundir import RunDir
from app.engine.training.sft import RunConfig
from tests.conftest import SAMPLE_DATA


def test_train_scores_the_task_at_every_evaluation(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(["train", "-m", str(SAMPLE_DATA / "tiny-moe.gguf"),
                    "-d", str(SAMPLE_DATA / "chat.jsonl"), "--rank", "4", "--targets", "attn",
                    "--epochs", "0", "--max-steps", "4", "--eval-every", "2",
                    "--val-split", "0.1", "--eval-task", str(SAMPLE_DATA / "eval_tasks.jsonl"),
                    "--eval-task-limit", "8", "-o", str(out)]) == 0
    assert "jsonl:eval_tasks.jsonl=" in capsys.readouterr().out
    evals = [e for e in RunDir(out).metrics() if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4]
    assert all(e["task"] == "jsonl:eval_tasks.jsonl" for e in evals)
    # the last one is the final adapter's accuracy on the 8 items, scored alone
    model = load_model(SAMPLE_DATA / "tiny-moe.gguf")
    items = tasks.read_tasks("jsonl", SAMPLE_DATA / "eval_tasks.jsonl", 8)
    params = model.params(load_adapter(out / "adapter.gguf"))
    picked = scoring.score_tasks(model, params, "jsonl", items)
    assert evals[-1]["task_acc"] == sum(s.choice in t.correct for s, t in zip(picked, items)) / 8
    assert json.loads((out / "config.json").read_text())["eval_task"] == \
        f"jsonl:{SAMPLE_DATA / 'eval_tasks.jsonl'}"


def test_only_multiple_choice_tasks_and_one_process():
    config = RunConfig("m.gguf", "d.jsonl", eval_task=f"suite:{SAMPLE_DATA}/eval_suite.jsonl")
    with pytest.raises(ConfigError, match="multiple-choice task, not suite"):
        task_evaluator(config)
    assert task_evaluator(RunConfig("m.gguf", "d.jsonl")) is None
    with pytest.raises(ConfigError, match="data-parallel"):
        RunConfig("m.gguf", "d.jsonl", eval_task="mc:x.bin", workers=2).validate()


def test_the_best_checkpoint_by_the_tasks_accuracy(tmp_path):
    """--best-by task: the best step is the first evaluation with the highest task accuracy
    (its checkpoint kept), not the lowest validation loss."""
    from app.engine.runs.rundir import best_checkpoint

    out = tmp_path / "run"
    assert run_cli(["train", "-m", str(SAMPLE_DATA / "tiny-moe.gguf"),
                    "-d", str(SAMPLE_DATA / "chat.jsonl"), "--rank", "4", "--targets", "attn",
                    "--lr", "0.05", "--epochs", "0", "--max-steps", "6", "--eval-every", "2",
                    "--val-split", "0.1", "--eval-task", str(SAMPLE_DATA / "eval_tasks.jsonl"),
                    "--eval-task-limit", "8", "--best-by", "task", "-o", str(out)]) == 0
    evals = [e for e in RunDir(out).metrics() if e["type"] == "eval"]
    accs = [e["task_acc"] for e in evals]
    want = evals[accs.index(max(accs))]["step"]
    assert [e["step"] for e in evals if e["best"]][-1] == want
    assert best_checkpoint(out)[0] == want
    with pytest.raises(ConfigError, match="best_by task needs an evaluation task"):
        RunConfig("m.gguf", "d.jsonl", best_by="task").validate()
