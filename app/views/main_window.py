"""The main window: a model picker on the left, the model card (or the error panel) on the right."""

from __future__ import annotations

import os
from collections.abc import Callable

from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (QFileDialog, QFrame, QHBoxLayout, QLabel, QLineEdit, QListWidget,
                               QListWidgetItem, QMainWindow, QPushButton, QStackedWidget,
                               QVBoxLayout, QWidget)

from app.engine.model_info import ModelCard, describe_model
from app.views.error_panel import ErrorPanel
from app.views.model_card import ModelCardView

APP_NAME = "GGUF Workbench"
RECENT_KEY = "recent/models"
MAX_RECENT = 10


class MainWindow(QMainWindow):
    """`settings` holds the recent-files list (default: the application's QSettings);
    `read_model` reads a card from a path (default: the engine's describe_model)."""

    def __init__(self, settings: QSettings | None = None,
                 read_model: Callable[[str], ModelCard] = describe_model):
        super().__init__()
        self.settings = settings if settings is not None else QSettings()
        self.setWindowTitle(APP_NAME)
        self.card_view = ModelCardView(read_model)
        self.card_view.card_loaded.connect(self._on_card_loaded)
        self.card_view.load_failed.connect(self._on_load_failed)
        self.error_panel = ErrorPanel()
        self._content = QStackedWidget(objectName="content")
        self._content.addWidget(self.card_view)
        self._content.addWidget(self.error_panel)

        central = QWidget()
        layout = QHBoxLayout(central)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(self._build_sidebar())
        layout.addWidget(self._content, 1)
        self.setCentralWidget(central)
        self._build_menu()
        self._refresh_recent()

    def open_model(self, path: str) -> None:
        """Show the card of the GGUF file at `path` (read in the background)."""
        path = os.path.abspath(os.path.expanduser(path))
        self.path_field.setText(path)
        self.recent_list.clearSelection()
        self._content.setCurrentWidget(self.card_view)
        self.setWindowTitle(f"{os.path.basename(path)} \u2014 {APP_NAME}")
        self.card_view.load(path)

    def choose_model(self) -> None:
        start = os.path.dirname(self.path_field.text()) or os.path.expanduser("~")
        path, _ = QFileDialog.getOpenFileName(self, "Open model", start,
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.open_model(path)

    def recent_models(self) -> list[str]:
        """Paths of recently opened models, most recent first."""
        return list(self.settings.value(RECENT_KEY, [], type=list))

    def error_shown(self) -> bool:
        return self._content.currentWidget() is self.error_panel

    def _on_card_loaded(self, card: ModelCard) -> None:
        recent = [card.path] + [p for p in self.recent_models() if p != card.path]
        self.settings.setValue(RECENT_KEY, recent[:MAX_RECENT])
        self._refresh_recent()

    def _on_load_failed(self, path: str, error: BaseException) -> None:
        self.error_panel.show_error(f"Could not open {os.path.basename(path)}", error,
                                    context=f"File: {path}")
        self._content.setCurrentWidget(self.error_panel)

    def _open_field_path(self) -> None:
        if self.path_field.text().strip():
            self.open_model(self.path_field.text().strip())

    def _open_recent(self, item: QListWidgetItem) -> None:
        self.open_model(item.data(Qt.UserRole))

    def _refresh_recent(self) -> None:
        self.recent_list.clear()
        for path in self.recent_models():
            item = QListWidgetItem(os.path.basename(path))
            item.setData(Qt.UserRole, path)
            item.setToolTip(path)
            self.recent_list.addItem(item)
            item.setSelected(self.card_view.card is not None and path == self.card_view.card.path)
        self.recent_list.setVisible(self.recent_list.count() > 0)
        self._recent_empty.setVisible(self.recent_list.count() == 0)

    def _build_sidebar(self) -> QWidget:
        self.path_field = QLineEdit(placeholderText="Path to a .gguf file", clearButtonEnabled=True)
        self.path_field.returnPressed.connect(self._open_field_path)
        open_button = QPushButton("Open model\u2026", objectName="primaryButton")
        open_button.clicked.connect(self.choose_model)
        self.recent_list = QListWidget(objectName="recentList")
        self.recent_list.itemClicked.connect(self._open_recent)
        self.recent_list.itemActivated.connect(self._open_recent)
        self._recent_empty = QLabel("Models you open appear here.", objectName="sidebarHint",
                                    wordWrap=True)

        sidebar = QFrame(objectName="sidebar")
        sidebar.setFixedWidth(300)
        layout = QVBoxLayout(sidebar)
        layout.setContentsMargins(18, 20, 18, 18)
        layout.setSpacing(8)
        layout.addWidget(QLabel("MODEL", objectName="sectionHeader"))
        layout.addWidget(self.path_field)
        layout.addWidget(open_button)
        layout.addSpacing(18)
        layout.addWidget(QLabel("RECENT", objectName="sectionHeader"))
        layout.addWidget(self._recent_empty)
        layout.addWidget(self.recent_list, 1)
        layout.addStretch(0)            # takes the space while the list is hidden
        return sidebar

    def _build_menu(self) -> None:
        menu = self.menuBar().addMenu("&File")
        open_action = QAction("&Open model\u2026", self, shortcut=QKeySequence.Open)
        open_action.triggered.connect(self.choose_model)
        quit_action = QAction("&Quit", self, shortcut=QKeySequence.Quit)
        quit_action.triggered.connect(self.close)
        menu.addAction(open_action)
        menu.addSeparator()
        menu.addAction(quit_action)
