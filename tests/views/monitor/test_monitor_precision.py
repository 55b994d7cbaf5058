"""Monitor says what a run's products compute in (issue 30): status.json's `precision`, written
from the run's start event (app.engine.runs.reporter)."""

from __future__ import annotations

from app.engine.runs.reporter import RunReporter
from app.engine.training import events
from app.views.monitor.view import MonitorView
from tests.views.fake_runs import FakeRun

REASON = "bf16: AVX512-BF16 via oneDNN"


def test_the_start_events_precision_reaches_status_log_and_monitor(qtbot, ctx):
    fake = FakeRun(ctx.runs_root() / "bf16-run", total_steps=10)
    RunReporter(fake.run).report(events.SFT_START(
        total_steps=10, epochs=1, steps_per_epoch=10, trainable=1000, train_rows=90,
        val_rows=10, skipped_rows=0, resumed_at=0, precision=REASON))
    assert fake.run.status()["precision"] == REASON
    assert f"products in {REASON}" in (fake.run.path / "log.txt").read_text()
    fake.step(3)
    monitor = MonitorView(ctx)
    qtbot.addWidget(monitor)
    ctx.select_run(fake.path)
    qtbot.waitUntil(lambda: "precision bf16" in monitor.stats_label.text())
    assert REASON in monitor.stats_label.toolTip()
