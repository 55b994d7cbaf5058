"""A run's input files, fingerprinted in its checkpoints: a resumed run notices a changed input.

A run records the fingerprint (app.engine.runtime.inputs.fingerprint: size, mtime, hashes of
the head, the tail and samples) of each input file in its run state, key "inputs", which every
checkpoint saves with the rest of the state. When the run resumes from a checkpoint, the files
are compared with what that checkpoint recorded, before anything is loaded:

- same content (a touched mtime included): the run goes on (a touch is said in a log event);
- a change (another size or content, a missing file, another path in config.json): InputChanged
  names the file and what changed, unless the caller allows it (`workbench resume
  --allow-changed-data`), which says so in a log event and records the new fingerprints. The
  worker, which resumes interrupted and paused jobs, does not allow it: the job fails with the
  same message, and the user decides with `workbench resume`.

Reward files are not fingerprinted here: their trust (app.engine.training.reward_functions) is
a hash of them and the modules they import, checked on every start.
"""

from __future__ import annotations

import json
from typing import Callable

from app.engine.errors import ConfigError, EngineError
from app.engine.runtime.inputs import fingerprint, fingerprint_changes
from app.engine.training import events
from app.engine.training.checkpoints import META, list_checkpoints, read_meta

STATE_KEY = "inputs"


class InputChanged(ConfigError):
    """An input file of a run differs from what the run's checkpoint recorded."""

    kind = "input_changed"


def take(paths: dict[str, str | None]) -> dict[str, dict]:
    """{what: fingerprint} of the files `paths` names ({"model": ..., "dataset": ...}; None:
    the run has no such file). A file that cannot be read is left out: its loader says why, in
    its own words (a DatasetError for the dataset, ...)."""
    out = {}
    for what, path in paths.items():
        if path:
            try:
                out[what] = fingerprint(path, what)
            except EngineError:
                pass
    return out


def recorded(checkpoints) -> tuple[int, dict] | None:
    """(step, {what: fingerprint}) that the newest checkpoint with a readable meta.json
    recorded (its JSON only, not its arrays); None without one (a fresh run, or a checkpoint
    from before fingerprints)."""
    for path in reversed(list_checkpoints(checkpoints) if checkpoints else []):
        try:
            meta = json.loads(read_meta(path / META))
            found = meta["meta"]["run"].get(STATE_KEY)
            step = int(meta["step"])
        except (OSError, EngineError, ValueError, KeyError, TypeError, AttributeError):
            continue
        return (step, found) if isinstance(found, dict) else None
    return None


def check_inputs(checkpoints, paths: dict[str, str | None], report: Callable[[dict], None],
                 allow_changed: bool = False) -> dict[str, dict]:
    """Compare the run's input files (`paths`, as `take`) with the newest checkpoint's record;
    returns the fingerprints to record from now on. InputChanged for a change unless
    `allow_changed` (then a log event says what changed)."""
    found = recorded(checkpoints)
    if found is not None:
        step, record = found
        changed = []
        for what, path in paths.items():
            before = record.get(what)
            if not isinstance(before, dict) or "path" not in before:
                continue
            if path != before["path"]:
                changed.append((what, path, f"the run now names {path}, not {before['path']}"))
                continue
            changes, touched = fingerprint_changes(before)
            if changes:
                changed.append((what, path, ", ".join(changes)))
            elif touched:
                report(events.LOG_EVENT(message=f"the {what} {path} was touched since step "
                                                f"{step} (its content is the same)"))
        if changed and not allow_changed:
            listed = "; ".join(f"the {what} {path} ({how})" for what, path, how in changed)
            raise InputChanged(
                f"The run's input changed since its checkpoint of step {step}: {listed}.",
                "Put the original file back, or continue on the changed input with: "
                "workbench resume RUN_DIR --allow-changed-data (the steps so far were trained "
                "on the old one).")
        for what, path, how in changed:
            report(events.LOG_EVENT(message=f"the {what} {path} changed since step {step} "
                                            f"({how}); continuing on it (--allow-changed-data)"))
    return take(paths)
