"""The reward functions of a GRPO run: a list of rows (function, its argument, weight) to add
to and remove from, each checked as you type with the problem shown under it.

A row edits one `RewardSpec` dict (app.engine.training.reward_functions): the function's kind, the one
argument that kind takes (see ARGUMENTS) and the weight. Settings a row does not show (a
numeric reward's tag, a custom function name) are kept as they were loaded. A Python file runs
as Python with the user's rights (not in a sandbox): while a row names one, a note under the list
says so.
Test-visible state: `rows` (list of RewardRow), `add_button`, `code_note`, `specs()`,
`validate()`.
"""

from __future__ import annotations

import os

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFontInfo
from PySide6.QtWidgets import (QFileDialog, QGridLayout, QHBoxLayout, QLabel, QLineEdit,
                               QPushButton, QToolButton, QVBoxLayout, QWidget)

from app.engine.api import ConfigError, RewardSpec
from app.views.widgets.form_fields import combo, dspin, set_combo

KINDS = (("exact", "exact match"), ("numeric", "numeric"), ("regex", "regex"),
         ("format", "format tag"), ("length", "length penalty"), ("file", "Python file"))
# kind -> (RewardSpec field the argument sets, its type, placeholder, what the reward does)
ARGUMENTS = {
    "exact": ("tag", str, "tag (optional)", "1 when the completion equals the answer (with a "
              "tag: the text inside its last <tag>\u2026</tag>), else 0"),
    "numeric": ("tolerance", float, "tolerance (default 0)", "1 when the completion's last "
                "number is within the tolerance of the answer, else 0"),
    "regex": ("arg", str, r"pattern, e.g. ^\d+$", "1 when the pattern is found in the "
              "completion, else 0"),
    "format": ("arg", str, "tag (default answer)", "1 when the completion holds "
               "<tag>\u2026</tag> with some text, else 0"),
    "length": ("target", int, "target tokens (default 0)", "0 up to the target length, "
               "falling to -1 at max new tokens"),
    "file": ("arg", str, "path to a .py file", "reward(prompt, completion, **row) -> float "
             "from your Python file; it runs as Python with your rights")}
CODE_NOTE = ("A Python file runs as Python with your rights, like any script you run: use only "
             "files you wrote or trust. Starting a run asks before a file you have not "
             "trusted yet (or one changed since) runs.")
DEFAULTS = {"format": "answer"}
KIND_WIDTH, WEIGHT_WIDTH, REMOVE_WIDTH = 130, 92, 28      # columns shared by rows and header


def column_widths(widget: QWidget) -> tuple[int, int, int]:
    """The kind, weight and remove columns' widths in `widget`'s font: the sizes above at
    10 pt, grown with a larger font (a large-text desktop cut "Python file" and the weight)."""
    widget.ensurePolished()
    scale = max(1.0, QFontInfo(widget.font()).pixelSize() / 13)       # 10 pt at 96 dpi
    return tuple(round(w * scale) for w in (KIND_WIDTH, WEIGHT_WIDTH, REMOVE_WIDTH))


class RewardRow(QWidget):
    """One reward function; `spec()` is its RewardSpec dict (ValueError for a bad number)."""

    changed = Signal()
    remove_requested = Signal(object)

    def __init__(self, spec: dict, parent: QWidget | None = None):
        super().__init__(parent)
        self._spec = dict(spec)
        kind_width, weight_width, remove_width = column_widths(self)
        self.kind_box = combo(KINDS)
        self.kind_box.setFixedWidth(kind_width)
        self.arg_field = QLineEdit()
        self.browse_button = QPushButton("Browse\u2026", clicked=self._browse)
        self.weight_box = dspin(-1000, 1000, 1.0, 2, 0.1)
        self.weight_box.setFixedWidth(weight_width)
        self.weight_box.setToolTip("The reward's weight in the total: sum of weight x reward")
        self.remove_button = QToolButton(text="\u2715", autoRaise=True, toolTip="Remove")
        self.remove_button.setFixedWidth(remove_width)
        self.remove_button.clicked.connect(lambda: self.remove_requested.emit(self))
        self.error_label = QLabel(objectName="fieldError", wordWrap=True,
                                  textFormat=Qt.PlainText)
        self.error_label.hide()
        set_combo(self.kind_box, spec.get("kind", "exact"))
        self.weight_box.setValue(float(spec.get("weight", 1.0)))
        self._show_kind(keep_argument=True)
        self.kind_box.currentIndexChanged.connect(lambda _i: self._on_kind())
        self.arg_field.textChanged.connect(lambda _t: self.changed.emit())
        self.weight_box.valueChanged.connect(lambda _v: self.changed.emit())

        grid = QGridLayout(self)
        grid.setContentsMargins(0, 0, 0, 0)
        grid.setHorizontalSpacing(6)
        grid.setVerticalSpacing(2)
        grid.setColumnStretch(1, 1)
        grid.addWidget(self.kind_box, 0, 0)
        grid.addWidget(self.arg_field, 0, 1)
        grid.addWidget(self.browse_button, 0, 2)
        grid.addWidget(self.weight_box, 0, 3)
        grid.addWidget(self.remove_button, 0, 4)
        grid.addWidget(self.error_label, 1, 0, 1, 5)

    def kind(self) -> str:
        return self.kind_box.currentData()

    def _on_kind(self) -> None:
        self._spec = {"kind": self.kind()}
        self._show_kind(keep_argument=False)
        self.changed.emit()

    def _show_kind(self, keep_argument: bool) -> None:
        key, _, placeholder, tip = ARGUMENTS[self.kind()]
        value = self._spec.get(key) if keep_argument else None
        self.arg_field.blockSignals(True)
        self.arg_field.setText(DEFAULTS.get(self.kind(), "") if value in (None, "")
                               else f"{value:g}" if isinstance(value, float) else str(value))
        self.arg_field.blockSignals(False)
        self.arg_field.setPlaceholderText(placeholder)
        self.kind_box.setToolTip(tip)
        self.arg_field.setToolTip(tip)
        self.browse_button.setVisible(self.kind() == "file")

    def spec(self) -> dict:
        key, kind_of = ARGUMENTS[self.kind()][:2]
        text = self.arg_field.text().strip()
        spec = {**self._spec, "kind": self.kind(), "weight": self.weight_box.value()}
        spec.pop(key, None)
        if text:
            spec[key] = kind_of(text)
        return spec

    def set_error(self, message: str) -> None:
        self.error_label.setText(message)
        self.error_label.setVisible(bool(message))

    def _browse(self) -> None:
        start = os.path.dirname(self.arg_field.text()) or os.path.expanduser("~")
        path, _ = QFileDialog.getOpenFileName(self, "Reward function", start,
                                              "Python (*.py);;All files (*)")
        if path:
            self.arg_field.setText(path)


def check_spec(row: RewardRow) -> str:
    """The problem with the row's reward, or ""."""
    try:
        RewardSpec.from_dict(row.spec()).validate()
    except ValueError:
        kind = ARGUMENTS[row.kind()][1]
        return f"Enter {'a whole number' if kind is int else 'a number'}."
    except ConfigError as e:
        return e.message
    return ""


class RewardEditor(QWidget):
    """The list of reward functions; `changed()` after any edit."""

    changed = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.rows: list[RewardRow] = []
        head = QHBoxLayout()
        head.setSpacing(6)
        kind_width, weight_width, remove_width = column_widths(self)
        for text, width in (("Function", kind_width), ("Argument", 0), ("Weight", weight_width)):
            label = QLabel(text, objectName="formLabel")
            if width:
                label.setFixedWidth(width)
            head.addWidget(label, 0 if width else 1)
        head.addSpacing(remove_width + 6)
        self._list = QVBoxLayout()
        self._list.setSpacing(4)
        self.add_button = QPushButton("Add reward", clicked=lambda: self.add({"kind": "exact"}))
        self.empty_label = QLabel("Add at least one reward function.", objectName="fieldError")
        self.code_note = QLabel(CODE_NOTE, objectName="hint", wordWrap=True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(head)
        layout.addLayout(self._list)
        layout.addWidget(self.empty_label)
        layout.addWidget(self.code_note)
        layout.addWidget(self.add_button, 0, Qt.AlignLeft)
        self.validate()

    def add(self, spec: dict) -> RewardRow:
        row = RewardRow(spec)
        row.changed.connect(self._on_change)
        row.remove_requested.connect(self.remove)
        self.rows.append(row)
        self._list.addWidget(row)
        self._on_change()
        return row

    def remove(self, row: RewardRow) -> None:
        self.rows.remove(row)
        self._list.removeWidget(row)
        row.deleteLater()
        self._on_change()

    def set_specs(self, specs: list[dict]) -> None:
        for row in list(self.rows):
            self.remove(row)
        for spec in specs:
            self.add(spec)

    def specs(self) -> list[dict]:
        """The RewardSpec dicts of the rows that have no problem."""
        return [row.spec() for row in self.rows if not check_spec(row)]

    def validate(self) -> list[str]:
        """Show each row's problem under it; the problems, as "reward N: ..."."""
        problems = []
        for i, row in enumerate(self.rows, start=1):
            message = check_spec(row)
            row.set_error(message)
            if message:
                problems.append(f"reward {i} ({row.kind()}): {message}")
        self.empty_label.setVisible(not self.rows)
        self.code_note.setVisible(any(row.kind() == "file" for row in self.rows))
        if not self.rows:
            problems.append("Add at least one reward function.")
        return problems

    def _on_change(self) -> None:
        self.validate()
        self.changed.emit()
