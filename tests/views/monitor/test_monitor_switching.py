"""Monitor in one window across runs and kinds (issue 29, item 1): a supervised run, another
ticked under "Compare with", a GRPO run, back to the supervised run. After each switch nothing
of the previous run remains (plot items, best marks, progress, statistics, log, settings
table) and no exception is raised in a slot (`qtbot.captureExceptions`: pytest-qt would only
fail the test at its end)."""

from __future__ import annotations

import pyqtgraph as pg
import pytest
from PySide6.QtCore import Qt

from app.engine.api import GRPO, SFT
from app.views.monitor.view import MonitorView
from tests.views.conftest import shown
from tests.views.fake_runs import FakeGrpoRun, FakeRun, fake_config


def n_points(curve) -> int:
    return 0 if curve.xData is None else len(curve.xData)


def plot_items(monitor) -> dict:
    """{plot: the set of its items} for every plot of the screen."""
    return {plot: set(plot.getPlotItem().items) for plot in monitor.findChildren(pg.PlotWidget)}


def stray_curves(monitor) -> list:
    """Curves in a plot's scene that are not inside a plot (drawn over the axes or outside)."""
    return [item for plot in monitor.findChildren(pg.PlotWidget)
            for item in plot.scene().items()
            if isinstance(item, pg.PlotDataItem) and not isinstance(item.getViewBox(), pg.ViewBox)]


def offered(monitor) -> list[str]:
    """The runs "Compare with" offers."""
    runs = monitor.compare.compare_list
    return [runs.item(i).text() for i in range(runs.count()) if not runs.item(i).isHidden()]


@pytest.fixture
def runs(ctx):
    a = FakeRun(ctx.runs_root() / "sft-a", total_steps=30)
    a.log("only in run a")
    for _ in range(3):
        a.step(10)
        a.eval()                                             # the best at step 30
    a.finish()
    b = FakeRun(ctx.runs_root() / "sft-b", total_steps=20, config=fake_config(epochs=3))
    b.log("only in run b")
    b.step(20)
    b.eval()
    b.finish()
    g = FakeGrpoRun(ctx.runs_root() / "grpo", total_steps=20)
    g.step(5)
    g.eval(0.4)                                              # held-out best at step 5
    return a, b, g


def test_cycling_sft_compare_grpo_and_back_leaves_nothing_behind(qtbot, ctx, runs):
    a, b, g = runs
    monitor = shown(qtbot, MonitorView(ctx), 1200, 760)
    own = plot_items(monitor)                          # the screen's own items, no run yet
    loss_title = monitor.loss_plot.getPlotItem().titleLabel
    reward_title = monitor.grpo.reward_plot.getPlotItem().titleLabel

    with qtbot.captureExceptions() as exceptions:
        ctx.select_run(a.path)
        qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 30 and monitor.best is not None
                        and monitor.best.step == 30 and monitor.status.get("state") == "done")
        qtbot.waitUntil(lambda: monitor.compare.compare_list.count() == 3)
    assert exceptions == []
    assert "best: step 30" in loss_title.text and monitor.best_mark.line.isVisible()
    assert "only in run a" in monitor.log_view.toPlainText()
    assert offered(monitor) == ["sft-b"]                  # not the GRPO run

    # compare: tick run b
    item = next(monitor.compare.compare_list.item(i)
                for i in range(monitor.compare.compare_list.count())
                if monitor.compare.compare_list.item(i).text() == "sft-b")
    with qtbot.captureExceptions() as exceptions:
        item.setCheckState(Qt.Checked)
        curve = monitor.compare.compare_curves[b.path]
        qtbot.waitUntil(lambda: n_points(curve) == 20)
        monitor.redraw.flush()
    assert exceptions == []
    assert curve in monitor.loss_plot.getPlotItem().items
    assert monitor.compare.settings_diff()                   # epochs 2 vs 3

    # the GRPO run
    with qtbot.captureExceptions() as exceptions:
        ctx.select_run(g.path)
        assert monitor.title.text() == "grpo" and monitor.kind.name == "grpo"
        assert n_points(monitor.loss_curve) == 0 and monitor.log_view.toPlainText() == ""
        assert monitor.best is None and monitor.stats_label.text() == ""
        qtbot.waitUntil(lambda: n_points(monitor.grpo.reward_curve) == 5
                        and monitor.best is not None
                        and "step 5 of 20" in monitor.progress.text())
        qtbot.wait(300)                                      # a late read of run a would land
        monitor.redraw.flush()
    assert exceptions == []
    assert monitor.compare.compare_curves == {} and monitor.compare.settings_diff() == {}
    assert item.checkState() == Qt.Unchecked and monitor.compare.diff_table.isHidden()
    assert offered(monitor) == [] and monitor.compare.compare_hint.isVisibleTo(monitor)
    functions = monitor.grpo.functions_plot                  # the run's reward functions
    assert set(monitor.grpo.function_curves) == {"exact", "format"}
    assert plot_items(monitor) == {**own, functions: set(monitor.grpo.function_curves.values())}
    assert stray_curves(monitor) == []
    assert n_points(monitor.loss_curve) == 5 and n_points(monitor.val_curve) == 0
    assert not monitor.best_marks[SFT].line.isVisible()
    assert "best" not in loss_title.text
    assert "best: step 5 (held-out reward 0.40)" in reward_title.text
    assert monitor.best_mark.line.value() == 5 and monitor.best_mark.line.isVisible()
    log = monitor.log_view.toPlainText()
    assert "only in run" not in log and "2 prompts x 4 completions" in log
    assert "reward" in monitor.stats_label.text()
    assert "validation" not in monitor.stats_label.text()
    assert monitor.progress.maximum() == 20

    # back to the supervised run
    with qtbot.captureExceptions() as exceptions:
        ctx.select_run(a.path)
        assert n_points(monitor.grpo.reward_curve) == 0
        assert monitor.completions.step_box.count() == 0
        qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 30 and monitor.best is not None
                        and monitor.progress.text().startswith("done"))
        qtbot.wait(300)
        monitor.redraw.flush()
    assert exceptions == []
    assert plot_items(monitor) == own and stray_curves(monitor) == []
    assert n_points(monitor.grpo.reward_curve) == 0
    assert "best" not in reward_title.text and not monitor.best_marks[GRPO].line.isVisible()
    assert "best: step 30" in loss_title.text and monitor.best_mark.line.value() == 30
    log = monitor.log_view.toPlainText()
    assert "only in run a" in log and "prompts x" not in log
    assert "reward" not in monitor.stats_label.text()
    assert monitor.progress.maximum() == 30 and item.checkState() == Qt.Unchecked
    assert offered(monitor) == ["sft-b"]                  # runs of the followed run's kind

