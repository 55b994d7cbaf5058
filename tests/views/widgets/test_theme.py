"""The dark theme (issue 29, item 11; widgets/theme.py): forced with WORKBENCH_THEME or the
system's colour scheme, every screen's plots are dark with light text and curves that stand
out; a change of the system's scheme switches the open window live. QT_QPA_PLATFORM=offscreen
(conftest).

Contrast is WCAG's ratio of relative luminances, (L1 + 0.05) / (L2 + 0.05): at least 4.5 for
text (axis ticks and titles), 3 for curves and lines (WCAG's figure for graphics)."""

from __future__ import annotations

import pyqtgraph as pg
import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPalette

from app.views.widgets import theme
from tests.views.test_fits_screen import screen_pages, window_with_runs

TEXT, GRAPHICS = 4.5, 3.0


def luminance(color: QColor) -> float:
    def channel(v: float) -> float:
        return v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4
    return (0.2126 * channel(color.redF()) + 0.7152 * channel(color.greenF())
            + 0.0722 * channel(color.blueF()))


def contrast(a: QColor, b: QColor) -> float:
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def plot_problems(plot: pg.PlotWidget, dark: bool) -> list[str]:
    """What in `plot` does not match the theme (`dark` or light)."""
    name = plot.getPlotItem().titleLabel.text[:30] or type(plot).__name__
    bg = plot.backgroundBrush().color()
    out = []
    if (luminance(bg) < 0.05) != dark:
        return [f"{name}: background {bg.name()}"]
    for item in plot.scene().items():
        if not item.isVisible():
            continue
        if isinstance(item, pg.AxisItem):
            color = item.textPen().color()
            if contrast(color, bg) < TEXT:
                out.append(f"{name}: axis text {color.name()} on {bg.name()}")
        elif isinstance(item, pg.LabelItem) and item.opts.get("color") is not None:
            color = pg.mkColor(item.opts["color"])
            if item.text and contrast(color, bg) < TEXT:
                out.append(f"{name}: text '{item.text[:20]}' {color.name()} on {bg.name()}")
        elif isinstance(item, pg.PlotDataItem) and dark:
            pen = pg.mkPen(item.opts.get("pen"))
            if pen.style() != Qt.NoPen and pen.color().alpha() > 0 and \
                    contrast(pen.color(), bg) < GRAPHICS:
                out.append(f"{name}: curve {pen.color().name()} on {bg.name()}")
        elif isinstance(item, pg.BarGraphItem) and dark:
            for brush in item.opts.get("brushes") or [item.opts.get("brush")]:
                color = pg.mkBrush(brush).color()
                if contrast(color, bg) < GRAPHICS:
                    out.append(f"{name}: bar {color.name()} on {bg.name()}")
        elif isinstance(item, pg.ErrorBarItem) and dark:
            color = pg.mkPen(item.opts.get("pen")).color()
            if contrast(color, bg) < GRAPHICS:
                out.append(f"{name}: error bar {color.name()} on {bg.name()}")
        elif isinstance(item, pg.LegendItem) and item.opts.get("brush") is not None:
            fill = pg.mkBrush(item.opts["brush"]).color()
            if (luminance(fill) < 0.05) != dark:
                out.append(f"{name}: legend {fill.name()}")
    return out


def highlights(panel) -> set[str]:
    """The background colours of the dataset example's highlighted text."""
    colors = set()
    block = panel.example_view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            brush = it.fragment().charFormat().background()
            if brush.style() != Qt.NoBrush:
                colors.add(brush.color().name())
            it += 1
        block = block.next()
    return colors


def theme_problems(qtbot, win, dark: bool) -> dict[str, list[str]]:
    """Every page of every screen: its shown plots and the window's palette."""
    found = {}
    for page in screen_pages(win):
        qtbot.wait(60)                          # Monitor shows its plots one per tick
        problems = [p for plot in win.findChildren(pg.PlotWidget) if plot.isVisible()
                    for p in plot_problems(plot, dark)]
        window = win.palette().color(QPalette.Window)
        if (luminance(window) < 0.05) != dark:
            problems.append(f"window background {window.name()}")
        if problems:
            found[page] = problems
    return found


@pytest.mark.slow
def test_forced_dark_every_screen_and_plot_is_dark(qtbot, ctx, qapp, restore, monkeypatch):
    monkeypatch.setenv(theme.ENV, "dark")
    assert theme.requested_mode() == "dark"
    theme.apply_theme(qapp, mode=theme.requested_mode())
    win, (a, b, g) = window_with_runs(qtbot, ctx)
    ctx.select_run(a.path)                      # loss, validation, best mark, compare list
    qtbot.waitUntil(lambda: win.screen("monitor").best is not None)
    assert theme_problems(qtbot, win, dark=True) == {}
    ctx.select_run(g.path)                      # rewards: bands, legend, function keys
    qtbot.waitUntil(lambda: win.screen("monitor").kind.name == "grpo")
    qtbot.wait(300)
    assert theme_problems(qtbot, win, dark=True) == {}
    # the style sheet and the highlighted dataset text are the dark palette's
    sheet = qapp.styleSheet()
    assert f"background: {theme.DARK['base']}" in sheet
    assert f"background: {theme.LIGHT['base']}" not in sheet
    assert win.new_run.dataset.highlighted_spans()


@pytest.mark.slow
def test_the_window_follows_the_system_scheme_live(qtbot, ctx, qapp, restore):
    hints = qapp.styleHints()
    # the offscreen platform cannot change its scheme (setColorScheme does nothing there):
    # the change is the signal a desktop sends
    hints.colorSchemeChanged.emit(Qt.ColorScheme.Light)
    theme.apply_theme(qapp, mode="system")
    win, (a, b, g) = window_with_runs(qtbot, ctx)
    ctx.select_run(a.path)
    win.show_screen("monitor")
    qtbot.waitUntil(lambda: win.screen("monitor").best is not None)
    qtbot.wait(200)
    monitor = win.screen("monitor")
    assert not theme.is_dark()
    assert [p for plot in monitor.findChildren(pg.PlotWidget)
            for p in plot_problems(plot, dark=False)] == []

    assert highlights(win.new_run.dataset) == {theme.LIGHT["trained_bg"]}

    hints.colorSchemeChanged.emit(Qt.ColorScheme.Dark)      # the system switches
    qtbot.waitUntil(theme.is_dark)
    assert theme_problems(qtbot, win, dark=True) == {}
    assert highlights(win.new_run.dataset) == {theme.DARK["trained_bg"]}
    hints.colorSchemeChanged.emit(Qt.ColorScheme.Light)
    qtbot.waitUntil(lambda: not theme.is_dark())
    assert theme_problems(qtbot, win, dark=False) == {}
    assert highlights(win.new_run.dataset) == {theme.LIGHT["trained_bg"]}


def test_a_forced_theme_ignores_the_system(qapp, restore):
    theme.apply_theme(qapp, mode="light")
    qapp.styleHints().colorSchemeChanged.emit(Qt.ColorScheme.Dark)
    assert not theme.is_dark()
    with pytest.raises(ValueError, match="light, dark, system"):
        theme.apply_theme(qapp, mode="sepia")


def test_palettes_name_the_same_colours_and_translate(qapp, restore, monkeypatch):
    assert set(theme.LIGHT) == set(theme.DARK)
    monkeypatch.setenv(theme.ENV, "sepia")
    assert theme.requested_mode() == "system"
    theme.apply_theme(qapp, mode="dark")
    for name, light in theme.LIGHT.items():    # every name's colour, whichever name shares it
        assert theme.translate(light) == theme.DARK[name], name
        assert theme.translate(light.upper()) == theme.DARK[name], name
    assert theme.translate("#123456") == "#123456"
    text = f'<span style="color:{theme.LIGHT["accent"]}">x</span>'
    assert theme.translate(text) == f'<span style="color:{theme.DARK["accent"]}">x</span>'
    theme.apply_theme(qapp, mode="light")
    for name, dark in theme.DARK.items():      # and back: there and back is where it started
        assert theme.translate(dark) == theme.LIGHT[name], name
    sheet = theme.style_sheet(theme.DARK, font_scale=1.5)
    assert "$" not in sheet and "font-size: 15pt" in sheet and "font-size: 21pt" in sheet


@pytest.mark.slow
def test_view_menu_theme_is_kept_for_the_next_start(qtbot, ctx, qapp, restore, monkeypatch):
    from app.views.main_window import THEME_KEY, MainWindow

    monkeypatch.delenv(theme.ENV, raising=False)
    theme.apply_theme(qapp, mode="light")
    win = MainWindow(ctx, discover=lambda: [])
    qtbot.addWidget(win)
    assert win.theme_actions["light"].isChecked()
    win.theme_actions["dark"].trigger()
    assert theme.is_dark() and ctx.settings.value(THEME_KEY) == "dark"
    assert win.theme_actions["dark"].isChecked() and not win.theme_actions["light"].isChecked()
    theme.apply_theme(qapp, mode="light")           # a new start: the choice comes back
    win.restore_theme()
    assert theme.is_dark() and win.theme_actions["dark"].isChecked()
    monkeypatch.setenv(theme.ENV, "light")          # the environment wins
    win.restore_theme()
    assert not theme.is_dark() and win.theme_actions["light"].isChecked()


def test_evaluate_bars_are_the_themes_palette(qtbot, ctx, qapp, restore):
    """Evaluate's bars (one colour per model) and error bars are the plots' palette in the
    current theme: drawn in the dark one's colours, moved to the light one's at a switch."""
    from app.views.evaluate.view import EvaluateView

    theme.apply_theme(qapp, mode="dark")
    view = EvaluateView(ctx)
    qtbot.addWidget(view)
    models = [f"model{i}" for i in range(len(theme.CURVES) + 1)]     # the palette wraps
    view.show_results([{"model": m, "task": t, "kind": "jsonl", "metric": "acc",
                        "value": 0.25 + 0.05 * i, "stderr": 0.04, "n": 20}
                       for i, m in enumerate(models) for t in ("jsonl:a.jsonl", "mc:b.bin")])

    def colors(kind):
        items = [i for i in view.chart.getPlotItem().items if isinstance(i, kind)]
        if kind is pg.BarGraphItem:
            return [pg.mkBrush(i.opts["brush"]).color().name() for i in items]
        return [pg.mkPen(i.opts["pen"]).color().name() for i in items]

    assert plot_problems(view.chart, dark=True) == []
    dark_bars = colors(pg.BarGraphItem)
    assert len(set(dark_bars)) == len(theme.CURVES)                 # models told apart
    assert set(dark_bars) == {theme.DARK[c] for c in theme.CURVES}
    assert set(dark_bars) <= set(theme.DARK.values())
    assert set(colors(pg.ErrorBarItem)) == {theme.DARK["axis_text"]}
    theme.apply_theme(qapp, mode="light")                           # followed live
    assert set(colors(pg.BarGraphItem)) == {theme.LIGHT[c] for c in theme.CURVES}
    assert set(colors(pg.ErrorBarItem)) == {theme.LIGHT["axis_text"]}
