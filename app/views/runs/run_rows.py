"""What the Runs screen lists: one `RunRow` per run directory, gathered off the GUI thread.

`RunLister()(queue, runs_root)` runs in the reader thread and returns a `Listing`: rows for the
queue's jobs, the runs folder's runs and the registered runs (`read_registry`: made by the
window, the CLI or Python, wherever their folder is), each from its status.json (a GRPO run's
latest mean reward included), its new events (the best evaluation, when it started) and
config.json (re-read only when it changed). A listed folder that is gone shows as "missing".

At scale (10,000 runs) two rules keep it cheap: the registry and the runs folder are listed
again only every REGISTRY_S seconds (or after `invalidate`, when the window changed a run), and
a run is read again only when its files changed (the size, time and inode of config.json,
status.json, metrics.jsonl and checkpoints/, and its job): an unchanged run keeps its `RunRow`
object, so the GUI thread updates only the rows that are new objects. A "running" status is
read every time (a writer that died makes it "interrupted" without a file changing).

A registry that cannot be read, or lines of it that name no run, are `Listing.problem`: the
screen says so instead of showing fewer runs without a word.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.engine.api import (GRPO, SFT, EngineError, Job, RunDir, job_state, list_runs,
                            read_registry)
from app.views.widgets.run_best import Best, BestTracker

REQUESTED = {"pause": "pausing\u2026", "cancel": "cancelling\u2026"}
STALE_S = 300            # a terminal run whose status has not changed for this long: stalled?
REGISTRY_S = 10.0        # how often the list of registered runs is read again


@dataclass
class RunRow:
    path: str
    name: str
    state: str
    job: Job | None = None
    step: int = 0
    total: int = 0
    eta_s: float | None = None
    loss: float | None = None
    reward: float | None = None
    kind: str = SFT.name     # a name of app.engine.api.KINDS (or an unknown one, as written)
    model: str = ""
    dataset: str = ""
    created: float | None = None     # when it was created (its first event, else config.json)
    duration_s: float | None = None
    best: Best | None = None
    epochs: int = 0
    has_checkpoint: bool = False
    error: dict | None = None
    updated_at: float = 0.0
    stalled: bool = False    # no process advances it: interrupted, or no update for STALE_S
    status: dict = field(default_factory=dict)
    renamed: bool = False    # `name` is a display name given in the window (not the folder's)

    @property
    def folder(self) -> str:
        return os.path.basename(self.path)

    @property
    def state_word(self) -> str:
        """The state in `workbench queue list`'s words (api.job_state): "submitting" for a job
        handed to a cluster that has not accepted it yet, where `state` (the queue's) says
        running."""
        return job_state(self.job, self.status) if self.job is not None else self.state

    @property
    def label(self) -> str:
        """The state as shown: 'running (pausing...)', 'running?' for a stalled run of the command
        line."""
        if self.job is not None:     # the words of `workbench queue list`
            if self.job.requested_action in REQUESTED:
                return f"{self.state_word} ({REQUESTED[self.job.requested_action]})"
            return self.state_word
        if self.stalled and self.state == "running":
            return f"{self.state}? (no update for {(time.time() - self.updated_at) / 60:.0f} min)"
        return self.state           # outside the queue: the Where column's tooltip says so


_configs: dict[str, tuple] = {}      # path -> (mtime, model name, epochs, kind, dataset name)
_tracker = BestTracker()


def _config_summary(run: RunDir) -> tuple[str, int, str, str, float | None]:
    """(model file name, epochs, kind, dataset file name, config.json's time) from config.json,
    re-read only when the file changed."""
    try:
        mtime = run.config_path.stat().st_mtime
    except OSError:
        return "", 0, SFT.name, "", None
    cached = _configs.get(str(run.path))
    if cached is None or cached[0] != mtime:
        try:
            cfg = run.config()
        except EngineError:
            cfg = {}
        data = cfg.get("data") or cfg.get("prompts") or ""
        cached = (mtime, Path(str(cfg.get("model", ""))).name, int(cfg.get("epochs") or 0),
                  str(cfg.get("kind", SFT.name)), Path(str(data)).name)
        _configs[str(run.path)] = cached
    return (*cached[1:], mtime)


def _read_row(path: str, job: Job | None, name: str | None = None) -> RunRow:
    run = RunDir(path)
    shown = name or run.name
    try:
        status = run.status()
    except EngineError:
        status = {}
    model, epochs, kind, dataset, config_time = _config_summary(run)
    if config_time is None and not run.path.exists():
        return RunRow(path=str(run.path), name=shown, state="missing", job=job,
                      renamed=bool(name))
    best, started = _tracker.best(run, kind)
    state = job.state if job is not None else str(status.get("state") or "new")
    said = job_state(job, status) if job is not None else state    # no ETA while submitting
    error = job.error if job is not None and job.error else status.get("error")
    try:
        has_ckpt = any(p.is_dir() for p in run.checkpoints_dir.iterdir())
    except OSError:
        has_ckpt = False
    updated = float(status.get("updated_at") or 0.0)
    total = int(status.get("total_steps") or 0)
    return RunRow(
        path=str(run.path), name=shown, state=state, job=job,
        step=int(status.get("step") or 0), total=total,
        eta_s=status.get("eta_s") if said == "running" else None, loss=status.get("loss"),
        reward=status.get(GRPO.metric) if kind == GRPO.name else None, kind=kind,
        model=model, dataset=dataset, created=started or config_time,
        duration_s=status.get("elapsed_s"), best=best, epochs=epochs,
        has_checkpoint=has_ckpt, error=error if isinstance(error, dict) else None,
        updated_at=updated, status=status, renamed=bool(name),
        stalled=job is None and (state == "interrupted" or (
            state == "running" and updated > 0 and time.time() - updated > STALE_S)))


def _signature(path: str) -> tuple:
    """What says a run changed: each file's (mtime, size, inode), None where it is absent."""
    out = []
    for name in ("config.json", "status.json", "metrics.jsonl", "checkpoints"):
        try:
            st = os.stat(os.path.join(path, name))
        except (OSError, ValueError):
            out.append(None)
        else:
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


@dataclass
class Listing:
    rows: list[RunRow]
    problem: str = ""        # the registry (or lines of it) could not be read: say so


class RunLister:
    """The Runs screen's reader: call it in the reader thread; see the module docstring."""

    def __init__(self):
        self._listed_at = float("-inf")
        self._paths: list[str] = []                   # the runs folder's, then the registry's
        self._registered: list[str] = []
        self._names: dict[str, str] = {}              # display names given in the window
        self._forgotten: set[str] = set()             # deleted in the window: not listed
        self._problem = ""
        self._rows: dict[str, tuple[tuple, RunRow]] = {}
        self._lock = threading.Lock()                 # the reader thread and a refresh

    def invalidate(self) -> None:
        """List the registry and the runs folder again at the next call (a run was made,
        renamed or deleted)."""
        self._listed_at = float("-inf")

    def _list(self, runs_root) -> None:
        self._listed_at = time.monotonic()
        folder = [str(r.path) for r in list_runs(runs_root)]
        try:
            found = read_registry()
        except EngineError as e:                     # keep the registered runs listed before
            self._paths = folder + self._registered
            self._problem = f"The list of runs could not be read: {e.message}"
        else:
            entries = sorted(found.entries, key=lambda e: -(e["created"] or 0))
            self._names = {e["path"]: e["name"] for e in entries if e.get("name")}
            self._forgotten = found.forgotten
            self._registered = [e["path"] for e in entries]
            self._paths = folder + self._registered
            self._problem = "" if not found.unreadable else (
                f"{len(found.unreadable)} line(s) of the list of runs could not be read and "
                f"were skipped (line {', '.join(map(str, found.unreadable[:5]))}"
                f"{', ...' if len(found.unreadable) > 5 else ''} of "
                f"{found.path}): a run registered there is not shown.")

    def _row(self, path: str, job: Job | None) -> RunRow:
        name = self._names.get(path)
        signature = (_signature(path), job, name)
        cached = self._rows.get(path)
        if cached is not None and cached[0] == signature and cached[1].status.get(
                "state") != "running":
            return cached[1]
        row = _read_row(path, job, name)
        self._rows[path] = (signature, row)
        return row

    def __call__(self, queue, runs_root) -> Listing:
        """Rows for the queue's jobs (the newest job of each run directory; running and
        pending ones first, in queue order), then the runs folder's and the registered runs
        that are not in the queue (most recently updated first, with the finished jobs;
        missing folders last)."""
        with self._lock:
            return self._collect(queue, runs_root)

    def _collect(self, queue, runs_root) -> Listing:
        if time.monotonic() - self._listed_at > REGISTRY_S:
            self._list(runs_root)
        try:
            jobs = queue.list()
        except EngineError:
            jobs = []
        newest: dict[str, Job] = {}
        for job in jobs:
            key = str(RunDir(job.run_dir).path)
            if key not in newest or job.id > newest[key].id:
                newest[key] = job
        rows = [self._row(path, job) for path, job in newest.items()
                if path not in self._forgotten or job.state in ("running", "queued", "paused")]
        rows += [self._row(path, None) for path in dict.fromkeys(self._paths)
                 if path not in newest and path not in self._forgotten]
        listed = {r.path for r in rows}
        self._rows = {p: v for p, v in self._rows.items() if p in listed}
        order = {job.id: i for i, job in enumerate(jobs)}
        active = [r for r in rows if r.job is not None and r.job.state in ("running", "queued",
                                                                           "paused")]
        active.sort(key=lambda r: order[r.job.id])
        rest = [r for r in rows if r.job is None or r.job.state not in ("running", "queued",
                                                                        "paused")]
        rest.sort(key=lambda r: -(r.updated_at or (r.job.finished_at if r.job else 0) or 0))
        return Listing(active + rest, self._problem)
