"""Screenshots of the main window for the docs.

Run from the repo root: QT_QPA_PLATFORM=offscreen python -m tests.views.screenshots
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from PySide6.QtCore import QDeadlineTimer, QSettings, QThread
from PySide6.QtWidgets import QApplication

from app.views.app import REPO_ROOT, prepare_app
from app.views.main_window import MainWindow

GOLDEN = REPO_ROOT / "tests" / "data" / "golden"
OUT = REPO_ROOT / "docs" / "screenshots"


def wait_until(done, timeout_ms: int = 10_000) -> None:
    deadline = QDeadlineTimer(timeout_ms)
    while not done():
        if deadline.hasExpired():
            raise TimeoutError("the window did not reach the expected state")
        QApplication.processEvents()
        QThread.msleep(10)


def shoot(window: MainWindow, path: str, done, out: Path) -> None:
    window.open_model(path)
    wait_until(done)
    QApplication.processEvents()
    window.grab().save(str(out))
    print(f"wrote {out}")


def main() -> None:
    prepare_app([])
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        settings = QSettings(os.path.join(tmp, "settings.ini"), QSettings.IniFormat)
        for name in ("deepseek-f32.gguf", "qwen2moe-q8_0.gguf"):   # a few recent files
            settings.setValue("recent/models", [str(GOLDEN / name)] +
                              settings.value("recent/models", [], type=list))
        window = MainWindow(settings)
        window.resize(1100, 720)
        window.show()
        shoot(window, str(GOLDEN / "mixtral-q4_0.gguf"),
              lambda: window.card_view.card is not None, OUT / "model-card.png")
        bad = Path(tmp) / "bad.gguf"
        bad.write_bytes(os.urandom(100))
        shoot(window, str(bad), window.error_shown, OUT / "model-error.png")
        window.error_panel.details_button.setChecked(True)
        QApplication.processEvents()
        window.grab().save(str(OUT / "model-error-details.png"))


if __name__ == "__main__":
    main()
