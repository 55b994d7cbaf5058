"""The contract between screens: one `AppContext` shared by every screen of the window.

Every screen is a QWidget built as `Screen(ctx: AppContext, parent=None)`. Screens talk to
each other only through this object (its signals and `current_run`); the engine process is
reached through `ctx.queue` (the job queue) and run directories on disk, which are the state:
closing the window never stops training and reopening it reattaches.

Nothing heavy is imported here (the engine's queue module only for typing).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QObject, QRunnable, QSettings, QThreadPool, Signal

if TYPE_CHECKING:  # pragma: no cover
    from app.engine.api import ClusterStore, JobQueue

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE_DATA = REPO_ROOT / "sample_data"
ORG_NAME = "gguf-workbench"
SETTINGS_APP = "GGUF Workbench"        # = app.views.main_window.APP_NAME (recent files live here)
SCREENS = ("new_run", "runs", "monitor", "experts", "playground", "export", "evaluate",
           "settings")


def sample_model_path() -> str | None:
    """The bundled tiny MoE model, `<repo>/sample_data/tiny-moe.gguf`, if it is there."""
    path = SAMPLE_DATA / "tiny-moe.gguf"
    return str(path) if path.is_file() else None


def sample_dataset_path(name: str = "chat.jsonl") -> str | None:
    """A bundled dataset, `<repo>/sample_data/<name>`, if it is there."""
    path = SAMPLE_DATA / name
    return str(path) if path.is_file() else None


class AppContext(QObject):
    """State and signals shared by the screens.

    Signals:
      run_selected(str)   a run directory path; Monitor, Experts, Playground and Export follow it
      model_selected(str) a GGUF path picked anywhere
      runs_changed()      a run was queued, started or removed (the Runs screen refreshes)
      clusters_changed()  a cluster was added, changed or removed (Settings > Clusters);
                          New run's "Run on" reads the list again
      status_message(str) a short message for the window's status bar
      navigate(str)       ask the shell to show a screen by key (one of SCREENS: "new_run",
                          "runs", "monitor", "experts", "playground", "export", "settings")
      error_reported(str, object, str)
                          title, exception, context: the window's error funnel shows it
                          (message, hint, expandable details; see error_panel.describe_error)
    """

    run_selected = Signal(str)
    model_selected = Signal(str)
    runs_changed = Signal()
    clusters_changed = Signal()
    status_message = Signal(str)
    navigate = Signal(str)
    error_reported = Signal(str, object, str)

    def __init__(self, queue: "JobQueue", settings: QSettings | None = None,
                 parent: QObject | None = None, *, runs_root: str | os.PathLike | None = None):
        super().__init__(parent)
        self.queue = queue
        self.settings = settings if settings is not None else QSettings(ORG_NAME, SETTINGS_APP)
        self.current_run: str | None = None
        self.current_model: str | None = None
        self._runs_root = Path(runs_root).expanduser() if runs_root is not None else None

    # ---------------------------------------------------------------- selection
    def select_run(self, path: str | os.PathLike) -> None:
        """Make `path` the current run and emit `run_selected` (also when it is unchanged, so a
        screen can ask the others to refresh)."""
        self.current_run = str(path)
        self.run_selected.emit(self.current_run)

    def select_model(self, path: str | os.PathLike) -> None:
        """Remember `path` as the current model and emit `model_selected`."""
        self.current_model = str(path)
        self.model_selected.emit(self.current_model)

    def show_screen(self, key: str) -> None:
        """Ask the shell to switch to the screen `key`."""
        self.navigate.emit(key)

    def notify_runs_changed(self) -> None:
        self.runs_changed.emit()

    def report_error(self, title: str, error: BaseException, context: str = "") -> None:
        """Send an error to the window's one funnel (EngineError: message + hint; anything
        else: a bug with its traceback in the details)."""
        self.error_reported.emit(title, error, context)

    def status(self, message: str) -> None:
        self.status_message.emit(message)

    # ---------------------------------------------------------------- engine process
    def ensure_worker(self) -> int | None:
        """Start the engine worker process for `queue` unless one runs; its pid (or None)."""
        from app.engine.api import ensure_worker

        return ensure_worker(self.queue.path)

    def queue_new_run(self, path: str | os.PathLike, config: dict, first: bool,
                      executor: str = "local") -> int | None:
        """Write the run directory `path` with `config`, queue it (ahead of the waiting jobs
        when `first`) to run on `executor` ("local" or a cluster's name) and make sure a worker
        runs (its pid; it also submits and follows cluster jobs). A cluster that cannot see
        `path` (its path map) refuses before the folder is made. Call it off the GUI thread."""
        from app.engine.api import LOCAL, PENDING, RunDir

        if executor != LOCAL:
            self.clusters().get(executor).cluster_path(path)
        run = RunDir.create(path, config)
        priority = 0
        if first:
            pending = self.queue.list(PENDING)
            priority = max((j.priority for j in pending), default=0) + (1 if pending else 0)
        self.queue.add(run.path, priority, executor=executor)
        return self.ensure_worker()

    def clusters(self) -> "ClusterStore":
        """The clusters runs can be sent to: clusters.json beside the queue's database (the
        tokens are in the OS keyring)."""
        return self.queue.clusters()

    def stop_worker(self, timeout: float = 20.0) -> bool:
        """Stop the queue's worker (its running job is checkpointed and requeued) and wait
        for it; True when none runs any more."""
        from app.engine.api import stop_worker

        return stop_worker(self.queue.path, timeout)

    def worker_running(self) -> bool:
        from app.engine.api import worker_running

        return worker_running(self.queue.path)

    def worker_pid(self) -> int | None:
        from app.engine.api import worker_pid

        return worker_pid(self.queue.path)

    # ---------------------------------------------------------------- places
    def runs_root(self) -> Path:
        """Where new runs go: the override given at construction, else env `WORKBENCH_RUNS`,
        else the engine's default runs directory."""
        if self._runs_root is not None:
            return self._runs_root
        env = os.environ.get("WORKBENCH_RUNS")
        if env:
            return Path(env).expanduser()
        from app.engine.api import default_runs_dir

        return default_runs_dir()

    def set_runs_root(self, path: str | os.PathLike | None) -> None:
        self._runs_root = Path(path).expanduser() if path is not None else None


# ---------------------------------------------------------------- work off the GUI thread
class _TaskSignals(QObject):
    finished = Signal(str, int, bool, object)    # key, request id, ok, result or exception


class _Task(QRunnable):
    def __init__(self, signals: _TaskSignals, key: str, request: int, fn: Callable, args, kwargs):
        super().__init__()
        self._signals, self._key, self._request = signals, key, request
        self._fn, self._args, self._kwargs = fn, args, kwargs

    def run(self) -> None:
        try:
            result, ok = self._fn(*self._args, **self._kwargs), True
        except BaseException as exc:    # noqa: BLE001 -- handed to the caller's on_error
            result, ok = exc, False
        try:
            self._signals.finished.emit(self._key, self._request, ok, result)
        except RuntimeError:            # the owner was deleted meanwhile
            pass


class Background(QObject):
    """Run slow calls (reading a model header, linting, scanning folders) in worker threads and
    get the result back on the GUI thread. Per `key`, only the newest request's callbacks run:
    a result that a newer `run(key, ...)` superseded is dropped.

        self.bg = Background(self)
        self.bg.run("lint", lint_file, data, model, on_done=self._show, on_error=self._fail)
    """

    def __init__(self, parent: QObject | None = None, max_threads: int = 2):
        super().__init__(parent)
        # The pool is created before the signals object, so it is destroyed first and its
        # destructor waits for running tasks while the signals object still exists.
        self._pool = QThreadPool(self)
        self._pool.setMaxThreadCount(max_threads)
        self._signals = _TaskSignals(self)
        self._signals.finished.connect(self._on_finished)
        self._latest: dict[str, int] = {}
        self._callbacks: dict[tuple[str, int], tuple[Callable | None, Callable | None]] = {}
        self._counter = 0

    def run(self, key: str, fn: Callable, *args: Any,
            on_done: Callable[[Any], None] | None = None,
            on_error: Callable[[BaseException], None] | None = None, **kwargs: Any) -> int:
        self._counter += 1
        request = self._counter
        self._latest[key] = request
        self._callbacks[(key, request)] = (on_done, on_error)
        self._pool.start(_Task(self._signals, key, request, fn, args, kwargs))
        return request

    def cancel(self, key: str) -> None:
        """Forget the pending request of `key` (its result will be dropped)."""
        self._latest.pop(key, None)

    def busy(self, key: str | None = None) -> bool:
        """Is a request (of `key`) still waiting for its result?"""
        if key is None:
            return bool(self._callbacks)
        return any(k == key for k, _ in self._callbacks)

    def wait(self, timeout_ms: int = -1) -> bool:
        """Block until every task finished (tests and shutdown only)."""
        return self._pool.waitForDone(timeout_ms)

    def _on_finished(self, key: str, request: int, ok: bool, result: object) -> None:
        on_done, on_error = self._callbacks.pop((key, request), (None, None))
        if self._latest.get(key) != request:
            return
        del self._latest[key]
        if ok:
            if on_done is not None:
                on_done(result)
        elif on_error is not None:
            on_error(result)
