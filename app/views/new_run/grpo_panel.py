"""The prompts-and-rewards half of a new GRPO run: the prompt file, the reward functions, and
how completions are sampled and compared.

A prompt file is JSONL, one prompt a line: {"messages": [...]} (a chat, rendered with the
model's chat template) or {"prompt": "..."}, plus the reference answer that the exact and
numeric rewards compare with ("answer" unless the answer field says otherwise). The first rows
are shown with the number of rows; rows the run cannot use are skipped when it starts (its log
says how many).

`values()` is the part of a GrpoConfig dict this tab owns (prompts, rewards and the sampling
settings); `set_values(d)` loads one; `problems()` lists what stops the run from starting and
`summary()` sums the tab up. "Use the addition demo" asks for the bundled task
(`preset_requested(addition_demo())`).
"""

from __future__ import annotations

import os

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QFileDialog, QFrame, QHBoxLayout, QLabel, QLineEdit,
                               QPushButton, QScrollArea, QSplitter, QVBoxLayout, QWidget)

from app.engine.api import GrpoConfig, RewardSpec, TrainConfig
from app.views.context import Background, sample_dataset_path, sample_model_path
from app.views.new_run.dataset_panel import fill_preview, make_table, read_preview, titled
from app.views.new_run.reward_editor import RewardEditor
from app.views.widgets.form_fields import FormBase, combo, dspin, field_value, set_field, spin
from app.views.widgets.setting_labels import setting_label
from app.views.widgets.tooltips import GRPO_TIPS

ADVANTAGES = (("group-std", "group mean and std (GRPO)"), ("no-std", "group mean only (Dr. GRPO)"),
              ("batch-std", "group mean, batch std"))
SAMPLING_KEYS = ("group_size", "prompts_per_step", "temperature", "top_p", "max_new_tokens",
                 "advantage", "kl", "answer_field", "samples_every", "samples_prompts",
                 "eval_samples", "reward_timeout", "micro_batch_tokens", "parse_special")


def addition_demo() -> dict | None:
    """The bundled GRPO task: two-digit addition (sample_data/addition.jsonl) on the sample
    model with the exact reward, as in the user guide; None when the files are missing."""
    model, prompts = sample_model_path(), sample_dataset_path("addition.jsonl")
    if not model or not prompts:
        return None
    return GrpoConfig(model=model, prompts=prompts, rewards=(RewardSpec("exact"),),
                      train=TrainConfig(lora_rank=8, lora_alpha=16, lr=5e-4,
                                        lora_targets=("attention", "experts", "router")),
                      group_size=8, prompts_per_step=8, max_new_tokens=6, max_steps=40,
                      val_split=0.25, eval_every=20, samples_every=5).to_dict()


def scan_prompts(path: str) -> tuple[tuple[list, list], int]:
    """(`read_preview` of the file, its number of non-blank lines); runs off the GUI thread."""
    with open(os.path.expanduser(path), "rb") as f:
        rows = sum(1 for line in f if line.strip())
    return read_preview(path), rows


class SamplingForm(FormBase):
    """Group size, prompts per step, temperature, top-p, max new tokens, advantage, KL, the
    answer field and how often completions are recorded; `needs_answer` is set by the panel
    when a reward compares with the answer."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.needs_answer = True
        g = GrpoConfig(model="", prompts="")
        grid = self._group("Sampling and advantages")
        for key, widget in (            # named by the one table (widgets.setting_labels)
                ("group_size", spin(2, 1024, g.group_size)),
                ("prompts_per_step", spin(1, 4096, g.prompts_per_step)),
                ("temperature", dspin(0, 5, g.temperature, 2, 0.1)),
                ("top_p", dspin(0.01, 1, g.top_p, 2, 0.05)),
                ("max_new_tokens", spin(1, 1 << 16, g.max_new_tokens)),
                ("advantage", combo(ADVANTAGES)),
                ("kl", dspin(0, 10, g.kl, 3, 0.01)),
                ("answer_field", QLineEdit(g.answer_field)),
                ("samples_every", spin(0, 10**6, g.samples_every, "never")),
                ("samples_prompts", spin(0, 1024, g.samples_prompts)),
                ("eval_samples", spin(0, 1024, g.eval_samples, "greedy only")),
                ("reward_timeout", dspin(0.1, 3600, g.reward_timeout, 1, 1)),
                ("micro_batch_tokens", spin(1, 1 << 24, g.micro_batch_tokens)),
                ("parse_special", QCheckBox(setting_label("parse_special")))):
            self._row(grid, key, "" if isinstance(widget, QCheckBox) else setting_label(key),
                      widget)
        self.set_tooltips({k: v for k, v in GRPO_TIPS.items() if k in self.fields})
        self.fields["samples_every"].setSuffix(" steps")
        self.fields["reward_timeout"].setSuffix(" s")
        self.fields["micro_batch_tokens"].setSuffix(" tokens")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(grid.parentWidget())

    def values(self) -> dict:
        return {key: field_value(self.fields[key]) for key in SAMPLING_KEYS}

    def set_values(self, d: dict) -> None:
        default = GrpoConfig(model="", prompts="").to_dict()
        self._loading = True
        try:
            for key in SAMPLING_KEYS:
                set_field(self.fields[key], d.get(key, default[key]))
        finally:
            self._loading = False
        self.validate()

    def validate(self) -> dict[str, str]:
        errors = {}
        if self.fields["temperature"].value() == 0:
            errors["temperature"] = ("At temperature 0 the completions of a prompt are all the "
                                     "same: no group has spread, nothing is learned. Try 1.0.")
        if self.needs_answer and not field_value(self.fields["answer_field"]):
            errors["answer_field"] = "Name the rows' field with the reference answer (answer)."
        return self._show_errors(errors)


class GrpoPanel(QWidget):
    """The Prompts and rewards tab; see the module docstring. `changed()` after any edit,
    `prompts_changed(path)` when another prompt file was picked."""

    changed = Signal()
    prompts_changed = Signal(str)
    preset_requested = Signal(dict)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.rows: int | None = None                 # non-blank lines of the prompt file
        self._bg = Background(self)
        self.path_field = QLineEdit(placeholderText="Path to a .jsonl file of prompts",
                                    clearButtonEnabled=True, toolTip=GRPO_TIPS["prompts"])
        self.path_field.editingFinished.connect(
            lambda: self.set_prompts_path(self.prompts_path()))
        browse = QPushButton("Choose prompts\u2026", clicked=self.choose)
        self.demo_button = QPushButton("Use the addition demo")
        self.demo_button.setToolTip("Two-digit addition on the sample model with the exact "
                                    "reward: a 40-step run that shows the reward grow")
        self.demo_button.clicked.connect(self._request_demo)
        self.demo_button.setEnabled(addition_demo() is not None)
        self.summary_label = QLabel(objectName="lintSummary", wordWrap=True,
                                    textFormat=Qt.PlainText)
        self.preview_table = make_table()
        self.rewards = RewardEditor()
        self.rewards.changed.connect(self._on_rewards)
        self.sampling = SamplingForm()
        self.sampling.changed.connect(lambda _key: self._on_edit())

        top = QHBoxLayout()
        top.addWidget(QLabel("Prompts", objectName="formLabel"))
        top.addWidget(self.path_field, 1)
        top.addWidget(browse)
        top.addWidget(self.demo_button)
        right = QWidget(objectName="formBody")
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 8, 0)
        rl.addWidget(titled("Reward functions (total = sum of weight \u00d7 reward)",
                            self.rewards))
        rl.addWidget(self.sampling)
        rl.addStretch(1)
        self._scroll = QScrollArea(widgetResizable=True, frameShape=QFrame.NoFrame)
        self._scroll.setWidget(right)
        body = QSplitter(Qt.Horizontal)
        body.addWidget(titled("First rows", self.preview_table))
        body.addWidget(self._scroll)
        body.setSizes([560, 500])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 12, 16, 12)
        layout.addLayout(top)
        layout.addWidget(self.summary_label)
        layout.addWidget(body, 1)
        self.set_values({})

    # ---------------------------------------------------------------- the prompt file
    def prompts_path(self) -> str:
        return self.path_field.text().strip()

    def set_prompts_path(self, path: str) -> None:
        path = os.path.abspath(os.path.expanduser(path)) if path else ""
        if self.path_field.text() != path:
            self.path_field.setText(path)
        self.rows = None
        fill_preview(self.preview_table, ([], []))
        if os.path.isfile(path):
            self._bg.run("scan", scan_prompts, path, on_done=self._on_scan,
                         on_error=lambda e: self._on_scan((([], []), None)))
        self.prompts_changed.emit(path)
        self._on_edit()

    def choose(self) -> None:
        start = os.path.dirname(self.prompts_path()) or os.path.expanduser("~")
        path, _ = QFileDialog.getOpenFileName(self, "Choose prompts", start,
                                              "JSON Lines (*.jsonl *.json);;All files (*)")
        if path:
            self.set_prompts_path(path)

    def _on_scan(self, result) -> None:
        preview, self.rows = result
        fill_preview(self.preview_table, preview)
        self._on_edit()

    def _request_demo(self) -> None:
        self.preset_requested.emit(addition_demo())

    # ---------------------------------------------------------------- values
    def values(self) -> dict:
        """prompts, rewards and the sampling settings, as GrpoConfig's keys."""
        return {"prompts": self.prompts_path(), "rewards": self.rewards.specs(),
                **self.sampling.values()}

    def set_values(self, d: dict) -> None:
        self.rewards.set_specs(d.get("rewards") or [{"kind": "exact"}])
        self.sampling.set_values(d)
        if d.get("prompts"):
            self.set_prompts_path(d["prompts"])

    def _on_rewards(self) -> None:
        self.sampling.needs_answer = any(r.kind() in ("exact", "numeric")
                                         for r in self.rewards.rows)
        self.sampling.validate()
        self._fit_scroll()
        self._on_edit()

    def _fit_scroll(self) -> None:
        """The rewards and sampling pane is never narrower than its widest row plus a vertical
        scroll bar: a long row (a Python file's Browse button) never puts its weight and remove
        button under the bar."""
        bar = self._scroll.verticalScrollBar().sizeHint().width()
        self._scroll.setMinimumWidth(self._scroll.widget().minimumSizeHint().width() + bar)

    def _on_edit(self) -> None:
        self._update_summary()
        self.changed.emit()

    def problems(self) -> list[str]:
        """What stops the run from starting, in plain words."""
        path = self.prompts_path()
        out = []
        if not path:
            out.append("Pick a prompt file (Prompts tab).")
        elif not os.path.isfile(path):
            out.append(f"There is no file {path}.")
        elif self.rows == 0:
            out.append(f"{os.path.basename(path)} holds no prompts.")
        out += self.rewards.validate()
        out += [f"{self.sampling.label(k).text().lower()}: {m}"
                for k, m in self.sampling.validate().items()]
        return out

    def summary(self) -> str:
        """The tab in a line: prompt file (rows), prompts x completions per step, rewards."""
        v = self.values()
        name = os.path.basename(v["prompts"]) or "no prompts"
        rows = f" ({self.rows:,} rows)" if self.rows is not None else ""
        rewards = ", ".join(f"{RewardSpec.from_dict(r).label} \u00d7{r['weight']:g}"
                            for r in v["rewards"]) or "no reward"
        return (f"{name}{rows} \u00b7 {v['prompts_per_step']} prompts \u00d7 "
                f"{v['group_size']} completions \u00b7 {rewards}")

    def _update_summary(self) -> None:
        rows = "" if self.rows is None else f"{self.rows:,} prompt rows \u00b7 "
        self.summary_label.setText(
            f"{rows}each row: {{\"messages\": [...]}} or {{\"prompt\": \"...\"}} with the "
            f"reference answer in \"{field_value(self.sampling['answer_field']) or 'answer'}\"; "
            "rows the run cannot use are skipped (the run's log says how many)")
