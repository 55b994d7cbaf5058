"""Live data from a run directory: tail `metrics.jsonl`, `log.txt` and `status.json` on a timer.

`RunTail(parent)` follows one run directory (`set_run(path)`). Every tick (150 ms by default)
it hands one read to a background thread: `RunDir.read_metrics(offset)` (only the bytes added
since the last read, whole lines only), the new bytes of `log.txt` and `status.json`. The
parsed events are sorted by type in that thread; the next tick, on the GUI thread, emits them
as batches:

  steps(list[dict])     step events                 evals(list[dict])    eval events
  norms(list[dict])     norms events                routing(list[dict])  routing events
  events(list[dict])    every event of the batch    logs(list[str])      log.txt's new lines
  status_changed(dict)  status.json when it changed
  reset(str)            the run changed (or metrics.jsonl was replaced, or an attempt
                        restarted): drop what you have

Steps are deduplicated here, once for every view (`dedupe_steps`, as the engine reads a run):
a run resumed from a checkpoint after its worker died, or a cluster job's next attempt, repeats
the steps after that checkpoint; the later event for a step wins and the earlier attempt's
events from that step on (steps, evals, norms...) are dropped. Within one read that is a filter;
a step at or before the last one delivered makes the read take the whole file again, and the
views get `reset` and then the deduplicated events.

So the GUI thread never waits for the disk or the JSON parser: a tick costs a `Future.done()`
check and the signal emissions (see `stats` for the measured cost). One read is in flight at a
time per tail; all tails share one reader thread. Because that thread allocates, the first
tail moves Python's garbage collection to the GUI thread (`collect_garbage_on_gui_thread`).
"""

from __future__ import annotations

import atexit
import gc
import math
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PySide6.QtCore import QCoreApplication, QObject, QTimer, Signal

from app.engine.api import EngineError, RunDir, dedupe_steps, read_range

DEFAULT_INTERVAL_MS = 150
MAX_LOG_BYTES = 64 * 1024          # a first look at a long log.txt reads only its tail

_executor: ThreadPoolExecutor | None = None


def reader_pool() -> ThreadPoolExecutor:
    """The one background thread that reads run directories for every view."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="run-tail")
        atexit.register(_executor.shutdown, wait=False, cancel_futures=True)
    return _executor


_LOG_DATE = re.compile(r"^\d{4}-\d\d-\d\d (?=\d\d:\d\d:\d\d )")   # log.txt's date
_gc_timer: QTimer | None = None


def collect_garbage_on_gui_thread(interval_ms: int = 500) -> bool:
    """Run Python's cyclic garbage collector only on the GUI thread, from a timer.

    A background thread that allocates (the tail's JSON parsing) otherwise triggers
    collections itself, and a collection destroys whatever Qt objects sit in garbage cycles
    (closed widgets, pyqtgraph items) in that thread: Qt then deadlocks or crashes (seen here:
    ~QObject in the reader thread waiting for the GIL while the GUI thread waits for Qt's
    mutex). This is pyqtgraph's `GarbageCollector` recipe, with two changes: `gc.freeze()` of
    what exists at install time (modules, classes), so collections stay short; and full
    collections only, because young-generation collections run from a timer freed live
    pyqtgraph items under PySide6 6.12 (whose reference-count bugs leave some objects with
    too few references; a full collection still finds them reachable). Installed once per
    process, from the GUI thread, by the first `RunTail`; returns True when it installed it.
    """
    global _gc_timer
    app = QCoreApplication.instance()
    if _gc_timer is not None or app is None or threading.current_thread() is not \
            threading.main_thread():
        return False
    gc.collect()
    gc.freeze()
    gc.disable()
    threshold = gc.get_threshold()[0]

    def check() -> None:
        if gc.get_count()[0] > threshold:
            gc.collect()

    _gc_timer = QTimer(app, interval=interval_ms)
    _gc_timer.timeout.connect(check)
    _gc_timer.start()
    return True


def _first_step(events: list) -> float | None:
    return next((ev["step"] for ev in events if ev.get("type", "step") == "step"
                 and isinstance(ev.get("step"), (int, float))), None)


def _read(path: Path, offset: int, log_offset: int, last_step: float = -math.inf) -> dict:
    """One read of a run directory (runs in the reader thread). Steps are deduplicated here,
    for every view: a step at or before `last_step` (the last one delivered) is a later
    attempt that resumed from a checkpoint (a restarted worker, a cluster's new attempt), so
    the whole file is read again, `restarted`, with the earlier attempt's events from that step
    on dropped (`dedupe_steps`: the later event for a step wins), as within any read."""
    t0 = time.perf_counter()
    run = RunDir(path)
    out: dict = {"events": [], "offset": offset, "log": [], "log_offset": log_offset,
                 "status": None, "error": None, "restarted": False}
    try:
        out["events"], out["offset"] = run.read_metrics(offset)
        first = _first_step(out["events"])
        if offset and first is not None and first <= last_step:
            out["events"], out["offset"] = run.read_metrics(0)
            out["restarted"] = True
            log_offset = min(log_offset, 0)              # the views start again: the log too
    except EngineError as e:
        out["error"] = e
    out["events"] = dedupe_steps(out["events"])
    try:
        out["status"] = run.status()
    except EngineError:
        out["status"] = None                         # being replaced or corrupt: next tick
    try:
        if log_offset < 0:                           # this tail does not read log.txt
            raise FileNotFoundError
        size = os.path.getsize(run.log_path)
        if log_offset > size:
            log_offset = 0
        if log_offset == 0 and size > MAX_LOG_BYTES:
            log_offset = size - MAX_LOG_BYTES
        data = read_range(run.log_path, "run's log", log_offset, size - log_offset)
        end = data.rfind(b"\n")
        if end >= 0:
            out["log"] = [_LOG_DATE.sub("", line) for line in
                          data[:end].decode("utf-8", "replace").splitlines()]
            out["log_offset"] = log_offset + end + 1
    except (OSError, EngineError):                   # no log yet, or not a regular file
        pass
    groups: dict[str, list] = {"step": [], "eval": [], "norms": [], "routing": []}
    for ev in out["events"]:
        kind = ev.get("type", "step")
        if kind in groups:
            groups[kind].append(ev)
    out["groups"] = groups
    # The lines are log.txt's alone: the engine writes the readable events there too, in the
    # order they happened (app.engine.runs.reporter.record_event), with the job's lines.
    out["lines"] = out["log"]
    out["bytes"] = out["offset"] - offset
    out["read_ms"] = (time.perf_counter() - t0) * 1000
    return out


class RunTail(QObject):
    """Follows one run directory; see the module docstring for the signals."""

    # `object`, not `list`/`dict`: PySide would deep-copy every event into QVariants (20 ms
    # for ten norms events of a big MoE); `object` passes the Python list itself.
    steps = Signal(object)
    evals = Signal(object)
    norms = Signal(object)
    routing = Signal(object)
    events = Signal(object)
    logs = Signal(object)
    status_changed = Signal(object)
    reset = Signal(str)

    def __init__(self, parent: QObject | None = None, interval_ms: int = DEFAULT_INTERVAL_MS,
                 *, read_log: bool = True):
        super().__init__(parent)
        self.path: str | None = None
        self.offset = 0
        self.log_offset = 0
        self.last_step = -math.inf          # of the step events delivered (restarts: _read)
        self.status: dict = {}
        self.error: EngineError | None = None
        self.read_log = read_log
        self._generation = 0
        self._future: Future | None = None
        self.stats = {"ticks": 0, "reads": 0, "bytes": 0, "events": 0, "last_read_ms": 0.0,
                      "max_read_ms": 0.0, "last_tick_ms": 0.0, "max_tick_ms": 0.0}
        self.timer = QTimer(self, interval=interval_ms)
        self.timer.timeout.connect(self.tick)
        collect_garbage_on_gui_thread()

    # ---------------------------------------------------------------- control
    def set_run(self, path: str | os.PathLike | None) -> None:
        """Follow `path` from its first event (None: follow nothing). Emits `reset`."""
        self._generation += 1
        self._future = None                 # a read of the previous run is ignored
        self.path = str(path) if path else None
        self.offset = self.log_offset = 0
        self.last_step = -math.inf
        self.status = {}
        self.error = None
        self.reset.emit(self.path or "")
        if self.path:
            self.timer.start()
            self.tick()
        else:
            self.timer.stop()

    def stop(self) -> None:
        self.timer.stop()

    def start(self) -> None:
        if self.path and not self.timer.isActive():
            self.timer.start()

    def busy(self) -> bool:
        """A read is in flight."""
        return self._future is not None

    # ---------------------------------------------------------------- the tick
    def tick(self) -> None:
        """Deliver a finished read, then start the next one."""
        t0 = time.perf_counter()
        self.stats["ticks"] += 1
        fut = self._future
        if fut is not None and fut.done():
            self._future = None
            if fut.generation == self._generation and not fut.cancelled():
                try:
                    self._deliver(fut.result())
                except EngineError as e:
                    self.error = e
        if self._future is None and self.path:
            fut = reader_pool().submit(_read, Path(self.path), self.offset,
                                       self.log_offset if self.read_log else -1,
                                       self.last_step)
            fut.generation = self._generation
            self._future = fut
        ms = (time.perf_counter() - t0) * 1000
        self.stats["last_tick_ms"] = ms
        self.stats["max_tick_ms"] = max(self.stats["max_tick_ms"], ms)

    def _deliver(self, result: dict) -> None:
        self.error = result["error"]
        if result["offset"] < self.offset or result["restarted"]:   # metrics.jsonl was
            self.last_step = -math.inf                     # replaced, or an attempt restarted
            self.reset.emit(self.path or "")
        self.offset = result["offset"]
        if self.read_log:
            self.log_offset = result["log_offset"]
        st = self.stats
        st["reads"] += 1
        st["bytes"] += result["bytes"]
        st["events"] += len(result["events"])
        st["last_read_ms"] = result["read_ms"]
        st["max_read_ms"] = max(st["max_read_ms"], result["read_ms"])
        status = result["status"]
        if status is not None and status != self.status:
            self.status = status
            self.status_changed.emit(status)
        groups = result["groups"]
        step = groups["step"][-1].get("step") if groups["step"] else None
        if isinstance(step, (int, float)):
            self.last_step = step
        if result["events"]:
            self.events.emit(result["events"])
        for kind, signal in (("step", self.steps), ("eval", self.evals),
                             ("norms", self.norms), ("routing", self.routing)):
            if groups[kind]:
                signal.emit(groups[kind])
        if result["lines"]:
            self.logs.emit(result["lines"])


class BackgroundPoll(QObject):
    """Call `fn()` in the reader thread every `interval_ms` (one call in flight at a time) and
    emit its return value as `result` on the GUI thread (an exception as `failed`). A `tick()`
    that comes while a call is in flight (the screen's state changed after that call began) is
    kept, and the next call starts as soon as that one's result is delivered, not an interval
    later."""

    result = Signal(object)
    failed = Signal(object)

    def __init__(self, fn, interval_ms: int = 1000, parent: QObject | None = None):
        super().__init__(parent)
        self.fn = fn
        self._future: Future | None = None
        self._again = False                               # a tick came during the call
        self.timer = QTimer(self, interval=interval_ms)
        self.timer.timeout.connect(self.tick)
        self._check = QTimer(self, interval=50)           # delivers a result soon after it ends
        self._check.timeout.connect(self._deliver)

    def start(self) -> None:
        if not self.timer.isActive():
            self.timer.start()
            self.tick()

    def stop(self) -> None:
        self.timer.stop()
        self._check.stop()
        self._again = False

    def tick(self) -> None:
        if self._deliver():
            return                                        # the next call has just started
        if self._future is None:
            self._submit()
        else:
            self._again = True

    def _submit(self) -> None:
        self._future = reader_pool().submit(self.fn)
        self._check.start()

    def _deliver(self) -> bool:
        """Emit the finished call's result, if any; True when that started the next call (a tick
        came while it ran)."""
        fut, started = self._future, False
        if fut is not None and fut.done():
            self._future = None
            try:
                value = fut.result()
            except Exception as e:  # noqa: BLE001 - reported, the next tick tries again
                self.failed.emit(e)
            else:
                self.result.emit(value)
            if self._again:
                self._again = False
                if self._future is None:                  # (a slot may have ticked already)
                    self._submit()
                started = True
        if self._future is None:
            self._check.stop()
        return started


class PacedRedraw(QObject):
    """Redraws spread over timer ticks: `mark(key)` schedules the callback registered under
    `key`; each tick runs one, so each pass of the event loop repaints at most one plot (a
    pyqtgraph plot costs 3-10 ms to paint; five at once would block for 50 ms and more)."""

    def __init__(self, parent: QObject | None = None, interval_ms: int = 25):
        super().__init__(parent)
        self._jobs: dict = {}
        self._dirty: list = []
        self.timer = QTimer(self, interval=interval_ms)
        self.timer.timeout.connect(self._next)

    def add(self, key: str, fn) -> None:
        self._jobs[key] = fn

    def mark(self, *keys: str) -> None:
        for key in keys or tuple(self._jobs):
            if key not in self._dirty:
                self._dirty.append(key)
        if self._dirty and not self.timer.isActive():
            self.timer.start()

    def _next(self) -> None:
        if self._dirty:
            self._jobs[self._dirty.pop(0)]()
        if not self._dirty:
            self.timer.stop()

    def flush(self) -> None:
        """Run every pending redraw now (tests, screenshots, a user's own action)."""
        while self._dirty:
            self._next()


def clock(seconds) -> str:
    """h:mm:ss, or "-" for no value."""
    if not isinstance(seconds, (int, float)) or math.isnan(seconds) or seconds < 0:
        return "-"
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def ema(values, weight: float, acc: float = 0.0, n: int = 0):
    """Debiased exponential moving average (TensorBoard's smoothing) of `values`, continuing
    from the running state (acc, n); NaNs are carried over. Returns (smoothed, acc, n)."""
    out = np.empty(len(values))
    for i, v in enumerate(values.tolist()):
        if not math.isnan(v):
            acc, n = weight * acc + (1 - weight) * v, n + 1
        out[i] = acc / (1 - weight ** n) if n else np.nan
    return out, acc, n


class Series:
    """Growing (step, value...) columns in a numpy buffer, for curves fed batch by batch.
    A step at or before the last one truncates the columns back to it (a RunTail delivers
    steps deduplicated, and `reset` before a restarted attempt's events: this is a guard)."""

    def __init__(self, n_cols: int):
        self.data = np.empty((256, n_cols))
        self.n = 0
        self._ema: tuple = (None, np.empty(0), 0.0, 0)

    def extend(self, rows: list) -> None:
        if not rows:
            return
        new = np.asarray(rows, dtype=float)
        if self.n and new[0, 0] <= self.data[self.n - 1, 0]:
            self.n = int(np.searchsorted(self.data[:self.n, 0], new[0, 0]))
            self._ema = (None, np.empty(0), 0.0, 0)
        if self.n + len(new) > len(self.data):
            grown = np.empty((max(2 * len(self.data), self.n + len(new)), self.data.shape[1]))
            grown[:self.n] = self.data[:self.n]
            self.data = grown
        self.data[self.n:self.n + len(new)] = new
        self.n += len(new)

    def col(self, i: int) -> np.ndarray:
        return self.data[:self.n, i]

    def clear(self) -> None:
        self.n = 0
        self._ema = (None, np.empty(0), 0.0, 0)

    def smoothed(self, weight: float, i: int = 1) -> np.ndarray:
        """EMA of column `i`, computed incrementally (from scratch after a change of `weight`,
        a truncation or `clear`)."""
        if not weight:
            return self.col(i)
        key, done, acc, count = self._ema
        if key != (weight, i) or done.size > self.n:
            key, done, acc, count = (weight, i), np.empty(0), 0.0, 0
        if done.size < self.n:
            new, acc, count = ema(self.data[done.size:self.n, i], weight, acc, count)
            done = np.concatenate([done, new])
        self._ema = (key, done, acc, count)
        return done
