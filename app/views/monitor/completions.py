"""The Monitor's Completions page for GRPO runs: what the model actually wrote, and how it scored.

Two kinds of events carry completions (see app.engine.training.grpo): "samples" (every samples_every
steps, all G sampled completions of the step's first prompts, with their advantages) and "eval"
(its "examples": greedy completions of held-out prompts). Each becomes one entry of the step
box, the newest first; "Follow newest" shows each new one as it arrives.

One row per completion: step, prompt, reference answer, completion, reward, one column per
reward function, advantage, length in tokens, finished (False: cut off at max_new_tokens).
Long text is elided in its cell (the whole text is its tooltip); the pane below shows the
selected row in full. Rows with a positive advantage are tinted green, negative red.
Test-visible state: `table`, `step_box`, `follow_box`, `detail`, `entries`, `rows()`.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont
from PySide6.QtWidgets import (QAbstractItemView, QCheckBox, QComboBox, QHBoxLayout, QHeaderView,
                               QLabel, QPlainTextEdit, QSplitter, QTableWidget, QTableWidgetItem,
                               QVBoxLayout, QWidget)

from app.views.widgets import theme
from app.views.widgets.plots import box

CELL_CHARS = 70
SOURCES = {"samples": "sampled", "eval": "held-out, greedy"}


def elide(text: str, limit: int = CELL_CHARS) -> str:
    """One line (newlines shown as \u21b5), at most `limit` characters."""
    line = str(text).replace("\r", "").replace("\n", " \u21b5 ")
    return line if len(line) <= limit else line[:limit - 1] + "\u2026"


def _number(value, fmt: str = "{:.2f}") -> str:
    return "\u2014" if not isinstance(value, (int, float)) else fmt.format(value)


class CompletionsView(QWidget):
    """See the module docstring; `add_events(events)` takes any batch of run events."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.entries: list[tuple[int, str, list]] = []     # (step, source, items), oldest first
        self._rows: list[tuple[int, dict]] = []            # (step, item) per table row

        self.step_box = QComboBox(minimumContentsLength=28)
        self.step_box.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
        self.step_box.activated.connect(lambda _i: self.follow_box.setChecked(False))
        self.step_box.currentIndexChanged.connect(lambda _i: self._show_entry())
        self.step_box.setToolTip("Which step's completions to show: sampled ones (with their "
                                 "advantages) or the held-out prompts' greedy ones.")
        self.follow_box = QCheckBox("Follow newest", checked=True)
        self.follow_box.setToolTip("Show each new step's completions as they arrive.")
        self.follow_box.toggled.connect(self._on_follow)
        self.hint = QLabel("No completions yet: sampled completions are recorded every "
                           "samples_every steps, held-out ones at every evaluation.",
                           objectName="pageSubtitle", wordWrap=True)
        self.table = QTableWidget(0, 0)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.table.setWordWrap(False)
        self.table.itemSelectionChanged.connect(self._show_detail)
        self.detail = QPlainTextEdit(readOnly=True, objectName="completionDetail")
        self.detail.setFont(QFont("monospace", 9))
        self.detail.setPlaceholderText("Select a row to read the prompt and completion in full.")
        split = QSplitter(Qt.Vertical)
        split.addWidget(self.table)
        split.addWidget(self.detail)
        split.setSizes([380, 180])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 6, 0, 0)
        layout.addLayout(box(QHBoxLayout, QLabel("Completions of"), self.step_box, 12,
                             self.follow_box, None))
        layout.addWidget(self.hint)
        layout.addWidget(split, 1)
        self.clear()
        theme.follow(self, CompletionsView._show_entry, now=False)   # the rows' tints

    # ---------------------------------------------------------------- data
    def clear(self) -> None:
        self.entries.clear()
        self.step_box.clear()
        self._fill([])

    def add_events(self, events: list) -> None:
        shown = self.current_entry()
        self.step_box.blockSignals(True)          # the table changes only with its entry
        for ev in events:
            kind = ev.get("type")
            items = ev.get("items") if kind == "samples" else ev.get("examples")
            if kind in SOURCES and items:
                step, source = int(ev.get("step", 0)), SOURCES[kind]
                self.entries.append((step, source, items))
                self.step_box.insertItem(0, f"step {step} \u00b7 {source} ({len(items)})",
                                         len(self.entries) - 1)
        if self.follow_box.isChecked():
            self.step_box.setCurrentIndex(0)
        self.step_box.blockSignals(False)
        if self.current_entry() is not shown:
            self._show_entry()

    def _on_follow(self, on: bool) -> None:
        if on and self.step_box.count():
            self.step_box.setCurrentIndex(0)

    def select(self, step: int, source: str = "sampled") -> None:
        """Show the completions of `step` from `source` ("sampled" or "held-out, greedy");
        stops following the newest."""
        self.follow_box.setChecked(False)
        for i in range(self.step_box.count()):
            if self.entries[self.step_box.itemData(i)][:2] == (step, source):
                self.step_box.setCurrentIndex(i)

    def current_entry(self) -> tuple[int, str, list] | None:
        i = self.step_box.currentData()
        return self.entries[i] if i is not None else None

    # ---------------------------------------------------------------- the table
    def _show_entry(self) -> None:
        entry = self.current_entry()
        self._fill([] if entry is None else [(entry[0], item) for item in entry[2]])

    def _fill(self, rows: list) -> None:
        names = list(dict.fromkeys(n for _, it in rows for n in it.get("rewards") or {}))
        columns = (["step", "prompt", "answer", "completion", "reward"] + names
                   + ["advantage", "length", "finished"])
        t = self.table
        t.blockSignals(True)
        t.clear()
        t.setColumnCount(len(columns))
        t.setHorizontalHeaderLabels(columns)
        t.setRowCount(len(rows))
        for r, (step, it) in enumerate(rows):
            adv = it.get("advantage")
            texts = ([str(step), it.get("prompt", ""), _text(it.get("answer")),
                      it.get("completion", ""), _number(it.get("reward"))]
                     + [_number((it.get("rewards") or {}).get(n)) for n in names]
                     + [_number(adv, "{:+.2f}"), str(it.get("length", "")),
                        "yes" if it.get("finished") else "no (clipped)"])
            tint = QColor(theme.color("good_tint")) if isinstance(adv, (int, float)) and \
                adv > 0 else QColor(theme.color("bad_tint")) if isinstance(adv, (int, float)) \
                and adv < 0 else None
            for c, text in enumerate(texts):
                cell = QTableWidgetItem(elide(text))
                if c in (1, 2, 3) and cell.text() != text:
                    cell.setToolTip(text)
                if c >= 4:
                    cell.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                if tint is not None:
                    cell.setBackground(tint)
                t.setItem(r, c, cell)
        header = t.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeToContents)
        for c in (1, 3):
            header.setSectionResizeMode(c, QHeaderView.Stretch)
        t.blockSignals(False)
        self._rows = rows
        self.hint.setVisible(not self.entries)
        self.detail.clear()

    def rows(self) -> list[list[str]]:
        """The cells' texts, row by row, as shown."""
        t = self.table
        return [[t.item(r, c).text() for c in range(t.columnCount())]
                for r in range(t.rowCount())]

    def _show_detail(self) -> None:
        selected = self.table.selectedItems()
        if not selected:
            self.detail.clear()
            return
        step, it = self._rows[selected[0].row()]
        entry = self.current_entry()
        rewards = ", ".join(f"{n} {_number(v)}" for n, v in (it.get("rewards") or {}).items())
        lines = [f"Step {step} \u00b7 {entry[1] if entry else ''} \u00b7 prompt line "
                 f"{it.get('line', '?')}, sample {it.get('sample', 0)} \u00b7 reward "
                 f"{_number(it.get('reward'))} ({rewards}) \u00b7 advantage "
                 f"{_number(it.get('advantage'), '{:+.3f}')} \u00b7 {it.get('length')} tokens, "
                 f"{'finished' if it.get('finished') else 'clipped at max new tokens'}",
                 f"Reference answer: {_text(it.get('answer'))}",
                 "", "Prompt:", str(it.get("prompt", "")),
                 "", "Completion:", str(it.get("completion", ""))]
        self.detail.setPlainText("\n".join(lines))


def _text(value) -> str:
    return "" if value is None else str(value)
