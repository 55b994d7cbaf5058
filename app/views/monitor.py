"""The Monitor screen: live curves of the selected run, its progress and log, stop buttons, and
an overlay of other runs with the settings in which they differ.

Data arrives from `RunTail` (a background read of only the new bytes, delivered in batches);
curves are built once and updated with `setData` on those batches, one plot per pass of the
event loop (`redraw`, a `PacedRedraw`; `redraw.flush()` draws what is pending now). The x
axis shows the whole run (step 0 to the total) until the user zooms. Test-visible state:
`loss_curve` (raw training loss), `smooth_curve` (its EMA), `val_curve`, `lr_curve`,
`grad_curve`, `clipped_curve`, `tps_curve`, `compare_curves[path]`, `progress`, `log_view`,
`settings_diff()`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QCheckBox, QGridLayout, QHBoxLayout, QLabel, QListWidget,
                               QListWidgetItem, QMessageBox, QPlainTextEdit, QProgressBar,
                               QPushButton, QSlider, QSplitter, QTableWidget, QTableWidgetItem,
                               QVBoxLayout, QWidget)

from app.engine.errors import EngineError
from app.engine.rundir import RunDir, list_runs
from app.views.run_tail import BackgroundPoll, PacedRedraw, RunTail, Series, clock

ACCENT = "#2f6fde"
PALETTE = ("#d1453b", "#2e9d5b", "#8e44ad", "#e08a1e", "#16a2b8", "#7f8c8d", "#c2185b")
ACTIVE = ("running", "queued", "paused")


def _num(ev: dict, key: str) -> float:
    v = ev.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else np.nan


def flatten(cfg: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else v
    return out


def box(kind, *items, widget: bool = False):
    """A layout of `items`: widgets, layouts, (item, stretch), an int (spacing), None
    (stretch); with `widget`, a margin-less QWidget holding it."""
    layout = kind()
    for item in items:
        item, stretch = item if isinstance(item, tuple) else (item, 0)
        if item is None:
            layout.addStretch(1)
        elif isinstance(item, int):
            layout.addSpacing(item)
        elif isinstance(item, QWidget):
            layout.addWidget(item, stretch)
        else:
            layout.addLayout(item, stretch)
    if not widget:
        return layout
    holder = QWidget()
    layout.setContentsMargins(0, 0, 0, 0)
    holder.setLayout(layout)
    return holder


def small_plot(title: str, grid: bool = False) -> pg.PlotWidget:
    plot = pg.PlotWidget(background="w")
    plot.setTitle(title, color="#3a4047", size="9pt")
    plot.showGrid(x=grid, y=grid, alpha=0.12)       # grid lines cost ~3 ms a paint
    plot.setMinimumHeight(120)
    plot.getAxis("left").setWidth(54)          # fixed: a changing label width would relayout
    item = plot.getPlotItem()
    item.setDownsampling(auto=True, mode="peak")
    item.setClipToView(True)
    for axis in ("left", "bottom"):
        item.getAxis(axis).setTextPen("#4d545c")
        item.getAxis(axis).setPen("#aab1b8")
    return plot


class MonitorView(QWidget):
    """Follows `ctx.run_selected`; see the module docstring."""

    def __init__(self, ctx, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.run_path: str | None = None
        self.status: dict = {}
        self.last_step: dict = {}
        self.confirm = self._confirm_discard       # replaced in tests
        self._steps = Series(6)                    # step, loss, lr, grad_norm, clipped, tok/s
        self._evals = Series(2)
        self._compare: dict[str, tuple[RunTail, Series, pg.PlotDataItem]] = {}
        self._configs: dict[str, dict] = {}
        self.follow_x = True                       # False once the user zooms or pans
        self._refit: set = set()                   # plots whose range is set afresh

        self.tail = RunTail(self)
        self.tail.reset.connect(self._on_reset)
        self.tail.steps.connect(self._on_steps)
        self.tail.evals.connect(self._on_evals)
        self.tail.logs.connect(self._on_logs)
        self.tail.status_changed.connect(self._on_status)

        self.title = QLabel("No run selected", objectName="pageTitle")
        self.subtitle = QLabel("Pick a run on the Runs screen.", objectName="pageSubtitle")
        self.stop_save_button = QPushButton("Stop and save", clicked=self.stop_and_save)
        self.stop_save_button.setToolTip("Pause: the worker saves a checkpoint after the current "
                                         "step; resume it later from the Runs screen.")
        self.stop_discard_button = QPushButton("Stop and discard", clicked=self.stop_and_discard)
        self.stop_discard_button.setToolTip("Cancel the job after the current step; it is marked "
                                            "cancelled (its files stay on disk).")
        self.progress = QProgressBar(textVisible=True, maximumHeight=20)
        self.progress.setFormat("")
        self.stats_label = QLabel(objectName="pageSubtitle", textFormat=Qt.PlainText)

        self.loss_plot = small_plot("Loss", grid=True)
        self.loss_plot.setMinimumHeight(260)
        self.loss_plot.addLegend(offset=(-10, 10), labelTextColor="#1f2328")
        self.loss_curve = self.loss_plot.plot(pen=pg.mkPen("#9db8ec", width=1), name="train",
                                              connect="finite")
        self.smooth_curve = self.loss_plot.plot(pen=pg.mkPen(ACCENT, width=2),
                                                name="train (smoothed)", connect="finite")
        self.val_curve = self.loss_plot.plot(pen=pg.mkPen("#e08a1e", width=2), symbol="o",
                                             symbolSize=6, symbolBrush="#e08a1e",
                                             symbolPen=None, name="validation")
        plots = [small_plot(t) for t in ("Learning rate", "Gradient norm", "Clipped fraction",
                                         "Tokens / s")]
        self.lr_plot, self.grad_plot, self.clipped_plot, self.tps_plot = plots
        self.lr_curve, self.grad_curve, self.clipped_curve, self.tps_curve = (
            p.plot(pen=pg.mkPen(ACCENT, width=1.5), connect="finite", fillLevel=0,
                   brush=(47, 111, 222, 40)) for p in plots)     # the fill keeps 0 in view
        self.clipped_plot.setYRange(0, 1, padding=0.02)
        self.clipped_plot.getPlotItem().enableAutoRange(y=False)
        for p in plots + [self.loss_plot]:
            p.getPlotItem().enableAutoRange(False)        # ranges are set by `_fit`
        self.plots = {"loss": self.loss_plot, "lr": self.lr_plot, "grad": self.grad_plot,
                      "clipped": self.clipped_plot, "tps": self.tps_plot}
        self.redraw = PacedRedraw(self)            # one plot per event-loop pass
        self.redraw.add("loss", self._draw_loss)
        for i, key in enumerate(("lr", "grad", "clipped", "tps"), start=2):
            self.redraw.add(key, lambda i=i, key=key: self._draw_small(key, i))
        for p in self.plots.values():
            p.getViewBox().sigRangeChangedManually.connect(self._on_user_zoom)

        self.log_scale = QCheckBox("Log scale", toggled=self._on_log_scale)
        self.smoothing = QSlider(Qt.Horizontal, minimum=0, maximum=99, value=60,
                                 maximumWidth=160)
        self.smoothing.valueChanged.connect(self._on_smoothing)
        self.smoothing_label = QLabel("0.60")
        reset_zoom = QPushButton("Reset zoom", clicked=self.reset_zoom)
        self.log_view = QPlainTextEdit(readOnly=True, maximumBlockCount=300)
        self.compare_list = QListWidget()
        self.compare_list.itemChanged.connect(self._on_compare_item)
        self.diff_table = QTableWidget(0, 0)
        self.diff_table.verticalHeader().setVisible(False)
        self.compare_hint = QLabel("No other runs yet.", objectName="pageSubtitle")
        self.diff_hint = QLabel(objectName="pageSubtitle", wordWrap=True)

        grid = QGridLayout()
        for i, p in enumerate(plots):
            grid.addWidget(p, i // 2, i % 2)
        right = []
        for label, *widgets in (("Compare with", self.compare_list, self.compare_hint),
                                ("Settings that differ", self.diff_table, self.diff_hint),
                                ("Recent log", (self.log_view, 1))):
            right += [QLabel(label, objectName="sectionHeader"), *widgets]
        split = QSplitter(Qt.Horizontal)
        split.addWidget(box(QVBoxLayout, box(QHBoxLayout, self.log_scale, 16,
                                             QLabel("Smoothing"), self.smoothing,
                                             self.smoothing_label, None, reset_zoom),
                            (self.loss_plot, 3), (grid, 2), widget=True))
        split.addWidget(box(QVBoxLayout, *right, widget=True))
        split.setSizes([900, 340])
        layout = box(QVBoxLayout, box(QHBoxLayout, (box(QVBoxLayout, self.title,
                                                        self.subtitle), 1),
                                      self.stop_save_button, self.stop_discard_button),
                     self.progress, self.stats_label, (split, 1))
        layout.setContentsMargins(20, 16, 20, 16)
        self.setLayout(layout)

        self.runs_poll = BackgroundPoll(self._list_runs, 5000, self)
        self.runs_poll.result.connect(self._fill_compare_list)
        self.runs_poll.start()
        ctx.run_selected.connect(self.set_run)
        ctx.runs_changed.connect(self.runs_poll.tick)
        self._update_buttons()
        if getattr(ctx, "current_run", None):
            self.set_run(ctx.current_run)

    # ---------------------------------------------------------------- following a run
    def set_run(self, path: str) -> None:
        path = str(RunDir(path).path) if path else None
        if path == self.run_path:
            return
        self.run_path = path
        self.title.setText(Path(path).name if path else "No run selected")
        self.subtitle.setText(path or "Pick a run on the Runs screen.")
        self._configs.pop(path, None)
        self.tail.set_run(path)
        self._uncheck(path)
        self._update_diff()
        self.runs_poll.tick()                     # a new run may have appeared

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.tail.start()                        # after a close; a no-op when following
        self.runs_poll.start()

    def _on_reset(self, _path: str) -> None:
        self._steps.clear()
        self._evals.clear()
        self.status, self.last_step = {}, {}
        self.log_view.clear()
        self._refit = set(self.plots.values())
        self.redraw.mark()
        self.redraw.flush()
        self._update_progress()
        self._update_buttons()

    def _on_steps(self, events: list) -> None:
        self._steps.extend([(e.get("step", 0), _num(e, "loss"), _num(e, "lr"),
                             _num(e, "grad_norm"), _num(e, "clipped_fraction"),
                             _num(e, "tokens_per_s")) for e in events])
        self.last_step = events[-1]
        self.redraw.mark()
        self._update_progress()

    def _on_evals(self, events: list) -> None:
        self._evals.extend([(e.get("step", 0), _num(e, "loss")) for e in events])
        self.redraw.mark("loss")
        self._update_progress()

    def _on_logs(self, lines: list) -> None:
        self.log_view.appendPlainText("\n".join(lines[-300:]))

    def _on_status(self, status: dict) -> None:
        self.status = status
        self._update_progress()
        self._update_buttons()

    def _on_smoothing(self, value: int) -> None:
        self.smoothing_label.setText(f"{value / 100:.2f}")
        self.redraw.mark("loss")
        self.redraw.flush()

    def _draw_loss(self) -> None:
        weight = self.smoothing.value() / 100
        x = self._steps.col(0)
        self.loss_curve.setData(x, self._steps.col(1))
        self.smooth_curve.setData(x, self._steps.smoothed(weight))
        self.val_curve.setData(self._evals.col(0), self._evals.col(1))
        ys = [self._steps.col(1), self._evals.col(1)]
        for _, series, curve in self._compare.values():
            curve.setData(series.col(0), series.smoothed(weight))
            ys.append(series.col(1))
        self._fit(self.loss_plot, ys, log=self.log_scale.isChecked())

    def _draw_small(self, key: str, column: int) -> None:
        curve = {"lr": self.lr_curve, "grad": self.grad_curve, "clipped": self.clipped_curve,
                 "tps": self.tps_curve}[key]
        curve.setData(self._steps.col(0), self._steps.col(column))
        self._fit(self.plots[key], [] if key == "clipped" else [self._steps.col(column)],
                  from_zero=True)

    def _fit(self, plot: pg.PlotWidget, ys: list, log: bool = False,
             from_zero: bool = False) -> None:
        """Set the view range by hand, and only when the data outgrow it (or fill less than
        half of it): steps 0 .. total, values with hysteresis. A range that changes every
        update makes pyqtgraph re-lay out the axes and paint each plot twice (5-20 ms)."""
        if not self.follow_x:
            return
        vb = plot.getViewBox()
        total = self.last_step.get("total_steps") or self.status.get("total_steps") or 0
        x_max = max([float(total)] + [s.col(0)[-1] for s in [self._steps] + [
            c[1] for c in self._compare.values()] if s.n])
        if x_max > 0 and vb.viewRange()[0] != [0.0, x_max]:
            vb.setXRange(0, x_max, padding=0)
        y = np.concatenate([np.asarray(v, float) for v in ys]) if ys else np.empty(0)
        y = y[np.isfinite(y) & (y > 0)] if log else y[np.isfinite(y)]
        if not y.size:
            return
        y = np.log10(y) if log else y
        lo, hi = (0.0, float(y.max())) if from_zero else (float(y.min()), float(y.max()))
        span = (hi - lo) or abs(hi) * 0.2 or 1.0
        top, bottom = vb.viewRange()[1][1], vb.viewRange()[1][0]
        if plot in self._refit or lo < bottom or hi > top or (hi - lo) < 0.4 * (top - bottom):
            self._refit.discard(plot)
            below = 0.0 if from_zero else 0.25 * span    # room to fall: fewer refits
            vb.setYRange(lo - below, hi + 0.08 * span, padding=0)

    def _on_user_zoom(self, *_):
        self.follow_x = False

    def _update_progress(self) -> None:
        st, ev = self.status, self.last_step
        state = st.get("state") or ("running" if ev else "")
        step = ev.get("step", st.get("step")) or 0
        total = ev.get("total_steps", st.get("total_steps")) or 0
        eta = ev.get("eta_s", st.get("eta_s")) if state == "running" else None
        if state == "done" and total:
            step = total
        self.progress.setRange(0, max(int(total), 1))
        self.progress.setValue(min(int(step), max(int(total), 1)))
        text = state or "waiting for the first event"
        if total:
            text = f"{text} \u00b7 step {step} of {total} ({100 * step / total:.0f}%)"
        if eta is not None:
            text += f" \u00b7 ETA {clock(eta)}"
        self.progress.setFormat(text)
        parts = []
        if ev:
            parts.append(f"loss {_num(ev, 'loss'):.4f}")
            if self._evals.n:
                parts.append(f"validation {self._evals.col(1)[-1]:.4f}")
            parts += [f"lr {_num(ev, 'lr'):.2e}", f"grad norm {_num(ev, 'grad_norm'):.3f}",
                      f"clipped {100 * _num(ev, 'clipped_fraction'):.0f}%",
                      f"{_num(ev, 'tokens_per_s'):,.0f} tokens/s",
                      f"elapsed {clock(ev.get('elapsed_s'))}"]
        error = st.get("error")
        if isinstance(error, dict) and error.get("message"):
            parts.append(f"failed: {error['message']}")
        self.stats_label.setText("   \u00b7   ".join(parts))

    # ---------------------------------------------------------------- controls
    def _on_log_scale(self, on: bool) -> None:
        self.loss_plot.setLogMode(y=on)
        self._refit.add(self.loss_plot)
        self.redraw.mark("loss")
        self.redraw.flush()

    def set_smoothing(self, weight: float) -> None:
        self.smoothing.setValue(round(weight * 100))

    def reset_zoom(self) -> None:
        """Back to the whole run: steps 0 .. total, values auto-ranged."""
        self.follow_x = True
        self.clipped_plot.setYRange(0, 1, padding=0.02)
        self._refit = set(self.plots.values())
        self.redraw.mark()
        self.redraw.flush()

    def job(self):
        """The newest queue job of the followed run (None for a run started in the terminal)."""
        if not self.run_path:
            return None
        try:
            jobs = self.ctx.queue.find(self.run_path)
        except EngineError:
            return None
        return jobs[0] if jobs else None

    def _update_buttons(self) -> None:
        job = self.job()
        active = job is not None and job.state in ACTIVE
        self.stop_save_button.setEnabled(active and job.state in ("running", "queued")
                                         and job.requested_action == "none")
        self.stop_discard_button.setEnabled(active and job.requested_action != "cancel")
        if job is None and self.status.get("state") == "running":
            tip = "Started from the command line: press Ctrl-C in its terminal to pause it."
            self.stop_save_button.setToolTip(tip)

    def stop_and_save(self) -> None:
        self._request("pause", "Pausing")

    def stop_and_discard(self) -> None:
        if self.confirm():
            self._request("cancel", "Cancelling")

    def _request(self, action: str, verb: str) -> None:
        job = self.job()
        if job is None:
            return
        try:
            getattr(self.ctx.queue, action)(job.id)
            self.ctx.status_message.emit(f"{verb} job {job.id} after its current step")
        except EngineError as e:
            self.ctx.status_message.emit(e.message)
        self._update_buttons()
        self.ctx.runs_changed.emit()

    def _confirm_discard(self) -> bool:
        return QMessageBox.question(
            self, "Stop and discard",
            "Cancel this run? It stops after the current step and is marked cancelled.",
            QMessageBox.Yes | QMessageBox.No, QMessageBox.No) == QMessageBox.Yes

    # ---------------------------------------------------------------- comparing runs
    def _list_runs(self) -> list[str]:
        """Run directories to offer for comparison (runs folder and queue); reader thread."""
        paths = [str(r.path) for r in list_runs(self.ctx.runs_root())]
        try:
            paths += [str(RunDir(j.run_dir).path) for j in self.ctx.queue.list()]
        except EngineError:
            pass
        return list(dict.fromkeys(p for p in paths if os.path.isdir(p)))

    def _fill_compare_list(self, paths: list) -> None:
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
        self._sync_compare_list()
        self.compare_list.blockSignals(False)

    def _sync_compare_list(self) -> None:
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

    def set_compared(self, path: str, on: bool = True) -> None:
        """Overlay (or remove) another run's smoothed training loss."""
        path = str(RunDir(path).path)
        if on and path not in self._compare and path != self.run_path:
            tail = RunTail(self, interval_ms=1000, read_log=False)
            series = Series(2)
            color = PALETTE[len(self._compare) % len(PALETTE)]
            curve = self.loss_plot.plot(pen=pg.mkPen(color, width=2, style=Qt.DashLine),
                                        name=Path(path).name, connect="finite")
            self._compare[path] = (tail, series, curve)
            tail.steps.connect(lambda evs, s=series: self._on_compare_steps(s, evs))
            tail.set_run(path)
        elif not on and path in self._compare:
            tail, _, curve = self._compare.pop(path)
            tail.set_run(None)
            tail.deleteLater()
            self.loss_plot.removeItem(curve)
        self.redraw.mark("loss")
        self._sync_compare_list()
        self._update_diff()

    @property
    def compare_curves(self) -> dict[str, pg.PlotDataItem]:
        """{run directory: its overlaid (smoothed) training-loss curve}."""
        return {path: curve for path, (_, _, curve) in self._compare.items()}

    def _on_compare_steps(self, series: Series, events: list) -> None:
        series.extend([(e.get("step", 0), _num(e, "loss")) for e in events])
        self.redraw.mark("loss")

    def _on_compare_item(self, item: QListWidgetItem) -> None:
        self.set_compared(item.data(Qt.UserRole), item.checkState() == Qt.Checked)

    def _uncheck(self, path: str | None) -> None:
        if path in self._compare:
            self.set_compared(path, False)
        self._sync_compare_list()

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
                               "Tick runs above to overlay their training loss and list the "
                               "settings in which they differ.")
        names = list(next(iter(diff.values())).keys()) if diff else []
        self.diff_table.clear()
        self.diff_table.setColumnCount(1 + len(names))
        self.diff_table.setHorizontalHeaderLabels(["setting"] + names)
        self.diff_table.setRowCount(len(diff))
        for r, (key, values) in enumerate(diff.items()):
            self.diff_table.setItem(r, 0, QTableWidgetItem(key))
            for c, name in enumerate(names, start=1):
                self.diff_table.setItem(r, c, QTableWidgetItem(str(values[name])))
        self.diff_table.resizeColumnsToContents()

    def closeEvent(self, event) -> None:
        self.tail.stop()
        self.runs_poll.stop()
        self.redraw.timer.stop()
        for tail, _, _ in self._compare.values():
            tail.stop()
        super().closeEvent(event)
