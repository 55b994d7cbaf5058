"""GUI entry point: `workbench` with no arguments lands here."""

from __future__ import annotations

import os
import sys

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QApplication

from app.views.context import (ORG_NAME, REPO_ROOT, AppContext, sample_dataset_path,
                               sample_model_path)
from app.views.main_window import APP_NAME, MainWindow
from app.views.widgets.theme import apply_theme

__all__ = ["REPO_ROOT", "build_window", "make_queue", "prepare_app", "run_gui",
           "sample_dataset_path", "sample_model_path"]


def prepare_app(argv: list[str] | None = None) -> QApplication:
    """The QApplication (created once), named and styled (the theme: widgets/theme.py)."""
    app = QApplication.instance() or QApplication(sys.argv if argv is None else argv)
    app.setApplicationName(APP_NAME)
    app.setOrganizationName(ORG_NAME)
    app.setStyle("Fusion")
    apply_theme(app)            # WORKBENCH_THEME or the system's scheme; follows its changes
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
    window.restore_theme()                      # View > Theme's choice, unless the env's
    geometry = window.ctx.settings.value("window/geometry")
    if geometry is None or not window.restoreGeometry(geometry):
        window.resize(1200, 780)
    window.show()
    if model_path and model_path != sample_model_path():
        window.open_model(model_path)
    return app.exec()
