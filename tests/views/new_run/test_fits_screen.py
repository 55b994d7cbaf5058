"""New run fits a 1280x720 window (1920x1080 at 150%): on every tab of both run types no field
or button is cut by the window's edge or hidden under a scroll bar (scrolling down is fine).
QT_QPA_PLATFORM=offscreen (conftest)."""

from __future__ import annotations

from PySide6.QtCore import QPoint, QRect
from PySide6.QtWidgets import (QAbstractButton, QAbstractScrollArea, QAbstractSpinBox,
                               QComboBox, QLineEdit, QSplitter, QWidget)

from app.views.main_window import MainWindow
from app.views.new_run.view import NewRunView
from tests.views.conftest import wait_ready

INPUTS = (QAbstractSpinBox, QComboBox, QLineEdit, QAbstractButton)


def clipped(root: QWidget) -> list[str]:
    """The visible inputs under `root` that the window's edge cuts, that are squeezed below
    their minimum width, or that reach past (under the scroll bar of) their scroll area's
    viewport on the right."""
    window = root.window()
    out = []
    for w in root.findChildren(QWidget):
        if not isinstance(w, INPUTS) or not w.isVisibleTo(window) or \
                isinstance(w.parent(), (QAbstractSpinBox, QComboBox, QLineEdit)):
            continue
        name = (f"{type(w).__name__} {getattr(w, 'text', lambda: '')() or w.objectName()} "
                f"in {type(w.parent()).__name__}")
        fixed = w.minimumWidth() == w.maximumWidth()          # sized on purpose
        if not fixed and w.width() < w.minimumSizeHint().width():
            out.append(f"{name}: squeezed to {w.width()} < {w.minimumSizeHint().width()}")
        area = w.parentWidget()
        while area is not None and not isinstance(area, QAbstractScrollArea):
            area = area.parentWidget()
        if area is None or not area.viewport().isAncestorOf(w):
            rect = QRect(w.mapTo(window, QPoint(0, 0)), w.size())
            if not window.rect().contains(rect):
                out.append(f"{name}: outside the window {rect}")
        else:                                  # scrolled into view downwards, never sideways
            viewport = area.viewport()
            left = w.mapTo(viewport, QPoint(0, 0)).x()
            if left < 0 or left + w.width() > viewport.width():
                out.append(f"{name}: under the scroll bar ({left}+{w.width()} > "
                           f"{viewport.width()})")
    return out


def test_new_run_fits_1280x720_on_every_tab(qtbot, ctx):
    win = MainWindow(ctx, discover=lambda: [])
    qtbot.addWidget(win)
    win.resize(1280, 720)
    win.show()
    view = win.findChild(NewRunView)
    wait_ready(qtbot, view)
    assert win.width() <= 1280 and win.height() <= 720
    for kind in ("sft", "grpo", "dpo", "kto"):   # DPO and KTO: the preference fields
        view.set_run_type(kind)
        qtbot.waitUntil(lambda: not view.dataset.is_busy(), timeout=15_000)
        if kind == "grpo":                     # Python file rows: weight and remove visible
            for _ in range(4):
                view.grpo_panel.rewards.add({"kind": "file"})
        for i in range(view.tabs.count()):
            view.tabs.setCurrentIndex(i)
            qtbot.wait(50)
            problems = clipped(view)
            assert problems == [], (kind, view.tabs.tabText(i), problems)
            if kind == "grpo" and i == 1:      # the rows were among the inputs checked
                row = view.grpo_panel.rewards.rows[-1]
                assert row.weight_box.isVisibleTo(win) and row.remove_button.isVisibleTo(win)
                splitter = view.grpo_panel.findChild(QSplitter)
                splitter.setSizes([10**4, 1])  # the first rows widened as far as they go
                qtbot.wait(50)
                assert clipped(view) == []
