"""The dataset half of a new run: what a JSONL file will become under the chosen model.

A preview table of the first rows, the detected format, the linter's summary with the rejected
rows (line and reason), a histogram of row lengths in tokens against the context, and one
example with the trained spans highlighted. Reading and linting run off the GUI thread; a newer
request supersedes an older one.

For a preference run (`set_pairs(True)`: DPO, ORPO, SimPO, KTO) the file is linted as pairs by
the engine's `lint_preference_file` (what `workbench lint` prints for it): the pairs counted
(KTO's unpaired rows by label), identical, empty and too-long rows flagged among the rejected
ones, the sequence lengths against the context, and one pair shown with its chosen and rejected
completions one under the other, each completion's tokens highlighted. `pair_report` is that
report (a dict); `report` (a supervised run's LintReport) stays None.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QColor, QFont, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (QAbstractItemView, QFileDialog, QHBoxLayout, QHeaderView, QLabel,
                               QLineEdit, QProgressBar, QPushButton, QSplitter, QTableWidget,
                               QTextEdit, QVBoxLayout, QWidget)

from app.engine.api import ConfigError, DataConfig, LintReport, lint_file, lint_preference_file
from app.views.context import Background
from app.views.widgets import theme
from app.views.widgets.error_panel import ErrorPanel
from app.views.widgets.fit import WrappedLabel
from app.views.widgets.plots import pen, plot_widget, tint
from app.views.widgets.tables import fill_rows
from app.views.widgets.tooltips import NEW_RUN_TIPS

PREVIEW_ROWS = 30
LEGENDS = {False: "Highlighted: the tokens the model is trained to produce.",
           True: "Highlighted: each completion, whose log-probability the method compares."}
CELL_CHARS = 160


def read_preview(path: str, n: int = PREVIEW_ROWS) -> tuple[list[str], list[list[str]]]:
    """(columns, rows) of the first `n` non-blank lines: the line number and each top-level
    field, shortened for a table cell."""
    columns: list[str] = []
    parsed: list[tuple[int, object]] = []
    with open(os.path.expanduser(path), "rb") as f:
        for i, raw in enumerate(f, start=1):
            if len(parsed) >= n:
                break
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError:
                obj = None
            parsed.append((i, obj))
            if isinstance(obj, dict):
                columns += [k for k in obj if k not in columns]
    rows = []
    for line, obj in parsed:
        if not isinstance(obj, dict):
            rows.append([str(line), "(not a JSON object)"] + [""] * max(len(columns) - 1, 0))
            continue
        rows.append([str(line)] + [_cell(obj.get(k)) for k in columns])
    return ["line"] + columns, rows


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        text = value
    elif isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        text = " | ".join(f"{m.get('role', m.get('from', '?'))}: "
                          f"{m.get('content', m.get('value', ''))}" for m in value)
    else:
        text = json.dumps(value, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= CELL_CHARS else text[:CELL_CHARS - 1] + "\u2026"


def lint_pairs(data: str, model: str, config: DataConfig) -> dict:
    """A preference file's lint report (app.engine.api.lint_preference_file) at the context of
    `config`; a file that is not one is a ConfigError saying which rows a preference run takes."""
    report = lint_preference_file(data, model, config, config.context)
    if report is None:
        raise ConfigError(f"{os.path.basename(data)} is not a preference dataset: its first rows "
                          'have no "chosen" and "rejected" (nor "completion" with a true/false '
                          '"label").',
                          'Use rows {"prompt", "chosen", "rejected"} (DPO, ORPO, SimPO, KTO) or '
                          '{"prompt", "completion", "label"} (KTO), e.g. '
                          'sample_data/preferences.jsonl.')
    return report


class DatasetPanel(QWidget):
    """`set_inputs(data, model, config)` (re)checks the dataset; `report` is the last report."""

    report_ready = Signal(object)       # LintReport
    data_changed = Signal(str)          # the user picked another file

    def __init__(self, parent: QWidget | None = None, *,
                 lint: Callable[..., LintReport] = lint_file):
        super().__init__(parent)
        self.report: LintReport | None = None
        self.pair_report: dict | None = None         # a preference file's (set_pairs)
        self._pairs = False
        self.error: BaseException | None = None     # why the last check failed
        self._lint = lint
        self._inputs: tuple[str, str, DataConfig] | None = None
        self._bg = Background(self)
        self._debounce = QTimer(self, singleShot=True, interval=250)
        self._build()
        self._layout()
        self._connect()
        self._show_report(None)

    def _build(self) -> None:
        self.path_field = QLineEdit(placeholderText="Path to a .jsonl dataset",
                                    toolTip=NEW_RUN_TIPS["data_path"],
                                    clearButtonEnabled=True)
        self.browse_button = QPushButton("Choose dataset\u2026")
        self.format_label = QLabel(objectName="badge")
        self.summary_label = QLabel(objectName="lintSummary", wordWrap=True,
                                    textFormat=Qt.PlainText)
        self.busy = QProgressBar(textVisible=False, maximumWidth=120, maximumHeight=6)
        self.busy.setRange(0, 0)
        self.busy.hide()
        self.error_panel = ErrorPanel(margins=0)
        self.error_panel.hide()

        self.preview_table = make_table()
        self.bad_rows_table = make_table(["line", "kind", "reason"])
        self.bad_rows_title = QLabel("Rejected rows", objectName="sectionHeader")

        self.plot = plot_widget()
        self.plot.setMinimumHeight(170)
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.hideButtons()
        self.plot.setLabel("bottom", "row length (tokens)")
        self.plot.setLabel("left", "rows")
        self.plot.setTitle("Row lengths against the context", color=theme.color("plot_title"),
                           size="10pt")
        self.hist_bars = pg.BarGraphItem(x=[], height=[], width=1.0)
        self.plot.addItem(self.hist_bars)
        self.context_line = pg.InfiniteLine(
            angle=90, pen=pen(theme.LIGHT["curve1"], width=2, style=Qt.DashLine),
            label="context", labelOpts={"position": 0.9, "color": tint(theme.LIGHT["curve1"]),
                                        "movable": False})
        self.plot.addItem(self.context_line)
        self.hist_stats = WrappedLabel(objectName="hint", textFormat=Qt.PlainText)

        self.example_title = QLabel("Example", objectName="sectionHeader")
        self.example_view = QTextEdit(readOnly=True, objectName="exampleView")
        self.example_view.setFont(QFont("monospace", 9))

    def _layout(self) -> None:
        top = QHBoxLayout()
        top.addWidget(QLabel("Dataset", objectName="formLabel"))
        top.addWidget(self.path_field, 1)
        top.addWidget(self.browse_button)
        summary = QHBoxLayout()
        summary.addWidget(self.format_label)
        summary.addWidget(self.summary_label, 1)
        summary.addWidget(self.busy)
        self.legend = legend = QLabel(LEGENDS[False], objectName="hint", wordWrap=True)
        left = QSplitter(Qt.Vertical)
        left.addWidget(titled("First rows", self.preview_table))
        self._bad_box = titled(self.bad_rows_title, self.bad_rows_table)
        left.addWidget(self._bad_box)
        left.setSizes([300, 140])
        self._right = right = QSplitter(Qt.Vertical)
        hist = QWidget()
        hl = QVBoxLayout(hist)
        hl.setContentsMargins(0, 0, 0, 0)
        hl.addWidget(self.plot, 1)
        hl.addWidget(self.hist_stats)
        right.addWidget(hist)
        ex = QWidget()
        el = QVBoxLayout(ex)
        el.setContentsMargins(0, 0, 0, 0)
        el.addWidget(self.example_title)
        el.addWidget(self.example_view, 1)
        el.addWidget(legend)
        right.addWidget(ex)
        right.setSizes([230, 230])
        body = QSplitter(Qt.Horizontal)
        body.addWidget(left)
        body.addWidget(right)
        body.setSizes([520, 440])

        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 12, 16, 12)
        layout.addLayout(top)
        layout.addLayout(summary)
        layout.addWidget(self.error_panel)
        layout.addWidget(body, 1)

    def _connect(self) -> None:
        theme.follow(self, DatasetPanel._retheme, now=False)   # the highlight's colour
        self._debounce.timeout.connect(self._start_lint)
        self.path_field.editingFinished.connect(self._path_edited)
        self.browse_button.clicked.connect(self.choose)

    # ---------------------------------------------------------------- inputs
    def data_path(self) -> str:
        return self.path_field.text().strip()

    def set_data_path(self, path: str) -> None:
        path = os.path.abspath(os.path.expanduser(path)) if path else ""
        self.path_field.setText(path)
        self._load_preview(path)
        self.data_changed.emit(path)

    def choose(self) -> None:
        start = os.path.dirname(self.data_path()) or os.path.expanduser("~")
        path, _ = QFileDialog.getOpenFileName(self, "Choose a dataset", start,
                                              "JSON Lines (*.jsonl *.json *.jsonl.gz);;"
                                              "All files (*)")
        if path:
            self.set_data_path(path)

    def _path_edited(self) -> None:
        if self.data_path() != (self._inputs[0] if self._inputs else ""):
            self.set_data_path(self.data_path())

    def set_inputs(self, data: str, model: str, config: DataConfig) -> None:
        """Lint `data` with `model`'s tokenizer and `config` (after a short pause, so typing
        in a field does not start a lint per key)."""
        inputs = (data, model, config)
        done = self.pair_report if self._pairs else self.report
        if inputs == self._inputs and (done is not None or self._bg.busy("lint")):
            return
        self._inputs = inputs
        if not data or not model:
            self._debounce.stop()                   # a pending lint would check nothing
            self._bg.cancel("lint")
            self.busy.hide()
            return
        self.busy.show()
        self._debounce.start()

    def set_pairs(self, pairs: bool) -> None:
        """Lint the file as preference pairs (True) or as a supervised dataset; the next
        `set_inputs` checks it again."""
        if pairs == self._pairs:
            return
        self._pairs, self._inputs = pairs, None
        self._bg.cancel("lint")
        self.plot.setVisible(not pairs)             # pairs: lengths in words, no histogram
        self.hist_stats.setAlignment(Qt.AlignLeft | (Qt.AlignTop if pairs else Qt.AlignVCenter))
        self._right.setSizes([80, 380] if pairs else [230, 230])   # the pair gets the room
        self.legend.setText(LEGENDS[pairs])
        self._show_report(None)

    def is_busy(self) -> bool:
        return self._debounce.isActive() or self._bg.busy("lint") or self._bg.busy("preview")

    def _start_lint(self) -> None:
        if self._inputs is None:
            return
        data, model, config = self._inputs
        lint = lint_pairs if self._pairs else self._lint
        self._bg.run("lint", lint, data, model, config, on_done=self._on_report,
                     on_error=self._on_error)

    def _load_preview(self, path: str) -> None:
        self.preview_table.setRowCount(0)
        if path:
            self._bg.run("preview", read_preview, path, on_done=self._show_preview,
                         on_error=lambda e: self._show_preview(([], [])))

    # ---------------------------------------------------------------- results
    def _on_report(self, report) -> None:
        self.error = None
        self.busy.hide()
        self.error_panel.hide()
        if isinstance(report, dict):                # a preference file's (lint_pairs)
            self._show_report(None)
            self._show_pairs(report)
            self.report_ready.emit(None)
            return
        self._show_report(report)
        self.report_ready.emit(report)

    def _on_error(self, error: BaseException) -> None:
        self.error = error
        self.busy.hide()
        self._show_report(None)
        name = os.path.basename(self._inputs[0]) if self._inputs else "the dataset"
        self.error_panel.present(f"Could not check {name}", error,
                                 context=f"File: {self._inputs[0] if self._inputs else ''}")
        self.report_ready.emit(None)

    def _show_preview(self, preview) -> None:
        fill_preview(self.preview_table, preview)

    def _show_report(self, r: LintReport | None) -> None:
        self.report = r
        self.pair_report = None
        if r is None:
            self.format_label.hide()
            self.summary_label.setText("Pick a model and a dataset to check it."
                                       if self._inputs is None else "")
            self.bad_rows_table.setRowCount(0)
            self.hist_bars.setOpts(x=[], height=[], width=1.0, brushes=[])
            self.hist_stats.setText("")
            self.example_view.clear()
            return
        self.format_label.setText(f"{r.format} ({'detected' if r.format_detected else 'chosen'})")
        self.format_label.show()
        weights = r.weights.get("source", "none")
        norm = r.weights.get("normalization", {}).get("method", "none")
        # as `lint` says it: accepted are the rows that train (a dropped row trains nothing)
        dropped = (f"{r.dropped:,} dropped as longer than the context, " if r.dropped else "")
        parts = [f"{r.rows:,} rows: {r.training_rows:,} accepted, {dropped}"
                 f"{r.rejected_count:,} rejected",
                 f"{r.trained_tokens:,} trained tokens of {r.positions:,} "
                 f"({100 * r.trained_token_fraction:.0f}%)",
                 f"{r.histogram.get('over_context', 0)} longer than the context "
                 f"({r.truncated} truncated, {r.split} split, {r.dropped} dropped)",
                 "weights: " + ("none" if weights == "none" else
                                f"from the {'file' if weights == 'file' else 'rows'}, "
                                f"normalisation {norm}")]
        self.summary_label.setText(" \u00b7 ".join(parts) +
                                   "".join(f"\nnote: {n}" for n in r.notes))
        self._show_bad_rows(r)
        self._show_histogram(r.histogram)
        self._show_example(r.example)

    def _show_pairs(self, r: dict) -> None:
        """A preference file's report: counts and flags, rejected rows, one pair."""
        self.pair_report = r
        self.format_label.setText(f"{r['format']} "
                                  f"({'detected' if r['format_detected'] else 'chosen'})")
        self.format_label.show()
        what = (f"{r['pairs']:,} pairs" if "pairs" in r else
                f"{r['desirable']:,} desirable and {r['undesirable']:,} undesirable rows")
        parts = [f"{r['rows']:,} rows: {what} accepted, {r['rejected_count']:,} rejected",
                 f"identical pairs {r['identical']}, empty completions {r['empty']}, longer "
                 f"than the context {r['too_long']}"]
        self.summary_label.setText(" \u00b7 ".join(parts) +
                                   "".join(f"\nnote: {n}" for n in r.get("notes", [])))
        self._show_bad_rows(r)
        if "lengths" in r:
            L, C = r["lengths"], r["completion_tokens"]
            self.hist_stats.setText(
                f"Sequences (prompt + completion): min {L['min']}, mean {L['mean']:g}, max "
                f"{L['max']} tokens; a row fits up to {L['fits_up_to']} (context "
                f"{r['context']}), longer ones are rejected. Completions: min {C['min']}, "
                f"mean {C['mean']:g}, max {C['max']} tokens.")
        else:
            self.hist_stats.setText("no accepted rows")
        self._show_pair_example(r.get("example"))

    def _show_pair_example(self, ex: dict | None) -> None:
        """One row's completions under each other (chosen, then rejected; KTO's one by its
        label), each completion's tokens highlighted, as one example of `_show_example`."""
        if not ex:
            self._show_example(None)
            return
        text, spans, trained = "", [], 0
        for key in ("chosen", "rejected"):
            e = ex[key]
            if e is None:
                continue
            name = key if ex["label"] is None else ("desirable" if ex["label"] else
                                                    "undesirable")
            head = f"\u2500\u2500 {name.upper()} ({e['trained_tokens']} completion tokens)\n"
            at = len(text) + len(head)
            spans += [(a + at, b + at) for a, b in e.get("trained_spans", [])]
            text += head + e["text"] + "\n\n"
            trained += e["trained_tokens"]
        self._show_example({"line": ex["line"], "text": text.rstrip("\n"),
                            "trained_spans": spans, "trained_tokens": trained,
                            "tokens": sum(ex[k]["tokens"] for k in ("chosen", "rejected")
                                          if ex[k] is not None)})
        kind = "pair" if ex["rejected"] is not None else "row"
        self.example_title.setText(f"Example {kind}: line {ex['line']}, "
                                   + ("chosen and rejected completions highlighted"
                                      if kind == "pair" else "its completion highlighted"))

    def _show_bad_rows(self, r) -> None:
        """The rejected rows of a LintReport or of a preference report (a dict)."""
        t = self.bad_rows_table
        rejected = r["rejected"] if isinstance(r, dict) else [
            {"line": x.line, "kind": x.kind, "reason": x.reason} for x in r.rejected]
        count = r["rejected_count"] if isinstance(r, dict) else r.rejected_count
        fill_rows(t, [(str(rej["line"]), rej["kind"], rej["reason"]) for rej in rejected])
        more = count - len(rejected)
        self.bad_rows_title.setText(
            "Rejected rows: none" if not count else
            f"Rejected rows: {count:,}" + (f" (first {len(rejected)} listed)"
                                          if more > 0 else ""))

    def _show_histogram(self, h: dict) -> None:
        bins = h.get("bins") or []
        fits = h.get("fits_up_to", 0)
        xs, ws, hs, brushes = [], [], [], []
        regular = max((b["to"] - b["from"] + 1 for b in bins[:-1]), default=1)
        for b in bins:
            over = b["to"] is None or b["from"] > fits
            lo = b["from"]
            hi = b["to"] if b["to"] is not None else lo + regular - 1
            xs.append((lo + hi) / 2)
            ws.append((hi - lo + 1) * 0.9)
            hs.append(b["rows"])
            brushes.append(tint(theme.LIGHT["curve1" if over else "accent"]))
        self.hist_bars.setOpts(x=xs, height=hs, width=ws, brushes=brushes, pen=None)
        self.context_line.setValue(fits + 0.5)
        self.context_line.label.setFormat(f"context {h.get('context', fits - 1)}")
        if bins:
            self.plot.setXRange(0, max(xs[-1] + ws[-1], fits * 1.05), padding=0.02)
            self.plot.setYRange(0, max(hs + [1]) * 1.15, padding=0)
        if "max" in h:
            context = h.get("context", fits - 1)
            self.hist_stats.setText(
                f"min {h['min']}, median {h['median']:.0f}, mean {h['mean']:.1f}, "
                f"p95 {round(h['p95'])}, max {h['max']} tokens. Context {context}: a row of up "
                f"to {fits} tokens trains whole ({context} predicted tokens, each from the ones "
                "before it); red rows are longer")
        else:
            self.hist_stats.setText("no accepted rows")

    def _retheme(self) -> None:
        """The theme changed: the example again, highlighted in the new theme's colour."""
        if self.pair_report is not None:            # a pair: its own title too
            self._show_pair_example(self.pair_report.get("example"))
        elif getattr(self, "_example", None) is not None:
            self._show_example(self._example)

    def _show_example(self, ex: dict | None) -> None:
        self._example = ex
        view = self.example_view
        view.clear()
        if not ex:
            self.example_title.setText("Example: none (no accepted rows)")
            return
        self.example_title.setText(f"Example: line {ex['line']}, {ex['tokens']} tokens, "
                                   f"{ex['trained_tokens']} trained")
        view.setPlainText(ex["text"])
        fmt = QTextCharFormat()
        fmt.setBackground(QColor(theme.color("trained_bg")))
        cursor = QTextCursor(view.document())
        for start, end in ex.get("trained_spans", []):
            cursor.setPosition(start)
            cursor.setPosition(min(end, len(ex["text"])), QTextCursor.KeepAnchor)
            cursor.mergeCharFormat(fmt)
        view.moveCursor(QTextCursor.Start)

    # ---------------------------------------------------------------- state for tests
    def histogram_heights(self) -> list[int]:
        return [int(v) for v in self.hist_bars.opts.get("height", [])]

    def highlighted_spans(self) -> list[tuple[int, int]]:
        """Character ranges of the example shown with the trained background."""
        spans: list[tuple[int, int]] = []
        block = self.example_view.document().begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                frag = it.fragment()
                if frag.isValid() and frag.charFormat().background().color().name() in \
                        (theme.LIGHT["trained_bg"], theme.DARK["trained_bg"]):
                    a, b = frag.position(), frag.position() + frag.length()
                    joined = spans and (spans[-1][1] == a or (
                        spans[-1][1] == a - 1 and a == block.position()))  # across a newline
                    if joined:
                        spans[-1] = (spans[-1][0], b)
                    else:
                        spans.append((a, b))
                it += 1
            block = block.next()
        return spans

    def bad_rows(self) -> list[tuple[str, str]]:
        t = self.bad_rows_table
        return [(t.item(i, 0).text(), t.item(i, 2).text()) for i in range(t.rowCount())]


def fill_preview(t: QTableWidget, preview: tuple[list[str], list[list[str]]]) -> None:
    """Show `read_preview`'s (columns, rows) in `t`: the line numbers narrow, the rest wide."""
    columns, rows = preview
    t.clear()
    t.setColumnCount(len(columns))
    t.setHorizontalHeaderLabels(columns)
    fill_rows(t, rows)
    if columns:
        t.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeToContents)
        for c in range(1, len(columns)):
            t.horizontalHeader().setSectionResizeMode(c, QHeaderView.Stretch)


def make_table(columns: list[str] | None = None) -> QTableWidget:
    t = QTableWidget(0, len(columns or []))
    if columns:
        t.setHorizontalHeaderLabels(columns)
        t.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        t.horizontalHeader().setStretchLastSection(True)
    t.verticalHeader().hide()
    t.setEditTriggers(QAbstractItemView.NoEditTriggers)
    t.setSelectionBehavior(QAbstractItemView.SelectRows)
    t.setWordWrap(False)
    t.setAlternatingRowColors(True)
    return t


def titled(title: str | QLabel, widget: QWidget) -> QWidget:
    box = QWidget()
    layout = QVBoxLayout(box)
    layout.setContentsMargins(0, 4, 0, 0)
    layout.setSpacing(4)
    layout.addWidget(title if isinstance(title, QLabel) else
                     QLabel(title, objectName="sectionHeader"))
    layout.addWidget(widget, 1)
    return box
