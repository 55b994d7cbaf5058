"""Playground: the base model and the adapter side by side on the same prompt, streaming.

The adapter comes from the selected run (its final `adapter.gguf`, else its newest checkpoint
through the export API) or from a file. Generation runs in a QThread: the two continuations
are produced token by token in turn (same seed, same settings), so both columns fill together;
Stop cancels between tokens. Models and adapters are loaded in that thread and kept for the
next prompt.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from PySide6.QtCore import QThread, Qt, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QGridLayout,
                               QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton,
                               QSlider, QSpinBox, QSplitter, QVBoxLayout, QWidget)

from app.engine.api import (ConfigError, RunDir, chat_prompt_ids, generation_prompt_ids,
                            load_adapter, load_model, source_from_run)
from app.views.context import AppContext, sample_model_path
from app.views.error_panel import ErrorPanel

FROM_RUN, FROM_FILE, NO_ADAPTER = "run", "file", "none"


def run_adapter_source(run_dir: str) -> tuple[str, str | None]:
    """(model path, adapter file or None) of a run: its config's model and its final adapter."""
    run = RunDir(run_dir)
    model = str(run.config().get("model", ""))
    final = run.path / "adapter.gguf"
    return model, (str(final) if final.is_file() else None)


class _Cache:
    """Models and adapters loaded by the generation thread (one at a time)."""

    def __init__(self):
        self.models: dict[str, object] = {}
        self.adapters: dict[tuple, object] = {}

    def model(self, path: str):
        if path not in self.models:
            self.models.clear()                 # one model in memory at a time
            self.adapters.clear()
            self.models[path] = load_model(path)
        return self.models[path]

    def adapter(self, key: tuple, model):
        """key: ("file", path, mtime) or ("run", run_dir, newest checkpoint marker)."""
        if key not in self.adapters:
            if key[0] == "file":
                adapter = load_adapter(key[1])
            else:
                adapter = source_from_run(key[1], model_path=model.path).adapter
                if adapter is None:
                    raise ConfigError("The run trained the model in full: it has no adapter.",
                                      "Export it as a merged model and open that instead.")
            self.adapters = {key: adapter}
        return self.adapters[key]


class Generation(QThread):
    """Generates the base and the adapter continuations in turn; emits text as it grows."""

    text = Signal(str, str)          # "base" | "adapter", the whole text so far
    failed = Signal(object)
    loaded = Signal(str)             # a status line once the model and adapter are ready

    def __init__(self, cache: _Cache, request: dict, parent=None):
        super().__init__(parent)
        self.cache, self.request = cache, request
        self._stop = False
        self.tokens = {"base": 0, "adapter": 0}
        self.elapsed = 0.0

    def stop(self) -> None:
        self._stop = True

    def run(self) -> None:
        try:
            self._generate()
        except Exception as e:                  # noqa: BLE001 -- to the error funnel
            self.failed.emit(e)

    def _generate(self) -> None:
        r = self.request
        model = self.cache.model(r["model"])
        adapter = self.cache.adapter(r["adapter_key"], model) if r["adapter_key"] else None
        tok = model.tokenizer
        ids = (chat_prompt_ids(tok, r["prompt"]) if r["chat"]
               else generation_prompt_ids(tok, r["prompt"]))
        self.loaded.emit(f"{len(ids)} prompt tokens")
        sides = {"base": model.generate(ids, r["max_tokens"], r["temperature"], r["top_p"],
                                        r["seed"])}
        if adapter is not None:
            sides["adapter"] = model.generate(ids, r["max_tokens"], r["temperature"], r["top_p"],
                                              r["seed"], adapter, r["scale"])
        out = {k: [] for k in sides}
        t0 = time.perf_counter()
        while sides and not self._stop:
            for side in list(sides):
                try:
                    token = next(sides[side])
                except StopIteration:
                    del sides[side]
                    continue
                out[side].append(token)
                self.tokens[side] += 1
                text = tok.decode(out[side])
                if not text.endswith("\ufffd"):        # a multi-byte character is complete
                    self.text.emit(side, text)
                if self._stop:
                    break
        for side, ids_ in out.items():
            self.text.emit(side, tok.decode(ids_))
        self.elapsed = time.perf_counter() - t0


class PlaygroundView(QWidget):
    """Prompt, settings, base and adapter outputs side by side."""

    finished = Signal()

    def __init__(self, ctx: AppContext, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self._cache = _Cache()
        self._thread: Generation | None = None
        self._build()
        self._layout()
        self._connect()
        if ctx.current_run:
            self.follow_run(ctx.current_run)
        elif ctx.current_model or sample_model_path():
            self.model_field.setText(ctx.current_model or sample_model_path())
        self._update_adapter_label()

    def _build(self) -> None:
        self.error_panel = ErrorPanel(margins=0, closable=True)
        self.error_panel.hide()
        self.model_field = QLineEdit(placeholderText="base model .gguf")
        self._model_browse = QPushButton("Browse\u2026")
        self.source_box = QComboBox()
        self.source_box.addItem("Adapter of the selected run", FROM_RUN)
        self.source_box.addItem("Adapter file", FROM_FILE)
        self.source_box.addItem("No adapter (base only)", NO_ADAPTER)
        self.adapter_field = QLineEdit(placeholderText="adapter .gguf")
        self._adapter_browse = QPushButton("Browse\u2026")
        self.adapter_label = QLabel(objectName="hint", wordWrap=True, textFormat=Qt.PlainText)

        self.scale_slider = QSlider(Qt.Horizontal, minimum=0, maximum=200, value=100)
        self.scale_slider.setMinimumWidth(140)
        self.scale_slider.setToolTip("0 = base model, 1 = as trained, 2 = twice the update")
        self.scale_value = QLabel("1.00", minimumWidth=36)
        self.temperature = QDoubleSpinBox(minimum=0, maximum=5, value=0, decimals=2,
                                          singleStep=0.1)
        self.temperature.setSpecialValueText("0 (greedy)")
        self.top_p = QDoubleSpinBox(minimum=0.01, maximum=1, value=1, decimals=2, singleStep=0.05)
        self.max_tokens = QSpinBox(minimum=1, maximum=8192, value=64)
        self.seed = QSpinBox(minimum=0, maximum=2**31 - 1, value=0)
        self.chat_box = QCheckBox("Apply the model's chat template", checked=True)

        self.prompt = QPlainTextEdit(placeholderText="Type a prompt, then Generate "
                                                     "(Ctrl+Enter)")
        self.prompt.setPlainText("Tell me a story about Ben.")
        self.prompt.setMaximumHeight(90)
        self.generate_button = QPushButton("Generate", objectName="primaryButton")
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
        grid.addWidget(self.model_field, 0, 1, 1, 4)
        grid.addWidget(self._model_browse, 0, 5)
        grid.addWidget(QLabel("Adapter", objectName="formLabel"), 1, 0)
        grid.addWidget(self.source_box, 1, 1)
        grid.addWidget(self.adapter_field, 1, 2, 1, 3)
        grid.addWidget(self._adapter_browse, 1, 5)
        grid.addWidget(self.adapter_label, 2, 1, 1, 5)
        knobs = QHBoxLayout()
        for label, w in (("Adapter scale", self.scale_slider), ("", self.scale_value),
                         ("Temperature", self.temperature), ("Top-p", self.top_p),
                         ("Max tokens", self.max_tokens), ("Seed", self.seed)):
            if label:
                knobs.addWidget(QLabel(label, objectName="formLabel"))
            knobs.addWidget(w, 2 if w is self.scale_slider else 0)
        knobs.addWidget(self.chat_box)
        knobs.addStretch(1)

        prompt_row = QHBoxLayout()
        prompt_row.addWidget(self.prompt, 1)
        buttons = QVBoxLayout()
        buttons.addWidget(self.generate_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        prompt_row.addLayout(buttons)
        outputs = QSplitter(Qt.Horizontal)
        for title, view in ((self.base_title, self.base_output),
                            (self.adapter_title, self.adapter_output)):
            box = QWidget()
            bl = QVBoxLayout(box)
            bl.setContentsMargins(0, 0, 0, 0)
            bl.addWidget(title)
            bl.addWidget(view, 1)
            outputs.addWidget(box)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 12, 16, 12)
        layout.addWidget(self.error_panel)
        layout.addLayout(grid)
        layout.addLayout(knobs)
        layout.addLayout(prompt_row)
        layout.addWidget(outputs, 1)
        layout.addWidget(self.status_label)

    def _connect(self) -> None:
        self._model_browse.clicked.connect(self._browse_model)
        self.source_box.currentIndexChanged.connect(self._update_adapter_label)
        self.adapter_field.textChanged.connect(self._update_adapter_label)
        self._adapter_browse.clicked.connect(self._browse_adapter)
        self.scale_slider.valueChanged.connect(
            lambda v: self.scale_value.setText(f"{v / 100:.2f}"))
        self.generate_button.clicked.connect(self.generate)
        self.stop_button.clicked.connect(self.stop)
        QShortcut(QKeySequence("Ctrl+Return"), self, activated=self.generate)
        self.ctx.run_selected.connect(self.follow_run)
        self.ctx.model_selected.connect(self._follow_model)

    # ---------------------------------------------------------------- inputs
    def follow_run(self, run_dir: str) -> None:
        """Use the run's base model and adapter."""
        try:
            model, _ = run_adapter_source(run_dir)
        except Exception:                       # noqa: BLE001 -- not a run (yet): ignore
            return
        if model:
            self.model_field.setText(model)
        self.source_box.setCurrentIndex(self.source_box.findData(FROM_RUN))
        self._update_adapter_label()

    def _follow_model(self, path: str) -> None:
        if not self.ctx.current_run:
            self.model_field.setText(path)

    def showEvent(self, event) -> None:          # noqa: N802 -- Qt override
        super().showEvent(event)
        self._update_adapter_label()             # the run may have finished meanwhile

    def adapter_source(self) -> str:
        return self.source_box.currentData()

    def adapter_key(self) -> tuple | None:
        """What the generation loads as the adapter: ("file", path, mtime) or ("run", run_dir,
        what it has now) or None. Raises ConfigError when the choice cannot be used."""
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
        _, final = run_adapter_source(run)
        if final:
            return ("file", final, os.path.getmtime(final))
        ckpts = sorted(Path(run, "checkpoints").glob("step-*"), key=lambda p: p.stat().st_mtime)
        if not ckpts:
            raise ConfigError("The selected run has no adapter yet.",
                              "Wait for its first checkpoint, or choose an adapter file.")
        return ("run", run, ckpts[-1].name)

    def _update_adapter_label(self) -> None:
        source = self.adapter_source()
        self.adapter_field.setEnabled(source == FROM_FILE)
        try:
            key = self.adapter_key()
        except Exception as e:                  # noqa: BLE001 -- shown as a hint
            self.adapter_label.setText(getattr(e, "message", str(e)))
            return
        if key is None:
            self.adapter_label.setText("Only the base model generates.")
        elif key[0] == "file":
            self.adapter_label.setText(f"Adapter: {key[1]}")
        else:
            self.adapter_label.setText(f"Adapter: the newest checkpoint of {Path(key[1]).name} "
                                       f"({key[2]})")

    def _browse_model(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Base model", self.model_field.text(),
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.model_field.setText(path)

    def _browse_adapter(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "LoRA adapter", self.adapter_field.text(),
                                              "GGUF adapters (*.gguf);;All files (*)")
        if path:
            self.adapter_field.setText(path)
            self.source_box.setCurrentIndex(self.source_box.findData(FROM_FILE))

    # ---------------------------------------------------------------- generation
    def is_generating(self) -> bool:
        return self._thread is not None

    def generate(self) -> None:
        if self._thread is not None:
            return
        self.error_panel.hide()
        try:
            model = os.path.expanduser(self.model_field.text().strip())
            if not os.path.isfile(model):
                raise ConfigError(f"There is no model file {model or '(none chosen)'}.",
                                  "Choose the base GGUF model.")
            key = self.adapter_key()
        except Exception as e:                  # noqa: BLE001
            self.error_panel.present("Cannot generate yet", e)
            return
        request = {"model": model, "adapter_key": key, "prompt": self.prompt.toPlainText(),
                   "chat": self.chat_box.isChecked(), "max_tokens": self.max_tokens.value(),
                   "temperature": self.temperature.value(), "top_p": self.top_p.value(),
                   "seed": self.seed.value(), "scale": self.scale_slider.value() / 100}
        self.base_output.clear()
        self.adapter_output.clear()
        self.adapter_title.setText("With the adapter" + (f" (scale {request['scale']:.2f})"
                                                         if key else ": none"))
        self.status_label.setText("Loading the model\u2026")
        thread = Generation(self._cache, request, self)
        thread.text.connect(self._on_text)
        thread.loaded.connect(lambda s: self.status_label.setText(f"Generating \u2026 ({s})"))
        thread.failed.connect(lambda e: self.error_panel.present("Generation failed", e))
        thread.finished.connect(self._on_finished)
        self._thread = thread
        self.generate_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self.status_label.setText("Stopping\u2026")

    def _on_text(self, side: str, text: str) -> None:
        view = self.base_output if side == "base" else self.adapter_output
        view.setPlainText(text)
        view.moveCursor(view.textCursor().MoveOperation.End)

    def _on_finished(self) -> None:
        thread, self._thread = self._thread, None
        self.generate_button.setEnabled(True)
        self.stop_button.setEnabled(False)
        if thread is not None:
            n = sum(thread.tokens.values())
            rate = n / thread.elapsed if thread.elapsed else 0.0
            stopped = " (stopped)" if thread._stop else ""
            self.status_label.setText(f"{thread.tokens['base']} base and {thread.tokens['adapter']}"
                                      f" adapter tokens, {rate:.1f} tokens/s{stopped}")
            thread.deleteLater()
        self.finished.emit()

    def shutdown(self, timeout_ms: int = 5000) -> None:
        """Stop a running generation and wait for its thread (closing the window)."""
        if self._thread is not None:
            self._thread.stop()
            self._thread.wait(timeout_ms)
