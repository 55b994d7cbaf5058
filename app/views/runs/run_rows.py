"""What the Runs screen lists: one `RunRow` per run directory, gathered off the GUI thread.

`collect_runs(queue, runs_root, registered)` reads the queue's jobs, the runs folder, the
registered runs (`registered_run_paths`: made by the window, the CLI or Python, wherever their folder
is; `Registered` re-reads that list every REGISTRY_S seconds) and each run's
status.json (a GRPO run's latest mean reward included) and its new events (the best evaluation,
when it started); config.json is re-read only when it changed. A listed folder that is gone
shows as "missing".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from app.engine.api import GRPO, SFT, EngineError, Job, RunDir, list_runs, registered_run_paths
from app.views.widgets.run_best import Best, BestTracker

REQUESTED = {"pause": "pausing\u2026", "cancel": "cancelling\u2026"}
STALE_S = 300            # a terminal run whose status has not changed for this long: stalled?
REGISTRY_S = 10.0        # how often the list of registered runs is read again


class Registered:
    """The paths of the registered runs, read again when older than REGISTRY_S."""

    def __init__(self):
        self._read_at, self._paths = float("-inf"), []

    def __call__(self) -> list[str]:
        if time.monotonic() - self._read_at > REGISTRY_S:
            self._paths = registered_run_paths()          # paths only: rows read them
            self._read_at = time.monotonic()
        return self._paths


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

    @property
    def label(self) -> str:
        """The state as shown: 'running (pausing...)', 'running?' for a stalled terminal run."""
        if self.job is not None and self.job.requested_action in REQUESTED:
            return f"{self.state} ({REQUESTED[self.job.requested_action]})"
        if self.stalled and self.state == "running":
            return f"{self.state}? (no update for {(time.time() - self.updated_at) / 60:.0f} min)"
        return self.state + ("" if self.job else " (terminal)" if self.state == "running" else "")


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


def _read_row(path: str, job: Job | None) -> RunRow:
    run = RunDir(path)
    try:
        status = run.status()
    except EngineError:
        status = {}
    model, epochs, kind, dataset, config_time = _config_summary(run)
    if config_time is None and not run.path.exists():
        return RunRow(path=str(run.path), name=run.name, state="missing", job=job)
    best, started = _tracker.best(run, kind)
    state = job.state if job is not None else str(status.get("state") or "new")
    error = job.error if job is not None and job.error else status.get("error")
    try:
        has_ckpt = any(p.is_dir() for p in run.checkpoints_dir.iterdir())
    except OSError:
        has_ckpt = False
    updated = float(status.get("updated_at") or 0.0)
    total = int(status.get("total_steps") or 0)
    return RunRow(
        path=str(run.path), name=run.name, state=state, job=job,
        step=int(status.get("step") or 0), total=total,
        eta_s=status.get("eta_s") if state == "running" else None, loss=status.get("loss"),
        reward=status.get(GRPO.metric) if kind == GRPO.name else None, kind=kind,
        model=model, dataset=dataset, created=started or config_time,
        duration_s=status.get("elapsed_s"), best=best, epochs=epochs,
        has_checkpoint=has_ckpt, error=error if isinstance(error, dict) else None,
        updated_at=updated, status=status,
        stalled=job is None and (state == "interrupted" or (
            state == "running" and updated > 0 and time.time() - updated > STALE_S)))


def collect_runs(queue, runs_root, registered: list[str]) -> list[RunRow]:
    """Rows for the queue's jobs (the newest job of each run directory; running and pending
    ones first, in queue order), then the runs under `runs_root` and the `registered` run
    directories that are not in the queue (most recently updated first, with the finished
    jobs; missing folders last)."""
    try:
        jobs = queue.list()
    except EngineError:
        jobs = []
    newest: dict[str, Job] = {}
    for job in jobs:
        key = str(RunDir(job.run_dir).path)
        if key not in newest or job.id > newest[key].id:
            newest[key] = job
    rows = [_read_row(path, job) for path, job in newest.items()]
    known = set(newest)
    paths = [str(r.path) for r in list_runs(runs_root)] + registered
    rows += [_read_row(path, None) for path in dict.fromkeys(paths) if path not in known]
    order = {job.id: i for i, job in enumerate(jobs)}
    active = [r for r in rows if r.job is not None and r.job.state in ("running", "queued",
                                                                       "paused")]
    active.sort(key=lambda r: order[r.job.id])
    rest = [r for r in rows if r.job is None or r.job.state not in ("running", "queued",
                                                                    "paused")]
    rest.sort(key=lambda r: -(r.updated_at or (r.job.finished_at if r.job else 0) or 0))
    return active + rest
