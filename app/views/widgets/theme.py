"""The window's colours, in one place: a light and a dark palette, the style sheet built from
them, and the switch between them.

Which theme: `WORKBENCH_THEME` (`light`, `dark` or `system`, the default), else the system's
colour scheme (`QStyleHints.colorScheme()`, Qt 6.5 or later; light when it is unknown). With
`system`, the window follows a live change of the system's scheme (`colorSchemeChanged`).

Screens never write a colour: they ask `color(name)` (the current theme's), and what must change
when the theme changes (a plot's background and pens, a table's tints) registers with
`follow(widget, restyle)`. A colour set once and kept by an item (a curve's pen) is moved to
the other theme by `translate`: each name has one colour in each palette, so a colour of the
old palette maps to the same name's colour in the new one.

`apply_theme(app, font_scale=1.5)` also scales the application's font and every font size of
the style sheet (the tests use it for a large-text desktop, which is what grows widgets against
a 1280x720 window at 150% scaling).
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Callable
from string import Template

from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QWidget

MODES = ("light", "dark", "system")
ENV = "WORKBENCH_THEME"

# name: (light, dark); the two palettes have the same names, so a colour of one moves to
# the same name's in the other (`translate`). A colour found on screen must name one pair: two
# names with the same colour in one palette have the same in the other too (a shade apart
# where they differ: "#56d365", "#56d366"), or a theme switch there and back changes a curve
# into another name's colour (tests/views/widgets/test_theme.py).
COLORS = {
    # window
    "base": ("#ffffff", "#1e2227"),
    "text": ("#1f2328", "#e6e8eb"),
    "menubar": ("#f3f4f6", "#262b31"),
    "panel": ("#f6f7f9", "#23272d"),
    "border": ("#e1e4e8", "#3b424b"),
    "muted": ("#6a737d", "#9aa3ad"),
    "faint": ("#8a929a", "#7d8590"),
    "input_border": ("#d0d5db", "#4a525c"),
    "accent": ("#2f6fde", "#4a86f0"),
    "accent_hover": ("#2a63c7", "#3b74d9"),
    "hover": ("#f0f2f5", "#2c3238"),
    "list_hover": ("#e9ecf0", "#2c3239"),
    "selected": ("#dce7fb", "#24406e"),
    "heading": ("#3a4047", "#c9d1d9"),
    "title": ("#2f3a48", "#dfe5ec"),
    "hint": ("#4d545c", "#aeb6bf"),
    "track": ("#e6e9ed", "#333a42"),
    "card_bg": ("#fafbfc", "#22262c"),
    "output_bg": ("#fbfcfd", "#1a1d21"),
    "badge_bg": ("#e7eefc", "#1f3a66"),
    "info": ("#2552a8", "#9cc0ff"),
    "moe_bg": ("#fdefe2", "#4a2e16"),
    "moe_text": ("#a44e14", "#f0b27a"),
    "error_bg": ("#fff6f5", "#3a2225"),
    "error_border": ("#f3c6c1", "#6e3530"),
    "error_edge": ("#d1453b", "#f0645a"),
    "error_title": ("#8e1f17", "#ff9b92"),
    "bad": ("#c0392b", "#ff7b72"),
    "bad_bg": ("#ffebe9", "#4a2323"),
    "good": ("#1a7f37", "#56d364"),
    "good_bg": ("#dafbe1", "#1c3b27"),
    "warn": ("#a15c07", "#e3a341"),
    "disabled_text": ("#a0a7ae", "#6b737c"),
    "primary_disabled": ("#a9c1ee", "#2c4370"),
    "primary_disabled_text": ("#f4f7fd", "#8a98b5"),
    "progress_chunk": ("#a9c4f2", "#2f5597"),
    "done": ("#2e7d4f", "#56d366"),
    # plots and tints
    "plot_bg": ("#ffffff", "#1e2227"),
    "plot_title": ("#3a4047", "#c9d1d9"),
    "axis_text": ("#4d545d", "#b4bcc5"),
    "axis": ("#aab1b8", "#5d6670"),
    "raw_curve": ("#9db8ec", "#4f6f9e"),
    "orange": ("#e08a1e", "#f0a040"),
    "legend_text": ("#1f2328", "#e6e8eb"),
    "legend_bg": ("#ffffffd7", "#1e2227d7"),
    "trained_bg": ("#c9f0d3", "#1f4a2c"),
    "good_tint": ("#e3f4e8", "#1c3b28"),
    "bad_tint": ("#fbe7e5", "#4a2324"),
    "curve1": ("#d1453c", "#ff7b73"),
    "curve2": ("#2e9d5b", "#56d365"),
    "curve3": ("#8e44ad", "#c297ff"),
    "curve4": ("#e08a1e", "#f0a040"),
    "curve5": ("#16a2b8", "#39c5cf"),
    "curve6": ("#7f8c8d", "#a0acb0"),
    "curve7": ("#c2185b", "#f06292"),
}
LIGHT = {name: light for name, (light, _) in COLORS.items()}
DARK = {name: dark for name, (_, dark) in COLORS.items()}
CURVES = tuple(f"curve{i}" for i in range(1, 8))

STYLE = """
QMainWindow, #content, #cardBody { background: $base; }
QWidget { color: $text; font-size: 10pt; }
QMenuBar { background: $menubar; border-bottom: 1px solid $border; }
QToolTip { color: $text; background: $panel; border: 1px solid $border; }

#sidebar { background: $panel; border-right: 1px solid $border; }
#sectionHeader { color: $muted; font-size: 8pt; font-weight: 600; letter-spacing: 1px; }
#sidebarHint { color: $faint; }

QLineEdit {
    background: $base; border: 1px solid $input_border; border-radius: 5px; padding: 5px 7px;
    selection-background-color: $accent;
}
QLineEdit:focus { border-color: $accent; }

QPushButton {
    background: $base; border: 1px solid $input_border; border-radius: 5px; padding: 6px 14px;
}
QPushButton:hover { background: $hover; }
QPushButton#primaryButton { background: $accent; border-color: $accent_hover; color: #ffffff;
                            font-weight: 600; }
QPushButton#primaryButton:hover { background: $accent_hover; }

#recentList { background: transparent; border: none; outline: none; }
#recentList::item { padding: 6px 8px; border-radius: 5px; }
#recentList::item:hover { background: $list_hover; }
#recentList::item:selected { background: $selected; color: $text; }

#pageTitle { font-size: 14pt; font-weight: 600; color: $heading; }
#pageSubtitle { color: $muted; }
QProgressBar { background: $track; border: none; border-radius: 3px; }

#cardTitle { font-size: 17pt; font-weight: 600; }
#cardPath { color: $muted; }
#badge {
    background: $badge_bg; color: $info; border-radius: 9px; padding: 2px 9px;
    font-size: 9pt; font-weight: 600;
}
#badge[variant="moe"] { background: $moe_bg; color: $moe_text; }
#cardRows { background: $card_bg; border: 1px solid $track; border-radius: 8px; }
#cardLabel { font-weight: 600; color: $heading; }
#cardValue { color: $text; }

#errorCard { background: $error_bg; border: 1px solid $error_border;
             border-left: 4px solid $error_edge; border-radius: 8px; }
#errorTitle { font-size: 13pt; font-weight: 600; color: $error_title; }
#errorHint { color: $hint; }
#detailsToggle { border: none; color: $accent; padding: 2px 0; background: transparent; }
#errorDetails { background: $base; border: 1px solid $track; border-radius: 5px;
                font-size: 9pt; }

#navPanel { background: $panel; border-right: 1px solid $border; }
#appTitle { font-size: 12pt; font-weight: 700; color: $title; padding: 2px 6px 8px 6px; }
#navList { background: transparent; border: none; outline: none; font-size: 10.5pt; }
#navList::item { padding: 9px 10px; border-radius: 6px; margin: 1px 0; }
#navList::item:hover { background: $list_hover; }
#navList::item:selected { background: $selected; color: $text; font-weight: 600; }
#actionBar { background: $panel; border-top: 1px solid $border; }
#fieldError { color: $bad; font-size: 9pt; }
#formLabel { color: $heading; }
#hint, #lintSummary, #runSummary { color: $hint; }
#memoryEstimate { color: $info; font-weight: 600; padding: 4px 0; }
#paramCount { color: $muted; font-size: 9pt; }
#trainableTotal { color: $info; }
#workerState[state="running"] { color: $good; font-weight: 600; }
#workerState[state="stopped"] { color: $muted; }
#reportBadge[ok="true"] { background: $good_bg; color: $good; border-radius: 9px;
                          padding: 3px 10px; font-weight: 700; }
#reportBadge[ok="false"] { background: $bad_bg; color: $bad; border-radius: 9px;
                           padding: 3px 10px; font-weight: 700; }
#outputView, #exampleView, #reportText { background: $output_bg; border: 1px solid $border;
                                         border-radius: 5px; }
#runsProblem { color: $warn; }
#tokenWarning { color: $warn; font-weight: 600; }
#testResult[ok="true"] { color: $good; font-weight: 600; }
#testResult[ok="false"] { color: $bad; font-weight: 600; }
QSpinBox:disabled, QDoubleSpinBox:disabled, QComboBox:disabled { color: $disabled_text; }
QGroupBox { font-weight: 600; border: 1px solid $border; border-radius: 6px; margin-top: 14px;
            padding-top: 6px; }
QGroupBox::title { subcontrol-origin: margin; left: 8px; padding: 0 4px; color: $heading; }
QTabBar::tab { padding: 7px 16px; }
QPushButton:disabled { color: $disabled_text; background: $panel; border-color: $border; }
QPushButton#primaryButton:disabled { background: $primary_disabled;
                                     border-color: $primary_disabled;
                                     color: $primary_disabled_text; }
#statusMessage { color: $hint; padding-left: 12px; }
QProgressBar { color: $text; text-align: center; }
QProgressBar::chunk { background: $progress_chunk; border-radius: 3px; }
QTabBar::tab:selected { font-weight: 600; }
"""
_PT = re.compile(r"(\d+(?:\.\d+)?)pt\b")
_HEX = re.compile(r"#[0-9a-fA-F]{6}(?:[0-9a-fA-F]{2})?\b")


def requested_mode() -> str:
    """`WORKBENCH_THEME` when it names a mode, else "system"."""
    mode = os.environ.get(ENV, "").strip().lower()
    return mode if mode in MODES else "system"


def system_is_dark() -> bool:
    """Does the system ask for a dark scheme? (False before Qt 6.5 or when it is unknown.)"""
    app = QGuiApplication.instance()
    hints = app.styleHints() if app is not None else None
    scheme = getattr(hints, "colorScheme", None)
    return scheme is not None and scheme() == Qt.ColorScheme.Dark


def style_sheet(colors: dict[str, str], font_scale: float = 1.0) -> str:
    """The application's style sheet in `colors`, every font size times `font_scale`."""
    sheet = Template(STYLE).substitute(colors)
    if font_scale != 1.0:
        sheet = _PT.sub(lambda m: f"{float(m.group(1)) * font_scale:.4g}pt", sheet)
    return sheet


def qt_palette(colors: dict[str, str]) -> QPalette:
    """A QPalette for the Fusion style in `colors` (what the style sheet does not paint:
    tables, spin boxes, combo boxes, scroll bars, menus)."""
    c = {name: QColor(value) for name, value in colors.items()}
    p = QPalette()
    roles = {QPalette.Window: "base", QPalette.WindowText: "text", QPalette.Base: "base",
             QPalette.AlternateBase: "card_bg", QPalette.Text: "text", QPalette.Button: "panel",
             QPalette.ButtonText: "text", QPalette.BrightText: "bad",
             QPalette.Highlight: "accent", QPalette.HighlightedText: "base",
             QPalette.ToolTipBase: "panel", QPalette.ToolTipText: "text",
             QPalette.PlaceholderText: "faint", QPalette.Link: "accent",
             QPalette.Light: "hover", QPalette.Midlight: "border", QPalette.Mid: "input_border",
             QPalette.Dark: "axis", QPalette.Shadow: "muted"}
    for role, name in roles.items():
        p.setColor(role, c[name])
    p.setColor(QPalette.HighlightedText, QColor("#ffffff"))
    for role in (QPalette.WindowText, QPalette.Text, QPalette.ButtonText):
        p.setColor(QPalette.Disabled, role, c["disabled_text"])
    return p


class Theme(QObject):
    """The current theme (one per process: `current()`); `changed` after every switch."""

    changed = Signal()

    def __init__(self):
        super().__init__()
        self.mode = requested_mode()
        self.dark = False
        self.font_scale = 1.0
        self._base_font_pt: float | None = None
        self._followers: list[tuple[weakref.ref, Callable[[QWidget], None]]] = []
        self._listening = False
        self._system_dark: bool | None = None     # as colorSchemeChanged last said

    def system_dark(self) -> bool:
        """The system's scheme: what its last change said, else what Qt reports."""
        return self._system_dark if self._system_dark is not None else system_is_dark()

    @property
    def colors(self) -> dict[str, str]:
        return DARK if self.dark else LIGHT

    def apply(self, app: QApplication | None = None, mode: str | None = None,
              font_scale: float | None = None) -> None:
        app = app or QApplication.instance()
        if mode is not None:
            if mode not in MODES:
                raise ValueError(f"theme {mode!r}: use one of {', '.join(MODES)}")
            self.mode = mode
        if font_scale is not None:
            self.font_scale = font_scale
        self.dark = self.mode == "dark" or (self.mode == "system" and self.system_dark())
        if app is None:
            return
        if not self._listening:
            hints = app.styleHints()
            if hasattr(hints, "colorSchemeChanged"):
                hints.colorSchemeChanged.connect(self._on_system_scheme)
            self._listening = True
        font = app.font()
        if self._base_font_pt is None:
            self._base_font_pt = font.pointSizeF()
        font.setPointSizeF(self._base_font_pt * self.font_scale)
        app.setFont(font)
        if self.dark or self.system_dark():
            app.setPalette(qt_palette(self.colors))
        else:                               # a light system: the style's own light palette
            app.setPalette(app.style().standardPalette())
        app.setStyleSheet(style_sheet(self.colors, self.font_scale))
        self._restyle_followers()
        self.changed.emit()

    def _on_system_scheme(self, scheme: Qt.ColorScheme) -> None:
        """The system's scheme changed: switch after the signal's other receivers (Qt's own
        palette and style updates) have run, not inside its emission."""
        self._system_dark = scheme == Qt.ColorScheme.Dark
        QTimer.singleShot(0, self._follow_system)

    def _follow_system(self) -> None:
        if self.mode == "system" and self.system_dark() != self.dark:
            self.apply()

    def follow(self, widget: QWidget, restyle: Callable[[QWidget], None],
               now: bool = True) -> None:
        """Call `restyle(widget)` now (unless not `now`) and after every switch, while
        `widget` lives."""
        if now:
            restyle(widget)
        self._followers.append((weakref.ref(widget), restyle))

    def _restyle_followers(self) -> None:
        from shiboken6 import isValid

        alive = []
        for ref, restyle in self._followers:
            widget = ref()
            if widget is None or not isValid(widget):
                continue
            alive.append((ref, restyle))
            restyle(widget)
        self._followers = alive


_current: Theme | None = None


def current() -> Theme:
    global _current
    if _current is None:
        _current = Theme()
        _current.dark = _current.mode == "dark" or (_current.mode == "system"
                                                    and system_is_dark())
    return _current


def apply_theme(app: QApplication | None = None, mode: str | None = None,
                font_scale: float | None = None) -> Theme:
    """Apply the theme (`mode`: light, dark or system; default `WORKBENCH_THEME`) and the
    font scale to `app`; restyles every follower and emits `changed`."""
    theme = current()
    theme.apply(app, mode, font_scale)
    return theme


def color(name: str) -> str:
    """The current theme's colour `name` (a key of LIGHT)."""
    return current().colors[name]


def is_dark() -> bool:
    return current().dark


def follow(widget: QWidget, restyle: Callable[[QWidget], None], now: bool = True) -> None:
    current().follow(widget, restyle, now)


_OTHER: dict[str, str] = {}


def translate(value: str) -> str:
    """A colour of either palette (#rrggbb or #rrggbbaa, any case) as the same name's colour
    in the current one; any other colour unchanged. Text with colours in it (HTML) has each
    translated."""
    if not _OTHER:
        for name, light in LIGHT.items():
            _OTHER.setdefault(light.lower(), name)
            _OTHER.setdefault(DARK[name].lower(), name)
    colors = current().colors

    def one(match: re.Match) -> str:
        name = _OTHER.get(match.group(0).lower())
        return colors[name] if name is not None else match.group(0)

    return _HEX.sub(one, value)
