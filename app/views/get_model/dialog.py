""""Get a model...": search the Hugging Face Hub for GGUF models, see a repository's files with
their sizes, quant types and what fits here, download one with progress and cancel.

Every call to the Hub runs in a worker thread (`Background`): searching, listing, reading each
file's header for "what fits" (a ranged request, no weights), downloading (its progress comes
back through a queued signal; Cancel sets an event the download checks between chunks, and the
part already fetched is kept for the next try). The window stays responsive throughout.
`downloaded(path)` when a model is in the cache; the picker then opens it. Closing the dialog
leaves a download running (the picker shows the same dialog again); quitting cancels it.
"""

from __future__ import annotations

import threading

from PySide6.QtCore import QCoreApplication, QObject, Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QComboBox, QDialog, QHBoxLayout, QHeaderView,
                               QLabel, QLineEdit, QProgressBar, QPushButton, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from app.engine.api import EngineError, human_bytes, hub, trainable_path
from app.views.context import Background
from app.views.widgets.error_panel import ErrorPanel

RESULT_COLUMNS = ("Repository", "Downloads", "Likes")
FILE_COLUMNS = ("Model", "Quant", "Size", "Trains here?")


class _Progress(QObject):
    """Carries a download's progress from its worker thread to the GUI thread (queued)."""

    changed = Signal(int, int, str)


def _item(text: str, data=None, align=Qt.AlignLeft | Qt.AlignVCenter) -> QTableWidgetItem:
    item = QTableWidgetItem(text)
    item.setFlags(Qt.ItemIsSelectable | Qt.ItemIsEnabled)
    item.setTextAlignment(align)
    if data is not None:
        item.setData(Qt.UserRole, data)
    return item


def _table(columns: tuple[str, ...], stretch: int = 0) -> QTableWidget:
    t = QTableWidget(0, len(columns))
    t.setHorizontalHeaderLabels(list(columns))
    t.setSelectionBehavior(QAbstractItemView.SelectRows)
    t.setSelectionMode(QAbstractItemView.SingleSelection)
    t.verticalHeader().hide()
    for i in range(len(columns)):
        t.horizontalHeader().setSectionResizeMode(
            i, QHeaderView.Stretch if i == stretch else QHeaderView.ResizeToContents)
    return t


def fit_text(fit) -> str:
    """A file's "Trains here?" cell: the architecture and the estimate against this machine's
    memory, or why not (the whole note is the cell's tooltip)."""
    if not fit.supported:
        return f"\u2717 {fit.note}"
    if fit.need is None or fit.have is None:
        return f"? {fit.architecture}: {fit.note}"
    mark = "\u2713" if fit.fits else "\u2717 too big:"
    return f"{mark} {fit.architecture}, needs {human_bytes(fit.need)} of {human_bytes(fit.have)}"


class GetModelDialog(QDialog):
    downloaded = Signal(str)

    def __init__(self, parent: QWidget | None = None, *, rank: int = 16, context: int = 512):
        super().__init__(parent)
        self.setWindowTitle("Get a model from Hugging Face")
        self.resize(900, 640)
        self.rank, self.context = rank, context
        self.models: list = []
        self.fits: dict[str, object] = {}
        self._cancel: threading.Event | None = None
        self._downloading = None                 # the HubModel being downloaded
        self._bg = Background(self, max_threads=3)
        self._progress = _Progress(self)
        self._progress.changed.connect(self._show_progress)

        self.query = QLineEdit(placeholderText="Search GGUF models (e.g. Qwen3, gemma-3, OLMoE)",
                               clearButtonEnabled=True)
        self.query.returnPressed.connect(self.search)
        self.sort = QComboBox()
        self.sort.addItem("Most downloaded", "downloads")
        self.sort.addItem("Most liked", "likes")
        self.search_button = QPushButton("Search", objectName="primaryButton")
        self.search_button.clicked.connect(self.search)
        self.results = _table(RESULT_COLUMNS)
        self.results.itemSelectionChanged.connect(self._repo_selected)
        self.files = _table(FILE_COLUMNS, stretch=3)
        self.files.itemSelectionChanged.connect(self._file_selected)
        self.hint = QLabel(objectName="sidebarHint", wordWrap=True)
        self._say_estimate()
        self.status = QLabel("Search the Hub for repositories with GGUF files.",
                             objectName="sidebarHint", wordWrap=True,
                             textFormat=Qt.PlainText)
        self.bar = QProgressBar(textVisible=True)
        self.bar.hide()
        self.error = ErrorPanel(self, margins=0, closable=True)
        self.error.hide()
        self.download_button = QPushButton("Download", objectName="primaryButton",
                                           enabled=False)
        self.download_button.clicked.connect(self.download)
        self.cancel_button = QPushButton("Cancel download", enabled=False)
        self.cancel_button.clicked.connect(self.cancel)
        close = QPushButton("Close")
        close.clicked.connect(self.reject)
        app = QCoreApplication.instance()
        if app is not None:          # quitting with a download running: stop it at once
            app.aboutToQuit.connect(self.cancel)

        top = QHBoxLayout()
        top.addWidget(self.query, 1)
        top.addWidget(self.sort)
        top.addWidget(self.search_button)
        bottom = QHBoxLayout()
        bottom.addWidget(self.bar, 3)
        bottom.addStretch(1)
        bottom.addWidget(self.download_button)
        bottom.addWidget(self.cancel_button)
        bottom.addWidget(close)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.error)
        layout.addWidget(QLabel("REPOSITORIES", objectName="sectionHeader"))
        layout.addWidget(self.results, 2)
        layout.addWidget(QLabel("GGUF FILES", objectName="sectionHeader"))
        layout.addWidget(self.files, 3)
        layout.addWidget(self.hint)
        layout.addWidget(self.status)
        layout.addLayout(bottom)

    def _say_estimate(self) -> None:
        self.hint.setText(
            f"Trains here?: the estimate of a LoRA run (rank {self.rank}, context "
            f"{self.context}) read from each file's header before any weights are fetched. "
            "Files go to the Hugging Face cache (HF_HOME); a gated model needs `hf auth login` "
            "or HF_TOKEN.")

    def set_estimate(self, rank: int, context: int) -> None:
        """The run's settings changed: "Trains here?" again at these."""
        if (rank, context) == (self.rank, self.context):
            return
        self.rank, self.context = rank, context
        self._say_estimate()
        if self.models:
            self._show_files(self.models)

    # ---- search and listing --------------------------------------------------------------
    def search(self) -> None:
        self.error.hide()
        self.status.setText("Searching\u2026")
        self._bg.run("search", hub.search, self.query.text().strip(), None,
                     self.sort.currentData(), 50, on_done=self._show_results,
                     on_error=lambda e: self._fail("Search failed", e))

    def _show_results(self, hits: list) -> None:
        self.results.setRowCount(0)
        for hit in hits:
            row = self.results.rowCount()
            self.results.insertRow(row)
            name = hit.repo_id + ("  (gated)" if hit.gated else "")
            self.results.setItem(row, 0, _item(name, hit.repo_id))
            right = Qt.AlignRight | Qt.AlignVCenter
            self.results.setItem(row, 1, _item(f"{hit.downloads:,}", align=right))
            self.results.setItem(row, 2, _item(f"{hit.likes:,}", align=right))
        self.status.setText(f"{len(hits)} repositories with GGUF files. Pick one to see its "
                            "files." if hits else "No repository with GGUF files matches.")

    def selected_repo(self) -> str | None:
        rows = self.results.selectionModel().selectedRows()
        return rows[0].data(Qt.UserRole) if rows else None

    def _repo_selected(self) -> None:
        repo = self.selected_repo()
        self.files.setRowCount(0)
        self.download_button.setEnabled(False)
        if repo is None:
            return
        self.status.setText(f"Listing the files of {repo}\u2026")
        self._bg.run("files", hub.list_models, repo, on_done=self._show_files,
                     on_error=lambda e: self._fail(f"Cannot list {repo}", e))

    def _show_files(self, models: list) -> None:
        self.models = list(models)
        self.fits = {}
        self.files.setRowCount(0)
        for m in self.models:
            row = self.files.rowCount()
            self.files.insertRow(row)
            parts = f" ({len(m.files)} parts)" if m.is_split else ""
            self.files.setItem(row, 0, _item(m.name + parts, m.name))
            self.files.setItem(row, 1, _item(m.quant or "-"))
            self.files.setItem(row, 2, _item(human_bytes(m.size),
                                             align=Qt.AlignRight | Qt.AlignVCenter))
            self.files.setItem(row, 3, _item("reading the header\u2026"))
            self._bg.run(f"fit:{m.repo_id}:{m.name}", hub.what_fits, m, self.rank, self.context,
                         on_done=lambda fit, m=m: self._show_fit(m, fit),
                         on_error=lambda e, m=m: self._show_fit(m, e))
        self.status.setText(f"{len(self.models)} GGUF models. Pick one and Download."
                            if self.models else "This repository holds no GGUF file.")

    def _show_fit(self, model, fit) -> None:
        self.fits[model.name] = fit
        row = self._row_of(model.name)
        if row is None:
            return
        if isinstance(fit, BaseException):
            text = fit.message if isinstance(fit, EngineError) else str(fit)
            item = _item(f"cannot read the header: {text}")
        else:
            item = _item(fit_text(fit))
            item.setToolTip(f"Architecture: {fit.architecture or 'unknown'}\n{fit.note}")
            self.files.setItem(row, 1, _item(hub.quant_shown(model.quant, fit)))
        self.files.setItem(row, 3, item)

    def _row_of(self, name: str) -> int | None:
        for row in range(self.files.rowCount()):
            if self.files.item(row, 0).data(Qt.UserRole) == name:
                return row
        return None

    def selected_model(self):
        rows = self.files.selectionModel().selectedRows()
        if not rows:
            return None
        name = rows[0].data(Qt.UserRole)
        return next((m for m in self.models if m.name == name), None)

    def select_file(self, name: str) -> None:
        row = self._row_of(name)
        if row is not None:
            self.files.selectRow(row)

    def select_repo(self, repo_id: str) -> None:
        for row in range(self.results.rowCount()):
            if self.results.item(row, 0).data(Qt.UserRole) == repo_id:
                self.results.selectRow(row)

    def _file_selected(self) -> None:
        self.download_button.setEnabled(self.selected_model() is not None
                                        and self._cancel is None)

    # ---- download ------------------------------------------------------------------------
    def is_downloading(self) -> bool:
        return self._cancel is not None

    def download(self) -> None:
        model = self.selected_model()
        if model is None or self._cancel is not None:
            return
        self.error.hide()
        self._cancel = threading.Event()
        self._downloading = model
        self.download_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.bar.setRange(0, 1000)
        self.bar.setValue(0)
        self.bar.show()
        self.status.setText(f"Downloading {model.name} ({human_bytes(model.size)})\u2026")
        self._bg.run("download", hub.download, model, self._progress.changed.emit, self._cancel,
                     on_done=self._downloaded, on_error=self._download_failed)

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()
            self.cancel_button.setEnabled(False)
            self.status.setText("Cancelling\u2026")

    def _show_progress(self, done: int, total: int, name: str) -> None:
        self.bar.setValue(int(1000 * done / total) if total else 1000)
        self.bar.setFormat(f"{name}: {human_bytes(done)} of {human_bytes(total)}")

    def _end_download(self) -> None:
        self._cancel = None
        self.cancel_button.setEnabled(False)
        self._file_selected()

    def _downloaded(self, path) -> None:
        self.bar.setValue(1000)
        model = self._downloading
        if model is not None and model.is_split:    # one file to train: merged once, kept
            self.status.setText(f"Merging the {len(model.files)} parts of {model.name} into "
                                "one file to train\u2026")
            key = f"{model.repo_id.replace('/', '--')}/{path.parent.name}"
            self._bg.run("merge", trainable_path, path, key, on_done=self._ready,
                         on_error=self._download_failed)
            return
        self._ready(path)

    def _ready(self, path) -> None:
        self._end_download()
        self.status.setText(f"Downloaded: {path}")
        self.downloaded.emit(str(path))
        self.accept()

    def _download_failed(self, error: BaseException) -> None:
        self._end_download()
        self.bar.hide()
        if getattr(error, "kind", "") == "cancelled":
            self.status.setText(f"{error.message} {error.hint}")
            return
        self._fail("Download failed", error)

    def _fail(self, title: str, error: BaseException) -> None:
        self.status.setText("")
        if getattr(error, "kind", "") == "hub_offline":   # say what is here without the Hub
            cached = hub.cached_models()
            names = ", ".join(f"{c.repo_id}:{c.quant or c.name}" for c in cached[:5])
            self.status.setText(
                f"Offline. Downloaded before: {names}{', ...' if len(cached) > 5 else ''} "
                "(listed under On this computer)." if cached else
                "Offline, and no model was downloaded from the Hub before.")
        self.error.present(title, error)

    # Close hides the dialog and a running download goes on (Cancel stops it): the picker's
    # "Get a model..." shows it again, and when it ends the model opens as usual.
