"""Comparing runs in the Monitor: tick other runs to overlay one of their curves (the smoothed
training loss, or for GRPO runs the smoothed reward) on the followed run's plot, and list the
settings in which the runs differ.

`ComparePanel(ctx)` holds the list of runs (filled from the runs folder and the queue in the
reader thread every 5 s) and the table of differing settings. The Monitor tells it which run it
follows (`set_run`) and which plot and metric to overlay (`set_target`), and redraws when
`changed` fires (`draw(weight)`). Test-visible state: `compare_list`, `diff_table`,
`compare_curves`, `settings_diff()`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QHeaderView, QLabel, QListWidget, QListWidgetItem, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from app.engine.api import EngineError, RunDir, list_runs
from app.views.widgets.plots import PALETTE, num
from app.views.widgets.run_tail import BackgroundPoll, RunTail, Series


def flatten(cfg: dict, prefix: str = "") -> dict:
    """{"train.lr": 0.005, ...}: nested settings as dotted keys, lists as JSON text."""
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else v
    return out


class ComparePanel(QWidget):
    """The "Compare with" list and the "Settings that differ" table; see the module docstring."""

    changed = Signal()

    def __init__(self, ctx, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.run_path: str | None = None
        self._plot: pg.PlotWidget | None = None
        self._metric = "loss"
        self._compare: dict[str, tuple[RunTail, Series, pg.PlotDataItem]] = {}
        self._configs: dict[str, dict] = {}

        self.compare_list = QListWidget()
        self.compare_list.itemChanged.connect(self._on_item)
        self.compare_hint = QLabel("No other runs yet.", objectName="pageSubtitle")
        self.diff_table = QTableWidget(0, 0)
        self.diff_table.verticalHeader().setVisible(False)
        self.diff_table.horizontalHeader().setSectionResizeMode(QHeaderView.Stretch)
        self.diff_table.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)   # fits the pane
        self.diff_table.setTextElideMode(Qt.ElideMiddle)                     # hover: all of it
        self.diff_hint = QLabel(objectName="pageSubtitle", wordWrap=True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        for widget in (QLabel("Compare with", objectName="sectionHeader"), self.compare_list,
                       self.compare_hint, QLabel("Settings that differ",
                                                 objectName="sectionHeader"),
                       self.diff_table, self.diff_hint):
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
        self.runs_poll.tick()                     # a new run may have appeared

    def set_target(self, plot: pg.PlotWidget, metric: str) -> None:
        """Overlay the compared runs' `metric` (a step event's key) on `plot`; the compared
        runs are read again when the metric changes."""
        if plot is self._plot and metric == self._metric:
            return
        old, self._plot, self._metric = self._plot, plot, metric
        for path, (tail, series, curve) in self._compare.items():
            if old is not None:
                old.removeItem(curve)
            plot.addItem(curve)
            series.clear()
            tail.set_run(path)
        self.changed.emit()

    # ---------------------------------------------------------------- compared runs
    def set_compared(self, path: str, on: bool = True) -> None:
        """Overlay (or remove) another run's smoothed curve."""
        path = str(RunDir(path).path)
        if on and path not in self._compare and path != self.run_path and self._plot:
            tail = RunTail(self, interval_ms=1000, read_log=False)
            series = Series(2)
            color = PALETTE[len(self._compare) % len(PALETTE)]
            curve = self._plot.plot(pen=pg.mkPen(color, width=2, style=Qt.DashLine),
                                    name=Path(path).name, connect="finite")
            self._compare[path] = (tail, series, curve)
            tail.steps.connect(lambda evs, s=series: self._on_steps(s, evs))
            tail.reset.connect(lambda _path, s=series: s.clear())   # read again from the start
            tail.set_run(path)
        elif not on and path in self._compare:
            tail, _, curve = self._compare.pop(path)
            tail.set_run(None)
            tail.deleteLater()
            self._plot.removeItem(curve)
        self.changed.emit()
        self._sync_list()
        self._update_diff()

    @property
    def compare_curves(self) -> dict[str, pg.PlotDataItem]:
        """{run directory: its overlaid (smoothed) curve}."""
        return {path: curve for path, (_, _, curve) in self._compare.items()}

    def _on_steps(self, series: Series, events: list) -> None:
        series.extend([(e.get("step", 0), num(e, self._metric)) for e in events])
        self.changed.emit()

    def draw(self, plot: pg.PlotWidget, weight: float) -> list[np.ndarray]:
        """Set the curves (smoothed with `weight`) when they are on `plot`; their raw values,
        for the plot's range."""
        if plot is not self._plot:
            return []
        for _, series, curve in self._compare.values():
            curve.setData(series.col(0), series.smoothed(weight))
        return [series.col(1) for _, series, _ in self._compare.values()]

    def last_step(self) -> float:
        return max([s.col(0)[-1] for _, s, _ in self._compare.values() if s.n], default=0.0)

    def stop(self) -> None:
        self.runs_poll.stop()
        for tail, _, _ in self._compare.values():
            tail.stop()

    def start(self) -> None:
        self.runs_poll.start()

    # ---------------------------------------------------------------- the list
    def _list_runs(self) -> list[str]:
        """Run directories to offer for comparison (runs folder and queue); reader thread."""
        paths = [str(r.path) for r in list_runs(self.ctx.runs_root())]
        try:
            paths += [str(RunDir(j.run_dir).path) for j in self.ctx.queue.list()]
        except EngineError:
            pass
        return list(dict.fromkeys(p for p in paths if os.path.isdir(p)))

    def _fill_list(self, paths: list) -> None:
        have = {self.compare_list.item(i).data(Qt.UserRole)
                for i in range(self.compare_list.count())}
        self.compare_list.blockSignals(True)
        for path in paths:
            if path not in have:
                item = QListWidgetItem(Path(path).name)
                item.setData(Qt.UserRole, path)
                item.setToolTip(path)
                item.setFlags(item.flags() | Qt.ItemIsUserCheckable)
                self.compare_list.addItem(item)
        self._sync_list()
        self.compare_list.blockSignals(False)

    def _sync_list(self) -> None:
        """Check the compared runs; hide the followed one (it is always shown)."""
        blocked = self.compare_list.blockSignals(True)
        shown = 0
        for i in range(self.compare_list.count()):
            item = self.compare_list.item(i)
            path = item.data(Qt.UserRole)
            item.setHidden(path == self.run_path)
            shown += path != self.run_path
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
        self.diff_table.setRowCount(len(diff))
        for r, (key, values) in enumerate(diff.items()):
            texts = [key] + [str(values[name]) for name in names]
            for c, text in enumerate(texts):
                item = QTableWidgetItem(text)
                item.setToolTip(text)
                self.diff_table.setItem(r, c, item)
