"""Export: turn a run (or an adapter file) into what llama.cpp, Ollama or PEFT load, verified.

Source: the selected run (its best checkpoint by default, any kept step, or its final
adapter.gguf) or an adapter file with its base model. Format (GGUF LoRA, merged GGUF, PEFT, Ollama), tensor type,
scale, destination. The export runs off the GUI thread (`app.engine.export.exporter.export`); its
verification report is shown check by check, flagged in red when a check failed, with the
command that loads the result. An export that would replace an existing output asks first;
one whose output is one of its inputs is refused (the engine's rule, in the error panel).
Perplexity on a text file (chunked as llama-perplexity) compares the base model, base +
adapter and the last merged export (`compare_perplexity`), off the GUI thread too.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QAbstractItemView, QCheckBox, QComboBox, QDoubleSpinBox,
                               QFileDialog, QGridLayout, QHBoxLayout, QHeaderView, QLabel,
                               QLineEdit, QMessageBox, QPlainTextEdit, QProgressBar,
                               QPushButton, QSpinBox, QTableWidget, QTableWidgetItem, QVBoxLayout,
                               QWidget)

from app.engine.api import (ConfigError, ExportTargetExists, RunDir, compare_perplexity, export,
                            source_from_adapter, source_from_run)
from app.views.context import AppContext, Background
from app.views.widgets.error_panel import ErrorPanel
from app.views.widgets.run_best import FINAL, checkpoint_choices, choice_step
from app.views.widgets.tooltips import EXPORT_TIPS

FORMAT_LABELS = {"gguf-lora": "GGUF LoRA adapter (llama.cpp --lora)",
                 "merged": "Merged GGUF model (base + adapter)",
                 "peft": "PEFT adapter (Hugging Face safetensors)",
                 "ollama": "Ollama (Modelfile + adapter)"}
TYPES = {"gguf-lora": ("f32", "f16", "bf16", "q8_0"), "peft": ("f32", "f16"),
         "ollama": ("f32", "f16", "bf16", "q8_0"), "merged": ("f16", "f32", "bf16", "q8_0")}
NEWEST = "newest"                  # no choice listed (no checkpoint yet): the newest one
MARKS = {True: "\u2713 ok", False: "\u2717 FAILED", None: "\u2013 skipped"}


def export_source(spec: dict):
    """The ExportSource `spec` names (in a worker thread: it reads the checkpoint)."""
    if spec["source"] == "run":
        run, which = spec["run_dir"], spec["checkpoint"]
        if which == FINAL:
            model = RunDir(run).config().get("model", "")
            source = source_from_adapter(os.path.join(run, "adapter.gguf"), model)
            source.run_dir = run
        else:
            source = source_from_run(run, step=None if which == NEWEST
                                     else choice_step(run, which))
    else:
        source = source_from_adapter(spec["adapter"], spec["model"])
    return source


def do_export(spec: dict):
    """Build the export source from `spec` and export it (runs in a worker thread)."""
    return export(export_source(spec), spec["format"], spec["out"] or None,
                  adapter_type=spec["type"], scale=spec["scale"],
                  llamacpp=None if spec["llamacpp"] else False, overwrite=spec["overwrite"])


def do_perplexity(spec: dict, text: str, n_ctx: int, merged: str | None):
    """Perplexity of base, base + adapter and the merged export (runs in a worker thread)."""
    return compare_perplexity(export_source(spec), text, n_ctx, merged)


def merged_path(report) -> str | None:
    """The merged model an export wrote, if any (a merged export, or Ollama's model.gguf)."""
    if report is None or report.format not in ("merged", "ollama"):
        return None
    model = report.path if report.format == "merged" else os.path.join(report.path, "model.gguf")
    return model if model in report.files else None


def usage_command(report, model_path: str) -> str:
    """How to load the export."""
    out = report.path
    if report.format == "gguf-lora":
        return f"llama-cli -m {shlex.quote(model_path)} --lora {shlex.quote(out)}"
    if report.format == "merged":
        return f"llama-cli -m {shlex.quote(out)}"
    if report.format == "ollama":
        return f"ollama create my-finetune -f {shlex.quote(os.path.join(out, 'Modelfile'))}"
    return (f"PeftModel.from_pretrained(base_model, {out!r})   # peft; base: the Hugging Face "
            "model the GGUF was converted from")


class ExportView(QWidget):
    """The Export screen. `report` is the last verification report (ExportReport)."""

    export_finished = Signal(object)     # ExportReport, or the exception (ExportTargetExists
                                         # when the user kept the existing output)

    def __init__(self, ctx: AppContext, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.report = None
        self.run_dir = ""
        self._bg = Background(self, max_threads=1)
        self._build()
        self._layout()
        self._connect()
        self.follow_run(ctx.current_run or "")
        self._update_fields()

    def _build(self) -> None:
        self.error_panel = ErrorPanel(margins=0, closable=True)
        self.error_panel.hide()
        self.source_box = QComboBox()
        self.source_box.addItem("The selected run", "run")
        self.source_box.addItem("An adapter file and its base model", "file")
        self.run_label = QLabel(textFormat=Qt.PlainText, wordWrap=True)
        self.checkpoint_box = QComboBox()
        self.adapter_field = QLineEdit(placeholderText="adapter .gguf or PEFT folder")
        self.model_field = QLineEdit(placeholderText="base model .gguf")
        self._adapter_browse = QPushButton("Browse\u2026")
        self._model_browse = QPushButton("Browse\u2026")
        self.format_box = QComboBox()
        for key, label in FORMAT_LABELS.items():
            self.format_box.addItem(label, key)
        self.type_box = QComboBox()
        self.scale = QDoubleSpinBox(minimum=0.01, maximum=10, value=1.0, decimals=2,
                                    singleStep=0.1)
        self.out_field = QLineEdit()
        self._out_browse = QPushButton("Browse\u2026")
        self.llamacpp_box = QCheckBox("Also compare with llama.cpp when llama-cpp-python is "
                                      "installed", checked=True)
        self.export_button = QPushButton("Export", objectName="primaryButton")
        self.busy = QProgressBar(textVisible=False, maximumWidth=160, maximumHeight=6)
        self.busy.setRange(0, 0)
        self.busy.hide()

        self.badge = QLabel(objectName="reportBadge")
        self.badge.hide()
        self.report_title = QLabel(objectName="sectionHeader", wordWrap=True,
                                   textFormat=Qt.PlainText)
        self.checks_table = QTableWidget(0, 3)
        self.checks_table.setHorizontalHeaderLabels(["result", "check", "detail"])
        self.checks_table.verticalHeader().hide()
        self.checks_table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.checks_table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeToContents)
        self.checks_table.horizontalHeader().setSectionResizeMode(1, QHeaderView.ResizeToContents)
        self.checks_table.horizontalHeader().setStretchLastSection(True)
        self.report_text = QPlainTextEdit(readOnly=True, objectName="reportText")
        self.report_text.setMaximumHeight(130)
        self.open_folder = QPushButton("Open folder")
        self.open_folder.setEnabled(False)
        self.text_field = QLineEdit(placeholderText="a UTF-8 text file (not training data)")
        self.text_field.setToolTip("Perplexity on this text, chunked as llama-perplexity -c N "
                                   "does (workbench eval): base, base + adapter, merged.")
        self._text_browse = QPushButton("Browse\u2026")
        self.ctx_box = QSpinBox(minimum=16, maximum=32768, value=512, singleStep=64,
                                prefix="ctx ")
        self.ctx_box.setToolTip("Tokens per chunk (llama-perplexity -c); the second half of "
                                "each chunk is scored.")
        self.eval_button = QPushButton("Perplexity")
        self.eval_button.setToolTip("Measure base, base + adapter and the last merged export on "
                                    "the text (a few seconds per chunk on a small model).")
        self.eval_label = QLabel(textFormat=Qt.PlainText, wordWrap=True)

    def _layout(self) -> None:
        g = QGridLayout()
        g.setHorizontalSpacing(10)
        rows = [("Source", [self.source_box]), ("Run", [self.run_label]),
                ("Checkpoint", [self.checkpoint_box]),
                ("Adapter", [self.adapter_field, self._adapter_browse]),
                ("Base model", [self.model_field, self._model_browse]),
                ("Format", [self.format_box]), ("Tensor type", [self.type_box]),
                ("Scale", [self.scale]),
                ("Destination", [self.out_field, self._out_browse]), ("", [self.llamacpp_box])]
        self._rows: dict[str, list[QWidget]] = {}
        for r, (label, widgets) in enumerate(rows):
            name = QLabel(label, objectName="formLabel")
            g.addWidget(name, r, 0)
            for c, w in enumerate(widgets):
                g.addWidget(w, r, 1 + c, 1, 1 if len(widgets) > 1 or c else 2)
            self._rows[label] = [name, *widgets]
            for w in self._rows[label]:
                w.setToolTip(EXPORT_TIPS[label])
        g.setColumnStretch(1, 1)
        actions = QHBoxLayout()
        actions.addWidget(self.export_button)
        actions.addWidget(self.busy)
        actions.addStretch(1)
        head = QHBoxLayout()
        head.addWidget(self.badge)
        head.addWidget(self.report_title, 1)
        head.addWidget(self.open_folder)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 12, 16, 12)
        layout.addWidget(self.error_panel)
        form = QWidget(maximumWidth=860)
        form.setLayout(g)
        g.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(form)
        layout.addLayout(actions)
        layout.addSpacing(6)
        layout.addLayout(head)
        layout.addWidget(self.checks_table, 1)
        layout.addWidget(self.report_text)
        evaluate = QHBoxLayout()
        evaluate.addWidget(QLabel("Evaluate on", objectName="formLabel"))
        evaluate.addWidget(self.text_field, 1)
        evaluate.addWidget(self._text_browse)
        evaluate.addWidget(self.ctx_box)
        evaluate.addWidget(self.eval_button)
        layout.addLayout(evaluate)
        layout.addWidget(self.eval_label)

    def _connect(self) -> None:
        self.source_box.currentIndexChanged.connect(self._update_fields)
        self._adapter_browse.clicked.connect(
            lambda: self._browse(self.adapter_field, "LoRA adapter"))
        self._model_browse.clicked.connect(lambda: self._browse(self.model_field, "Base model"))
        self.format_box.currentIndexChanged.connect(self._update_fields)
        self.type_box.currentIndexChanged.connect(self._update_placeholder)
        self._out_browse.clicked.connect(self._browse_out)
        self.export_button.clicked.connect(self.start_export)
        self.open_folder.clicked.connect(self._open_folder)
        self._text_browse.clicked.connect(self._browse_text)
        self.eval_button.clicked.connect(self.start_perplexity)
        self.ctx.run_selected.connect(self.follow_run)
        self.ctx.model_selected.connect(
            lambda p: self.model_field.text() or self.model_field.setText(p))

    # ---------------------------------------------------------------- inputs
    def follow_run(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.run_label.setText(run_dir or "No run selected: pick one in Runs, or export an "
                                          "adapter file.")
        self.checkpoint_box.clear()              # another run: its best checkpoint again
        self._fill_checkpoints()
        if not run_dir and self.source_box.currentData() == "run":
            self.source_box.setCurrentIndex(self.source_box.findData("file"))
        elif run_dir:
            self.source_box.setCurrentIndex(self.source_box.findData("run"))
        self._update_fields()

    def _fill_checkpoints(self) -> None:
        box = self.checkpoint_box
        current = box.currentData()
        box.clear()
        if not self.run_dir:
            return
        for data, label in checkpoint_choices(self.run_dir):     # the best first
            box.addItem(label, data)
        i = box.findData(current)
        box.setCurrentIndex(max(i, 0))

    def showEvent(self, event) -> None:          # noqa: N802 -- Qt override
        super().showEvent(event)
        self._fill_checkpoints()                 # the run may have saved new ones

    def _update_fields(self, *_):
        fmt = self.format_box.currentData()
        from_run = self.source_box.currentData() == "run"
        for label, visible in (("Run", from_run), ("Checkpoint", from_run),
                               ("Adapter", not from_run), ("Base model", not from_run),
                               ("Tensor type", bool(TYPES[fmt]))):
            for w in self._rows[label]:
                w.setVisible(visible)
        current = self.type_box.currentData()
        self.type_box.clear()
        for t in TYPES[fmt]:
            self.type_box.addItem(t, t)
        i = self.type_box.findData(current)
        self.type_box.setCurrentIndex(max(i, 0))
        self._update_placeholder()

    def _update_placeholder(self, *_):
        fmt = self.format_box.currentData()
        from_run = self.source_box.currentData() == "run"
        names = {"gguf-lora": f"adapter-{self.type_box.currentData() or 'f32'}.gguf",
                 "merged": "merged.gguf", "peft": "peft", "ollama": "ollama"}
        self.out_field.setPlaceholderText(
            f"default: {os.path.join(self.run_dir, 'exports', names[fmt])}"
            if from_run and self.run_dir else "where to write the export")

    def spec(self) -> dict:
        return {"source": self.source_box.currentData(), "run_dir": self.run_dir,
                "checkpoint": self.checkpoint_box.currentData() or NEWEST,
                "adapter": os.path.expanduser(self.adapter_field.text().strip()),
                "model": os.path.expanduser(self.model_field.text().strip()),
                "format": self.format_box.currentData(),
                "type": self.type_box.currentData() or "f32", "scale": self.scale.value(),
                "out": os.path.expanduser(self.out_field.text().strip()),
                "llamacpp": self.llamacpp_box.isChecked(), "overwrite": False}

    def set_format(self, fmt: str, adapter_type: str | None = None) -> None:
        self.format_box.setCurrentIndex(self.format_box.findData(fmt))
        if adapter_type:
            self.type_box.setCurrentIndex(self.type_box.findData(adapter_type))

    # ---------------------------------------------------------------- exporting
    def is_busy(self) -> bool:
        return self._bg.busy("export")

    def start_export(self) -> None:
        spec = self.spec()
        self.error_panel.hide()
        problem = None
        if spec["source"] == "run" and not spec["run_dir"]:
            problem = ConfigError("No run is selected.", "Pick a run in Runs first.")
        elif spec["source"] == "file" and not (spec["adapter"] and spec["model"]):
            problem = ConfigError("Choose the adapter and its base model.")
        elif not spec["out"] and spec["source"] == "file":
            problem = ConfigError("Choose where to write the export (Destination).")
        if problem is not None:
            self.error_panel.present("Cannot export yet", problem)
            return
        self._run_export(spec)

    def _run_export(self, spec: dict) -> None:
        self.export_button.setEnabled(False)
        self.busy.show()
        self.report_title.setText("Exporting and verifying\u2026")
        self._bg.run("export", do_export, spec, on_done=self._on_report,
                     on_error=lambda error: self._on_error(error, spec))

    def _on_error(self, error: BaseException, spec: dict) -> None:
        kept = isinstance(error, ExportTargetExists)    # the engine checked before writing
        if kept and self._confirm_replace(error.path):
            self._run_export(dict(spec, overwrite=True))
            return
        self.export_button.setEnabled(True)
        self.busy.hide()
        self.report_title.setText("")
        if kept:
            self.ctx.status(f"Export cancelled: {error.path} kept")
        else:
            self.error_panel.present("The export failed", error)
        self.export_finished.emit(error)

    def _confirm_replace(self, path: Path) -> bool:
        what = "folder" if path.is_dir() else "file"
        return QMessageBox.question(
            self, "Replace the export", f"Replace {path}?\n\nThe {what} exists already; the "
            "new export takes its place.",
            QMessageBox.Yes | QMessageBox.No, QMessageBox.No) == QMessageBox.Yes

    def _on_report(self, report) -> None:
        self.export_button.setEnabled(True)
        self.busy.hide()
        self.report = report
        self.badge.setText("VERIFIED" if report.ok else "FAILED VERIFICATION")
        self.badge.setProperty("ok", "true" if report.ok else "false")
        self.badge.style().polish(self.badge)
        self.badge.show()
        diff = report.max_abs_logit_diff
        self.report_title.setText(
            f"{report.format}: {report.path}" + (f"  \u00b7  max |logit diff| {diff:.2e}"
                                                 if diff is not None else ""))
        t = self.checks_table
        t.setRowCount(len(report.checks))
        for i, c in enumerate(report.checks):
            info = c.ok is None and c.data.get("informational")
            mark = "\u2139 info" if info else MARKS[c.ok]
            for col, text in enumerate((mark, c.name, c.detail)):
                item = QTableWidgetItem(text)
                item.setToolTip(text)
                if c.ok is False:
                    item.setForeground(Qt.red)
                t.setItem(i, col, item)
        model = report.source.get("model") or ""
        lines = []
        if not report.ok:
            lines.append("This export FAILED verification: do not use it. See the checks above.")
        lines += [f"warning: {w}" for w in report.warnings]
        lines.append("Use it: " + usage_command(report, model))
        lines += [f"file: {f}" for f in report.files]
        lines += [f"report: {p}" for p in report.report_paths]
        self.report_text.setPlainText("\n".join(lines))
        self.open_folder.setEnabled(True)
        self._fill_checkpoints()
        self.ctx.status(f"Export {'verified' if report.ok else 'FAILED verification'}: "
                        f"{report.path}")
        self.export_finished.emit(report)

    # ---------------------------------------------------------------- perplexity
    def start_perplexity(self) -> None:
        spec, text = self.spec(), os.path.expanduser(self.text_field.text().strip())
        self.error_panel.hide()
        if not text:
            self.error_panel.present("Cannot evaluate yet", ConfigError(
                "Choose a text file to measure perplexity on.", "Use text the run did not "
                "train on, e.g. a held-out part of your data as plain text."))
            return
        self.eval_button.setEnabled(False)
        self.eval_label.setText("Measuring perplexity\u2026")
        self._bg.run("perplexity", do_perplexity, spec, text, self.ctx_box.value(),
                     merged_path(self.report), on_done=self._on_perplexity,
                     on_error=self._on_perplexity_error)

    def _on_perplexity(self, results: dict) -> None:
        self.eval_button.setEnabled(True)
        first = next(iter(results.values()))
        self.eval_label.setText(
            "  \u00b7  ".join(f"{label}: PPL {r.ppl:.4f}" for label, r in results.items())
            + f"   ({first.n_chunks} chunks of {first.n_ctx} tokens, {first.n_scored} scored, "
              "as llama-perplexity)")

    def _on_perplexity_error(self, error: BaseException) -> None:
        self.eval_button.setEnabled(True)
        self.eval_label.setText("")
        self.error_panel.present("Perplexity failed", error)

    def failed_checks(self) -> list[str]:
        return [c.name for c in self.report.failed] if self.report is not None else []

    # ---------------------------------------------------------------- dialogs
    def _browse(self, field: QLineEdit, title: str) -> None:
        path, _ = QFileDialog.getOpenFileName(self, title, field.text(),
                                              "GGUF (*.gguf);;All files (*)")
        if path:
            field.setText(path)

    def _browse_text(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Text to evaluate on", self.text_field.text(),
                                              "Text (*.txt);;All files (*)")
        if path:
            self.text_field.setText(path)

    def _browse_out(self) -> None:
        fmt = self.format_box.currentData()
        if fmt in ("peft", "ollama"):
            path = QFileDialog.getExistingDirectory(self, "Export folder", self.out_field.text())
        else:
            path, _ = QFileDialog.getSaveFileName(self, "Export file", self.out_field.text(),
                                                  "GGUF (*.gguf)")
        if path:
            self.out_field.setText(path)

    def _open_folder(self) -> None:
        if self.report is not None:
            p = Path(self.report.path)
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(p if p.is_dir() else p.parent)))
