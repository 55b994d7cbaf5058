"""The Monitor screen: live curves of the selected run, its progress and log, stop and resume
buttons, and an overlay of other runs with the settings in which they differ (`run_compare`).
Everything a run owns (curves, best mark, progress, statistics, log, compared runs of the
other kind) is reset when another run is followed (`set_run` -> `_set_kind`, `_on_reset`).

Data arrives from `RunTail` (a background read of only the new bytes, delivered in batches);
curves are built once and updated with `setData` on those batches, one plot per pass of the
event loop (`redraw`, a `PacedRedraw`; `redraw.flush()` draws what is pending now). The x
axis shows the whole run (step 0 to the total) until the user zooms (`ranges`, a `RunRanges`).

A supervised run shows its loss page alone. A GRPO run (config.json "kind": "grpo") gets three
pages: Rewards (`grpo`, a `GrpoCurves`), Completions (`completions`, a `CompletionsView`) and
the same loss page. A preference run (dpo, orpo, simpo, kto) shows the loss page with its
preference loss (held-out: the validation points), the best step by held-out accuracy, and its
accuracy and reward margin where a supervised run's clipped fraction and tokens/s are (each
step's curve, the held-out values as points: `held_out_curves`). A run trained with
--eval-task (its eval events carry `task` and `task_acc`) gets a plot of that accuracy beside
the loss (`task_plot`, `task_curve`; hidden for other runs). Test-visible state: `loss_curve`
(raw training loss), `smooth_curve` (its EMA), `val_curve`, `best_mark` (the best
evaluation's step, `best`, on the headline plot; `best_marks` by kind), `lr_curve`,
`grad_curve`, `clipped_curve`, `tps_curve`, `pages`, `kind` (the run's RunKind), `grpo`,
`completions`, `compare`, `progress`, `stats_label`, `log_view`, `continue_button`,
`stop_save_button`, `stop_discard_button`.
"""

from __future__ import annotations

from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QCheckBox, QGridLayout, QHBoxLayout, QLabel, QMessageBox,
                               QPlainTextEdit, QProgressBar, QPushButton, QSizePolicy, QSlider,
                               QSplitter, QTabWidget, QVBoxLayout, QWidget)

from app.engine.api import (GRPO, PREFERENCE_KINDS, SFT, EngineError, RunDir, RunKind,
                            can_continue, kind_of)
from app.views.monitor.completions import CompletionsView
from app.views.monitor.grpo_curves import KEYS as GRPO_KEYS
from app.views.monitor.grpo_curves import GrpoCurves
from app.views.monitor.run_compare import ComparePanel
from app.views.widgets import theme
from app.views.widgets.fit import ElidedLabel, WrappedLabel
from app.views.widgets.plots import (ACCENT, LEGEND, ORANGE, RAW, BestMark, PacedReveal,
                                     RunRanges, box, filled_curve, num, small_plot)
from app.views.widgets.run_best import better
from app.views.widgets.run_tail import PacedRedraw, RunTail, Series, clock
from app.views.widgets.tooltips import CONTINUE_TIP

ACTIVE = ("running", "queued", "paused")
SFT_KEYS = ("loss", "lr", "grad", "clipped", "tps")
TASK_Y = "accuracy (share)"      # 0-1, as a preference run's accuracy ("share")
# A preference run's last two small plots: its accuracy and margin (step, and held-out points)
# where a supervised run's show the clipped fraction and tokens/s: (title, y label, step field).
SMALL_PLOTS = {"clipped": ("Clipped fraction", "share", "clipped_fraction"),
               "tps": ("Tokens / s", "tokens/s", "tokens_per_s")}
PREFERENCE_PLOTS = {"clipped": ("Accuracy: chosen above rejected", "share",
                                "rewards/accuracies"),
                    "tps": ("Reward margin: chosen - rejected", "margin", "rewards/margins")}


def run_kind(path: str | None) -> RunKind:
    """The run's kind, from its config.json (a missing, unreadable or unknown one: SFT)."""
    try:
        return kind_of(RunDir(path).config()) if path else SFT
    except EngineError:
        return SFT


class MonitorView(QWidget):
    """Follows `ctx.run_selected`; see the module docstring."""

    def __init__(self, ctx, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.run_path: str | None = None
        self.kind = SFT
        self.status: dict = {}
        self.last_step: dict = {}
        self.best = None                           # run_best.Best of the followed run
        self.confirm = self._confirm_discard       # replaced in tests
        self._steps = Series(6)                    # step, loss, lr, grad_norm, clipped, tok/s
        self._evals = Series(2)
        self._pref_evals = Series(3)               # step, held-out accuracy, held-out margin
        self._task_evals = Series(2)               # step, --eval-task accuracy
        self._build()
        self._layout()
        self._connect()
        self._set_kind(SFT)
        self._update_buttons()
        self.reveal.hide(self)
        if getattr(ctx, "current_run", None):
            self.set_run(ctx.current_run)

    def _build(self) -> None:
        self.tail = RunTail(self)
        # a run's name and folder: elided in the middle, never wider than the window
        self.title = ElidedLabel("No run selected", objectName="pageTitle")
        self.subtitle = ElidedLabel("Pick a run on the Runs screen.", objectName="pageSubtitle")
        self.stop_save_button = QPushButton("Stop and save")
        self.stop_save_button.setToolTip("Pause: the worker saves a checkpoint after the current "
                                         "step; resume it later from the Runs screen.")
        self.continue_button = QPushButton("Continue", toolTip=CONTINUE_TIP)  # as on Runs
        self.stop_discard_button = QPushButton("Stop and discard")
        self.stop_discard_button.setToolTip("Cancel the job after the current step; it is marked "
                                            "cancelled (its files stay on disk).")
        self.progress = QProgressBar(textVisible=True, maximumHeight=20)
        self.progress.setFormat("")
        self.stats_label = WrappedLabel(objectName="pageSubtitle", textFormat=Qt.PlainText)
        self.stats_label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)

        self.redraw = PacedRedraw(self)            # one plot per event-loop pass
        self.reveal = PacedReveal(self)            # and when the screen appears
        self.ranges = RunRanges(self._x_max)
        self.compare = ComparePanel(self.ctx)
        self.loss_plot = small_plot("Loss", "loss (nats/token)", grid=True)
        self.loss_plot.setMinimumHeight(160)     # with the four below: fits a 720 px window
        self.loss_plot.addLegend(offset=(-10, 10), **LEGEND)   # top right: the loss falls
        self.loss_curve = self.loss_plot.plot(pen=pg.mkPen(RAW, width=1), name="train",
                                              connect="finite")
        self.smooth_curve = self.loss_plot.plot(pen=pg.mkPen(ACCENT, width=2),
                                                name="train (smoothed)", connect="finite")
        self.val_curve = self.loss_plot.plot(pen=pg.mkPen(ORANGE, width=2), symbol="o",
                                             symbolSize=6, symbolBrush=ORANGE,
                                             symbolPen=None, name="validation")
        # --eval-task: the task's accuracy at each evaluation, beside the loss (0-1, fixed)
        self.task_plot = small_plot("Task accuracy", TASK_Y, grid=True)
        self.task_curve = self.task_plot.plot(pen=pg.mkPen(ORANGE, width=2), symbol="o",
                                              symbolSize=6, symbolBrush=ORANGE, symbolPen=None)
        self.task_plot.hide()
        # 0 to 1, a little room around: at the edges pyqtgraph leaves the 0 and 1 unlabelled
        self.ranges.watch(self.task_plot, y=(-0.04, 1.04))
        plots = [small_plot(*t) for t in (("Learning rate", "lr"), ("Gradient norm", "L2 norm"),
                                          SMALL_PLOTS["clipped"][:2], SMALL_PLOTS["tps"][:2])]
        self.lr_plot, self.grad_plot, self.clipped_plot, self.tps_plot = plots
        self.lr_curve, self.grad_curve, self.clipped_curve, self.tps_curve = (
            filled_curve(p) for p in plots)
        # a preference run's held-out accuracy and margin, points on those two plots
        self.held_out_curves = {key: plot.plot(pen=None, symbol="o", symbolSize=6,
                                               symbolBrush=ORANGE, symbolPen=None)
                                for key, plot in (("clipped", self.clipped_plot),
                                                  ("tps", self.tps_plot))}
        self.plots = dict(zip(SFT_KEYS, [self.loss_plot] + plots))
        for key, plot in self.plots.items():
            self.ranges.watch(plot, y=(0, 1) if key == "clipped" else None)

        self.log_scale = QCheckBox("Log scale")
        self.smoothing = QSlider(Qt.Horizontal, minimum=0, maximum=99, value=60,
                                 maximumWidth=160)
        self.smoothing_label = QLabel("0.60")
        self.reset_zoom_button = QPushButton("Reset zoom")
        self.log_scale.setToolTip("Show the loss on a logarithmic scale (its late, small "
                                  "changes become visible).")
        self.smoothing.setToolTip("How much the smoothed curve averages out step-to-step noise "
                                  "(an exponential moving average; 0: the raw values).")
        self.reset_zoom_button.setToolTip("Back to the whole run (step 0 to the last), values "
                                          "fitted; the mouse wheel zooms, dragging pans.")
        self.log_view = QPlainTextEdit(readOnly=True, maximumBlockCount=300)
        self.grpo = GrpoCurves(self.redraw, self.ranges, lambda: self.smoothing.value() / 100,
                               self.compare.draw)
        self.completions = CompletionsView()
        self.best_marks = {SFT: BestMark(self.loss_plot, "Loss"),
                           GRPO: BestMark(self.grpo.reward_plot, self.grpo.reward_title)}

    def _layout(self) -> None:
        grid = QGridLayout()
        for i, p in enumerate((self.lr_plot, self.grad_plot, self.clipped_plot, self.tps_plot)):
            grid.addWidget(p, i // 2, i % 2)
        self.pages = QTabWidget(documentMode=True)
        self.pages.addTab(self.grpo, "Rewards")
        self.pages.addTab(self.completions, "Completions")
        self.pages.addTab(box(QVBoxLayout, (box(QHBoxLayout, (self.loss_plot, 2),
                                                (self.task_plot, 1)), 3),
                              (grid, 2), widget=True),
                          "Loss and optimiser")
        split = QSplitter(Qt.Horizontal)
        split.addWidget(box(QVBoxLayout, box(QHBoxLayout, self.log_scale, 16,
                                             QLabel("Smoothing"), self.smoothing,
                                             self.smoothing_label, None, self.reset_zoom_button),
                            (self.pages, 1), widget=True))
        split.addWidget(box(QVBoxLayout, self.compare,
                            QLabel("Recent log", objectName="sectionHeader"),
                            (self.log_view, 1), widget=True))
        split.setSizes([900, 340])
        layout = box(QVBoxLayout, box(QHBoxLayout, (box(QVBoxLayout, self.title,
                                                        self.subtitle), 1),
                                      self.continue_button, self.stop_save_button,
                                      self.stop_discard_button),
                     self.progress, self.stats_label, (split, 1))
        layout.setContentsMargins(20, 16, 20, 16)
        self.setLayout(layout)

    def _connect(self) -> None:
        self.tail.reset.connect(self._on_reset)
        self.tail.steps.connect(self._on_steps)
        self.tail.evals.connect(self._on_evals)
        self.tail.events.connect(self._on_events)
        self.tail.logs.connect(self._on_logs)
        self.tail.status_changed.connect(self._on_status)
        self.stop_save_button.clicked.connect(self.stop_and_save)
        self.stop_discard_button.clicked.connect(self.stop_and_discard)
        self.continue_button.clicked.connect(self.continue_run)
        self.compare.changed.connect(lambda: self.redraw.mark(self._headline_plot()))
        self.redraw.add("loss", self._draw_loss)
        self.redraw.add("task", self._draw_task)
        for i, key in enumerate(SFT_KEYS[1:], start=2):
            self.redraw.add(key, lambda i=i, key=key: self._draw_small(key, i))
        self.log_scale.toggled.connect(self._on_log_scale)
        self.smoothing.valueChanged.connect(self._on_smoothing)
        self.reset_zoom_button.clicked.connect(self.reset_zoom)
        self.ctx.run_selected.connect(self.set_run)
        self.ctx.runs_changed.connect(self._update_buttons)    # paused or resumed on Runs

    # ---------------------------------------------------------------- following a run
    def set_run(self, path: str) -> None:
        path = str(RunDir(path).path) if path else None
        if path == self.run_path:
            return
        self.run_path = path
        self.title.setText(Path(path).name if path else "No run selected")
        self.subtitle.setText(path or "Pick a run on the Runs screen.")
        self._set_kind(run_kind(path))
        self.compare.set_run(path)
        self.tail.set_run(path)

    def _set_kind(self, kind: RunKind) -> None:
        """Show the pages of a GRPO or a supervised run; compared runs go with the old kind.
        Each kind's headline plot has its own best mark (one moved between two plots' scenes
        was drawn outside both)."""
        self.kind = kind
        grpo = kind is GRPO
        titles = PREFERENCE_PLOTS if self._preference else SMALL_PLOTS
        for key, plot in (("clipped", self.clipped_plot), ("tps", self.tps_plot)):
            retitle(plot, *titles[key][:2])
        for i in (0, 1):
            self.pages.setTabVisible(i, grpo)
        self.pages.tabBar().setVisible(grpo)
        self.pages.setCurrentIndex(0 if grpo else 2)
        self.compare.set_target(self.grpo.reward_plot if grpo else self.loss_plot, kind)

    @property
    def _preference(self) -> bool:
        return self.kind.name in PREFERENCE_KINDS

    @property
    def best_mark(self) -> BestMark:
        """The best mark on the followed run's headline plot."""
        return self.best_marks.get(self.kind, self.best_marks[SFT])   # preference: the loss plot

    def _headline_plot(self) -> str:
        """The redraw key of the plot with the run's headline metric (and the runs compared)."""
        return "reward" if self.kind is GRPO else "loss"

    def showEvent(self, event) -> None:
        super().showEvent(event)
        if not event.spontaneous():
            self.reveal.start(self)
        self.tail.start()                        # after a close; a no-op when following
        self.compare.start()

    def hideEvent(self, event) -> None:
        super().hideEvent(event)
        if not event.spontaneous():
            self.reveal.hide(self)               # laid out and painted when shown again

    def _redraw_keys(self) -> tuple[str, ...]:
        return SFT_KEYS + (GRPO_KEYS if self.kind is GRPO else ())

    def _on_reset(self, _path: str) -> None:
        self._steps.clear()
        self._evals.clear()
        self._pref_evals.clear()
        self._task_evals.clear()
        self.task_plot.hide()
        self.grpo.clear()
        self.completions.clear()
        self.status, self.last_step = {}, {}
        self.best = None
        for mark in self.best_marks.values():
            mark.clear()
        self.log_view.clear()
        self.ranges.refit()
        self.redraw.mark()                          # every plot, the hidden pages' too
        self.redraw.flush()
        self._update_progress()
        self._update_buttons()

    def _on_steps(self, events: list) -> None:
        small = PREFERENCE_PLOTS if self._preference else SMALL_PLOTS
        self._steps.extend([(e.get("step", 0), num(e, "loss"), num(e, "lr"),
                             num(e, "grad_norm"), num(e, small["clipped"][2]),
                             num(e, small["tps"][2])) for e in events])
        if self.kind is GRPO:
            self.grpo.add_steps(events)
        self.last_step = events[-1]
        self.redraw.mark(*self._redraw_keys())
        self._update_progress()

    def _on_evals(self, events: list) -> None:
        for event in events:
            self.best = better(event, self.kind.name, self.best)
        if self.best is not None:
            self.best_mark.set(self.best.step, self.best.text())
        if self.kind is GRPO:                  # held-out rewards, no validation loss
            self.grpo.add_evals(events)
            self.redraw.mark("reward")
        else:
            self._evals.extend([(e.get("step", 0), num(e, "eval_loss" if "eval_loss" in e
                                                       else "loss")) for e in events])
            self.redraw.mark("loss")
        if self._preference:
            self._pref_evals.extend([(e.get("step", 0), num(e, "eval_rewards/accuracies"),
                                      num(e, "eval_rewards/margins")) for e in events])
            self.redraw.mark("clipped", "tps")
        tasks = [e for e in events if "task_acc" in e]
        if tasks:
            self._task_evals.extend([(e.get("step", 0), num(e, "task_acc")) for e in tasks])
            retitle(self.task_plot, f"Task accuracy: {tasks[-1].get('task', '')}", TASK_Y)
            self.task_plot.show()
            self.redraw.mark("task")
        self._update_progress()

    def _on_events(self, events: list) -> None:
        if self.kind is GRPO:
            self.completions.add_events(events)

    def _on_logs(self, lines: list) -> None:
        self.log_view.appendPlainText("\n".join(lines[-300:]))

    def _on_status(self, status: dict) -> None:
        self.status = status
        self._update_progress()
        self._update_buttons()

    def _on_smoothing(self, value: int) -> None:
        self.smoothing_label.setText(f"{value / 100:.2f}")
        self.redraw.mark(self._headline_plot())
        self.redraw.flush()

    def _draw_loss(self) -> None:
        weight = self.smoothing.value() / 100
        x = self._steps.col(0)
        self.loss_curve.setData(x, self._steps.col(1))
        self.smooth_curve.setData(x, self._steps.smoothed(weight))
        self.val_curve.setData(self._evals.col(0), self._evals.col(1))
        ys = [self._steps.col(1), self._evals.col(1)] + self.compare.draw(self.loss_plot, weight)
        self.ranges.fit(self.loss_plot, ys, log=self.log_scale.isChecked())

    def _draw_task(self) -> None:
        self.task_curve.setData(self._task_evals.col(0), self._task_evals.col(1))
        self.ranges.fit(self.task_plot, [])

    def _draw_small(self, key: str, column: int) -> None:
        curve = {"lr": self.lr_curve, "grad": self.grad_curve, "clipped": self.clipped_curve,
                 "tps": self.tps_curve}[key]
        curve.setData(self._steps.col(0), self._steps.col(column))
        ys = [self._steps.col(column)]
        if key in self.held_out_curves:      # a preference run's held-out points (else none)
            col = 1 if key == "clipped" else 2
            points = self._pref_evals if self._preference else Series(3)
            self.held_out_curves[key].setData(points.col(0), points.col(col))
            ys.append(points.col(col))
        self.ranges.fit(self.plots[key], ys, from_zero=True)

    def _x_max(self) -> float:
        """The last step the plots show: the run's total, or further when the data go on."""
        total = self.last_step.get("total_steps") or self.status.get("total_steps") or 0
        last = self._steps.col(0)[-1] if self._steps.n else 0.0
        return max(float(total), last, self.compare.last_step())

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
        if ev and self.kind is GRPO:
            parts = self.grpo.stats(ev)
        elif ev:
            parts.append(f"loss {num(ev, 'loss'):.4f}")
            if self._evals.n:
                parts.append(f"validation {self._evals.col(1)[-1]:.4f}")
            if self.best is not None:
                parts.append(f"best at {self.best.text()}")
            parts += [f"lr {num(ev, 'lr'):.2e}", f"grad norm {num(ev, 'grad_norm'):.3f}",
                      f"clipped {100 * num(ev, 'clipped_fraction'):.0f}%",
                      f"{num(ev, 'tokens_per_s'):,.0f} tokens/s",
                      f"elapsed {clock(ev.get('elapsed_s'))}"]
        if st.get("precision"):   # what the products compute in, e.g. "bf16: AVX512-BF16 via ..."
            parts.append(f"precision {str(st['precision']).split(':')[0]}")
        self.stats_label.setToolTip(f"Precision: {st['precision']}" if st.get("precision")
                                    else "")
        error = st.get("error")
        if isinstance(error, dict) and error.get("message"):
            parts.append(f"failed: {error['message']}")
        self.stats_label.setText("   \u00b7   ".join(parts))

    # ---------------------------------------------------------------- controls
    def _on_log_scale(self, on: bool) -> None:
        self.loss_plot.setLogMode(y=on)
        self.ranges.refit(self.loss_plot)
        self.redraw.mark("loss")
        self.redraw.flush()

    def set_smoothing(self, weight: float) -> None:
        self.smoothing.setValue(round(weight * 100))

    def reset_zoom(self) -> None:
        """Back to the whole run: steps 0 .. total, values auto-ranged."""
        self.ranges.reset()
        self.redraw.mark(*self._redraw_keys())
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
        self.continue_button.setEnabled(self._continuable(job))
        if job is None and self.status.get("state") == "running":
            tip = "Started from the command line: press Ctrl-C in its terminal to pause it."
            self.stop_save_button.setToolTip(tip)

    def _continuable(self, job) -> bool:
        """Whether Continue applies (api.can_continue, as on the Runs screen): a paused,
        failed or cancelled job, or a run outside the queue that stopped with a checkpoint."""
        if self.run_path is None:
            return False
        try:
            has_checkpoint = any(p.is_dir()
                                 for p in RunDir(self.run_path).checkpoints_dir.iterdir())
        except OSError:
            has_checkpoint = False
        return can_continue(job, job.state if job is not None else
                            str(self.status.get("state") or ""), has_checkpoint)

    def continue_run(self) -> None:
        """Continue the followed run (JobQueue.continue_run, the Runs screen's Continue) and
        make sure a worker runs it."""
        try:
            message = self.ctx.queue.continue_run(self.run_path, self.job())
            self.ctx.ensure_worker()
            self.ctx.status_message.emit(message)
        except EngineError as e:
            self.ctx.status_message.emit(e.message)
        self._update_buttons()
        self.ctx.runs_changed.emit()

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

    def closeEvent(self, event) -> None:
        self.tail.stop()
        self.compare.stop()
        self.redraw.timer.stop()
        super().closeEvent(event)


def retitle(plot, title: str, y_label: str) -> None:
    """A small plot's title and y label (as `small_plot` styles them)."""
    plot.setTitle(title, color=theme.color("plot_title"), size="9pt")
    plot.getPlotItem().setLabel("left", y_label, color=theme.color("axis_text"),
                                **{"font-size": "8pt"})
