"""The durable job queue: one SQLite database shared by the GUI, the CLI and the worker.

Each job is one run directory (see `app.engine.runs.rundir`). States::

    queued --claim--> running --finish--> done | failed | cancelled
      |  ^              |  \\--finish(paused)--> paused --resume--> queued
      |  |              \\--worker died--> queued (attempts+1) | failed after max_attempts
      v  |
    paused (held: the worker skips it)          failed | cancelled --retry--> queued

Requests on a running job (cancel, pause) are stored as `requested_action` and honoured by the
worker between training steps, or forced within a grace period when the job is stuck (see
`app.engine.runs.worker`). Every call either changes the job or raises a `JobStateError`
that says why not; unknown ids raise `NoSuchJobError`.

Concurrency: WAL mode, a busy timeout, short `BEGIN IMMEDIATE` write transactions and one
connection per call, so any number of processes (GUI, CLI, workers) may read and write at
once. `claim_next` is atomic: only one worker ever owns a job.

The files beside the database are checked before SQLite opens it (`_check_database_files`),
since SQLite itself trusts them: a database with several hard links is refused (SQLite keeps
a write-ahead log per name, and each name would get its own worker lock), and so is a
`-wal` file that is not the database's own (one copied from another database: SQLite would
replay its pages over the queue's and the jobs would be gone). A log tells whose it is
because every write transaction also bumps `meta.writes` (`_MARK_WRITE`), so each of its
committed transactions carries the page of the `meta` table and its `queue_id`.

The database lives at `platformdirs.user_data_dir("gguf-workbench")/queue.sqlite3`, or at
`$WORKBENCH_QUEUE`, or at the path passed to `JobQueue(path)` (the CLI's `--queue PATH`).
It stays on this machine (SQLite's WAL must not sit on a network filesystem), whatever runs
the job.

Where a job runs is its `executor`: "local" (the worker on this machine runs it) or the name of
a cluster (`app.engine.runs.clusters`; the worker submits it there and polls it; see
`app.engine.runs.executors`). `attempt` counts its submissions (a cluster job's Ray
submission id is `wb-<queue_id>-<job id>-a<attempt>`), and `handle` (JSON) says where the current
attempt runs: local {"pid", "start_time"} (the worker's process; the start time guards against
a reused pid), ray {"submission_id", "cluster"}.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from app.engine.errors import ConfigError, EngineError
from app.engine.runs.clusters import ClusterStore
from app.engine.runs.executors.local import local_alive, local_handle
from app.engine.runs.rundir import RunDir
from app.engine.runs.runlock import RunBusyError, describe, lock_holder
from app.engine.runtime.files import check_regular
from app.engine.runtime.paths import default_queue_path, ensure_state_dir
from app.engine.runtime.processes import pid_alive, this_host

SCHEMA_VERSION = 3
LOCAL = "local"  # the executor of a job this machine's worker runs

STATES = ("queued", "running", "paused", "done", "failed", "cancelled")
PENDING = ("queued", "paused")
FINISHED = ("done", "failed", "cancelled")
ACTIONS = ("none", "cancel", "pause")
FINISH_STATES = ("done", "failed", "cancelled", "paused", "queued")

DEFAULT_STALE_S = 60.0
DEFAULT_MAX_ATTEMPTS = 3
LOW_DISK_BYTES = 16 << 20  # free space under which a "disk I/O error" means a full disk

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS jobs (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    run_dir          TEXT    NOT NULL,
    state            TEXT    NOT NULL CHECK (state IN ({", ".join(repr(s) for s in STATES)})),
    priority         INTEGER NOT NULL DEFAULT 0,
    position         INTEGER NOT NULL,
    requested_action TEXT    NOT NULL DEFAULT 'none'
                             CHECK (requested_action IN ({", ".join(repr(a) for a in ACTIONS)})),
    worker_id        TEXT,
    worker_host      TEXT,
    worker_pid       INTEGER,
    heartbeat_at     REAL,
    created_at       REAL    NOT NULL,
    started_at       REAL,
    finished_at      REAL,
    attempts         INTEGER NOT NULL DEFAULT 0,
    error_kind       TEXT,
    error_message    TEXT,
    error_hint       TEXT,
    error_detail     TEXT,
    executor         TEXT    NOT NULL DEFAULT 'local',
    attempt          INTEGER NOT NULL DEFAULT 0,
    handle           TEXT
);
CREATE INDEX IF NOT EXISTS jobs_state_position ON jobs (state, position, id);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
# Every write transaction ends with this, so that its pages in the write-ahead log include the
# meta table's, which holds the database's queue_id: whose log it is (_check_database_files).
_MARK_WRITE = ("INSERT INTO meta VALUES ('writes', 1) "
               "ON CONFLICT (key) DO UPDATE SET value = value + 1")
WAL_HEADER_BYTES = 32  # a -wal file no longer than its header holds no transaction
# Columns added after schema 1: (name, declaration), added to an older database when missing.
_ADDED_COLUMNS = (("executor", "TEXT NOT NULL DEFAULT 'local'"),
                  ("attempt", "INTEGER NOT NULL DEFAULT 0"),
                  ("handle", "TEXT"))



class QueueError(EngineError):
    """The queue database cannot be used (busy for too long, corrupt, unwritable)."""

    kind = "queue"


class NoSuchJobError(QueueError):
    kind = "no_such_job"


class JobStateError(QueueError):
    """The requested change is not possible in the job's current state."""

    kind = "job_state"


class JobLostError(JobStateError):
    """A worker acted on a job it no longer owns (recovered as stale, or finished elsewhere)."""

    kind = "job_lost"


@dataclass(frozen=True)
class Job:
    id: int
    run_dir: str
    state: str
    priority: int
    position: int
    requested_action: str
    worker_id: str | None
    worker_host: str | None
    worker_pid: int | None
    heartbeat_at: float | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    attempts: int
    error_kind: str | None
    error_message: str | None
    error_hint: str | None
    error_detail: str | None
    executor: str = LOCAL                 # "local" or a cluster's name
    attempt: int = 0                      # submissions so far (the current one's number)
    handle: dict | None = field(default=None, hash=False)  # where the current attempt runs

    @property
    def is_local(self) -> bool:
        return self.executor == LOCAL

    @property
    def in_flight(self) -> bool:
        """An attempt of this job runs on its cluster, followed by a worker or waiting for the
        next one (queued with its handle): a cancel or pause must reach the cluster."""
        return not self.is_local and self.handle is not None and self.state in ("queued",
                                                                                 "running")

    @property
    def is_pending(self) -> bool:
        return self.state in PENDING

    @property
    def is_finished(self) -> bool:
        return self.state in FINISHED

    @property
    def error(self) -> dict | None:
        if self.error_kind is None and self.error_message is None:
            return None
        return {"kind": self.error_kind, "message": self.error_message,
                "hint": self.error_hint, "detail": self.error_detail}

    def rundir(self) -> RunDir:
        return RunDir(self.run_dir)

    def to_dict(self) -> dict:
        return asdict(self)


_COLUMNS = tuple(Job.__dataclass_fields__)
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM jobs"
_LIST_ORDER = ("ORDER BY CASE WHEN state = 'running' THEN 0 WHEN state IN ('queued', 'paused') "
               "THEN 1 ELSE 2 END, CASE WHEN state IN ('done', 'failed', 'cancelled') THEN 0 "
               "ELSE position END, id")


def _error_fields(error: Any) -> dict:
    """Normalise an error (None, EngineError, mapping) to the error_* columns; a surrogate
    escape in its text (a path's byte that is not UTF-8, as os.fsdecode gives it) spelled out
    as \\udcXX, since SQLite keeps only UTF-8 text."""
    columns = _error_columns(error)
    return {column: value.encode("utf-8", "backslashreplace").decode("utf-8")
            if isinstance(value, str) else value for column, value in columns.items()}


def _error_columns(error: Any) -> dict:
    if error is None:
        return {"error_kind": None, "error_message": None, "error_hint": None,
                "error_detail": None}
    if isinstance(error, EngineError):
        return {"error_kind": error.kind, "error_message": error.message,
                "error_hint": error.hint or None, "error_detail": None}
    if isinstance(error, BaseException):
        return {"error_kind": "bug", "error_message": f"{type(error).__name__}: {error}",
                "error_hint": None, "error_detail": None}
    if isinstance(error, Mapping):
        return {"error_kind": error.get("kind"), "error_message": error.get("message"),
                "error_hint": error.get("hint"), "error_detail": error.get("detail")}
    raise TypeError(f"error must be None, an exception or a mapping, not {type(error).__name__}")


class JobQueue:
    """The job queue at `path` (default: `default_queue_path()`). Holds no open connection:
    cheap to create, safe to use from several threads and processes, picklable."""

    def __init__(self, path: str | os.PathLike | None = None, *, busy_timeout_s: float = 30.0):
        self.path = Path(path).expanduser().absolute() if path is not None else \
            default_queue_path().absolute()
        self.busy_timeout_s = float(busy_timeout_s)
        self._local = threading.local()
        self._init_db()

    def __repr__(self) -> str:
        return f"JobQueue({str(self.path)!r})"

    def __reduce__(self):
        return (type(self), (str(self.path),), None)

    # ---------------------------------------------------------------- connections
    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
        conn.execute("PRAGMA synchronous = NORMAL")
        return conn

    def _translate(self, e: sqlite3.Error) -> QueueError:
        text = str(e).lower()
        if "locked" in text or "busy" in text:
            return QueueError(
                f"The job queue {self.path} stayed locked by another program for more than "
                f"{self.busy_timeout_s:g} s.",
                "Try again; if it persists, close other workbench windows or workers.")
        if "not a database" in text or "malformed" in text or "corrupt" in text:
            return QueueError(f"The job queue {self.path} is corrupt ({e}).",
                              "Move the file away; an empty queue is created in its place. "
                              "Run directories are not affected.")
        # A full disk shows as SQLITE_FULL, or as a "disk I/O error" when a write to the WAL
        # or its shared memory fails: then the free space tells.
        if "full" in text or ("disk i/o" in text and self._disk_full()):
            return QueueError(f"The disk holding the job queue {self.path} is full ({e}).",
                              "Free some space on that disk, then try again.")
        if "disk i/o" in text:
            return QueueError(f"The job queue {self.path} could not be read or written: the "
                              f"disk reported an I/O error ({e}).",
                              "Check the disk (a removed drive, a network share gone, a "
                              "failing disk), then try again.")
        if "readonly" in text or "unable to open" in text:
            return QueueError(f"The job queue {self.path} cannot be opened or written ({e}).",
                              "Check that its folder exists and is writable.")
        return QueueError(f"The job queue {self.path} failed: {e}.",
                          "Try again; report it if it persists.")

    def _disk_full(self) -> bool:
        """Is the disk under the queue (nearly) full?"""
        try:
            return shutil.disk_usage(self.path.parent).free < LOW_DISK_BYTES
        except OSError:
            return False

    def _connection(self) -> sqlite3.Connection:
        """This thread's connection (kept open: closing the last connection checkpoints the
        WAL with an fsync, which would make every call cost a disk flush)."""
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is None or local.pid != os.getpid():
            conn = self._connect()
            local.conn, local.pid = conn, os.getpid()
        return conn

    def close(self) -> None:
        """Close this thread's connection (other threads' close when the threads end)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None and self._local.pid == os.getpid():
            conn.close()

    @contextmanager
    def _tx(self, write: bool) -> Iterator[sqlite3.Connection]:
        try:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        except sqlite3.Error as e:
            self.close()
            raise self._translate(e) from e
        try:
            yield conn
        except BaseException as e:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                self.close()
            if isinstance(e, sqlite3.Error):
                self.close()
                raise self._translate(e) from e
            raise
        try:
            if write:
                conn.execute(_MARK_WRITE)
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            self.close()
            raise self._translate(e) from e

    def _check_database_files(self) -> None:
        """Refuse what SQLite would silently take for part of the queue (see the module's
        docstring): QueueError when the database or SQLite's files beside it are not regular
        files (a FIFO, a device), when the database has several hard links, or when its `-wal`
        file shows another database's queue_id (or none) where the database file alone shows
        its own. The log is read through a read-only connection, which never checkpoints it
        into the file; a database with no queue_id of its own yet (new, or not a queue) or a
        busy one is not judged. A log written before the write mark (an older workbench) is
        judged only by the transactions that touched the meta table."""
        real = os.path.realpath(self.path)
        for name in (self.path, *(f"{real}{end}" for end in ("-wal", "-shm", "-journal"))):
            try:   # a FIFO or a device there: SQLite's "disk I/O error", or a read that blocks
                check_regular(os.stat(name), os.fspath(name), "job queue file",
                              error=QueueError, own=True)
            except OSError:
                pass                      # none yet, or unreadable: the open says why
        try:
            links = os.stat(self.path).st_nlink
        except OSError:
            return                        # none yet, or unreadable: the open says why
        if links > 1:
            raise QueueError(
                f"The job queue {self.path} has {links} hard links (other names for the same "
                "file). SQLite keeps a write-ahead log per name, so two names can lose jobs, "
                "and each name would get a worker of its own.",
                "Keep one name: delete the other hard links, or replace them with symbolic "
                "links (those are safe).")
        wal = Path(f"{real}-wal")         # SQLite's: beside the real file
        try:
            if wal.stat().st_size <= WAL_HEADER_BYTES:
                return
        except OSError:
            return
        try:
            own = self._read_queue_id("immutable=1")     # the database file alone
        except sqlite3.Error:
            return
        if own is None:
            return
        try:
            seen = self._read_queue_id("mode=ro")        # with the log replayed over it
        except sqlite3.OperationalError as e:
            if any(w in str(e).lower() for w in ("locked", "busy", "unable to open")):
                return
            seen = None
        except sqlite3.Error:
            seen = None
        if seen != own:
            raise QueueError(
                f"{wal} does not belong to the job queue {self.path}: it is the write-ahead "
                "log of another database, and SQLite would replay its pages over the queue's "
                "(the queue's jobs would be gone).",
                f"Move {wal.name} away (and {wal.name[:-4]}-shm beside it, if there is one), "
                "then try again: the queue opens as its own file last saved it.")

    def _read_queue_id(self, mode: str) -> str | None:
        """meta's queue_id of the database opened with URI parameter `mode`; sqlite3.Error
        when it cannot be read."""
        conn = sqlite3.connect(f"{self.path.as_uri()}?{mode}", uri=True,
                               timeout=self.busy_timeout_s)
        try:
            row = conn.execute("SELECT value FROM meta WHERE key = 'queue_id'").fetchone()
        finally:
            conn.close()
        return row[0] if row else None

    def _init_db(self) -> None:
        ensure_state_dir(self.path.parent)
        self._check_database_files()
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                conn = self._connect()
                try:
                    if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                        conn.execute("PRAGMA journal_mode = WAL")
                    version = conn.execute("PRAGMA user_version").fetchone()[0]
                    if version < SCHEMA_VERSION:
                        conn.execute("BEGIN IMMEDIATE")
                        for stmt in _SCHEMA.split(";"):
                            if stmt.strip():
                                conn.execute(stmt)
                        have = {r[1] for r in conn.execute("PRAGMA table_info(jobs)")}
                        for name, declaration in _ADDED_COLUMNS:
                            if name not in have:
                                conn.execute(f"ALTER TABLE jobs ADD COLUMN {name} {declaration}")
                        conn.execute("INSERT OR IGNORE INTO meta VALUES ('queue_id', ?)",
                                     (uuid.uuid4().hex[:8],))
                        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                        conn.execute("COMMIT")
                    elif version > SCHEMA_VERSION:
                        raise QueueError(
                            f"The job queue {self.path} was written by a newer workbench "
                            f"(schema {version}, this one knows {SCHEMA_VERSION}).",
                            "Update the workbench, or use another queue with --queue.")
                except BaseException:
                    conn.close()
                    raise
                self._local.conn, self._local.pid = conn, os.getpid()  # reused by the calls
                return
            except sqlite3.OperationalError as e:
                if "locked" in str(e).lower() and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise self._translate(e) from e
            except sqlite3.Error as e:
                raise self._translate(e) from e

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _row_to_job(row: tuple) -> Job:
        handle = row[-1]
        return Job(*row[:-1], json.loads(handle) if handle else None)

    def _get(self, conn: sqlite3.Connection, job_id: int) -> Job:
        row = conn.execute(f"{_SELECT} WHERE id = ?", (int(job_id),)).fetchone()
        if row is None:
            raise NoSuchJobError(f"There is no job {job_id} in the queue {self.path}.",
                                 "List the jobs with: workbench queue list")
        return self._row_to_job(row)

    @staticmethod
    def _pending_ids(conn: sqlite3.Connection) -> list[int]:
        return [r[0] for r in conn.execute(
            "SELECT id FROM jobs WHERE state IN ('queued', 'paused') ORDER BY position, id")]

    @staticmethod
    def _renumber(conn: sqlite3.Connection, ids: list[int]) -> None:
        conn.executemany("UPDATE jobs SET position = ? WHERE id = ?",
                         [(i + 1, job_id) for i, job_id in enumerate(ids)])

    @staticmethod
    def _front_position(conn: sqlite3.Connection) -> int:
        row = conn.execute(
            "SELECT MIN(position) FROM jobs WHERE state IN ('queued', 'paused')").fetchone()
        return (row[0] if row[0] is not None else 1) - 1

    @staticmethod
    def _end_position(conn: sqlite3.Connection) -> int:
        row = conn.execute(
            "SELECT MAX(position) FROM jobs WHERE state IN ('queued', 'paused')").fetchone()
        return (row[0] if row[0] is not None else 0) + 1

    @staticmethod
    def _update(conn: sqlite3.Connection, job_id: int, **fields) -> None:
        cols = ", ".join(f"{k} = ?" for k in fields)
        conn.execute(f"UPDATE jobs SET {cols} WHERE id = ?", (*fields.values(), int(job_id)))

    def _active_job_for(self, conn: sqlite3.Connection, run_dir: str,
                        exclude: int | None = None) -> Job | None:
        row = conn.execute(
            f"{_SELECT} WHERE run_dir = ? AND state IN ('queued', 'running', 'paused') "
            "AND id != ? LIMIT 1", (run_dir, -1 if exclude is None else int(exclude))).fetchone()
        return self._row_to_job(row) if row else None

    # ---------------------------------------------------------------- reading
    def get(self, job_id: int) -> Job:
        with self._tx(write=False) as conn:
            return self._get(conn, job_id)

    def list(self, states: Iterable[str] | str | None = None) -> list[Job]:
        """Jobs, running first, then queued/paused in queue order, then finished ones."""
        if isinstance(states, str):
            states = (states,)
        states = tuple(states) if states is not None else None
        if states is not None:
            bad = [s for s in states if s not in STATES]
            if bad:
                raise QueueError(f"Unknown job state {bad[0]!r}.",
                                 f"States are: {', '.join(STATES)}.")
        with self._tx(write=False) as conn:
            if states is None:
                rows = conn.execute(f"{_SELECT} {_LIST_ORDER}").fetchall()
            elif not states:
                rows = []
            else:
                marks = ", ".join("?" * len(states))
                rows = conn.execute(f"{_SELECT} WHERE state IN ({marks}) {_LIST_ORDER}",
                                    states).fetchall()
        return [self._row_to_job(r) for r in rows]

    def find(self, run_dir: str | os.PathLike) -> list[Job]:
        """Jobs of one run directory, newest first."""
        key = run_key(run_dir)
        with self._tx(write=False) as conn:
            rows = conn.execute(f"{_SELECT} WHERE run_dir = ? ORDER BY id DESC",
                                (key,)).fetchall()
        return [self._row_to_job(r) for r in rows]

    # ---------------------------------------------------------------- user requests
    @property
    def queue_id(self) -> str:
        """This queue's own id (8 hex digits, made with the database): it names its jobs'
        submissions on clusters, which other queues (another user, a queue made anew) share."""
        with self._tx(write=False) as conn:
            return conn.execute("SELECT value FROM meta WHERE key = 'queue_id'").fetchone()[0]

    def clusters(self) -> ClusterStore:
        """The clusters this queue's jobs may run on: clusters.json beside the database."""
        return ClusterStore(self.path.parent / "clusters.json")

    def add(self, run_dir: str | os.PathLike, priority: int = 0, *, check: bool = True,
            executor: str = LOCAL) -> int:
        """Queue a run directory; returns the job id.

        The job goes after every queued/paused job of the same or higher priority (ahead of
        lower ones). With `check`, the run directory must hold a readable config.json
        (ConfigError otherwise). A run directory can have only one active job, whatever the
        spelling of its path (`run_key`), and none while another process writes it (holds its
        lock: RunBusyError naming the holder). `executor`:
        "local", or the name of a cluster in `clusters()` (ClusterError when unknown), which
        must see the run directory through its path map (ConfigError otherwise; a loopback
        cluster sees this machine's paths).
        """
        key = run_key(run_dir)
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:  # a byte os.fsdecode escaped: SQLite's text cannot hold it
            raise ConfigError(f"The run folder's path {key!r} has a byte that is not UTF-8 (the "
                              "\\udc.. above); the queue cannot keep such a path.",
                              "Rename the folder (or the one above it that has the byte), or "
                              "run it in the foreground (without --queue or --on).") from None
        run = RunDir(key)
        if check:
            workers = run.config().get("workers", 1)
            if executor == LOCAL and isinstance(workers, int) and workers > 1:
                raise ConfigError(f"{key} trains data-parallel ({workers} workers) on a Ray "
                                  "cluster; this machine's queue trains a run in one process.",
                                  "Queue it on a cluster (--on CLUSTER, see `workbench cluster "
                                  "list`), or set workers to 1 in its config.json.")
        holder = lock_holder(run)
        if holder is not None:
            raise RunBusyError(f"{key} is being written by {describe(holder)}; a run has one "
                               "writer at a time.",
                               "Queue it when that process has ended (or stop it first).")
        if executor != LOCAL:
            self.clusters().get(executor).cluster_path(run.path)
        with self._tx(write=True) as conn:
            other = self._active_job_for(conn, key)
            if other is not None:
                raise JobStateError(f"{key} is already in the queue as job {other.id} "
                                    f"({other.state}).",
                                    "Cancel that job first, or wait until it finishes.")
            pending = conn.execute(
                "SELECT id, priority FROM jobs WHERE state IN ('queued', 'paused') "
                "ORDER BY position, id").fetchall()
            index = next((i for i, (_, p) in enumerate(pending) if p < priority), len(pending))
            position = self._end_position(conn) if index == len(pending) else 0
            cur = conn.execute(
                "INSERT INTO jobs (run_dir, state, priority, position, created_at, executor) "
                "VALUES (?, 'queued', ?, ?, ?, ?)",
                (key, int(priority), position, time.time(), str(executor)))
            job_id = cur.lastrowid
            if index < len(pending):
                ids = [i for i, _ in pending]
                ids.insert(index, job_id)
                self._renumber(conn, ids)
        return int(job_id)

    def cancel(self, job_id: int) -> Job:
        """Queued or paused: cancelled at once. Running (or `in_flight`): the worker stops it
        after the current step (requested_action = cancel). Returns the job after the change."""
        with self._tx(write=True) as conn:
            job = self._get(conn, job_id)
            if job.state in PENDING and not job.in_flight:
                self._update(conn, job.id, state="cancelled", requested_action="none",
                             finished_at=time.time())
            elif job.state == "running" or job.in_flight:
                if job.requested_action == "cancel":
                    raise JobStateError(f"Job {job.id}: cancelling it was already requested.",
                                        "The worker stops it after the current step.")
                self._update(conn, job.id, requested_action="cancel")
            else:
                raise JobStateError(f"Job {job.id} has already finished ({job.state}); "
                                    "there is nothing to cancel.", _finished_hint(job))
            return self._get(conn, job.id)

    def pause(self, job_id: int) -> Job:
        """Queued: held (the worker skips it) until resumed. Running: the worker saves a
        checkpoint and stops after the current step; the job becomes paused (so does an
        `in_flight` job, when a worker follows it again)."""
        with self._tx(write=True) as conn:
            job = self._get(conn, job_id)
            if job.state == "queued" and not job.in_flight:
                self._update(conn, job.id, state="paused")
            elif job.state == "running" or job.in_flight:
                if job.requested_action == "pause":
                    raise JobStateError(f"Job {job.id}: pausing it was already requested.",
                                        "The worker pauses it after the current step.")
                if job.requested_action == "cancel":
                    raise JobStateError(f"Job {job.id} is being cancelled; it cannot be paused.",
                                        "Wait until it is cancelled, then retry it.")
                self._update(conn, job.id, requested_action="pause")
            elif job.state == "paused":
                raise JobStateError(f"Job {job.id} is already paused.",
                                    f"Resume it with: workbench queue resume {job.id}")
            else:
                raise JobStateError(f"Job {job.id} has already finished ({job.state}); "
                                    "there is nothing to pause.", _finished_hint(job))
            return self._get(conn, job.id)

    def resume(self, job_id: int) -> Job:
        """Paused: queued again, in its place (it continues from its last checkpoint).
        Running with a pause requested: the request is withdrawn."""
        with self._tx(write=True) as conn:
            job = self._get(conn, job_id)
            if job.state == "paused":
                self._update(conn, job.id, state="queued", requested_action="none")
            elif job.state == "running" and job.requested_action == "pause":
                self._update(conn, job.id, requested_action="none")
            elif job.state in ("running", "queued"):
                raise JobStateError(f"Job {job.id} is {job.state}, not paused; "
                                    "there is nothing to resume.")
            else:
                raise JobStateError(f"Job {job.id} has finished ({job.state}); "
                                    "it cannot be resumed.", _finished_hint(job))
            return self._get(conn, job.id)

    def retry(self, job_id: int) -> Job:
        """Failed or cancelled: queued again at the end (the run continues from its last
        checkpoint); attempts and the error are cleared."""
        with self._tx(write=True) as conn:
            job = self._get(conn, job_id)
            if job.state == "done":
                raise JobStateError(
                    f"Job {job.id} finished successfully; there is nothing to retry.",
                    f"To train longer: workbench resume {job.run_dir} --extend-epochs N")
            if job.state not in ("failed", "cancelled"):
                raise JobStateError(f"Job {job.id} is {job.state}; only failed or cancelled "
                                    "jobs can be retried.")
            other = self._active_job_for(conn, job.run_dir, exclude=job.id)
            if other is not None:
                raise JobStateError(f"{job.run_dir} is already in the queue as job {other.id} "
                                    f"({other.state}).", "Cancel that job first.")
            self._update(conn, job.id, state="queued", requested_action="none",
                         position=self._end_position(conn), attempts=0, worker_id=None,
                         worker_host=None, worker_pid=None, heartbeat_at=None,
                         started_at=None, finished_at=None, handle=None,
                         **_error_fields(None))
            return self._get(conn, job.id)

    def continue_run(self, run_dir: str | os.PathLike, job: Job | None) -> str:
        """Go on with the run `run_dir` from its last checkpoint (from the start without one),
        whose latest job is `job` (None: never queued, a run of the command line): resume a
        paused job (or withdraw a pause request), queue a failed or cancelled job again
        (`retry`), else queue the run as a new job. What the window's Continue does, on the
        Runs screen and in the Monitor alike (`can_continue` says when); returns what it did,
        in a sentence."""
        if job is not None and (job.state == "paused" or job.requested_action == "pause"):
            self.resume(job.id)
            return f"Resumed job {job.id}"
        if job is not None and job.state in ("failed", "cancelled"):
            self.retry(job.id)
            return f"Job {job.id} queued again"
        return f"Queued {Path(run_dir).name} as job {self.add(run_dir)}"

    def reorder(self, job_id: int, position: int) -> Job:
        """Move a queued or paused job to 1-based `position` among the queued and paused
        jobs (clamped to the first and last place)."""
        return self._reorder(job_id, lambda current: int(position))

    def move(self, job_id: int, offset: int) -> Job:
        """Move a queued or paused job `offset` places (negative: towards the front)."""
        return self._reorder(job_id, lambda current: current + int(offset))

    def _reorder(self, job_id: int, target) -> Job:
        with self._tx(write=True) as conn:
            job = self._get(conn, job_id)
            if job.state not in PENDING:
                raise JobStateError(f"Job {job.id} is {job.state}; only queued or paused jobs "
                                    "can be reordered.")
            ids = self._pending_ids(conn)
            current = ids.index(job.id) + 1
            ids.remove(job.id)
            index = min(max(target(current), 1), len(ids) + 1) - 1
            ids.insert(index, job.id)
            self._renumber(conn, ids)
            return self._get(conn, job.id)

    def move_up(self, job_id: int) -> Job:
        return self.move(job_id, -1)

    def move_down(self, job_id: int) -> Job:
        return self.move(job_id, 1)

    # ---------------------------------------------------------------- the worker's side
    def claim_next(self, worker_id: str, skip_executors: Iterable[str] = ()) -> Job | None:
        """Atomically take the first queued job: running, owned by `worker_id` (and this
        process's host and pid, for `recover_stale`). None when nothing is queued. Jobs of
        `skip_executors` are left queued (clusters the worker waits for: it backs off one
        that does not answer)."""
        now = time.time()
        skip = list(skip_executors)
        with self._tx(write=True) as conn:
            row = conn.execute(f"{_SELECT} WHERE state = 'queued' AND executor NOT IN "
                               f"({', '.join('?' * len(skip))}) ORDER BY position, id LIMIT 1",
                               skip).fetchone()
            if row is None:
                return None
            job = self._row_to_job(row)
            if job.is_local:
                fields = {"handle": json.dumps(local_handle(os.getpid())),
                          "requested_action": "none"}
            elif job.handle is None:
                fields = {"requested_action": "none"}
            else:  # a cluster job whose worker died: the new worker reattaches to its
                fields = {}  # submission and honours the request left on it, if any
            self._update(conn, job.id, state="running", worker_id=str(worker_id),
                         worker_host=this_host(), worker_pid=os.getpid(), heartbeat_at=now,
                         started_at=now, finished_at=None, **fields, **_error_fields(None))
            return self._get(conn, job.id)

    def record_attempt(self, job_id: int, worker_id: str, attempt: int,
                       handle: dict | None) -> Job:
        """The worker starts attempt `attempt` of its job (submitted as `handle`), or forgets
        the handle (None) of an attempt that is over. JobLostError if it does not own it."""
        with self._tx(write=True) as conn:
            job = self._get(conn, job_id)
            if job.state != "running" or job.worker_id != worker_id:
                raise JobLostError(f"Worker {worker_id} no longer owns job {job.id} "
                                   f"(it is {job.state}).")
            self._update(conn, job.id, attempt=int(attempt),
                         handle=None if handle is None else json.dumps(handle))
            return self._get(conn, job.id)

    def heartbeat(self, job_id: int, worker_id: str, *, touch: bool = True) -> str | None:
        """Mark the job alive (unless not `touch`) and return the requested action:
        None, "cancel" or "pause". JobLostError if `worker_id` no longer owns the job."""
        with self._tx(write=touch) as conn:
            row = conn.execute("SELECT state, worker_id, requested_action FROM jobs "
                               "WHERE id = ?", (int(job_id),)).fetchone()
            if row is None or row[0] != "running" or row[1] != worker_id:
                state = "deleted" if row is None else row[0]
                raise JobLostError(f"Worker {worker_id} no longer owns job {job_id} "
                                   f"(it is {state}).",
                                   "Another worker took it over, or it was recovered as stale.")
            if touch:
                self._update(conn, job_id, heartbeat_at=time.time())
            return None if row[2] == "none" else row[2]

    def finish(self, job_id: int, worker_id: str, state: str, error: Any = None) -> Job:
        """The worker ends its job: done, failed (with `error`: an EngineError or a mapping
        with kind, message, hint, detail), cancelled, paused, or queued (the worker is
        stopping: the job goes back to the front of the queue)."""
        if state not in FINISH_STATES:
            raise ValueError(f"finish state must be one of {FINISH_STATES}, not {state!r}")
        now = time.time()
        with self._tx(write=True) as conn:
            job = self._get(conn, job_id)
            if job.state != "running" or job.worker_id != worker_id:
                raise JobLostError(f"Worker {worker_id} cannot finish job {job.id}: it is "
                                   f"{job.state}" + (f" and owned by {job.worker_id}."
                                                     if job.worker_id != worker_id else "."))
            fields: dict = {"state": state, "requested_action": "none", "heartbeat_at": now,
                            **_error_fields(error)}
            if state in FINISHED:
                fields["finished_at"] = now
            if state == "queued":
                fields["position"] = self._front_position(conn)
            if state != "queued" or job.is_local:  # a cluster job put back keeps its handle:
                fields["handle"] = None            # the next worker reattaches to it
            self._update(conn, job.id, **fields)
            return self._get(conn, job.id)

    def recover_stale(self, timeout_s: float = DEFAULT_STALE_S,
                      max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> list[Job]:
        """Find running jobs whose worker died: heartbeat older than `timeout_s`, or (same
        host) worker pid gone. Each is queued again at the front with attempts+1 (the runner
        resumes from the last checkpoint), or marked failed ("worker died") once its worker
        has died `max_attempts` times. Returns the jobs as changed."""
        now = time.time()
        host = this_host()
        changed: list[Job] = []
        with self._tx(write=True) as conn:
            running = [self._row_to_job(r) for r in
                       conn.execute(f"{_SELECT} WHERE state = 'running' ORDER BY position, id")]
            for job in running:
                old = job.heartbeat_at is None or now - job.heartbeat_at > timeout_s
                dead = job.worker_host == host and not _worker_alive(job)
                if not (old or dead):
                    continue
                if not job.is_local and job.handle is not None:
                    # its cluster may still run it: the next worker reattaches (and honours
                    # the request, if any); not an attempt lost
                    self._update(conn, job.id, state="queued",
                                 position=self._front_position(conn))
                    changed.append(self._get(conn, job.id))
                    continue
                attempts = job.attempts + 1
                why = (f"its worker (pid {job.worker_pid}) is gone" if dead else
                       f"its worker sent no heartbeat for {now - (job.heartbeat_at or now):.0f} s")
                if attempts >= max_attempts:
                    self._update(conn, job.id, state="failed", attempts=attempts,
                                 requested_action="none", finished_at=now, handle=None,
                                 error_kind="worker_died",
                                 error_message=(f"The worker running job {job.id} died "
                                                f"{attempts} time(s) ({why})."),
                                 error_hint=("Check the worker log and the run's log.txt "
                                             "(out of memory? killed?); retry the job to "
                                             "resume from its last checkpoint."),
                                 error_detail=None)
                elif job.requested_action == "cancel":
                    self._update(conn, job.id, state="cancelled", attempts=attempts,
                                 requested_action="none", finished_at=now, handle=None)
                else:
                    state = "paused" if job.requested_action == "pause" else "queued"
                    self._update(conn, job.id, state=state, attempts=attempts,
                                 requested_action="none", handle=None,
                                 position=self._front_position(conn))
                changed.append(self._get(conn, job.id))
        for job in changed:  # best effort: tell the run directory too
            try:
                run = job.rundir()
                if run.path.is_dir():
                    run.write_status(state=job.state, job_id=job.id, attempts=job.attempts,
                                     error=job.error)
                    run.log(f"job {job.id}: worker died; now {job.state} "
                            f"(attempt {job.attempts})")
            except EngineError:
                pass
        return changed


def run_key(run_dir: str | os.PathLike) -> str:
    """A run's key in the queue: its resolved absolute path (through `..` and links), so that
    every spelling of a run's path names the same job."""
    return str(Path(run_dir).expanduser().resolve())


def _worker_alive(job: Job) -> bool:
    """Is the process that ran `job` on this host still alive (the same process, not a new
    one that reuses its pid)?"""
    if job.is_local and job.handle and job.handle.get("pid") == job.worker_pid:
        return local_alive(job.handle)
    return pid_alive(job.worker_pid)


def _finished_hint(job: Job) -> str:
    if job.state in ("failed", "cancelled"):
        return f"Run it again with: workbench queue retry {job.id}"
    return f"To train longer: workbench resume {job.run_dir} --extend-epochs N"


def can_continue(job: Job | None, state: str, has_checkpoint: bool,
                 stalled: bool = False) -> bool:
    """Whether the window's Continue (`JobQueue.continue_run`) applies to a run whose latest
    job is `job` and whose state is `state` (the job's, else status.json's): a paused job (or
    one asked to pause), a failed or cancelled one; a run outside the queue that failed or was
    cancelled, or that stopped (paused, interrupted, or `stalled`: running with no process
    advancing it) and kept a checkpoint."""
    if job is not None:
        return (job.state == "paused" or job.requested_action == "pause"
                or job.state in ("failed", "cancelled"))
    return (state in ("failed", "cancelled") or
            (has_checkpoint and (state in ("paused", "interrupted") or stalled)))
