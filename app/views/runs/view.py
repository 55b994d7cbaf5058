"""The Queue and runs screen: every job in the queue and every run in the runs folder (runs
started from the command line too), with their type (SFT or GRPO), model, dataset, when they
were created, how long they ran, their steps, their best evaluation (validation loss, or a GRPO
run's held-out reward, and its step), where they run (this computer or a cluster, and the
attempt from the second on) and their status, and the actions on them.

The rows are gathered in the reader thread (`run_rows.collect_runs`: the queue's jobs,
`list_runs`, each run's status.json) every second and applied on the GUI thread; actions call the job
queue and refresh at once. A failed run's stored error (kind, message, hint, detail) shows in
the error panel. Test-visible state: `rows` (list of `RunRow`), `table`, `error_panel`,
`selected_row()`, and the action methods (`move_up`, `cancel`, `pause_or_resume`, `retry`,
`resume_from_checkpoint`, `extend`, `open_folder`).
"""

from __future__ import annotations

import os
import time
from datetime import datetime

from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QColor, QDesktopServices
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QLabel, QProgressBar,
                               QPushButton, QSpinBox, QTableWidget, QTableWidgetItem, QVBoxLayout,
                               QWidget)

from app.engine.api import KINDS, LOCAL, ConfigError, EngineError, JobStateError, RunDir
from app.views.runs.run_rows import Registered, RunRow, collect_runs
from app.views.widgets.error_panel import BUG_HINT, ErrorPanel
from app.views.widgets.run_tail import BackgroundPoll, clock

COLUMNS = ("Run", "Type", "Model", "Dataset", "Created", "Duration", "Steps", "Best", "Where",
           "Status")
COL = {name: i for i, name in enumerate(COLUMNS)}
STATE_COLORS = {"running": "#2f6fde", "done": "#2e7d4f", "failed": "#c0392b",
                "cancelled": "#6a737d", "paused": "#a15c07", "queued": "#4d545c",
                "missing": "#a0a7ae"}


def best_text(row: RunRow) -> str:
    """The best evaluation ("validation 1.37 at step 120"), else the latest loss or reward."""
    if row.best is not None:
        return f"{row.best.metric} {row.best.value:.3f} at step {row.best.step}"
    latest = row.reward if row.reward is not None else row.loss
    name = "reward" if row.reward is not None else "loss"
    return f"{name} {latest:.3f} (latest)" if isinstance(latest, (int, float)) else ""


def status_text(row: RunRow) -> str:
    """The state, the ETA of a running run, the job's number."""
    text = row.label
    if row.eta_s is not None:
        text += f" \u00b7 ETA {clock(row.eta_s)}"
    if row.job is not None:
        text += f" \u00b7 job {row.job.id}"
    return text


def attempt_of(row: RunRow) -> int:
    """The job's attempt: a cluster job's submissions (Job.attempt), a local job's worker
    deaths + 1 once it has started; 0 before."""
    job = row.job
    if job is None:
        return 0
    if job.executor != LOCAL:
        return job.attempt
    return job.attempts + 1 if job.started_at or job.attempts else 0


def where_text(row: RunRow) -> tuple[str, str]:
    """(text, tooltip) of the Where column: "this computer" or the cluster's name, and the
    attempt from the second on ("lab \u00b7 attempt 2")."""
    job = row.job
    place = "this computer" if job is None or job.executor == LOCAL else job.executor
    n = attempt_of(row)
    text = place + (f" \u00b7 attempt {n}" if n > 1 else "")
    if job is None:
        return text, "Run here, outside the queue (the command line)"
    tip = (f"Job {job.id} runs on this computer" if job.executor == LOCAL
           else f"Job {job.id} runs on cluster {job.executor}")
    if n:
        tip += f", attempt {n}"
    sid = (job.handle or {}).get("submission_id")
    return text, tip + (f" (Ray submission {sid})" if sid else "")


def error_from_dict(error: dict) -> EngineError:
    """A stored error (kind, message, hint) as an EngineError for `ErrorPanel.show_error`."""
    kind = error.get("kind") or "error"
    exc = EngineError(error.get("message") or "The run failed.",
                      error.get("hint") or (BUG_HINT if kind == "bug" else ""))
    exc.kind = kind
    return exc


def _progress_cell() -> QWidget:
    cell = QWidget()
    box = QHBoxLayout(cell)
    box.setContentsMargins(6, 0, 6, 0)
    cell.bar = QProgressBar(textVisible=True, maximumHeight=16, alignment=Qt.AlignCenter)
    box.addWidget(cell.bar)
    return cell


class RunsView(QWidget):
    """Every queued job and every run folder; see the module docstring."""

    def __init__(self, ctx, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.rows: list[RunRow] = []
        self.open_url = QDesktopServices.openUrl            # replaced in tests
        self._selected: str | None = None

        title = QLabel("Queue and runs", objectName="pageTitle")
        self.summary = QLabel(objectName="pageSubtitle")
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.table.setAlternatingRowColors(True)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeToContents)
        for name in ("Run", "Model", "Dataset", "Best", "Status"):   # share the width: the
            header.setSectionResizeMode(COL[name], QHeaderView.Stretch)  # table fits, no scroll
        self.table.setTextElideMode(Qt.ElideMiddle)
        header.setSectionResizeMode(COL["Steps"], QHeaderView.Fixed)
        self.table.setColumnWidth(COL["Steps"], 100)
        self.table.itemSelectionChanged.connect(self._on_selection)
        self.table.cellDoubleClicked.connect(lambda *_: self.ctx.show_screen("monitor"))

        b = self.buttons = {}
        for key, text, slot, tip in (
                ("up", "\u25b2 Up", self.move_up, "Move the job earlier in the queue"),
                ("down", "\u25bc Down", self.move_down, "Move the job later in the queue"),
                ("pause", "Pause", self.pause_or_resume,
                 "Pause (a running job checkpoints after its current step) or resume"),
                ("cancel", "Cancel", self.cancel, "Cancel the job"),
                ("retry", "Retry", self.retry,
                 "Queue a failed or cancelled run again; it continues from its last checkpoint"),
                ("resume", "Resume from checkpoint", self.resume_from_checkpoint,
                 "Queue a paused or interrupted run; it continues from its last checkpoint"),
                ("extend", "Extend by", self.extend,
                 "Train a finished run for more epochs (continues from its final checkpoint)"),
                ("folder", "Open folder", self.open_folder, "Open the run directory")):
            b[key] = QPushButton(text, clicked=lambda _=False, s=slot: s(), toolTip=tip)
        self.extend_epochs = QSpinBox(minimum=1, maximum=1000, value=1, suffix=" epoch(s)")
        bar = QWidget(objectName="runActions")
        bar.setStyleSheet("QPushButton:disabled, QSpinBox:disabled { color: #a7adb4; }")
        actions = QHBoxLayout(bar)
        actions.setContentsMargins(0, 0, 0, 0)
        for key in ("up", "down", "pause", "cancel", "retry", "resume"):
            actions.addWidget(b[key])
        actions.addSpacing(12)
        actions.addWidget(b["extend"])
        actions.addWidget(self.extend_epochs)
        actions.addStretch(1)
        actions.addWidget(b["folder"])
        self.error_panel = ErrorPanel()
        self.error_panel.hide()

        layout = QVBoxLayout(self)
        layout.setContentsMargins(20, 16, 20, 16)
        layout.addWidget(title)
        layout.addWidget(self.summary)
        layout.addWidget(bar)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.error_panel)

        self._refreshed_at = 0.0
        self._registered = Registered()
        self.poll = BackgroundPoll(self._collect, 1000, self)
        self.poll.result.connect(self._on_polled)
        # A new or changed run: read again now, on the reader thread. Reading every run (the
        # registered ones too, a list that grows with the user's history) took 230 ms of the
        # GUI thread when the window started a run, with a few hundred runs registered.
        ctx.runs_changed.connect(self.poll.tick)
        ctx.run_selected.connect(self._follow_selection)
        self._update_buttons()
        self.poll.start()

    # ---------------------------------------------------------------- rows
    def refresh(self) -> None:
        """Re-read the queue and the runs folder now (on this thread)."""
        self._refreshed_at = time.monotonic()
        self._apply(collect_runs(self.ctx.queue, self.ctx.runs_root(), self._registered()))

    def _collect(self) -> tuple[float, list]:                 # in the reader thread
        return time.monotonic(), collect_runs(self.ctx.queue, self.ctx.runs_root(),
                                              self._registered())

    def _on_polled(self, result: tuple) -> None:
        started, rows = result
        if started >= self._refreshed_at:                    # else older than a refresh
            self._apply(rows)

    def _apply(self, rows: list) -> None:
        self.rows = rows
        t = self.table
        t.blockSignals(True)
        if [r.path for r in rows] != [t.item(i, 0).data(Qt.UserRole) if t.item(i, 0) else None
                                      for i in range(t.rowCount())]:
            t.setRowCount(len(rows))
            for i, row in enumerate(rows):
                for c in range(len(COLUMNS)):
                    t.setItem(i, c, QTableWidgetItem())
                t.item(i, 0).setData(Qt.UserRole, row.path)
                t.setCellWidget(i, COL["Steps"], _progress_cell())
            t.clearSelection()
            if self._selected in [r.path for r in rows]:
                t.selectRow([r.path for r in rows].index(self._selected))
        for i, row in enumerate(rows):
            kind = KINDS[row.kind].label if row.kind in KINDS else row.kind
            created = (datetime.fromtimestamp(row.created).strftime("%Y-%m-%d %H:%M")
                       if row.created else "")
            where, where_tip = where_text(row)
            texts = (row.name, kind, row.model, row.dataset, created,
                     clock(row.duration_s) if row.duration_s else "", "", best_text(row),
                     where, status_text(row))
            for c, text in enumerate(texts):
                t.item(i, c).setText(text)
            t.item(i, 0).setToolTip(row.path)
            t.item(i, COL["Where"]).setToolTip(where_tip)
            t.item(i, COL["Best"]).setToolTip(texts[COL["Best"]])   # elided in a narrow window
            t.item(i, COL["Status"]).setForeground(QColor(STATE_COLORS.get(row.state,
                                                                           "#1f2328")))
            bar = t.cellWidget(i, COL["Steps"]).bar
            total = max(row.total, 1)
            bar.setRange(0, total)
            bar.setValue(total if row.state == "done" and row.total else min(row.step, total))
            bar.setFormat(f"{row.step}/{row.total}" if row.total else "\u2014")
        t.blockSignals(False)
        counts = {}
        for r in rows:
            counts[r.state] = counts.get(r.state, 0) + 1
        self.summary.setText(", ".join(f"{n} {s}" for s, n in counts.items()) or
                             f"No runs yet in {self.ctx.runs_root()}.")
        self._update_buttons()
        self._show_row_error()

    def selected_row(self) -> RunRow | None:
        return next((r for r in self.rows if r.path == self._selected), None)

    def select(self, path: str) -> None:
        """Select the row of run directory `path` (and make it the current run); a run not
        listed yet is selected when it appears."""
        path = str(RunDir(path).path)
        self._selected = path
        for i, row in enumerate(self.rows):
            if row.path == path:
                self.table.clearSelection()
                self.table.selectRow(i)

    def _follow_selection(self, path: str) -> None:
        """Another screen selected a run: show it selected here too (no signal back)."""
        path = str(RunDir(path).path) if path else None
        if path == self._selected:
            return
        self._selected = path
        self.table.blockSignals(True)
        self.table.clearSelection()
        for i, row in enumerate(self.rows):
            if row.path == path:
                self.table.selectRow(i)
        self.table.blockSignals(False)
        self.error_panel.hide()
        self._update_buttons()
        self._show_row_error()

    def _on_selection(self) -> None:
        items = self.table.selectedItems()
        path = self.table.item(items[0].row(), 0).data(Qt.UserRole) if items else None
        self._selected = path
        self._update_buttons()
        self.error_panel.hide()
        self._show_row_error()
        if path:
            self.ctx.select_run(path)

    def _show_row_error(self) -> None:
        row = self.selected_row()
        if row is not None and row.state == "failed" and row.error and (
                self.error_panel.isHidden() or self.error_panel.property("run") != row.path):
            self.error_panel.show_error(f"{row.name} failed", error_from_dict(row.error),
                                        self._error_context(row))
            self.error_panel.setProperty("run", row.path)
            self.error_panel.show()

    @staticmethod
    def _error_context(row: RunRow) -> str:
        detail = (row.error or {}).get("detail") or ""
        text = f"Run: {row.path}\nKind: {(row.error or {}).get('kind')}"
        return f"{text}\n\n{detail}".rstrip() if detail else text

    def _update_buttons(self) -> None:
        row = self.selected_row()
        job = row.job if row else None
        state = row.state if row else ""
        b = self.buttons
        pending = job is not None and state in ("queued", "paused")
        b["up"].setEnabled(pending)
        b["down"].setEnabled(pending)
        pausing = job is not None and job.requested_action == "pause"
        b["pause"].setText("Resume" if state == "paused" or pausing else "Pause")
        b["pause"].setEnabled(job is not None and (state in ("queued", "paused") or (
            state == "running" and job.requested_action in ("none", "pause"))))
        b["cancel"].setEnabled(job is not None and state in ("queued", "paused", "running")
                               and job.requested_action != "cancel")
        b["retry"].setEnabled(row is not None and state in ("failed", "cancelled"))
        b["resume"].setEnabled(row is not None and row.has_checkpoint and (
            (job is not None and state == "paused") or
            (job is None and (state in ("paused", "failed", "cancelled") or row.stalled))))
        b["extend"].setEnabled(row is not None and state == "done" and row.epochs > 0)
        self.extend_epochs.setEnabled(b["extend"].isEnabled())
        b["folder"].setEnabled(row is not None)

    # ---------------------------------------------------------------- actions
    def _act(self, what: str, action) -> None:
        row = self.selected_row()
        if row is None:
            return
        try:
            message = action(row)
        except EngineError as e:
            self.error_panel.show_error(f"Could not {what} {row.name}", e, row.path)
            self.error_panel.setProperty("run", None)
            self.error_panel.show()
        else:
            self.error_panel.hide()
            if message:
                self.ctx.status_message.emit(message)
        self.refresh()                                      # the user's own action, at once
        self.ctx.runs_changed.emit()

    def _queue_up(self, row: RunRow) -> str:
        """Queue the run directory (a new job) and make sure a worker will run it."""
        job_id = self.ctx.queue.add(row.path)
        self._start_worker()
        return f"Queued {row.name} as job {job_id}"

    def _start_worker(self) -> None:
        try:
            self.ctx.ensure_worker()
        except EngineError as e:
            self.ctx.status_message.emit(f"Could not start the worker: {e.message}")

    def move_up(self) -> None:
        self._act("move", lambda r: self.ctx.queue.move_up(r.job.id) and None)

    def move_down(self) -> None:
        self._act("move", lambda r: self.ctx.queue.move_down(r.job.id) and None)

    def pause_or_resume(self) -> None:
        def act(row):
            if row.state == "paused" or row.job.requested_action == "pause":
                self.ctx.queue.resume(row.job.id)
                self._start_worker()
                return f"Resumed job {row.job.id}"
            self.ctx.queue.pause(row.job.id)
            return f"Pausing job {row.job.id}" + (" after its current step"
                                                  if row.state == "running" else "")
        self._act("pause or resume", act)

    def cancel(self) -> None:
        self._act("cancel", lambda r: self.ctx.queue.cancel(r.job.id) and
                  f"Cancelled job {r.job.id}")

    def retry(self) -> None:
        def act(row):
            if row.job is None:
                return self._queue_up(row)
            self.ctx.queue.retry(row.job.id)
            self._start_worker()
            return f"Job {row.job.id} queued again"
        self._act("retry", act)

    def resume_from_checkpoint(self) -> None:
        def act(row):
            if row.job is not None and row.state == "paused":
                self.ctx.queue.resume(row.job.id)
                self._start_worker()
                return f"Resumed job {row.job.id}"
            return self._queue_up(row)
        self._act("resume", act)

    def extend(self, epochs: int | None = None) -> None:
        """Add `epochs` (default: the spin box) to a finished run's config and queue it; like
        `workbench resume RUN --extend-epochs N`, it continues from its final checkpoint."""
        n = int(epochs if epochs is not None else self.extend_epochs.value())

        def act(row):
            if row.job is not None and row.state in ("running", "queued", "paused"):
                raise JobStateError(f"{row.name} is {row.state}; only a finished run can be "
                                    "extended.", "Wait until it is done.")
            run = RunDir(row.path)
            cfg = run.config()
            if not cfg.get("epochs"):
                raise ConfigError("Only runs that count epochs can be extended by epochs.",
                                  "This run counts steps (epochs 0): edit max_steps in its "
                                  "config.json and resume it.")
            cfg["epochs"] = int(cfg["epochs"]) + n
            run.write_config(cfg)
            return self._queue_up(row) + f" for {cfg['epochs']} epochs in all"
        self._act("extend", act)

    def closeEvent(self, event) -> None:
        self.poll.stop()
        super().closeEvent(event)

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.poll.start()

    def open_folder(self) -> None:
        row = self.selected_row()
        if row is not None and os.path.isdir(row.path):
            self.open_url(QUrl.fromLocalFile(row.path))
