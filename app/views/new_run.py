"""New run: pick a model and a dataset, set the training up, queue it or start it now.

Three tabs (Model, Dataset, Training) above an action bar that is always visible: the run's
name and folder, a summary with the estimated memory, save/load settings, "Queue run" and
"Start now". Starting creates the run directory (`RunDir.create`), adds it to the job queue,
makes sure the engine worker runs (`ctx.ensure_worker()`), selects the run and shows Monitor.
It opens with the bundled sample model and `sample_data/chat.jsonl`, so a first-time user can
press Start.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QFileDialog, QHBoxLayout, QLabel, QLineEdit, QPushButton,
                               QStackedWidget, QTabWidget, QVBoxLayout, QWidget)

from app.engine.data import DataConfig
from app.engine.errors import ConfigError, EngineError
from app.engine.lint import LintReport, lint_file
from app.engine.model_info import ModelCard, describe_model, human_bytes, human_count
from app.views.context import AppContext, Background, sample_dataset_path, sample_model_path
from app.views.dataset_panel import DatasetPanel
from app.views.error_panel import ErrorPanel
from app.views.model_card import ModelCardView, ModelPicker, discover_models
from app.views.settings_form import DATA_KEYS, SettingsForm

ESTIMATE_ROW = "LoRA run estimate"
DATA_KEY = "recent/dataset"
TABS = ("model", "dataset", "training")
_NAME_OK = re.compile(r"^[\w.\-+ ]+$")


def _create_and_queue(ctx: AppContext, path: Path, config: dict, start: bool) -> int | None:
    """Write the run directory, queue it (first when `start`), make sure a worker runs.
    Runs in a worker thread: disk and queue writes never hold the window up."""
    from app.engine.jobs import PENDING
    from app.engine.rundir import RunDir

    run = RunDir.create(path, config)
    priority = 0
    if start:
        pending = ctx.queue.list(PENDING)
        priority = max((j.priority for j in pending), default=0) + (1 if pending else 0)
    ctx.queue.add(run.path, priority)
    return ctx.ensure_worker()


class NewRunView(QWidget):
    """The New run screen. `run_created(path)` after a run was queued."""

    run_created = Signal(str)

    def __init__(self, ctx: AppContext, parent: QWidget | None = None, *,
                 read_model: Callable[[str], ModelCard] = describe_model,
                 lint: Callable[..., LintReport] = lint_file,
                 discover: Callable[[], list] | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.card: ModelCard | None = None
        self.memory_estimate: int | None = None     # bytes, for the current settings
        self._creating: str | None = None           # the run being created and queued
        self._read_model = read_model
        self._bg = Background(self, max_threads=1)

        self.picker = ModelPicker(ctx.settings, discover=discover or discover_models)
        self.picker.model_chosen.connect(self.open_model)
        self.card_view = ModelCardView(read_model)
        self.card_view.card_loaded.connect(self._on_card)
        self.card_view.load_failed.connect(self._on_card_failed)
        self.model_error = ErrorPanel()
        self._card_stack = QStackedWidget(objectName="content")
        self._card_stack.addWidget(self.card_view)
        self._card_stack.addWidget(self.model_error)
        model_tab = QWidget()
        ml = QHBoxLayout(model_tab)
        ml.setContentsMargins(0, 0, 0, 0)
        ml.setSpacing(0)
        ml.addWidget(self.picker)
        ml.addWidget(self._card_stack, 1)

        self.dataset = DatasetPanel(lint=lint)
        self.dataset.data_changed.connect(self._on_data_changed)
        self.dataset.report_ready.connect(lambda _r: self._update_summary())
        self.form = SettingsForm()
        self.form.changed.connect(self._on_form_changed)
        self.memory_label = QLabel(objectName="memoryEstimate", wordWrap=True,
                                   textFormat=Qt.PlainText)
        training_tab = QWidget()
        tl = QVBoxLayout(training_tab)
        tl.setContentsMargins(16, 10, 16, 0)
        tl.addWidget(self.memory_label)
        tl.addWidget(self.form, 1)

        self.tabs = QTabWidget(documentMode=True)
        self.tabs.addTab(model_tab, "1  Model")
        self.tabs.addTab(self.dataset, "2  Dataset")
        self.tabs.addTab(training_tab, "3  Training")

        self.name_field = QLineEdit(placeholderText="run name (default: date-time-dataset)")
        self.name_field.setMaximumWidth(280)
        self.name_field.textChanged.connect(lambda _t: self._update_summary())
        self.summary_label = QLabel(objectName="runSummary", wordWrap=True,
                                    textFormat=Qt.PlainText)
        self.problems_label = QLabel(objectName="fieldError", wordWrap=True,
                                     textFormat=Qt.PlainText)
        self.save_button = QPushButton("Save settings\u2026")
        self.save_button.clicked.connect(self._save_dialog)
        self.load_button = QPushButton("Load settings\u2026")
        self.load_button.clicked.connect(self._load_dialog)
        self.queue_button = QPushButton("Queue run")
        self.queue_button.setToolTip("Add the run to the end of the queue")
        self.queue_button.clicked.connect(lambda: self.create_run(start=False))
        self.start_button = QPushButton("Start now", objectName="primaryButton")
        self.start_button.setToolTip("Put the run first in the queue, start the worker and "
                                     "watch it in Monitor")
        self.start_button.clicked.connect(lambda: self.create_run(start=True))
        bar = QWidget(objectName="actionBar")
        bl = QVBoxLayout(bar)
        bl.setContentsMargins(16, 8, 16, 10)
        bl.setSpacing(4)
        row1 = QHBoxLayout()
        row1.addWidget(QLabel("Run name", objectName="formLabel"))
        row1.addWidget(self.name_field)
        row1.addWidget(self.summary_label, 1)
        row2 = QHBoxLayout()
        row2.addWidget(self.problems_label, 1)
        for b in (self.save_button, self.load_button, self.queue_button, self.start_button):
            row2.addWidget(b)
        bl.addLayout(row1)
        bl.addLayout(row2)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(self.tabs, 1)
        layout.addWidget(bar)

        self._estimate_timer = QTimer(self, singleShot=True, interval=200)
        self._estimate_timer.timeout.connect(self._start_estimate)
        model, data = self._initial_files()
        if data:
            self.dataset.set_data_path(data)
        if model:
            self.open_model(model)
        self._update_summary()

    def _initial_files(self) -> tuple[str | None, str | None]:
        """The last model and dataset used, else the bundled sample model and chat.jsonl."""
        recent = [p for p in self.picker.recent_models() if os.path.isfile(p)]
        data = self.ctx.settings.value(DATA_KEY, "", type=str)
        return (recent[0] if recent else sample_model_path(),
                data if data and os.path.isfile(data) else sample_dataset_path())

    # ---------------------------------------------------------------- model
    def open_model(self, path: str) -> None:
        """Show the card of the GGUF file at `path` (read in the background)."""
        path = os.path.abspath(os.path.expanduser(path))
        self.card = None
        self.memory_estimate = None
        self.memory_label.setText("")
        self.form.set_card(None)
        self.picker.set_current(path)
        self._card_stack.setCurrentWidget(self.card_view)
        self.card_view.load(path)
        self._relint()
        self._update_summary()

    def model_path(self) -> str:
        return self.card.path if self.card is not None else ""

    def model_error_shown(self) -> bool:
        return self._card_stack.currentWidget() is self.model_error

    def _on_card(self, card: ModelCard) -> None:
        self.card = card
        self.picker.remember(card.path)
        self.form.set_card(card)
        self.ctx.select_model(card.path)
        self._relint()
        self._estimate_timer.start()
        self._update_summary()

    def _on_card_failed(self, path: str, error: BaseException) -> None:
        self.card = None
        self.model_error.show_error(f"Could not open {os.path.basename(path)}", error,
                                    context=f"File: {path}")
        self._card_stack.setCurrentWidget(self.model_error)
        self._relint()
        self._update_summary()

    # ---------------------------------------------------------------- live estimate
    def _start_estimate(self) -> None:
        if self.card is None:
            return
        rank, ctx = self.form["rank"].value(), self.form["context"].value()
        self._bg.run("estimate", describe_model, self.card.path, rank, ctx,
                     on_done=self._show_estimate, on_error=lambda e: self._show_estimate(None))

    def _show_estimate(self, sized: ModelCard | None) -> None:
        card = sized or self.card
        if card is None or self.card is None:
            return
        m = card.memory
        trainable = self.form.trainable_params()
        per_param = m.adapter / card.lora_params if card.lora_params else 16
        if self.form.mode() == "full":
            self.memory_estimate = None
            text = (f"Full fine-tuning: weights {human_bytes(m.weights)} plus optimizer state "
                    "for every unquantized tensor (no estimate yet).")
        else:
            adapter = int((trainable or 0) * per_param)
            self.memory_estimate = m.weights + m.dequant_working + m.activations + adapter
            text = (f"Estimated memory: {human_bytes(self.memory_estimate)} \u2014 weights "
                    f"{human_bytes(m.weights)} (memory-mapped), dequantized layer "
                    f"{human_bytes(m.dequant_working)}, adapter + optimizer {human_bytes(adapter)} "
                    f"({human_count(trainable or 0)} trainable), activations "
                    f"{human_bytes(m.activations)} (context {card.context})")
        self.memory_label.setText(text)
        self.card_view.set_row(ESTIMATE_ROW, "Estimated memory (current settings)",
                               text.split(": ", 1)[-1])
        self._update_summary()

    # ---------------------------------------------------------------- dataset
    def data_path(self) -> str:
        return self.dataset.data_path()

    def data_config(self) -> DataConfig | None:
        """The dataset settings of the form, or None while they are invalid."""
        try:
            cfg = DataConfig.from_dict(self.form.values()["data_config"])
            cfg.validate()
        except (EngineError, TypeError, ValueError):
            return None
        if any(k in self.form.errors() for k in DATA_KEYS):
            return None
        return cfg

    def _on_data_changed(self, path: str) -> None:
        if path and os.path.isfile(path):
            self.ctx.settings.setValue(DATA_KEY, path)
        self._relint()

    def _relint(self) -> None:
        cfg = self.data_config()
        if cfg is None:
            return
        self.dataset.set_inputs(self.data_path(), self.model_path(), replace(cfg))

    def _on_form_changed(self, key: str) -> None:
        if key in DATA_KEYS or key in ("all", "seed", "clip", "weights_path"):
            self._relint()
        if key in ("rank", "context", "targets", "mode", "all"):
            self._estimate_timer.start()
        self._update_summary()

    # ---------------------------------------------------------------- the run
    def config_dict(self) -> dict:
        """The RunConfig dict the screen would start (model and data included)."""
        d = self.form.values()
        d["model"], d["data"] = self.model_path(), self.data_path()
        return d

    def build_config(self):
        """The RunConfig to start; raises ConfigError when something is missing or invalid."""
        from app.engine.run import RunConfig

        d = self.config_dict()
        if not d["model"]:
            raise ConfigError("Pick a model first.", "Open a GGUF file on the Model tab.")
        if not d["data"]:
            raise ConfigError("Pick a dataset first.", "Choose a JSONL file on the Dataset tab.")
        cfg = RunConfig.from_dict(d)
        cfg.validate()
        return cfg

    def problems(self) -> list[tuple[str, str]]:
        """(tab, message) for everything that stops the run from starting."""
        out: list[tuple[str, str]] = []
        if self.card is None:
            out.append(("model", "Pick a model that opens (Model tab)."))
        if not self.data_path():
            out.append(("dataset", "Pick a dataset (Dataset tab)."))
        elif not os.path.isfile(self.data_path()):
            out.append(("dataset", f"There is no file {self.data_path()}."))
        elif self.dataset.error is not None:
            out.append(("dataset", "The dataset cannot be used: " +
                        getattr(self.dataset.error, "message", str(self.dataset.error))))
        elif self.dataset.report is not None and self.dataset.report.accepted == 0:
            out.append(("dataset", "No row of the dataset can be used (see rejected rows)."))
        for key, msg in self.form.errors().items():
            out.append(("training", f"{key.replace('_', ' ')}: {msg}"))
        name = self.name_field.text().strip()
        if name and not _NAME_OK.match(name):
            out.append(("training", "The run name may use letters, digits, spaces and . - _ +"))
        return out

    def run_dir_for(self, name: str = "") -> Path:
        name = name.strip() or time.strftime("%Y%m%d-%H%M%S-") + Path(self.data_path()).stem
        root = self.ctx.runs_root()
        path, i = root / name, 2
        while path.exists() or str(path) == self._creating:
            path, i = root / f"{name}-{i}", i + 1
        return path

    def create_run(self, start: bool = True) -> str | None:
        """Create the run directory and queue it (first when `start`), off the GUI thread.
        Returns the run's path at once (`run_created(path)` follows when it is queued), or
        None when something is wrong (the problems are shown, nothing is created)."""
        problems = self.problems()
        if problems:
            self._update_summary()
            self.tabs.setCurrentIndex(TABS.index(problems[0][0]))
            return None
        if self.is_creating():
            return None
        try:
            config = self.build_config()
        except Exception as e:                      # noqa: BLE001 -- to the error funnel
            self.ctx.report_error("Could not queue the run", e)
            return None
        path = self.run_dir_for(self.name_field.text())
        self._creating = str(path)
        self._update_summary()
        self._bg.run("create", _create_and_queue, self.ctx, path, config.to_dict(), start,
                     on_done=lambda _pid: self._on_created(str(path), start),
                     on_error=self._on_create_failed)
        return str(path)

    def is_creating(self) -> bool:
        return self._creating is not None

    def _on_created(self, path: str, start: bool) -> None:
        self._creating = None
        self.ctx.notify_runs_changed()
        self.ctx.select_run(path)
        self.ctx.status(f"{'Started' if start else 'Queued'} {os.path.basename(path)}")
        self.name_field.clear()
        self._update_summary()
        self.run_created.emit(path)
        self.ctx.show_screen("monitor" if start else "runs")

    def _on_create_failed(self, error: BaseException) -> None:
        self._creating = None
        self._update_summary()
        self.ctx.report_error("Could not queue the run", error)

    # ---------------------------------------------------------------- summary
    def _update_summary(self) -> None:
        parts = []
        if self.card is not None:
            parts.append(os.path.basename(self.card.path))
        r = self.dataset.report
        if self.data_path():
            name = os.path.basename(self.data_path())
            parts.append(f"{name} ({r.accepted:,} rows, {r.format})" if r else name)
        mode = self.form.mode()
        if mode != "full":
            parts.append(f"{'LoRA' if mode == 'lora' else 'hybrid'} rank "
                         f"{self.form['rank'].value()} on {', '.join(self.form.targets()) or '-'}")
        if self.memory_estimate:
            parts.append(f"\u2248 {human_bytes(self.memory_estimate)}")
        parts.append(f"\u2192 {self.ctx.runs_root()}")
        self.summary_label.setText(" \u00b7 ".join(parts))
        problems = self.problems()
        self.problems_label.setText("\n".join(m for _, m in problems[:3]))
        ok = not problems and self._creating is None
        self.queue_button.setEnabled(ok)
        self.start_button.setEnabled(ok)

    # ---------------------------------------------------------------- settings files
    def save_settings(self, path: str) -> None:
        Path(path).write_text(json.dumps(self.config_dict(), indent=2) + "\n", encoding="utf-8")
        self.ctx.status(f"Saved settings to {path}")

    def load_settings(self, path: str) -> None:
        """Load a settings file or a run's config.json (model and dataset too, when they
        exist); errors go to the window's error funnel."""
        try:
            try:
                d = json.loads(Path(path).read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ConfigError(f"Could not read {os.path.basename(path)}: {e}.",
                                  "Pick a settings file saved by the workbench or a run's "
                                  "config.json.") from e
            if not isinstance(d, dict):
                raise ConfigError(f"{os.path.basename(path)} is not a settings file.")
            from app.engine.run import RunConfig

            RunConfig.from_dict({"model": "", "data": "", **d})     # unknown keys -> ConfigError
        except Exception as e:                      # noqa: BLE001
            self.ctx.report_error("Could not load the settings", e, f"File: {path}")
            return
        self.form.set_values(d)
        if d.get("data") and os.path.isfile(d["data"]):
            self.dataset.set_data_path(d["data"])
        if d.get("model") and os.path.isfile(d["model"]) and d["model"] != self.model_path():
            self.open_model(d["model"])
        self.ctx.status(f"Loaded settings from {path}")

    def _save_dialog(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save settings", "run-settings.json",
                                              "JSON (*.json)")
        if path:
            try:
                self.save_settings(path)
            except OSError as e:
                self.ctx.report_error("Could not save the settings", ConfigError(
                    f"Could not write {path}: {e.strerror or e}.",
                    "Choose a folder you can write to."), f"File: {path}")

    def _load_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Load settings", "",
                                              "JSON (*.json);;All files (*)")
        if path:
            self.load_settings(path)
