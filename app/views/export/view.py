"""Export: turn a run (or an adapter file) into what llama.cpp, Ollama or PEFT load, verified.

Source: the selected run (its best checkpoint by default, any kept step, or its final
adapter.gguf) or an adapter file with its base model. Format (GGUF LoRA, merged GGUF, PEFT, Ollama), tensor type,
scale, destination. The export runs off the GUI thread (`app.engine.export.exporter.export`); its
verification report is shown check by check, flagged in red when a check failed, with the
command that loads the result. An export that would replace an existing output asks first;
one whose output is one of its inputs is refused (the engine's rule, in the error panel).
Perplexity on a text file (chunked as llama-perplexity) compares the base model, base +
adapter and the last merged export (`compare_perplexity`), off the GUI thread too.

Honest about what it shows: a result belongs to the inputs that made it, so changing the
source, checkpoint, format, type or destination (or keeping the existing output at "Replace?")
clears it (and the form is locked while an export runs); an export that failed verification
says where it was moved aside; the size the export will write is shown before Export is pressed
(`expected_export_size`, off the GUI thread) and the size written after; the checks' figures
are explained in sentences (`explain_checks`); the engine's hints name command-line flags,
which the window says in its own words (`window_words`); the llama.cpp cross-check is
disabled, with the reason, when llama-cpp-python cannot be found.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from pathlib import Path

from PySide6.QtCore import QSignalBlocker, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QAbstractItemView, QCheckBox, QComboBox, QDoubleSpinBox,
                               QFileDialog, QGridLayout, QHBoxLayout, QHeaderView, QLabel,
                               QLineEdit, QMessageBox, QPlainTextEdit, QProgressBar,
                               QPushButton, QScrollArea, QSpinBox, QTableWidget, QTableWidgetItem,
                               QVBoxLayout, QWidget)

from app.engine.api import (ConfigError, EngineError, ExportTargetExists, RunDir,
                            compare_perplexity, expected_export_size, export, human_bytes,
                            llamacpp_python, source_from_adapter, source_from_run)
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
NO_LLAMACPP = ("Not available: llama-cpp-python is not installed. Install it (pip install "
               "'gguf-workbench[verify]') or set WORKBENCH_LLAMACPP_PYTHON to a Python that has "
               "it, then restart the workbench; the export is still verified by the engine.")

# The engine's hints name command-line flags; the window names its own controls instead.
# Ordered: whole phrases before the flags they contain.
WINDOW_WORDS = [
    (r"workbench export \S+ --checkpoint STEP", "choose it in the Checkpoint list"),
    (r"--checkpoint (\w+)", r"checkpoint \1 in the Checkpoint list"),
    (r"Pass --overwrite to replace it, or choose another path \(--out\)\.",
     "Export again and answer Yes when asked to replace it, or choose another Destination."),
    (r"not even when allowed to replace its output \(--overwrite\)",
     "not even when you answer Yes to Replace"),
    (r"not even with --overwrite", "not even when you answer Yes to Replace"),
    (r"a smaller --ctx", "a smaller ctx (beside Perplexity)"),
    (r"--to merged", "Format \u201cMerged GGUF model\u201d"),
    (r"--to ollama", "Format \u201cOllama\u201d"),
    (r"--type (\w+) \(or (\w+)\)", r"Tensor type \1 (or \2)"),
    (r"--type (\w+) or (\w+)", r"Tensor type \1 or \2"),
    (r"--type (\w+)", r"Tensor type \1"),
    (r"\(--out\)", "(Destination)"),
]


def in_window_words(text: str) -> str:
    """The engine's `text` (a hint, a check's detail) with WINDOW_WORDS applied."""
    for pattern, words in WINDOW_WORDS:
        text = re.sub(pattern, words, text)
    return text


def window_words(error: BaseException) -> BaseException:
    """`error` as the window says it: an EngineError's message and hint in_window_words (a
    copy; the engine's error, written to logs and reports, keeps its flags)."""
    if not isinstance(error, EngineError):
        return error
    said = type(error).__new__(type(error), error.message)    # not __init__: its own args
    said.__dict__.update(vars(error))
    said.message, said.hint = in_window_words(error.message), in_window_words(error.hint)
    return said


def _ppl(nll: float) -> str:
    return f"{math.exp(nll):,.1f}" if nll < 700 else "over 10^300"


def explain_check(check) -> str:
    """One check's figures in a sentence (empty for the checks whose detail says it all)."""
    name, d = check.name.rsplit(" ", 1)[-1], check.data
    if name == "kept" and "live_nll" in d:          # verify.nll_check: "adapter kept"
        merged, live, base = d["merged_nll"], d["live_nll"], d["base_nll"]
        said = (f"On a short held-out English passage (fixed, not your data), the merged model's "
                f"perplexity is {_ppl(merged)} and base + adapter's {_ppl(live)}: "
                f"{d['relative_diff']:.2%} apart in mean loss, ")
        bound = f"{d.get('bound', 0.01):.0%}"
        said += (f"within the {bound} allowed, so the merge keeps the adapter's effect."
                 if check.ok else
                 f"more than the {bound} allowed: the merge loses part of the adapter's effect.")
        said += (f" The base model alone has perplexity {_ppl(base)}: the adapter makes this "
                 f"general text {'more' if live < base else 'less'} predictable.")
        if live > math.log(1000):
            said += (" A perplexity this high means the model hardly predicts this passage (a "
                     "tiny test model, or text unlike its training); the check compares the "
                     "merge with base + adapter, it does not rate the model.")
        return said
    if name == "logits" and "max_abs_diff" in d:
        ref = d.get("reference", "")
        if check.ok:
            return (f"Read back, the export predicts the same next-token scores as {ref}: the "
                    f"largest difference is {d['max_abs_diff']:.2g}, under the "
                    f"{d['tolerance']:.2g} allowed for rounding noise.")
        return (f"Read back, the export's next-token scores differ from {ref} by up to "
                f"{d['max_abs_diff']:.2g} (allowed {d['tolerance']:.2g}): it does not compute "
                "what was trained.")
    if name == "drift" and "max_abs_diff" in d:
        return (f"Storing fewer bits moves the next-token scores by up to "
                f"{d['max_abs_diff']:.2g} from the trained adapter's (for information: a "
                "rounding cost, not a fault).")
    if name == "llamacpp":
        if d.get("skipped") == "disabled":
            return "The llama.cpp cross-check was turned off for this export."
        if check.ok is None:
            why = check.detail.removeprefix("skipped: ").removeprefix("inconclusive: ")
            return f"The llama.cpp cross-check did not run: {why}."
        median = d.get("statistic") == "median"      # rounded weights: a typical position
        diff = d.get("median_position_max_diff" if median else "max_abs_diff", 0.0)
        return (f"llama.cpp loads the file and computes "
                f"{'the same' if check.ok else 'different'} next-token scores as the engine "
                f"({'typical' if median else 'largest'} difference {diff:.2g}, allowed "
                f"{d.get('tolerance', 0):.2g}).")
    return ""


def explain_checks(report) -> str:
    """The report's figures in words, the failed checks first."""
    ordered = sorted(report.checks, key=lambda c: c.ok is not False)
    return "\n".join(filter(None, (explain_check(c) for c in ordered)))


def written_size(report) -> int:
    """The bytes of the files the export wrote (those still there)."""
    return sum(os.path.getsize(f) for f in report.files if os.path.isfile(f))


def expected_size(spec: dict) -> int:
    """The bytes the export of `spec` will write (runs in a worker thread: reads the source)."""
    return expected_export_size(export_source(spec), spec["format"], spec["type"])


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
        self._sizes = Background(self, max_threads=1)     # not queued behind an export
        self._size_timer = QTimer(self, singleShot=True, interval=250)   # typing: once
        self.expected = None          # bytes the export will write (None: unknown yet)
        self._size_said = ""          # what the size label says before an export
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
        self.llamacpp_box = QCheckBox("Also compare with llama.cpp (llama-cpp-python)",
                                      checked=True)
        self.export_button = QPushButton("Export", objectName="primaryButton")
        self.busy = QProgressBar(textVisible=False, maximumWidth=160, maximumHeight=6)
        self.busy.setRange(0, 0)
        self.busy.hide()
        self.size_label = QLabel(textFormat=Qt.PlainText, wordWrap=True)

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
        self.checks_table.setMinimumHeight(120)
        self.explain_label = QLabel(textFormat=Qt.PlainText, wordWrap=True)
        self.explain_label.hide()
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
        self.llamacpp_missing = llamacpp_python() is None
        if self.llamacpp_missing:                # the cross-check cannot run: say why
            self.llamacpp_box.setChecked(False)
            self.llamacpp_box.setEnabled(False)
            self.llamacpp_box.setToolTip(NO_LLAMACPP)
        g.setColumnStretch(1, 1)
        actions = QHBoxLayout()
        actions.addWidget(self.export_button)
        actions.addWidget(self.busy)
        actions.addWidget(self.size_label, 1)
        head = QHBoxLayout()
        head.addWidget(self.badge)
        head.addWidget(self.report_title, 1)
        head.addWidget(self.open_folder)

        outer = QVBoxLayout(self)               # the error on top; the rest scrolls if short
        outer.setContentsMargins(16, 12, 16, 12)
        outer.addWidget(self.error_panel)
        self.scroll = QScrollArea(widgetResizable=True, frameShape=QScrollArea.NoFrame)
        outer.addWidget(self.scroll, 1)
        page = QWidget()
        self.scroll.setWidget(page)
        layout = QVBoxLayout(page)
        layout.setContentsMargins(0, 0, 4, 0)
        self.form = form = QWidget(maximumWidth=860)
        form.setLayout(g)
        g.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(form)
        layout.addLayout(actions)
        layout.addSpacing(6)
        layout.addLayout(head)
        layout.addWidget(self.checks_table, 1)
        layout.addWidget(self.explain_label)
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
        for signal in (self.source_box.currentIndexChanged, self.format_box.currentIndexChanged,
                       self.type_box.currentIndexChanged, self.checkpoint_box.currentIndexChanged,
                       self.adapter_field.textChanged, self.model_field.textChanged):
            signal.connect(self._inputs_changed)
        for signal in (self.scale.valueChanged, self.out_field.textChanged):   # same size
            signal.connect(self.clear_result)
        self._size_timer.timeout.connect(self._estimate_size)
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
        if run_dir != self.run_dir:
            self._inputs_changed()
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
        """List the run's checkpoints again, keeping the choice; only a choice that changed
        (it is gone, or another run) counts as changed inputs."""
        box = self.checkpoint_box
        current, text = box.currentData(), box.currentText()
        with QSignalBlocker(box):
            box.clear()
            if self.run_dir:
                for data, label in checkpoint_choices(self.run_dir):     # the best first
                    box.addItem(label, data)
                box.setCurrentIndex(max(box.findData(current), 0))
        if (box.currentData(), box.currentText()) != (current, text):
            self._inputs_changed()

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

    def _inputs_changed(self, *_) -> None:
        """What is shown was made from other inputs: clear it, and estimate the size anew."""
        self.expected = None
        self._size_said = ""
        self.clear_result()
        self._sizes.cancel("size")
        self._size_timer.start()

    def clear_result(self, *_) -> None:
        """Forget the last export's result (badge, report, checks, written size)."""
        self.size_label.setText(self._size_said)
        self.report = None
        self.badge.hide()
        self.report_title.setText("")
        self.checks_table.setRowCount(0)
        self.explain_label.hide()
        self.explain_label.setText("")
        self.report_text.setPlainText("")
        self.open_folder.setEnabled(False)
        self.eval_label.setText("")            # measured with the last merged export

    def _estimate_size(self) -> None:
        spec = self.spec()
        if (spec["source"] == "run" and not spec["run_dir"]) or (
                spec["source"] == "file" and not (spec["adapter"] and spec["model"])):
            return
        self._say_size("Size: estimating\u2026")
        self._sizes.run("size", expected_size, spec, on_done=self._on_size,
                        on_error=self._on_size_error)

    def _on_size(self, size: int) -> None:
        self.expected = size
        self._say_size(f"Will write about {human_bytes(size)}")

    def _on_size_error(self, error: BaseException) -> None:
        """The estimate reads the source as the export does: its ConfigError (no adapter
        for this format, a missing file) is why the export would fail, said before it does."""
        said = window_words(error)
        text = said.message if isinstance(said, EngineError) else f"{type(error).__name__}: {error}"
        hint = getattr(said, "hint", "")
        self._say_size(f"Size unknown: {text}" + (f" {hint}" if hint else ""))

    def _say_size(self, text: str) -> None:
        self._size_said = text
        if self.report is None:                  # not over the size an export wrote
            self.size_label.setText(text)

    def spec(self) -> dict:
        return {"source": self.source_box.currentData(), "run_dir": self.run_dir,
                "checkpoint": self.checkpoint_box.currentData() or NEWEST,
                "adapter": os.path.expanduser(self.adapter_field.text().strip()),
                "model": os.path.expanduser(self.model_field.text().strip()),
                "format": self.format_box.currentData(),
                "type": self.type_box.currentData() or "f32", "scale": self.scale.value(),
                "out": os.path.expanduser(self.out_field.text().strip()),
                # missing, it is still asked for: the report then says why it did not run
                "llamacpp": self.llamacpp_box.isChecked() or self.llamacpp_missing,
                "overwrite": False}

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
        self.clear_result()                      # what was shown is not this export's
        self._run_export(spec)

    def _run_export(self, spec: dict) -> None:
        self.export_button.setEnabled(False)
        self.form.setEnabled(False)              # the inputs stay those of the result to come
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
        self.form.setEnabled(True)
        self.busy.hide()
        self.report_title.setText("")            # the result was cleared at the start
        if kept:
            self.report_title.setText(f"Not exported: {error.path} was kept as it was.")
            self.ctx.status(f"Export cancelled: {error.path} kept")
        else:
            self.error_panel.present("The export failed", window_words(error))
        self.export_finished.emit(error)

    def _confirm_replace(self, path: Path) -> bool:
        what = "folder" if path.is_dir() else "file"
        return QMessageBox.question(
            self, "Replace the export", f"Replace {path}?\n\nThe {what} exists already; the "
            "new export takes its place.",
            QMessageBox.Yes | QMessageBox.No, QMessageBox.No) == QMessageBox.Yes

    def _on_report(self, report) -> None:
        self.export_button.setEnabled(True)
        self.form.setEnabled(True)
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
        explained = explain_checks(report)
        self.explain_label.setText(explained)
        self.explain_label.setVisible(bool(explained))
        size = written_size(report)
        self.size_label.setText(f"Wrote {human_bytes(size)}" + (
            f" (expected about {human_bytes(self.expected)})" if self.expected else ""))
        t = self.checks_table
        t.setRowCount(len(report.checks))
        for i, c in enumerate(report.checks):
            info = c.ok is None and c.data.get("informational")
            mark = "\u2139 info" if info else MARKS[c.ok]
            for col, text in enumerate((mark, c.name, in_window_words(c.detail))):
                item = QTableWidgetItem(text)
                item.setToolTip(text)
                if c.ok is False:
                    item.setForeground(Qt.red)
                t.setItem(i, col, item)
        model = report.source.get("model") or ""
        lines = []
        if not report.ok:
            lines.append("This export FAILED verification: do not use it. See the checks above.")
        if report.moved_from:
            lines.append(f"It was not written to {report.moved_from} (anything there is as "
                         f"it was): it was moved aside to {report.path}.")
        lines += [f"warning: {w}" for w in report.warnings]
        if report.ok:                            # a failed one is not to be used
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
        self.error_panel.present("Perplexity failed", window_words(error))

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
