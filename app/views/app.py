"""GUI entry point: `workbench` with no arguments lands here."""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtWidgets import QApplication

from app.views.main_window import APP_NAME, MainWindow

REPO_ROOT = Path(__file__).resolve().parents[2]
STYLE_SHEET = REPO_ROOT / "resources" / "style.qss"


def sample_model_path() -> str | None:
    """The bundled tiny MoE model, `<repo>/sample_data/tiny-moe.gguf`, if it is there."""
    path = REPO_ROOT / "sample_data" / "tiny-moe.gguf"
    return str(path) if path.is_file() else None


def prepare_app(argv: list[str] | None = None) -> QApplication:
    """The QApplication (created once), named and styled."""
    app = QApplication.instance() or QApplication(sys.argv if argv is None else argv)
    app.setApplicationName(APP_NAME)
    app.setOrganizationName("gguf-workbench")
    app.setStyle("Fusion")
    if STYLE_SHEET.is_file():
        app.setStyleSheet(STYLE_SHEET.read_text(encoding="utf-8"))
    return app


def run_gui(argv: list[str] | None = None, model_path: str | None = None) -> int:
    """Open the main window (with `model_path` pre-selected) and run the event loop."""
    app = prepare_app(argv)
    window = MainWindow()
    window.resize(1100, 720)
    window.show()
    if model_path:
        window.open_model(model_path)
    return app.exec()
