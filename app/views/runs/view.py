"""The Queue and runs screen: every job in the queue and every run in the runs folder (runs
started from the command line too), with their type (SFT or GRPO), model, dataset, when they
were created, how long they ran, their steps, their best evaluation (validation loss, or a GRPO
run's held-out reward, and its step), where they run (this computer or a cluster, and the
attempt from the second on) and their status, and the actions on them.

The rows are gathered in the reader thread every second (`run_rows.RunLister`: only the runs
whose files changed are read again) and shown by a model (`table.RunsModel`), so 10,000 runs
keep the window responsive; a list of runs that cannot be read (or lines of it) is said above
the table. Headers sort (a third click: the queue's order again), the filter box matches name, model, dataset, type and state. A details
pane (collapsible) shows the selected run's paths, best checkpoint, settings, exports and
evaluations. Actions call the job queue and refresh at once; "Continue" is the one way to go on
with a run from its last checkpoint (a paused job, a failed or cancelled one, a run stopped
outside the queue). Rename gives a display name (the folder keeps its name: the queue and other
runs name it by path); Delete moves the folder to the trash after asking, and refuses a run
that is queued or running. A failed run's stored error (kind, message, hint, detail) shows in
the error panel. Test-visible state: `rows` (list of `RunRow`, all of them), `model` (what the
table shows), `text(i, column)`, `error_panel`, `problem_label`, `details`, `selected_row()`,
and the action methods.
"""

from __future__ import annotations

import os
import time

from PySide6.QtCore import QEvent, QFile, Qt, QUrl
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QInputDialog, QLabel,
                               QLineEdit, QMessageBox, QPushButton, QSpinBox, QSplitter,
                               QVBoxLayout, QWidget)

from app.engine.api import (ConfigError, EngineError, JobStateError, RunDir, can_continue,
                            forget_run, rename_run)
from app.views.runs.details import DetailsPane
from app.views.runs.run_rows import Listing, RunLister, RunRow
from app.views.runs.table import (COL, COLUMNS, ELIDED_MIN, ELIDING, PADDING, PATH_ROLE,
                                  RUN_SAMPLE, SAMPLES, ProgressDelegate, RunsModel, RunsTable)
from app.views.widgets.error_panel import BUG_HINT, ErrorPanel
from app.views.widgets.fit import FlowLayout
from app.views.widgets.run_tail import BackgroundPoll
from app.views.widgets.tooltips import CONTINUE_TIP

__all__ = ["COL", "COLUMNS", "RunsView", "error_from_dict"]
ACTIVE = ("running", "queued", "paused")


def error_from_dict(error: dict) -> EngineError:
    """A stored error (kind, message, hint) as an EngineError for `ErrorPanel.show_error`."""
    kind = error.get("kind") or "error"
    exc = EngineError(error.get("message") or "The run failed.",
                      error.get("hint") or (BUG_HINT if kind == "bug" else ""))
    exc.kind = kind
    return exc


class RunsView(QWidget):
    """Every queued job and every run folder; see the module docstring."""

    def __init__(self, ctx, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.rows: list[RunRow] = []
        self.open_url = QDesktopServices.openUrl            # replaced in tests
        self.confirm = self._confirm                        # replaced in tests
        self.ask_name = self._ask_name                      # replaced in tests
        self.trash = QFile.moveToTrash                      # replaced in tests
        self._selected: str | None = None
        self._details_row: RunRow | None = None

        title = QLabel("Queue and runs", objectName="pageTitle")
        self.summary = QLabel(objectName="pageSubtitle")
        self.problem_label = QLabel(objectName="runsProblem", wordWrap=True)
        self.problem_label.hide()
        self.filter_box = QLineEdit(placeholderText="Filter: name, model, dataset, type, state",
                                    clearButtonEnabled=True, toolTip=(
                                        "Show only the runs whose name, model, dataset, type "
                                        "or state contain every word typed here"))
        self.filter_box.textChanged.connect(self._on_filter)

        self.model = RunsModel(self)
        t = self.table = RunsTable()
        t.setModel(self.model)
        t.setSelectionBehavior(QAbstractItemView.SelectRows)
        t.setSelectionMode(QAbstractItemView.SingleSelection)
        t.setEditTriggers(QAbstractItemView.NoEditTriggers)
        t.setAlternatingRowColors(True)
        t.setTextElideMode(Qt.ElideMiddle)                  # a long name keeps both ends
        t.setWordWrap(False)
        t.setItemDelegateForColumn(COL["Steps"], ProgressDelegate(t))
        vertical = t.verticalHeader()
        vertical.setVisible(False)
        vertical.setSectionResizeMode(QHeaderView.Fixed)
        vertical.setDefaultSectionSize(26)
        header = t.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.Interactive)
        header.setMinimumSectionSize(40)
        header.setSectionResizeMode(COL["Run"], QHeaderView.Stretch)
        self._fit_columns()
        t.resized.connect(self._fit_columns)
        header.setSortIndicator(-1, Qt.AscendingOrder)      # the queue's order until a click
        t.setSortingEnabled(True)
        self._sorted_by = (-1, Qt.AscendingOrder)
        header.sortIndicatorChanged.connect(self._on_sort)
        t.selectionModel().selectionChanged.connect(lambda *_: self._on_selection())
        t.doubleClicked.connect(lambda *_: self.ctx.show_screen("monitor"))

        b = self.buttons = {}
        for key, text, slot, tip in (
                ("up", "\u25b2 Up", self.move_up, "Move the job earlier in the queue"),
                ("down", "\u25bc Down", self.move_down, "Move the job later in the queue"),
                ("pause", "Pause", self.pause,
                 "Pause the job: a running job saves a checkpoint after its current step; "
                 "Continue goes on from there"),
                ("cancel", "Cancel", self.cancel, "Cancel the job"),
                ("continue", "Continue", self.continue_run, CONTINUE_TIP),   # as in Monitor
                ("extend", "Extend by", self.extend,
                 "Train a finished run for more epochs (continues from its final checkpoint)"),
                ("rename", "Rename\u2026", self.rename,
                 "Give the run a display name; its folder keeps its name"),
                ("delete", "Delete\u2026", self.delete,
                 "Move the run's folder to the trash (asks first); a queued or running run "
                 "cannot be deleted"),
                ("folder", "Open folder", self.open_folder, "Open the run directory")):
            b[key] = QPushButton(text, clicked=lambda _=False, s=slot: s(), toolTip=tip)
        self.extend_epochs = QSpinBox(minimum=1, maximum=1000, value=1, suffix=" epoch(s)",
                                      toolTip="How many epochs Extend adds")
        b["details"] = QPushButton("Details", checkable=True, checked=True,
                                   toolTip="Show or hide the selected run's details")
        bar = QWidget(objectName="runActions")
        # one line when the window is wide enough (about 1,000 px), else wrapped
        actions = FlowLayout(bar)
        for key in ("up", "down", "pause", "cancel", "continue"):
            actions.addWidget(b[key])
        extend = QWidget()                  # the spin box stays beside its button
        extend_row = QHBoxLayout(extend)
        extend_row.setContentsMargins(8, 0, 0, 0)
        extend_row.addWidget(b["extend"])
        extend_row.addWidget(self.extend_epochs)
        actions.addWidget(extend)
        actions.add_stretch()
        for key in ("rename", "delete", "folder"):
            actions.addWidget(b[key])
        self.error_panel = ErrorPanel()
        self.error_panel.hide()

        self.details = DetailsPane()
        b["details"].toggled.connect(self.details.setVisible)
        split = self.splitter = QSplitter(Qt.Vertical, childrenCollapsible=False)
        split.addWidget(t)
        split.addWidget(self.details)
        split.setStretchFactor(0, 1)
        split.setSizes([400, 170])                          # the details' seven lines

        top = QHBoxLayout()
        top.addWidget(self.summary, 1)
        top.addWidget(self.filter_box, 1)
        top.addWidget(b["details"])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(20, 16, 20, 16)
        layout.addWidget(title)
        layout.addLayout(top)
        layout.addWidget(self.problem_label)
        layout.addWidget(bar)
        layout.addWidget(split, 1)
        layout.addWidget(self.error_panel)

        self._refreshed_at = 0.0
        self.lister = RunLister()
        self.poll = BackgroundPoll(self._collect, 1000, self)
        self.poll.result.connect(self._on_polled)
        self.poll.failed.connect(self._on_poll_failed)
        # A new or changed run: list and read again now, on the reader thread.
        ctx.runs_changed.connect(self._runs_changed)
        ctx.run_selected.connect(self._follow_selection)
        self._update_buttons()
        self.poll.start()

    # ---------------------------------------------------------------- rows
    def refresh(self) -> None:
        """List the runs again now, on this thread (the user's own action, and tests)."""
        self._refreshed_at = time.monotonic()
        self.lister.invalidate()
        self._apply(self.lister(self.ctx.queue, self.ctx.runs_root()))

    def _runs_changed(self) -> None:
        self.lister.invalidate()
        self.poll.tick()

    def _collect(self) -> tuple[float, Listing]:              # in the reader thread
        return time.monotonic(), self.lister(self.ctx.queue, self.ctx.runs_root())

    def _on_polled(self, result: tuple) -> None:
        started, listing = result
        if started >= self._refreshed_at:                    # else older than a refresh
            self._apply(listing)

    def _on_poll_failed(self, error: BaseException) -> None:
        """A read that failed is said, not swallowed (the next poll tries again)."""
        text = (error.message if isinstance(error, EngineError)
                else f"{type(error).__name__}: {error}")
        self._show_problem(f"The runs could not be read: {text}")

    def _show_problem(self, text: str) -> None:
        self.problem_label.setText(text)
        self.problem_label.setToolTip(text)
        self.problem_label.setVisible(bool(text))

    def _apply(self, listing: Listing) -> None:
        self.rows = listing.rows
        self._show_problem(listing.problem)
        self.model.set_rows(listing.rows)
        self._restore_selection()
        counts: dict[str, int] = {}
        for r in self.rows:
            counts[r.state_word] = counts.get(r.state_word, 0) + 1
        text = ", ".join(f"{n} {s}" for s, n in counts.items())
        if self.model.shown is not self.rows and len(self.model.shown) != len(self.rows):
            text += f" \u00b7 {len(self.model.shown)} shown"
        self.summary.setText(text or f"No runs yet in {self.ctx.runs_root()}.")
        self._update_buttons()
        self._show_row_error()
        self._show_details()

    def text(self, i: int, column: str) -> str:
        """The text of row `i`'s cell in `column` as the table shows it (tests)."""
        return self.model.index(i, COL[column]).data() or ""

    def _restore_selection(self) -> None:
        """Keep the selected run selected (by path) across resets, without a signal."""
        i = self.model.row_of(self._selected)
        sel = self.table.selectionModel()
        current = sel.selectedRows()
        if (current[0].row() if current else -1) == i:
            return
        sel.blockSignals(True)
        sel.clearSelection()
        if i >= 0:
            self.table.selectRow(i)
        sel.blockSignals(False)
        self.table.viewport().update()

    def _on_sort(self, section: int, order) -> None:
        """A header's third click (ascending, descending, then this) gives the queue's order
        back: running and queued jobs first, then the most recently updated runs."""
        last, self._sorted_by = self._sorted_by, (section, order)
        if section >= 0 and last == (section, Qt.DescendingOrder) and order == Qt.AscendingOrder:
            self.table.horizontalHeader().setSortIndicator(-1, Qt.AscendingOrder)

    def _on_filter(self, text: str) -> None:
        self.model.set_filter(text)
        self._apply(Listing(self.rows, self.problem_label.text()))

    def selected_row(self) -> RunRow | None:
        return next((r for r in self.rows if r.path == self._selected), None)

    def select(self, path: str) -> None:
        """Select the row of run directory `path` (and make it the current run); a run not
        listed yet is selected when it appears."""
        path = str(RunDir(path).path)
        self._selected = path
        i = self.model.row_of(path)
        if i >= 0:
            self.table.clearSelection()
            self.table.selectRow(i)

    def _follow_selection(self, path: str) -> None:
        """Another screen selected a run: show it selected here too (no signal back)."""
        path = str(RunDir(path).path) if path else None
        if path == self._selected:
            return
        self._selected = path
        self._restore_selection()
        self.error_panel.hide()
        self._update_buttons()
        self._show_row_error()
        self._show_details()

    def _on_selection(self) -> None:
        rows = self.table.selectionModel().selectedRows()
        path = rows[0].data(PATH_ROLE) if rows else None
        self._selected = path
        self._update_buttons()
        self.error_panel.hide()
        self._show_row_error()
        self._show_details()
        if path:
            self.table.scrollTo(rows[0])
            self.ctx.select_run(path)

    def _show_details(self) -> None:
        """The selected run's details, read again only when its row changed (a new object)."""
        row = self.selected_row()
        if row is not self._details_row or row is None:
            self.details.show_row(row)
            self._details_row = row

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
        b["pause"].setEnabled(job is not None and job.requested_action == "none" and
                              state in ("queued", "running"))
        b["cancel"].setEnabled(job is not None and state in ACTIVE
                               and job.requested_action != "cancel")
        b["continue"].setEnabled(self._continuable(row))
        b["extend"].setEnabled(row is not None and state == "done" and row.epochs > 0)
        self.extend_epochs.setEnabled(b["extend"].isEnabled())
        b["rename"].setEnabled(row is not None and state != "missing")
        b["delete"].setEnabled(row is not None and not self._busy(row))
        b["folder"].setEnabled(row is not None)

    @staticmethod
    def _continuable(row: RunRow | None) -> bool:
        """api.can_continue, as the Monitor's Continue asks it."""
        return row is not None and can_continue(row.job, row.state, row.has_checkpoint,
                                                row.stalled)

    @staticmethod
    def _busy(row: RunRow) -> bool:
        """Queued, paused in the queue, or running (a run of the command line too)."""
        return ((row.job is not None and row.state in ACTIVE) or
                (row.job is None and row.state == "running" and not row.stalled))

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

    def pause(self) -> None:
        def act(row):
            self.ctx.queue.pause(row.job.id)
            return f"Pausing job {row.job.id}" + (" after its current step"
                                                  if row.state == "running" else "")
        self._act("pause", act)

    def cancel(self) -> None:
        self._act("cancel", lambda r: self.ctx.queue.cancel(r.job.id) and
                  f"Cancelled job {r.job.id}")

    def continue_run(self) -> None:
        """Go on from the last checkpoint (JobQueue.continue_run, the Monitor's Continue too):
        resume a paused job (or take back a pause request), queue a failed or cancelled job
        again, or queue a run stopped outside the queue."""
        def act(row):
            message = self.ctx.queue.continue_run(row.path, row.job)
            self._start_worker()
            return message
        self._act("continue", act)

    def extend(self, epochs: int | None = None) -> None:
        """Add `epochs` (default: the spin box) to a finished run's config and queue it; like
        `workbench resume RUN --extend-epochs N`, it continues from its final checkpoint."""
        n = int(epochs if epochs is not None else self.extend_epochs.value())

        def act(row):
            if row.job is not None and row.state in ACTIVE:
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

    def rename(self, name: str | None = None) -> None:
        """Give the selected run a display name (`name`, else asked); empty: its folder's."""
        row = self.selected_row()
        if row is None:
            return
        if name is None:
            name = self.ask_name(row)
            if name is None:
                return
        self._act("rename", lambda r: f"Renamed {r.name} to {rename_run(r.path, name)}")

    def delete(self) -> None:
        """Move the selected run's folder to the trash (after asking) and drop it from the
        list. A queued, paused or running run is refused (cancel it first); where the system
        has no trash the folder is kept and the refusal says how to delete it by hand: the
        window never deletes a run for good."""
        row = self.selected_row()
        if row is None:
            return

        def act(r):
            if self._busy(r):
                raise JobStateError(f"{r.name} is {r.state}: it cannot be deleted.",
                                    "Cancel it first (or wait until it ends).")
            if os.path.lexists(r.path) and not self.trash(r.path):
                raise ConfigError(f"{r.path} could not be moved to the trash (this system "
                                  "or this disk has none).",
                                  "Nothing was deleted. Delete the folder yourself (Open "
                                  "folder) if you want it gone.")
            forget_run(r.path)
            self.lister.invalidate()
            return f"Moved {r.name} to the trash"

        if self._busy(row) or self.confirm(
                "Delete run", f"Move {row.name} to the trash?\n\n{row.path}\n\nIts "
                "checkpoints and exports go with it; the trash can restore the folder."):
            self._act("delete", act)

    def _confirm(self, title: str, text: str) -> bool:
        return QMessageBox.question(self, title, text) == QMessageBox.Yes

    def _ask_name(self, row: RunRow) -> str | None:
        name, ok = QInputDialog.getText(
            self, "Rename run", f"Display name (the folder {row.folder} keeps its name; "
            "empty: the folder's name):", text=row.name)
        return name if ok else None

    def _fit_columns(self) -> None:
        """Each column at its sample's width in the font the table shows (polished first: the
        style sheet's font is not the widget's before), Run stretching over the rest; where
        that leaves Run too narrow for a default name, the eliding columns give up width."""
        t = self.table
        t.ensurePolished()
        metrics = t.fontMetrics()
        widths = {name: metrics.horizontalAdvance(sample) + PADDING
                  for name, sample in SAMPLES.items()}
        short = (metrics.horizontalAdvance(RUN_SAMPLE) + PADDING + sum(widths.values())
                 - t.viewport().width())
        spare = sum(max(0, widths[name] - ELIDED_MIN) for name in ELIDING)
        if short > 0 and spare > 0:
            share = min(1.0, short / spare)
            for name in ELIDING:
                widths[name] -= round(max(0, widths[name] - ELIDED_MIN) * share)
        for name, width in widths.items():
            t.setColumnWidth(COL[name], width)

    def changeEvent(self, event) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.FontChange, QEvent.StyleChange):
            self._fit_columns()

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
