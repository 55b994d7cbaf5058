"""Monitor's controls (issue 29): Stop and save, then Continue, the Runs screen's action of the
same name (one engine call, JobQueue.continue_run: the queue's resume for a paused job, a retry
for a failed or cancelled one, a new job for a stopped or interrupted run with a checkpoint);
tooltips on every control."""

from __future__ import annotations

import pytest
from PySide6.QtWidgets import QPushButton

from app.views.monitor.view import MonitorView
from tests.views.conftest import untipped_inputs
from tests.views.fake_runs import FakeRun
from tests.views.monitor.test_monitor import follow_a_running_job


@pytest.fixture
def monitor(ctx, qtbot):
    view = MonitorView(ctx)
    qtbot.addWidget(view)
    return view


def test_stop_and_save_then_continue_from_the_monitor(qtbot, ctx, monitor):
    fake, job_id = follow_a_running_job(qtbot, ctx, monitor)
    assert not monitor.continue_button.isEnabled()                   # running
    monitor.stop_save_button.click()
    assert ctx.queue.get(job_id).requested_action == "pause"
    assert monitor.continue_button.isEnabled()             # withdraws the pause, as on Runs
    ctx.queue.finish(job_id, "worker-1", "paused")       # the worker saved and stopped
    fake.finish("paused")
    qtbot.waitUntil(lambda: monitor.status.get("state") == "paused")
    assert monitor.continue_button.isEnabled() and not monitor.stop_save_button.isEnabled()
    with qtbot.waitSignal(ctx.runs_changed):
        monitor.continue_button.click()
    assert ctx.queue.get(job_id).state == "queued" and ctx.worker_starts == [1]
    assert not monitor.continue_button.isEnabled() and monitor.stop_save_button.isEnabled()
    ctx.queue.pause(job_id)                              # paused on the Runs screen
    ctx.runs_changed.emit()
    assert monitor.continue_button.isEnabled()


@pytest.mark.parametrize("state", ["paused", "interrupted"])
def test_a_stopped_run_without_a_job_continues_as_a_new_job(qtbot, ctx, monitor, state):
    fake = FakeRun(ctx.runs_root() / "cli", status_state=state)
    fake.step(3, status=False)
    ctx.select_run(fake.path)
    qtbot.waitUntil(lambda: monitor.status.get("state") == state)
    assert not monitor.continue_button.isEnabled()               # no checkpoint to resume from
    (fake.run.checkpoints_dir / "step-3").mkdir(parents=True)
    fake.run.write_status(state=state, step=3, total_steps=100, fsync=False)
    qtbot.waitUntil(lambda: monitor.continue_button.isEnabled())
    monitor.continue_button.click()
    jobs = ctx.queue.find(fake.path)
    assert [j.state for j in jobs] == ["queued"] and ctx.worker_starts == [1]
    assert not monitor.continue_button.isEnabled()


def test_continue_is_the_runs_screens_action_for_a_failed_job_too(qtbot, ctx, monitor):
    """Issue 29 item 8: Monitor's Resume was off for a failed job that Runs' Continue queued
    again; now one action, one name and one tooltip on both screens."""
    from app.views.runs.view import RunsView
    fake, job_id = follow_a_running_job(qtbot, ctx, monitor)
    ctx.queue.finish(job_id, "worker-1", "failed", {"kind": "bug", "message": "boom",
                                                    "hint": None, "detail": ""})
    fake.finish("failed", {"kind": "bug", "message": "boom", "hint": None})
    qtbot.waitUntil(lambda: monitor.status.get("state") == "failed")
    runs = RunsView(ctx)
    qtbot.addWidget(runs)
    runs.refresh()
    runs.select(fake.path)
    assert monitor.continue_button.text() == runs.buttons["continue"].text() == "Continue"
    assert monitor.continue_button.toolTip() == runs.buttons["continue"].toolTip()
    assert monitor.continue_button.isEnabled() and runs.buttons["continue"].isEnabled()
    with qtbot.waitSignal(ctx.runs_changed):
        monitor.continue_button.click()
    assert ctx.queue.get(job_id).state == "queued"       # the same job, queued again
    assert ctx.worker_starts == [1] and not monitor.continue_button.isEnabled()


def test_every_control_has_a_tooltip(monitor):
    assert untipped_inputs(monitor) == []
    assert [b.text() for b in monitor.findChildren(QPushButton) if not b.toolTip()] == []
