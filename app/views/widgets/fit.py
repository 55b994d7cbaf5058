"""Pieces that let a screen fit a small window (1280x720 logical pixels: a 1366x768 laptop,
1920x1080 at 150%): a row of buttons that wraps, a label that elides instead of widening its
screen, and a scroll area that scrolls a screen taller (or wider) than the window.

- `FlowLayout`: widgets left to right, wrapped onto more lines when the row is narrower than
  they are (an action row that needed 1,000 px at 1x made the window that wide). `add_stretch`
  pushes the following widgets to the right end of their line.
- `ElidedLabel`: one line of text elided (in the middle by default) to the width it gets, the
  whole text in its tooltip; its minimum width is a few characters, never the text's.
- `WrappedLabel`: word-wrapped text whose minimum height is the wrapped text's.
- `Columns`: widgets side by side when they fit, one under the other when they do not (New
  run's two columns of settings needed 1,340 px with a large font).
- `scrolled(widget)`: `widget` in a frameless scroll area (`FitArea`) that resizes it to the
  viewport, so the window's minimum size is not the widget's; it scrolls when the window is
  smaller.
"""

from __future__ import annotations

from PySide6.QtCore import QPoint, QRect, QSize, Qt
from PySide6.QtWidgets import (QBoxLayout, QFrame, QGridLayout, QLabel, QLayout, QLayoutItem, QScrollArea, QSizePolicy,
                               QStyle, QWidget)


class FlowLayout(QLayout):
    """Lays its items out in lines, wrapping where the width runs out (Qt's flow layout
    example, with stretches: `add_stretch()` right-aligns what follows on its line). An item
    wider than the line gets the line's width (wrapped text its height for that width)."""

    def __init__(self, parent: QWidget | None = None, spacing: int = 6):
        super().__init__(parent)
        self._items: list[QLayoutItem] = []
        self._breaks: set[int] = set()       # indexes of items that a stretch precedes
        self._spacing = spacing
        self.setContentsMargins(0, 0, 0, 0)

    # QLayout's interface
    def addItem(self, item: QLayoutItem) -> None:
        self._items.append(item)

    def add_stretch(self) -> None:
        """Put what is added next at the right end of its line."""
        self._breaks.add(len(self._items))

    def count(self) -> int:
        return len(self._items)

    def itemAt(self, index: int) -> QLayoutItem | None:
        return self._items[index] if 0 <= index < len(self._items) else None

    def takeAt(self, index: int) -> QLayoutItem | None:
        if 0 <= index < len(self._items):
            self._breaks = {b - (b > index) for b in self._breaks}
            return self._items.pop(index)
        return None

    def expandingDirections(self) -> Qt.Orientation:
        return Qt.Orientation(0)

    def hasHeightForWidth(self) -> bool:
        return True

    def heightForWidth(self, width: int) -> int:
        return self._place(QRect(0, 0, width, 0), move=False)

    def setGeometry(self, rect: QRect) -> None:
        super().setGeometry(rect)
        self._place(rect, move=True)

    def sizeHint(self) -> QSize:
        """All on one line."""
        items = self._visible()
        m = self.contentsMargins()
        width = sum(i.sizeHint().width() for i in items) + self._spacing * max(0, len(items) - 1)
        height = max((i.sizeHint().height() for i in items), default=0)
        return QSize(width + m.left() + m.right(), height + m.top() + m.bottom())

    def minimumSize(self) -> QSize:
        """The widest item: everything else may wrap."""
        m = self.contentsMargins()
        size = QSize()
        for item in self._visible():
            size = size.expandedTo(item.minimumSize())
        return size + QSize(m.left() + m.right(), m.top() + m.bottom())

    # placing
    def _visible(self) -> list[QLayoutItem]:
        return [i for i in self._items if not i.isEmpty()]

    @staticmethod
    def _expands(item: QLayoutItem) -> bool:
        return bool(item.expandingDirections() & Qt.Horizontal)

    def _want(self, item: QLayoutItem, width: int) -> int:
        """The width `item` asks for on a line of `width`: its size hint; an expanding item
        (wrapped text) at least a third of the line, it then takes the rest of its line."""
        if self._expands(item):
            return max(item.minimumSize().width(), width // 3)
        return item.sizeHint().width()

    def _lines(self, width: int) -> list[list[tuple[int, QLayoutItem, int]]]:
        """[(index, item, width)] per line."""
        lines: list[list[tuple[int, QLayoutItem, int]]] = [[]]
        used = 0
        for index, item in enumerate(self._items):
            if item.isEmpty():
                continue
            w = self._want(item, width)
            if lines[-1] and used + self._spacing + w > width:
                lines.append([])
                used = 0
            used += (self._spacing if lines[-1] else 0) + w
            lines[-1].append((index, item, w))
        for line in lines:                   # an expanding item takes the rest of its line
            rest = width - sum(w for *_, w in line) - self._spacing * max(0, len(line) - 1)
            for k, (index, item, w) in enumerate(line):
                if self._expands(item) and rest > 0:
                    line[k] = (index, item, w + rest)
                    rest = 0
        return lines

    def _place(self, rect: QRect, move: bool) -> int:
        m = self.contentsMargins()
        area = rect.adjusted(m.left(), m.top(), -m.right(), -m.bottom())
        y = area.y()
        for line in self._lines(area.width()):
            if not line:
                continue
            widths = [min(w, area.width()) for *_, w in line]
            heights = [item.heightForWidth(w) if item.hasHeightForWidth()
                       else item.sizeHint().height() for (_, item, _), w in zip(line, widths)]
            height = max(heights)
            if move:
                # from a stretch on: at the right end (its line's rest, and the lines after)
                first = min(self._breaks, default=len(self._items))
                split = next((k for k, (index, *_) in enumerate(line) if index >= first),
                             len(line))
                tail = sum(widths[split:]) + self._spacing * max(0, len(line) - split - 1)
                x = area.x()
                for k, ((_, item, _), w, h) in enumerate(zip(line, widths, heights)):
                    if k == split:
                        x = max(x, area.right() + 1 - tail)
                    item.setGeometry(QRect(QPoint(x, y + (height - h) // 2), QSize(w, h)))
                    x += w + self._spacing
            y += height + self._spacing
        return y - self._spacing - area.y() + m.top() + m.bottom() if y > area.y() else 0


class ElidedLabel(QLabel):
    """A one-line label that elides its text (`mode`, default in the middle) to its width;
    the whole text is its tooltip when it does not fit. `text()` is the whole text."""

    def __init__(self, text: str = "", parent: QWidget | None = None, *,
                 mode: Qt.TextElideMode = Qt.ElideMiddle, **kwargs):
        super().__init__(parent, **kwargs)
        self._text = ""
        self._mode = mode
        self.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.setText(text)

    def setText(self, text: str) -> None:
        self._text = text or ""
        self._elide()

    def text(self) -> str:
        return self._text

    def minimumSizeHint(self) -> QSize:
        hint = super().minimumSizeHint()
        return QSize(min(hint.width(), self.fontMetrics().horizontalAdvance("M") * 6),
                     hint.height())

    def sizeHint(self) -> QSize:
        hint = super().sizeHint()
        return QSize(self.fontMetrics().horizontalAdvance(self._text) + 4, hint.height())

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._elide()

    def changeEvent(self, event) -> None:
        super().changeEvent(event)
        if event.type() in (event.Type.FontChange, event.Type.StyleChange):
            self._elide()

    def _elide(self) -> None:
        shown = self.fontMetrics().elidedText(self._text, self._mode, max(self.width(), 1))
        super().setText(shown)
        self.setToolTip(self._text if shown != self._text else "")


class Columns(QWidget):
    """`columns` side by side (equal stretch) when the width allows their minimum widths,
    else stacked in one column. Its minimum width is the widest column's, so a scroll area
    around it (widgetResizable) narrows it instead of scrolling sideways."""

    def __init__(self, columns: list[QWidget], parent: QWidget | None = None, *,
                 spacing: int = 16, margins: tuple[int, int, int, int] = (0, 0, 0, 0),
                 **kwargs):
        super().__init__(parent, **kwargs)
        self.columns = list(columns)
        self.stacked: bool | None = None
        self._grid = QGridLayout(self)
        self._grid.setSpacing(spacing)
        self._grid.setContentsMargins(*margins)
        self._arrange(False)

    def _needed(self) -> int:
        m = self._grid.contentsMargins()
        return (sum(c.minimumSizeHint().width() for c in self.columns)
                + self._grid.horizontalSpacing() * (len(self.columns) - 1)
                + m.left() + m.right())

    def _arrange(self, stacked: bool) -> None:
        if stacked == self.stacked:
            return
        self.stacked = stacked
        for c in self.columns:
            self._grid.removeWidget(c)
        for i in range(len(self.columns)):
            self._grid.setColumnStretch(i, 0)
            self._grid.setRowStretch(i, 0)
        for i, c in enumerate(self.columns):
            self._grid.addWidget(c, i if stacked else 0, 0 if stacked else i)
            if not stacked:
                self._grid.setColumnStretch(i, 1)
        self._grid.setRowStretch(len(self.columns) if stacked else 1, 1)
        self.updateGeometry()

    def minimumSizeHint(self) -> QSize:
        m = self._grid.contentsMargins()
        width = max((c.minimumSizeHint().width() for c in self.columns), default=0)
        return QSize(width + m.left() + m.right(), super().minimumSizeHint().height())

    def resizeEvent(self, event) -> None:
        self._arrange(event.size().width() < self._needed())
        super().resizeEvent(event)


def least_height(layout: QLayout | None, width: int) -> int:
    """The least height of a vertical box `layout` at `width`: its stretching items (the
    plots, tabs and tables that take the rest) at their minimum height, the others (rows of
    buttons that wrap, wrapped text) at their height for that width. Qt's own
    `minimumHeightForWidth` counts a wrapping widget anywhere in a stretching item (a label
    in a tab page) at its preferred height for the width. 0 for any other layout."""
    if not isinstance(layout, QBoxLayout) or layout.direction() not in (
            QBoxLayout.TopToBottom, QBoxLayout.BottomToTop):
        return 0
    m = layout.contentsMargins()
    inner = width - m.left() - m.right()
    heights = []
    for i in range(layout.count()):
        item = layout.itemAt(i)
        if item.isEmpty():
            continue
        if layout.stretch(i) == 0 and item.hasHeightForWidth():
            heights.append(item.heightForWidth(inner))
        else:
            heights.append(item.minimumSize().height())
    return sum(heights) + layout.spacing() * max(0, len(heights) - 1) + m.top() + m.bottom()


class FitArea(QScrollArea):
    """A frameless scroll area that gives its widget the viewport's size, or the widget's
    minimum where the viewport is smaller (then it scrolls). Unlike `widgetResizable`, which
    gives a widget with wrapping text its preferred height for the width (Monitor became
    1,400 px tall and scrolled), it gives the least height the widget's layout accepts."""

    def __init__(self, widget: QWidget, parent: QWidget | None = None, **kwargs):
        super().__init__(parent, frameShape=QFrame.NoFrame, **kwargs)
        self.setWidgetResizable(False)
        self.setWidget(widget)
        self.setAutoFillBackground(False)
        self.viewport().setAutoFillBackground(False)
        widget.installEventFilter(self)

    def needed(self, width: int) -> QSize:
        """The widget's least size at `width` (or its minimum width, if more)."""
        widget = self.widget()
        hint = widget.minimumSizeHint().expandedTo(widget.minimumSize())
        width = max(width, hint.width())
        return QSize(width, max(hint.height(), least_height(widget.layout(), width)))

    def fit(self) -> None:
        widget = self.widget()
        if widget is None:
            return
        bar = scroll_bar_width(self)
        full = self.maximumViewportSize()          # the viewport without scroll bars
        size = self.needed(full.width())
        if size.height() > full.height():           # a vertical bar takes its width
            size = self.needed(full.width() - bar)
        if size.width() > full.width():             # and a horizontal one its height
            full.setHeight(full.height() - bar)
        widget.resize(size.width(), max(size.height(), full.height()
                                        - (bar if size.height() > full.height() else 0)))

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.fit()

    def eventFilter(self, watched, event) -> bool:
        if watched is self.widget() and event.type() == event.Type.LayoutRequest:
            self.fit()
        return super().eventFilter(watched, event)

    def viewportEvent(self, event) -> bool:
        if event.type() == event.Type.LayoutRequest:    # the widget's hints changed
            self.fit()
        return super().viewportEvent(event)


class WrappedLabel(QLabel):
    """A word-wrapped label whose minimum height is its text's height at its width: a
    splitter or a squeezed layout, which ask for minimum sizes only, never cut its last
    lines."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, wordWrap=True, **kwargs)
        self._width = -1

    def minimumSizeHint(self) -> QSize:
        hint = super().minimumSizeHint()
        if self.width() > 0 and self.text():
            hint.setHeight(max(hint.height(), self.heightForWidth(self.width())))
        return hint

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if event.size().width() != self._width:
            self._width = event.size().width()
            self.updateGeometry()


def scrolled(widget: QWidget, name: str = "screenScroll") -> FitArea:
    """`widget` in a `FitArea`; its background is its parent's."""
    return FitArea(widget, objectName=name)


def scroll_bar_width(widget: QWidget) -> int:
    """The width of a vertical scroll bar in `widget`'s style."""
    return widget.style().pixelMetric(QStyle.PM_ScrollBarExtent, None, widget)


__all__ = ["Columns", "ElidedLabel", "FitArea", "FlowLayout", "WrappedLabel", "scroll_bar_width",
           "scrolled"]
