"""A DPO run through the window's queue (queued through the context's door, as New run queues
its runs, from the config `workbench train --method dpo` writes; New run's own Start:
tests/views/new_run/test_new_run_preference.py), run by the worker's own loop, then shown in Monitor (loss, accuracy and
margin, the best step) and Runs (type DPO, Best the held-out accuracy)."""

from __future__ import annotations

import pytest

from app.engine.runs.rundir import RunDir
from app.engine.runs.worker import run_worker
from app.engine.training.config import TrainConfig
from app.engine.training.preference import PreferenceConfig
from app.views.monitor.view import MonitorView
from app.views.runs.view import RunsView
from tests.conftest import REPO


def run_and_follow(qtbot, ctx):
    """Run the queue's one DPO run by the worker's own loop, then select it in a Monitor:
    (its RunDir, its eval events, the Monitor showing a held-out accuracy point for each)."""
    assert run_worker(ctx.queue, once=True, poll_s=0.01) == 1       # the worker's loop
    [job] = ctx.queue.list()
    assert job.state == "done", job.error
    run = RunDir(job.run_dir)
    evals = [e for e in run.metrics() if e["type"] == "eval"]
    monitor = MonitorView(ctx)
    qtbot.addWidget(monitor)
    ctx.select_run(run.path)
    held_out = monitor.held_out_curves["clipped"]
    qtbot.waitUntil(lambda: held_out.yData is not None and len(held_out.yData) == len(evals),
                    timeout=10_000)
    assert monitor.kind.name == "dpo"
    assert list(held_out.yData) == [e["eval_rewards/accuracies"] for e in evals]
    return run, evals, monitor


@pytest.mark.slow
def test_a_dpo_run_through_the_queue_to_monitor_and_runs(qtbot, ctx):
    config = PreferenceConfig(model=str(REPO / "sample_data/tiny-moe.gguf"),
                              data=str(REPO / "sample_data/preferences.jsonl"),
                              train=TrainConfig(lr=3.5e-3, lora_rank=4), val_split=0.1,
                              pairs_per_step=8, max_steps=12, epochs=0, eval_every=4)
    path = ctx.runs_root() / "dpo-preferences"
    ctx.queue_new_run(path, config.to_dict(), first=True)
    assert ctx.worker_starts                                       # the window asked for one
    run, evals, monitor = run_and_follow(qtbot, ctx)
    assert evals[0]["eval_rewards/accuracies"] == 0.0              # every reward 0 at step 0
    assert evals[-1]["eval_rewards/accuracies"] >= 0.9
    monitor.redraw.flush()
    assert len(monitor.tps_curve.yData) == 12                      # the margin of each step
    assert "held-out accuracy" in monitor.best_mark.text

    runs = RunsView(ctx)
    qtbot.addWidget(runs)
    runs.refresh()
    assert runs.text(0, "Type") == "DPO"
    assert runs.text(0, "Best").startswith("1.000 @ ")
