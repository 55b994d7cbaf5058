"""Every screen of the window fits 1280x720 logical pixels (issue 29, item 4): a 1366x768
laptop, and 1920x1080 at 150% scaling. At 1.5x scaling (QT_SCALE_FACTOR=1.5) Qt scales
everything alike, so 1280x720 logical pixels is the same layout as 1x; what grows widgets
against the window is a bigger font (X11's Xft.dpi 144, a desktop's large-text setting): the
second run of each test scales the application's font and every font size of the style sheet
by 1.5 (`theme.apply_theme(font_scale=1.5)`); one test starts a window with
QT_SCALE_FACTOR=1.5 in a process of its own.

The window is built with runs (a finished supervised run with evaluations, a second one ticked
under Monitor's "Compare with", a GRPO run), resized to 1280x720, shown offscreen; then every
page of the navigation list (screens added later are covered without a change here) and every
tab of a screen's tab widgets is shown in turn and checked (`layout_problems`):

- the window's minimum size fits 1280x720 and the window is not bigger;
- no visible widget reaches outside its visible parent (inside a scroll area's viewport the
  content scrolls: only its width is checked, a field under the vertical scroll bar is cut);
- no two visible interactive siblings overlap;
- no plot's legend or title reaches past the plot's edge;
- every visible button, check box and label is at least as wide as its minimum size hint (its
  text is not cut), but for the labels in ELIDES, which elide on purpose, and every wrapped
  label as high as its text needs at its width.

QT_QPA_PLATFORM=offscreen (conftest)."""

from __future__ import annotations

import pyqtgraph as pg
import pytest
from PySide6.QtCore import QEvent, Qt
from PySide6.QtTest import QTest
from PySide6.QtWidgets import (QAbstractButton, QAbstractItemView, QAbstractScrollArea,
                               QAbstractSlider, QAbstractSpinBox, QApplication, QComboBox,
                               QLabel, QLineEdit, QPlainTextEdit, QScrollBar, QSplitterHandle,
                               QTabBar, QTabWidget, QTextEdit, QWidget)

from app.views.main_window import MainWindow
from app.views.widgets import theme
from app.views.widgets.fit import ElidedLabel
from tests.views.conftest import wait_ready
from tests.hub_server import hub, hub_repos  # noqa: F401  (fixtures: the local Hugging Face Hub)
from tests.views.fake_runs import FakeGrpoRun, FakeRun, fake_config

WIDTH, HEIGHT = 1280, 720
INTERACTIVE = (QAbstractButton, QAbstractSpinBox, QComboBox, QLineEdit, QAbstractSlider,
               QAbstractItemView, QTextEdit, QPlainTextEdit, QTabBar)
# labels whose text is cut on purpose: {class: why}
ELIDES = {
    ElidedLabel: "a path or a run's name on one line, elided in the middle (the whole text in "
                 "its tooltip) so that a long name does not widen its screen",
}


def _name(w: QWidget) -> str:
    text = w.text() if isinstance(w, (QAbstractButton, QLabel, QLineEdit)) else ""
    text = (text or w.objectName() or "")[:40]
    parent = w.parentWidget()
    return f"{type(w).__name__} '{text}' in {type(parent).__name__} '{parent.objectName()}'"


def _in_viewport(w: QWidget) -> QAbstractScrollArea | None:
    """The scroll area whose viewport `w` is directly in (its content), if any."""
    parent = w.parentWidget()
    area = parent.parentWidget() if parent is not None else None
    if isinstance(area, QAbstractScrollArea) and area.viewport() is parent:
        return area
    return None


def _inside_a_control(w: QWidget) -> bool:
    """Parts of a compound control (a spin box's line edit, a scroll area's scroll bars, a tab
    bar's scroll buttons, a table's header...): the control lays them out."""
    parent = w.parentWidget()
    return isinstance(parent, (QAbstractSpinBox, QComboBox, QAbstractScrollArea, QTabBar,
                               QLineEdit)) or isinstance(w, (QScrollBar, QSplitterHandle))


def layout_problems(root: QWidget) -> list[str]:
    """What is cut or overlaps among the widgets of `root` that are visible now."""
    problems = []
    visible = [w for w in root.findChildren(QWidget) if w.isVisible()]
    for w in visible:
        parent = w.parentWidget()
        if parent is None or w.isWindow() or _inside_a_control(w):
            continue
        area = _in_viewport(w)
        geo = w.geometry()
        if area is not None:            # scrolled content: never wider than the viewport
            if w.width() > parent.width() and \
                    area.horizontalScrollBarPolicy() != Qt.ScrollBarAlwaysOff:
                problems.append(f"{_name(w)}: {w.width()} px wide in a {parent.width()} px "
                                f"viewport (under the scroll bar or scrolled sideways)")
        elif not parent.rect().contains(geo) and not geo.isEmpty():
            problems.append(f"{_name(w)}: {geo.getRect()} outside its parent "
                            f"{parent.rect().getRect()}")
        if isinstance(w, (QAbstractButton, QLabel)) and not isinstance(w, tuple(ELIDES)):
            need = w.minimumSizeHint()
            if isinstance(w, QLabel) and w.wordWrap():
                need.setWidth(0)        # wraps: its height grows instead
                if w.hasHeightForWidth() and w.height() < w.heightForWidth(w.width()) - 1:
                    problems.append(f"{_name(w)}: {w.height()} px high, its text needs "
                                    f"{w.heightForWidth(w.width())}")
            if w.width() < need.width():
                problems.append(f"{_name(w)}: {w.width()} px wide < {need.width()} "
                                f"(text cut)")
    for plot in (w for w in visible if isinstance(w, pg.PlotWidget)):
        area = plot.mapToScene(plot.viewport().rect()).boundingRect()
        for item in plot.scene().items():     # a legend or title cut by the plot's edge
            if isinstance(item, (pg.LegendItem, pg.LabelItem)) and item.isVisible() and \
                    item.sceneBoundingRect().width() > 0 and \
                    not area.adjusted(-1, -1, 1, 1).contains(item.sceneBoundingRect()):
                text = getattr(item, "text", "") or "legend"
                problems.append(f"{_name(plot)}: '{text[:30]}' cut by the plot's edge "
                                f"{item.sceneBoundingRect().getRect()} in {area.getRect()}")
    by_parent: dict[QWidget, list[QWidget]] = {}
    for w in visible:
        if isinstance(w, INTERACTIVE) and not _inside_a_control(w) and not w.isWindow():
            by_parent.setdefault(w.parentWidget(), []).append(w)
    for siblings in by_parent.values():
        for i, a in enumerate(siblings):
            for b in siblings[i + 1:]:
                if a.geometry().intersects(b.geometry()):
                    problems.append(f"{_name(a)} overlaps {_name(b)}")
    return problems


def settle() -> None:
    """Let the layouts settle: a label that wraps anew or a row that wraps asks its parents
    again, one pass of the event loop per level."""
    for _ in range(5):
        QTest.qWait(20)


def screen_pages(win: MainWindow, only: str | None = None):
    """Show every screen of the navigation list (or the screen `only`) and, within it, every
    page of its tab widgets (nested ones too); yields a label for each state shown."""
    for row in range(win.nav.count()):
        win.nav.setCurrentRow(row)
        key = win.current_screen_key()
        if only is not None and key != only:
            continue
        screen = win.screen(key)
        settle()
        yield key
        for tabs in screen.findChildren(QTabWidget):
            if not tabs.isVisible():
                continue
            for i in range(tabs.count()):
                if not tabs.isTabVisible(i) or not tabs.isTabEnabled(i):
                    continue
                tabs.setCurrentIndex(i)
                settle()
                yield f"{key} > {tabs.tabText(i)}"
            tabs.setCurrentIndex(0)


def drop_orphans() -> None:
    """Delete the hidden parentless widgets earlier tests' windows left: pyqtgraph makes a
    context menu and an options widget without a parent for every plot, which outlive it. A
    style sheet set after their plot was deleted and then set again crashed Qt in this test
    process (the window never deletes a plot); call it before a test sets a style sheet,
    while no window of its own is open."""
    for widget in QApplication.topLevelWidgets():
        if widget.parent() is None and not widget.isVisible():
            widget.deleteLater()
    QApplication.sendPostedEvents(None, QEvent.DeferredDelete)


@pytest.fixture(params=[1.0, 1.5], ids=["font-1x", "font-1.5x"])
def font_scale(request, qapp):
    """The application's font and the style sheet's font sizes scaled (restored after)."""
    drop_orphans()
    font = qapp.font()
    sheet = qapp.styleSheet()
    theme.apply_theme(qapp, font_scale=request.param)
    yield request.param
    theme.current().font_scale = 1.0           # the next apply_theme at the normal size
    qapp.setFont(font)
    qapp.setStyleSheet(sheet)


def window_with_runs(qtbot, ctx) -> tuple[MainWindow, tuple]:
    """The main window at 1280x720, shown, on three runs: (a) a finished supervised run with
    evaluations, norms and routing, (b) another supervised one, (g) a GRPO run 5 steps in."""
    a = FakeRun(ctx.runs_root() / "2026-11-28-0647-first-supervised-run", total_steps=30)
    for _ in range(3):
        a.step(10)
        a.eval()
        a.norms()
        a.routing()
    a.finish()
    b = FakeRun(ctx.runs_root() / "second-supervised", total_steps=20,
                config=fake_config(epochs=3))
    b.step(20)
    b.eval()
    b.finish()
    g = FakeGrpoRun(ctx.runs_root() / "grpo", total_steps=20)
    g.step(5)
    g.eval(0.4)
    for run in (a, b, g):
        ctx.queue.add(run.path)
    win = MainWindow(ctx, discover=lambda: [])
    qtbot.addWidget(win)
    win.resize(WIDTH, HEIGHT)
    win.show()
    wait_ready(qtbot, win.new_run)
    return win, (a, b, g)


@pytest.fixture
def window(qtbot, ctx, font_scale):
    return window_with_runs(qtbot, ctx)


# screens seen whole at 1280x720, without scrolling (New run's pages scroll within their tab:
# its action bar, Start, stays in sight)
WHOLE = ("new_run", "runs", "monitor", "experts", "playground", "export", "settings")


def page_problems(win: MainWindow) -> list[str]:
    """`layout_problems` of the window, and a screen of WHOLE that scrolls."""
    problems = layout_problems(win)
    screen = win.current_screen()
    viewport = screen.parentWidget()
    if win.current_screen_key() in WHOLE and screen.height() > viewport.height():
        problems.append(f"{screen.height()} px high in {viewport.height()}: it scrolls")
    return problems


def check_every_page(qtbot, win: MainWindow) -> dict[str, list[str]]:
    found = {}
    for page in screen_pages(win):
        if problems := page_problems(win):
            found[page] = problems
    return found


def assert_fits(win: MainWindow) -> None:
    hint, minimum = win.minimumSizeHint(), win.minimumSize()
    assert hint.width() <= WIDTH and hint.height() <= HEIGHT, hint
    assert minimum.width() <= WIDTH and minimum.height() <= HEIGHT, minimum
    assert win.width() <= WIDTH and win.height() <= HEIGHT, win.size()


@pytest.mark.slow
def test_every_screen_fits_1280x720(qtbot, ctx, window):
    win, (a, b, g) = window
    assert_fits(win)
    problems = check_every_page(qtbot, win)

    # New run in GRPO mode with Python file reward rows
    view = win.new_run
    win.show_screen("new_run")
    view.set_run_type("grpo")
    for _ in range(3):
        view.grpo_panel.rewards.add({"kind": "file"})
    for i in range(view.tabs.count()):
        view.tabs.setCurrentIndex(i)
        settle()
        if found := page_problems(win):
            problems[f"new_run (GRPO) > {view.tabs.tabText(i)}"] = found
    row = view.grpo_panel.rewards.rows[-1]
    view.set_run_type("dpo")             # a preference run: the pair panel, DPO's fields
    qtbot.waitUntil(lambda: view.dataset.pair_report is not None
                    and not view.dataset.is_busy(), timeout=15_000)
    for i in range(view.tabs.count()):
        view.tabs.setCurrentIndex(i)
        settle()
        if found := page_problems(win):
            problems[f"new_run (DPO) > {view.tabs.tabText(i)}"] = found
    view.set_run_type("sft")

    # Monitor: a supervised run compared with another, then the GRPO run
    monitor = win.screen("monitor")
    ctx.select_run(a.path)
    qtbot.waitUntil(lambda: monitor.compare.compare_list.count() >= 2)
    compare = monitor.compare.compare_list
    for i in range(compare.count()):
        if compare.item(i).text() == "second-supervised":
            compare.item(i).setCheckState(Qt.Checked)
    qtbot.waitUntil(lambda: b.path in monitor.compare.compare_curves)
    win.show_screen("monitor")
    for page in screen_pages(win, "monitor"):
        if found := page_problems(win):
            problems[f"{page} (compare)"] = found
    ctx.select_run(g.path)
    qtbot.waitUntil(lambda: monitor.kind.name == "grpo")
    for page in screen_pages(win, "monitor"):
        if found := page_problems(win):
            problems[f"{page} (GRPO)"] = found
    assert not problems, "\n".join(f"{page}: {p}" for page, found in problems.items()
                                    for p in found)
    assert_fits(win)
    assert row.weight_box.width() > 0 and row.remove_button.width() > 0



@pytest.mark.slow
def test_the_get_a_model_dialog_fits(qtbot, hub, font_scale):  # noqa: F811 (hub: a fixture)
    """"Get a model..." (New run's picker) with search results and a repository's files: its
    minimum fits 1280x720, and at its default size nothing is cut or overlaps."""
    from app.views.get_model.dialog import GetModelDialog
    from tests.views.get_model.test_get_model import _to_files

    dialog = GetModelDialog()
    qtbot.addWidget(dialog)
    dialog.show()
    _to_files(qtbot, dialog)
    settle()
    hint = dialog.minimumSizeHint()
    assert hint.width() <= WIDTH and hint.height() <= HEIGHT, hint
    assert dialog.width() <= WIDTH and dialog.height() <= HEIGHT, dialog.size()
    assert layout_problems(dialog) == []


SCALED_WINDOW = """
import json, sys, time
from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QApplication
from app.views.app import build_window, prepare_app
from tests.views.test_fits_screen import layout_problems, screen_pages

app = prepare_app([])
tmp = sys.argv[1]
win = build_window(QSettings(tmp + "/settings.ini", QSettings.IniFormat), tmp + "/queue.sqlite3",
                   tmp + "/runs", discover=lambda: [])
win.resize(1280, 720)
win.show()
view, deadline = win.new_run, time.monotonic() + 60
while not (view.card is not None and view.dataset.report is not None
           and not view.dataset.is_busy() and view.memory_estimate is not None):
    if time.monotonic() > deadline:
        sys.exit("New run did not read the sample model and dataset in 60 s")
    app.processEvents()
    time.sleep(0.01)
found = {page: layout_problems(win) for page in screen_pages(win)}
print(json.dumps({"ratio": app.primaryScreen().devicePixelRatio(),
                  "size": [win.width(), win.height()],
                  "problems": {k: v for k, v in found.items() if v}}))
"""


@pytest.mark.slow
def test_the_window_fits_at_150_percent_scaling(tmp_path):
    """QT_SCALE_FACTOR=1.5 (1920x1080 at 150%: 1280x720 logical pixels), in a process of its
    own (the factor is read when Qt starts): every page of every screen as above."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "QT_SCALE_FACTOR": "1.5", "QT_QPA_PLATFORM": "offscreen",
           "WORKBENCH_QUEUE": str(tmp_path / "queue.sqlite3"), "WORKBENCH_THEME": "light"}
    done = subprocess.run([sys.executable, "-c", SCALED_WINDOW, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=180,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ratio"] == 1.5 and result["size"] == [WIDTH, HEIGHT]
    assert result["problems"] == {}
