"""GUI entry point: `workbench` with no arguments lands here."""

from __future__ import annotations

import os
import sys

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QApplication

from app.views.context import (ORG_NAME, REPO_ROOT, AppContext, sample_dataset_path,
                               sample_model_path)
from app.views.main_window import APP_NAME, MainWindow

STYLE_SHEET = REPO_ROOT / "resources" / "style.qss"
__all__ = ["REPO_ROOT", "build_window", "make_queue", "prepare_app", "run_gui",
           "sample_dataset_path", "sample_model_path"]

# Rules for the shell and the screens that resources/style.qss does not cover yet.
EXTRA_STYLE = """
#navPanel { background: #f6f7f9; border-right: 1px solid #e1e4e8; }
#appTitle { font-size: 12pt; font-weight: 700; color: #2f3a48; padding: 2px 6px 8px 6px; }
#navList { background: transparent; border: none; outline: none; font-size: 10.5pt; }
#navList::item { padding: 9px 10px; border-radius: 6px; margin: 1px 0; }
#navList::item:hover { background: #e9ecf0; }
#navList::item:selected { background: #dce7fb; color: #1f2328; font-weight: 600; }
#actionBar { background: #f6f7f9; border-top: 1px solid #e1e4e8; }
#fieldError { color: #c0392b; font-size: 9pt; }
#formLabel { color: #3a4047; }
#hint, #lintSummary, #runSummary { color: #4d545c; }
#memoryEstimate { color: #2552a8; font-weight: 600; padding: 4px 0; }
#paramCount { color: #6a737d; font-size: 9pt; }
#trainableTotal { color: #2552a8; }
#workerState[state="running"] { color: #1a7f37; font-weight: 600; }
#workerState[state="stopped"] { color: #6a737d; }
#reportBadge[ok="true"] { background: #dafbe1; color: #1a7f37; border-radius: 9px;
                          padding: 3px 10px; font-weight: 700; }
#reportBadge[ok="false"] { background: #ffebe9; color: #c0392b; border-radius: 9px;
                           padding: 3px 10px; font-weight: 700; }
#outputView, #exampleView, #reportText { background: #fbfcfd; border: 1px solid #e1e4e8;
                                         border-radius: 5px; }
QGroupBox { font-weight: 600; border: 1px solid #e1e4e8; border-radius: 6px; margin-top: 14px;
            padding-top: 6px; }
QGroupBox::title { subcontrol-origin: margin; left: 8px; padding: 0 4px; color: #3a4047; }
QTabBar::tab { padding: 7px 16px; }
QPushButton:disabled { color: #a0a7ae; background: #f6f7f9; border-color: #e1e4e8; }
QPushButton#primaryButton:disabled { background: #a9c1ee; border-color: #a9c1ee; color: #f4f7fd; }
#statusMessage { color: #4d545c; padding-left: 12px; }
QProgressBar { color: #1f2328; text-align: center; }
QProgressBar::chunk { background: #a9c4f2; }
QTabBar::tab:selected { font-weight: 600; }
"""


def prepare_app(argv: list[str] | None = None) -> QApplication:
    """The QApplication (created once), named and styled."""
    app = QApplication.instance() or QApplication(sys.argv if argv is None else argv)
    app.setApplicationName(APP_NAME)
    app.setOrganizationName(ORG_NAME)
    app.setStyle("Fusion")
    style = STYLE_SHEET.read_text(encoding="utf-8") if STYLE_SHEET.is_file() else ""
    app.setStyleSheet(style + EXTRA_STYLE)
    return app


def make_queue(path: str | os.PathLike | None = None):
    """The job queue: `path`, else $WORKBENCH_QUEUE, else the default in the user data dir."""
    from app.engine.api import JobQueue

    return JobQueue(path or os.environ.get("WORKBENCH_QUEUE") or None)


def build_window(settings: QSettings | None = None, queue_path: str | None = None,
                 runs_root: str | None = None, **kwargs) -> MainWindow:
    """The main window around a fresh AppContext (the screenshot tool and tests use this)."""
    ctx = AppContext(make_queue(queue_path), settings, runs_root=runs_root)
    return MainWindow(ctx, **kwargs)


def run_gui(argv: list[str] | None = None, model_path: str | None = None) -> int:
    """Open the main window (with `model_path` pre-selected) and run the event loop."""
    app = prepare_app(argv)
    window = build_window()
    geometry = window.ctx.settings.value("window/geometry")
    if geometry is None or not window.restoreGeometry(geometry):
        window.resize(1200, 780)
    window.show()
    if model_path and model_path != sample_model_path():
        window.open_model(model_path)
    return app.exec()
