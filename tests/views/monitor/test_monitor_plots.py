"""Monitor's plots read well (issue 29, item 11): axis titles with units, whole-number step
ticks on a short run, a loss axis that stays at 0 or above when the losses do, the best mark's
text where it cannot cover a curve; and the screen fits 1280x720 with a GRPO run (its reward
plots and legend inside the visible area)."""

from __future__ import annotations

import pyqtgraph as pg
import pytest
from PySide6.QtCore import QPoint, QRect

from app.views.main_window import MainWindow
from app.views.monitor.view import MonitorView
from tests.views.conftest import shown
from tests.views.fake_runs import FakeGrpoRun, FakeRun


def n_points(curve) -> int:
    return 0 if curve.xData is None else len(curve.xData)


@pytest.fixture
def monitor(ctx, qtbot):
    return shown(qtbot, MonitorView(ctx), 1200, 760)


def axis_label(plot, axis: str) -> str:
    return plot.getPlotItem().getAxis(axis).labelText


def test_every_plot_has_axis_titles_with_units(monitor):
    g = monitor.grpo
    expected = {monitor.loss_plot: "loss (nats/token)", monitor.tps_plot: "tokens/s",
                monitor.lr_plot: "lr", g.reward_plot: "reward", g.length_plot: "tokens"}
    for plot, label in expected.items():
        assert axis_label(plot, "left") == label
    for plot in monitor.findChildren(pg.PlotWidget):
        assert axis_label(plot, "bottom") == "step" and axis_label(plot, "left")


def test_a_short_run_has_whole_step_ticks(qtbot, ctx, monitor):
    fake = FakeRun(ctx.runs_root() / "short", total_steps=5)
    fake.step(5)
    ctx.select_run(fake.path)
    qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 5)
    monitor.redraw.flush()
    width = monitor.loss_plot.getPlotItem().getViewBox().width()
    assert any(v % 1 for _, vs in pg.AxisItem("bottom").tickValues(0, 5, width)
               for v in vs)                                    # pyqtgraph's own: 0.5 steps
    for plot in monitor.plots.values():                    # the supervised run's plots
        axis = plot.getPlotItem().getAxis("bottom")
        lo, hi = plot.getViewBox().viewRange()[0]
        assert (lo, hi) == (0.0, 5.0)
        values = [v for _, vs in axis.tickValues(lo, hi, axis.width()) for v in vs]
        assert values and all(v == int(v) for v in values)


def test_the_loss_axis_does_not_go_below_zero(qtbot, ctx, monitor):
    fake = FakeRun(ctx.runs_root() / "long", total_steps=200)
    fake.step(200)                                  # 3.43 down to 0.52: room below is 0.7
    ctx.select_run(fake.path)
    qtbot.waitUntil(lambda: n_points(monitor.loss_curve) == 200)
    monitor.redraw.flush()
    bottom, top = monitor.loss_plot.getViewBox().viewRange()[1]
    assert 0.0 <= bottom <= FakeRun.loss_at(200) and FakeRun.loss_at(1) <= top
    for plot in (monitor.lr_plot, monitor.grad_plot, monitor.tps_plot):
        assert plot.getViewBox().viewRange()[1][0] == 0.0


def test_the_best_mark_text_is_above_the_plot_not_over_the_curve(qtbot, ctx, monitor):
    fake = FakeRun(ctx.runs_root() / "best", total_steps=40)
    fake.step(20)
    fake.eval()
    fake.step(20)
    ctx.select_run(fake.path)
    qtbot.waitUntil(lambda: monitor.best is not None and n_points(monitor.loss_curve) == 40)
    monitor.redraw.flush()
    qtbot.wait(50)
    item = monitor.loss_plot.getPlotItem()
    assert "best: step 20" in item.titleLabel.text
    texts = [i for i in monitor.loss_plot.scene().items() if isinstance(i, pg.TextItem)]
    assert texts == []                               # no text beside the line, over the curve
    curves = item.getViewBox().sceneBoundingRect()
    assert not item.titleLabel.sceneBoundingRect().intersects(curves)


def inside(widget, window) -> bool:
    """`widget` is shown whole: not clipped by any parent (a scroll area's viewport, a
    splitter's pane), up to the window."""
    parent = widget.parentWidget()
    while widget.isVisible() and parent is not None:
        rect = QRect(widget.mapTo(parent, QPoint(0, 0)), widget.size())
        if not parent.rect().contains(rect):
            return False
        if parent is window:
            return True
        parent = parent.parentWidget()
    return False


def test_a_grpo_run_fits_1280x720(qtbot, ctx):
    fake = FakeGrpoRun(ctx.runs_root() / "grpo", total_steps=20)
    fake.step(12)
    fake.eval(0.4)
    win = MainWindow(ctx, discover=lambda: [])
    qtbot.addWidget(win)
    win.resize(1280, 720)
    win.show()
    win.show_screen("monitor")
    monitor = win.screen("monitor")
    ctx.select_run(fake.path)
    qtbot.waitUntil(lambda: n_points(monitor.grpo.reward_curve) == 12)
    g = monitor.grpo
    plots = (g.reward_plot, g.functions_plot, g.fractions_plot, g.length_plot)
    qtbot.waitUntil(lambda: all(p.isVisible() for p in plots))          # PacedReveal
    monitor.redraw.flush()
    assert win.width() <= 1280 and win.height() <= 720
    hint = monitor.minimumSizeHint()
    assert hint.width() <= monitor.width() and hint.height() <= monitor.height(), hint
    for plot in plots:
        title = plot.getPlotItem().titleLabel
        assert inside(plot, win), title.text
        assert plot.height() >= 120
        # the title, which is the legend of the small plots, is not cut off
        assert title.item.boundingRect().width() <= plot.width(), title.text
    assert g.reward_plot.height() >= 200
    legend = g.reward_plot.getPlotItem().legend
    view = g.reward_plot.getPlotItem().getViewBox().sceneBoundingRect()
    assert legend.isVisible() and view.contains(legend.sceneBoundingRect())
    for button in (monitor.continue_button, monitor.stop_save_button,
                   monitor.stop_discard_button):
        assert inside(button, win)

