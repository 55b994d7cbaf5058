"""The Runs screen's table: a model over the `RunRow`s (no widget per cell), its texts, sorting,
filtering and the Steps column's progress bar, painted by a delegate.

Thousands of runs cost the GUI thread only what it shows: `RunsModel.set_rows` compares the new
rows with the shown ones by identity (the reader keeps an unchanged run's `RunRow` object, see
`run_rows`) and signals only the rows that changed; a cell's text is made when the view paints
it. A run appearing or leaving, a sort or a filter resets the model (the view keeps the
selection by path). Sorting and filtering are the model's own (plain Python lists: a
QSortFilterProxyModel would call `data()` from C++ for every comparison).

The cells are compact so that ten columns fit 1280x720: Best is "1.284 @ 177" (the header's
tooltip says which metric), a name is elided in the middle only when it does not fit and the
tooltip carries it whole with its folder.
"""

from __future__ import annotations

from datetime import datetime

from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (QApplication, QStyle, QStyledItemDelegate, QStyleOptionProgressBar,
                               QTableView)

from app.engine.api import KINDS, LOCAL, PREFERENCE_KINDS
from app.views.runs.run_rows import RunRow
from app.views.widgets import theme
from app.views.widgets.run_tail import clock

COLUMNS = ("Run", "Type", "Model", "Dataset", "Created", "Duration", "Steps", "Best", "Where",
           "Status")
COL = {name: i for i, name in enumerate(COLUMNS)}
# Each column's width: its sample text in the table's font as the style sheet sets it (so at
# any scale), plus padding; Run takes the rest. Longer models and datasets are elided in the middle, whole in the tooltip.
SAMPLES = {"Type": "GRPO", "Model": "tiny-moe.gguf", "Dataset": "addition.jsonl",
           "Created": "2026-11-28 06:47", "Duration": "10:00:00", "Steps": "1000/1000",
           "Best": "1.284 @ 1770", "Where": "this computer", "Status": "running \u00b7 ETA 0:00:07"}
PADDING = 20
# A narrow table: the Run column keeps a default name whole (a run's "<created>-<dataset>",
# an evaluation's "<created>-<id>", the longer), and the columns that elide (Model, Dataset,
# Where) give up width for it, down to ELIDED_MIN each.
RUN_SAMPLE = "20261128-084514-7a07bc"
ELIDING = ("Model", "Dataset", "Where")
ELIDED_MIN = 60
HEADER_TIPS = {
    "Run": "The run's name (a display name given here, else its folder's); hover for its folder",
    "Type": "SFT (supervised fine-tuning) or GRPO (reinforcement learning with rewards)",
    "Created": "When the run started (its first event), else when it was created",
    "Duration": "How long it trained (h:mm:ss)",
    "Steps": "Steps done of the run's total",
    "Best": "The best evaluation and its step: 1.284 @ 177 is a validation loss of 1.284 at "
            "step 177 (supervised: lower is better) or a GRPO run's held-out reward (higher "
            "is better). Before the first evaluation: the latest training loss or reward",
    "Where": "This computer or the cluster the job runs on, and its attempt from the second on",
    "Status": "The run's state and its ETA while it runs; hover for its job in the queue",
}
# a state's colour: a name of widgets/theme.py's palettes
STATE_COLORS = {"running": "accent", "done": "done", "failed": "bad", "cancelled": "muted",
                "paused": "warn", "queued": "hint", "missing": "disabled_text"}
PATH_ROLE = Qt.UserRole                 # the run's folder
PROGRESS_ROLE = Qt.UserRole + 1         # (step, total, done) for the progress delegate


def best_text(row: RunRow) -> tuple[str, str]:
    """(cell, tooltip) of Best: "1.284 @ 177", else the latest loss or reward."""
    if row.best is not None:
        return (f"{row.best.value:.3f} @ {row.best.step}",
                f"Best {row.best.metric} {row.best.value:.4f} at step {row.best.step}")
    latest = row.reward if row.reward is not None else row.loss
    if not isinstance(latest, (int, float)):
        return "", ""
    name = "reward" if row.reward is not None else "training loss"
    return f"{latest:.3f} latest", f"No evaluation yet: the latest {name}, {latest:.4f}"


def status_text(row: RunRow) -> tuple[str, str]:
    """(cell, tooltip) of Status: the state and a running run's ETA; the tooltip adds the
    job's number (or says the run is outside the queue)."""
    text = row.label + (f" \u00b7 ETA {clock(row.eta_s)}" if row.eta_s is not None else "")
    where = f"job {row.job.id} in the queue" if row.job is not None else "outside the queue"
    return text, f"{text} ({where})"


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


def kind_label(row: RunRow) -> str:
    kinds = {**KINDS, **PREFERENCE_KINDS}        # with DPO, ORPO, SimPO, KTO
    return kinds[row.kind].label if row.kind in kinds else row.kind


def cells(row: RunRow) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(texts, tooltips) of a row's cells, one per column."""
    created = (datetime.fromtimestamp(row.created).strftime("%Y-%m-%d %H:%M")
               if row.created else "")
    where, where_tip = where_text(row)
    best, best_tip = best_text(row)
    status, status_tip = status_text(row)
    name_tip = (f"{row.name}\nFolder: {row.path}" if row.renamed else row.path)
    texts = (row.name, kind_label(row), row.model, row.dataset, created,
             clock(row.duration_s) if row.duration_s else "",
             f"{row.step}/{row.total}" if row.total else "\u2014", best, where, status)
    tips = (name_tip, "", row.model, row.dataset, "", "", "", best_tip, where_tip, status_tip)
    return texts, tips


def _best_key(row: RunRow) -> float:
    if row.best is None:
        return float("inf")
    return -row.best.value if row.best.metric != "validation" else row.best.value


SORT_KEYS = {
    "Run": lambda r: r.name.casefold(), "Type": kind_label, "Model": lambda r: r.model,
    "Dataset": lambda r: r.dataset, "Created": lambda r: r.created or 0.0,
    "Duration": lambda r: r.duration_s or 0.0, "Steps": lambda r: (r.step, r.total),
    "Best": _best_key, "Where": lambda r: where_text(r)[0], "Status": lambda r: r.label,
}


def haystack(row: RunRow) -> str:
    """What the filter matches: name (and folder), model, dataset, state, type."""
    return " ".join((row.name, row.folder, row.model, row.dataset, row.label,
                     kind_label(row))).casefold()


class RunsTable(QTableView):
    """The runs table; `resized` after its own geometry changed (the view fits its columns to
    the width the table has then, not the one it had when its parent was resized)."""

    resized = Signal()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.resized.emit()


class RunsModel(QAbstractTableModel):
    """The rows the table shows: `all_rows` (the reader's order: the queue first) filtered by
    `set_filter` and sorted by `sort` (column -1: the reader's order)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.all_rows: list[RunRow] = []
        self.shown: list[RunRow] = []
        self._cells: dict[int, tuple] = {}            # id(row) -> cells(row), shown rows only
        self._terms: list[str] = []
        self._sort: tuple[int, Qt.SortOrder] = (-1, Qt.AscendingOrder)

    # ---------------------------------------------------------------- Qt's model API
    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.shown)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.DisplayRole):
        if orientation != Qt.Horizontal:
            return None
        if role == Qt.DisplayRole:
            return COLUMNS[section]
        if role == Qt.ToolTipRole:
            return HEADER_TIPS.get(COLUMNS[section])
        return None

    def data(self, index, role=Qt.DisplayRole):
        row = self.shown[index.row()]
        col = index.column()
        if role in (Qt.DisplayRole, Qt.ToolTipRole):
            texts, tips = self.cells(row)
            return texts[col] if role == Qt.DisplayRole else (tips[col] or None)
        if role == PATH_ROLE:
            return row.path
        if role == Qt.ForegroundRole and col == COL["Status"]:
            return QColor(theme.color(STATE_COLORS.get(row.state, "text")))
        if role == PROGRESS_ROLE:
            return row.step, row.total, row.state == "done"
        return None

    def sort(self, column: int, order=Qt.AscendingOrder) -> None:
        self._sort = (column, order)
        self._reset(self.all_rows)

    # ---------------------------------------------------------------- rows
    def cells(self, row: RunRow) -> tuple:
        found = self._cells.get(id(row))
        if found is None or found[0] is not row:
            found = self._cells[id(row)] = (row, *cells(row))
        return found[1:]

    def set_filter(self, text: str) -> None:
        self._terms = text.casefold().split()
        self._reset(self.all_rows)

    def set_rows(self, rows: list[RunRow]) -> None:
        """Show `rows`: only the rows that are new objects are signalled as changed when the
        same runs stay in the same places; else the model is reset."""
        shown = self._arrange(rows)
        if [r.path for r in shown] != [r.path for r in self.shown]:
            self._reset(rows, shown)
            return
        self.all_rows, old, self.shown = rows, self.shown, shown
        last = len(COLUMNS) - 1
        for i, (a, b) in enumerate(zip(old, shown)):
            if a is not b:
                self._cells.pop(id(a), None)
                self.dataChanged.emit(self.index(i, 0), self.index(i, last))

    def _arrange(self, rows: list[RunRow]) -> list[RunRow]:
        shown = rows
        if self._terms:
            shown = [r for r in rows if all(t in haystack(r) for t in self._terms)]
        column, order = self._sort
        if column >= 0:
            shown = sorted(shown, key=SORT_KEYS[COLUMNS[column]],
                           reverse=order == Qt.DescendingOrder)
        return shown

    def _reset(self, rows: list[RunRow], shown: list[RunRow] | None = None) -> None:
        self.beginResetModel()
        self.all_rows = rows
        self.shown = self._arrange(rows) if shown is None else shown
        self._cells.clear()
        self.endResetModel()

    def row_of(self, path: str | None) -> int:
        return next((i for i, r in enumerate(self.shown) if r.path == path), -1)


class ProgressDelegate(QStyledItemDelegate):
    """The Steps column: a progress bar painted in the cell ("42/100"; a dash without a total)."""

    def paint(self, painter, option, index) -> None:
        step, total, done = index.data(PROGRESS_ROLE)
        bar = QStyleOptionProgressBar()
        bar.rect = option.rect.adjusted(4, 3, -4, -3)
        bar.minimum, bar.maximum = 0, max(total, 1)
        bar.progress = total if done and total else min(step, max(total, 1))
        bar.text = index.data(Qt.DisplayRole)
        bar.textVisible = True
        bar.textAlignment = Qt.AlignCenter
        bar.state = option.state
        style = option.widget.style() if option.widget else QApplication.style()
        style.drawControl(QStyle.CE_ProgressBar, bar, painter, option.widget)
