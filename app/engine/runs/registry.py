"""The list of every run the workbench created, wherever its folder is: `runs.jsonl` in the
user's state folder (app.engine.runtime.paths.user_state_dir, beside the queue).

`RunDir.create` appends one JSON line per new run (path, created, kind, model, dataset), so a
run made by the window, `workbench train -o some/folder`, the queue or Python is listed by
`workbench runs list` and the window's Runs screen (`app.engine.runs.rundir.registered_runs`).
Lines are appended whole (O_APPEND); a torn or foreign line is skipped, and a path registered
twice (a config replaced) keeps its latest line. The file is the user's to edit, so a line is
read as untrusted: nothing on it (nesting, a date out of range, a value of the wrong type) may
stop the list of every other run (`_entry`); `read_registry` counts the lines it skipped, so the
window can say so.

The window edits the list by appending too (never rewriting the file, so a run registered at
the same moment is not lost): `forget_run` appends a line that drops a path (a run deleted
from the Runs screen; a run created there again later registers again), `rename_run` the
path's record again with a display `name`. A display name is only a label: the folder keeps
its name, so the queue's rows and every path that names the run stay valid.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.engine.errors import ConfigError
from app.engine.runtime.files import append_line, loads_json, read_own_bytes, storage_error
from app.engine.runtime.paths import state_file, user_state_dir

REGISTRY = "runs.jsonl"
LATEST_TIME = 253402300799.0   # 9999-12-31 23:59:59 UTC: the last second a date can show
NAME_LIMIT = 200               # characters of a display name
REGISTRY_MAX_BYTES = 256 << 20  # about a million lines; a larger file is not the workbench's


def registry_path() -> Path:
    return user_state_dir() / REGISTRY


def register_run(path: str | os.PathLike, config: dict) -> None:
    """Add the run at `path` (absolute) with its config.json's kind, model and dataset."""
    _append({"path": str(path), "created": time.time(), "kind": config.get("kind", "sft"),
             "model": config.get("model"),
             "dataset": config.get("data") or config.get("prompts")})


def _append(record: dict) -> None:
    # ASCII JSON: a folder name that is not UTF-8 (surrogate escapes) is kept, escaped
    append_line(state_file(registry_path()), json.dumps(record, default=str))


@dataclass
class Registry:
    """What `read_registry` found: the runs, the paths a later line dropped, and the numbers
    (from 1) of the lines that name no run (torn, foreign, edited by hand)."""

    entries: list[dict] = field(default_factory=list)
    forgotten: set[str] = field(default_factory=set)
    unreadable: list[int] = field(default_factory=list)
    path: str = ""                                       # the file read


def read_registry() -> Registry:
    """The registry as it is now; a file that exists but cannot be read is a StorageError
    (a missing one is an empty list), and so is anything but a regular file of at most
    REGISTRY_MAX_BYTES (files.read_own_bytes: a FIFO or a link to /dev/zero never hangs)."""
    path = registry_path()
    try:
        lines = read_own_bytes(path, "list of runs", max_bytes=REGISTRY_MAX_BYTES).decode(
            "utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return Registry()
    except OSError as e:
        raise storage_error(e, path, "read") from None
    found = Registry(path=str(path))
    entries: dict[str, dict] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _entry(line)
        if record is None:
            found.unreadable.append(number)
            continue
        entries.pop(record["path"], None)
        if record.pop("forgotten"):
            found.forgotten.add(record["path"])
        else:
            found.forgotten.discard(record["path"])
            entries[record["path"]] = record
    found.entries = list(entries.values())
    return found


def registry_entries() -> list[dict]:
    """The registered runs, oldest first, one per path (its latest line)."""
    return read_registry().entries


def forget_run(path: str | os.PathLike) -> None:
    """Drop the run at `path` (absolute) from the list; its folder is not touched."""
    _append({"path": str(path), "forgotten": time.time()})


def rename_run(path: str | os.PathLike, name: str) -> str:
    """Give the run at `path` (absolute) the display `name` (stripped; empty: its folder's name
    again) and return it. The folder is not renamed (see the module docstring)."""
    name = " ".join(str(name).split())
    if len(name) > NAME_LIMIT:
        raise ConfigError(f"A run's name has at most {NAME_LIMIT} characters "
                          f"({len(name)} given).", "Choose a shorter name.")
    record = next((e for e in registry_entries() if e["path"] == str(path)), None)
    record = dict(record or {"path": str(path), "created": None})
    record["name"] = name or None
    _append(record)
    return name or Path(path).name


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
            "forgotten": "forgotten" in record,
            **{key: record[key] if isinstance(record.get(key), str) else None
               for key in ("kind", "model", "dataset", "name")}}


def _valid_time(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and 0 <= value <= LATEST_TIME)
