"""Evaluate: the base model and runs' adapters side by side on benchmark tasks and prompt
suites (app.engine.evaluation, the same as `workbench eval --task`).

The evaluation runs in the engine process: Evaluate writes an evaluation job into the chosen
run's folder (RUN/evals/<id>/, `new_eval_job`) and queues it; the worker loads the model once,
scores every model on every task and saves the results with the run (RUN/evals.jsonl, written
whole when it has finished: a cancelled evaluation leaves nothing). The screen polls the job's
status (progress bar, Cancel) and shows the results as a table and a bar chart with error bars
(one standard error). Nothing here blocks the window: the model never loads in this process.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QComboBox, QFileDialog, QHBoxLayout, QLabel, QLineEdit,
                               QListWidget, QListWidgetItem, QProgressBar, QPushButton,
                               QSpinBox, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from app.engine.api import (EvalConfig, JobQueue, RunDir, list_runs, new_eval_job, parse_task,
                            read_evals, saved_cell)   # a result as workbench eval prints it
from app.engine.errors import EngineError
from app.views.context import AppContext, sample_dataset_path, sample_model_path
from app.views.widgets import theme
from app.views.widgets.plots import LEGEND, PALETTE, pen, plot_widget, tint

POLL_MS = 500
FORMATS = ("hellaswag", "winogrande", "mc", "jsonl", "suite", "ppl")


class EvaluateView(QWidget):
    """The Evaluate screen. `evaluate()` queues the job; `poll()` follows it."""

    finished = Signal(str)          # the job folder, when its results are shown

    def __init__(self, ctx: AppContext, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.job_id: int | None = None
        self.job_folder: Path | None = None
        layout = QVBoxLayout(self)
        layout.setContentsMargins(20, 16, 20, 16)
        layout.addWidget(QLabel("Evaluate", objectName="pageTitle"))
        layout.addWidget(QLabel("The base model and your runs' adapters on benchmark tasks "
                                "(scored as llama-perplexity scores them) and prompt suites "
                                "(scored by reward functions). It runs in the engine process "
                                "and is saved with the run.", objectName="pageSubtitle",
                                wordWrap=True))

        row = QHBoxLayout()
        row.addWidget(QLabel("Model"))
        self.model = QLineEdit(sample_model_path() or "")
        self.model.setToolTip("The GGUF base model every adapter is evaluated on.")
        row.addWidget(self.model, 1)
        browse = QPushButton("Browse\u2026")
        browse.clicked.connect(self._browse_model)
        row.addWidget(browse)
        layout.addLayout(row)

        lists = QHBoxLayout()
        self.targets = _titled_list(lists, "MODELS", "The base is always evaluated; tick the "
                                    "runs whose adapter (adapter.gguf) joins it.")
        self.tasks = _titled_list(lists, "TASKS", "Task specs: hellaswag:FILE, winogrande:FILE, "
                                  "mc:FILE, FILE.jsonl, suite:FILE, ppl:FILE "
                                  "(docs/USER_GUIDE.md, section 11).")
        right = lists.itemAt(1).layout()
        add = QHBoxLayout()
        self.format = QComboBox(minimumContentsLength=6)
        self.format.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
        self.format.addItems(FORMATS)
        self.format.setToolTip("The format of the task file you add.")
        add.addWidget(self.format)
        add_file = QPushButton("Add task file\u2026")
        add_file.clicked.connect(self._add_task_file)
        add.addWidget(add_file)
        remove = QPushButton("Remove")
        remove.clicked.connect(lambda: self.tasks.takeItem(self.tasks.currentRow()))
        add.addWidget(remove)
        right.addLayout(add)
        layout.addLayout(lists, 1)

        go = QHBoxLayout()
        go.addWidget(QLabel("Items per task"))
        self.limit = QSpinBox(minimum=0, maximum=1_000_000, value=0, specialValueText="all")
        self.limit.setToolTip("The first N items of each task file (all: 0).")
        go.addWidget(self.limit)
        go.addWidget(QLabel("Save with run"))
        self.save_with = QComboBox(minimumContentsLength=8)
        self.save_with.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
        self.save_with.setToolTip("The run whose evals.jsonl keeps the results.")
        go.addWidget(self.save_with, 1)
        self.evaluate_button = QPushButton("Evaluate", objectName="primary")
        self.evaluate_button.clicked.connect(self.evaluate)
        go.addWidget(self.evaluate_button)
        self.cancel_button = QPushButton("Cancel", enabled=False)
        self.cancel_button.clicked.connect(self.cancel)
        go.addWidget(self.cancel_button)
        layout.addLayout(go)
        self.progress = QProgressBar(textVisible=True)
        layout.addWidget(self.progress)
        self.message = QLabel("", objectName="hint", wordWrap=True)
        layout.addWidget(self.message)

        results = QHBoxLayout()
        self.table = QTableWidget(0, 0)
        results.addWidget(self.table, 1)
        self.chart = plot_widget()
        self.chart.setMinimumSize(240, 220)
        results.addWidget(self.chart, 1)
        layout.addLayout(results, 2)

        self.timer = QTimer(self, interval=POLL_MS)
        self.timer.timeout.connect(self.poll)
        for name in ("eval_suite.jsonl", "eval_tasks.jsonl"):
            path = sample_dataset_path(name)
            if path:
                self.add_task(("suite:" if name == "eval_suite.jsonl" else "") + path)
        self.refresh_runs()
        ctx.runs_changed.connect(self.refresh_runs)

    # ---------------------------------------------------------------- choices
    def refresh_runs(self) -> None:
        """The runs with an adapter, as choices; the base first, always on."""
        ticked = {self.targets.item(i).data(Qt.UserRole) for i in range(self.targets.count())
                  if self.targets.item(i).checkState() == Qt.Checked}
        current = self.save_with.currentData()
        self.targets.clear()
        self.save_with.clear()
        base = QListWidgetItem("base (no adapter)")
        base.setFlags(base.flags() & ~Qt.ItemIsUserCheckable & ~Qt.ItemIsEnabled)
        base.setCheckState(Qt.Checked)
        self.targets.addItem(base)
        for run in list_runs(self.ctx.runs_root()):
            self.save_with.addItem(run.name, str(run.path))
            adapter = run.path / "adapter.gguf"
            if adapter.is_file():
                item = QListWidgetItem(run.name)
                item.setData(Qt.UserRole, str(adapter))
                item.setFlags(item.flags() | Qt.ItemIsUserCheckable)
                item.setCheckState(Qt.Checked if str(adapter) in ticked else Qt.Unchecked)
                self.targets.addItem(item)
        if current is not None and self.save_with.findData(current) >= 0:
            self.save_with.setCurrentIndex(self.save_with.findData(current))

    def tick(self, run_name: str) -> None:
        for i in range(self.targets.count()):
            if self.targets.item(i).text() == run_name:
                self.targets.item(i).setCheckState(Qt.Checked)

    def add_task(self, spec: str) -> None:
        try:
            parse_task(spec)
        except EngineError as e:
            self.message.setText(str(e))
            return
        self.tasks.addItem(spec)

    def _add_task_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Task file")
        if path:
            fmt = self.format.currentText()
            self.add_task(path if fmt == "jsonl" else f"{fmt}:{path}")

    def _browse_model(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Model", "", "GGUF models (*.gguf)")
        if path:
            self.model.setText(path)

    def config(self) -> EvalConfig:
        targets = [{"label": "base"}]
        for i in range(1, self.targets.count()):
            item = self.targets.item(i)
            if item.checkState() == Qt.Checked:
                targets.append({"label": item.text(), "adapter": item.data(Qt.UserRole)})
        tasks = [self.tasks.item(i).text() for i in range(self.tasks.count())]
        return EvalConfig(os.path.abspath(self.model.text()), tasks, targets,
                          self.limit.value() or None)

    # ---------------------------------------------------------------- the job
    def evaluate(self) -> None:
        """Write the job into the chosen run and queue it (small file writes only)."""
        run = self.save_with.currentData()
        try:
            if not run:
                raise EngineError("Choose the run the results are saved with.",
                                  "Train a run first, or point Runs at your runs folder.")
            config = self.config()
            self.job_folder = new_eval_job(run, config)
            self.job_id = self.ctx.queue.add(self.job_folder)
            self.ctx.ensure_worker()
        except EngineError as e:
            self.message.setText(str(e))
            return
        self.message.setText(f"Queued: {len(config.targets)} models x {len(config.tasks)} "
                             "tasks, in the engine process.")
        self.progress.setRange(0, len(config.targets) * len(config.tasks))
        self.progress.setValue(0)
        self.evaluate_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.timer.start()

    def cancel(self) -> None:
        if self.job_id is not None:
            self.ctx.queue.cancel(self.job_id)
            self.message.setText("Cancelling: nothing is saved.")

    def poll(self) -> None:
        """Follow the job: progress from its status.json; at the end, its results."""
        if self.job_folder is None:
            return
        status = RunDir(self.job_folder).status()
        if status.get("total_steps"):
            self.progress.setRange(0, status["total_steps"])
            self.progress.setValue(status.get("step", 0))
        job = self.ctx.queue.get(self.job_id)
        if job.state in ("queued", "running", "paused"):
            return
        self.timer.stop()
        self.evaluate_button.setEnabled(True)
        self.cancel_button.setEnabled(False)
        if job.state == "done":
            self.show_results(read_evals(self.job_folder))
            self.message.setText(f"Saved with the run: {self.job_folder.parent.parent}"
                                 "/evals.jsonl")
            self.finished.emit(str(self.job_folder))
        else:
            self.message.setText(f"The evaluation {job.state}"
                                 + (f": {job.error_message}" if job.error_message else "."))

    # ---------------------------------------------------------------- results
    def show_results(self, rows: list[dict]) -> None:
        """A table (models x tasks) and a bar chart with one-standard-error bars."""
        models = list(dict.fromkeys(r["model"] for r in rows))
        tasks = list(dict.fromkeys(r["task"] for r in rows))
        cell = {(r["model"], r["task"]): r for r in rows}
        self.table.clear()
        self.table.setRowCount(len(models))
        self.table.setColumnCount(len(tasks))
        self.table.setHorizontalHeaderLabels(tasks)
        self.table.setVerticalHeaderLabels(models)
        for i, m in enumerate(models):
            for j, t in enumerate(tasks):
                r = cell.get((m, t))
                self.table.setItem(i, j, QTableWidgetItem(saved_cell(r) if r else ""))
        self.table.resizeColumnsToContents()
        self.chart.clear()
        width = 0.8 / max(len(models), 1)
        # the plots' palette in the current theme (the chart follows a switch: plots.themed)
        whiskers = pen(theme.LIGHT["axis_text"])
        self.chart.addLegend(**{key: tint(c) for key, c in LEGEND.items()})
        for i, m in enumerate(models):
            xs, ys, errs = [], [], []
            for j, t in enumerate(tasks):
                r = cell.get((m, t))
                if r and r["metric"] in ("acc", "pass_rate"):
                    xs.append(j + (i - (len(models) - 1) / 2) * width)
                    ys.append(100 * r["value"])
                    errs.append(100 * (r["stderr"] or 0) if r["stderr"] == r["stderr"] else 0)
            bars = pg.BarGraphItem(x=xs, height=ys, width=width,
                                   brush=tint(PALETTE[i % len(PALETTE)]), name=m)
            self.chart.addItem(bars)
            self.chart.addItem(pg.ErrorBarItem(x=np.array(xs), y=np.array(ys),
                                               height=2 * np.array(errs), beam=width / 3,
                                               pen=whiskers))
        self.chart.getAxis("bottom").setTicks([list(enumerate(tasks))])
        self.chart.setLabel("left", "accuracy / pass rate (%)")
        self.bars = [(m, t) for m in models for t in tasks
                     if cell.get((m, t)) and cell[(m, t)]["metric"] in ("acc", "pass_rate")]


def _titled_list(row: QHBoxLayout, title: str, tip: str) -> QListWidget:
    """A column of `row`: a section header over a list (returned)."""
    column = QVBoxLayout()
    column.addWidget(QLabel(title, objectName="sectionHeader"))
    widget = QListWidget(toolTip=tip)
    column.addWidget(widget)
    row.addLayout(column, 1)
    return widget
