"""The main window: picking a model, its card, the error funnel, recent files.

QT_QPA_PLATFORM=offscreen is set in conftest.py.
"""

import os
import threading
from pathlib import Path

import pytest
import shiboken6
from PySide6.QtCore import QSettings, Qt

from app.engine.errors import ModelFormatError
from app.engine.model_info import describe_model
from app.views.app import sample_model_path
from app.views.main_window import MAX_RECENT, MainWindow

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
MIXTRAL = str(GOLDEN / "mixtral-q4_0.gguf")
DEEPSEEK = str(GOLDEN / "deepseek-f32.gguf")
DENSE = str(GOLDEN / "llama-f32.gguf")


@pytest.fixture
def settings(tmp_path):
    return QSettings(str(tmp_path / "settings.ini"), QSettings.IniFormat)


@pytest.fixture
def window(qtbot, settings):
    win = MainWindow(settings)
    qtbot.addWidget(win)
    win.resize(1100, 720)
    win.show()
    return win


def open_and_wait(qtbot, win, path):
    win.open_model(path)
    qtbot.waitUntil(lambda: win.card_view.card is not None or win.error_shown(), timeout=10_000)


def test_shows_placeholder_before_a_model_is_picked(window):
    assert window.card_view.card is None
    assert window.card_view.shown_rows() == []
    assert not window.error_shown()


def test_mixtral_card(qtbot, window):
    open_and_wait(qtbot, window, MIXTRAL)
    rows = dict(window.card_view.shown_rows())
    assert rows["Architecture"] == "llama"
    assert rows["Experts"] == "4 (2 used per token)"
    assert rows["File"] == "mixtral-q4_0.gguf"
    assert window.card_view.badges() == ["llama", "MoE"]
    assert "mixtral-q4_0.gguf" in window.windowTitle()
    assert window.path_field.text() == MIXTRAL


def test_deepseek_and_dense_badges(qtbot, window):
    open_and_wait(qtbot, window, DEEPSEEK)
    assert window.card_view.badges() == ["deepseek", "MoE"]
    assert dict(window.card_view.shown_rows())["Experts"].startswith("4 (2 used per token)")
    open_and_wait(qtbot, window, DENSE)
    assert window.card_view.badges() == ["llama"]
    assert dict(window.card_view.shown_rows())["Experts"] == "none (dense)"


def test_corrupt_file_shows_the_error_panel(qtbot, window, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(os.urandom(100))
    open_and_wait(qtbot, window, str(bad))
    panel = window.error_panel
    assert window.error_shown() and window.isVisible()
    assert "bad.gguf" in panel.title_label.text()
    assert "bad.gguf" in panel.message_label.text()
    assert panel.hint_label.text()
    assert not panel.details_view.isVisible()
    panel.details_button.setChecked(True)
    assert panel.details_view.isVisible()
    assert str(bad) in panel.details_view.toPlainText()
    assert window.recent_models() == []             # failed opens are not remembered
    open_and_wait(qtbot, window, MIXTRAL)            # the window recovers
    assert not window.error_shown()
    assert dict(window.card_view.shown_rows())["Architecture"] == "llama"


def test_a_bug_shows_its_traceback(qtbot, settings):
    def broken(path):
        raise KeyError("general.architecture")

    win = MainWindow(settings, read_model=broken)
    qtbot.addWidget(win)
    open_and_wait(qtbot, win, MIXTRAL)
    assert win.error_shown()
    assert "KeyError" in win.error_panel.message_label.text()
    assert "bug" in win.error_panel.hint_label.text()
    details = win.error_panel.details_view.toPlainText()
    assert "Traceback" in details and "in broken" in details


def test_engine_error_from_the_reader_goes_to_the_funnel(qtbot, settings):
    def unreadable(path):
        raise ModelFormatError(f"{os.path.basename(path)} is truncated.", "Download it again.")

    win = MainWindow(settings, read_model=unreadable)
    qtbot.addWidget(win)
    open_and_wait(qtbot, win, MIXTRAL)
    assert win.error_panel.message_label.text() == "mixtral-q4_0.gguf is truncated."
    assert win.error_panel.hint_label.text() == "Download it again."
    assert "Traceback" not in win.error_panel.details_view.toPlainText()


def test_reading_runs_off_the_gui_thread(qtbot, settings):
    release = threading.Event()

    def slow(path):
        assert threading.current_thread() is not threading.main_thread()
        release.wait(10)
        return describe_model(path)

    win = MainWindow(settings, read_model=slow)
    qtbot.addWidget(win)
    win.open_model(MIXTRAL)
    assert win.card_view.is_reading()                # the GUI thread is free meanwhile
    qtbot.wait(50)
    assert win.card_view.is_reading() and win.card_view.card is None
    release.set()
    qtbot.waitUntil(lambda: win.card_view.card is not None, timeout=10_000)
    assert not win.card_view.is_reading()


def test_recent_files(qtbot, settings):
    win = MainWindow(settings)
    qtbot.addWidget(win)
    for path in (MIXTRAL, DEEPSEEK, MIXTRAL):
        open_and_wait(qtbot, win, path)
    assert win.recent_models() == [MIXTRAL, DEEPSEEK]          # most recent first, no dupes
    assert [win.recent_list.item(i).text() for i in range(win.recent_list.count())] == [
        "mixtral-q4_0.gguf", "deepseek-f32.gguf"]

    reopened = MainWindow(QSettings(settings.fileName(), QSettings.IniFormat))
    qtbot.addWidget(reopened)                                   # persisted across windows
    reopened.show()
    assert reopened.recent_list.count() == 2
    rect = reopened.recent_list.visualItemRect(reopened.recent_list.item(1))
    qtbot.mouseClick(reopened.recent_list.viewport(), Qt.LeftButton, pos=rect.center())
    qtbot.waitUntil(lambda: reopened.card_view.card is not None, timeout=10_000)
    assert reopened.card_view.card.path == DEEPSEEK
    assert reopened.recent_models()[0] == DEEPSEEK


def test_recent_files_keep_the_last_ten(qtbot, settings, tmp_path):
    win = MainWindow(settings)
    qtbot.addWidget(win)
    copies = []
    for i in range(MAX_RECENT + 2):
        copy = tmp_path / f"model-{i}.gguf"
        copy.write_bytes(Path(MIXTRAL).read_bytes())
        copies.append(str(copy))
        open_and_wait(qtbot, win, str(copy))
    assert win.recent_models() == copies[::-1][:MAX_RECENT]
    assert win.recent_list.count() == MAX_RECENT


def test_sample_model_path():
    path = sample_model_path()
    assert path is None or (os.path.isfile(path) and path.endswith("tiny-moe.gguf"))


def test_closing_while_reading_is_safe(qtbot, settings):
    release = threading.Event()

    def slow(path):
        release.wait(10)
        return describe_model(path)

    win = MainWindow(settings, read_model=slow)
    win.open_model(MIXTRAL)
    threading.Timer(0.1, release.set).start()
    shiboken6.delete(win)            # waits for the read; its result is dropped, nothing crashes
    qtbot.wait(50)
    assert release.is_set()
