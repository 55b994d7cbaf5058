"""New run: pick a model and a dataset, set the training up, queue it or start it now.

Three tabs (Model, Dataset, Training) above an action bar that is always visible: the run's
name and folder, "Run on" (`run_on.RunOnBox`: this computer or a cluster of Settings >
Clusters, whose path map must cover the run folder), a summary with the estimated memory,
"Reset to defaults", save/load settings, "Queue run" and "Start now". Starting creates the
run directory (`RunDir.create`), adds it to the job queue on the chosen executor, makes sure
the engine worker runs (`ctx.ensure_worker()`), selects the run and shows Monitor.
It opens with the bundled sample model and `sample_data/chat.jsonl`, so a first-time user can
press Start.

The run type (top right) is "Supervised (SFT)", "GRPO (reward-driven)" or a preference method
(DPO, ORPO, SimPO, KTO: app.engine.api.PREFERENCE_KINDS). A preference run's second tab is
Preference pairs (the dataset panel linting the file as pairs, `DatasetPanel.set_pairs`; each
kind of run keeps its own file), its Training tab shows the method's fields, and its config.json
is built by `build_preference_config`, as `workbench train --method` builds it. A GRPO run's second
tab is Prompts and rewards (`grpo_panel.GrpoPanel`) and its Training tab shows what a GRPO run
takes; its config.json is built by the engine's `build_grpo_config`, as `workbench grpo` does,
with "kind": "grpo", which the worker dispatches on. Custom reward files run as Python with the
user's rights: before a GRPO run with a file not yet trusted as it is now (typed in, loaded with
settings, or changed since) is queued, a question names the files, and only Yes trusts them
(app.engine.training.reward_functions) and queues the run.

Each run type keeps its own settings (`SettingsForm.set_kind`): a GRPO preset such as the
addition demo never reaches a supervised run. A supervised run on a dataset whose rows are
mostly rejected (more than half) starts only after a question naming the rejected lines.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QFileDialog, QHBoxLayout, QLabel, QLineEdit, QMessageBox,
                               QPushButton, QSizePolicy, QStackedWidget, QTabWidget, QVBoxLayout,
                               QWidget)

from app.engine.api import (GRPO, KINDS, LOCAL, PREFERENCE_KINDS, RUN_NAME_MAX, SFT,
                            ConfigError, DataConfig, EngineError, GrpoConfig, LintReport,
                            ModelCard, PreferenceConfig, RunConfig, build_grpo_config,
                            build_preference_config,
                            check_model_targets, default_run_name,
                            describe_model, estimate_memory, human_bytes, lint_file,
                            TRUST_SCOPE, trust_reward_files, untrusted_reward_files)
from app.views.context import AppContext, Background, sample_dataset_path, sample_model_path
from app.views.new_run.dataset_panel import DatasetPanel
from app.views.new_run.grpo_panel import GrpoPanel
from app.views.new_run.memory_estimate import memory_sentence
from app.views.new_run.model_card import ModelCardView, ModelPicker, discover_models
from app.views.new_run.preset_bar import PresetBar
from app.views.new_run.run_on import RunOnBox
from app.views.new_run.settings_file import read_settings, write_settings
from app.views.new_run.settings_form import DATA_KEYS, SettingsForm
from app.views.widgets.error_panel import ErrorPanel
from app.views.widgets.fit import FlowLayout, scrolled
from app.views.widgets.form_fields import combo, set_combo
from app.views.widgets.plots import box
from app.views.widgets.tooltips import KIND_TIPS, NEW_RUN_TIPS

ESTIMATE_ROW = "LoRA run estimate"                      # the card's row, until the first
ESTIMATE_LABEL = "Estimated memory (current settings)"  # estimate of the form renames it
DATA_KEY, PROMPTS_KEY = "recent/dataset", "recent/prompts"
KTO_KIND = "kto"                    # the preference method that takes unpaired rows too
PAIRS_KEY = "recent/preferences"    # a preference run's file: its own, not the dataset's
SAMPLE_PAIRS = "preferences.jsonl"  # a first preference run's (sample_data)
TABS = ("model", "dataset", "training")
# the run types: supervised, GRPO and the preference methods (DPO, ORPO, SimPO, KTO)
RUN_TYPES = tuple((k.name, k.title) for k in (*KINDS.values(), *PREFERENCE_KINDS.values()))
DATA_TABS = {SFT.name: "2  Dataset", GRPO.name: "2  Prompts and rewards",
             **{name: "2  Preference pairs" for name in PREFERENCE_KINDS}}
MAX_REJECTIONS_ASKED = 10           # rejected lines named in the question before a run
_NAME_OK = re.compile(r"^[\w.\-+ ]+$")


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
        self._loaded: tuple[str, dict] = ("", {})   # run type and dict of the last settings loaded
        self._pairs = False                         # the Dataset tab holds a preference file
        self._other_data = ""                       # the other kind of dataset's file, kept
        self._read_model = read_model
        self._bg = Background(self, max_threads=1)
        self._build(read_model, lint, discover or discover_models)
        self._layout()
        self._connect()
        model, data, prompts = self._initial_files()
        if data:
            self.dataset.set_data_path(data)
        if prompts:
            self.grpo_panel.set_prompts_path(prompts)
        if model:
            self.open_model(model)
        self._update_summary()

    def _build(self, read_model, lint, discover) -> None:
        self.picker = ModelPicker(self.ctx.settings, discover=discover)
        self.picker.estimate_settings = lambda: (self.form["rank"].value(),
                                                 self.form["context"].value())
        self.card_view = ModelCardView(read_model)
        self.model_error = ErrorPanel()
        self.dataset = DatasetPanel(lint=lint)
        self.grpo_panel = GrpoPanel()
        self.form = SettingsForm()
        self.presets = PresetBar(self.form, self.ctx.settings)
        self.memory_label = QLabel(objectName="memoryEstimate", wordWrap=True,
                                   textFormat=Qt.PlainText)
        self.kind_box = combo(RUN_TYPES)
        self.kind_box.setToolTip(NEW_RUN_TIPS["kind"])
        for i, (name, _title) in enumerate(RUN_TYPES):      # each choice says what it does
            self.kind_box.setItemData(i, KIND_TIPS[name], Qt.ToolTipRole)
        self.name_field = QLineEdit(placeholderText="default: date-time-dataset")
        self.name_field.ensurePolished()                  # the style sheet's font
        hint_width = self.name_field.fontMetrics().horizontalAdvance(
            self.name_field.placeholderText()) + 48        # + margins, frame and padding
        self.name_field.setMinimumWidth(hint_width)         # the whole placeholder shows
        self.name_field.setMaximumWidth(max(280, hint_width))
        self.name_field.setToolTip(NEW_RUN_TIPS["name"])
        self.run_on = RunOnBox(self.ctx)
        self.summary_label = QLabel(objectName="runSummary", wordWrap=True,
                                    textFormat=Qt.PlainText)
        self.problems_label = QLabel(objectName="fieldError", wordWrap=True,
                                     textFormat=Qt.PlainText)
        self.save_button = QPushButton("Save settings\u2026")
        self.load_button = QPushButton("Load settings\u2026")
        self.reset_button = QPushButton("Reset to defaults")
        self.reset_button.setToolTip("The run type's default settings (the command line's "
                                     "defaults; the model's context); the model, the data and "
                                     "the rewards stay")
        self.queue_button = QPushButton("Queue run")
        self.queue_button.setToolTip("Add the run to the end of the queue")
        self.start_button = QPushButton("Start now", objectName="primaryButton")
        self.start_button.setToolTip("Put the run first in the queue, start the worker and "
                                     "watch it in Monitor")
        self._estimate_timer = QTimer(self, singleShot=True, interval=200)

    def _layout(self) -> None:
        self._card_stack = QStackedWidget(objectName="content")
        self._card_stack.addWidget(self.card_view)
        self._card_stack.addWidget(self.model_error)
        model_tab = box(QHBoxLayout, self.picker, (self._card_stack, 1), widget=True)
        model_tab.layout().setSpacing(0)
        self._data_stack = QStackedWidget()
        self._data_stack.addWidget(self.dataset)
        self._data_stack.addWidget(self.grpo_panel)
        training_tab = box(QVBoxLayout, self.presets, self.memory_label, (self.form, 1),
                           widget=True)
        training_tab.layout().setContentsMargins(16, 10, 16, 0)

        self.tabs = QTabWidget(documentMode=True)
        # the Model and Dataset pages scroll within the tab when the window is short (a large
        # font), so the action bar below (Start) stays in sight
        self.tabs.addTab(scrolled(model_tab, "tabScroll"), "1  Model")
        self.tabs.addTab(scrolled(self._data_stack, "tabScroll"), DATA_TABS[SFT.name])
        self.tabs.addTab(training_tab, "3  Training")
        corner = box(QHBoxLayout, QLabel("Run type", objectName="formLabel"), self.kind_box,
                     widget=True)
        corner.layout().setContentsMargins(0, 2, 12, 2)
        self.tabs.setCornerWidget(corner, Qt.TopRightCorner)

        bar = QWidget(objectName="actionBar")
        bl = QVBoxLayout(bar)
        bl.setContentsMargins(16, 8, 16, 10)
        bl.setSpacing(4)
        row1 = FlowLayout(spacing=12)       # one line, or wrapped when narrow
        name = box(QHBoxLayout, QLabel("Run name", objectName="formLabel"), self.name_field,
                   widget=True)
        name.setSizePolicy(QSizePolicy.Maximum, QSizePolicy.Preferred)   # its hint, no more
        row1.addWidget(name)
        row1.addWidget(self.run_on)
        self.summary_label.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Preferred)
        row1.addWidget(self.summary_label)                 # the rest of the line, wrapped
        row2 = FlowLayout()                 # the problems, then the buttons at the right end
        self.problems_label.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Preferred)
        row2.addWidget(self.problems_label)
        row2.add_stretch()
        for b in (self.reset_button, self.save_button, self.load_button, self.queue_button,
                  self.start_button):
            row2.addWidget(b)
        bl.addLayout(row1)
        bl.addLayout(row2)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(self.tabs, 1)
        layout.addWidget(bar)

    def _connect(self) -> None:
        self.picker.model_chosen.connect(self.open_model)
        self.card_view.card_loaded.connect(self._on_card)
        self.card_view.load_failed.connect(self._on_card_failed)
        self.dataset.data_changed.connect(self._on_data_changed)
        self.dataset.report_ready.connect(self._on_report)
        self.grpo_panel.changed.connect(self._update_summary)
        self.grpo_panel.sampling.changed.connect(self._on_sampling_changed)
        self.grpo_panel.prompts_changed.connect(self._on_prompts_changed)
        self.grpo_panel.preset_requested.connect(self.apply_settings)
        self.form.changed.connect(self._on_form_changed)
        self.kind_box.currentIndexChanged.connect(lambda _i: self.set_run_type(self.kind()))
        self.name_field.textChanged.connect(lambda _t: self._update_summary())
        self.run_on.changed.connect(self._on_run_on)
        self.reset_button.clicked.connect(self.reset_settings)
        self.save_button.clicked.connect(self._save_dialog)
        self.load_button.clicked.connect(self._load_dialog)
        self.queue_button.clicked.connect(lambda: self.create_run(start=False))
        self.start_button.clicked.connect(lambda: self.create_run(start=True))
        self._estimate_timer.timeout.connect(self._start_estimate)
        self.form.set_on_cluster(self.run_on.cluster() is not None)

    def _on_run_on(self) -> None:
        """Run on changed: data-parallel workers are a cluster's (the form says so)."""
        self.form.set_on_cluster(self.run_on.cluster() is not None)
        self._update_summary()

    def _initial_files(self) -> tuple[str | None, str | None, str | None]:
        """The last model, dataset and prompt file used, else the bundled sample model,
        chat.jsonl and addition.jsonl."""
        recent = [p for p in self.picker.recent_models() if os.path.isfile(p)]
        last = lambda key: self.ctx.settings.value(key, "", type=str)
        data, prompts = last(DATA_KEY), last(PROMPTS_KEY)
        return (recent[0] if recent else sample_model_path(),
                data if data and os.path.isfile(data) else sample_dataset_path(),
                prompts if prompts and os.path.isfile(prompts)
                else sample_dataset_path("addition.jsonl"))

    # ---------------------------------------------------------------- run type
    def kind(self) -> str:
        """The run type: "sft", "grpo" or a preference method ("dpo", "orpo", "simpo", "kto")."""
        return self.kind_box.currentData()

    def set_run_type(self, kind: str) -> None:
        """Show the tabs and settings of a supervised ("sft"), a GRPO ("grpo") or a preference
        run ("dpo", "orpo", "simpo", "kto")."""
        if kind != self.kind():
            set_combo(self.kind_box, kind)              # comes back here through the signal
            return
        self._data_stack.setCurrentIndex(kind == GRPO.name)
        self.tabs.setTabText(1, DATA_TABS[kind])
        self.form.set_kind(kind)
        self._swap_dataset(kind in PREFERENCE_KINDS)    # after the form: its lint settings
        self.presets.setVisible(kind == SFT.name)      # the presets set a supervised run
        self._relint()
        if kind in PREFERENCE_KINDS and self.dataset.pair_report is not None:
            self._on_report(None)       # the steps' estimate again: KTO counts a pair twice
        self._estimate_timer.start()
        self._update_summary()

    def _swap_dataset(self, pairs: bool) -> None:
        """Between a supervised and a preference run the Dataset tab swaps files: each kind keeps
        its own (a preference run first gets the last preference file used, else the sample
        preferences), so neither trains on the other's file."""
        if pairs == self._pairs:
            return
        self._pairs = pairs
        here, path = self.data_path(), self._other_data
        last = self.ctx.settings.value(PAIRS_KEY, "", type=str)
        if not path and pairs:
            path = last if last and os.path.isfile(last) else sample_dataset_path(SAMPLE_PAIRS)
        self._other_data = here
        self.dataset.set_pairs(pairs)                   # lint it as a preference file
        if path and path != here:
            self.dataset.set_data_path(path)

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
        self.presets.set_moe(card.config.n_expert > 0)
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
        rank = self.form["rank"].value()
        if self.kind() == GRPO.name:
            ctx = self.grpo_panel.sampling["micro_batch_tokens"].value()
        elif self.kind() in PREFERENCE_KINDS:   # a micro-batch of packed completions, as the
            ctx = self.config_dict().get("micro_batch_tokens",      # CLI's check_run_memory
                                         PreferenceConfig.micro_batch_tokens)   # counts
        else:
            ctx = self.form["context"].value()
        self._bg.run("estimate", describe_model, self.card.path, rank, ctx,
                     on_done=self._show_estimate, on_error=lambda e: self._show_estimate(None))

    def _show_estimate(self, sized: ModelCard | None) -> None:
        card = sized or self.card
        if card is None or self.card is None:
            return
        packed = self.kind() == GRPO.name or self.kind() in PREFERENCE_KINDS
        tokens = f"{card.context:,} tokens" if packed else f"context {card.context}"
        train = self.config_dict().get("train", {})
        full, device = self.form.mode() == "full", self.form["device"].currentData()
        checkpoint = self.form["checkpoint_interval"].value()
        est = estimate_memory(card, self.form.trainable_params(), full, device, checkpoint,
                              train.get("weight_cache_mb"), train.get("precision", "auto"))
        self.memory_estimate = est.total
        text = memory_sentence(est, tokens, full, checkpoint, device)
        self.memory_label.setText(text)
        value = text.split(": ", 1)[-1]
        if not self.card_view.set_row(ESTIMATE_LABEL, ESTIMATE_LABEL, value):
            self.card_view.set_row(ESTIMATE_ROW, ESTIMATE_LABEL, value)
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
            self.ctx.settings.setValue(PAIRS_KEY if self._pairs else DATA_KEY, path)
        self._relint()

    def _on_sampling_changed(self, key: str) -> None:
        if key == "micro_batch_tokens":                 # a GRPO update's activations
            self._estimate_timer.start()

    def _on_prompts_changed(self, path: str) -> None:
        if path and os.path.isfile(path):
            self.ctx.settings.setValue(PROMPTS_KEY, path)

    def _on_report(self, report: LintReport | None) -> None:
        self.form.set_lint_report(report)
        pairs = self.dataset.pair_report
        if self.kind() in PREFERENCE_KINDS:     # KTO trains each pair as two rows
            self.form.set_training_rows(pairs and (
                2 * pairs["pairs"] if "pairs" in pairs and self.kind() == KTO_KIND
                else pairs["accepted"]))
        self._update_summary()

    def _relint(self) -> None:
        if self.kind() in PREFERENCE_KINDS:     # the form's preference settings as DataConfig
            d = self.form.values()
            cfg = DataConfig(context=d["context"], chat_template=d["chat_template"],
                             completion_as_chat=d["completion_as_chat"])
        else:
            cfg = None if self.kind() == GRPO.name else self.data_config()
        if cfg is None:
            return
        self.dataset.set_inputs(self.data_path(), self.model_path(), replace(cfg))

    def _on_form_changed(self, key: str) -> None:
        if key in DATA_KEYS or key in ("all", "seed", "clip", "weights_path"):
            self._relint()
        if key in ("rank", "context", "targets", "mode", "device", "checkpoint_interval",
                   "weight_cache_mb", "precision", "all"):
            self._estimate_timer.start()
        self._update_summary()

    # ---------------------------------------------------------------- the run
    def config_dict(self) -> dict:
        """The RunConfig dict the screen would start (model and data included), or of a GRPO
        run the GrpoConfig dict (model, prompts and rewards included)."""
        d = self.form.values()
        if self.kind() == GRPO.name:
            d = {**d, **self.grpo_panel.values(), "model": self.model_path()}
        else:
            d["model"], d["data"] = self.model_path(), self.data_path()
        kind, loaded = self._loaded
        return _with_hidden_settings(d, loaded) if kind == self.kind() else d

    def build_config(self):
        """The RunConfig (or GrpoConfig) to start; raises ConfigError when something is
        missing or invalid."""
        d = self.config_dict()
        if not d["model"]:
            raise ConfigError("Pick a model first.", "Open a GGUF file on the Model tab.")
        if self.kind() == GRPO.name:
            return build_grpo_config(d)
        if not d["data"]:
            raise ConfigError("Pick a dataset first.", "Choose a JSONL file on the Dataset tab.")
        if self.kind() in PREFERENCE_KINDS:     # as `workbench train --method KIND` builds it
            return build_preference_config(d)
        cfg = RunConfig.from_dict(d)
        cfg.validate()
        return cfg

    def problems(self) -> list[tuple[str, str]]:
        """(tab, message) for everything that stops the run from starting."""
        out: list[tuple[str, str]] = []
        if self.card is None:
            out.append(("model", "Pick a model that opens (Model tab)."))
        if self.kind() == GRPO.name:
            out += [("dataset", m) for m in self.grpo_panel.problems()]
        elif not self.data_path():
            out.append(("dataset", "Pick a dataset (Dataset tab)."))
        elif not os.path.isfile(self.data_path()):
            out.append(("dataset", f"There is no file {self.data_path()}."))
        elif self.dataset.error is not None:
            out.append(("dataset", "The dataset cannot be used: " +
                        getattr(self.dataset.error, "message", str(self.dataset.error))))
        elif (self.kind() in PREFERENCE_KINDS and self.dataset.pair_report is not None
              and not self.dataset.pair_report["trains"]):
            out.append(("dataset", "No row of the preference file can be used (see rejected "
                                   "rows)."))
        elif (self.kind() in PREFERENCE_KINDS and self.kind() != KTO_KIND
              and self.dataset.pair_report is not None and "pairs" not in self.dataset.pair_report):
            out.append(("dataset", f"The file has unpaired (KTO) rows: "
                                   f"{PREFERENCE_KINDS[self.kind()].label} needs chosen/rejected "
                                   "pairs. Choose KTO as the run type, or a file of pairs."))
        elif self.dataset.report is not None and self.dataset.report.accepted == 0:
            out.append(("dataset", "No row of the dataset can be used (see rejected rows)."))
        elif self.dataset.report is not None and self.dataset.report.training_rows == 0:
            out.append(("dataset", "No row of the dataset fits the context: all "
                                   f"{self.dataset.report.dropped:,} are longer and dropped "
                                   "(Rows longer than context)."))
        for key, msg in self.form.errors().items():
            out.append(("training", f"{key.replace('_', ' ')}: {msg}"))
        name = self.name_field.text().strip()
        if name and not _NAME_OK.match(name):
            out.append(("training", "The run name may use letters, digits, spaces and . - _ +"))
        elif len(os.fsencode(name)) > RUN_NAME_MAX:
            out.append(("training", f"The run name may be at most {RUN_NAME_MAX} bytes long "
                                    "(a folder name; accented letters take 2)."))
        elif self.run_on.cluster() is not None:        # its path map must cover the folder
            problem = self.run_on.problem(self.run_dir_for(name))
            out += [("training", problem)] if problem else []
        return out

    def run_dir_for(self, name: str = "") -> Path:
        stem = (f"grpo-{Path(self.grpo_panel.prompts_path()).stem}" if self.kind() == GRPO.name
                else Path(self.data_path()).stem)
        name = name.strip() or default_run_name(stem)
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
        if isinstance(config, GrpoConfig) and not self._confirm_reward_code(config):
            return None
        if isinstance(config, (RunConfig, PreferenceConfig)) and \
                not self._confirm_rejected_rows():
            return None
        path = self.run_dir_for(self.name_field.text())
        self._creating = str(path)
        self._update_summary()
        self._bg.run("create", self._check_and_queue, path, config, start,
                     self.run_on.executor(),
                     on_done=lambda _pid: self._on_created(str(path), start),
                     on_error=self._on_create_failed)
        return str(path)

    def _check_and_queue(self, path: Path, config, start: bool, executor: str = LOCAL):
        """(On the background thread.) The CLI's start-of-run rule first: LoRA targets that
        match nothing on this model, or make an adapter llama.cpp cannot load (e.g. embeddings
        of a tied model), are refused before a run folder exists; then queue the run to run on
        `executor` ("local" or a cluster's name)."""
        if config.train.mode != "full":
            check_model_targets(config.model, config.train.lora_targets)
        return self.ctx.queue_new_run(path, config.to_dict(), start, executor)

    def _confirm_reward_code(self, config: GrpoConfig) -> bool:
        """Ask before custom reward files not yet trusted as they are now run; Yes trusts
        them. False when the user says No."""
        files = untrusted_reward_files(config.rewards)
        if not files:
            return True
        answer = QMessageBox.question(
            self, "Run reward code?", f"This run uses reward code from {', '.join(files)}. "
            f"It runs as Python with your rights. {TRUST_SCOPE} Run it?",
            QMessageBox.Yes | QMessageBox.No, QMessageBox.No)
        if answer != QMessageBox.Yes:
            return False
        trust_reward_files(config.rewards)
        return True

    def _confirm_rejected_rows(self) -> bool:
        """Ask before training on a dataset whose rows mostly cannot train (more than half
        rejected, or dropped as longer than the context), naming the rejected lines and why
        and the dropped rows' count (the Dataset tab's report; a preference file's alike, its
        rows too long rejected, none dropped). False when the user says No."""
        r = _rows_report(self.dataset.report, self.dataset.pair_report if self._pairs else None)
        if r is None or (r.rows - r.training_rows) * 2 <= r.rows:   # rejected or dropped
            return True
        shown = r.rejected[:MAX_REJECTIONS_ASKED]
        lines = [f"line {line}: {reason}" for line, reason in shown]
        more = r.rejected_count - len(shown)
        if more > 0:
            lines.append(f"... and {more:,} more (Dataset tab)")
        if r.dropped:
            lines.append(f"{r.dropped:,} longer than the context ({r.context} positions), "
                         "dropped (Rows longer than context)")
        answer = QMessageBox.question(
            self, "Train on the few rows left?",
            f"{r.rows - r.training_rows:,} of the {r.rows:,} rows of {os.path.basename(r.path)} "
            f"cannot be used; the run would train on {r.training_rows:,}.\n\n"
            + "\n".join(lines) + "\n\nStart anyway?",
            QMessageBox.Yes | QMessageBox.No, QMessageBox.No)
        return answer == QMessageBox.Yes

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
        if self.kind() == GRPO.name:
            parts.append("GRPO: " + self.grpo_panel.summary())
        elif self.kind() in PREFERENCE_KINDS and self.data_path():
            p = self.dataset.pair_report
            what = ("" if p is None else f" ({p['pairs']:,} pairs)" if "pairs" in p
                    else f" ({p['accepted']:,} rows)")
            parts.append(f"{PREFERENCE_KINDS[self.kind()].label}: "
                         f"{os.path.basename(self.data_path())}{what}")
        elif self.data_path():
            name = os.path.basename(self.data_path())
            dropped = f", {r.dropped:,} dropped for overflow" if r and r.dropped else ""
            parts.append(f"{name} ({r.training_rows:,} rows{dropped}, {r.format})" if r
                         else name)
        mode = self.form.mode()
        if mode != "full":
            parts.append(f"{'LoRA' if mode == 'lora' else 'hybrid'} rank "
                         f"{self.form['rank'].value()} on {', '.join(self.form.targets()) or '-'}")
        if self.memory_estimate:
            parts.append(f"\u2248 {human_bytes(self.memory_estimate)}")
        where = self.run_on.executor()
        parts.append(f"\u2192 {self.ctx.runs_root()}" + (f" on {where}" if self.run_on.cluster()
                                                         else ""))
        self.summary_label.setText(" \u00b7 ".join(parts))
        problems = self.problems()
        self.problems_label.setText("\n".join(m for _, m in problems[:3]))
        ok = not problems and self._creating is None
        self.queue_button.setEnabled(ok)
        self.start_button.setEnabled(ok)

    # ---------------------------------------------------------------- settings files
    def save_settings(self, path: str) -> None:
        write_settings(path, self.config_dict())
        self.ctx.status(f"Saved settings to {path}")

    def load_settings(self, path: str) -> None:
        """Load a settings file or a run's config.json (model and dataset too, when they
        exist; a GRPO one switches the run type); errors go to the window's error funnel."""
        try:
            d = read_settings(path)
        except Exception as e:                      # noqa: BLE001
            self.ctx.report_error("Could not load the settings", e, f"File: {path}")
            return
        self.apply_settings(d)
        self.ctx.status(f"Loaded settings from {path}")

    def apply_settings(self, d: dict) -> None:
        """Show the settings of a RunConfig, GrpoConfig or PreferenceConfig dict (its run type,
        its model and dataset or prompts when they exist)."""
        self.set_run_type(d.get("kind", SFT.name))
        self._loaded = (self.kind(), d)     # what the form does not show is kept (config_dict)
        self.form.set_values(d)
        if self.kind() == GRPO.name:
            self.grpo_panel.set_values(d)
        elif d.get("data") and os.path.isfile(d["data"]):
            self.dataset.set_data_path(d["data"])
        if d.get("model") and os.path.isfile(d["model"]) and d["model"] != self.model_path():
            self.open_model(d["model"])

    def reset_settings(self) -> None:
        """The run type's defaults: the form's (`SettingsForm.reset`), a GRPO run's sampling
        settings; settings loaded from a file and not shown are dropped too."""
        self._loaded = ("", {})
        self.form.reset()
        if self.kind() == GRPO.name:
            self.grpo_panel.sampling.set_values({})
        self._update_summary()
        self.ctx.status("Settings reset to the defaults")

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


class _RowsReport(NamedTuple):
    """What the question before a mostly rejected run names, of either kind of report."""
    path: str
    rows: int
    training_rows: int
    rejected: list[tuple[int, str]]      # (line, reason), the first ones
    rejected_count: int
    dropped: int
    context: int


def _rows_report(report: LintReport | None, pairs: dict | None) -> _RowsReport | None:
    """A supervised dataset's LintReport or a preference file's report (`pairs`, preferred)
    as the few facts `_confirm_rejected_rows` asks with."""
    if pairs is not None:
        return _RowsReport(pairs["path"], pairs["rows"], pairs["accepted"],
                           [(x["line"], x["reason"]) for x in pairs["rejected"]],
                           pairs["rejected_count"], 0, pairs["context"])
    if report is None:
        return None
    return _RowsReport(report.path, report.rows, report.training_rows,
                       [(x.line, x.reason) for x in report.rejected], report.rejected_count,
                       report.dropped, report.context)


def _with_hidden_settings(shown: dict, loaded: dict) -> dict:
    """`shown` (the screen's settings) plus the settings of `loaded` that the screen has no
    field for, nested dicts merged the same way: repeating a run from its config.json keeps
    what the command line set (a weight cache size, GRPO's held-out samples, ...)."""
    out = dict(shown)
    for key, value in loaded.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _with_hidden_settings(out[key], value)
    return out
