"""The shell: a navigation list on the left, the screens in a stack, the worker in the status bar.

Screens (all built as `Screen(ctx, parent)` around one `AppContext`): New run, Runs, Monitor,
Experts, Playground, Export, Settings (clusters). They talk through the context
(run_selected, model_selected, runs_changed, clusters_changed, navigate, error_reported);
errors reach the user through one banner (the ErrorPanel) above the screens.

Closing the window never stops training: the engine worker is its own process and the queue
and run directories are the state. Opening the window again reattaches: the running job (or
the last selected run) is selected, so Monitor and Experts follow it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Callable

from PySide6.QtCore import QSettings, Qt, QTimer, QUrl
from PySide6.QtGui import (QAction, QActionGroup, QDesktopServices, QFont, QFontMetrics,
                           QKeySequence)
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QListWidget, QListWidgetItem,
                               QMainWindow, QMessageBox, QPushButton, QSizePolicy,
                               QStackedWidget, QVBoxLayout, QWidget)

from app.engine.api import JobQueue, ModelCard, describe_model
from app.views.context import SCREENS, AppContext
from app.views.widgets.error_panel import ErrorPanel
from app.views.widgets import theme
from app.views.widgets.fit import scrolled
from app.views.widgets.run_tail import BackgroundPoll

APP_NAME = "GGUF Workbench"
RECENT_KEY = "recent/models"
MAX_RECENT = 10
LAST_RUN_KEY = "window/last_run"
THEME_KEY = "window/theme"              # View > Theme: system, light or dark
SCREEN_TITLES = {"new_run": "New run", "runs": "Runs", "monitor": "Monitor",
                 "experts": "Experts", "playground": "Playground", "export": "Export",
                 "evaluate": "Evaluate", "settings": "Settings"}
# key -> (module, class): the other screens are imported lazily, with a placeholder if missing
SCREEN_CLASSES = {"runs": ("app.views.runs.view", "RunsView"),
                  "monitor": ("app.views.monitor.view", "MonitorView"),
                  "experts": ("app.views.experts.view", "ExpertsView"),
                  "playground": ("app.views.playground.view", "PlaygroundView"),
                  "export": ("app.views.export.view", "ExportView"),
                  "evaluate": ("app.views.evaluate.view", "EvaluateView"),
                  "settings": ("app.views.settings.view", "SettingsView")}
STATUS_INTERVAL_MS = 1000
MESSAGE_MS = 10_000


def app_version() -> str:
    """The installed package's version (pyproject.toml), or "unknown" when it is not installed."""
    try:
        return importlib.metadata.version("gguf-workbench")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def about_text() -> str:
    return (f"{APP_NAME} {app_version()}\nFine-tune GGUF models (MoE first) on your "
            "workstation.\nTraining runs in its own process: closing this window does not "
            "stop it.")


def default_context(settings: QSettings | None = None) -> AppContext:
    """A context on the default queue ($WORKBENCH_QUEUE or the user data directory)."""
    return AppContext(JobQueue(os.environ.get("WORKBENCH_QUEUE") or None), settings)


class Placeholder(QWidget):
    """Stands in for a screen whose module is missing or failed to build."""

    def __init__(self, title: str, reason: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.reason = reason
        head = QLabel(title, objectName="pageTitle", alignment=Qt.AlignCenter)
        text = QLabel(reason, objectName="pageSubtitle", alignment=Qt.AlignCenter, wordWrap=True)
        layout = QVBoxLayout(self)
        layout.addStretch(1)
        layout.addWidget(head)
        layout.addWidget(text)
        layout.addStretch(2)


class MainWindow(QMainWindow):
    """The workbench window. `ctx` defaults to the default queue and the app's QSettings;
    `read_model` and `lint` are passed to the New run screen (tests replace them)."""

    def __init__(self, ctx: AppContext | None = None, parent: QWidget | None = None, *,
                 read_model: Callable[[str], ModelCard] = describe_model,
                 lint: Callable | None = None, discover: Callable | None = None):
        super().__init__(parent)
        self.ctx = ctx if ctx is not None else default_context()
        self.setWindowTitle(APP_NAME)
        self.screens: dict[str, QWidget] = {}
        self.error_banner = ErrorPanel(margins=10, closable=True)
        self.error_banner.hide()
        self.stack = QStackedWidget(objectName="content")
        self.nav = QListWidget(objectName="navList")

        from app.views.new_run.view import NewRunView

        kwargs = {"read_model": read_model}
        if lint is not None:
            kwargs["lint"] = lint
        if discover is not None:
            kwargs["discover"] = discover
        self.new_run = NewRunView(self.ctx, **kwargs)
        self._add_screen("new_run", self.new_run)
        for key in SCREENS[1:]:
            self._add_screen(key, self._build_screen(key))
        self.nav.currentRowChanged.connect(self.stack.setCurrentIndex)

        body = QWidget()
        bl = QVBoxLayout(body)
        bl.setContentsMargins(0, 0, 0, 0)
        bl.setSpacing(0)
        bl.addWidget(self.error_banner)
        bl.addWidget(self.stack, 1)
        central = QWidget()
        layout = QHBoxLayout(central)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(self._nav_panel())
        layout.addWidget(body, 1)
        self.setCentralWidget(central)

        self.worker_label = QLabel(objectName="workerState")
        self.start_worker_button = QPushButton("Start worker", flat=True)
        self.start_worker_button.clicked.connect(self._start_worker)
        self.start_worker_button.hide()
        self.run_label = QLabel(objectName="currentRun")
        self.message_label = QLabel(objectName="statusMessage")
        self._message_timer = QTimer(self, singleShot=True, interval=MESSAGE_MS)
        self._message_timer.timeout.connect(self.message_label.clear)
        self.statusBar().addWidget(self.worker_label)
        self.statusBar().addWidget(self.start_worker_button)
        self.statusBar().addWidget(self.message_label, 1)
        self.statusBar().addPermanentWidget(self.run_label)
        self._build_menu()

        self.ctx.navigate.connect(self.show_screen)
        self.ctx.error_reported.connect(self.show_error)
        self.ctx.status_message.connect(self.show_message)
        self.ctx.run_selected.connect(self._on_run_selected)
        self.ctx.model_selected.connect(self._on_model_selected)
        self.new_run.card_view.load_failed.connect(self._on_model_failed)
        self.show_screen("new_run")
        self.reattach()
        self.refresh_status()
        self._status_poll = BackgroundPoll(self.worker_state, STATUS_INTERVAL_MS, self)
        self._status_poll.result.connect(self._show_status)
        self._status_poll.failed.connect(self._show_queue_error)
        self._status_poll.start()

    # ---------------------------------------------------------------- screens
    def _build_screen(self, key: str) -> QWidget:
        module_name, class_name = SCREEN_CLASSES[key]
        title = SCREEN_TITLES[key]
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as e:
            return Placeholder(title, f"This screen is not available yet ({e}).")
        try:
            return cls(self.ctx)
        except Exception as e:                  # noqa: BLE001 -- keep the window usable
            self.show_error(f"The {title} screen failed to open", e)
            return Placeholder(title, f"This screen failed to open: {type(e).__name__}: {e}")

    def _add_screen(self, key: str, widget: QWidget) -> None:
        self.screens[key] = widget
        # in a scroll area: a screen taller or wider than the window scrolls instead of
        # making the window's minimum size its own (the window fits 1280x720)
        self.stack.addWidget(scrolled(widget))
        item = QListWidgetItem(SCREEN_TITLES[key])
        item.setData(Qt.UserRole, key)
        self.nav.addItem(item)

    def _nav_panel(self) -> QWidget:
        panel = QFrame(objectName="navPanel")
        # as wide as its title and items need (170 px at 1x; more with a larger font)
        panel.setSizePolicy(QSizePolicy.Fixed, QSizePolicy.Preferred)
        layout = QVBoxLayout(panel)
        layout.setContentsMargins(10, 16, 10, 10)
        layout.setSpacing(10)
        layout.addWidget(QLabel("GGUF\nWorkbench", objectName="appTitle"))
        layout.addWidget(self.nav, 1)
        self.nav.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self._fit_nav()
        theme.current().changed.connect(self._fit_nav)         # a new font size
        return panel

    def _fit_nav(self) -> None:
        """The navigation list as wide as its longest title needs in its font (150 px at the
        default size, more with a larger font)."""
        self.nav.ensurePolished()
        metrics = self.nav.fontMetrics()
        bold = QFont(self.nav.font())
        bold.setBold(True)                                 # the selected item's weight
        widest = max(QFontMetrics(bold).horizontalAdvance(self.nav.item(i).text())
                     for i in range(self.nav.count()))
        self.nav.setFixedWidth(max(150, widest + 2 * metrics.averageCharWidth() + 24))

    def screen(self, key: str) -> QWidget:
        return self.screens[key]

    def show_screen(self, key: str) -> None:
        if key in self.screens:
            self.nav.setCurrentRow(list(self.screens).index(key))

    def current_screen_key(self) -> str:
        return list(self.screens)[self.stack.currentIndex()]

    def current_screen(self) -> QWidget:
        """The screen shown (the stack holds each in its scroll area)."""
        return self.screens[self.current_screen_key()]

    def placeholders(self) -> list[str]:
        """Keys of the screens shown as placeholders."""
        return [k for k, w in self.screens.items() if isinstance(w, Placeholder)]

    # ---------------------------------------------------------------- compatibility helpers
    def open_model(self, path: str) -> None:
        """Open a model in New run (the command line's `workbench MODEL` lands here)."""
        self.show_screen("new_run")
        self.new_run.open_model(path)

    @property
    def card_view(self):
        return self.new_run.card_view

    def recent_models(self) -> list[str]:
        return self.new_run.picker.recent_models()

    # ---------------------------------------------------------------- errors and status
    def show_error(self, title: str, error: BaseException, context: str = "") -> None:
        self.error_banner.present(title, error, context)

    def show_message(self, text: str) -> None:
        """A short message in the status bar, beside the worker's state (cleared after 10 s)."""
        self.message_label.setText(text)
        self._message_timer.start()

    def error_shown(self) -> bool:
        return self.error_banner.isVisibleTo(self)

    def worker_state(self) -> dict:
        """{"running": bool, "pid": int | None, "jobs": {state: count}} from the queue (the
        status bar reads it every second in the reader thread: SQLite and the worker's lock)."""
        running = self.ctx.worker_running()
        counts: dict[str, int] = {}
        for job in self.ctx.queue.list(("running", "queued", "paused")):
            counts[job.state] = counts.get(job.state, 0) + 1
        return {"running": running, "pid": self.ctx.worker_pid() if running else None,
                "jobs": counts}

    def refresh_status(self) -> None:
        """Read the worker's state now and show it."""
        try:
            state = self.worker_state()
        except Exception as e:                  # noqa: BLE001 -- the queue is unreadable
            self._show_queue_error(e)
            return
        self._show_status(state)

    def _show_queue_error(self, error: BaseException) -> None:
        self.worker_label.setText(f"Queue unavailable: {getattr(error, 'message', error)}")

    def _show_status(self, state: dict) -> None:
        jobs = state["jobs"]
        queued = jobs.get("queued", 0)
        detail = ", ".join(f"{n} {s}" for s, n in jobs.items()) or "no jobs waiting"
        if state["running"]:
            pid = f" (pid {state['pid']})" if state["pid"] else ""
            self.worker_label.setText(f"\u25cf Worker running{pid} \u00b7 {detail}")
            self.worker_label.setProperty("state", "running")
        else:
            self.worker_label.setText(f"\u25cb Worker stopped \u00b7 {detail}")
            self.worker_label.setProperty("state", "stopped")
        self.worker_label.style().polish(self.worker_label)
        self.start_worker_button.setVisible(not state["running"] and queued > 0)

    def _start_worker(self) -> None:
        try:
            self.ctx.ensure_worker()
        except Exception as e:                  # noqa: BLE001
            self.show_error("Could not start the worker", e)
        self.refresh_status()

    def _on_run_selected(self, path: str) -> None:
        self.ctx.settings.setValue(LAST_RUN_KEY, path)
        self.run_label.setText(f"Run: {os.path.basename(path.rstrip(os.sep))}")
        self.run_label.setToolTip(path)

    def _on_model_selected(self, path: str) -> None:
        self.setWindowTitle(f"{os.path.basename(path)} \u2014 {APP_NAME}")

    def _on_model_failed(self, path: str, _error: BaseException) -> None:
        self.setWindowTitle(f"{os.path.basename(path)} (cannot be opened) \u2014 {APP_NAME}")

    def reattach(self) -> None:
        """Follow the running job, else the last run selected in a previous session."""
        try:
            running = self.ctx.queue.list("running")
        except Exception:                       # noqa: BLE001 -- shown by refresh_status
            running = []
        last = self.ctx.settings.value(LAST_RUN_KEY, "", type=str)
        if running:
            self.ctx.select_run(running[0].run_dir)
            self.show_screen("monitor")
        elif last and os.path.isfile(os.path.join(last, "config.json")):
            self.ctx.select_run(last)

    # ---------------------------------------------------------------- menu and closing
    def _build_menu(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        for text, shortcut, slot in (
                ("&Open model\u2026", QKeySequence.Open, self.new_run.picker.choose),
                ("Open &dataset\u2026", None, self.new_run.dataset.choose),
                ("&Load settings\u2026", None, self.new_run._load_dialog),
                ("&Save settings\u2026", None, self.new_run._save_dialog),
                ("Open runs &folder", None, self._open_runs_folder)):
            action = QAction(text, self)
            if shortcut is not None:
                action.setShortcut(shortcut)
            action.triggered.connect(slot)
            file_menu.addAction(action)
        file_menu.addSeparator()
        # Ctrl+Q spelled out: QKeySequence.Quit is empty on some desktops (and offscreen)
        quit_action = QAction("&Quit", self, shortcut=QKeySequence("Ctrl+Q"))
        quit_action.triggered.connect(self.close)
        file_menu.addAction(quit_action)
        view = self.menuBar().addMenu("&View")
        for i, key in enumerate(self.screens):
            action = QAction(SCREEN_TITLES[key], self, shortcut=QKeySequence(f"Ctrl+{i + 1}"))
            action.triggered.connect(lambda _=False, k=key: self.show_screen(k))
            view.addAction(action)
        view.addSeparator()
        themes = view.addMenu("&Theme")
        group = QActionGroup(self)
        self.theme_actions: dict[str, QAction] = {}
        for mode, text in (("system", "Like the &system"), ("light", "&Light"),
                           ("dark", "&Dark")):
            action = QAction(text, self, checkable=True)
            action.triggered.connect(lambda _=False, m=mode: self.set_theme(m))
            group.addAction(action)
            themes.addAction(action)
            self.theme_actions[mode] = action
        self.theme_actions[theme.current().mode].setChecked(True)
        help_menu = self.menuBar().addMenu("&Help")
        guide = QAction("User &guide", self)
        guide.triggered.connect(self._open_guide)
        about = QAction("&About", self)
        about.triggered.connect(lambda: QMessageBox.about(self, APP_NAME, about_text()))
        help_menu.addAction(guide)
        help_menu.addAction(about)

    def set_theme(self, mode: str) -> None:
        """View > Theme: `mode` (system, light or dark) now, and at the next start unless
        WORKBENCH_THEME says otherwise."""
        theme.apply_theme(mode=mode)
        self.theme_actions[mode].setChecked(True)
        self.ctx.settings.setValue(THEME_KEY, mode)

    def restore_theme(self) -> None:
        """At start: the theme chosen in View > Theme last time, unless WORKBENCH_THEME is set
        (it wins: `WORKBENCH_THEME=light workbench` for one session)."""
        mode = self.ctx.settings.value(THEME_KEY, "", type=str)
        if os.environ.get(theme.ENV) or mode not in theme.MODES:
            mode = theme.requested_mode()
        if mode != theme.current().mode:
            theme.apply_theme(mode=mode)
        self.theme_actions[mode].setChecked(True)

    def _open_runs_folder(self) -> None:
        root = self.ctx.runs_root()
        root.mkdir(parents=True, exist_ok=True)
        QDesktopServices.openUrl(QUrl.fromLocalFile(str(root)))

    def _open_guide(self) -> None:
        from app.views.context import REPO_ROOT

        QDesktopServices.openUrl(QUrl.fromLocalFile(str(REPO_ROOT / "docs" / "USER_GUIDE.md")))

    def closeEvent(self, event) -> None:         # noqa: N802 -- Qt override
        """Close the window only: the worker keeps training (reopening reattaches)."""
        self._status_poll.stop()
        self.ctx.settings.setValue("window/geometry", self.saveGeometry())
        for widget in self.screens.values():
            shutdown = getattr(widget, "shutdown", None)
            if callable(shutdown):
                shutdown()
        super().closeEvent(event)
