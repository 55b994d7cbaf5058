"""The list of every run the workbench created, wherever its folder is: `runs.jsonl` in the
user's state folder (app.engine.runtime.paths.user_state_dir, beside the queue).

`RunDir.create` appends one JSON line per new run (path, created, kind, model, dataset), so a
run made by the window, `workbench train -o some/folder`, the queue or Python is listed by
`workbench runs list` and the window's Runs screen (`app.engine.runs.rundir.registered_runs`).
Lines are appended whole (O_APPEND); a torn or foreign line is skipped, and a path registered
twice (a config replaced) keeps its latest line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from app.engine.runtime.files import append_line, to_json
from app.engine.runtime.paths import user_state_dir

REGISTRY = "runs.jsonl"


def registry_path() -> Path:
    return user_state_dir() / REGISTRY


def register_run(path: str | os.PathLike, config: dict) -> None:
    """Add the run at `path` (absolute) with its config.json's kind, model and dataset."""
    record = {"path": str(path), "created": time.time(), "kind": config.get("kind", "sft"),
              "model": config.get("model"), "dataset": config.get("data") or config.get("prompts")}
    append_line(registry_path(), to_json(record))


def registry_entries() -> list[dict]:
    """The registered runs, oldest first, one per path (its latest line)."""
    try:
        lines = registry_path().read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    entries: dict[str, dict] = {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("path"), str):
            entries.pop(record["path"], None)
            entries[record["path"]] = record
    return list(entries.values())
