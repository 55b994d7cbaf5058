"""The model card panel: what a GGUF file holds, read off the GUI thread; and where models are.

`load(path)` shows a "Reading <file>..." state and reads the header in a worker thread; the card
replaces it when the read finishes. A failed read is not shown here: `load_failed` hands the
exception to the window's error funnel.

`discover_models()` (app.engine.hub.local, through the engine's door, shared with `workbench
models list`) lists the GGUF models found in the usual places: the Hugging Face cache,
llama.cpp's cache, LM Studio's model folders and Ollama's blobs.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from PySide6.QtCore import QObject, QRunnable, QSettings, Qt, QThreadPool, Signal
from PySide6.QtWidgets import (QFileDialog, QFrame, QGridLayout, QHBoxLayout, QLabel, QLineEdit,
                               QListWidget, QListWidgetItem, QProgressBar, QPushButton,
                               QScrollArea, QSizePolicy, QStackedWidget, QVBoxLayout,
                               QWidget)

from app.engine.api import FoundModel, ModelCard, describe_model, discover_models, human_bytes
from app.views.widgets.fit import ElidedLabel, WrappedLabel
from app.views.widgets.tooltips import NEW_RUN_TIPS

LABEL_WIDTH = 190                       # long labels wrap rather than push the values right


class _ReadSignals(QObject):
    finished = Signal(int, object)      # request id, ModelCard or the exception raised


class _ReadTask(QRunnable):
    def __init__(self, read: Callable[[str], ModelCard], path: str, request: int,
                 signals: _ReadSignals):
        super().__init__()
        self._read, self._path, self._request, self._signals = read, path, request, signals

    def run(self) -> None:
        try:
            result = self._read(self._path)
        except Exception as exc:        # the view decides: EngineError or a bug
            result = exc
        self._signals.finished.emit(self._request, result)


class ModelCardView(QWidget):
    """Placeholder, "Reading..." or the card of one model. `card` is the card shown, or None."""

    card_loaded = Signal(object)        # ModelCard
    load_failed = Signal(str, object)   # path, exception (EngineError, or a bug with traceback)

    def __init__(self, read: Callable[[str], ModelCard] = describe_model,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.card: ModelCard | None = None
        self._read = read
        self._request = 0
        self._path = ""
        # The pool is created before the signals object, so it is destroyed first, and its
        # destructor waits for a running read while the signals object still exists.
        self._pool = QThreadPool(self)
        self._signals = _ReadSignals(self)
        self._signals.finished.connect(self._on_read)

        self._pages = QStackedWidget()
        self._placeholder = _MessagePage(
            "No model selected",
            "Open a GGUF file to see its architecture, experts and what a LoRA run needs.")
        self._reading = _MessagePage(busy=True)
        self._card_page = self._build_card_page()
        for page in (self._placeholder, self._reading, self._card_page):
            self._pages.addWidget(page)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self._pages)

    def load(self, path: str) -> None:
        """Read `path` in a worker thread; emits card_loaded or load_failed."""
        self._request += 1
        self._path = path
        self.card = None
        self._reading.title.setText(f"Reading {os.path.basename(path)}\u2026")
        self._reading.subtitle.setText(os.path.dirname(path))
        self._pages.setCurrentWidget(self._reading)
        self._pool.start(_ReadTask(self._read, path, self._request, self._signals))

    def is_reading(self) -> bool:
        return self._pages.currentWidget() is self._reading

    def clear(self) -> None:
        """Back to the placeholder; a read still running is ignored when it finishes."""
        self._request += 1
        self.card = None
        self._pages.setCurrentWidget(self._placeholder)

    def _on_read(self, request: int, result: object) -> None:
        if request != self._request:
            return                      # a newer load() or clear() superseded this read
        if isinstance(result, BaseException):
            self.clear()
            self.load_failed.emit(self._path, result)
            return
        self._show_card(result)
        self.card_loaded.emit(result)

    def _show_card(self, card: ModelCard) -> None:
        self.card = card
        cfg = card.config
        self._name.setText(card.name)
        self._arch_badge.setText(cfg.arch)
        self._moe_badge.setVisible(cfg.is_moe)
        self._moe_badge.setToolTip(f"Mixture of Experts: {cfg.n_expert} experts, "
                                   f"{cfg.n_expert_used} used per token" if cfg.is_moe else "")
        self._path_label.setText(card.path)
        for pair in self._rows:
            for widget in pair:
                widget.deleteLater()
        self._rows = []
        for i, (label, value) in enumerate(card.rows()):
            name = QLabel(label, objectName="cardLabel", wordWrap=True, textFormat=Qt.PlainText)
            name.setFixedWidth(LABEL_WIDTH)
            text = QLabel(value, objectName="cardValue", wordWrap=True, textFormat=Qt.PlainText)
            text.setTextInteractionFlags(Qt.TextSelectableByMouse)
            self._grid.addWidget(name, i, 0, Qt.AlignTop)
            self._grid.addWidget(text, i, 1, Qt.AlignTop)
            self._rows.append((name, text))
        self._pages.setCurrentWidget(self._card_page)

    def set_row(self, prefix: str, label: str, value: str) -> bool:
        """Replace the row whose label starts with `prefix` (e.g. the memory estimate, updated
        live with the run's settings); False when there is no such row."""
        for name, text in self._rows:
            if name.text().startswith(prefix):
                name.setText(label)
                text.setText(value)
                return True
        return False

    def shown_rows(self) -> list[tuple[str, str]]:
        """The (label, value) rows as displayed."""
        return [(name.text(), value.text()) for name, value in self._rows]

    def badges(self) -> list[str]:
        """Texts of the visible badges next to the title."""
        return [b.text() for b in (self._arch_badge, self._moe_badge) if b.isVisibleTo(self)]

    def _build_card_page(self) -> QWidget:
        # a long file name is elided in the middle (whole in its tooltip and the path below)
        self._name = ElidedLabel(objectName="cardTitle", textFormat=Qt.PlainText)
        self._name.setSizePolicy(QSizePolicy.Preferred, QSizePolicy.Preferred)
        self._arch_badge = QLabel(objectName="badge")
        self._moe_badge = QLabel("MoE", objectName="badge")
        self._moe_badge.setProperty("variant", "moe")
        title = QHBoxLayout()
        title.setSpacing(10)
        title.addWidget(self._name)
        title.addWidget(self._arch_badge)
        title.addWidget(self._moe_badge)
        title.addStretch(1)
        self._path_label = QLabel(objectName="cardPath", wordWrap=True, textFormat=Qt.PlainText)
        self._path_label.setTextInteractionFlags(Qt.TextSelectableByMouse)

        self._rows: list[tuple[QLabel, QLabel]] = []
        rows = QFrame(objectName="cardRows")
        self._grid = QGridLayout(rows)
        self._grid.setColumnStretch(1, 1)
        self._grid.setHorizontalSpacing(28)
        self._grid.setVerticalSpacing(10)
        self._grid.setContentsMargins(20, 16, 20, 16)

        body = QWidget(objectName="cardBody")
        layout = QVBoxLayout(body)
        layout.setContentsMargins(28, 24, 28, 24)
        layout.setSpacing(6)
        layout.addLayout(title)
        layout.addWidget(self._path_label)
        layout.addSpacing(14)
        layout.addWidget(rows)
        layout.addStretch(1)
        scroll = QScrollArea(widgetResizable=True, frameShape=QFrame.NoFrame)
        scroll.setWidget(body)
        return scroll


class _MessagePage(QWidget):
    """A centred title and subtitle, optionally with a busy bar."""

    def __init__(self, title: str = "", subtitle: str = "", busy: bool = False):
        super().__init__()
        self.title = QLabel(title, objectName="pageTitle", alignment=Qt.AlignCenter,
                            textFormat=Qt.PlainText)
        self.subtitle = QLabel(subtitle, objectName="pageSubtitle", alignment=Qt.AlignCenter,
                               wordWrap=True, textFormat=Qt.PlainText)
        layout = QVBoxLayout(self)
        layout.setSpacing(10)
        layout.addStretch(1)
        layout.addWidget(self.title)
        layout.addWidget(self.subtitle)
        if busy:
            bar = QProgressBar(textVisible=False, maximumWidth=220, maximumHeight=6)
            bar.setRange(0, 0)
            layout.addWidget(bar, 0, Qt.AlignHCenter)
        layout.addStretch(2)


# ---------------------------------------------------------------- the picker
RECENT_KEY = "recent/models"
MAX_RECENT = 10


class ModelPicker(QFrame):
    """A path field, "Open model...", the models found on this computer and the recent ones.
    `model_chosen(path)` when the user picks one; `remember(path)` after it opened."""

    model_chosen = Signal(str)

    def __init__(self, settings: QSettings, parent: QWidget | None = None, *,
                 discover: Callable[[], list[FoundModel]] = discover_models):
        super().__init__(parent, objectName="sidebar")
        from app.views.context import Background

        self.settings = settings
        self.found: list[FoundModel] = []
        self._bg = Background(self, max_threads=1)
        self.path_field = QLineEdit(placeholderText="Path to a .gguf file", clearButtonEnabled=True,
                                    toolTip=NEW_RUN_TIPS["model_path"])
        self.path_field.returnPressed.connect(self._field_entered)
        open_button = QPushButton("Open model\u2026", objectName="primaryButton")
        open_button.clicked.connect(self.choose)
        self.get_button = QPushButton("Get a model\u2026",
                                      toolTip="Search Hugging Face for GGUF models, see what "
                                              "fits here and download one")
        self.get_button.clicked.connect(self.get_model)
        self.get_dialog = None
        # (LoRA rank, context) of the run being set up, for the dialog's "Trains here?"
        self.estimate_settings: Callable[[], tuple[int, int]] = lambda: (16, 512)
        self.found_list = QListWidget(objectName="recentList")
        self.recent_list = QListWidget(objectName="recentList")
        for lst in (self.found_list, self.recent_list):
            lst.setSizeAdjustPolicy(QListWidget.AdjustToContents)   # no empty list area
            lst.itemClicked.connect(self._picked)
            lst.itemActivated.connect(self._picked)
        # wrapped in the fixed width, never cut (a large font makes them taller)
        self.found_hint = WrappedLabel("Looking in the Hugging Face cache, llama.cpp, LM Studio "
                                       "and Ollama folders\u2026", objectName="sidebarHint")
        self.recent_hint = WrappedLabel("Models you open appear here.", objectName="sidebarHint")
        self.setFixedWidth(290)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 16, 16, 16)
        layout.setSpacing(8)
        layout.addWidget(QLabel("MODEL", objectName="sectionHeader"))
        layout.addWidget(self.path_field)
        layout.addWidget(open_button)
        layout.addWidget(self.get_button)
        layout.addSpacing(12)
        layout.addWidget(QLabel("RECENT", objectName="sectionHeader"))
        layout.addWidget(self.recent_hint)
        layout.addWidget(self.recent_list)
        layout.addSpacing(12)
        layout.addWidget(QLabel("ON THIS COMPUTER", objectName="sectionHeader"))
        layout.addWidget(self.found_hint)
        layout.addWidget(self.found_list, 1)
        layout.addStretch(1)
        self._refresh_recent()
        self._discover = discover
        self._bg.run("discover", discover, on_done=self._show_found,
                     on_error=lambda e: self._show_found([]))

    def choose(self) -> None:
        start = os.path.dirname(self.path_field.text()) or os.path.expanduser("~")
        path, _ = QFileDialog.getOpenFileName(self, "Open model", start,
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.model_chosen.emit(path)

    def get_model(self) -> None:
        """The "Get a model..." dialog (app.views.get_model); a model it downloads is opened
        and listed with those on this computer."""
        from app.views.get_model.dialog import GetModelDialog

        rank, context = self.estimate_settings()
        if self.get_dialog is None:             # one dialog, kept: its search, its download
            self.get_dialog = GetModelDialog(self, rank=rank, context=context)
            self.get_dialog.downloaded.connect(self._got_model)
        else:
            self.get_dialog.set_estimate(rank, context)
        self.get_dialog.open()

    def _got_model(self, path: str) -> None:
        self.model_chosen.emit(path)
        self._bg.run("discover", self._discover, on_done=self._show_found,
                     on_error=lambda e: self._show_found([]))

    def set_current(self, path: str) -> None:
        self.path_field.setText(path)
        self.path_field.setCursorPosition(0)        # the start of the path, not its end
        self.path_field.setToolTip(f"{path}\n\n{NEW_RUN_TIPS['model_path']}")
        for lst in (self.recent_list, self.found_list):
            for i in range(lst.count()):
                item = lst.item(i)
                item.setSelected(item.data(Qt.UserRole) == path)

    def recent_models(self) -> list[str]:
        """Paths of recently opened models, most recent first."""
        return list(self.settings.value(RECENT_KEY, [], type=list))

    def remember(self, path: str) -> None:
        recent = [path] + [p for p in self.recent_models() if p != path]
        self.settings.setValue(RECENT_KEY, recent[:MAX_RECENT])
        self._refresh_recent()
        self.set_current(path)

    def _field_entered(self) -> None:
        if self.path_field.text().strip():
            self.model_chosen.emit(self.path_field.text().strip())

    def _picked(self, item: QListWidgetItem) -> None:
        self.model_chosen.emit(item.data(Qt.UserRole))

    def _refresh_recent(self) -> None:
        self.recent_list.clear()
        for path in self.recent_models():
            item = QListWidgetItem(os.path.basename(path))
            item.setData(Qt.UserRole, path)
            item.setToolTip(path)
            self.recent_list.addItem(item)
            item.setSelected(path == self.path_field.text())
        self.recent_list.setVisible(self.recent_list.count() > 0)
        self.recent_hint.setVisible(self.recent_list.count() == 0)

    def _show_found(self, found: list[FoundModel]) -> None:
        self.found = list(found)
        self.found_list.clear()
        for m in self.found:
            item = QListWidgetItem(f"{m.name}\n{m.source} \u00b7 {human_bytes(m.size)}")
            item.setData(Qt.UserRole, m.path)
            item.setToolTip(m.path)
            self.found_list.addItem(item)
        self.found_list.setVisible(bool(self.found))
        self.found_hint.setText("" if self.found else
                                "No models in the Hugging Face cache, llama.cpp's cache, LM "
                                "Studio or Ollama folders.")
        self.found_hint.setVisible(not self.found)
