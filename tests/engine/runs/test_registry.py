"""The user's list of runs (app.engine.runs.registry): every RunDir.create registers its run,
wherever its folder is; a deleted folder is listed as missing."""

from __future__ import annotations

import shutil

from app.engine.runs.registry import registry_entries, registry_path
from app.engine.runs.rundir import RunDir, best_evaluation, registered_runs


def _by_path(path):
    return {r.path: r for r in registered_runs()}.get(RunDir(path).path)


def test_a_created_run_is_registered_with_its_model_and_dataset(tmp_path):
    run = RunDir.create(tmp_path / "anywhere" / "r1", {"model": "/m/tiny.gguf",
                                                       "data": "/d/chat.jsonl"})
    row = _by_path(run.path)
    assert (row.kind, row.model, row.dataset, row.state) == ("sft", "/m/tiny.gguf",
                                                             "/d/chat.jsonl", "new")
    assert row.name == "r1" and row.created > 0


def test_a_run_with_status_and_evaluations_shows_duration_steps_and_best(tmp_path):
    run = RunDir.create(tmp_path / "r2", {"kind": "grpo", "model": "m", "prompts": "p.jsonl"})
    run.write_status(state="done", step=10, total_steps=10, started_at=100.0, finished_at=160.0)
    for step, reward in ((0, 0.1), (5, 0.7), (10, 0.4)):
        run.append_metrics({"type": "eval", "step": step, "reward_mean": reward})
    row = _by_path(run.path)
    assert (row.kind, row.dataset, row.state, row.step, row.duration_s) == (
        "grpo", "p.jsonl", "done", 10, 60.0)
    assert row.best == {"metric": "reward", "value": 0.7, "step": 5}


def test_a_deleted_folder_is_missing_not_an_error(tmp_path):
    run = RunDir.create(tmp_path / "gone", {"model": "m", "data": "d"})
    shutil.rmtree(run.path)
    assert _by_path(run.path).state == "missing"


def test_torn_lines_are_skipped_and_a_path_is_listed_once(tmp_path):
    run = RunDir.create(tmp_path / "twice", {"model": "m", "data": "a"})
    with open(registry_path(), "a") as f:
        f.write('{"path": "torn\n')
    RunDir.create(run.path, {"model": "m", "data": "b"}, exist_ok=True)
    mine = [e for e in registry_entries() if e["path"] == str(run.path)]
    assert len(mine) == 1 and mine[0]["dataset"] == "b"


def test_best_evaluation_is_the_lowest_validation_loss():
    events = [{"type": "step", "step": 1, "loss": 0.1},
              {"type": "eval", "step": 30, "loss": 1.5}, {"type": "eval", "step": 60, "loss": 1.2},
              {"type": "eval", "step": 90, "loss": 1.4}]
    assert best_evaluation(events) == {"metric": "val_loss", "value": 1.2, "step": 60}
    assert best_evaluation([]) is None
