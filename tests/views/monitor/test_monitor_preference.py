"""Monitor follows a preference (DPO) run: the loss plot shows its training and held-out
preference loss and the best step with its held-out accuracy (before: a KeyError in the Qt event
loop on selecting the run), and beside it the accuracy and the reward margin, each step's and
the held-out ones; a supervised run selected next gets its own plots back."""

from __future__ import annotations

import pytest

from app.engine.api import SFT
from app.engine.runs.reporter import RunReporter
from app.engine.runs.rundir import RunDir
from app.engine.training.config import TrainConfig
from app.engine.training.preference import PreferenceConfig, train_preference
from app.views.monitor.view import MonitorView
from tests.conftest import REPO


@pytest.mark.slow
def test_monitor_shows_a_dpo_run(ctx, qtbot, tmp_path):
    config = PreferenceConfig(model=str(REPO / "sample_data/tiny-moe.gguf"),
                              data=str(REPO / "sample_data/preferences.jsonl"),
                              train=TrainConfig(lr=3.5e-3, lora_rank=4), val_split=0.1,
                              pairs_per_step=4, max_steps=4, epochs=0, eval_every=2)
    run = RunDir.create(ctx.runs_root() / "dpo-run", config.to_dict())
    train_preference(config, RunReporter(run).report, lambda: None, run.checkpoints_dir)
    view = MonitorView(ctx)
    qtbot.addWidget(view)
    ctx.select_run(run.path)
    qtbot.waitUntil(lambda: view.val_curve.xData is not None and len(view.val_curve.xData) == 3,
                    timeout=10000)
    view.redraw.flush()
    assert list(view.val_curve.xData) == [0, 2, 4]
    assert len(view.loss_curve.xData) == 4
    assert "held-out accuracy" in view.best_mark.text
    steps = [e for e in run.metrics() if e["type"] == "step"]
    evals = [e for e in run.metrics() if e["type"] == "eval"]
    assert "Accuracy" in view.clipped_plot.getPlotItem().titleLabel.text
    assert "margin" in view.tps_plot.getPlotItem().titleLabel.text
    assert list(view.clipped_curve.yData) == [e["rewards/accuracies"] for e in steps]
    assert list(view.tps_curve.yData) == [e["rewards/margins"] for e in steps]
    held_out = view.held_out_curves
    assert list(held_out["clipped"].yData) == [e["eval_rewards/accuracies"] for e in evals]
    assert list(held_out["tps"].yData) == [e["eval_rewards/margins"] for e in evals]
    view.grab().save(str(tmp_path / "monitor-dpo.png"))
    view._set_kind(SFT)                      # a supervised run: its own titles, no points
    assert "Clipped fraction" in view.clipped_plot.getPlotItem().titleLabel.text
