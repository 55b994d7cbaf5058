"""One attempt of a run on a cluster node: `python -m app queue run-remote RUN_DIR`, the
entrypoint a cluster's executor submits (`app.engine.runs.executors.ray`).

No queue here (it stays on the machine with the window): the run directory is the whole
contract. The run's kind loop runs on it as the worker would run it (resuming from its last
checkpoint, writing metrics.jsonl, status.json and checkpoints), or, for a run whose config asks
`workers` > 1, the data-parallel trainer (`app.engine.runs.data_parallel`). The files its config
names are read through the cluster's path map (`--path-map`, as in Settings). A stop (SIGTERM or
SIGINT: Ray's stop of the job) asks the loop to pause: it saves a checkpoint after the current
step and returns. An attempt that starts after the queue's side gave it up (Ray cannot stop a
job that pends for resources: it may start when they appear) finds another submission id in
status.json than its own (WORKBENCH_SUBMISSION_ID) and exits at once. Exit status: 0 when the
run is done, 1 when it failed (its error in status.json), `EXIT_STOPPED` when it stopped before
its end (the machine with the queue decides whether that was a pause, a cancel, or a lost
attempt to resume).
"""

from __future__ import annotations

import os
import threading

from app.engine.errors import Cancelled, MissingModuleError
from app.engine.evaluation.runner import TaskSpec, parse_task
from app.engine.runs.clusters import PathMap
from app.engine.runs.executors.ray import SUBMISSION_ENV
from app.engine.runs.reporter import RunReporter, failure
from app.engine.runs.rundir import RunDir
from app.engine.runs.runlock import RunLock
from app.engine.runtime.processes import this_host
from app.engine.runs.worker import RESULTS, default_runner, install_stop_signals, restore_signals

EXIT_DONE, EXIT_FAILED, EXIT_STOPPED = 0, 1, 3


class MappedRunDir(RunDir):
    """A run directory whose config.json names files (model, data...) by the paths of the
    machine that made it: every absolute path under a local prefix of `path_map` reads as the
    cluster sees it."""

    def __init__(self, path: str | os.PathLike, path_map: PathMap):
        super().__init__(path)
        self.path_map = path_map

    def config(self) -> dict:
        config = _to_cluster(super().config(), self.path_map)
        task = config.get("eval_task")
        if isinstance(task, str) and task:        # KIND:PATH (issue 32): its path maps too
            spec = parse_task(task)
            config["eval_task"] = TaskSpec(spec.kind, _to_cluster(spec.path, self.path_map)
                                           ).to_text()
        return config


def _to_cluster(value, path_map: PathMap):
    if isinstance(value, dict):
        return {k: _to_cluster(v, path_map) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cluster(v, path_map) for v in value]
    if isinstance(value, str) and value.startswith("/") and path_map.covers(value):
        return path_map.to_cluster(value)
    return value


class RemoteControl:
    """The runner's control on a cluster node: stop requests come from signals, events go to
    the run directory through the same RunReporter a queued or foreground run uses."""

    def __init__(self, run_dir: RunDir, stop_event: threading.Event):
        self.run_dir = run_dir
        self.reporter = RunReporter(run_dir)
        self._stop_event = stop_event

    def should_stop(self) -> str | None:
        return "pause" if self._stop_event.is_set() else None

    def report(self, event: dict) -> dict:
        return self.reporter.report(event)

    def log(self, line: str) -> None:
        self.run_dir.log(line)


def remote_runner(run_dir: RunDir, control) -> str | None:
    """The run's kind loop, or the data-parallel trainer when its config asks `workers` > 1."""
    if int(run_dir.config().get("workers") or 1) > 1:
        from app.engine.runs.data_parallel import run_data_parallel

        return run_data_parallel(run_dir, control)
    return default_runner(run_dir, control)


def run_remote(run_dir: str | os.PathLike, runner=remote_runner,
               path_map: PathMap | None = None) -> int:
    """Run one attempt of the run in `run_dir` in this process (its config's paths through
    `path_map`, the cluster's); returns the exit status."""
    run = MappedRunDir(run_dir, path_map or PathMap())
    run.config()  # a run folder the node cannot read fails here, clearly
    mine, current = os.environ.get(SUBMISSION_ENV), run.status().get("submission_id")
    if mine and mine != current:
        _say(run, f"attempt {mine} started after it was superseded (now: {current}); "
                  "left the run alone")
        return EXIT_STOPPED
    lock = RunLock(run, "workbench queue run-remote" + (f" (attempt {mine})" if mine else ""))
    lock.acquire()  # another process writes the run (an attempt still alive): RunBusyError
    stop = threading.Event()
    previous = install_stop_signals(stop)
    control = RemoteControl(run, stop)
    error = None
    try:
        control.reporter.started(pid=os.getpid())
        _say(run, f"attempt started on {this_host()} (pid {os.getpid()})")
        try:
            state = RESULTS.get(runner(run, control), "paused")
        except Cancelled:
            state = "paused"
        except Exception as e:  # noqa: BLE001 - recorded in status.json for the queue's side
            missing = MissingModuleError.of(e) if isinstance(e, ModuleNotFoundError) else None
            state, error = "failed", failure(missing or e)  # a module missing: not a bug
        control.reporter.finished(state, error)
        _say(run, f"attempt ended: {state}" + (f": {error['kind']}: {error['message']}\n"
                                               f"{error.get('detail') or ''}" if error else ""))
    finally:
        restore_signals(previous)
        lock.release()
    return {"done": EXIT_DONE, "failed": EXIT_FAILED}.get(state, EXIT_STOPPED)


def _say(run: RunDir, line: str) -> None:
    """A line for the run's log.txt and for the job's own output (Ray's job logs)."""
    run.log(line)
    print(line, flush=True)
