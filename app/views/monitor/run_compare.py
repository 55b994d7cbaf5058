"""Comparing runs in the Monitor: tick other runs to overlay their headline metric on the
followed run's plot (the smoothed training loss and the validation loss, or for GRPO runs the
smoothed reward and the held-out reward), and list the settings in which the runs differ, by
their names in the window ("LoRA rank": New run's, from widgets.setting_labels; the config key
in the tooltip), and the latest evaluation saved with each shown run (RUN/evals.jsonl: the
Evaluate screen's and `workbench eval --save`'s; each model or adapter's task and accuracy
+- its standard error, or pass rate, as `workbench eval` prints them).

`ComparePanel(ctx)` holds the list of runs (filled from the runs folder and the queue in the
reader thread every 5 s; it offers the runs of the followed run's kind) and the table of
differing settings. The Monitor tells it which run it follows (`set_run`) and its kind and
headline plot (`set_target`: a new target drops the compared runs, which are of the other
kind; curves are built on the new plot, since a curve moved between two plots' scenes is left
half-added by pyqtgraph), and redraws when `changed` fires (`draw(weight)`). Test-visible
state: `compare_list`, `compare_hint`, `diff_table`, `compare_curves`, `compare_eval_curves`,
`settings_diff()`, `evals_table`, `evaluations` ({run name: its latest evaluation's rows, each
(model, task, result)}).
The evaluations are read with the runs, in the reader thread (an evals.jsonl may be large).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QHeaderView, QLabel, QListWidget, QListWidgetItem, QTableWidget,
                               QVBoxLayout, QWidget)

from app.engine.api import (SFT, EngineError, RunDir, RunKind, kind_of, latest_evals,
                            list_runs, saved_cell)
from app.views.widgets.plots import PALETTE, num, tint
from app.views.widgets.run_tail import BackgroundPoll, RunTail, Series
from app.views.widgets.setting_labels import setting_label   # New run's names too
from app.views.widgets.tables import fill_rows


KIND_ROLE = Qt.UserRole + 1          # a list item's run kind (its path: Qt.UserRole)


def flatten(cfg: dict, prefix: str = "") -> dict:
    """{"train.lr": 0.005, ...}: nested settings as dotted keys, lists as JSON text."""
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else v
    return out


@dataclass
class Compared:
    """A compared run: its reader, its steps' and evaluations' (step, metric), their curves."""
    tail: RunTail
    steps: Series
    evals: Series
    curve: pg.PlotDataItem
    eval_curve: pg.PlotDataItem


class ComparePanel(QWidget):
    """The "Compare with" list and the "Settings that differ" table; see the module docstring."""

    changed = Signal()

    def __init__(self, ctx, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.run_path: str | None = None
        self._plot: pg.PlotWidget | None = None
        self._kind: RunKind = SFT
        self._kinds: dict[str, tuple[float, str]] = {}     # path -> (config.json's time, kind)
        self._compare: dict[str, Compared] = {}
        self._configs: dict[str, dict] = {}

        self.compare_list = QListWidget()
        self.compare_list.itemChanged.connect(self._on_item)
        self.compare_list.setToolTip("Tick a run to overlay its smoothed curve (dashed) and its "
                                     "evaluations (triangles) on this run's plot, and to list "
                                     "the settings in which the runs differ.")
        self.compare_hint = QLabel("No other runs of this kind yet.", objectName="pageSubtitle",
                                   wordWrap=True)
        self.diff_table = QTableWidget(0, 0)
        self.diff_table.verticalHeader().setVisible(False)
        self.diff_table.setToolTip("The settings in which the shown runs differ; hover a cell "
                                   "for all of it.")
        self.diff_table.horizontalHeader().setSectionResizeMode(QHeaderView.Stretch)
        self.diff_table.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)   # fits the pane
        self.diff_table.setTextElideMode(Qt.ElideMiddle)                     # hover: all of it
        self.diff_hint = QLabel(objectName="pageSubtitle", wordWrap=True)
        self._evals: dict[str, list] = {}           # run directory -> its latest evaluation
        self.evaluations: dict[str, list] = {}      # the shown runs': run name -> that
        self.evals_header = QLabel("Latest evaluations", objectName="sectionHeader")
        self.evals_table = EvalTable(0, len(EVAL_COLUMNS))
        self.evals_table.setHorizontalHeaderLabels(EVAL_COLUMNS)
        self.evals_table.verticalHeader().setVisible(False)
        self.evals_table.setToolTip("The latest evaluation saved with each shown run (the "
                                    "Evaluate screen, workbench eval --save): accuracy in % "
                                    "+- its standard error, or the pass rate; hover a cell "
                                    "for all of it.")
        header = self.evals_table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.Stretch)
        for column in (0, 2):              # model, result: as wide as their text (_show_evals)
            header.setSectionResizeMode(column, QHeaderView.Fixed)
        self.evals_table.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.evals_table.setTextElideMode(Qt.ElideMiddle)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        for widget in (QLabel("Compare with", objectName="sectionHeader"), self.compare_list,
                       self.compare_hint, QLabel("Settings that differ",
                                                 objectName="sectionHeader"),
                       self.diff_table, self.diff_hint, self.evals_header, self.evals_table):
            layout.addWidget(widget)

        self.runs_poll = BackgroundPoll(self._list_runs, 5000, self)
        self.runs_poll.result.connect(self._fill_list)
        self.runs_poll.start()
        ctx.runs_changed.connect(self.runs_poll.tick)

    # ---------------------------------------------------------------- the followed run
    def set_run(self, path: str | None) -> None:
        self.run_path = path
        self._configs.pop(path, None)
        if path in self._compare:
            self.set_compared(path, False)
        self._sync_list()
        self._update_diff()
        self._show_evals()
        self.runs_poll.tick()                     # a new run may have appeared; evaluations

    def set_target(self, plot: pg.PlotWidget, kind: RunKind) -> None:
        """Offer the runs of `kind` and overlay their headline metric (a step and eval event's
        key) on `plot`. A new target drops the compared runs (of the other kind)."""
        if plot is self._plot and kind is self._kind:
            return
        for path in list(self._compare):
            self._drop(path)
        self._plot, self._kind = plot, kind
        self.changed.emit()
        self._sync_list()
        self._update_diff()

    # ---------------------------------------------------------------- compared runs
    def set_compared(self, path: str, on: bool = True) -> None:
        """Overlay (or remove) another run's smoothed curve and its evaluations."""
        path = str(RunDir(path).path)
        if on and path not in self._compare and path != self.run_path and self._plot:
            color = tint(PALETTE[len(self._compare) % len(PALETTE)])
            name = Path(path).name
            run = Compared(RunTail(self, interval_ms=1000, read_log=False), Series(2),
                           Series(2),
                           self._plot.plot(pen=pg.mkPen(color, width=2, style=Qt.DashLine),
                                           name=name, connect="finite"),
                           self._plot.plot(pen=pg.mkPen(color, width=1, style=Qt.DotLine),
                                           symbol="t", symbolSize=7, symbolBrush=color,
                                           symbolPen=None))   # the legend: one row a run
            self._compare[path] = run
            run.tail.steps.connect(lambda evs, s=run.steps: self._on_events(s, evs))
            run.tail.evals.connect(lambda evs, s=run.evals: self._on_events(s, evs))
            run.tail.reset.connect(lambda _path, r=run: (r.steps.clear(), r.evals.clear()))
            run.tail.set_run(path)
        elif not on and path in self._compare:
            self._drop(path)
        self.changed.emit()
        self._sync_list()
        self._update_diff()
        self._show_evals()
        self.runs_poll.tick()                     # its evaluations

    def _drop(self, path: str) -> None:
        run = self._compare.pop(path)
        run.tail.set_run(None)
        run.tail.deleteLater()
        for curve in (run.curve, run.eval_curve):
            self._plot.removeItem(curve)

    @property
    def compare_curves(self) -> dict[str, pg.PlotDataItem]:
        """{run directory: its overlaid (smoothed) curve}."""
        return {path: run.curve for path, run in self._compare.items()}

    @property
    def compare_eval_curves(self) -> dict[str, pg.PlotDataItem]:
        """{run directory: its evaluations' points (validation loss, held-out reward)}."""
        return {path: run.eval_curve for path, run in self._compare.items()}

    def _on_events(self, series: Series, events: list) -> None:
        series.extend([(e.get("step", 0), num(e, self._kind.metric)) for e in events])
        self.changed.emit()

    def draw(self, plot: pg.PlotWidget, weight: float) -> list[np.ndarray]:
        """Set the curves (smoothed with `weight`) when they are on `plot`; their raw values,
        for the plot's range."""
        if plot is not self._plot:
            return []
        for run in self._compare.values():
            run.curve.setData(run.steps.col(0), run.steps.smoothed(weight))
            run.eval_curve.setData(run.evals.col(0), run.evals.col(1))
        return [s.col(1) for run in self._compare.values() for s in (run.steps, run.evals)]

    def last_step(self) -> float:
        return max([r.steps.col(0)[-1] for r in self._compare.values() if r.steps.n],
                   default=0.0)

    def stop(self) -> None:
        self.runs_poll.stop()
        for run in self._compare.values():
            run.tail.stop()

    def start(self) -> None:
        self.runs_poll.start()

    # ---------------------------------------------------------------- the list
    def _list_runs(self) -> tuple[list[tuple[str, str]], dict[str, list]]:
        """(run directory, kind name) of the runs to offer for comparison (runs folder and
        queue), and the shown runs' latest evaluations; reader thread."""
        shown = [p for p in (self.run_path, *list(self._compare)) if p]
        paths = [str(r.path) for r in list_runs(self.ctx.runs_root())]
        try:
            paths += [str(RunDir(j.run_dir).path) for j in self.ctx.queue.list()]
        except EngineError:
            pass
        return ([(p, self._kind_name(p)) for p in dict.fromkeys(paths) if os.path.isdir(p)],
                {p: eval_rows(p) for p in shown})

    def _kind_name(self, path: str) -> str:
        """The run's kind, from its config.json (read again only when it changed; missing,
        unreadable or unknown: supervised); reader thread."""
        run = RunDir(path)
        try:
            mtime = run.config_path.stat().st_mtime
        except OSError:
            return SFT.name
        if self._kinds.get(path, (None,))[0] != mtime:
            try:
                kind = kind_of(run.config()).name
            except EngineError:
                kind = SFT.name
            self._kinds[path] = (mtime, kind)
        return self._kinds[path][1]

    def _fill_list(self, found: tuple) -> None:
        runs, self._evals = found
        self._show_evals()
        items = {self.compare_list.item(i).data(Qt.UserRole): self.compare_list.item(i)
                 for i in range(self.compare_list.count())}
        self.compare_list.blockSignals(True)
        for path, kind in runs:
            item = items.get(path)
            if item is None:
                item = QListWidgetItem(Path(path).name)
                item.setData(Qt.UserRole, path)
                item.setToolTip(path)
                item.setFlags(item.flags() | Qt.ItemIsUserCheckable)
                self.compare_list.addItem(item)
            item.setData(KIND_ROLE, kind)
        self._sync_list()
        self.compare_list.blockSignals(False)

    def _sync_list(self) -> None:
        """Check the compared runs; offer the runs of the followed run's kind, but not the
        followed one (it is always shown)."""
        blocked = self.compare_list.blockSignals(True)
        shown = 0
        for i in range(self.compare_list.count()):
            item = self.compare_list.item(i)
            path = item.data(Qt.UserRole)
            offered = path != self.run_path and item.data(KIND_ROLE) == self._kind.name
            item.setHidden(not offered)
            shown += offered
            item.setCheckState(Qt.Checked if path in self._compare else Qt.Unchecked)
        self.compare_list.blockSignals(blocked)
        self.compare_list.setVisible(shown > 0)
        self.compare_hint.setVisible(shown == 0)

    def _on_item(self, item: QListWidgetItem) -> None:
        self.set_compared(item.data(Qt.UserRole), item.checkState() == Qt.Checked)

    # ---------------------------------------------------------------- settings that differ
    def _config(self, path: str) -> dict:
        if path not in self._configs:
            try:
                self._configs[path] = flatten(RunDir(path).config())
            except EngineError:
                self._configs[path] = {}
        return self._configs[path]

    def settings_diff(self) -> dict[str, dict[str, object]]:
        """{config key: {run name: value}} for the keys in which the shown runs differ."""
        paths = ([self.run_path] if self.run_path else []) + list(self._compare)
        if len(paths) < 2:
            return {}
        configs = {Path(p).name: self._config(p) for p in paths}
        keys = sorted(set().union(*configs.values()))
        return {k: {name: cfg.get(k, "\u2014") for name, cfg in configs.items()}
                for k in keys if len({repr(c.get(k)) for c in configs.values()}) > 1}

    def _update_diff(self) -> None:
        diff = self.settings_diff()
        self.diff_table.setVisible(bool(diff))
        self.diff_hint.setVisible(not diff)
        self.diff_hint.setText("The compared runs have the same settings." if self._compare else
                               "Tick runs above to overlay their curve and list the settings "
                               "in which they differ.")
        names = list(next(iter(diff.values())).keys()) if diff else []
        self.diff_table.clear()
        self.diff_table.setColumnCount(1 + len(names))
        self.diff_table.setHorizontalHeaderLabels(["setting"] + names)
        keys = list(diff)
        fill_rows(self.diff_table, [[setting_label(key)] + [str(values[name]) for name in names]
                                    for key, values in diff.items()],
                  tip=lambda r, c, text: f"{text} (config.json: {keys[r]})" if c == 0 else text)

    # ---------------------------------------------------------------- evaluations
    def _show_evals(self) -> None:
        """The shown runs' latest evaluations (as the reader thread last read them; a run just
        ticked gets its own at the next read); the section hides when none has one."""
        shown = [p for p in (self.run_path, *self._compare) if p]
        self.evaluations = {Path(p).name: self._evals[p] for p in shown if p in self._evals}
        rows = [row for name, rows in self.evaluations.items() for row in [(name,), *rows]]
        any_saved = any(row != NONE_SAVED for rows in self.evaluations.values() for row in rows)
        self.evals_header.setVisible(any_saved)
        self.evals_table.setVisible(any_saved)
        table = self.evals_table
        table.clearSpans()
        fill_rows(table, rows)
        for r, texts in enumerate(rows):
            if len(texts) == 1:                        # a run's name over its rows, bold
                table.setSpan(r, 0, 1, len(EVAL_COLUMNS))
                font = table.item(r, 0).font()
                font.setBold(True)
                table.item(r, 0).setFont(font)
        table.resizeRowsToContents()
        table.fit_columns()
        shown_rows = min(len(rows), EVAL_ROWS_SHOWN)     # more, or a short window: it scrolls
        table.setMaximumHeight(table.horizontalHeader().sizeHint().height() + 2 * table.frameWidth()
                             + sum(table.rowHeight(r) for r in range(shown_rows)))


EVAL_COLUMNS = ["model", "task", "result"]      # under a row with the run's name


class EvalTable(QTableWidget):
    """The evaluations' table: its model and result columns as wide as their cells (not the
    runs' names spanning the rows: Qt's fit to contents counts those), at most 30% and 45% of
    the width, again at every resize; the task takes the rest (elided in the middle)."""

    def fit_columns(self) -> None:
        metrics, width = self.fontMetrics(), self.viewport().width()
        for c, share in ((0, 0.3), (2, 0.45)):
            texts = [EVAL_COLUMNS[c]] + [self.item(r, c).text() for r in range(self.rowCount())
                                         if self.columnSpan(r, 0) == 1 and self.item(r, c)]
            needed = max(metrics.horizontalAdvance(t) for t in texts) + 14
            self.horizontalHeader().resizeSection(c, min(needed, int(share * width)))

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.fit_columns()
EVAL_ROWS_SHOWN = 6
NONE_SAVED = ("\u2014", "\u2014", "none saved")


def eval_rows(path: str) -> list[tuple[str, str, str]]:
    """A run's latest evaluation: (model, task, result) per model and task, the result as
    `workbench eval` prints it ("40.00 +- 7.75", "5.0% (1/20)"); none: [NONE_SAVED]; an
    unreadable file: its error in the result."""
    try:
        rows = latest_evals(path)
    except EngineError as e:
        return [(*NONE_SAVED[:2], e.message)]
    except OSError as e:                      # unreadable: said here, the runs still listed
        return [(*NONE_SAVED[:2], f"{e.filename or 'evals.jsonl'}: {e.strerror or e}")]
    return [(str(r.get("model", "?")), str(r.get("task", "?")), saved_cell(r))
            for r in rows] or [NONE_SAVED]
