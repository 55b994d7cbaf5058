"""The Experts screen: where the LoRA update goes, and where the router sends the tokens.

Left, the norm of each adapter's update ||s B A|| from the run's `norms` events: layers (rows)
by experts (columns), per projection (gate, up, down, or all: the square root of the sum of
squares), or for dense models (and on request) layers by modules (attn_q/k/v/output,
ffn_gate/up/down, router, shared experts...). Right, the router load from `routing` events:
the share of tokens each expert received, in the last interval or averaged since the start.
A step slider replays how both grew. Warnings name experts that receive no tokens and adapters
that barely changed.

Test-visible state: `norm_image.image`, `routing_image.image` (row-major: layers x columns),
`columns` (the column labels), `warnings()`.
"""

from __future__ import annotations

import bisect
import math
import re
import warnings as _warnings

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QSize, Qt
from PySide6.QtWidgets import (QCheckBox, QComboBox, QHBoxLayout, QLabel, QListWidget,
                               QListWidgetItem, QSlider, QStyle, QVBoxLayout, QWidget)

from app.engine.api import RunDir
from app.views.widgets import theme
from app.views.widgets.fit import ElidedLabel
from app.views.widgets.plots import themed
from app.views.widgets.run_tail import PacedRedraw, RunTail

PROJECTIONS = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}
MODULE_ORDER = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate",
                "ffn_up", "ffn_down", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
MODULE_LABELS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "out",
                 "ffn_gate_inp": "router", "ffn_gate": "gate", "ffn_up": "up",
                 "ffn_down": "down", "ffn_gate_exps": "E gate", "ffn_up_exps": "E up",
                 "ffn_down_exps": "E down", "ffn_gate_inp_shexp": "S router",
                 "ffn_gate_shexp": "S gate", "ffn_up_shexp": "S up", "ffn_down_shexp": "S down"}


def modules_axis(kinds: list[str]) -> str:
    notes = ["E = all experts"] if any(k.endswith("_exps") for k in kinds) else []
    notes += ["S = shared expert"] if any(k.endswith("_shexp") for k in kinds) else []
    return "module" + (f" ({', '.join(notes)})" if notes else "")
TINY_FRACTION = 0.01        # an adapter below 1% of the largest update "barely changed"
_NAME = re.compile(r"^blk\.(\d+)\.(.+?)(?:\.weight)?$")


def parse_norms(event: dict) -> dict[tuple[int, str], np.ndarray]:
    """{(layer, tensor kind): per-expert (or single) delta norms} of a norms event."""
    out = {}
    for name, value in (event.get("tensors") or {}).items():
        m = _NAME.match(name)
        if m and isinstance(value, dict) and value.get("delta"):
            out[(int(m.group(1)), m.group(2))] = np.asarray(value["delta"], dtype=float)
    return out


def is_moe(parsed: dict) -> bool:
    return any(kind in PROJECTIONS.values() for _, kind in parsed)


def expert_matrix(parsed: dict, projection: str = "all") -> np.ndarray:
    """(layers, experts) update norms; layers without expert adapters are NaN."""
    kinds = list(PROJECTIONS.values()) if projection == "all" else [PROJECTIONS[projection]]
    cells = {k: v for k, v in parsed.items() if k[1] in kinds}
    if not cells:
        return np.zeros((0, 0))
    n_layers = 1 + max(layer for layer, _ in parsed)
    n_experts = max(len(v) for v in cells.values())
    sq = np.full((n_layers, n_experts), np.nan)
    for (layer, _), v in cells.items():
        row = sq[layer, :len(v)]
        sq[layer, :len(v)] = np.where(np.isnan(row), 0.0, row) + v * v
    return np.sqrt(sq)


def module_matrix(parsed: dict) -> tuple[np.ndarray, list[str]]:
    """(layers, modules) update norms (expert tensors: over all experts), and the modules."""
    kinds = sorted({k for _, k in parsed}, key=lambda k: (
        MODULE_ORDER.index(k) if k in MODULE_ORDER else len(MODULE_ORDER), k))
    if not kinds:
        return np.zeros((0, 0)), []
    n_layers = 1 + max(layer for layer, _ in parsed)
    out = np.full((n_layers, len(kinds)), np.nan)
    for (layer, kind), v in parsed.items():
        out[layer, kinds.index(kind)] = math.sqrt(float(np.sum(v * v)))
    return out, kinds


def routing_matrix(events: list[dict]) -> np.ndarray:
    """(layers, experts) share of tokens, averaged over `events`; NaN where unknown."""
    rows: dict[int, list] = {}
    for ev in events:
        for layer, share in (ev.get("layers") or {}).items():
            rows.setdefault(int(layer), []).append(np.asarray(share, dtype=float))
    if not rows:
        return np.zeros((0, 0))
    n_experts = max(len(s) for v in rows.values() for s in v)
    out = np.full((1 + max(rows), n_experts), np.nan)
    for layer, shares in rows.items():
        same = [s for s in shares if len(s) == n_experts]
        if same:
            out[layer] = np.mean(same, axis=0)
    return out


def group_cells(cells, what: str, column_name: str) -> list[str]:
    """'Layer 2: experts 1, 5 <what>' lines from (layer, column label) pairs."""
    by_layer: dict[int, list] = {}
    for layer, col in cells:
        by_layer.setdefault(layer, []).append(str(col))
    return [f"Layer {layer}: {column_name}{'s' if len(cols) > 1 else ''} {', '.join(cols)} "
            f"{what}" for layer, cols in sorted(by_layer.items())]


class Heatmap(pg.PlotWidget):
    """An ImageItem (row-major, row 0 at the top) with a ColorBarItem and labelled axes."""

    def __init__(self, title: str, cmap: str):
        super().__init__()
        themed(self)                            # background, axes, title: the theme's
        self.setTitle(title, color=theme.color("plot_title"), size="10pt")
        self.image_item = pg.ImageItem(axisOrder="row-major")
        self.addItem(self.image_item)
        self.invertY(True)
        self.setMouseEnabled(x=False, y=False)
        self.hideButtons()
        self.getPlotItem().setMenuEnabled(False)
        for axis in ("left", "bottom"):
            self.getAxis(axis).setTextPen(theme.color("axis_text"))
            self.getAxis(axis).setPen(theme.color("axis"))
        self.bar = pg.ColorBarItem(values=(0, 1), colorMap=cmap, interactive=False, width=14)
        self.bar.setImageItem(self.image_item, insert_in=self.getPlotItem())
        self.bar.getAxis("right").setTextPen(theme.color("axis_text"))
        self.setMinimumSize(280, 240)
        self.getAxis("left").setWidth(36)
        self._layout_key = None

    def show(self, matrix: np.ndarray | None, columns: list[str], x_label: str) -> None:
        """Show `matrix` (rows: layers); axes and ranges change only with the shape/labels."""
        if matrix is None or matrix.size == 0:
            if self.image_item.image is not None:
                self.image_item.clear()
                self.image_item.image = None
            return
        top = float(np.nanmax(matrix)) if np.isfinite(matrix).any() else 1.0
        self.image_item.setImage(matrix, autoLevels=False)
        if self.bar.levels() != (0.0, top if top > 0 else 1.0):
            self.bar.setLevels((0.0, top if top > 0 else 1.0))
        rows, cols = matrix.shape
        key = (rows, cols, tuple(columns), x_label)
        if key != self._layout_key:
            self._layout_key = key
            every = max(1, math.ceil(cols / 16))
            self.getAxis("bottom").setTicks(
                [[(c + 0.5, columns[c]) for c in range(0, cols, every)]])
            step = max(1, math.ceil(rows / 24))
            self.getAxis("left").setTicks([[(r + 0.5, str(r)) for r in range(0, rows, step)]])
            self.setLabel("bottom", x_label, color=theme.color("axis_text"))
            self.setLabel("left", "layer", color=theme.color("axis_text"))
            self.setRange(xRange=(0, cols), yRange=(0, rows), padding=0)


class ExpertsView(QWidget):
    """Follows `ctx.run_selected`; see the module docstring."""

    def __init__(self, ctx, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.run_path: str | None = None
        self._norms: list[dict] = []
        self._routing_steps: list[int] = []
        self._routing = np.zeros((0, 0, 0))     # (capacity, layers, experts); first n used
        self._is_moe = False
        self._total_steps = 0                   # status.json's total_steps; 0: not known yet
        self._warnings: list[str] = []
        self._norm_warnings: list[str] = []
        self._routing_warnings: list[str] = []
        self.columns: list[str] = []          # column labels of the norm heatmap
        self.kinds: list[str] = []            # their tensor kinds (or expert numbers)
        self._build()
        self._layout()
        self._connect()
        self._redraw()
        if getattr(ctx, "current_run", None):
            self.set_run(ctx.current_run)

    def _build(self) -> None:
        self.tail = RunTail(self, read_log=False)
        self.title = QLabel("Experts", objectName="pageTitle")
        self.subtitle = ElidedLabel("No run selected.", objectName="pageSubtitle")   # a path
        self.view_combo = QComboBox()
        self.view_combo.addItems(["Experts", "Modules"])
        self.projection = QComboBox()
        self.projection.addItems(["all", "gate", "up", "down"])
        self.window_combo = QComboBox()
        self.window_combo.addItems(["since start", "last interval"])
        self.slider = QSlider(Qt.Horizontal, minimum=0, maximum=0)
        self.step_label = ElidedLabel("no norms yet", mode=Qt.ElideRight)
        self.follow = QCheckBox("Follow latest", checked=True)
        self.redraw = PacedRedraw(self)          # one heatmap per pass of the event loop
        self.norm_plot = Heatmap("LoRA update norm \u2016s\u00b7B\u00b7A\u2016", "viridis")
        self.routing_plot = Heatmap("Router load (share of tokens)", "inferno")
        self.norm_image = self.norm_plot.image_item
        self.routing_image = self.routing_plot.image_item
        self.hover = ElidedLabel(" ", objectName="pageSubtitle", mode=Qt.ElideRight)
        self.warning_list = QListWidget(maximumHeight=110)
        self.warning_list.setIconSize(QSize(16, 16))
        self.moe_controls = QWidget()             # hidden for dense models
        self.dense_note = QLabel("Dense model (no experts, no router): update norms per layer "
                                 "and module.", objectName="pageSubtitle")
        self.dense_note.hide()
        self._set_tooltips()

    def _set_tooltips(self) -> None:
        """What each control does (the records come every `norms_every` steps)."""
        self.view_combo.setToolTip("Experts: layers by experts, for the projection chosen "
                                   "beside. Modules: layers by adapted modules (attention, FFN, "
                                   "router, shared experts...).")
        self.projection.setToolTip("Which expert projection's update norm the left heatmap "
                                   "shows; all: the square root of the sum of their squares.")
        self.window_combo.setToolTip("Router load over the whole run so far (since start) or "
                                     "in the last recorded interval only.")
        self.slider.setToolTip("Replay the recorded steps (one record every norms_every "
                               "steps): both heatmaps show the record at or before the step.")
        self.follow.setToolTip("Jump to each new record as the run writes it; moving the "
                               "slider back turns this off.")

    def _layout(self) -> None:
        head = QVBoxLayout()
        head.addWidget(self.title)
        head.addWidget(self.subtitle)
        controls = QHBoxLayout(self.moe_controls)
        controls.setContentsMargins(0, 0, 0, 0)
        for label, widget in (("Show", self.view_combo), ("Projection", self.projection),
                              ("Router load", self.window_combo)):
            controls.addWidget(QLabel(label))
            controls.addWidget(widget)
            controls.addSpacing(10)
        controls.addStretch(1)
        replay = QHBoxLayout()
        replay.addWidget(QLabel("Step"))
        replay.addWidget(self.slider, 1)
        replay.addWidget(self.step_label)
        replay.addWidget(self.follow)
        plots = QHBoxLayout()
        plots.addWidget(self.norm_plot, 1)
        plots.addWidget(self.routing_plot, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(20, 16, 20, 16)
        layout.addLayout(head)
        layout.addWidget(self.moe_controls)
        layout.addWidget(self.dense_note)
        layout.addLayout(replay)
        layout.addLayout(plots, 1)
        layout.addWidget(self.hover)
        layout.addWidget(QLabel("Warnings", objectName="sectionHeader"))
        layout.addWidget(self.warning_list)

    def _connect(self) -> None:
        self.tail.reset.connect(self._on_reset)
        self.tail.norms.connect(self._on_norms)
        self.tail.routing.connect(self._on_routing)
        self.tail.status_changed.connect(self._on_status)
        self.redraw.add("norms", self._draw_norms)
        self.redraw.add("routing", self._draw_routing)
        for combo in (self.view_combo, self.projection, self.window_combo):
            combo.currentTextChanged.connect(self._redraw)
        self.slider.valueChanged.connect(self._on_slider)
        for plot in (self.norm_plot, self.routing_plot):
            plot.scene().sigMouseMoved.connect(lambda pos, p=plot: self._on_hover(p, pos))
        self.ctx.run_selected.connect(self.set_run)

    # ---------------------------------------------------------------- data
    def set_run(self, path: str) -> None:
        path = str(RunDir(path).path) if path else None
        if path != self.run_path:
            self.run_path = path
            self.tail.set_run(path)

    def _on_reset(self, path: str) -> None:
        self._norms, self._routing_steps = [], []
        self._routing = np.zeros((0, 0, 0))
        self._is_moe = False
        self._total_steps = 0
        self.subtitle.setText(path or "No run selected.")
        self._update_slider()

    def _on_status(self, status: dict) -> None:
        self._total_steps = int(status.get("total_steps") or 0)
        self._update_step_label()

    def _on_norms(self, events: list) -> None:
        self._norms.extend(events)
        self._update_slider()

    def _on_routing(self, events: list) -> None:
        mats = [routing_matrix([ev]) for ev in events]
        n, buf = len(self._routing_steps), self._routing
        rows = max([buf.shape[1]] + [m.shape[0] for m in mats])
        cols = max([buf.shape[2]] + [m.shape[1] for m in mats])
        if n + len(mats) > len(buf) or (rows, cols) != buf.shape[1:]:   # grow, doubling
            grown = np.full((max(2 * len(buf), n + len(mats), 16), rows, cols), np.nan)
            grown[:n, :buf.shape[1], :buf.shape[2]] = buf[:n]
            self._routing = buf = grown
        for i, m in enumerate(mats):
            buf[n + i] = np.nan
            buf[n + i, :m.shape[0], :m.shape[1]] = m
        self._routing_steps += [int(ev.get("step", 0)) for ev in events]
        self._update_slider()

    def _steps(self) -> list[int]:
        return ([int(ev.get("step", 0)) for ev in self._norms] if self._norms
                else list(self._routing_steps))

    def _update_slider(self) -> None:
        steps = self._steps()
        at_end = self.slider.value() >= self.slider.maximum()
        self.slider.blockSignals(True)
        self.slider.setMaximum(max(len(steps) - 1, 0))
        if self.follow.isChecked() or at_end:
            self.slider.setValue(self.slider.maximum())
        self.slider.blockSignals(False)
        self._update_step_label()
        self.redraw.mark()

    def _on_slider(self, value: int) -> None:
        self.follow.setChecked(value >= self.slider.maximum())
        self._redraw()

    def _redraw(self, *_):
        """Redraw both heatmaps now (a user's action)."""
        self._update_step_label()
        self.redraw.mark()
        self.redraw.flush()

    def shown_step(self) -> int | None:
        steps = self._steps()
        return steps[min(self.slider.value(), len(steps) - 1)] if steps else None

    # ---------------------------------------------------------------- drawing
    def _update_step_label(self) -> None:
        """The label "step S of N": S the record shown, N the run's total steps
        (status.json), or the last record's step while the total is unknown (records come
        every `norms_every` steps, so the last one is rarely the run's last step)."""
        step = self.shown_step()
        self.step_label.setText(
            "no norms yet: they are recorded every few steps (norms_every)" if step is None
            else f"step {step} of {max(self._total_steps, self._steps()[-1])}")

    def _draw_norms(self) -> None:
        step = self.shown_step()
        norm_event = None if step is None else next(
            (ev for ev in reversed(self._norms) if int(ev.get("step", 0)) <= step), None)
        parsed = parse_norms(norm_event) if norm_event else {}
        moe = self._is_moe = is_moe(parsed) or bool(self._routing_steps)
        self.view_combo.setEnabled(moe)
        self.moe_controls.setVisible(moe or not parsed)
        self.dense_note.setVisible(bool(parsed) and not moe)
        modules = self.view_combo.currentText() == "Modules" or (parsed and not is_moe(parsed))
        self.projection.setEnabled(not modules)
        if modules:
            matrix, self.kinds = module_matrix(parsed)
            self.columns = [MODULE_LABELS.get(k, k) for k in self.kinds]
            x_label = "module"
        else:
            matrix = expert_matrix(parsed, self.projection.currentText())
            self.columns = self.kinds = [str(c) for c in range(matrix.shape[1])]
            x_label = "expert"
        self.norm_plot.show(matrix if parsed else None, self.columns,
                            modules_axis(self.kinds) if modules else x_label)
        self._norm_warnings = []
        if parsed and matrix.size and np.isfinite(matrix).any():
            top = float(np.nanmax(matrix))
            tiny = [(int(r), self.kinds[c]) for r, c in
                    zip(*np.nonzero(np.nan_to_num(matrix, nan=np.inf) < TINY_FRACTION * top))]
            what = (f"barely changed (update norm under {TINY_FRACTION:.0%} of the largest, "
                    f"{top:.3g})")
            self._norm_warnings = group_cells(tiny, what, x_label)
        self._show_warnings(bool(parsed))

    def _draw_routing(self) -> None:
        step = self.shown_step()
        k = len(self._routing_steps) if step is None else bisect.bisect_right(
            self._routing_steps, step)
        moe = bool(self._routing_steps) or self._is_moe
        self.routing_plot.setVisible(moe)
        self.window_combo.setEnabled(moe)
        since_start = self.window_combo.currentText() == "since start"
        routing = None
        if k:
            with _warnings.catch_warnings():
                _warnings.simplefilter("ignore", RuntimeWarning)       # all-NaN rows
                routing = (np.nanmean(self._routing[:k], axis=0) if since_start
                           else self._routing[k - 1].copy())
        self.routing_plot.show(routing, [str(c) for c in range(
            routing.shape[1] if routing is not None else 0)], "expert")
        self._routing_warnings = []
        if routing is not None:
            dead = [(int(r), int(c)) for r, c in zip(*np.nonzero(routing == 0))]
            window = ("since the start" if since_start
                      else f"in the interval ending at step {self._routing_steps[k - 1]}")
            self._routing_warnings = group_cells(dead, f"received no tokens {window}", "expert")
        self._show_warnings(bool(self._norms))

    def _show_warnings(self, have_data: bool) -> None:
        warnings = self._routing_warnings + self._norm_warnings
        if warnings != self._warnings or not self.warning_list.count():
            self._warnings = warnings
            self.warning_list.clear()
            icon = self.style().standardIcon(QStyle.SP_MessageBoxWarning)
            for text in warnings:
                self.warning_list.addItem(QListWidgetItem(icon, text))
            if not warnings and have_data:
                self.warning_list.addItem("No problems seen.")

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.tail.start()

    def closeEvent(self, event) -> None:
        self.tail.stop()
        self.redraw.timer.stop()
        super().closeEvent(event)

    def warnings(self) -> list[str]:
        """The warnings shown for the current step, projection and router window."""
        return list(self._warnings)

    def _on_hover(self, plot: Heatmap, pos) -> None:
        image = plot.image_item.image
        if image is None or not plot.sceneBoundingRect().contains(pos):
            return
        p = plot.getViewBox().mapSceneToView(pos)
        r, c = math.floor(p.y()), math.floor(p.x())
        if 0 <= r < image.shape[0] and 0 <= c < image.shape[1]:
            cols = self.kinds if plot is self.norm_plot else [str(i) for i in
                                                              range(image.shape[1])]
            name = "expert" if plot is self.routing_plot or cols[c].isdigit() else "module"
            value = image[r, c]
            text = "-" if math.isnan(value) else (f"{value:.1%}" if plot is self.routing_plot
                                               else f"{value:.4g}")
            self.hover.setText(f"layer {r} \u00b7 {name} {cols[c]}: {text}")
