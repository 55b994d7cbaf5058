"""Monitor on GRPO runs: reward curves and the sampled completions table, from a metrics.jsonl
with grpo events (tests/views/fake_runs.FakeGrpoRun). QT_QPA_PLATFORM=offscreen (conftest)."""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import Qt

from app.views.monitor.completions import CompletionsView, elide
from app.views.monitor.view import MonitorView
from tests.views.conftest import shown
from tests.views.fake_runs import FakeGrpoRun, FakeRun


@pytest.fixture
def monitor(ctx, qtbot):
    view = shown(qtbot, MonitorView(ctx), 1200, 760)
    view.set_smoothing(0)
    return view


def n_points(curve) -> int:
    return 0 if curve.xData is None else len(curve.xData)


def test_reward_curves_fill_from_grpo_events(qtbot, ctx, monitor):
    fake = FakeGrpoRun(ctx.runs_root() / "grpo", total_steps=20)
    fake.eval(0.1)
    fake.step(10)
    fake.eval(0.6)
    ctx.select_run(fake.path)
    assert monitor.kind.name == "grpo"
    tabs = monitor.pages
    assert [tabs.tabText(i) for i in range(3) if tabs.isTabVisible(i)] == [
        "Rewards", "Completions", "Loss and optimiser"]
    assert tabs.currentWidget() is monitor.grpo and tabs.tabBar().isVisible()
    g = monitor.grpo
    qtbot.waitUntil(lambda: n_points(g.reward_curve) == 10)
    monitor.redraw.flush()
    steps = np.arange(1, 11)
    r = np.array([FakeGrpoRun.reward_at(s) for s in steps])
    mean, std = r + 0.5 * (1 - r), 0.1 * steps
    x, y = g.reward_curve.getData()
    np.testing.assert_array_equal(x, steps)
    np.testing.assert_allclose(y, mean)
    np.testing.assert_allclose(g.reward_smooth_curve.getData()[1], mean)    # smoothing 0
    np.testing.assert_allclose(g.reward_band.lower.getData()[1], mean - std)
    np.testing.assert_allclose(g.reward_band.upper.getData()[1], mean + std)
    ex, ey = g.eval_reward_curve.getData()
    np.testing.assert_array_equal(ex, [0, 10])
    np.testing.assert_allclose(ey, [0.1, 0.6])
    assert set(g.function_curves) == {"exact", "format"}
    np.testing.assert_allclose(g.function_curves["exact"].getData()[1], r)
    np.testing.assert_allclose(g.function_curves["format"].getData()[1], 1 - r)
    np.testing.assert_allclose(g.zero_spread_curve.getData()[1], [0.5, 0] * 5)
    np.testing.assert_allclose(g.clipped_curve.getData()[1], [0.25] * 10)
    np.testing.assert_allclose(g.length_curve.getData()[1], 3.0 + steps)
    np.testing.assert_allclose(g.length_band.upper.getData()[1], 5 + steps)
    assert g.reward_plot.getViewBox().viewRange()[0] == [0.0, 20.0]     # the whole run
    # the loss page still follows the same events
    np.testing.assert_allclose(monitor.loss_curve.getData()[1], -0.01 * steps)
    assert n_points(monitor.val_curve) == 0                    # GRPO evals have no loss
    text = monitor.stats_label.text()
    assert f"reward {mean[-1]:.3f} \u00b1 {std[-1]:.3f}" in text and "held-out 0.600" in text
    assert "zero spread 0%" in text and "length 13.0" in text
    assert "step 10 of 20 (50%)" in monitor.progress.text()
    qtbot.waitUntil(lambda: "2 prompts x 4 completions" in monitor.log_view.toPlainText())

    fake.step(5)                                               # live: more steps arrive
    qtbot.waitUntil(lambda: n_points(g.reward_curve) == 15)
    monitor.redraw.flush()
    assert n_points(g.function_curves["exact"]) == 15


def test_switching_to_a_supervised_run_hides_the_grpo_pages(qtbot, ctx, monitor):
    grpo = FakeGrpoRun(ctx.runs_root() / "grpo")
    grpo.step(3)
    sft = FakeRun(ctx.runs_root() / "sft")
    sft.step(4)
    ctx.select_run(grpo.path)
    qtbot.waitUntil(lambda: n_points(monitor.grpo.reward_curve) == 3)
    ctx.select_run(sft.path)
    assert monitor.kind.name == "sft" and not monitor.pages.tabBar().isVisible()
    assert not monitor.pages.isTabVisible(0) and not monitor.pages.isTabVisible(1)
    assert n_points(monitor.grpo.reward_curve) == 0
    qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 4)


def test_comparing_grpo_runs_overlays_their_reward(qtbot, ctx, monitor):
    a, b = FakeGrpoRun(ctx.runs_root() / "a"), FakeGrpoRun(ctx.runs_root() / "b")
    a.step(4)
    b.step(6)
    ctx.select_run(a.path)
    monitor.compare.set_compared(b.path)
    curve = monitor.compare.compare_curves[b.path]
    assert curve in monitor.grpo.reward_plot.getPlotItem().items
    qtbot.waitUntil(lambda: n_points(curve) == 6)
    r = np.array([FakeGrpoRun.reward_at(s) for s in range(1, 7)])
    np.testing.assert_allclose(curve.getData()[1], r + 0.5 * (1 - r))


def test_completions_table_shows_the_samples_event(qtbot, ctx, monitor):
    fake = FakeGrpoRun(ctx.runs_root() / "grpo", group_size=3)
    fake.eval(0.0)                                  # step 0: greedy held-out examples
    fake.step(5)
    first = fake.samples()
    fake.step(5)
    items = fake.samples()
    ctx.select_run(fake.path)
    view = monitor.completions
    qtbot.waitUntil(lambda: view.step_box.count() == 3)
    assert [view.step_box.itemText(i) for i in range(3)] == [
        "step 10 \u00b7 sampled (6)", "step 5 \u00b7 sampled (6)",
        "step 0 \u00b7 held-out, greedy (2)"]                  # the newest first
    t = view.table
    header = [t.horizontalHeaderItem(c).text() for c in range(t.columnCount())]
    assert header == ["step", "prompt", "answer", "completion", "reward", "exact", "format",
                      "advantage", "length", "finished"]
    rows = view.rows()
    assert len(rows) == len(items) == 6
    for row, it in zip(rows, items):
        assert row == ["10", it["prompt"], it["answer"], elide(it["completion"]),
                       f"{it['reward']:.2f}", f"{it['rewards']['exact']:.2f}", "0.00",
                       f"{it['advantage']:+.2f}", str(it["length"]),
                       "yes" if it["finished"] else "no (clipped)"]
    long = t.item(1, 3)                             # elided, the whole text in the tooltip
    assert long.text().endswith("\u2026") and long.toolTip() == items[1]["completion"]
    assert t.item(1, 4).background().color().name() == "#e3f4e8"   # positive advantage
    assert t.item(0, 4).background().color().name() == "#fbe7e5"   # negative advantage
    t.selectRow(1)
    detail = view.detail.toPlainText()
    assert items[1]["completion"] in detail and "Reference answer: 1" in detail
    assert "advantage +1.000" in detail

    view.step_box.setCurrentIndex(2)                # an older entry: the held-out examples
    view.step_box.activated.emit(2)
    assert not view.follow_box.isChecked()
    assert [r[0] for r in view.rows()] == ["0", "0"] and view.rows()[0][7] == "\u2014"
    t.selectRow(1)
    fake.samples()                                  # not following: the choice stays
    qtbot.waitUntil(lambda: view.step_box.count() == 4)
    assert view.current_entry()[0] == 0 and t.currentRow() == 1    # and the row read
    view.follow_box.setChecked(True)
    assert view.step_box.currentIndex() == 0 and view.rows()[0][0] == "10"
    assert first[0]["prompt"] in [r[1] for r in view.rows()]


def test_completions_view_alone(qtbot):
    view = CompletionsView()
    qtbot.addWidget(view)
    assert view.hint.isVisibleTo(view) and view.table.rowCount() == 0
    item = {"prompt": "p\nq", "completion": "x" * 200, "reward": 0.5, "rewards": {"r": 0.5},
            "advantage": None, "length": 64, "finished": False}
    view.add_events([{"type": "step"}, {"type": "samples", "step": 3, "items": [item]}])
    assert view.rows() == [["3", "p \u21b5 q", "", elide("x" * 200), "0.50", "0.50",
                            "\u2014", "64", "no (clipped)"]]
    assert not view.hint.isVisibleTo(view)
    assert view.table.item(0, 0).textAlignment() != int(Qt.AlignRight | Qt.AlignVCenter)
