"""Playground: a multi-turn chat with the base model and the adapter, side by side or one alone.

The adapter is one of the selected run's kept checkpoints (its best by default, named with its
step), its final adapter, an adapter file, or none. Each message is answered by both sides in a
QThread (`chat.Reply`: same seed and settings, token by token in turn); each side keeps its own
history. The conversation is cleared when the run or the adapter changes (its answers would be
another adapter's), and by Clear.
"""

from __future__ import annotations

import os

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeySequence, QShortcut, QTextCharFormat
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout,
                               QGridLayout, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit,
                               QPushButton, QSlider, QSpinBox, QSplitter, QVBoxLayout, QWidget)

from app.engine.api import ConfigError, RunDir
from app.views.context import AppContext, sample_model_path
from app.views.playground.chat import SIDES, ModelCache, Reply, transcript
from app.views.widgets.error_panel import ErrorPanel
from app.views.widgets.run_best import FINAL, checkpoint_choices, choice_step
from app.views.widgets.tooltips import PLAYGROUND_TIPS

FROM_RUN, FROM_FILE, NO_ADAPTER = "run", "file", "none"
VIEWS = (("both", "Side by side"), ("adapter", "Adapter only"), ("base", "Base only"))


class PlaygroundView(QWidget):
    """Adapter choice, sampling settings, the two conversations and the message box."""

    finished = Signal()

    def __init__(self, ctx: AppContext, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self._cache = ModelCache()
        self._thread: Reply | None = None
        self.histories: dict[str, list[dict]] = {side: [] for side in SIDES}
        self._build()
        self._layout()
        for name, text in PLAYGROUND_TIPS.items():
            getattr(self, name).setToolTip(text)
        self._connect()
        if ctx.current_run:
            self.follow_run(ctx.current_run)
        elif ctx.current_model or sample_model_path():
            self.model_field.setText(ctx.current_model or sample_model_path())
        self._adapter_changed()

    def _build(self) -> None:
        self.error_panel = ErrorPanel(margins=0, closable=True)
        self.error_panel.hide()
        self.model_field = QLineEdit(placeholderText="base model .gguf")
        self._model_browse = QPushButton("Browse\u2026")
        self.source_box = QComboBox()
        for text, key in (("A checkpoint of the selected run", FROM_RUN),
                          ("Adapter file", FROM_FILE), ("No adapter (base only)", NO_ADAPTER)):
            self.source_box.addItem(text, key)
        self.checkpoint_box = QComboBox()
        self.adapter_field = QLineEdit(placeholderText="adapter .gguf")
        self._adapter_browse = QPushButton("Browse\u2026")
        self.adapter_label = QLabel(objectName="hint", wordWrap=True, textFormat=Qt.PlainText)

        self.system_prompt = QPlainTextEdit(placeholderText="System prompt (optional)")
        self.system_prompt.setMaximumHeight(70)
        self.view_box = QComboBox()
        for key, text in VIEWS:
            self.view_box.addItem(text, key)
        self.scale_slider = QSlider(Qt.Horizontal, minimum=0, maximum=200, value=100)
        self.scale_value = QLabel("1.00", minimumWidth=36)
        self.temperature = QDoubleSpinBox(minimum=0, maximum=5, value=0, decimals=2,
                                          singleStep=0.1, specialValueText="0 (greedy)")
        self.top_p = QDoubleSpinBox(minimum=0.01, maximum=1, value=1, decimals=2, singleStep=0.05)
        self.max_tokens = QSpinBox(minimum=1, maximum=8192, value=64)
        self.seed = QSpinBox(minimum=0, maximum=2**31 - 1, value=0)
        self.chat_box = QCheckBox("Chat template", checked=True)
        self.stop_box = QCheckBox("Stop at end of turn", checked=True)
        self.clear_button = QPushButton("Clear conversation")

        self.message = QPlainTextEdit(placeholderText="Type a message, then Send (Ctrl+Enter)")
        self.message.setPlainText("Tell me a story about Ben.")
        self.message.setMaximumHeight(70)
        self.send_button = QPushButton("Send", objectName="primaryButton")
        self.stop_button = QPushButton("Stop", enabled=False)
        self.base_title = QLabel("Base model", objectName="sectionHeader")
        self.adapter_title = QLabel("With the adapter", objectName="sectionHeader")
        self.base_output = QPlainTextEdit(readOnly=True, objectName="outputView")
        self.adapter_output = QPlainTextEdit(readOnly=True, objectName="outputView")
        self.status_label = QLabel(objectName="hint", textFormat=Qt.PlainText)

    def _layout(self) -> None:
        grid = QGridLayout()
        grid.setHorizontalSpacing(10)
        grid.addWidget(QLabel("Model", objectName="formLabel"), 0, 0)
        grid.addWidget(self.model_field, 0, 1, 1, 2)
        grid.addWidget(self._model_browse, 0, 3)
        grid.addWidget(QLabel("Adapter", objectName="formLabel"), 1, 0)
        grid.addWidget(self.source_box, 1, 1)
        grid.addWidget(self.checkpoint_box, 1, 2)
        grid.addWidget(self.adapter_field, 1, 2)
        grid.addWidget(self._adapter_browse, 1, 3)
        grid.addWidget(self.adapter_label, 2, 1, 1, 3)
        grid.setColumnStretch(2, 1)

        settings = QWidget(maximumWidth=300)
        column = QVBoxLayout(settings)
        column.setContentsMargins(0, 0, 8, 0)
        form = QFormLayout()
        column.addLayout(form)
        column.addStretch(1)                     # the rows keep their height
        scale = QHBoxLayout()
        scale.addWidget(self.scale_slider, 1)
        scale.addWidget(self.scale_value)
        form.addRow(self.system_prompt)
        for label, item in (("Show", self.view_box), ("Adapter scale", scale),
                            ("Temperature", self.temperature), ("Top-p", self.top_p),
                            ("Max tokens", self.max_tokens), ("Seed", self.seed)):
            form.addRow(QLabel(label, objectName="formLabel"), item)
        for w in (self.chat_box, self.stop_box, self.clear_button):
            form.addRow(w)

        outputs = QSplitter(Qt.Horizontal)
        self._panes = {}
        for side, title, view in (("base", self.base_title, self.base_output),
                                  ("adapter", self.adapter_title, self.adapter_output)):
            pane = QWidget()
            pl = QVBoxLayout(pane)
            pl.setContentsMargins(0, 0, 0, 0)
            pl.addWidget(title)
            pl.addWidget(view, 1)
            outputs.addWidget(pane)
            self._panes[side] = pane
        send = QVBoxLayout()
        send.addWidget(self.send_button)
        send.addWidget(self.stop_button)
        message_row = QHBoxLayout()
        message_row.addWidget(self.message, 1)
        message_row.addLayout(send)
        chat = QVBoxLayout()
        chat.addWidget(outputs, 1)
        chat.addLayout(message_row)
        chat.addWidget(self.status_label)
        body = QHBoxLayout()
        body.addWidget(settings)
        body.addLayout(chat, 1)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 12, 16, 12)
        layout.addWidget(self.error_panel)
        layout.addLayout(grid)
        layout.addLayout(body, 1)

    def _connect(self) -> None:
        self._model_browse.clicked.connect(self._browse_model)
        self.model_field.editingFinished.connect(self.clear)
        self.source_box.currentIndexChanged.connect(self._adapter_changed)
        self.checkpoint_box.currentIndexChanged.connect(self._adapter_changed)
        self.adapter_field.editingFinished.connect(self._adapter_changed)
        self._adapter_browse.clicked.connect(self._browse_adapter)
        self.scale_slider.valueChanged.connect(
            lambda v: self.scale_value.setText(f"{v / 100:.2f}"))
        self.view_box.currentIndexChanged.connect(self._show_panes)
        self.clear_button.clicked.connect(self.clear)
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(self.stop)
        QShortcut(QKeySequence("Ctrl+Return"), self, activated=self.send)
        self.ctx.run_selected.connect(self.follow_run)
        self.ctx.model_selected.connect(self._follow_model)

    # ---------------------------------------------------------------- inputs
    def follow_run(self, run_dir: str) -> None:
        """Use the run's base model and its best checkpoint; a new conversation."""
        try:
            model = str(RunDir(run_dir).config().get("model", ""))
        except Exception:                       # noqa: BLE001 -- not a run (yet): ignore
            return
        if model:
            self.model_field.setText(model)
        self._fill_checkpoints(keep=False)
        self.source_box.setCurrentIndex(self.source_box.findData(FROM_RUN))
        self._adapter_changed()

    def _follow_model(self, path: str) -> None:
        if not self.ctx.current_run:
            self.model_field.setText(path)

    def showEvent(self, event) -> None:          # noqa: N802 -- Qt override
        super().showEvent(event)
        self._fill_checkpoints(keep=True)        # the run may have saved new ones meanwhile

    def _fill_checkpoints(self, keep: bool) -> None:
        box = self.checkpoint_box
        current = box.currentData() if keep else None
        box.blockSignals(True)
        box.clear()
        for data, label in checkpoint_choices(self.ctx.current_run or ""):
            box.addItem(label, data)             # the best first
        box.setCurrentIndex(max(box.findData(current), 0))
        box.blockSignals(False)
        self._update_adapter_label()

    def adapter_source(self) -> str:
        return self.source_box.currentData()

    def adapter_key(self) -> tuple | None:
        """What the conversation loads as the adapter: ("file", path, mtime), ("run", run_dir,
        step) or None. Raises ConfigError when the choice cannot be used."""
        source = self.adapter_source()
        if source == NO_ADAPTER:
            return None
        if source == FROM_FILE:
            path = os.path.expanduser(self.adapter_field.text().strip())
            if not os.path.isfile(path):
                raise ConfigError(f"There is no adapter file {path or '(none chosen)'}.",
                                  "Choose a GGUF LoRA adapter, or use the selected run's.")
            return ("file", path, os.path.getmtime(path))
        run = self.ctx.current_run
        if not run:
            raise ConfigError("No run is selected.",
                              "Select a run in Runs, or choose an adapter file.")
        choice = self.checkpoint_box.currentData()
        if choice is None:
            raise ConfigError("The selected run has no adapter yet.",
                              "Wait for its first checkpoint, or choose an adapter file.")
        if choice == FINAL:
            final = os.path.join(run, "adapter.gguf")
            return ("file", final, os.path.getmtime(final))
        return ("run", run, choice_step(run, choice))

    def _adapter_changed(self, *_) -> None:
        """Another adapter: the answers so far were not its own."""
        self.clear()
        self._update_adapter_label()

    def _update_adapter_label(self) -> None:
        source = self.adapter_source()
        self.adapter_field.setVisible(source == FROM_FILE)
        self._adapter_browse.setVisible(source == FROM_FILE)
        self.checkpoint_box.setVisible(source == FROM_RUN)
        try:
            key = self.adapter_key()
        except Exception as e:                  # noqa: BLE001 -- shown as a hint
            self.adapter_label.setText(getattr(e, "message", str(e)))
            return
        if key is None:
            self.adapter_label.setText("Only the base model answers.")
        elif source == FROM_RUN:
            run = os.path.basename(self.ctx.current_run.rstrip(os.sep))
            self.adapter_label.setText(f"Adapter: {self.checkpoint_box.currentText()} of {run}")
        else:
            self.adapter_label.setText(f"Adapter: {key[1]}")

    def _browse_model(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Base model", self.model_field.text(),
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.model_field.setText(path)
            self.clear()

    def _browse_adapter(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "LoRA adapter", self.adapter_field.text(),
                                              "GGUF adapters (*.gguf);;All files (*)")
        if path:
            self.adapter_field.setText(path)
            self.source_box.setCurrentIndex(self.source_box.findData(FROM_FILE))
            self._adapter_changed()

    def _show_panes(self, *_) -> None:
        shown = self.view_box.currentData()
        for side, pane in self._panes.items():
            pane.setVisible(shown in ("both", side))

    def sides(self) -> list[str]:
        """The sides that answer: those shown, the adapter's only with an adapter."""
        shown = self.view_box.currentData()
        return [s for s in SIDES if shown in ("both", s)
                and (s == "base" or self.adapter_source() != NO_ADAPTER)]

    # ---------------------------------------------------------------- the conversation
    def is_generating(self) -> bool:
        return self._thread is not None

    def clear(self) -> None:
        """Forget the conversation (a running answer is stopped and dropped)."""
        if self._thread is not None:
            self._thread.stop()
            self._thread.wait(5000)
        self.histories = {side: [] for side in SIDES}
        self.base_output.clear()
        self.adapter_output.clear()

    def send(self) -> None:
        """Add the message to each side's history and answer it."""
        if self._thread is not None:
            return
        self.error_panel.hide()
        text = self.message.toPlainText().strip()
        try:
            model = os.path.expanduser(self.model_field.text().strip())
            if not os.path.isfile(model):
                raise ConfigError(f"There is no model file {model or '(none chosen)'}.",
                                  "Choose the base GGUF model.")
            key = self.adapter_key()
            if not text:
                raise ConfigError("Type a message first.")
            if not self.sides():
                raise ConfigError("There is no adapter to show.",
                                  "Choose an adapter, or show the base model.")
        except Exception as e:                  # noqa: BLE001
            self.error_panel.present("Cannot answer yet", e)
            return
        sides = self.sides()
        for side in sides:
            self.histories[side].append({"role": "user", "content": text})
        request = {"model": model, "adapter_key": key if "adapter" in sides else None,
                   "histories": {s: self.histories[s] for s in sides},
                   "system": self.system_prompt.toPlainText(), "chat": self.chat_box.isChecked(),
                   "stop_eos": self.stop_box.isChecked(), "max_tokens": self.max_tokens.value(),
                   "temperature": self.temperature.value(), "top_p": self.top_p.value(),
                   "seed": self.seed.value(), "scale": self.scale_slider.value() / 100}
        self.adapter_title.setText("With the adapter" + (f" (scale {request['scale']:.2f})"
                                                         if key else ": none"))
        for side in sides:
            self._on_text(side, "")
        self.status_label.setText("Loading the model\u2026")
        thread = Reply(self._cache, request, self)
        thread.text.connect(self._on_text)
        thread.loaded.connect(lambda s: self.status_label.setText(f"Answering \u2026 ({s})"))
        thread.failed.connect(lambda e: self.error_panel.present("Generation failed", e))
        thread.finished.connect(self._on_finished)
        self._thread = thread
        self.send_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self.message.clear()
        thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self.status_label.setText("Stopping\u2026")

    def _view(self, side: str) -> QPlainTextEdit:
        return self.base_output if side == "base" else self.adapter_output

    def _on_text(self, side: str, text: str) -> None:
        view = self._view(side)
        view.setPlainText(transcript(self.histories[side], text))
        view.moveCursor(view.textCursor().MoveOperation.End)

    def _on_finished(self) -> None:
        thread, self._thread = self._thread, None
        self.send_button.setEnabled(True)
        self.stop_button.setEnabled(False)
        if thread is None:
            return
        for side in thread.request["histories"]:
            if side not in thread.answers and self.histories[side]:
                self.histories[side].pop()        # failed: the question goes unanswered
        for side, answer in thread.answers.items():
            if self.histories[side]:             # not cleared meanwhile
                self.histories[side].append({"role": "assistant", "content": answer})
                self._view(side).setPlainText(transcript(self.histories[side]))
                if thread.tokens[side] >= thread.request["max_tokens"] and not thread.stopped():
                    self._mark_cut(side, thread.request["max_tokens"])
        n = sum(thread.tokens.values())
        rate = n / thread.elapsed if thread.elapsed else 0.0
        counts = " and ".join(f"{n_} {side}" for side, n_ in thread.tokens.items())
        stopped = " (stopped)" if thread.stopped() else ""
        self.status_label.setText(f"{counts} tokens, {rate:.1f} tokens/s{stopped}")
        thread.deleteLater()
        self.finished.emit()

    def _mark_cut(self, side: str, limit: int) -> None:
        """A muted mark after an answer cut at Max tokens. The engine does not yield the stop
        token, so an answer of `limit` tokens ended at the limit, not on end-of-sequence. The
        mark is in the pane only, never in the history sent back; the next turn redraws the
        pane without it."""
        fmt = QTextCharFormat()
        fmt.setForeground(self._view(side).palette().placeholderText())
        fmt.setFontItalic(True)
        cursor = self._view(side).textCursor()
        cursor.movePosition(cursor.MoveOperation.End)
        cursor.insertText(f" \u2026 [stopped at {limit} tokens: raise Max tokens to see more]",
                          fmt)

    def shutdown(self, timeout_ms: int = 5000) -> None:
        """Stop a running answer and wait for its thread (closing the window)."""
        if self._thread is not None:
            self._thread.stop()
            self._thread.wait(timeout_ms)
