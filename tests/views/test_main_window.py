"""The shell: navigation, the screens, the error funnel, the worker in the status bar,
reattaching; and the model picker with its card (New run's first tab).

QT_QPA_PLATFORM=offscreen is set in conftest.py.
"""

import importlib.metadata
import os
import threading
from pathlib import Path

import pytest
import shiboken6
from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QAction

from app.engine.errors import ConfigError, ModelFormatError
from app.engine.model.card import describe_model
from app.engine.runs.rundir import RunDir
from app.views import main_window as mw
from app.views.app import sample_model_path
from app.views.context import SCREENS
from app.views.main_window import MAX_RECENT, MainWindow, Placeholder

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
MIXTRAL = str(GOLDEN / "mixtral-q4_0.gguf")
DEEPSEEK = str(GOLDEN / "deepseek-f32.gguf")
DENSE = str(GOLDEN / "llama-f32.gguf")
SAMPLE = sample_model_path()


def make_window(qtbot, ctx, **kwargs):
    win = MainWindow(ctx, discover=lambda: [], **kwargs)
    qtbot.addWidget(win)
    win.resize(1100, 720)
    win.show()
    return win


@pytest.fixture
def window(qtbot, ctx):
    win = make_window(qtbot, ctx)
    wait_card(qtbot, win)                            # the sample model opens first
    return win


def wait_card(qtbot, win):
    qtbot.waitUntil(lambda: win.new_run.card is not None or win.new_run.model_error_shown(),
                    timeout=10_000)


def open_and_wait(qtbot, win, path):
    win.open_model(path)
    wait_card(qtbot, win)


# ---------------------------------------------------------------- the shell
def test_navigation_lists_every_screen_and_switches(qtbot, window, ctx):
    titles = [window.nav.item(i).text() for i in range(window.nav.count())]
    assert titles == ["New run", "Runs", "Monitor", "Experts", "Playground", "Export",
                      "Evaluate", "Settings"]
    assert list(window.screens) == list(SCREENS)
    assert window.placeholders() == []               # every real screen is there
    assert type(window.screen("runs")).__name__ == "RunsView"
    assert type(window.screen("monitor")).__name__ == "MonitorView"
    assert type(window.screen("experts")).__name__ == "ExpertsView"
    assert type(window.screen("settings").clusters).__name__ == "ClustersPanel"
    assert window.current_screen_key() == "new_run"
    rect = window.nav.visualItemRect(window.nav.item(4))
    qtbot.mouseClick(window.nav.viewport(), Qt.LeftButton, pos=rect.center())
    assert window.current_screen_key() == "playground"
    assert window.current_screen() is window.screen("playground")
    ctx.show_screen("monitor")                       # screens ask the shell through ctx
    assert window.current_screen_key() == "monitor"


def test_a_missing_screen_module_shows_a_placeholder(qtbot, ctx, monkeypatch):
    monkeypatch.setitem(mw.SCREEN_CLASSES, "runs", ("app.views.no_such_module", "RunsView"))
    win = make_window(qtbot, ctx)
    assert win.placeholders() == ["runs"]
    assert isinstance(win.screen("runs"), Placeholder)
    assert "not available" in win.screen("runs").reason


def test_errors_from_any_screen_reach_the_one_banner(qtbot, window, ctx):
    assert not window.error_shown()
    ctx.report_error("Could not queue the run", ConfigError("The disk is read-only.",
                                                            "Pick another runs folder."))
    banner = window.error_banner
    assert window.error_shown()
    assert banner.title_label.text() == "Could not queue the run"
    assert banner.message_label.text() == "The disk is read-only."
    assert banner.hint_label.text() == "Pick another runs folder."
    assert not banner.details_view.isVisible()
    banner.details_button.setChecked(True)
    assert banner.details_view.isVisible()
    try:
        {}["missing"]
    except KeyError as e:                            # a bug: its traceback in the details
        ctx.report_error("Oops", e)
    assert "bug" in banner.hint_label.text()
    assert "Traceback" in banner.details_view.toPlainText()
    banner.dismiss()
    assert not window.error_shown()


def test_status_bar_shows_the_worker_and_offers_to_start_it(qtbot, window, ctx, tmp_path):
    assert "Worker stopped" in window.worker_label.text()
    assert not window.start_worker_button.isVisible()
    run = RunDir.create(tmp_path / "runs" / "r1", {"model": "m", "data": "d"})
    ctx.queue.add(run.path, check=False)
    window.refresh_status()
    assert "1 queued" in window.worker_label.text()
    assert window.start_worker_button.isVisible()
    qtbot.mouseClick(window.start_worker_button, Qt.LeftButton)
    assert ctx.worker_starts == [1]


def test_closing_never_stops_training_and_reopening_reattaches(qtbot, ctx, tmp_path):
    run = RunDir.create(tmp_path / "runs" / "live", {"model": "m", "data": "d"})
    job_id = ctx.queue.add(run.path, check=False)
    ctx.queue.claim_next("some-worker")              # a worker process is training it
    win = make_window(qtbot, ctx)
    assert ctx.current_run == str(run.path)          # reattached to the running job
    assert win.current_screen_key() == "monitor"
    assert win.screen("monitor").run_path == str(run.path)
    win.close()
    assert ctx.queue.get(job_id).state == "running"  # closing requested nothing
    assert ctx.queue.get(job_id).requested_action == "none"


def test_reopening_selects_the_last_run(qtbot, ctx, tmp_path):
    run = RunDir.create(tmp_path / "runs" / "old", {"model": "m", "data": "d"})
    first = make_window(qtbot, ctx)
    ctx.select_run(str(run.path))
    assert "old" in first.run_label.text()
    first.close()
    ctx.current_run = None
    make_window(qtbot, ctx)
    assert ctx.current_run == str(run.path)


# ---------------------------------------------------------------- model picker and card
def test_opens_with_the_sample_model(window):
    assert SAMPLE and window.new_run.card is not None
    assert window.new_run.card.path == SAMPLE
    assert window.card_view.badges() == ["llama", "MoE"]
    assert "tiny-moe.gguf" in window.windowTitle()


def test_mixtral_card(qtbot, window):
    open_and_wait(qtbot, window, MIXTRAL)
    rows = dict(window.card_view.shown_rows())
    assert rows["Architecture"] == "llama"
    assert rows["Experts"] == "4 (2 used per token)"
    assert rows["File"] == "mixtral-q4_0.gguf"
    assert window.card_view.badges() == ["llama", "MoE"]
    assert "mixtral-q4_0.gguf" in window.windowTitle()
    assert window.new_run.picker.path_field.text() == MIXTRAL


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
    new_run = window.new_run
    panel = new_run.model_error
    assert new_run.model_error_shown() and window.isVisible()
    assert "bad.gguf" in panel.title_label.text()
    assert "bad.gguf" in panel.message_label.text()
    assert panel.hint_label.text()
    assert not panel.details_view.isVisible()
    panel.details_button.setChecked(True)
    assert panel.details_view.isVisible()
    assert str(bad) in panel.details_view.toPlainText()
    assert str(bad) not in window.recent_models()        # failed opens are not remembered
    assert not new_run.start_button.isEnabled()          # no model, no run
    open_and_wait(qtbot, window, MIXTRAL)                # the window recovers
    assert not new_run.model_error_shown()
    assert dict(window.card_view.shown_rows())["Architecture"] == "llama"


def test_a_bug_shows_its_traceback(qtbot, ctx):
    def broken(path):
        raise KeyError("general.architecture")

    win = make_window(qtbot, ctx, read_model=broken)
    wait_card(qtbot, win)
    assert win.new_run.model_error_shown()
    panel = win.new_run.model_error
    assert "KeyError" in panel.message_label.text()
    assert "bug" in panel.hint_label.text()
    details = panel.details_view.toPlainText()
    assert "Traceback" in details and "in broken" in details


def test_engine_error_from_the_reader_goes_to_the_funnel(qtbot, ctx):
    def unreadable(path):
        raise ModelFormatError(f"{os.path.basename(path)} is truncated.", "Download it again.")

    win = make_window(qtbot, ctx, read_model=unreadable)
    open_and_wait(qtbot, win, MIXTRAL)
    panel = win.new_run.model_error
    assert panel.message_label.text() == "mixtral-q4_0.gguf is truncated."
    assert panel.hint_label.text() == "Download it again."
    assert "Traceback" not in panel.details_view.toPlainText()


def test_reading_runs_off_the_gui_thread(qtbot, ctx):
    release = threading.Event()

    def slow(path):
        assert threading.current_thread() is not threading.main_thread()
        release.wait(10)
        return describe_model(path)

    win = make_window(qtbot, ctx, read_model=slow)
    win.open_model(MIXTRAL)
    assert win.card_view.is_reading()                # the GUI thread is free meanwhile
    qtbot.wait(50)
    assert win.card_view.is_reading() and win.card_view.card is None
    release.set()
    qtbot.waitUntil(lambda: win.card_view.card is not None and
                    win.card_view.card.path == MIXTRAL, timeout=10_000)
    assert not win.card_view.is_reading()


def test_recent_files(qtbot, ctx, settings):
    win = make_window(qtbot, ctx)
    wait_card(qtbot, win)
    for path in (MIXTRAL, DEEPSEEK, MIXTRAL):
        open_and_wait(qtbot, win, path)
    assert win.recent_models() == [MIXTRAL, DEEPSEEK, SAMPLE]   # most recent first, no dupes
    picker = win.new_run.picker
    assert [picker.recent_list.item(i).text() for i in range(picker.recent_list.count())] == [
        "mixtral-q4_0.gguf", "deepseek-f32.gguf", "tiny-moe.gguf"]

    ctx.settings = QSettings(settings.fileName(), QSettings.IniFormat)
    reopened = make_window(qtbot, ctx)                          # persisted across windows
    wait_card(qtbot, reopened)
    recent = reopened.new_run.picker.recent_list
    assert recent.count() == 3
    rect = recent.visualItemRect(recent.item(1))
    qtbot.mouseClick(recent.viewport(), Qt.LeftButton, pos=rect.center())
    qtbot.waitUntil(lambda: reopened.card_view.card is not None and
                    reopened.card_view.card.path == DEEPSEEK, timeout=10_000)
    assert reopened.recent_models()[0] == DEEPSEEK


def test_recent_files_keep_the_last_ten(qtbot, window, tmp_path):
    copies = []
    for i in range(MAX_RECENT + 2):
        copy = tmp_path / f"model-{i}.gguf"
        copy.write_bytes(Path(MIXTRAL).read_bytes())
        copies.append(str(copy))
        open_and_wait(qtbot, window, str(copy))
    assert window.recent_models() == copies[::-1][:MAX_RECENT]
    assert window.new_run.picker.recent_list.count() == MAX_RECENT


def test_sample_model_path():
    assert SAMPLE is None or (os.path.isfile(SAMPLE) and SAMPLE.endswith("tiny-moe.gguf"))


def test_closing_while_reading_is_safe(qtbot, ctx):
    release = threading.Event()

    def slow(path):
        release.wait(10)
        return describe_model(path)

    win = MainWindow(ctx, read_model=slow, discover=lambda: [])
    win.open_model(MIXTRAL)
    threading.Timer(0.1, release.set).start()
    shiboken6.delete(win)            # waits for the read; its result is dropped, nothing crashes
    qtbot.wait(50)
    assert release.is_set()


def test_an_unreadable_file_changes_the_title(qtbot, window, tmp_path):
    open_and_wait(qtbot, window, MIXTRAL)
    assert window.windowTitle().startswith(os.path.basename(MIXTRAL))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"9\xff\xb7e" + os.urandom(100))
    open_and_wait(qtbot, window, str(bad))
    assert window.windowTitle().startswith("broken.gguf (cannot be opened)")


def test_an_unreadable_file_shows_no_python_bytes(qtbot, window, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"9\xff\xb7e" + os.urandom(100))
    open_and_wait(qtbot, window, str(bad))
    text = window.new_run.model_error.message_label.text()
    assert "b'" not in text and "39 ff b7 65" in text


def test_quit_and_about(window):
    from PySide6.QtGui import QKeySequence

    from app.views.main_window import about_text


    actions = {a.text(): a for a in window.findChildren(QAction)}
    assert actions["&Quit"].shortcut() == QKeySequence("Ctrl+Q")
    version = importlib.metadata.version("gguf-workbench")
    assert about_text().startswith(f"GGUF Workbench {version}\n")
