"""A preference run's best in the window (Runs' Best column, Monitor's mark, Playground's and
Export's checkpoint choice): its highest held-out accuracy, as the engine chose it, labelled
as an accuracy (before: "validation 1.00", the label of a loss, or no best at all)."""

from __future__ import annotations

from app.engine.runs.rundir import RunDir
from app.engine.runs.reporter import RunReporter
from app.engine.training.config import TrainConfig
from app.engine.training.preference import PreferenceConfig, train_preference
from app.views.widgets.run_best import ACCURACY, better, checkpoint_choices, run_best
from tests.conftest import REPO


def test_a_dpo_runs_best_is_its_held_out_accuracy(tmp_path):
    config = PreferenceConfig(model=str(REPO / "sample_data/tiny-moe.gguf"),
                              data=str(REPO / "sample_data/preferences.jsonl"),
                              train=TrainConfig(lr=3.5e-3, lora_rank=4), val_split=0.1,
                              pairs_per_step=4, max_steps=4, epochs=0, eval_every=2)
    run = RunDir.create(tmp_path / "run", config.to_dict())
    assert train_preference(config, RunReporter(run).report, lambda: None,
                            run.checkpoints_dir) == "done"
    evals = [e for e in run.metrics() if e["type"] == "eval"]
    best = None
    for e in evals:
        best = better(e, "dpo", best)
    marked = [e for e in evals if e["best"]][-1]
    assert best is not None and best.metric == ACCURACY
    assert (best.step, best.value) == (marked["step"], marked["eval_rewards/accuracies"])
    kept = run_best(str(run.path))
    assert kept is not None and kept.metric == ACCURACY and kept.step == best.step
    label = dict(checkpoint_choices(str(run.path)))["best"]
    assert "held-out accuracy" in label
