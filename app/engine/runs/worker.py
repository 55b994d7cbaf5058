"""The engine process: takes jobs from the queue one after another and runs them.

`run_worker(queue)` is the loop behind `workbench queue worker`. It recovers jobs whose worker
died, then claims queued jobs and calls a *runner* for each, in this process's main thread.
A job that fails (an EngineError, or a bug) is stored on the job with kind, message, hint and
traceback, and the worker continues with the next one: it never dies with a job. A job whose
executor is a cluster is not run here but submitted there and followed (`run_cluster_job`): the
runner contract below is then kept on the node by `app.engine.runs.remote`.

The runner contract (the default runner is `app.engine.runs.kinds.run_job`)::

    runner(run_dir: RunDir, control: JobControl) -> "done" | "paused" | "cancelled" | None

- Called once per claim. The run may have run before (paused, worker stopped, worker died:
  `control.job.attempts` counts deaths): if `run_dir.checkpoints_dir` holds a checkpoint,
  continue from it.
- Call `control.should_stop()` between steps. "pause": save a checkpoint, return "paused".
  "cancel": stop (a checkpoint is optional) and return "cancelled". None: carry on.
  (When the worker itself is asked to stop, should_stop says "pause"; the worker then puts
  the job back at the front of the queue instead of marking it paused.)
- A request the runner leaves unhonoured for `grace_s` (a pause: also twice the longest gap
  between its should_stop calls so far, so that a slow step can end and checkpoint) is
  forced: `JobInterrupted` is raised in the runner's thread wherever it is in Python code
  (rendering a template, tokenizing), and the job ends cancelled, paused (its last checkpoint
  as it was) or queued again. Only code stuck in one native call can delay that.
- Send events with `control.report(event)` (app.engine.training.events): appended to
  metrics.jsonl (with `type`, default "step", and `time`); step events also update status.json
  (events.STATUS_FIELDS; throttled to one write a second), through the RunReporter a run in the
  foreground uses too (app.engine.runs.reporter). `control.log(line)` writes log.txt.
- Return "done" (or None) when finished. Raise an EngineError for bad input or bad state
  (stored as its kind/message/hint plus the traceback); raising `Cancelled` counts as
  cancelled; any other exception is stored as a bug (kind "bug"), MemoryError as
  out_of_memory.
- The worker owns `status.json`'s `state`, `job_id`, `started_at`, `finished_at` and `error`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Callable, Optional

from app.engine.errors import Cancelled, EngineError
from app.engine.runs.clusters import ClusterError
from app.engine.runs.executors import AlreadySubmitted, RayExecutor, Unreachable, executor_for
from app.engine.runs.executors.local import worker_log_path
from app.engine.runs.executors.ray import (DEFAULT_STOP_GRACE_S, HTTP_TIMEOUT_S,
                                           environment_error, environment_problem)
from app.engine.runs.queue import (DEFAULT_MAX_ATTEMPTS, DEFAULT_STALE_S, Job, JobLostError,
                                   JobQueue, QueueError)
from app.engine.runtime.paths import default_queue_path
from app.engine.runtime.processes import this_host
from app.engine.runs.reporter import RunReporter, failure
from app.engine.runs.rundir import RunDir
from app.engine.runs.runlock import RunLock, try_lock, unlock
from app.engine.runtime.files import read_own_bytes, storage_error

log = logging.getLogger("app.engine.runs.worker")

Runner = Callable[[RunDir, "JobControl"], Optional[str]]

RESULTS = {None: "done", "done": "done", "paused": "paused", "cancelled": "cancelled"}
DEFAULT_HEARTBEAT_S = 5.0
DEFAULT_GRACE_S = 5.0  # how long a runner may leave a cancel, pause or stop unhonoured
STOPPED = {"cancel": "cancelled", "pause": "paused"}  # a request -> the job's state after it
DEFAULT_PENDING_TIMEOUT_S = 60.0  # a cluster job pending longer: is it asking absent GPUs?
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 60.0  # waits for a cluster that does not answer
DEFAULT_UNREACHABLE_TIMEOUT_S = 600.0  # a cluster silent longer fails the job that finds it so
SUBMITTING = "submitting"  # status.json's state of a cluster job the cluster has not accepted yet


def job_state(job: Job, status: dict) -> str:
    """The state `workbench queue list` and the window's Runs show for the queue's `job`, whose
    run's status.json is `status`: the queue's state, but "submitting" for a job handed to a
    cluster that has not accepted it yet (the queue says running; status.json says so)."""
    if job.state == "running" and status.get("state") == SUBMITTING:
        return SUBMITTING
    return job.state


class WorkerAlreadyRunning(EngineError):
    kind = "worker_running"


class JobInterrupted(BaseException):
    """Raised in the job's thread when the runner left a request unhonoured for the grace
    period. A BaseException, so that the runner's own `except Exception` lets it through."""


def _raise_in_thread(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in the thread at its next Python instruction; None withdraws a pending one."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               None if exc is None else ctypes.py_object(exc))


def default_runner(run_dir: RunDir, control: "JobControl") -> str | None:
    """The real training runner, `app.engine.runs.kinds.run_job`. Imported when a job first
    runs: the worker process starts, and waits for jobs, without the training stack."""
    from app.engine.runs.kinds import run_job

    return run_job(run_dir, control)


def make_worker_id() -> str:
    return f"{this_host()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------- the job control


class JobControl:
    """What a runner gets besides the run directory: stop requests, reporting (its
    `reporter`), logging."""

    def __init__(self, queue: JobQueue, job: Job, worker_id: str, run_dir: RunDir, *,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 stop_event: threading.Event | None = None, status_every_s: float = 1.0):
        self.queue = queue
        self.job = job
        self.worker_id = worker_id
        self.run_dir = run_dir
        self.heartbeat_s = heartbeat_s
        self.reporter = RunReporter(run_dir, status_every_s)
        self._stop_event = stop_event
        self._last_beat = time.monotonic()
        self._last_poll = time.monotonic()
        self.longest_poll_gap_s = 0.0       # the runner's longest time between should_stop calls
        self.requested: str | None = None   # the last action the queue asked for
        self.lost = False                   # the job was taken away from this worker
        self.worker_stopping = False        # should_stop said "pause" because the worker stops

    # ---------------------------------------------------------------- stop requests
    def should_stop(self) -> str | None:
        """None to carry on, or "cancel" / "pause" (see the runner contract). Reads the
        queue on every call (about 10 us) and heartbeats at most every `heartbeat_s`."""
        now = time.monotonic()
        self.longest_poll_gap_s = max(self.longest_poll_gap_s, now - self._last_poll)
        self._last_poll = now
        if self.lost:
            return "cancel"
        touch = now - self._last_beat >= self.heartbeat_s
        try:
            action = self.queue.heartbeat(self.job.id, self.worker_id, touch=touch)
            if touch:
                self._last_beat = now
            self.requested = action
        except JobLostError as e:
            log.warning("%s", e.message)
            self.lost = True
            return "cancel"
        except QueueError as e:  # a busy or briefly unavailable queue must not kill the run
            log.warning("job %s: could not read the queue: %s", self.job.id, e.message)
            action = self.requested
        if action is None and self._stop_event is not None and self._stop_event.is_set():
            self.worker_stopping = True
            return "pause"
        return action

    def pending(self) -> str | None:
        """What the runner has been asked to do and has not done yet: "cancel", "pause",
        "stop" (the worker stops) or None."""
        if self.lost:
            return "cancel"
        if self.requested in ("cancel", "pause"):
            return self.requested
        if self._stop_event is not None and self._stop_event.is_set():
            return "stop"
        return None

    def _beat(self, touch: bool = True) -> None:
        """Read the requested action from the background thread; `touch`: also heartbeat."""
        if self.lost:
            return
        try:
            self.requested = self.queue.heartbeat(self.job.id, self.worker_id, touch=touch)
            if touch:
                self._last_beat = time.monotonic()
        except JobLostError as e:
            log.warning("%s", e.message)
            self.lost = True
        except QueueError as e:
            log.warning("job %s: heartbeat failed: %s", self.job.id, e.message)

    # ---------------------------------------------------------------- reporting
    def report(self, event: dict) -> dict:
        """Append `event` to metrics.jsonl; step events also update status.json (throttled)."""
        return self.reporter.report(event)

    def log(self, line: str) -> None:
        self.run_dir.log(line)


class _Heartbeat(threading.Thread):
    """Heartbeats from a background thread, so a long step does not look like a dead worker;
    and the watchdog of requests. A cancel, pause or worker stop that the runner leaves
    unhonoured for the grace period is forced by raising JobInterrupted in the job's thread
    (once). If the job has still not ended one more grace period later (stuck in a native
    call), the heartbeats stop: the job goes stale instead of looking alive forever.

    Made in the job's thread; checks the queue every `check_s` (a read), heartbeats every
    `interval_s` (a write)."""

    def __init__(self, control: JobControl, interval_s: float, grace_s: float):
        super().__init__(name=f"heartbeat-job-{control.job.id}", daemon=True)
        self.control = control
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.check_s = min(interval_s, grace_s / 4)
        self.job_thread = threading.get_ident()
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._armed = False   # the runner is running: an interrupt lands in it
        self.fired = False    # JobInterrupted was raised (or is pending) in the job's thread

    def _grace(self, request: str) -> float:
        if request == "pause":  # let a slow step end and save its checkpoint
            return max(self.grace_s, 2 * self.control.longest_poll_gap_s)
        return self.grace_s

    def run(self) -> None:
        last_beat = time.monotonic()
        request, since = None, 0.0  # the unhonoured request and when it was first seen
        while not self._halt.wait(self.check_s):
            now = time.monotonic()
            overdue = now - since if request is not None else 0.0
            touch = now - last_beat >= self.interval_s and overdue < 2 * self._grace(request)
            self.control._beat(touch=touch)
            if touch:
                last_beat = now
            pending = self.control.pending()
            if pending != request:
                request, since = pending, now
            elif request is not None and overdue >= self._grace(request):
                self._interrupt(request, overdue)

    def _interrupt(self, request: str, overdue_s: float) -> None:
        with self._lock:
            if self._armed and not self.fired:
                log.warning("job %s: the runner left a %s unhonoured for %.1f s; interrupting it",
                            self.control.job.id, request, overdue_s)
                self.fired = True
                _raise_in_thread(self.job_thread, JobInterrupted)

    def guarded(self, runner: Runner, run: RunDir, control: JobControl) -> str | None:
        """`runner(run, control)`, interruptible by the watchdog while it runs."""
        with self._lock:
            self._armed = True
        try:
            return runner(run, control)
        finally:
            self.disarm()

    def disarm(self) -> None:
        """No interrupt from now on; one raised but not yet delivered is withdrawn."""
        with self._lock:
            self._armed = False
            if self.fired:
                _raise_in_thread(self.job_thread, None)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5.0)


def _interrupted_state(control: JobControl) -> str:
    """The job's state after an interrupt, from the request it forced."""
    if control.lost or control.requested == "cancel":
        return "cancelled"
    return "paused" if control.requested == "pause" else "queued"


# --------------------------------------------------------------------------- running one job


def run_job_once(queue: JobQueue, job: Job, runner: Runner, worker_id: str, *,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, grace_s: float = DEFAULT_GRACE_S,
                 stop_event: threading.Event | None = None) -> str:
    """Run one claimed job to its end and record the outcome; returns the job's new state
    ("done", "failed", "cancelled", "paused", "queued", or "lost"). Never raises for the
    job's own errors (KeyboardInterrupt/SystemExit put the job back and propagate).
    The job holds the run's lock (app.engine.runs.runlock) while it writes the run: a run
    that another process writes fails the job with its holder named, the run untouched."""
    run = RunDir(job.run_dir)
    control = JobControl(queue, job, worker_id, run, heartbeat_s=heartbeat_s,
                         stop_event=stop_event)
    beat = _Heartbeat(control, heartbeat_s, grace_s)
    beat.start()
    state, error = "failed", None
    lock = RunLock(run, f"queue job {job.id} (worker {worker_id})")
    log.info("job %s: started %s (attempt %s)", job.id, job.run_dir, job.attempts + 1)
    try:
        try:
            run.config()  # a missing or broken run directory fails here, clearly
            lock.acquire()
            control.reporter.started(job_id=job.id, worker_id=worker_id,
                                     attempts=job.attempts)
            run.log(f"job {job.id}: started by worker {worker_id}"
                    + (f" (resumed after {job.attempts} worker death(s))" if job.attempts else ""))
            result = beat.guarded(runner, run, control)
            if result not in RESULTS:
                raise ValueError(f"the runner returned {result!r}; expected one of "
                                 "'done', 'paused', 'cancelled' or None")
            state = RESULTS[result]
            if state == "paused" and control.worker_stopping and control.requested != "pause":
                state = "queued"  # the worker stops, not the user: first in line next time
        except JobInterrupted:
            beat.disarm()  # in case it landed in guarded's own disarm
            state = _interrupted_state(control)
        except Cancelled:
            state = "cancelled"
        except Exception as e:  # noqa: BLE001 - a bug (or MemoryError) must not kill the worker
            state, error = "failed", failure(e)
    except BaseException:  # KeyboardInterrupt, SystemExit: put the job back, then stop
        beat.stop()
        _record(queue, job, worker_id, run, control.reporter, "queued", None,
                write_run=lock.held)
        lock.release()
        raise
    beat.stop()
    if control.lost:
        lock.release()
        log.warning("job %s: lost to another worker; its outcome (%s) is not recorded",
                    job.id, state)
        return "lost"
    _record(queue, job, worker_id, run, control.reporter, state, error, write_run=lock.held)
    lock.release()
    log.info("job %s: %s%s", job.id, state, f" ({error['kind']}: {error['message']})"
             if error else "")
    return state


def _record(queue: JobQueue, job: Job, worker_id: str, run: RunDir, reporter: RunReporter,
            state: str, error: dict | None, *, write_run: bool = True) -> None:
    """Write the outcome to the run directory (unless not `write_run`: a local job writes
    only under the run's lock, which another process may hold) and the queue; failures are
    logged, not raised."""
    try:
        if write_run:
            reporter.finished(state, error, job_id=job.id)
            if error is not None:
                run.log(f"job {job.id}: failed: {error['kind']}: {error['message']}\n"
                        f"{error.get('detail') or ''}")
            else:
                run.log(f"job {job.id}: {state}")
    except EngineError as e:
        log.warning("job %s: could not write to the run directory: %s", job.id, e.message)
    for attempt in range(5):
        try:
            queue.finish(job.id, worker_id, state, error)
            return
        except JobLostError as e:
            log.warning("%s", e.message)
            return
        except QueueError as e:
            log.warning("job %s: could not record %s in the queue (%s); retrying", job.id,
                        state, e.message)
            time.sleep(0.2 * (attempt + 1))
    log.error("job %s: giving up recording %s; the job will be recovered as stale", job.id,
              state)


# --------------------------------------------------------------------------- a job on a cluster


class _Stopping(Exception):
    """The worker was asked to stop while it waited on a cluster's answer."""


class ClusterBackoff:
    """The clusters this worker could not reach, and when it tries each again: 1 s after the
    first failure, twice as long after each further one, at most 60 s (BACKOFF_FIRST_S,
    BACKOFF_MAX_S): a head that is down costs a request a minute, not a request a second. The
    job that found it down goes back to the queue; the worker's claim skips the jobs of the
    clusters in `waiting()` and runs the others (local ones too) meanwhile. A cluster that
    answers is forgotten. One that has not answered for `give_up_s` fails the job that finds
    it so, with the reason: a head that restarts, or a network outage, must not fail the queue,
    a wrong address must in the end (`workbench cluster test` says so at once)."""

    def __init__(self, give_up_s: float = DEFAULT_UNREACHABLE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.give_up_s = give_up_s
        self._clock = clock
        self._down: dict[str, tuple[float, float, float]] = {}  # name: since, wait, next try

    def failed(self, name: str) -> tuple[float, float]:
        """Cluster `name` did not answer: (seconds it has not answered for, seconds until the
        worker tries it again)."""
        now = self._clock()
        since, wait, _ = self._down.get(name, (now, BACKOFF_FIRST_S / 2, now))
        wait = min(2 * wait, BACKOFF_MAX_S)
        self._down[name] = (since, wait, now + wait)
        return now - since, wait

    def reached(self, name: str) -> None:
        self._down.pop(name, None)

    def waiting(self) -> list[str]:
        """The clusters whose jobs wait now."""
        now = self._clock()
        return sorted(name for name, (_, _, at) in self._down.items() if at > now)


class _ClusterJob:
    """One claimed job that a cluster runs: submitted (or reattached to by its handle), polled
    every `poll_s` while the queue is heartbeated; a cancel or pause is a stop of the cluster's
    job (it checkpoints within the stop grace); an attempt the cluster lost is submitted again
    as the next attempt, which resumes from the last checkpoint."""

    def __init__(self, queue: JobQueue, job: Job, executor: RayExecutor, worker_id: str, *,
                 poll_s: float, pending_timeout_s: float, max_attempts: int,
                 stop_event: threading.Event, reporter: RunReporter):
        self.queue, self.job, self.executor, self.worker_id = queue, job, executor, worker_id
        self.reporter = reporter
        self.poll_s = poll_s
        self.pending_timeout_s = pending_timeout_s
        self.max_attempts = max_attempts
        self.stop_event = stop_event
        self.run = RunDir(job.run_dir)
        self.lost = 0  # attempts the cluster lost since this worker took the job
        self.requested: str | None = None  # the user's last request: "cancel", "pause", None

    def _submit_next(self) -> None:
        """Record attempt+1 and its handle, then submit it (recorded first: a worker that dies
        in between leaves a handle the next worker finds unknown, never a second job)."""
        attempt = self.job.attempt + 1
        handle = self.executor.handle_for(self.job.id, attempt)
        self.job = self.queue.record_attempt(self.job.id, self.worker_id, attempt, handle)
        # the fence: an attempt that starts late (a job Ray could not stop while it pended)
        # finds another submission here and leaves the run alone (app.engine.runs.remote)
        self.run.write_status(submission_id=handle["submission_id"], attempt=attempt,
                              executor=self.job.executor)
        try:
            self._call(self.executor.submit, self.job, self.run.path)
        except AlreadySubmitted:
            log.warning("job %s: attempt %s was already submitted; polling it",
                        self.job.id, attempt)
        except Unreachable:
            # not submitted as far as we know: the job waits for its cluster (see
            # ClusterBackoff) and then submits this attempt again, under the same id (Ray
            # refuses it if this one did arrive: AlreadySubmitted, and it is polled)
            self.job = self.queue.record_attempt(self.job.id, self.worker_id, attempt - 1,
                                                 None)
            raise
        self.run.log(f"job {self.job.id}: attempt {attempt} submitted to cluster "
                     f"{self.executor.name} as {handle['submission_id']}")

    def _call(self, call, *args, interruptible: bool = True):
        """`call(*args)`, a request to the cluster, in a thread of its own: a worker asked to
        stop (`stop_event`) gives up waiting on it (`_Stopping`) instead of waiting out the
        request's timeout. A request given up was recorded first (the attempt's handle), so
        the next worker finds out whether it arrived. Not `interruptible`: waited for (a stop
        already sent, whose end the worker records). Never longer than the request's own
        timeout (HTTP_TIMEOUT_S) and a second: a head that answers a byte at a time is
        Unreachable like one that never answers, and the worker runs the other jobs."""
        outcome: dict = {}
        done = threading.Event()

        def target():
            try:
                outcome["value"] = call(*args)
            except BaseException as e:  # noqa: BLE001 - raised again in the worker's thread
                outcome["error"] = e
            finally:
                done.set()

        threading.Thread(target=target, daemon=True, name=f"cluster-job-{self.job.id}").start()
        deadline = time.monotonic() + HTTP_TIMEOUT_S + 1.0
        while not done.wait(0.1):
            if interruptible and self.stop_event.is_set():
                raise _Stopping
            if time.monotonic() > deadline:
                cluster = self.executor.cluster
                raise Unreachable(f"Cluster {cluster.name!r} ({cluster.url}) did not answer "
                                  f"within {HTTP_TIMEOUT_S + 1.0:g} s.",
                                  "Check that the Ray dashboard on the head runs and answers.")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def run_to_end(self) -> tuple[str, dict | EngineError | None]:
        """(the job's new state, its error) once the cluster's job has ended, or the worker
        stops ("queued": the cluster carries on, the next worker reattaches). Unreachable
        when the cluster does not answer (run_cluster_job puts the job back)."""
        try:
            return self._follow()
        except _Stopping:
            return "queued", None

    def _follow(self) -> tuple[str, dict | EngineError | None]:
        if self.job.handle is None:
            self._submit_next()
            # "running" once the cluster has the job ("submitting" until then: run_cluster_job)
            self.reporter.started(job_id=self.job.id, worker_id=self.worker_id,
                                  executor=self.job.executor)
        else:
            self.run.log(f"job {self.job.id}: reattached to {self.job.handle['submission_id']}")
        stopping: str | None = None     # the request sent to the cluster as a stop
        stop_asked = 0.0
        pending_since = time.monotonic()
        while True:
            try:
                action = self.queue.heartbeat(self.job.id, self.worker_id)
            except JobLostError:
                raise
            except QueueError as e:  # busy for a moment: the next beat will do
                log.warning("job %s: heartbeat failed: %s", self.job.id, e.message)
                action = None
            self.requested = action or self.requested
            if self.stop_event.is_set() and stopping is None:
                return "queued", None
            poll = self._call(self.executor.poll, self.job.handle,
                              interruptible=stopping is None)
            if action in ("cancel", "pause") and stopping is None and not poll.ended:
                stopping, stop_asked = action, time.monotonic()
                self.executor.cancel(self.job.handle)
                self.run.log(f"job {self.job.id}: {action} requested; stopping "
                             f"{self.job.handle['submission_id']}")
            if poll.state != "pending":
                pending_since = time.monotonic()
            elif stopping is not None:
                # Ray cannot stop a job pending for resources: give it up (the status
                # file's fence keeps it off the run if it ever starts)
                if time.monotonic() - stop_asked > self.executor.stop_grace_s:
                    return STOPPED[stopping], None
            elif time.monotonic() - pending_since > self.pending_timeout_s:
                infeasible = self._infeasible()
                if infeasible is not None:
                    self.executor.cancel(self.job.handle)
                    return "failed", infeasible
                pending_since = time.monotonic()  # a busy cluster: ask again a timeout later
            if poll.ended:
                outcome = self._ended(poll, stopping)
                if outcome is not None:
                    return outcome
                pending_since = time.monotonic()
                continue
            self.stop_event.wait(self.poll_s)

    def _infeasible(self) -> EngineError | None:
        """The reason a job pends forever: it asks more GPUs than the cluster has."""
        cluster = self.executor.cluster
        have = self.executor.resources().get("GPU", 0.0)
        if cluster.num_gpus <= have:
            return None  # a busy cluster: keep waiting
        return ClusterError(
            f"Cluster {cluster.name!r} has {have:g} GPU(s); each run asks {cluster.num_gpus:g} "
            f"(the job pended for more than {self.pending_timeout_s:g} s).",
            f"Lower the GPUs per run: `workbench cluster add {cluster.name} {cluster.url} "
            "--gpus 0`, or add GPU nodes to the cluster; then retry the job.")

    def _ended(self, poll, stopping: str | None) -> tuple[str, dict | None] | None:
        """The job's outcome when the cluster's job ended; None when the next attempt runs."""
        status = self.run.status()
        if poll.state == "succeeded" and status.get("state") == "done":
            return "done", None
        if stopping is not None:
            return STOPPED[stopping], None
        if status.get("state") == "failed" and status.get("error"):
            return "failed", status["error"]   # the run's own error: retrying will not help
        problem = environment_problem(self.executor.logs(self.job.handle)) \
            if poll.state == "failed" else None
        if problem:  # its Python cannot run the workbench: every attempt would end alike
            return "failed", environment_error(self.executor.cluster, problem)
        why = f"{poll.state}: {poll.message}".strip(": ")
        self.lost += 1
        if self.lost >= self.max_attempts:
            return "failed", ClusterError(
                f"Cluster {self.executor.name!r} lost job {self.job.id} {self.lost} "
                f"time(s); the last time: {why}",
                "See the job's logs (Ray dashboard > Jobs), then retry it: it resumes from its "
                "last checkpoint.")
        self.run.log(f"job {self.job.id}: attempt {self.job.attempt} lost ({why}); resuming "
                     "from the last checkpoint")
        self._submit_next()
        return None


def run_cluster_job(queue: JobQueue, job: Job, worker_id: str, *, poll_s: float = 1.0,
                    pending_timeout_s: float = DEFAULT_PENDING_TIMEOUT_S,
                    stop_grace_s: float = DEFAULT_STOP_GRACE_S,
                    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                    stop_event: threading.Event | None = None,
                    backoff: ClusterBackoff | None = None) -> str:
    """Run one claimed cluster job to its end (see `_ClusterJob`) and record the outcome;
    returns the job's new state, or "lost". Never raises for the job's own errors. A cluster
    that does not answer puts the job back ("queued", first in line) until `backoff` (the
    worker's) says to try that cluster again, or fails it once the cluster has not answered
    for `backoff.give_up_s`."""
    stop_event = stop_event or threading.Event()
    backoff = backoff if backoff is not None else ClusterBackoff()
    run = RunDir(job.run_dir)
    reporter = RunReporter(run)
    try:
        executor = executor_for(job, queue, stop_grace_s=stop_grace_s)
        cluster = _ClusterJob(queue, job, executor, worker_id, poll_s=poll_s,
                              pending_timeout_s=pending_timeout_s, max_attempts=max_attempts,
                              stop_event=stop_event, reporter=reporter)
        if job.handle is None:  # `queue list` says so instead of "running" (_ClusterJob._follow)
            run.write_status(state=SUBMITTING, job_id=job.id, worker_id=worker_id,
                             executor=job.executor, error=None)
        state, error = cluster.run_to_end()
        backoff.reached(job.executor)
    except JobLostError as e:
        log.warning("%s", e.message)
        return "lost"
    except Unreachable as e:
        silent_s, wait_s = backoff.failed(job.executor)
        if silent_s < backoff.give_up_s:
            return _wait_for_cluster(queue, cluster, run, reporter, e, wait_s)
        state, error = "failed", e
    except Exception as e:  # noqa: BLE001 - an unreachable cluster must not kill the worker
        state, error = "failed", e
    if isinstance(error, BaseException):
        error = failure(error)
    if state == "queued":  # the worker stops: the cluster carries on; no outcome to write
        _finish_quietly(queue, job, worker_id, state)
    else:
        with suppress(EngineError):
            run.write_status(submission_id=None)  # no attempt of this job may run any more
        _record(queue, job, worker_id, run, reporter, state, error)
    log.info("job %s on %s: %s", job.id, job.executor, state)
    return state


def _wait_for_cluster(queue: JobQueue, cluster: _ClusterJob, run: RunDir,
                      reporter: RunReporter, error: Unreachable, wait_s: float) -> str:
    """Put back a job whose cluster did not answer, and return its state: queued, with its
    attempt's handle if one runs there (the next claim reattaches to it; a cancel or pause
    the user asked is kept for it), else with the run's status saying queued (a cancel asked
    meanwhile cancels it)."""
    job = cluster.job
    log.warning("job %s: %s Trying cluster %s again in %g s, running other jobs meanwhile.",
                job.id, error.message, job.executor, wait_s)
    with suppress(EngineError):
        if job.handle is None:
            reporter.finished("queued", None)
        run.log(f"job {job.id}: {error.message} Trying again in {wait_s:g} s.")
    _finish_quietly(queue, job, cluster.worker_id, "queued")
    if cluster.requested in ("cancel", "pause"):
        with suppress(EngineError):
            return getattr(queue, cluster.requested)(job.id).state
    return "queued"


def _finish_quietly(queue: JobQueue, job: Job, worker_id: str, state: str) -> None:
    with suppress(QueueError):
        queue.finish(job.id, worker_id, state)


# --------------------------------------------------------------------------- the worker loop


def run_worker(queue: JobQueue | str | os.PathLike, runner: Runner | None = None,
               once: bool = False, poll_s: float = 1.0,
               stop_event: threading.Event | None = None, *, worker_id: str | None = None,
               heartbeat_s: float = DEFAULT_HEARTBEAT_S, grace_s: float = DEFAULT_GRACE_S,
               stale_after_s: float = DEFAULT_STALE_S, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
               exclusive: bool = True,
               pending_timeout_s: float = DEFAULT_PENDING_TIMEOUT_S,
               stop_grace_s: float = DEFAULT_STOP_GRACE_S,
               unreachable_timeout_s: float = DEFAULT_UNREACHABLE_TIMEOUT_S) -> int:
    """Run queued jobs until `stop_event` is set (or, with `once`, until none is queued).

    Local jobs run in this process (`runner`); a cluster's jobs are submitted there and polled
    every `poll_s` (`run_cluster_job`; one pending more than `pending_timeout_s` on a cluster
    without the GPUs it asks fails with that reason; a stopped one has `stop_grace_s` to save
    its checkpoint and exit; one whose cluster does not answer waits in the queue, tried
    again after 1, 2, 4 ... 60 s (`ClusterBackoff`) while the other jobs run, and fails when
    the cluster has not answered for `unreachable_timeout_s`).

    Recovers stale jobs first (and every `stale_after_s` while idle). With `exclusive` (the
    default, and what `workbench queue worker` does) it holds the queue's worker lock and
    raises WorkerAlreadyRunning if another worker holds it. Returns the number of jobs run (a
    cluster's job put back in the queue, its cluster silent or the worker stopping, is not).
    """
    queue = queue if isinstance(queue, JobQueue) else JobQueue(queue)
    runner = runner or default_runner
    stop_event = stop_event or threading.Event()
    worker_id = worker_id or make_worker_id()
    lock = None
    if exclusive:
        lock = WorkerLock(queue.path)
        if not lock.acquire():
            pid = lock.holder_pid()
            raise WorkerAlreadyRunning(
                f"A worker is already running on the queue {queue.path}"
                + (f" (pid {pid})." if pid else "."),
                "Only one worker may run per queue; it picks up the new jobs by itself.")
    try:
        return _loop(queue, runner, once, poll_s, stop_event, worker_id, heartbeat_s, grace_s,
                     stale_after_s, max_attempts, pending_timeout_s, stop_grace_s,
                     ClusterBackoff(unreachable_timeout_s))
    finally:
        if lock is not None:
            lock.release()


def _loop(queue, runner, once, poll_s, stop_event, worker_id, heartbeat_s, grace_s,
          stale_after_s, max_attempts, pending_timeout_s, stop_grace_s, backoff) -> int:
    log.info("worker %s on %s", worker_id, queue.path)
    last_recover = -float("inf")
    n = 0
    while not stop_event.is_set():
        if time.monotonic() - last_recover >= stale_after_s:
            try:
                for job in queue.recover_stale(stale_after_s, max_attempts):
                    log.warning("job %s: its worker died; now %s (attempt %s)", job.id,
                                job.state, job.attempts)
            except QueueError as e:
                log.warning("could not recover stale jobs: %s", e.message)
            last_recover = time.monotonic()
        try:
            job = queue.claim_next(worker_id, skip_executors=backoff.waiting())
        except QueueError as e:
            log.warning("could not read the queue: %s", e.message)
            if once:
                break
            stop_event.wait(poll_s)
            continue
        if job is None:
            if once:
                break
            stop_event.wait(poll_s)
            continue
        if job.is_local:
            run_job_once(queue, job, runner, worker_id, heartbeat_s=heartbeat_s,
                         grace_s=grace_s, stop_event=stop_event)
        else:
            state = run_cluster_job(queue, job, worker_id, poll_s=poll_s,
                                    pending_timeout_s=pending_timeout_s,
                                    stop_grace_s=stop_grace_s, max_attempts=max_attempts,
                                    stop_event=stop_event, backoff=backoff)
            if state == "queued":
                continue  # put back (its cluster silent, the worker stopping): not a job run
        n += 1
    log.info("worker %s: stopped after %d job(s)", worker_id, n)
    return n


# --------------------------------------------------------------------------- one worker per queue


def worker_lock_path(queue_path: str | os.PathLike) -> Path:
    """The queue's worker lock: beside the real database file, named by its device and inode,
    so that every spelling of the path (relative, with `..`, through a symlink, a hard link in
    the same folder) finds the same lock. (SQLite itself cannot share a database between hard
    links in different folders: each name gets its own journal.) FileNotFoundError when the
    database does not exist."""
    real = Path(os.path.realpath(queue_path))
    st = real.stat()
    return real.parent / f".workbench-queue-{st.st_dev}-{st.st_ino}.worker.lock"


class WorkerLock:
    """An OS file lock next to the queue (`worker_lock_path`): held by the one worker of that
    queue, released by the OS when the worker dies (even by kill -9). The holder's pid is kept
    in the file's companion `.pid` file."""

    def __init__(self, queue_path: str | os.PathLike):
        self.queue_path = queue_path
        self.path: Path | None = None  # None: there is no database, so no worker holds it
        with suppress(FileNotFoundError):
            self.path = worker_lock_path(queue_path)
        self.pid_path = None if self.path is None else \
            Path(str(self.path)[:-len(".lock")] + ".pid")
        self._fd: int | None = None

    def acquire(self, timeout_s: float = 1.0) -> bool:
        """Take the lock (retrying for `timeout_s`, since `worker_running` probes it briefly)."""
        if self.path is None:
            raise QueueError(f"There is no job queue at {self.queue_path}.",
                             "Open it with JobQueue first: that creates it.")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise storage_error(e, self.path, "create") from e
        deadline = time.monotonic() + timeout_s
        while not try_lock(fd):
            if time.monotonic() >= deadline:
                os.close(fd)
                return False
            time.sleep(0.05)
        self._fd = fd
        try:
            self.pid_path.write_text(f"{os.getpid()}\n")
        except OSError:
            pass
        return True

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.pid_path.unlink()
        except OSError:
            pass
        unlock(self._fd)
        os.close(self._fd)
        self._fd = None

    def is_held(self) -> bool:
        """Does any process (this one included) hold the lock?"""
        if self._fd is not None:
            return True
        if self.path is None:
            return False
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return False
        except OSError:
            return False
        try:
            if try_lock(fd, shared=True):
                unlock(fd)
                return False
            return True
        finally:
            os.close(fd)

    def holder_pid(self) -> int | None:
        if self.pid_path is None:
            return None
        try:
            text = read_own_bytes(self.pid_path, "worker's pid file", max_bytes=4096)
            return int(text.split()[0])
        except (OSError, ValueError, IndexError, EngineError):   # EngineError: not a file
            return None

    def __enter__(self) -> "WorkerLock":
        if not self.acquire():
            raise WorkerAlreadyRunning(f"A worker is already running ({self.path}).")
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _queue_path(queue: JobQueue | str | os.PathLike | None) -> Path:
    if isinstance(queue, JobQueue):
        return queue.path
    if queue is None:
        return default_queue_path().absolute()
    return Path(queue).expanduser().absolute()


def worker_running(queue: JobQueue | str | os.PathLike | None = None) -> bool:
    """Is a worker running on this queue (on this machine)?"""
    _reap_children()
    return WorkerLock(_queue_path(queue)).is_held()


def worker_pid(queue: JobQueue | str | os.PathLike | None = None) -> int | None:
    """The pid of the queue's running worker, or None when none runs."""
    lock = WorkerLock(_queue_path(queue))
    deadline = time.monotonic() + 1.0
    while worker_running(queue):
        pid = lock.holder_pid()
        # the holder writes its pid just after taking the lock: allow it that moment
        if pid is not None or time.monotonic() >= deadline:
            return pid
        time.sleep(0.02)
    return None


_children: list[subprocess.Popen] = []


def _reap_children() -> None:
    """Collect exited workers this process started (no zombies left behind)."""
    for proc in list(_children):
        if proc.poll() is not None:
            _children.remove(proc)


# The detached worker (the window's) runs at a lower CPU priority: training takes every core it
# is given, and the desktop, the window itself included, must stay responsive beside it. On an
# otherwise idle machine it costs nothing: priority only decides who waits under contention.
DETACHED_NICENESS = 10


def lower_priority(niceness: int) -> None:
    """Lower this process's CPU priority by `niceness` (POSIX nice; on Windows the window's
    worker is started below normal priority instead)."""
    if niceness > 0 and hasattr(os, "nice"):
        os.nice(niceness)


def start_worker_detached(queue_path: JobQueue | str | os.PathLike | None = None) -> int:
    """Start `python -m app queue worker --queue PATH --nice 10` in its own session (it
    survives the GUI), output to `<queue>.worker.log`; returns its pid. If another worker
    already runs, the new one exits at once with a message in that log (use `ensure_worker`)."""
    path = _queue_path(queue_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    kwargs: dict = {}
    if os.name == "nt":
        kwargs["creationflags"] = (subprocess.DETACHED_PROCESS
                                   | subprocess.CREATE_NEW_PROCESS_GROUP
                                   | getattr(subprocess, "CREATE_NO_WINDOW", 0)
                                   | getattr(subprocess, "BELOW_NORMAL_PRIORITY_CLASS", 0))
    else:
        kwargs["start_new_session"] = True
    with open(worker_log_path(path), "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app", "queue", "worker", "--queue",
                                 str(path), "--nice", str(DETACHED_NICENESS)],
                                stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=str(path.parent),
                                close_fds=True, **kwargs)
    _children.append(proc)
    return proc.pid


def ensure_worker(queue_path: JobQueue | str | os.PathLike | None = None) -> int | None:
    """Start a detached worker unless one runs; returns the worker's pid (None if a running
    worker's pid is unknown)."""
    if worker_running(queue_path):
        return worker_pid(queue_path)
    return start_worker_detached(queue_path)


def stop_worker(queue_path: JobQueue | str | os.PathLike | None = None,
                timeout: float = 20.0) -> bool:
    """Ask the queue's worker to stop (SIGTERM: it checkpoints the running job and puts it
    back at the front of the queue) and wait up to `timeout` seconds for it to be gone.
    Returns True when no worker runs any more."""
    pid = worker_pid(queue_path)
    if pid:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while worker_running(queue_path) and time.monotonic() < deadline:
            time.sleep(0.1)
    return not worker_running(queue_path)


def install_stop_signals(stop_event: threading.Event) -> dict:
    """SIGTERM / SIGINT / SIGHUP set `stop_event` (the running job is checkpointed and put
    back at the front of the queue); a second SIGINT interrupts at once. Returns the previous
    handlers, for `restore_signals`."""

    def handler(signum, frame):
        if stop_event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        log.info("signal %s: stopping after the current step", signum)
        stop_event.set()

    previous = {}
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None:
            try:
                previous[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):  # not the main thread
                pass
    return previous


def restore_signals(previous: dict) -> None:
    for sig, handler in previous.items():
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError, TypeError):
            pass
