"""This machine as an executor: the queue's worker runs the job in its own process (today's
detached worker, `app.engine.runs.worker`). The handle of a local attempt is that process's
pid and start time (`local_handle`): a pid the system reused for another process is not taken
for the worker. Cancel and pause go through the queue (the worker honours them between steps);
`cancel(handle)` here stops the worker process itself (SIGTERM: it checkpoints its job and puts
it back at the front of the queue).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from app.engine.errors import EngineError
from app.engine.runs.executors.base import Poll
from app.engine.runtime.files import read_range
from app.engine.runtime.processes import pid_alive, process_started

LOG_TAIL_BYTES = 64 << 10


def local_handle(pid: int) -> dict:
    """The handle of a job run by process `pid` on this machine."""
    return {"pid": int(pid), "start_time": process_started(pid)}


def local_alive(handle: dict) -> bool:
    """Is the process of `handle` alive, the same one (not a new process reusing its pid)?"""
    pid = handle.get("pid")
    if not pid_alive(pid):
        return False
    started = handle.get("start_time")
    return started is None or process_started(pid) in (None, started)


def worker_log_path(queue_path: str | os.PathLike) -> Path:
    """The log of the queue's detached worker: beside the database."""
    return Path(str(Path(queue_path).absolute()) + ".worker.log")


class LocalExecutor:
    name = "local"

    def __init__(self, queue_path: str | os.PathLike | None = None):
        self.queue_path = queue_path

    def check(self) -> str:
        return f"this computer, {os.cpu_count() or 1} CPUs"

    def submit(self, job, run_dir) -> dict:
        """The worker runs the job in this process."""
        return local_handle(os.getpid())

    def poll(self, handle: dict) -> Poll:
        if local_alive(handle):
            return Poll("running", f"worker process {handle['pid']}")
        return Poll("lost", f"worker process {handle.get('pid')} is gone")

    def cancel(self, handle: dict) -> None:
        if local_alive(handle):
            os.kill(int(handle["pid"]), signal.SIGTERM)

    def logs(self, handle: dict) -> str:
        if self.queue_path is None:
            return ""
        path = worker_log_path(self.queue_path)
        try:
            start = max(0, os.path.getsize(path) - LOG_TAIL_BYTES)
            return read_range(path, "worker log", start, LOG_TAIL_BYTES).decode("utf-8", "replace")
        except (OSError, EngineError):   # no log yet, or not a regular file (a planted FIFO)
            return ""
