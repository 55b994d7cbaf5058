"""The list of every run the workbench created, wherever its folder is: `runs.jsonl` in the
user's state folder (app.engine.runtime.paths.user_state_dir, beside the queue).

`RunDir.create` appends one JSON line per new run (path, created, kind, model, dataset), so a
run made by the window, `workbench train -o some/folder`, the queue or Python is listed by
`workbench runs list` and the window's Runs screen (`app.engine.runs.rundir.registered_runs`).
Lines are appended whole (O_APPEND); a torn or foreign line is skipped, and a path registered
twice (a config replaced) keeps its latest line. The file is the user's to edit, so a line is
read as untrusted: nothing on it (nesting, a date out of range, a value of the wrong type) may
stop the list of every other run (`_entry`).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from app.engine.runtime.files import append_line, loads_json
from app.engine.runtime.paths import state_file, user_state_dir

REGISTRY = "runs.jsonl"
LATEST_TIME = 253402300799.0   # 9999-12-31 23:59:59 UTC: the last second a date can show


def registry_path() -> Path:
    return user_state_dir() / REGISTRY


def register_run(path: str | os.PathLike, config: dict) -> None:
    """Add the run at `path` (absolute) with its config.json's kind, model and dataset."""
    record = {"path": str(path), "created": time.time(), "kind": config.get("kind", "sft"),
              "model": config.get("model"), "dataset": config.get("data") or config.get("prompts")}
    # ASCII JSON: a folder name that is not UTF-8 (surrogate escapes) is kept, escaped
    append_line(state_file(registry_path()), json.dumps(record, default=str))


def registry_entries() -> list[dict]:
    """The registered runs, oldest first, one per path (its latest line)."""
    try:
        lines = registry_path().read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    entries: dict[str, dict] = {}
    for line in lines:
        record = _entry(line)
        if record is not None:
            entries.pop(record["path"], None)
            entries[record["path"]] = record
    return list(entries.values())


def _entry(line: str) -> dict | None:
    """The record of one registry line, its fields checked, or None for a line that names no
    run: not a JSON object (torn, nested too deeply: `loads_json`), or no absolute path the
    system can name (a NUL, a lone surrogate). A field of the wrong type or out of range is
    dropped (a `created` that is not a finite time between the epoch and the year 9999, a
    kind, model or dataset that is not a string): the list then reads it from the run folder."""
    try:
        record = loads_json(line)
    except ValueError:
        return None
    path = record.get("path") if isinstance(record, dict) else None
    if not isinstance(path, str) or not os.path.isabs(path):
        return None
    try:
        if b"\0" in os.fsencode(path):
            return None
    except UnicodeError:   # a lone surrogate, not a byte of a name (surrogateescape)
        return None
    created = record.get("created")
    return {"path": path, "created": created if _valid_time(created) else None,
            **{key: record[key] if isinstance(record.get(key), str) else None
               for key in ("kind", "model", "dataset")}}


def _valid_time(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and 0 <= value <= LATEST_TIME)
