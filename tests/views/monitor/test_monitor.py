"""MonitorView: live curves from a run directory being written, stop buttons, comparisons."""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import Qt

from app.views.monitor.view import MonitorView
from tests.views.fake_runs import FakeRun, fake_config


@pytest.fixture
def monitor(ctx, qtbot):
    view = MonitorView(ctx)
    qtbot.addWidget(view)
    view.set_smoothing(0)
    return view


def n_points(curve) -> int:
    """Points set on the curve (getData() gives only those in view when zoomed)."""
    return 0 if curve.xData is None else len(curve.xData)


def reference_ema(values, weight):
    out, acc = [], 0.0
    for i, v in enumerate(values, start=1):
        acc = weight * acc + (1 - weight) * v
        out.append(acc / (1 - weight ** i))
    return np.array(out)


def test_curves_fill_while_the_run_is_written(qtbot, ctx, monitor):
    fake = FakeRun(ctx.runs_root() / "live", total_steps=200)
    fake.log("tokenizing chat.jsonl")
    ctx.select_run(fake.path)
    assert monitor.title.text() == "live"
    writer = fake.play_in_thread(120, every=10, delay_s=0.002)
    qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 120, timeout=10000)
    writer.join()
    monitor.redraw.flush()                      # the other plots are drawn a moment later
    x, y = monitor.loss_curve.getData()
    np.testing.assert_array_equal(x, np.arange(1, 121))
    np.testing.assert_allclose(y, [FakeRun.loss_at(s) for s in range(1, 121)])
    qtbot.waitUntil(lambda: n_points(monitor.val_curve) == 12)
    vx, vy = monitor.val_curve.getData()
    np.testing.assert_array_equal(vx, np.arange(10, 121, 10))
    np.testing.assert_allclose(vy, [FakeRun.loss_at(s) + 0.1 for s in range(10, 121, 10)])
    np.testing.assert_allclose(monitor.lr_curve.getData()[1][:3],
                               [0.005 * (1 - s / 200) for s in (1, 2, 3)])
    np.testing.assert_allclose(monitor.grad_curve.getData()[1][:2], [2.0, 1.5])
    np.testing.assert_allclose(monitor.clipped_curve.getData()[1][:4], [0.25, 0, 0.25, 0])
    np.testing.assert_allclose(monitor.tps_curve.getData()[1][-1], 2120.0)
    assert (monitor.progress.value(), monitor.progress.maximum()) == (120, 200)
    assert "step 120 of 200 (60%)" in monitor.progress.text()
    assert "ETA 0:00:08" in monitor.progress.text()
    assert f"loss {FakeRun.loss_at(120):.4f}" in monitor.stats_label.text()
    qtbot.waitUntil(lambda: "tokenizing chat.jsonl" in monitor.log_view.toPlainText())
    assert "start: 200 steps" in monitor.log_view.toPlainText()

    fake.finish()
    qtbot.waitUntil(lambda: monitor.progress.text().startswith("done"))
    assert monitor.progress.value() == 200
    qtbot.waitUntil(lambda: "done at step 120" in monitor.log_view.toPlainText())


def test_smoothing_log_scale_and_zoom(qtbot, ctx, monitor):
    fake = FakeRun(ctx.runs_root() / "run")
    fake.step(50)
    ctx.select_run(fake.path)
    qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 50)
    raw = np.array([FakeRun.loss_at(s) for s in range(1, 51)])
    np.testing.assert_allclose(monitor.smooth_curve.getData()[1], raw)      # smoothing 0
    monitor.set_smoothing(0.9)
    assert monitor.smoothing_label.text() == "0.90"
    np.testing.assert_allclose(monitor.smooth_curve.getData()[1], reference_ema(raw, 0.9))
    fake.step(10)                                         # smoothed incrementally from here
    qtbot.waitUntil(lambda: n_points(monitor.smooth_curve) == 60)
    raw = np.array([FakeRun.loss_at(s) for s in range(1, 61)])
    np.testing.assert_allclose(monitor.smooth_curve.getData()[1], reference_ema(raw, 0.9))

    monitor.log_scale.setChecked(True)
    assert monitor.loss_plot.getPlotItem().ctrl.logYCheck.isChecked()
    np.testing.assert_allclose(monitor.loss_curve.getData()[1], np.log10(raw))
    monitor.log_scale.setChecked(False)
    np.testing.assert_allclose(monitor.loss_curve.getData()[1], raw)

    vb = monitor.loss_plot.getViewBox()
    assert vb.viewRange()[0] == [0.0, 100.0]               # the whole run: steps 0 .. 100
    bottom, top = vb.viewRange()[1]                        # values: all of them in view
    assert bottom <= raw.min() and raw.max() <= top < raw.max() + 0.5
    vb.setXRange(10, 20, padding=0)                        # the user zooms in (mouse wheel)
    vb.sigRangeChangedManually.emit([True, True])
    fake.step(5)
    qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 65)
    monitor.redraw.flush()
    assert vb.viewRange()[0] == [10.0, 20.0]               # new data do not undo the zoom
    monitor.reset_zoom()
    assert vb.viewRange()[0] == [0.0, 100.0]
    bottom, top = vb.viewRange()[1]
    assert bottom <= FakeRun.loss_at(65) and FakeRun.loss_at(1) <= top


def test_a_resumed_run_rewrites_the_repeated_steps(qtbot, ctx, monitor):
    fake = FakeRun(ctx.runs_root() / "run")
    fake.step(30)
    ctx.select_run(fake.path)
    qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 30)
    fake.step_no = 20                              # the worker died; resumed from step 20
    fake.step(5)
    qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 25)
    np.testing.assert_array_equal(monitor.loss_curve.getData()[0], np.arange(1, 26))


def test_a_restarted_attempt_read_at_once_keeps_the_later_points(qtbot, ctx, monitor):
    """metrics.jsonl holds a lost attempt (steps 1-30) and the new attempt resumed from the
    checkpoint at step 20 (steps 21-25, other losses): one read gets both; each step is drawn
    once, with the new attempt's value, and nothing of the lost attempt after step 20."""
    fake = FakeRun(ctx.runs_root() / "run")
    fake.step(30)
    for step in range(21, 26):
        fake.run.append_metrics({"type": "step", "step": step, "total_steps": 100,
                                 "loss": 9.0 + step, "lr": 0.001})
    ctx.select_run(fake.path)
    qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 25)
    x, y = monitor.loss_curve.getData()
    np.testing.assert_array_equal(x, np.arange(1, 26))
    np.testing.assert_allclose(y[:20], [FakeRun.loss_at(s) for s in range(1, 21)])
    np.testing.assert_allclose(y[20:], [9.0 + s for s in range(21, 26)])
    monitor.redraw.flush()
    np.testing.assert_array_equal(monitor.lr_curve.getData()[0], np.arange(1, 26))


def test_a_lost_attempts_eval_and_best_go_when_the_next_attempt_repeats_its_steps(
        qtbot, ctx, monitor):
    fake = FakeRun(ctx.runs_root() / "run")
    for _ in range(3):
        fake.step(10)
        fake.eval()
    ctx.select_run(fake.path)
    qtbot.waitUntil(lambda: n_points(monitor.val_curve) == 3 and monitor.best is not None
                    and monitor.best.step == 30)
    for step in range(21, 26):          # the cluster lost attempt 1; attempt 2 resumed at 20
        fake.run.append_metrics({"type": "step", "step": step, "total_steps": 100,
                                 "loss": 9.0 + step})
    qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 25 and monitor.best is not None)
    monitor.redraw.flush()
    np.testing.assert_array_equal(monitor.loss_curve.getData()[0], np.arange(1, 26))
    np.testing.assert_allclose(monitor.loss_curve.getData()[1][20:], [9.0 + s for s in
                                                                     range(21, 26)])
    np.testing.assert_array_equal(monitor.val_curve.getData()[0], [10, 20])
    assert monitor.best.step == 20 and monitor.best_mark.line.value() == 20


def test_switching_runs_resets_the_curves(qtbot, ctx, monitor):
    a = FakeRun(ctx.runs_root() / "a")
    a.step(30)
    b = FakeRun(ctx.runs_root() / "b")
    b.step(7)
    ctx.select_run(a.path)
    qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 30)
    ctx.select_run(b.path)
    assert n_points(monitor.loss_curve) == 0
    qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 7)
    qtbot.wait(200)
    assert n_points(monitor.loss_curve) == 7


def follow_a_running_job(qtbot, ctx, monitor) -> tuple[FakeRun, int]:
    """A queued run three steps in, claimed by a worker, followed by `monitor` once its Stop
    buttons are on: (the run, its job id)."""
    fake = FakeRun(ctx.runs_root() / "run")
    fake.step(3)
    job_id = ctx.queue.add(fake.path)
    ctx.queue.claim_next("worker-1")
    ctx.select_run(fake.path)
    qtbot.waitUntil(lambda: monitor.stop_save_button.isEnabled())
    return fake, job_id


def test_stop_and_save_pauses_and_stop_and_discard_cancels(qtbot, ctx, monitor):
    _, job_id = follow_a_running_job(qtbot, ctx, monitor)
    assert monitor.stop_discard_button.isEnabled()
    with qtbot.waitSignal(ctx.runs_changed):
        monitor.stop_save_button.click()
    assert ctx.queue.get(job_id).requested_action == "pause"
    assert not monitor.stop_save_button.isEnabled()
    monitor.confirm = lambda: False
    monitor.stop_discard_button.click()
    assert ctx.queue.get(job_id).requested_action == "pause"      # not confirmed
    monitor.confirm = lambda: True
    monitor.stop_discard_button.click()
    assert ctx.queue.get(job_id).requested_action == "cancel"
    assert not monitor.stop_discard_button.isEnabled()


def test_a_terminal_run_cannot_be_stopped_from_here(qtbot, ctx, monitor):
    fake = FakeRun(ctx.runs_root() / "cli")
    fake.step(3)
    ctx.select_run(fake.path)
    qtbot.waitUntil(lambda: monitor.status.get("state") == "running")
    assert not monitor.stop_save_button.isEnabled()
    assert "Ctrl-C" in monitor.stop_save_button.toolTip()


def test_compare_runs_overlays_curves_and_diffs_settings(qtbot, ctx, monitor):
    a = FakeRun(ctx.runs_root() / "lr-5e-3")
    a.step(40)
    b = FakeRun(ctx.runs_root() / "lr-1e-3",
                config=fake_config(train={"lr": 0.001, "lora_rank": 16}, epochs=3,
                                   norms_every=5))
    b.step(10)
    b.eval()                                            # overlaid too: validation at step 10
    b.step(15)
    ctx.select_run(a.path)
    qtbot.waitUntil(lambda: monitor.compare.compare_list.count() == 2)
    items = {monitor.compare.compare_list.item(i).text(): monitor.compare.compare_list.item(i)
             for i in range(monitor.compare.compare_list.count())}
    assert items["lr-5e-3"].isHidden()                   # the followed run is always shown
    assert monitor.compare.diff_table.isHidden() and "Tick runs" in monitor.compare.diff_hint.text()
    items["lr-1e-3"].setCheckState(Qt.Checked)
    assert list(monitor.compare.compare_curves) == [b.path]
    qtbot.waitUntil(lambda: n_points(monitor.compare.compare_curves[b.path]) == 25)
    np.testing.assert_allclose(monitor.compare.compare_curves[b.path].getData()[1],
                               [FakeRun.loss_at(s) for s in range(1, 26)])
    val = monitor.compare.compare_eval_curves[b.path]
    qtbot.waitUntil(lambda: n_points(val) == 1)
    assert val in monitor.loss_plot.getPlotItem().items
    np.testing.assert_allclose(val.getData()[1], [FakeRun.loss_at(10) + 0.1])
    assert monitor.compare.settings_diff() == {"epochs": {"lr-5e-3": 2, "lr-1e-3": 3},
                                               "norms_every": {"lr-5e-3": 10, "lr-1e-3": 5},
                                               "train.lora_rank": {"lr-5e-3": 8, "lr-1e-3": 16},
                                               "train.lr": {"lr-5e-3": 0.005, "lr-1e-3": 0.001}}
    table = monitor.compare.diff_table
    assert table.rowCount() == 4 and table.columnCount() == 3
    # not raw keys, and New run's names (widgets.setting_labels): "Heatmap every", not a
    # second table's "Norms every"
    assert [table.item(r, 0).text() for r in range(4)] == ["Epochs", "Heatmap every",
                                                           "LoRA rank", "Learning rate"]
    assert "train.lora_rank" in table.item(2, 0).toolTip()
    assert table.item(3, 2).text() == "0.001"
    assert not table.isHidden() and monitor.compare.diff_hint.isHidden()
    items["lr-1e-3"].setCheckState(Qt.Unchecked)
    assert monitor.compare.compare_curves == {} and monitor.compare.settings_diff() == {}
    assert val not in monitor.loss_plot.getPlotItem().items
    assert table.rowCount() == 0
    monitor.compare.set_compared(b.path)
    assert items["lr-1e-3"].checkState() == Qt.Checked
    ctx.select_run(b.path)                      # the compared run becomes the followed one
    assert monitor.compare.compare_curves == {}
    assert items["lr-1e-3"].isHidden() and items["lr-1e-3"].checkState() == Qt.Unchecked
    assert not items["lr-5e-3"].isHidden()


def test_the_best_step_is_marked_on_the_loss_curve(qtbot, ctx, monitor):
    fake = FakeRun(ctx.runs_root() / "marked", total_steps=60)
    fake.step(20)
    fake.eval()                                           # best at step 20
    fake.step(20)
    fake._append({"type": "eval", "step": 40, "loss": 9.0, "accuracy": 0.1,
                  "perplexity": 9.0, "best": False})       # worse: the mark stays at 20
    ctx.select_run(fake.path)
    qtbot.waitUntil(lambda: monitor.best is not None and n_points(monitor.val_curve) == 2,
                    timeout=10_000)
    line = monitor.best_mark.line
    assert line.isVisible() and line.value() == 20
    assert line in monitor.loss_plot.getPlotItem().items
    assert "best: step 20 (validation" in monitor.loss_plot.getPlotItem().titleLabel.text
    assert "best at step 20" in monitor.stats_label.text()
