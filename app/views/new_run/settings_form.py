"""The run's settings: what to train, the optimiser, lengths, evaluation, data and reward weights.

`SettingsForm.values()` is the part of a RunConfig dict the form owns (everything but `model`
and `data`); `set_values(d)` loads one (a saved settings file or a run's config.json). Problems
are shown inline, under the field (`errors()` returns them), never as pop-ups. The targets'
checkboxes show the trainable parameters each group adds for the current model and rank.

`set_kind("grpo")` turns it into the training half of a GRPO run: LoRA only, a number of steps,
held-out prompts; the dataset-only settings are hidden, and `values()` / `set_values(d)` speak
the GrpoConfig dict's keys (train, max_steps, val_split, eval_every, save_every, norms_every).

A preference kind ("dpo", "orpo", "simpo", "kto") shows a Preference group with the method's
fields (PREF_FIELDS) and hides what it has no use for (NOT_PREFERENCE); `values()` /
`set_values(d)` speak PreferenceConfig's keys (context, val_split, val_data, ... at the top).

One source of truth: each run kind has one settings dict, `default_settings(kind, card)` (the
engine's config class's defaults, which the CLI uses too, with a first run's choices on top), and
the form shows one of them. `set_kind` keeps the dict of the kind it leaves and shows the other's,
so nothing a GRPO preset set leaks into a supervised run. Every field shows what the engine will
use: warmup 0 reads "auto: 5% = N steps", the context is `default_context(card)` until the user
edits it (an edited one is capped at a new model's context, with a note).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from dataclasses import replace

from PySide6.QtCore import Qt

from PySide6.QtWidgets import (QCheckBox, QFileDialog, QFrame, QGridLayout, QHBoxLayout, QLabel,
                               QLineEdit, QPushButton, QScrollArea, QVBoxLayout, QWidget)

from app.engine.api import precision_choice
from app.engine.api import (DEFAULT_BETA, EVAL_TASK_KINDS, GRPO, PREFERENCE_KINDS, SFT,
                            TARGET_GROUPS,
                            DataConfig, GrpoConfig, LintReport, ModelCard, PreferenceConfig,
                            RunConfig, TrainConfig, default_context, default_lr,
                            EngineError, gpu_available, human_bytes, human_count,
                            lora_param_count, parse_task, read_chat_template)
from app.views.widgets.fit import Columns
from app.views.widgets.form_fields import (FormBase, combo, dspin, field_value, set_combo,
                                           set_field, spin)
from app.views.widgets.setting_labels import setting_label
from app.views.widgets.tooltips import PREFERENCE_ADAPTER_TIP, SETTINGS_TIPS

# A trained LoRA parameter's memory: float32 value, gradient and AdamW's two moments (the
# estimate's adapter bytes, app.engine.model.card).
BYTES_PER_TRAINED = 16
AUTO_EXPERT_RANK = "auto"            # expert_rank None: the rank, at most 8 past 32 experts
GROUP_LABELS = {"attention": "Attention (q, k, v, out)", "ffn": "Dense FFN",
                "experts": "Experts (MoE)", "shared": "Shared experts", "router": "Router",
                "output": "Output head", "embeddings": "Token embeddings"}
FULL_TARGETS = ("norms", "router", "embeddings", "output")
FORMATS = ("auto", "text", "completion", "chat", "alpaca", "sharegpt")
DATA_KEYS = ("context", "format", "overflow", "packing", "chat_loss", "weights_source",
             "weight_field", "weights_path", "normalize", "clip_lo", "clip_hi",
             "allow_negative", "val_split", "add_eos", "parse_special",
             "completion_as_chat", "chat_template")   # changes that change the linter's report
# A first run in the window is the README's first CLI run: rank 8, alpha 16 (half TrainConfig's:
# the sweep in docs/USER_GUIDE.md finds ranks 4-64 alike at one alpha, and the smaller adapter is
# quicker) on attention, experts and router; a supervised one 3 epochs, 10% held out and an
# evaluation every 30 steps (so it has a best checkpoint). Everything else
# is the engine's config classes' defaults, the CLI's too; the learning rate is the kind's own
# (default_lr for the mode and alpha; GrpoConfig's for GRPO).
FIRST_TRAIN = dict(lora_rank=8, lora_alpha=16.0, lora_targets=("attention", "experts", "router"))
FIRST_SFT = dict(epochs=3, eval_every=30)
FIRST_VAL_SPLIT = 0.1
_T = TrainConfig()


def default_settings(kind: str, card: ModelCard | None = None) -> dict:
    """The settings dict a new run of `kind` starts from (without its inputs: model, data,
    prompts, rewards): a RunConfig's or GrpoConfig's defaults with the first run's choices;
    a supervised run's context is the engine's `default_context(card)` for the model."""
    train = replace(_T, **FIRST_TRAIN, lr=default_lr(_T.mode, FIRST_TRAIN["lora_alpha"]))
    if kind in PREFERENCE_KINDS:        # the CLI's `train --method KIND` defaults, 10% held out
        context = default_context(card) if card is not None else PreferenceConfig.context
        d = PreferenceConfig(model="", data="", method=kind, train=train, context=context,
                             val_split=FIRST_VAL_SPLIT).to_dict()
        for key in ("model", "data"):
            d.pop(key)
        return d
    if kind == GRPO.name:
        g = GrpoConfig(model="", prompts="")
        d = replace(g, train=replace(g.train, **FIRST_TRAIN)).to_dict()
        for key in ("model", "prompts", "rewards"):
            d.pop(key)
        return d
    context = default_context(card) if card is not None else DataConfig.context
    data = DataConfig(val_fraction=FIRST_VAL_SPLIT, context=context)
    d = RunConfig(model="", data="", train=train, data_config=data, **FIRST_SFT).to_dict()
    for key in ("model", "data"):
        d.pop(key)
    return d


# field -> (section of the settings dict ("" = top level), key). A GRPO dict's held-out
# fraction is its top-level val_split (set_values maps it).
SIMPLE_FIELDS = {
    "mode": ("train", "mode"), "rank": ("train", "lora_rank"), "alpha": ("train", "lora_alpha"),
    "rslora": ("train", "rslora"), "dropout": ("train", "lora_dropout"),
    "optimizer": ("train", "optimizer"), "schedule": ("train", "schedule"),
    "warmup": ("train", "warmup_steps"), "warmup_fraction": ("train", "warmup_fraction"),
    "gclip": ("train", "gclip"), "max_grad_norm": ("train", "max_grad_norm"),
    "weight_decay": ("train", "weight_decay"), "beta1": ("train", "beta1"),
    "beta2": ("train", "beta2"), "eps": ("train", "eps"), "min_lr": ("train", "min_lr"),
    "seed": ("train", "seed"), "device": ("train", "device"),
    "precision": ("train", "precision"),
    "checkpoint_interval": ("train", "checkpoint_interval"),
    "epochs": ("", "epochs"), "max_steps": ("", "max_steps"), "eval_every": ("", "eval_every"),
    "save_every": ("", "save_every"), "patience": ("", "patience"),
    "norms_every": ("", "norms_every"), "keep_last": ("", "keep_last"),
    "max_bad_steps": ("", "max_bad_steps"), "format": ("data_config", "format"),
    "context": ("data_config", "context"), "overflow": ("data_config", "overflow"),
    "packing": ("data_config", "packing"), "chat_loss": ("data_config", "chat_loss"),
    "val_split": ("data_config", "val_fraction"), "normalize": ("data_config", "normalize"),
    "allow_negative": ("data_config", "allow_negative_weights"),
    "strict": ("data_config", "strict"), "shuffle": ("data_config", "shuffle"),
    "add_eos": ("data_config", "add_eos"), "parse_special": ("data_config", "parse_special"),
    "completion_as_chat": ("data_config", "completion_as_chat"),
    "vocab_chunk": ("train", "vocab_chunk"), "workers": ("", "workers"),
    "eval_task_limit": ("", "eval_task_limit"), "best_by": ("", "best_by")}
# field -> its flattened config key: its name is the one table's (widgets.setting_labels),
# which Compare's rows read too. batch, trainable and weights_source are the window's own.
CONFIG_KEYS = {**{key: f"{section}.{name}" if section else name
                  for key, (section, name) in SIMPLE_FIELDS.items()},
               "lr": "train.lr", "targets": "train.lora_targets",
               "expert_rank": "train.expert_rank", "full_targets": "train.full_targets",
               "grad_accum": "train.grad_accum", "weight_cache_mb": "train.weight_cache_mb",
               "val_path": "data_config.val_path", "chat_template": "data_config.chat_template",
               "weight_field": "data_config.weight_field",
               "weights_path": "data_config.weights_path", "clip": "data_config.clip_range",
               "adapter": "adapter", "eval_task": "eval_task"}
# A preference run's own settings (PreferenceConfig's top-level keys; the form's keys are theirs)
# and the methods that use each; beta 0 in its field is None: the method's DEFAULT_BETA.
PREF_FIELDS = {"pairs_per_step": PREFERENCE_KINDS, "beta": ("dpo", "simpo", "kto"),
               "pref_loss": ("dpo",), "label_smoothing": ("dpo", "simpo"),
               "sft_weight": ("dpo", "simpo"), "orpo_lambda": ("orpo",),
               "simpo_gamma": ("simpo",), "kto_desirable_weight": ("kto",),
               "kto_undesirable_weight": ("kto",)}
CONFIG_KEYS.update({key: key for key in PREF_FIELDS})
# the data settings a preference run has no use for (its rows are pairs, each one sequence)
# (the LoRA dropout stays in sight: a preference run refuses one, and a loaded file may set it)
NOT_PREFERENCE = ("batch", "grad_accum", "patience", "strict", "workers", "format", "overflow",
                  "packing", "chat_loss", "add_eos", "parse_special", "shuffle", "eval_task",
                  "eval_task_limit", "best_by")
# the run-length settings a preference run keeps at the top level of its config
PREF_LENGTHS = ("epochs", "max_steps", "eval_every", "save_every", "norms_every", "keep_last",
                "max_bad_steps", "adapter")
FLOAT_TEXTS = ("lr", "min_lr", "eps")      # typed as text: 1e-4 reads better than 0.000100
WEIGHT_CACHE_AUTO = -1                     # the spin box's value for weight_cache_mb None
WEIGHT_SOURCES = (("row", "From each row's field"), ("file", "From a weights file"))
SFT_ONLY = ("mode", "epochs", "context", "batch", "grad_accum", "patience", "strict",
            "val_path", "workers", "eval_task", "eval_task_limit", "best_by")
# The evaluation task's file dialog: its filter names the spec's kind (--eval-task KIND:FILE).
# The kinds are the engine's EVAL_TASK_KINDS, the multiple-choice ones: a prompt suite (suite:)
# is refused during training (app.engine.evaluation.during_training), so the dialog does not
# offer one, and a typed suite: spec shows the engine's refusal under the field.
TASK_FILTERS = {"Multiple choice JSONL (*.jsonl)": "jsonl",
                "HellaSwag, llama.cpp's text (*.txt)": "hellaswag",
                "WinoGrande (*.csv)": "winogrande",
                "llama.cpp binary multiple choice (*.bin)": "mc"}
TASK_SUFFIXES = {".jsonl": "jsonl", ".txt": "hellaswag", ".csv": "winogrande", ".bin": "mc"}
MODEL_TEMPLATE = "the model's (ChatML when it has none)"   # data_config.chat_template None
# field -> ((label, special value text) of a supervised run, (the same) of a GRPO run, of a
# preference run) (GRPO's "Steps": its max_steps is the run's length, not a cap)
KIND_TEXTS = {"val_split": ((setting_label("data_config.val_fraction"), ""),
                            (setting_label("val_split"), ""),
                            (setting_label("data_config.val_fraction"), "")),
              "max_steps": ((setting_label("max_steps"), "no cap"), ("Steps", "not set"),
                            (setting_label("max_steps"), "no cap")),
              "eval_every": ((setting_label("eval_every"), "end of epoch"),
                             (setting_label("eval_every"), "start and end"),
                             (setting_label("eval_every"), "start and end")),
              "save_every": ((setting_label("save_every"), "end of epoch"),
                             (setting_label("save_every"), "at the end"),
                             (setting_label("save_every"), "at the end"))}


def kind_index(kind: str) -> int:
    """KIND_TEXTS' column of a run kind: 0 supervised, 1 GRPO, 2 a preference method."""
    return 1 if kind == GRPO.name else 2 if kind in PREFERENCE_KINDS else 0


def group_param_counts(card: ModelCard, rank: int,
                       expert_rank: int | None = None) -> dict[str, int]:
    """Trainable LoRA parameters per target group for `card`'s tensors at `rank` (expert
    stacks at `expert_rank`, None: the engine's default for their number of experts)."""
    shapes = card.tensor_shapes
    out = {g: lora_param_count(shapes, rank, kinds, expert_rank)
           for g, kinds in TARGET_GROUPS.items()}
    for group, kinds in TARGET_GROUPS.items():  # output, token_embd: not block tensors, which
        for kind in kinds:                      # lora_param_count skips
            shape = shapes.get(f"{kind}.weight")
            if shape is not None and len(shape) == 2:
                out[group] += rank * sum(shape)
    return out


class SettingsForm(FormBase):
    """Every training setting with inline validation. `changed(str)` names the field."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.target_boxes: dict[str, QCheckBox] = {}
        self.full_boxes: dict[str, QCheckBox] = {}
        self.card: ModelCard | None = None
        self.kind = SFT.name                       # the run type: KINDS' or PREFERENCE_KINDS'
        self._per_kind: dict[str, dict] = {}       # run type -> its settings when left
        self._context_auto = True                  # the context follows the model
        self.train_windows: int | None = None      # the dataset's, estimated (warmup's note)
        self.on_cluster = False                    # Run on: a cluster (data-parallel workers)
        self._template_error: str | None = None    # a chat template file that was refused
        self._layout(self._build())
        self._pref_box.hide()                      # a preference run's group (set_kind)
        self.set_tooltips(SETTINGS_TIPS)
        here = precision_choice("auto").reason      # detected once per process
        for w in (self.label("precision"), self.fields["precision"]):
            w.setToolTip(f"{SETTINGS_TIPS['precision']}\nauto on this computer: {here}")
        self._connect()
        self.set_values({})
        self._update_visibility()

    def _build(self) -> tuple[tuple[QGridLayout, ...], ...]:
        """The groups of fields, in two columns."""
        t = TrainConfig()
        train = self._group("What to train")
        self._field(train, "mode", combo([("lora", "LoRA adapters"),
                                          ("full", "Full fine-tuning"),
                                          ("hybrid", "LoRA + full (hybrid)")]))
        self._field(train, "rank", spin(1, 4096, 8))
        self._field(train, "expert_rank", spin(0, 4096, 0, AUTO_EXPERT_RANK))
        self._field(train, "alpha", dspin(0, 100000, 16, 2, 1))
        self._field(train, "rslora", QCheckBox())
        self._field(train, "dropout", dspin(0, 0.95, t.lora_dropout, 2, 0.05))
        targets = QWidget()
        grid = QGridLayout(targets)
        grid.setContentsMargins(0, 0, 0, 0)
        grid.setVerticalSpacing(2)
        self.target_counts: dict[str, QLabel] = {}
        for i, group in enumerate(TARGET_GROUPS):
            box = QCheckBox(GROUP_LABELS.get(group, group))
            count = QLabel("", objectName="paramCount")
            count.setAlignment(Qt.AlignRight | Qt.AlignVCenter)
            grid.addWidget(box, i, 0)
            grid.addWidget(count, i, 1)
            self.target_boxes[group], self.target_counts[group] = box, count
        self._field(train, "targets", targets)
        self.trainable_label = QLabel(objectName="trainableTotal", wordWrap=True)
        self._row(train, "trainable", "Trainable", self.trainable_label)
        full = QWidget()
        row = QHBoxLayout(full)
        row.setContentsMargins(0, 0, 0, 0)
        for name in FULL_TARGETS:
            box = QCheckBox(name)
            row.addWidget(box)
            self.full_boxes[name] = box
        row.addStretch(1)
        self._field(train, "full_targets", full)

        opt = self._group("Optimiser")
        self._field(opt, "optimizer", combo([("adamw", "AdamW"), ("sgd", "SGD"),
                                             ("lbfgs", "L-BFGS")]))
        self._field(opt, "lr", QLineEdit())
        self._field(opt, "schedule", combo(["constant", "linear", "cosine"]))
        self._field(opt, "warmup", spin(0, 10**7, t.warmup_steps, "auto"))
        self._field(opt, "max_grad_norm", dspin(0, 1e6, t.max_grad_norm, 3, 0.1))
        self._field(opt, "gclip", dspin(0, 1e6, t.gclip, 3, 0.1))
        for key in ("max_grad_norm", "gclip"):
            self.fields[key].setSpecialValueText("off")
        self._field(opt, "weight_decay", dspin(0, 10, t.weight_decay, 4, 0.01))
        self._field(opt, "seed", spin(0, 2**31 - 1, t.seed))
        self._field(opt, "device", combo([("cpu", "CPU (NumPy)"),
                                          ("cuda", "CUDA GPU (CuPy)")]))
        self._field(opt, "precision", combo([
            ("auto", "auto"), ("fp32", "float32"), ("bf16", "bf16 (frozen weights)")]))

        length = self._group("Length and batches")
        self._field(length, "epochs", spin(0, 100000, 3, "0 (use steps)"))
        self._field(length, "max_steps", spin(0, 10**8, 0, "no cap"))
        self._field(length, "context", spin(8, 1 << 20, DataConfig.context))
        self.context_note = self._note(length)
        self._row(length, "batch", "Batch (windows)", spin(1, 4096, 1))
        self._field(length, "grad_accum", spin(1, 4096, 1))
        self._field(length, "checkpoint_interval", spin(0, 512, t.checkpoint_interval, "off"))
        self.fields["checkpoint_interval"].setSuffix(" layers")

        ev = self._group("Evaluation and saving")
        self._field(ev, "val_split", dspin(0, 0.9, 0.1, 2, 0.05))
        self._field(ev, "eval_every", spin(0, 10**7, 30, "end of epoch"))
        self._field(ev, "save_every", spin(0, 10**7, 0, "end of epoch"))
        self._field(ev, "patience", spin(0, 1000, 0, "off"))
        self._field(ev, "norms_every", spin(0, 10**6, 5, "off"))
        self.eval_task, self._eval_task_browse = self._path_field(
            ev, "eval_task", "none, or hellaswag:FILE, mc:FILE, FILE.jsonl\u2026")
        self._field(ev, "eval_task_limit", spin(1, 10**6, RunConfig.eval_task_limit))
        self.fields["eval_task_limit"].setSuffix(" items")
        self._field(ev, "best_by", combo([("loss", "validation loss"),
                                          ("task", "task accuracy")]))
        for key in ("eval_every", "save_every", "norms_every"):
            self.fields[key].setSuffix(" steps")

        data = self._group("Data")
        self._field(data, "format", combo(FORMATS))
        self._field(data, "overflow", combo(["truncate", "split", "drop"]))
        self._field(data, "packing", combo(["pack", "pad", "none"]))
        self._field(data, "chat_loss",
                    combo([("assistant", "every assistant turn"), ("last", "last turn only")]))
        self._field(data, "completion_as_chat", QCheckBox())
        self._field(data, "add_eos", QCheckBox())
        self._field(data, "parse_special", QCheckBox())
        self._field(data, "shuffle", QCheckBox())
        self._field(data, "val_path",
                    QLineEdit(placeholderText="none: the validation split"))
        template = QWidget()                        # data_config.chat_template: None, the model's
        trow = QHBoxLayout(template)
        trow.setContentsMargins(0, 0, 0, 0)
        self.chat_template: str | None = None
        self.chat_template_label = QLabel(MODEL_TEMPLATE, objectName="chatTemplate",
                                          textFormat=Qt.PlainText)
        self.chat_template_load = QPushButton("Load\u2026", toolTip="Use a Jinja chat template "
                                              "file instead of the model's")
        self.chat_template_clear = QPushButton("Model's", toolTip="Use the model's own chat "
                                               "template again")
        trow.addWidget(self.chat_template_label, 1)
        trow.addWidget(self.chat_template_load)
        trow.addWidget(self.chat_template_clear)
        self._field(data, "chat_template", template)

        pref = self._group("Preference")
        self._field(pref, "pairs_per_step", spin(1, 4096, PreferenceConfig.pairs_per_step))
        self._field(pref, "beta", dspin(0, 1000, 0, 3, 0.05))
        self._field(pref, "pref_loss", combo(["sigmoid", "hinge", "ipo"]))
        self._field(pref, "label_smoothing", dspin(0, 0.5, 0, 3, 0.05))
        self._field(pref, "sft_weight", dspin(0, 1000, 0, 3, 0.1))
        self._field(pref, "orpo_lambda", dspin(0, 1000, PreferenceConfig.orpo_lambda, 3, 0.05))
        self._field(pref, "simpo_gamma", dspin(0, 1000, PreferenceConfig.simpo_gamma, 3, 0.1))
        for key in ("kto_desirable_weight", "kto_undesirable_weight"):
            self._field(pref, key, dspin(0, 1000, 1, 3, 0.1))

        rw = self._group("Reward weights")
        self._row(rw, "weights_source", "Weights", combo(WEIGHT_SOURCES))   # the window's own
        self._field(rw, "weight_field", QLineEdit(placeholderText="weight or reward"))
        path = QWidget()
        prow = QHBoxLayout(path)
        prow.setContentsMargins(0, 0, 0, 0)
        self.weights_path = QLineEdit(placeholderText="weights .jsonl/.csv/.txt")
        self._weights_browse = QPushButton("Browse\u2026")
        prow.addWidget(self.weights_path, 1)
        prow.addWidget(self._weights_browse)
        self.fields["weights_path_edit"] = self.weights_path
        self._field(rw, "weights_path", path)
        self._field(rw, "normalize", combo(["none", "mean-std", "min-max", "clip"]))
        clip = QWidget()
        crow = QHBoxLayout(clip)
        crow.setContentsMargins(0, 0, 0, 0)
        self.clip_lo, self.clip_hi = dspin(-1e6, 1e6, 0, 3, 0.1), dspin(-1e6, 1e6, 1, 3, 0.1)
        crow.addWidget(self.clip_lo)
        crow.addWidget(QLabel("to"))
        crow.addWidget(self.clip_hi)
        self._field(rw, "clip", clip)
        self._field(rw, "allow_negative", QCheckBox())

        adv = self._group("Advanced")
        self._field(adv, "warmup_fraction", dspin(0, 1, t.warmup_fraction, 3, 0.01))
        self._field(adv, "min_lr", QLineEdit())
        self._field(adv, "beta1", dspin(0, 1, t.beta1, 4, 0.01))
        self._field(adv, "beta2", dspin(0, 1, t.beta2, 4, 0.001))
        self._field(adv, "eps", QLineEdit())
        self._field(adv, "weight_cache_mb",
                    spin(WEIGHT_CACHE_AUTO, 10**7, WEIGHT_CACHE_AUTO, "auto (40% of RAM)"))
        self.fields["weight_cache_mb"].setSuffix(" MB")
        self.adapter_path, self._adapter_browse = self._path_field(adv, "adapter",
                                                                   "none: new adapters")
        self._field(adv, "keep_last", spin(1, 10**4, 2))
        self._field(adv, "max_bad_steps", spin(1, 10**4, 5))
        self._field(adv, "vocab_chunk", spin(1, 1 << 24, t.vocab_chunk))
        self.fields["vocab_chunk"].setSuffix(" tokens")
        self._field(adv, "strict", QCheckBox())
        self._field(adv, "workers", spin(1, 1024, 1))

        self._data_box, self._rw_box = data.parentWidget(), rw.parentWidget()
        self._pref_box = pref.parentWidget()
        return (train, pref, ev, data), (opt, length, rw, adv)

    def _field(self, grid: QGridLayout, key: str, widget: QWidget) -> None:
        """A row for the field `key`, named as the one table names its setting
        (widgets.setting_labels by CONFIG_KEYS[key]): a check box's text, else its label."""
        name = setting_label(CONFIG_KEYS[key])
        if isinstance(widget, QCheckBox):
            widget.setText(name)
            name = ""
        self._row(grid, key, name, widget)

    def _path_field(self, grid: QGridLayout, key: str,
                    placeholder: str) -> tuple[QLineEdit, QPushButton]:
        """A row for the field `key`: a path typed, or picked with its Browse button; the
        line edit is also `fields[key + "_edit"]`."""
        box = QWidget()
        row = QHBoxLayout(box)
        row.setContentsMargins(0, 0, 0, 0)
        edit, browse = QLineEdit(placeholderText=placeholder), QPushButton("Browse\u2026")
        row.addWidget(edit, 1)
        row.addWidget(browse)
        self.fields[f"{key}_edit"] = edit
        self._field(grid, key, box)
        return edit, browse

    def _note(self, grid: QGridLayout) -> QLabel:
        """A hint under the last field of `grid`: what the engine makes of its value."""
        note = QLabel(objectName="hint", wordWrap=True)
        grid.addWidget(note, grid.rowCount(), 1)
        return note

    def _layout(self, columns: tuple[tuple[QGridLayout, ...], ...]) -> None:
        widgets = []
        for groups in columns:
            column = QWidget()
            col = QVBoxLayout(column)
            col.setContentsMargins(0, 0, 0, 0)
            col.setSpacing(12)
            for g in groups:
                col.addWidget(g.parentWidget())
            col.addStretch(1)
            widgets.append(column)
        # side by side, or one under the other in a narrow window (a large font)
        body = Columns(widgets, objectName="formBody", margins=(16, 12, 16, 12))
        scroll = QScrollArea(widgetResizable=True, frameShape=QFrame.NoFrame)
        scroll.setWidget(body)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scroll)

    def _connect(self) -> None:
        for key, boxes in (("targets", self.target_boxes), ("full_targets", self.full_boxes)):
            for box in boxes.values():
                box.toggled.connect(lambda _=False, k=key: self._changed(k))
        self._weights_browse.clicked.connect(self._browse_weights)
        self.chat_template_load.clicked.connect(self._load_chat_template)
        self.chat_template_clear.clicked.connect(lambda: self._set_chat_template(None))
        self._adapter_browse.clicked.connect(self._browse_adapter)
        self._eval_task_browse.clicked.connect(self._browse_eval_task)
        self._watch(self.eval_task, "eval_task")
        for w in (self.weights_path, self.clip_lo, self.clip_hi):
            self._watch(w, "weights_path" if w is self.weights_path else "clip")
        self._watch(self.adapter_path, "adapter")

    # ---------------------------------------------------------------- model-dependent parts
    def set_card(self, card: ModelCard | None) -> None:
        """The model the run trains: targets it lacks are disabled, counts are shown."""
        self.card = card
        self._fit_context()
        self._update_visibility()
        self._update_counts()
        self.validate()

    def group_counts(self) -> dict[str, int]:
        if self.card is None:
            return {}
        return group_param_counts(self.card, self.fields["rank"].value(), self.expert_rank())

    def expert_rank(self) -> int | None:
        return self.fields["expert_rank"].value() or None

    def has_experts(self) -> bool:
        return self.card is not None and any(len(shape) == 3
                                             for shape in self.card.tensor_shapes.values())

    def trainable_params(self) -> int | None:
        """Trainable parameters of the chosen LoRA targets (None without a model or in full
        mode, where every unquantized tensor trains)."""
        if self.card is None or self.mode() == "full":
            return None
        counts = self.group_counts()
        return sum(counts.get(g, 0) for g in self.targets())

    def _update_counts(self) -> None:
        counts = self.group_counts()
        for group, label in self.target_counts.items():
            box = self.target_boxes[group]
            n = counts.get(group)
            if n is None:
                label.setText("")
                box.setEnabled(True)
            elif n == 0:
                label.setText("not in model")
                box.setEnabled(False)
            else:
                label.setText(f"{human_count(n)} params \u00b7 {human_bytes(n * BYTES_PER_TRAINED)}")
                box.setEnabled(True)
        total = self.trainable_params()
        if self.mode() == "full":
            self.trainable_label.setText("every F32/F16/BF16 tensor (quantized ones stay frozen)")
        elif total is None:
            self.trainable_label.setText("pick a model to see parameter counts")
        else:
            share = ""
            n = self.card.n_params if self.card is not None else 0
            if n:
                share = f" ({100 * total / n:.2f}% of {human_count(n)})"
            self.trainable_label.setText(f"{total:,} LoRA parameters{share}")

    # ---------------------------------------------------------------- values
    def mode(self) -> str:
        return self.fields["mode"].currentData()

    def targets(self) -> list[str]:
        return [g for g, b in self.target_boxes.items() if b.isChecked() and b.isEnabled()]

    def full_targets(self) -> list[str]:
        return [g for g, b in self.full_boxes.items() if b.isChecked()]

    def lr(self) -> float | None:
        return self._float("lr")

    def _float(self, key: str) -> float | None:
        """The number typed in the text field `key` (None: not a finite number)."""
        try:
            value = float(self.fields[key].text().strip())
        except ValueError:
            return None
        return value if math.isfinite(value) else None

    def total_steps(self) -> tuple[int | None, bool]:
        """(the run's optimizer steps, whether that is an estimate): a GRPO run's or a
        supervised run's cap without epochs are exact; epochs over the dataset's estimated
        `train_windows` are an estimate; (None, True) while unknown."""
        f = self.fields
        cap = f["max_steps"].value()
        if self.kind == GRPO.name or (cap and not f["epochs"].value()):
            return (cap or None), False
        if not self.train_windows:
            return None, True
        per_step = (f["pairs_per_step"].value() if self.kind in PREFERENCE_KINDS
                    else f["batch"].value() * f["grad_accum"].value())
        per_epoch = math.ceil(self.train_windows / per_step)
        total = per_epoch * f["epochs"].value()
        return (min(total, cap) if cap else total), True

    def set_lint_report(self, report: LintReport | None) -> None:
        """The dataset's linter report: its windows estimate the run's steps (warmup's note).
        Packed rows share windows of `context` positions; otherwise one row is one window."""
        if report is None or not report.training_rows:
            self.train_windows = None
        else:
            split = 1 - self.fields["val_split"].value()
            windows = (math.ceil(report.positions / max(report.context, 1))
                       if self.fields["packing"].currentData() == "pack"
                       else report.training_rows + report.split)   # dropped rows: no window
            self.train_windows = max(1, round(windows * split))
        self._update_warmup()

    def set_training_rows(self, rows: int | None) -> None:
        """A preference file's usable rows (its linter's pairs; KTO's rows): the steps' estimate."""
        split = 1 - self.fields["val_split"].value()
        self.train_windows = max(1, round(rows * split)) if rows else None
        self._update_warmup()

    def _update_warmup(self) -> None:
        """Warmup 0 reads what the engine does: a fraction of the steps, in steps when known."""
        fraction = self.fields["warmup_fraction"].value()
        total, approx = self.total_steps()
        text = f"auto: {fraction:.0%}"
        if total:
            sign = "\u2248" if approx else "="
            text += f" {sign} {min(round(fraction * total), total)} steps"
        else:
            text += " of the steps"
        self.fields["warmup"].setSpecialValueText(text)

    def _fit_context(self) -> None:
        """The context follows the model: its default (`default_context`) until the user edits
        it; an edited one longer than the model's context is capped at it, with a note."""
        box, note = self.fields["context"], ""
        if self.card is not None:
            limit = self.card.config.context_length
            value = box.value()
            if self._context_auto:
                value = default_context(self.card)
                note = f"this model's default (at most {DataConfig.context:,})"
            elif value > limit:
                value = limit
                note = f"capped at this model's context ({limit:,} tokens)"
            if value != box.value():
                self._loading, loading = True, self._loading
                box.setValue(value)
                self._loading = loading
                self.changed.emit("context")
        self.context_note.setText(note)
        self._update_visibility()

    def values(self) -> dict:
        """The RunConfig dict without model and data; of a GRPO run, its GrpoConfig keys; of a
        preference run, its PreferenceConfig keys."""
        v = self._run_values()
        if self.kind in PREFERENCE_KINDS:
            return self._preference_values(v)
        if self.kind != GRPO.name:
            return v
        skip = ("mode", "full_targets", "grad_accum")
        return {"kind": GRPO.name,
                "train": {k: x for k, x in v["train"].items() if k not in skip},
                "val_split": v["data_config"]["val_fraction"],
                **{k: v[k] for k in ("max_steps", "eval_every", "save_every", "norms_every",
                                     "keep_last", "max_bad_steps", "adapter")}}

    def _preference_values(self, v: dict) -> dict:
        """A PreferenceConfig dict (without model and data) from the form's run values `v`:
        its data settings at the top level; every preference field, the method's or not, so
        the dict is the same one the CLI writes (the others keep their defaults)."""
        f, dc = self.fields, v["data_config"]
        pref = {key: field_value(f[key]) for key in PREF_FIELDS}
        pref["beta"] = pref["beta"] or None                 # 0: the method's default
        return {"kind": self.kind,
                "train": {k: x for k, x in v["train"].items() if k != "grad_accum"},
                "context": dc["context"], "val_split": dc["val_fraction"],
                "val_data": dc["val_path"], "completion_as_chat": dc["completion_as_chat"],
                "chat_template": dc["chat_template"], **{k: v[k] for k in PREF_LENGTHS}, **pref}

    def _run_values(self) -> dict:
        f = self.fields
        source = f["weights_source"].currentData()
        clip = [self.clip_lo.value(), self.clip_hi.value()] \
            if f["normalize"].currentData() == "clip" else None
        cache = f["weight_cache_mb"].value()
        train = {
            "mode": self.mode(), "lora_rank": f["rank"].value(),
            "expert_rank": self.expert_rank(), "lora_alpha": f["alpha"].value(),
            "rslora": f["rslora"].isChecked(), "lora_dropout": f["dropout"].value(),
            "lora_targets": self.targets(),
            "full_targets": self.full_targets() if self.mode() == "hybrid" else [],
            "optimizer": f["optimizer"].currentData(), "lr": self.lr() or 0.0,
            "schedule": f["schedule"].currentData(), "warmup_steps": f["warmup"].value(),
            "warmup_fraction": f["warmup_fraction"].value(), "min_lr": self._float("min_lr"),
            "gclip": f["gclip"].value(), "max_grad_norm": f["max_grad_norm"].value(),
            "weight_decay": f["weight_decay"].value(), "beta1": f["beta1"].value(),
            "beta2": f["beta2"].value(), "eps": self._float("eps"),
            "weight_cache_mb": cache if cache != WEIGHT_CACHE_AUTO else None,
            "grad_accum": f["batch"].value() * f["grad_accum"].value(),
            "checkpoint_interval": f["checkpoint_interval"].value(), "seed": f["seed"].value(),
            "vocab_chunk": f["vocab_chunk"].value(),
            "device": f["device"].currentData(), "precision": f["precision"].currentData()}
        data = {
            "format": f["format"].currentData(), "context": f["context"].value(),
            "overflow": f["overflow"].currentData(), "packing": f["packing"].currentData(),
            "chat_loss": f["chat_loss"].currentData(), "val_fraction": f["val_split"].value(),
            "seed": f["seed"].value(),
            "weight_field": (f["weight_field"].text().strip() or None)
            if source == "row" else None,
            "weights_path": (self.weights_path.text().strip() or None)
            if source == "file" else None,
            "normalize": f["normalize"].currentData(), "clip_range": clip,
            "allow_negative_weights": f["allow_negative"].isChecked(),
            "val_path": field_value(f["val_path"]) or None,
            "chat_template": self.chat_template,
            **{k: f[k].isChecked() for k in ("strict", "shuffle", "add_eos", "parse_special",
                                             "completion_as_chat")}}
        return {"train": train, "data_config": data, "epochs": f["epochs"].value(),
                "max_steps": f["max_steps"].value(), "eval_every": f["eval_every"].value(),
                "save_every": f["save_every"].value(), "patience": f["patience"].value(),
                "norms_every": f["norms_every"].value(), "keep_last": f["keep_last"].value(),
                "max_bad_steps": f["max_bad_steps"].value(),
                "adapter": self.adapter_path.text().strip() or None,
                "workers": f["workers"].value(), "eval_task": self.eval_task_spec(),
                "eval_task_limit": f["eval_task_limit"].value(),
                "best_by": f["best_by"].currentData()}

    def set_values(self, d: dict) -> None:
        """Load a RunConfig or GrpoConfig dict of the form's run type (see `set_kind`); what it
        lacks is the run type's `default_settings`. A dict without a context lets the context
        follow the model."""
        base = default_settings(self.kind, self.card)
        t = {**base["train"], **(d.get("train") or {})}
        top = {**base, **d}
        preference = self.kind in PREFERENCE_KINDS
        if self.kind == GRPO.name or preference:    # the supervised-only settings stay hidden
            sft = default_settings(SFT.name, self.card)
            top = {**sft, **top}
            dc = {**sft["data_config"], "val_fraction": top["val_split"]}
            if preference:                  # its data settings are top-level keys
                dc.update(context=top["context"], val_path=top["val_data"],
                          completion_as_chat=top["completion_as_chat"],
                          chat_template=top["chat_template"])
        else:
            dc = {**base["data_config"], **(d.get("data_config") or {})}
        self._context_auto = "context" not in (d if preference else d.get("data_config") or {})
        if "lr" not in (d.get("train") or {}) and self.kind != GRPO.name:
            t["lr"] = default_lr(t["mode"], float(t["lora_alpha"]))
        f = self.fields
        self._loading = True
        try:
            for key, (section, name) in SIMPLE_FIELDS.items():
                set_field(f[key], {"train": t, "data_config": dc, "": top}[section][name])
            f["expert_rank"].setValue(t["expert_rank"] or 0)
            for g, box in self.target_boxes.items():
                box.setChecked(g in t["lora_targets"])
            for g, box in self.full_boxes.items():
                box.setChecked(g in t["full_targets"])
            for key in FLOAT_TEXTS:
                f[key].setText(f"{float(t[key]):g}")
            cache = t["weight_cache_mb"]
            f["weight_cache_mb"].setValue(WEIGHT_CACHE_AUTO if cache is None else cache)
            self.adapter_path.setText(top["adapter"] or "")
            self.eval_task.setText(top["eval_task"] or "")
            f["val_path"].setText(dc["val_path"] or "")
            f["batch"].setValue(1)
            set_combo(f["weights_source"], "file" if dc.get("weights_path") else "row")
            f["weight_field"].setText(dc.get("weight_field") or "")
            self.weights_path.setText(dc.get("weights_path") or "")
            clip = dc.get("clip_range") or (0.0, 1.0)
            self.clip_lo.setValue(float(clip[0]))
            self.clip_hi.setValue(float(clip[1]))
            self._set_chat_template(dc.get("chat_template"), "from the settings")
            if preference:
                for key in PREF_FIELDS:
                    set_field(f[key], top[key] if top[key] is not None else 0)
        finally:
            self._loading = False
        self._fit_context()
        self._update_warmup()
        self._update_visibility()
        self._update_counts()
        self.validate()
        self.changed.emit("all")

    def reset(self) -> None:
        """The run type's default settings (`default_settings`), the context the model's."""
        self.set_values({})

    def preset_values(self, keys) -> dict:
        """The fields `keys` as a preset stores them ("targets": the ticked groups)."""
        return {k: [g for g, b in self.target_boxes.items() if b.isChecked()] if k == "targets"
                else self.fields[k].text().strip() if k == "lr" else field_value(self.fields[k])
                for k in keys}

    def apply_preset(self, values: dict) -> None:
        """Set the fields of a preset ({field key: value}, "targets": groups); the others stay."""
        self._loading = True
        try:
            for key, value in values.items():
                if key == "targets":
                    for g, box in self.target_boxes.items():
                        box.setChecked(g in value)
                else:
                    set_field(self.fields[key], value)
        finally:
            self._loading = False
        self._update_visibility()
        self._update_counts()
        self.validate()
        self.changed.emit("all")

    def set_kind(self, kind: str) -> None:
        """Show the settings of a supervised ("sft"), a GRPO ("grpo") or a preference run
        ("dpo", "orpo", "simpo", "kto"). Each run type has
        its own settings: those of the type left are kept (its context only when edited) and
        the other's shown, its defaults the first time; the type shown already stays as it is."""
        if kind == self.kind:
            return
        kept = self.values()
        if self._context_auto:
            (kept.get("data_config") or kept).pop("context", None)
        self._per_kind[self.kind] = kept
        self.kind = kind
        grpo = kind == GRPO.name
        self._data_box.setVisible(not grpo)
        self._rw_box.setVisible(kind == SFT.name)
        self._pref_box.setVisible(kind in PREFERENCE_KINDS)
        if kind in PREFERENCE_KINDS:
            self.fields["beta"].setSpecialValueText(
                f"default ({DEFAULT_BETA[kind]:g})")
        self.set_tooltips({"adapter": PREFERENCE_ADAPTER_TIP if kind in PREFERENCE_KINDS
                           else SETTINGS_TIPS["adapter"]})
        for key, texts in KIND_TEXTS.items():
            label, special = texts[kind_index(kind)]
            self.label(key).setText(label)
            if special:
                self.fields[key].setSpecialValueText(special)
        self.set_values(self._per_kind.pop(kind, {}))

    # ---------------------------------------------------------------- validation
    def validate(self) -> dict[str, str]:
        """Check every field, show the problems under their fields and return them."""
        f = self.fields
        errors: dict[str, str] = {}
        lr = self.lr()
        if lr is None:
            errors["lr"] = "Enter a number, e.g. 1e-4 or 0.0005."
        elif lr <= 0:
            errors["lr"] = "The learning rate must be greater than 0."
        elif lr > 1:
            errors["lr"] = "A learning rate above 1 diverges; LoRA usually uses 1e-4 to 1e-2."
        if self.mode() in ("lora", "hybrid") and not self.targets():
            errors["targets"] = "Pick at least one target for the adapters."
        if self.mode() == "hybrid" and not self.full_targets():
            errors["full_targets"] = "A hybrid run trains some tensors fully: pick at least one."
        if self.mode() in ("lora", "hybrid") and f["alpha"].value() <= 0:
            errors["alpha"] = "Alpha must be greater than 0 (scale = alpha / rank)."
        if not f["epochs"].value() and not f["max_steps"].value():
            errors["epochs"] = "Set a number of epochs, or of steps with epochs 0."
        if f["device"].currentData() == "cuda" and not gpu_available():
            errors["device"] = ("This machine has no usable CUDA GPU (CuPy with a device): "
                                "compute on the CPU, or queue the run on a GPU machine.")
        if self.kind == GRPO.name and not f["max_steps"].value():
            errors["max_steps"] = "A GRPO run counts steps: set how many."
        if self.kind != SFT.name and f["optimizer"].currentData() == "lbfgs":
            errors["optimizer"] = (f"{'GRPO' if self.kind == GRPO.name else 'Preference'} runs "
                                   "use AdamW or SGD: L-BFGS needs the same batch at every "
                                   "step.")
        if self.kind in PREFERENCE_KINDS and f["dropout"].value():
            errors["dropout"] = ("Preference runs take no LoRA dropout (the loss's weights are "
                                 "computed without it): set it to 0.")
        if self.kind in PREFERENCE_KINDS and f["val_split"].value() and field_value(
                f["val_path"]):
            errors["val_path"] = "Choose a validation file or a validation split, not both."
        if self.card is not None and f["context"].value() > self.card.config.context_length:
            errors["context"] = (f"The model was trained with a context of "
                                 f"{self.card.config.context_length:,} tokens; use at most that.")
        total = f["max_steps"].value()
        if total and f["warmup"].value() >= total:
            errors["warmup"] = "Warmup must be shorter than the run's steps."
        for key, what in (("min_lr", "0 or e.g. 1e-5"), ("eps", "e.g. 1e-8")):
            value = self._float(key)
            if value is None or value < 0 or (key == "eps" and value == 0):
                errors[key] = f"Enter a number, {what}."
        for key, path in (("adapter", self.adapter_path.text().strip()),
                          ("val_path", field_value(f["val_path"]))):
            if path and not os.path.isfile(os.path.expanduser(path)):
                errors[key] = f"There is no file {path}."
        source = f["weights_source"].currentData()
        if source == "file":
            path = self.weights_path.text().strip()
            if not path:
                errors["weights_path"] = "Choose the weights file, or take weights from the rows."
            elif not os.path.isfile(os.path.expanduser(path)):
                errors["weights_path"] = f"There is no file {path}."
        if f["normalize"].currentData() == "clip" and self.clip_lo.value() >= self.clip_hi.value():
            errors["clip"] = "The lower bound must be below the upper bound."
        if self.kind == SFT.name and f["workers"].value() > 1 and not self.on_cluster:
            errors["workers"] = ("Training data-parallel needs a Ray cluster: choose one under "
                                 "Run on, or use 1 worker.")
        if self._template_error:
            errors["chat_template"] = self._template_error
        if self.kind == SFT.name:
            errors.update(self._eval_task_errors())
        return self._show_errors(errors)

    def _eval_task_errors(self) -> dict[str, str]:
        """The refusals `train --eval-task/--best-by` makes (RunConfig.validate, the CLI's
        parse_task, the run's start in app.engine.training.sft), under their fields."""
        f, text = self.fields, self.eval_task.text().strip()
        if not text:
            return ({"best_by": "Best by task accuracy needs an evaluation task: choose one "
                                "above, or keep the validation loss."}
                    if f["best_by"].currentData() == "task" else {})
        try:
            spec = parse_task(text)
        except EngineError as e:
            return {"eval_task": e.message}
        if spec.kind not in EVAL_TASK_KINDS:
            return {"eval_task": f"Training scores a multiple-choice task, not {spec.kind}: "
                                 "use hellaswag:FILE, winogrande:FILE, mc:FILE or FILE.jsonl."}
        if not os.path.isfile(os.path.expanduser(spec.path)):
            return {"eval_task": f"There is no file {spec.path}."}
        if f["workers"].value() > 1:
            return {"eval_task": "An evaluation task is scored by one process: a data-parallel "
                                 "run (workers > 1) cannot take one. Use 1 worker, or no task."}
        if not f["val_split"].value() and not field_value(f["val_path"]):
            return {"eval_task": "The task is scored at every evaluation, and this run has "
                                 "none: give it a validation split or a validation file."}
        return {}

    def eval_task_spec(self) -> str:
        """The evaluation task as the CLI writes it (`KIND:ABSOLUTE PATH`), "" for none; a
        spec the engine refuses stays as typed (validation shows why)."""
        text = self.eval_task.text().strip()
        try:
            spec = parse_task(text) if text else None
        except EngineError:
            return text
        return f"{spec.kind}:{Path(spec.path).expanduser().resolve()}" if spec else ""

    # ---------------------------------------------------------------- reactions
    def _changed(self, key: str) -> None:
        if self._loading:
            return
        if key == "context":
            self._context_auto = False
            self.context_note.setText("")
            self.context_note.hide()
        if key in ("mode", "weights_source", "normalize"):
            self._update_visibility()
        if key in ("epochs", "max_steps", "batch", "grad_accum", "warmup_fraction",
                   "pairs_per_step"):
            self._update_warmup()
        if key in ("rank", "expert_rank", "mode", "targets"):
            self._update_counts()
        super()._changed(key)

    def _update_visibility(self) -> None:
        mode = self.mode()
        lora = mode in ("lora", "hybrid")
        preference = self.kind in PREFERENCE_KINDS
        for key in ("rank", "alpha", "rslora", "dropout", "targets", "trainable"):
            self._show(key, lora or key == "trainable")
        self._show("expert_rank", lora and self.has_experts())
        self._show("full_targets", mode == "hybrid")
        for key in SFT_ONLY:
            self._show(key, self.kind != GRPO.name)
        for key in NOT_PREFERENCE:
            if preference:
                self._show(key, False)
        for key, methods in PREF_FIELDS.items():
            self._show(key, self.kind in methods)
        self.context_note.setVisible(self.kind != GRPO.name and bool(self.context_note.text()))
        source = self.fields["weights_source"].currentData()
        self._show("weight_field", source == "row")
        self._show("weights_path", source == "file")
        self._show("clip", self.fields["normalize"].currentData() == "clip")

    def set_on_cluster(self, on_cluster: bool) -> None:
        """Whether the run goes to a cluster (New run's Run on): data-parallel workers need one."""
        self.on_cluster = on_cluster
        self.validate()

    def _load_chat_template(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Chat template", "",
                                              "Jinja templates (*.jinja *.j2 *.txt);;"
                                              "All files (*)")
        if not path:
            return
        try:
            text = read_chat_template(path)
        except EngineError as e:                 # shown under the field, the template kept
            self._template_error = e.message
            self.validate()
            return
        self._set_chat_template(text, os.path.basename(path))

    def _set_chat_template(self, text: str | None, origin: str = "") -> None:
        """Train with the chat template `text` (None: the model's); `origin` says where from."""
        self.chat_template, self._template_error = text, None
        self.chat_template_label.setText(
            MODEL_TEMPLATE if text is None else f"{origin} ({len(text):,} characters)")
        self.chat_template_label.setToolTip("" if text is None else text[:2000])
        if not self._loading:
            self.validate()
            self._changed("chat_template")

    def _browse_adapter(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Starting adapter", self.adapter_path.text(),
                                              "GGUF LoRA adapter (*.gguf);;All files (*)")
        if path:
            self.adapter_path.setText(path)

    def _browse_eval_task(self) -> None:
        """Pick the task's file; the dialog's filter (else the file's suffix) is its kind."""
        path, chosen = QFileDialog.getOpenFileName(self, "Evaluation task", "",
                                                   ";;".join([*TASK_FILTERS, "All files (*)"]))
        if path:
            kind = TASK_FILTERS.get(chosen) or TASK_SUFFIXES.get(Path(path).suffix.lower(), "mc")
            self.eval_task.setText(path if kind == "jsonl" and path.endswith(".jsonl")
                                   else f"{kind}:{path}")

    def _browse_weights(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Reward weights", self.weights_path.text(),
                                              "Weights (*.jsonl *.json *.csv *.tsv *.txt);;"
                                              "All files (*)")
        if path:
            self.weights_path.setText(path)

