"""Evaluations saved with a run: `RUN_DIR/evals.jsonl`, one line per (model or adapter, task)
of each evaluation, the newest last:

    {"eval_id": "...", "time": 1764300000.0, "model": "base", "adapter": null | PATH,
     "task": "hellaswag:val.txt", "spec": "hellaswag:/data/val.txt", "kind": "hellaswag",
     "metric": "acc", "value": 0.62, "stderr": 0.02, "n": 500, ...extra}

An evaluation is saved whole or not at all: the file is rewritten atomically (the old lines and
the new ones, app.engine.runtime.files.atomic_write_bytes) once every task has finished, so a
cancelled or failed evaluation leaves the file as it was. The caller holds the run's writer lock
(app.engine.runs.runlock) while it saves.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from app.engine.errors import DatasetError
from app.engine.evaluation.results import TaskResult
from app.engine.runtime.files import atomic_write_bytes, read_own_bytes

EVALS = "evals.jsonl"
EVALS_LIMIT = 64 << 20      # bytes of evals.jsonl read


def evals_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / EVALS


def read_evals(run_dir: str | os.PathLike) -> list[dict]:
    """The saved lines (none: []); a line that is not a JSON object is a DatasetError."""
    path = evals_path(run_dir)
    if not path.exists():
        return []
    raw = read_own_bytes(path, "evaluations", max_bytes=EVALS_LIMIT)
    out = []
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            raise DatasetError(f"{path}, line {n}: not a JSON object.",
                               "Remove the line (or the file) to save evaluations again.")
        out.append(row)
    return out


def latest_evals(run_dir: str | os.PathLike) -> list[dict]:
    """The newest evaluation's lines (those of the last line's eval_id, in their order); none
    saved: []. Errors as `read_evals`."""
    rows = read_evals(run_dir)
    last = rows[-1].get("eval_id") if rows else None
    return [r for r in rows if r.get("eval_id") == last]


def save_evals(run_dir: str | os.PathLike, results: dict[str, list[TaskResult]],
               adapters: dict[str, str | None], specs: dict[str, str],
               eval_id: str | None = None, when: float | None = None) -> tuple[str, float]:
    """Append one evaluation (`results` as `runner.evaluate` gives them; `adapters`: each
    label's adapter path, None for the base; `specs`: each task name's spec) to the run's
    evals.jsonl, atomically. Returns (its eval_id, its time): pass them to save the same
    evaluation elsewhere."""
    eval_id, now = eval_id or uuid.uuid4().hex[:12], time.time() if when is None else when
    lines = []
    for label, rows in results.items():
        for r in rows:
            lines.append(json.dumps({"eval_id": eval_id, "time": now, "model": label,
                                     "adapter": adapters.get(label), "spec": specs.get(r.task),
                                     **r.to_dict()}))
    path = evals_path(run_dir)
    old = read_own_bytes(path, "evaluations", max_bytes=EVALS_LIMIT) if path.exists() else b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    atomic_write_bytes(path, old + "".join(line + "\n" for line in lines).encode("utf-8"))
    return eval_id, now
