"""What a run records in its run directory while it runs: its events (metrics.jsonl), its
progress and outcome (status.json) and its failure.

One `RunReporter` per run, used by a queued job (the worker's JobControl) and by a run in the
foreground (`workbench train`, `workbench grpo`, `workbench resume`) alike, so that the two
write the same files for the same events. Whoever runs the run owns its `state`
(`started`, `finished`); the worker adds its job's fields (job_id, worker_id, attempts).
"""

from __future__ import annotations

import math
import time
import traceback

from app.engine.errors import EngineError
from app.engine.runs.rundir import RunDir
from app.engine.runtime import faults
from app.engine.training.events import (EVAL, EVAL_STATUS_FIELDS, START, STATUS_FIELDS, STEP,
                                        describe, event_type)

FINAL_STATES = ("done", "failed", "cancelled")   # the states that stamp finished_at


class RunReporter:
    """Appends every event to metrics.jsonl; a step event's STATUS_FIELDS also go to
    status.json, at most one write every `status_every_s` (the run's last step at once)."""

    def __init__(self, run_dir: RunDir, status_every_s: float = 1.0):
        self.run_dir = run_dir
        self.status_every_s = status_every_s
        self._last_status = -math.inf      # the first step is written at once
        self._pending: dict = {}

    def started(self, **fields) -> None:
        """status.json: running since now, no error, with the runner's own `fields`. Until
        `finished`, a SIGBUS (the model file truncated under the run) records the run as failed
        with the message before the process ends (app.engine.runtime.faults)."""
        self.run_dir.write_status(state="running", started_at=time.time(), finished_at=None,
                                  error=None, **fields)
        faults.on_bus_error(self, lambda message, hint: self.finished(
            "failed", {"kind": "model_changed", "message": message, "hint": hint}))

    def report(self, event: dict) -> dict:
        """Record `event` (see app.engine.training.events); returns it as written."""
        ev = record_event(self.run_dir, event)
        if event_type(ev) == START and ev.get("precision"):   # what the products compute in
            self.run_dir.write_status(precision=ev["precision"])
        if event_type(ev) == EVAL:      # a preference run's held-out headline
            self._pending.update({k: ev[k] for k in EVAL_STATUS_FIELDS if k in ev})
        if event_type(ev) == STEP:
            self._pending.update({k: ev[k] for k in STATUS_FIELDS if k in ev})
            last = ev.get("total_steps") is not None and ev.get("step") == ev.get("total_steps")
            if last or time.monotonic() - self._last_status >= self.status_every_s:
                self.flush_status()
        return ev

    def flush_status(self) -> None:
        """Write the step fields held back by the throttle."""
        if self._pending:
            fields, self._pending = self._pending, {}
            self.run_dir.write_status(fsync=False, **fields)
            self._last_status = time.monotonic()

    def finished(self, state: str, error: dict | None = None, **fields) -> None:
        """status.json: the run's outcome `state` ("done", "paused", "failed", ... ), with the
        step fields held back and `error` (a `failure`; its kind, message and hint)."""
        faults.forget(self)
        pending, self._pending = self._pending, {}
        public = None if error is None else {k: error[k] for k in ("kind", "message", "hint")}
        self.run_dir.write_status(state=state, error=public,
                                  finished_at=time.time() if state in FINAL_STATES else None,
                                  **{**pending, **fields})


def record_event(run_dir: RunDir, event: dict) -> dict:
    """Append `event` to metrics.jsonl and, for an event a person reads (a log line, the start,
    a checkpoint, the end: `events.describe`), its line to log.txt. log.txt is the run's one
    readable log, in the order things happened: the worker's, the queue's and the lock's lines
    go there too, so a reader (the window's Monitor) that showed the events of metrics.jsonl
    and then the lines of log.txt put 'job N: started by worker' after 'done'."""
    ev = run_dir.append_metrics(event)
    line = describe(ev)
    if line is not None:
        run_dir.log(line)
    return ev


def failure(exc: BaseException) -> dict:
    """A failed run's error: kind, message, hint and detail (the traceback). An EngineError
    says its own; MemoryError is out_of_memory; anything else is a bug."""
    if isinstance(exc, EngineError):
        return _error_dict(exc, exc.kind, exc.message, exc.hint or None)
    if isinstance(exc, MemoryError):
        return _error_dict(exc, "out_of_memory", "The run ran out of memory.",
                           "Lower the batch size, the context length or the LoRA rank, or "
                           "enable gradient checkpointing; then retry the job.")
    return _error_dict(exc, "bug", f"The run stopped on a bug: {type(exc).__name__}: {exc}",
                       "This is a bug in the workbench; please report it with the detail "
                       "(traceback). Retry resumes from the last checkpoint.")


def _error_dict(exc: BaseException, kind: str, message: str, hint: str | None) -> dict:
    detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"kind": kind, "message": message, "hint": hint, "detail": detail}
