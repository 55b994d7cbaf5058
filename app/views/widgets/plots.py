"""Plot helpers shared by the Monitor's panels: layouts, small plots, bands, and the view ranges
that follow a run.

`small_plot` plots a metric over steps: axis titles with the unit, whole-number step ticks
(`StepAxis`). `BestMark` marks the best evaluation's step, its text in the plot's title.

`RunRanges` keeps every plot of a run showing the whole run (step 0 to its total) until the
user zooms or pans one of them; values are refit only when they outgrow the view (or fill less
than half of it), and never reach below 0 when the values do not. A range that changed on
every update would make pyqtgraph re-lay out the axes and paint each plot twice (5-20 ms).

`PacedReveal` shows a screen's plots one at a time when the screen appears (Qt would lay out and
paint them all in one pass).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QObject, Qt, QTimer
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QWidget

from app.views.widgets import theme

# The plots' colours, named by their light theme's value (widgets/theme.py): a plot follows the
# theme (`themed`), which moves every colour of one palette to the same name's in the other.
ACCENT = theme.LIGHT["accent"]
ORANGE = theme.LIGHT["orange"]
GREEN = theme.LIGHT["good"]
RAW = theme.LIGHT["raw_curve"]               # a raw, noisy curve under its smoothed one
# a plot's legend: on a card, so a band or curve under it does not hide its text
LEGEND = {"labelTextColor": theme.LIGHT["legend_text"], "brush": theme.LIGHT["legend_bg"]}
PALETTE = tuple(theme.LIGHT[name] for name in theme.CURVES)


def num(ev: dict, key: str) -> float:
    """`ev[key]` as a float; NaN when missing, null or not a number."""
    v = ev.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else np.nan


def box(kind, *items, widget: bool = False):
    """A layout of `items`: widgets, layouts, (item, stretch), an int (spacing), None
    (stretch); with `widget`, a margin-less QWidget holding it."""
    layout = kind()
    for item in items:
        item, stretch = item if isinstance(item, tuple) else (item, 0)
        if item is None:
            layout.addStretch(1)
        elif isinstance(item, int):
            layout.addSpacing(item)
        elif isinstance(item, QWidget):
            layout.addWidget(item, stretch)
        else:
            layout.addLayout(item, stretch)
    if not widget:
        return layout
    holder = QWidget()
    layout.setContentsMargins(0, 0, 0, 0)
    holder.setLayout(layout)
    return holder


class StepAxis(pg.AxisItem):
    """A step axis: ticks only on whole steps (a 5-step run showed 0.5, 1.5, ...)."""

    def tickSpacing(self, minVal, maxVal, size):
        levels = [(spacing, offset) for spacing, offset in
                  super().tickSpacing(minVal, maxVal, size) if spacing >= 1]
        return levels or [(1.0, 0.0)]


# ---------------------------------------------------------------- the theme
def tint(color) -> QColor:
    """`color` (a colour of either palette: str, tuple or QColor) in the current theme."""
    c = pg.mkColor(color)
    name = c.name(QColor.HexArgb)                    # #aarrggbb
    moved = QColor(theme.translate(f"#{name[3:]}"))
    moved.setAlpha(c.alpha())
    return moved


def pen(color, **kwargs):
    """`pg.mkPen(color, ...)` in the current theme."""
    return pg.mkPen(tint(color), **kwargs)


def _moved_pen(value):
    if value is None:
        return None
    p = pg.mkPen(value)
    if p.style() == Qt.NoPen:
        return p
    p.setColor(tint(p.color()))
    return p


def _moved_brush(value):
    if value is None:
        return None
    if isinstance(value, list) or (isinstance(value, tuple) and value
                                   and not isinstance(value[0], (int, float))):
        return [_moved_brush(v) for v in value]        # one per bar
    b = pg.mkBrush(value)
    b.setColor(tint(b.color()))
    return b


def restyle_plot(plot: pg.PlotWidget) -> None:
    """Put `plot` and everything drawn in it in the current theme: its background, titles,
    axes, legend, curves, fills, bars, error bars and lines (a colour of either palette moves to
    the current one; others stay)."""
    plot.setBackground(theme.color("plot_bg"))
    for item in plot.scene().items():
        if isinstance(item, pg.AxisItem):
            item.setPen(theme.color("axis"))
            item.setTextPen(theme.color("axis_text"))
            if item.labelText:
                style = {**item.labelStyle, "color": theme.color("axis_text")}
                item.setLabel(item.labelText, item.labelUnits or None, **style)
        elif isinstance(item, pg.LabelItem):
            color = item.opts.get("color")          # the other options are kept
            opts = {"color": tint(color).name()} if color is not None else {}
            item.setText(theme.translate(item.text), **opts)
        elif isinstance(item, pg.LegendItem):
            item.setBrush(tint(item.opts["brush"].color()) if item.opts.get("brush") is not None
                          else None)
            if item.opts.get("labelTextColor") is not None:
                item.setLabelTextColor(tint(item.opts["labelTextColor"]))
        elif isinstance(item, pg.PlotDataItem):
            o = item.opts
            item.setPen(_moved_pen(o.get("pen")))
            if o.get("fillBrush") is not None:
                item.setFillBrush(_moved_brush(o["fillBrush"]))
            if o.get("symbol") is not None:
                item.setSymbolBrush(_moved_brush(o.get("symbolBrush")))
                item.setSymbolPen(_moved_pen(o.get("symbolPen")))
        elif isinstance(item, pg.FillBetweenItem):
            item.setBrush(_moved_brush(item.brush()))
        elif isinstance(item, pg.InfiniteLine):
            item.setPen(_moved_pen(item.pen))
            label = getattr(item, "label", None)          # only a labelled line has one
            if label is not None:
                label.setColor(tint(label.color))
        elif isinstance(item, pg.ErrorBarItem):
            item.setData(pen=_moved_pen(item.opts.get("pen")))
        elif isinstance(item, pg.BarGraphItem):
            o = item.opts
            if o.get("brushes") is not None:
                item.setOpts(brushes=_moved_brush(list(o["brushes"])))
            elif o.get("brush") is not None:
                item.setOpts(brush=_moved_brush(o["brush"]))


def themed(plot: pg.PlotWidget) -> pg.PlotWidget:
    """`plot` follows the theme: its background now, all of it at every switch, and in a dark
    theme all of it once its screen is built (the curves, legend and titles the screen adds
    in light colours after this call; at the next pass of the event loop). An event filter
    that restyled at the first Show crashed Qt when a plot was deleted."""
    plot.setBackground(theme.color("plot_bg"))
    theme.follow(plot, restyle_plot, now=False)
    if theme.is_dark():
        QTimer.singleShot(0, plot, lambda: restyle_plot(plot))
    return plot


def plot_widget(**kwargs) -> pg.PlotWidget:
    """A pg.PlotWidget that follows the theme."""
    return themed(pg.PlotWidget(**kwargs))


def small_plot(title: str, y_label: str, grid: bool = False) -> pg.PlotWidget:
    """A plot of a run's metric over its steps: `title` above, "step" under the x axis and
    `y_label` (the value and its unit) beside the y axis."""
    plot = plot_widget(axisItems={"bottom": StepAxis("bottom")})
    plot.setTitle(title, color=theme.color("plot_title"), size="9pt")
    item = plot.getPlotItem()
    item.layout.removeItem(item.titleLabel)       # the title over the whole width, axis too:
    item.layout.addItem(item.titleLabel, 0, 0, 1, 3)  # one with keys was cut at 1280 px
    plot.showGrid(x=grid, y=grid, alpha=0.12)       # grid lines cost ~3 ms a paint
    plot.setMinimumHeight(100)                 # two rows and a headline plot fit 720 px
    plot.getAxis("left").setWidth(60)          # fixed: a changing label width would relayout
    item = plot.getPlotItem()
    item.setDownsampling(auto=True, mode="peak")
    item.setClipToView(True)
    for axis, label in (("left", y_label), ("bottom", "step")):
        item.getAxis(axis).setTextPen(theme.color("axis_text"))
        item.getAxis(axis).setPen(theme.color("axis"))
        item.setLabel(axis, label, color=theme.color("axis_text"), **{"font-size": "8pt"})
        item.getAxis(axis).enableAutoSIPrefix(False)   # "(x0.001)" cut the label off
    return plot


def title_with_keys(plot: pg.PlotWidget, title: str, keys: list[tuple[str, str]],
                    mark: str = "\u25ac") -> None:
    """A plot title that is its own legend: `title` then each (name, colour) in its colour,
    after `mark` (a line's sample)."""
    names = " ".join(f'<span style="color:{tint(color).name()}">{mark} {name}</span>'
                     for name, color in keys)
    plot.setTitle(f"{title} {names}", color=theme.color("plot_title"), size="9pt")


def filled_curve(plot: pg.PlotWidget, color: str = ACCENT) -> pg.PlotDataItem:
    """A line filled down to 0 (the fill keeps 0 in view)."""
    c = tint(color)
    return plot.plot(pen=pg.mkPen(c, width=1.5), connect="finite", fillLevel=0,
                     brush=(c.red(), c.green(), c.blue(), 40))


class Band:
    """A shaded band between two curves (mean +- std, min .. max) on `plot`."""

    def __init__(self, plot: pg.PlotWidget, color: str, alpha: int = 45,
                 name: str | None = None):
        c = tint(color)
        rgba = (c.red(), c.green(), c.blue(), alpha)
        edge = pg.mkPen((0, 0, 0, 0))          # invisible; pen=None would build no path to fill
        self.upper = pg.PlotDataItem(pen=edge, connect="finite")
        self.lower = pg.PlotDataItem(pen=edge, connect="finite")
        self.fill = pg.FillBetweenItem(self.upper, self.lower, brush=rgba)
        for item in (self.upper, self.lower, self.fill):
            plot.addItem(item)
        legend = plot.getPlotItem().legend
        if name and legend is not None:       # the legend draws a wide line for the band
            legend.addItem(pg.PlotDataItem(pen=pg.mkPen(rgba, width=10)), name)

    def set_data(self, x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        self.lower.setData(x, lo)
        self.upper.setData(x, hi)


class BestMark:
    """The best evaluation's step on `plot`: a dashed vertical line, and its text in the plot's
    title after `title` (a label beside the line sat on the train curve; the title never
    covers a curve). `set(step, text)` moves it there, `clear()` hides it."""

    def __init__(self, plot: pg.PlotWidget, title: str):
        self.plot, self.title, self.text = plot, title, ""
        self.line = pg.InfiniteLine(angle=90, pen=pen(GREEN, width=1.5, style=Qt.DashLine))
        self.line.hide()
        plot.getPlotItem().addItem(self.line, ignoreBounds=True)

    def set(self, step: float, text: str) -> None:
        self.text = f"best: {text}"
        self.line.setValue(step)
        self.line.show()
        title_with_keys(self.plot, self.title, [(self.text, GREEN)], mark="\u00a6")

    def clear(self) -> None:
        self.text = ""
        self.line.hide()
        title_with_keys(self.plot, self.title, [])


class RunRanges:
    """The view ranges of a run's plots (see the module docstring). `x_max()` gives the last
    step to show; `watch(plot, y=(lo, hi))` registers a plot (with a fixed value range)."""

    def __init__(self, x_max: Callable[[], float]):
        self.x_max = x_max
        self.follow = True                  # False once the user zooms or pans
        self._plots: dict[pg.PlotWidget, tuple | None] = {}
        self._refit: set = set()            # plots whose value range is set afresh

    def watch(self, plot: pg.PlotWidget, y: tuple[float, float] | None = None) -> None:
        self._plots[plot] = y
        plot.getPlotItem().enableAutoRange(False)
        if y is not None:
            plot.setYRange(*y, padding=0.02)
        plot.getViewBox().sigRangeChangedManually.connect(self._on_user_zoom)

    def _on_user_zoom(self, *_) -> None:
        self.follow = False

    def refit(self, *plots: pg.PlotWidget) -> None:
        """Set the value range of `plots` (default: all) afresh at their next fit."""
        self._refit.update(plots or self._plots)

    def reset(self) -> None:
        """Back to the whole run: steps 0 .. total, values refit."""
        self.follow = True
        for plot, y in self._plots.items():
            if y is not None:
                plot.setYRange(*y, padding=0.02)
        self.refit()

    def fit(self, plot: pg.PlotWidget, ys: list, log: bool = False,
            from_zero: bool = False) -> None:
        """Fit `plot` to steps 0 .. x_max() and to the values `ys` (a list of arrays; plots
        with a fixed value range ignore them), with hysteresis."""
        if not self.follow:
            return
        vb = plot.getViewBox()
        x_max = self.x_max()
        if x_max > 0 and vb.viewRange()[0] != [0.0, x_max]:
            vb.setXRange(0, x_max, padding=0)
        if self._plots.get(plot) is not None:
            return
        y = np.concatenate([np.asarray(v, float) for v in ys]) if ys else np.empty(0)
        y = y[np.isfinite(y) & (y > 0)] if log else y[np.isfinite(y)]
        if not y.size:
            return
        y = np.log10(y) if log else y
        lo, hi = (min(0.0, float(y.min())) if from_zero else float(y.min())), float(y.max())
        span = (hi - lo) or abs(hi) * 0.2 or 1.0
        bottom, top = vb.viewRange()[1]
        if plot in self._refit or lo < bottom or hi > top or (hi - lo) < 0.4 * (top - bottom):
            self._refit.discard(plot)
            below = 0.0 if from_zero else 0.25 * span    # room to fall: fewer refits
            bottom = lo - below if log or lo < 0 else max(0.0, lo - below)   # not below 0
            vb.setYRange(bottom, hi + 0.08 * span, padding=0)


class PacedReveal(QObject):
    """Shows a screen's plots one at a time when the screen appears: Qt lays out and paints
    every widget of a newly shown screen in one pass, and the first layout and paint of a
    pyqtgraph plot cost 5-15 ms (its axes), so Monitor's five plots blocked the window for
    25-35 ms at once, several times that on a busy machine. `hide(screen)`, while the screen is
    hidden, hides the plots it would show (their place in the layout is kept); `start(screen)`,
    from its showEvent, shows them again in order, one per tick. For screens that do not hide
    plots themselves."""

    def __init__(self, parent: QObject | None = None, interval_ms: int = 15):
        super().__init__(parent)
        self._hidden: list[QWidget] = []
        self.timer = QTimer(self, interval=interval_ms)
        self.timer.timeout.connect(self._next)

    def hide(self, screen: QWidget) -> None:
        self.timer.stop()
        for plot in screen.findChildren(pg.PlotWidget):
            if plot.isVisibleTo(screen):
                policy = plot.sizePolicy()
                policy.setRetainSizeWhenHidden(True)
                plot.setSizePolicy(policy)
                plot.hide()
                self._hidden.append(plot)

    def start(self, screen: QWidget) -> None:
        self.hide(screen)                   # any shown while the screen was hidden
        if self._hidden:
            self.timer.start()

    def _next(self) -> None:
        if self._hidden:
            self._hidden.pop(0).show()
        if not self._hidden:
            self.timer.stop()
