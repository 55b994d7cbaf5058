"""Presets on New run's Training tab: a box of named settings, a line that says what the chosen
one set, and "Save as preset…" for the user's own (kept in QSettings).

A preset is {SettingsForm field key: value} ("targets": the groups to tick); choosing one sets
those fields and leaves the others. "Experts only" and "Attention only" are offered for
Mixture-of-Experts models.
"""

from __future__ import annotations

import json

from PySide6.QtCore import QSettings, Qt
from PySide6.QtWidgets import (QComboBox, QHBoxLayout, QInputDialog, QLabel, QPushButton,
                               QVBoxLayout, QWidget)

from app.engine.api import TrainConfig, default_lr
from app.views.new_run.settings_form import SettingsForm
from app.views.widgets.tooltips import NEW_RUN_TIPS

# Every preset trains as the engine's defaults do (docs/USER_GUIDE.md, "Why these defaults"):
# its schedule, warmup over a fraction of the steps, global-norm clipping, and the learning rate
# default_lr gives for the preset's alpha. Presets differ in size, length and targets. A preset
# sets the fields of the run type shown (supervised: the bar is hidden for GRPO), so it lands in
# that run type's settings only.
_T = TrainConfig()
SAFE = {"schedule": _T.schedule, "warmup": _T.warmup_steps,
        "warmup_fraction": _T.warmup_fraction, "gclip": _T.gclip,
        "max_grad_norm": _T.max_grad_norm, "max_steps": 0}
ALL_TARGETS = ["attention", "ffn", "experts", "router"]        # the groups a model lacks stay off


def _preset(rank: int, alpha: float, **fields) -> dict:
    return {**SAFE, "rank": rank, "alpha": alpha, "lr": f"{default_lr('lora', alpha):g}",
            **fields}


PRESETS = {
    "Quick try": _preset(8, 16.0, epochs=1, eval_every=10, targets=ALL_TARGETS),
    "Balanced": _preset(8, 16.0, epochs=3, eval_every=20, targets=ALL_TARGETS),
    "Thorough": _preset(32, 64.0, epochs=5, eval_every=20, patience=3,
                        targets=ALL_TARGETS + ["shared"]),
    "Experts only": _preset(8, 16.0, epochs=3, eval_every=20, targets=["experts"]),
    "Attention only": _preset(8, 16.0, epochs=3, eval_every=20, targets=["attention"]),
}
MOE_ONLY = ("Experts only", "Attention only")
SAVED_KEYS = ("rank", "alpha", "dropout", "lr", "schedule", "warmup", "warmup_fraction",
              "gclip", "max_grad_norm", "weight_decay",
              "epochs", "max_steps", "context", "eval_every", "save_every", "patience",
              "targets")
SETTINGS_KEY = "presets/custom"
CHOOSE = "Choose a preset\u2026"


def describe(values: dict) -> str:
    """What a preset sets, in words."""
    names = {"rank": "rank", "alpha": "alpha", "dropout": "dropout", "lr": "learning rate",
             "schedule": "schedule", "warmup": "warmup steps",
             "warmup_fraction": "warmup fraction", "gclip": "per-value clip",
             "max_grad_norm": "gradient-norm clip",
             "weight_decay": "weight decay", "epochs": "epochs", "max_steps": "max steps",
             "context": "context", "eval_every": "evaluate every", "save_every": "save every",
             "patience": "patience", "targets": "targets"}
    zero = {"warmup": "automatic warmup", "gclip": "no per-value clip",
            "max_grad_norm": "no gradient-norm clip", "max_steps": "no step cap"}
    parts = []
    for key, value in values.items():
        if key in zero and not value:
            parts.append(zero[key])
            continue
        if key == "targets":
            value = ", ".join(value) or "none"
        elif isinstance(value, float):
            value = f"{value:g}"
        parts.append(f"{names.get(key, key)} {value}")
    return "Sets " + "; ".join(parts) + "."


class PresetBar(QWidget):
    """The preset box, its line and the save button, acting on `form`."""

    def __init__(self, form: SettingsForm, settings: QSettings, parent: QWidget | None = None):
        super().__init__(parent)
        self.form, self.settings = form, settings
        self.moe = True
        self.box = QComboBox(toolTip=NEW_RUN_TIPS["preset"])
        self.line = QLabel(objectName="hint", wordWrap=True, textFormat=Qt.PlainText)
        self.save_button = QPushButton("Save as preset\u2026", toolTip=NEW_RUN_TIPS["preset"])
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(QLabel("Preset", objectName="formLabel"))
        row.addWidget(self.box)
        row.addWidget(self.save_button)
        row.addStretch(1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addLayout(row)
        layout.addWidget(self.line)
        self._fill()
        self.box.activated.connect(lambda _i: self.apply(self.box.currentText()))
        self.save_button.clicked.connect(self._save_dialog)

    def custom(self) -> dict[str, dict]:
        try:
            return dict(json.loads(self.settings.value(SETTINGS_KEY, "{}", type=str)))
        except (TypeError, ValueError):
            return {}

    def presets(self) -> dict[str, dict]:
        """The presets offered now (the MoE ones only for an MoE model), the user's last."""
        built_in = {k: v for k, v in PRESETS.items() if self.moe or k not in MOE_ONLY}
        return {**built_in, **self.custom()}

    def set_moe(self, moe: bool) -> None:
        self.moe = moe
        self._fill()

    def _fill(self) -> None:
        current = self.box.currentText()
        self.box.clear()
        self.box.addItem(CHOOSE)
        self.box.addItems(list(self.presets()))
        self.box.setCurrentIndex(max(self.box.findText(current), 0))

    def apply(self, name: str) -> None:
        """Set the form's fields to the preset `name` and say what it set."""
        values = self.presets().get(name)
        if values is None:
            self.line.setText("")
            return
        self.form.apply_preset(values)
        self.box.setCurrentText(name)
        self.line.setText(f"{name}: {describe(values)}")

    def save(self, name: str) -> None:
        """Keep the form's current settings as the preset `name`."""
        custom = self.custom()
        custom[name] = self.form.preset_values(SAVED_KEYS)
        self.settings.setValue(SETTINGS_KEY, json.dumps(custom))
        self._fill()
        self.box.setCurrentText(name)
        self.line.setText(f"Saved {name}: {describe(custom[name])}")

    def _save_dialog(self) -> None:
        name, ok = QInputDialog.getText(self, "Save as preset", "Name of the preset:")
        if ok and name.strip():
            self.save(name.strip())
