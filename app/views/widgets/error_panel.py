"""The one error funnel of the GUI: a plain-language message, a hint, and expandable details.

An `EngineError` is bad input the user can fix: its message and hint are shown as they are.
Anything else is a bug: the panel says so and puts the traceback in the details.
"""

from __future__ import annotations

import traceback

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QSizePolicy, QStyle,
                               QToolButton, QVBoxLayout, QWidget)

from app.engine.api import EngineError

BUG_HINT = ("This is a bug in the workbench, not a problem with your file. "
            "Please report it with the details below.")


def describe_error(error: BaseException) -> tuple[str, str, str]:
    """(message, hint, details) for any exception, the way the panel shows it."""
    if isinstance(error, EngineError):
        return error.message, error.hint, f"{type(error).__name__} (kind: {error.kind})"
    details = "".join(traceback.format_exception(error)).rstrip()
    return f"Unexpected error: {type(error).__name__}: {error}", BUG_HINT, details


class ErrorPanel(QWidget):
    """An inline error card; `show_error` fills it. Sits where the content it replaces was, or,
    `closable`, as a banner above a screen (`present` fills and shows it, the x hides it)."""

    dismissed = Signal()

    def __init__(self, parent: QWidget | None = None, *, margins: int = 28,
                 closable: bool = False):
        super().__init__(parent)
        self.error: BaseException | None = None
        card = QFrame(objectName="errorCard")
        icon = QLabel()
        icon.setPixmap(self.style().standardIcon(QStyle.SP_MessageBoxCritical).pixmap(32, 32))
        icon.setFixedSize(32, 32)
        self.title_label = QLabel(objectName="errorTitle", textFormat=Qt.PlainText)
        self.message_label = _text_label("errorMessage")
        self.hint_label = _text_label("errorHint")
        self.details_button = QToolButton(text="Details", checkable=True,
                                          objectName="detailsToggle")
        self.details_button.setToolButtonStyle(Qt.ToolButtonTextBesideIcon)
        self.details_button.setArrowType(Qt.RightArrow)
        self.details_button.toggled.connect(self._toggle_details)
        self.details_view = QPlainTextEdit(readOnly=True, objectName="errorDetails")
        self.details_view.setFont(QFontDatabase.systemFont(QFontDatabase.FixedFont))
        self.details_view.setLineWrapMode(QPlainTextEdit.NoWrap)
        self.details_view.hide()

        text_box = QWidget()
        text_box.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Preferred)
        text = QVBoxLayout(text_box)
        text.setContentsMargins(0, 0, 0, 0)
        text.setSpacing(8)
        for widget in (self.title_label, self.message_label, self.hint_label,
                       self.details_button, self.details_view):
            text.addWidget(widget)
        row = QHBoxLayout(card)
        row.setContentsMargins(20, 18, 20, 18)
        row.setSpacing(16)
        row.addWidget(icon, 0, Qt.AlignTop)
        row.addWidget(text_box, 1)
        if closable:
            close = QToolButton(text="\u2715", objectName="errorClose", autoRaise=True)
            close.setToolTip("Dismiss")
            close.clicked.connect(self.dismiss)
            row.addWidget(close, 0, Qt.AlignTop)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(margins, margins, margins, margins)
        outer.addWidget(card)
        if not closable:
            outer.addStretch(1)

    def show_error(self, title: str, error: BaseException, context: str = "") -> None:
        """Show `error` under `title`; `context` (e.g. the full path) leads the details."""
        self.error = error
        message, hint, details = describe_error(error)
        self.title_label.setText(title)
        self.message_label.setText(message)
        self.hint_label.setText(hint)
        self.hint_label.setVisible(bool(hint))
        text = f"{context}\n\n{details}" if context else details
        self.details_view.setPlainText(text)
        lines = min(text.count("\n") + 1, 16)      # fit short details, scroll long tracebacks
        self.details_view.setFixedHeight(lines * self.details_view.fontMetrics().lineSpacing() + 16)
        self.details_button.setChecked(False)

    def present(self, title: str, error: BaseException, context: str = "") -> None:
        """`show_error` and make the panel visible."""
        self.show_error(title, error, context)
        self.show()

    def dismiss(self) -> None:
        self.hide()
        self.dismissed.emit()

    def _toggle_details(self, expanded: bool) -> None:
        self.details_button.setArrowType(Qt.DownArrow if expanded else Qt.RightArrow)
        self.details_view.setVisible(expanded)


def _text_label(name: str) -> QLabel:
    label = QLabel(objectName=name, wordWrap=True, textFormat=Qt.PlainText)
    label.setTextInteractionFlags(Qt.TextSelectableByMouse)
    return label
