"""The Runs screen's details pane: the selected run's folder, model and data paths, its best
checkpoint's path, a summary of its config, the exports found in RUN/exports and its
evaluations (RUN/evals.jsonl, when there is one). Collapsible (the screen's "Details" toggle).

Read when a run is selected or changes, on the GUI thread: a few small files of one run
(config.json, a checkpoint's meta, a directory listing, the last 64 KB of evals.jsonl).
"""

from __future__ import annotations

import html
import json
import os

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QScrollArea

from app.engine.api import EngineError, RunDir, best_checkpoint, human_bytes, saved_cell
from app.views.runs.run_rows import RunRow
from app.views.widgets import theme

EVALS = "evals.jsonl"
EVALS_TAIL = 64 * 1024
TRAIN_KEYS = (("lr", "learning rate"), ("lora_rank", "LoRA rank"), ("lora_alpha", "alpha"),
              ("schedule", "schedule"), ("mode", "mode"))


def config_summary(cfg: dict) -> str:
    """One line: length (epochs or steps), the training settings, context, evaluations."""
    train = cfg.get("train") if isinstance(cfg.get("train"), dict) else {}
    data = cfg.get("data_config") if isinstance(cfg.get("data_config"), dict) else {}
    steps = cfg.get("max_steps") or train.get("max_steps")
    parts = ([f"{cfg['epochs']} epoch(s)"] if cfg.get("epochs") else
             [f"{steps} steps"] if steps else [])
    parts += [f"{label} {train[key]}" for key, label in TRAIN_KEYS if key in train]
    if data.get("context"):
        parts.append(f"context {data['context']}")
    if cfg.get("eval_every"):
        parts.append(f"evaluates every {cfg['eval_every']} steps")
    return ", ".join(parts)


def exports_of(run: RunDir) -> list[str]:
    """"name (size)" of each file or folder in RUN/exports."""
    try:
        entries = sorted(os.scandir(run.exports_dir), key=lambda e: e.name)
    except OSError:
        return []
    out = []
    for entry in entries:
        try:
            size = entry.stat().st_size if entry.is_file() else None
        except OSError:
            size = None
        out.append(entry.name + (f" ({human_bytes(size)})" if size is not None else "/"))
    return out


def evals_of(run: RunDir) -> str:
    """How many evaluations RUN/evals.jsonl holds (in its last 64 KB: the Evaluate screen's and
    `workbench eval --save`'s, one line per model and task, an eval_id per evaluation) and the
    latest one's results as `workbench eval` prints them (api.saved_cell): "base mc:mc.bin
    33.33 +- 21.08, ..."."""
    path = run.path / EVALS
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - EVALS_TAIL, 0))
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return ""
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    if not rows:
        return f"{len(lines)} line(s) in {EVALS}, none readable"
    ids = list(dict.fromkeys(r.get("eval_id", i) for i, r in enumerate(rows)))
    latest = [r for i, r in enumerate(rows) if r.get("eval_id", i) == ids[-1]]
    return (f"{len(ids)} evaluation(s) in {EVALS}; the latest: "
            + ", ".join(f"{r.get('model', '?')} {r.get('task', '?')} {saved_cell(r)}"
                        for r in latest))


def details_html(row: RunRow) -> str:
    """The pane's text for `row`."""
    run = RunDir(row.path)
    lines = [("Run", row.name + (f" (folder {row.folder})" if row.renamed else "")),
             ("Folder", row.path)]
    if row.state == "missing":
        return _table(lines + [("State", "the folder is gone")])
    try:
        cfg = run.config()
    except EngineError as e:
        return _table(lines + [("Config", f"unreadable: {e.message}")])
    lines += [("Model", str(cfg.get("model") or "")),
              ("Data", str(cfg.get("data") or cfg.get("prompts") or "")),
              ("Settings", config_summary(cfg))]
    try:
        best = best_checkpoint(row.path)
    except EngineError:
        best = None
    lines.append(("Best checkpoint", f"step {best[0]}: {best[1]}" if best else
                  "none yet (no evaluation kept one)"))
    exports = exports_of(run)
    lines.append(("Exports", ", ".join(exports) if exports else "none yet"))
    evals = evals_of(run)
    if evals:
        lines.append(("Evaluations", evals))
    return _table(lines)


def _table(lines: list[tuple[str, str]]) -> str:
    muted = theme.color("muted")
    rows = "".join(f"<tr><td style='color:{muted}; padding-right:10px'>{html.escape(k)}</td>"
                   f"<td>{html.escape(v)}</td></tr>" for k, v in lines)
    return f"<table>{rows}</table>"


class DetailsPane(QScrollArea):
    """The details of one run (`show_row`), selectable text in a scroll area."""

    def __init__(self, parent=None):
        super().__init__(parent, objectName="runDetails", widgetResizable=True)
        self.label = QLabel(textFormat=Qt.RichText, wordWrap=True,
                            alignment=Qt.AlignTop | Qt.AlignLeft)
        self.label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.label.setContentsMargins(8, 6, 8, 6)
        self.setWidget(self.label)
        self.setMinimumHeight(90)
        self.show_row(None)

    def show_row(self, row: RunRow | None) -> None:
        self.label.setText(details_html(row) if row is not None else
                           f"<span style='color:{theme.color('muted')}'>Select a run to see "
                           "its folder, "
                           "best checkpoint, settings and exports.</span>")

    def text(self) -> str:
        """The pane's text without markup (tests)."""
        return self.label.text()
