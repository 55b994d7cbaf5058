"""Forms with inline validation: labelled rows in group boxes, a red problem under each field.

`FormBase` is what the run's settings forms share: `_group(title)` makes a titled box,
`_row(grid, key, label, widget)` adds a labelled field with an (initially hidden) error label
under it and emits `changed(key)` when the user edits it; `_show_errors(errors)` puts each
problem under its field (fields the user cannot see have none) and `errors()` returns what is
shown. The small constructors (`spin`, `dspin`, `combo`) give every field the same behaviour.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QGridLayout, QGroupBox,
                               QLabel, QLineEdit, QSpinBox, QWidget)


def spin(lo: int, hi: int, value: int, special: str = "") -> QSpinBox:
    box = QSpinBox(minimum=lo, maximum=hi, value=value)
    box.setFocusPolicy(Qt.StrongFocus)
    if special:
        box.setSpecialValueText(special)
    return box


def dspin(lo: float, hi: float, value: float, decimals: int, step: float) -> QDoubleSpinBox:
    box = QDoubleSpinBox(minimum=lo, maximum=hi, value=value, decimals=decimals, singleStep=step)
    box.setFocusPolicy(Qt.StrongFocus)
    return box


def combo(items) -> QComboBox:
    """A combo box of `items`: keys, or (key, text) pairs; the key is the item's data."""
    box = QComboBox()
    for item in items:
        key, text = item if isinstance(item, tuple) else (item, item)
        box.addItem(text, key)
    box.setFocusPolicy(Qt.StrongFocus)
    return box


def set_combo(box: QComboBox, key) -> None:
    i = box.findData(key)
    box.setCurrentIndex(i if i >= 0 else 0)


def set_field(widget: QWidget, value) -> None:
    """Set a combo box (by key), a check box, a line edit or a spin box to `value`."""
    if isinstance(widget, QComboBox):
        set_combo(widget, value)
    elif isinstance(widget, QCheckBox):
        widget.setChecked(bool(value))
    elif isinstance(widget, QLineEdit):
        widget.setText("" if value is None else str(value))
    else:
        widget.setValue(type(widget.value())(value))


def field_value(widget: QWidget):
    """The value of a combo box (its key), a check box, a line edit (stripped) or a spin box."""
    if isinstance(widget, QComboBox):
        return widget.currentData()
    if isinstance(widget, QCheckBox):
        return widget.isChecked()
    if isinstance(widget, QLineEdit):
        return widget.text().strip()
    return widget.value()


class FormBase(QWidget):
    """Fields by key with inline errors; `changed(str)` names the field the user edited."""

    changed = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.fields: dict[str, QWidget] = {}
        self.error_labels: dict[str, QLabel] = {}
        self._loading = False                 # set_values in progress: no `changed`
        self._boxes: list[QGroupBox] = []     # kept alive until laid out

    def _group(self, title: str) -> QGridLayout:
        box = QGroupBox(title)
        self._boxes.append(box)
        grid = QGridLayout(box)
        grid.setColumnStretch(1, 1)
        grid.setHorizontalSpacing(10)
        grid.setVerticalSpacing(4)
        return grid

    def _row(self, grid: QGridLayout, key: str, label: str, widget: QWidget) -> None:
        r = grid.rowCount()
        name = QLabel(label)
        name.setObjectName("formLabel")
        grid.addWidget(name, r, 0, Qt.AlignTop | Qt.AlignLeft)
        grid.addWidget(widget, r, 1)
        err = QLabel(objectName="fieldError", wordWrap=True, textFormat=Qt.PlainText)
        err.hide()
        grid.addWidget(err, r + 1, 1)
        self.fields[key] = widget
        self.error_labels[key] = err
        widget.setProperty("formLabel", name)
        self._watch(widget, key)

    def _watch(self, widget: QWidget, key: str) -> None:
        if isinstance(widget, QComboBox):
            widget.currentIndexChanged.connect(lambda *_: self._changed(key))
        elif isinstance(widget, (QSpinBox, QDoubleSpinBox)):
            widget.valueChanged.connect(lambda *_: self._changed(key))
        elif isinstance(widget, QLineEdit):
            widget.textChanged.connect(lambda *_: self._changed(key))
        elif isinstance(widget, QCheckBox):
            widget.toggled.connect(lambda *_: self._changed(key))

    def _changed(self, key: str) -> None:
        if self._loading:
            return
        self.validate()
        self.changed.emit(key)

    def set_tooltips(self, tips: dict[str, str]) -> None:
        """Each field's help on its label, the field and the inputs inside it."""
        for key, text in tips.items():
            widget = self.fields[key]
            for w in (self.label(key), widget, *widget.findChildren(QWidget)):
                w.setToolTip(text)

    def __getitem__(self, key: str) -> QWidget:
        return self.fields[key]

    def label(self, key: str) -> QLabel:
        return self.fields[key].property("formLabel")

    def _show(self, key: str, visible: bool) -> None:
        widget = self.fields[key]
        widget.setVisible(visible)
        self.label(key).setVisible(visible)
        if not visible:
            self.error_labels[key].hide()

    def validate(self) -> dict[str, str]:
        """Check every field, show the problems under their fields and return them."""
        return self._show_errors({})

    def _show_errors(self, errors: dict[str, str]) -> dict[str, str]:
        errors = {k: v for k, v in errors.items() if self.fields[k].isVisibleTo(self)}
        for key, label in self.error_labels.items():
            msg = errors.get(key, "")
            label.setText(msg)
            label.setVisible(bool(msg))
        return errors

    def errors(self) -> dict[str, str]:
        """The problems shown now, by field."""
        return {k: lab.text() for k, lab in self.error_labels.items() if lab.text()}
