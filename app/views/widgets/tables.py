"""Filling a QTableWidget with text: one item per cell, its whole text in its tooltip (a
narrow column elides it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from PySide6.QtWidgets import QTableWidget, QTableWidgetItem


def fill_rows(table: QTableWidget, rows: Sequence[Sequence[str]],
              tip: Callable[[int, int, str], str] = lambda _row, _column, text: text) -> None:
    """Set `table`'s rows to `rows` (a short row leaves its last cells empty); each cell's
    tooltip is `tip(row, column, text)` (default: the text)."""
    table.setRowCount(len(rows))
    for r, texts in enumerate(rows):
        for c, text in enumerate(texts):
            item = QTableWidgetItem(text)
            item.setToolTip(tip(r, c, text))
            table.setItem(r, c, item)
